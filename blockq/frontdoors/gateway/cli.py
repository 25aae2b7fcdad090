"""``blockq gateway`` / ``python -m blockq.frontdoors.gateway``: run the OpenAI-compatible HTTP gateway."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from blockq.config import ConfigError
from blockq.runtime.service_runner import add_common_arguments, run_service, settings_from_args

if TYPE_CHECKING:
    from blockq.frontdoors.gateway.api_keys import KeyPolicy


def _api_key(text: str) -> tuple[str, str, KeyPolicy | None]:
    from blockq.frontdoors.gateway.api_keys import parse_api_key_item

    if not text.partition("=")[0].strip():
        raise argparse.ArgumentTypeError("expected KEY, KEY=TENANT or KEY=TENANT;OPTION=VALUE...")
    try:
        return parse_api_key_item(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--host", default=None, help="listen address (default 127.0.0.1); env BLOCKQ_GATEWAY_HOST")
    parser.add_argument("--port", type=int, default=None, help="listen port (default 8000); env BLOCKQ_GATEWAY_PORT")
    parser.add_argument("--api-key", dest="api_keys", action="append", type=_api_key, default=None,
                        metavar="KEY[=TENANT][;OPTION=VALUE]",
                        help="accept this bearer token, for TENANT; options max_in_flight, max_requests_in_flight, priority, "
                             "may_set_priority, may_set_best_effort (repeatable; prefer the env "
                             "BLOCKQ_GATEWAY_API_KEYS or --api-keys-file: argv is visible to other users)")
    parser.add_argument("--api-keys-file", type=Path, default=None,
                        help="file of KEY=TENANT[;OPTION=VALUE]... lines")
    parser.add_argument("--key-max-in-flight", type=int, default=None,
                        help="concurrent requests per key unless its max_in_flight says (default: half of "
                             "--max-in-flight with two keys or more)")
    parser.add_argument("--key-max-requests-in-flight", type=int, default=None,
                        help="requests (prompts x n) one key's open calls may carry unless its "
                             "max_requests_in_flight says (default: half of BLOCKQ_MAX_BACKLOG with two keys "
                             "or more); env BLOCKQ_GATEWAY_KEY_MAX_REQUESTS_IN_FLIGHT")
    parser.add_argument("--served-model-name", dest="model_names", action="append", default=None,
                        help="model name clients may ask for (repeatable; default 'blockq')")
    parser.add_argument("--chat-template", default=None,
                        help="'chatml' (default), 'plain', or a Jinja2 template file")
    parser.add_argument("--request-timeout-s", type=float, default=None, help="longest a request may take, seconds")
    parser.add_argument("--max-body-bytes", type=int, default=None, help="request body limit, bytes")
    parser.add_argument("--max-json-depth", type=int, default=None, help="JSON nesting limit")
    parser.add_argument("--max-in-flight", type=int, default=None, help="concurrent requests before 429")
    parser.add_argument("--read-timeout-s", type=float, default=None,
                        help="longest a request body may take to arrive, seconds (then 408; default 30)")
    parser.add_argument("--write-timeout-s", type=float, default=None,
                        help="longest a stream write may wait for the client to read, seconds (then the "
                             "connection is dropped; default 5)")
    parser.add_argument("--allow-unauthenticated", action="store_true", default=None,
                        help="serve without API keys on a non-loopback host (refused otherwise)")


def run(args: argparse.Namespace) -> int:
    from blockq.frontdoors.gateway.config import (
        gateway_config_from_env,
        merge_api_keys,
        read_api_keys_file,
    )
    from blockq.frontdoors.gateway.server import serve

    settings = settings_from_args(args)
    sources = [read_api_keys_file(args.api_keys_file)] if args.api_keys_file is not None else []
    for key, tenant, policy in args.api_keys or ():
        sources.append(({key: tenant}, {key: policy} if policy is not None else {}))
    keys, policies = merge_api_keys(sources)
    config = gateway_config_from_env(
        host=args.host, port=args.port, api_key_to_tenant=keys or None, api_key_to_policy=policies or None,
        model_names=tuple(args.model_names) if args.model_names else None, chat_template=args.chat_template,
        request_timeout_s=args.request_timeout_s, max_body_bytes=args.max_body_bytes,
        max_json_depth=args.max_json_depth, max_in_flight=args.max_in_flight,
        read_timeout_s=args.read_timeout_s, write_timeout_s=args.write_timeout_s,
        key_max_in_flight=args.key_max_in_flight, key_max_requests_in_flight=args.key_max_requests_in_flight,
        allow_unauthenticated=args.allow_unauthenticated)
    return run_service(settings, "gateway", lambda stop: serve(config, settings, stop))


def main(argv: list[str] | None = None) -> int:
    import sys

    parser = argparse.ArgumentParser(prog="python -m blockq.frontdoors.gateway", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ConfigError as exc:
        sys.stderr.write(f"blockq gateway: configuration error: {exc}\n")
        return 2
