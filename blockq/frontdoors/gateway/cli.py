"""``blockq gateway`` / ``python -m blockq.frontdoors.gateway``: run the OpenAI-compatible HTTP gateway."""

from __future__ import annotations

import argparse
from pathlib import Path

from blockq.runtime.service_runner import add_common_arguments, run_service, settings_from_args


def _api_key(text: str) -> tuple[str, str]:
    key, _, tenant = text.partition("=")
    if not key:
        raise argparse.ArgumentTypeError("expected KEY or KEY=TENANT")
    return key, tenant or "default"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--host", default=None, help="listen address (default 127.0.0.1); env BLOCKQ_GATEWAY_HOST")
    parser.add_argument("--port", type=int, default=None, help="listen port (default 8000); env BLOCKQ_GATEWAY_PORT")
    parser.add_argument("--api-key", dest="api_keys", action="append", type=_api_key, default=None,
                        metavar="KEY[=TENANT]",
                        help="accept this bearer token, for TENANT (repeatable; prefer the env "
                             "BLOCKQ_GATEWAY_API_KEYS or --api-keys-file: argv is visible to other users)")
    parser.add_argument("--api-keys-file", type=Path, default=None, help="file of KEY=TENANT lines")
    parser.add_argument("--served-model-name", dest="model_names", action="append", default=None,
                        help="model name clients may ask for (repeatable; default 'blockq')")
    parser.add_argument("--chat-template", default=None,
                        help="'chatml' (default), 'plain', or a Jinja2 template file")
    parser.add_argument("--request-timeout-s", type=float, default=None, help="longest a request may take, seconds")
    parser.add_argument("--max-body-bytes", type=int, default=None, help="request body limit, bytes")
    parser.add_argument("--max-json-depth", type=int, default=None, help="JSON nesting limit")
    parser.add_argument("--max-in-flight", type=int, default=None, help="concurrent requests before 429")
    parser.add_argument("--allow-unauthenticated", action="store_true", default=None,
                        help="serve without API keys on a non-loopback host (refused otherwise)")


def run(args: argparse.Namespace) -> int:
    from blockq.frontdoors.gateway.config import gateway_config_from_env, read_api_keys_file
    from blockq.frontdoors.gateway.server import serve

    settings = settings_from_args(args)
    keys: dict[str, str] = {}
    if args.api_keys_file is not None:
        keys.update(read_api_keys_file(args.api_keys_file))
    keys.update(dict(args.api_keys or ()))
    config = gateway_config_from_env(
        host=args.host, port=args.port, api_key_to_tenant=keys or None,
        model_names=tuple(args.model_names) if args.model_names else None, chat_template=args.chat_template,
        request_timeout_s=args.request_timeout_s, max_body_bytes=args.max_body_bytes,
        max_json_depth=args.max_json_depth, max_in_flight=args.max_in_flight,
        allow_unauthenticated=args.allow_unauthenticated)
    return run_service(settings, "gateway", lambda stop: serve(config, settings, stop))


def main(argv: list[str] | None = None) -> int:
    import sys

    from blockq.config import ConfigError

    parser = argparse.ArgumentParser(prog="python -m blockq.frontdoors.gateway", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ConfigError as exc:
        sys.stderr.write(f"blockq gateway: configuration error: {exc}\n")
        return 2
