"""``blockq predictor serve`` (``python -m predictor_service``): the stream stage
(:mod:`.stage`) together with the feedback consumer (:mod:`.feedback`), the optional online
refit (:mod:`.online`) and the HTTP API (:mod:`.http_api`) in one event loop."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Mapping

import redis.asyncio as aioredis
import structlog

from blockq.config import ConfigError, Settings
from blockq.runtime.metrics_server import (
    add_metrics_arguments,
    metrics_endpoint_from_args,
    serving_metrics,
)
from blockq.runtime.service_runner import add_common_arguments, run_service, settings_from_args
from blockq.text.model_tokenizer import TokenizerUnavailable
from blockq.text.tokenizer import TokenCounter, get_token_counter
from blockq.wire.streams import connect_async, default_consumer_name
from predictor_service.http_api import TOKEN_ENV, HttpAccessOptions
from predictor_service.manifest import read_manifest
from predictor_service.models import (
    LengthPredictor,
    load_predictor,
)
from predictor_service.stage import PredictorStage, StageOptions

log = structlog.get_logger(__name__)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--backend", default="heuristic",
                        help="heuristic | fast | transformer | ensemble | oracle | trace (oracle/trace: benchmarks only)")
    parser.add_argument("--model-dir", default=None, help="trained model directory (fast, transformer, ensemble)")
    parser.add_argument("--tokenizer", default=None, help="token counter name (env BLOCKQ_TOKENIZER)")
    parser.add_argument("--batch-size", type=int, default=64, help="max requests per read and model call")
    parser.add_argument("--consumer-name", default=None,
                        help="consumer name in the predict and feedback groups; keep it across restarts, make "
                             "it unique per replica (env BLOCKQ_CONSUMER_NAME; default predict-<hostname>)")
    parser.add_argument("--http-port", type=int, default=None, help="also serve the HTTP API on this port")
    parser.add_argument("--http-host", default="127.0.0.1",
                        help=f"address the HTTP API binds; one other than loopback needs a bearer token "
                             f"(env {TOKEN_ENV}) or --http-allow-unauthenticated")
    parser.add_argument("--http-max-concurrent", type=int, default=HttpAccessOptions.max_concurrent_requests,
                        help="model requests (/predict, /refine) served at once; more get 503 with "
                             "Retry-After (count)")
    parser.add_argument("--http-allow-unauthenticated", action="store_true",
                        help=f"serve the HTTP API on a non-loopback --http-host without {TOKEN_ENV}")
    parser.add_argument("--refine-model", default=None,
                        help="a refinement model directory (blockq predictor refine-train): also serve POST /refine "
                             "(remaining lengths of running requests, for workers) on the HTTP port")
    add_metrics_arguments(parser)  # the same registry as the HTTP API's /metrics
    quality = parser.add_argument_group("online quality (from the done stream)")
    quality.add_argument("--feedback-window", type=int, default=1000,
                         help="done records in the rolling MAE/Acc-50/Acc-100 window (count)")
    quality.add_argument("--feedback-all-versions", action="store_true",
                         help="count done records of every predictor version, not only this process's")
    refit = parser.add_argument_group("online refit (fast backend)")
    refit.add_argument("--online-refit", action="store_true",
                       help="refit the fast model from done-stream feedback in the background")
    refit.add_argument("--refit-every-samples", type=int, default=2000,
                       help="refit after this many new feedback samples (count)")
    refit.add_argument("--refit-interval-s", type=float, default=600.0,
                       help="or after this many seconds, once --refit-min-samples arrived")
    refit.add_argument("--refit-min-samples", type=int, default=200,
                       help="new feedback samples needed before any refit (count)")
    refit.add_argument("--refit-save-dir", default=None,
                       help="also write each refitted model to DIR/<version>")


_SETTING_OF_ACCESS_FIELD = {"bearer_token": TOKEN_ENV, "max_concurrent_requests": "--http-max-concurrent"}


def http_access_from_args(args: argparse.Namespace,
                          env: Mapping[str, str] | None = None) -> HttpAccessOptions | None:
    """The HTTP API's token (env ``BLOCKQ_PREDICTOR_HTTP_TOKEN``, never a flag: argv is
    public on the host) and concurrency cap; None without ``--http-port``. ``ConfigError``
    names the setting, also for a non-loopback host without a token (as the gateway)."""
    if args.http_port is None:
        return None
    from blockq.frontdoors.gateway.config import is_loopback_host

    env = os.environ if env is None else env
    token = env.get(TOKEN_ENV) or None
    try:
        access = HttpAccessOptions(bearer_token=token, max_concurrent_requests=args.http_max_concurrent)
    except ValueError as exc:  # "field: message", named here as the operator sets it
        field, _, message = str(exc).partition(": ")
        raise ConfigError(f"{_SETTING_OF_ACCESS_FIELD.get(field, field)}: {message}") from None
    if token is None and not args.http_allow_unauthenticated and not is_loopback_host(args.http_host):
        raise ConfigError(f"--http-host: {args.http_host} is reachable from other machines: set {TOKEN_ENV} "
                          "(a bearer token), or pass --http-allow-unauthenticated")
    return access


def run_serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if args.online_refit and args.backend != "fast":
        raise ConfigError(f"--online-refit: needs --backend fast (got {args.backend!r})")
    if args.refine_model and args.http_port is None:
        raise ConfigError("--refine-model: needs --http-port (workers ask POST /refine over HTTP)")
    metrics_endpoint_from_args(args)  # validated before the model loads
    http_access_from_args(args)
    predictor = load_predictor(args.backend, args.model_dir)
    token_counter = get_token_counter(args.tokenizer)
    # The served model's tokenizer loads now, before any request waits: lazily, the first
    # batch waited seconds for `transformers` to import, and was refused as past its TTFT SLO.
    if settings.prefix_tokenizer:
        try:
            settings.prefix_scheme.encode(["warm-up"])
        except TokenizerUnavailable as exc:
            raise ConfigError(f"prefix_tokenizer: {exc}") from None

    async def main(stop: asyncio.Event) -> None:
        client = connect_async(settings.redis_url)
        try:
            await serve_predictor(stop, client, settings, predictor, token_counter, args)
        finally:
            await client.aclose()

    return run_service(settings, "predictor", main)


async def serve_predictor(stop: asyncio.Event, client: aioredis.Redis, settings: Settings,
                          predictor: LengthPredictor, token_counter: TokenCounter,
                          args: argparse.Namespace) -> None:
    """Run the stage, the feedback consumer, the online refit (``--online-refit``), the
    HTTP API (``--http-port``) and the metrics server (``--metrics-port``; the HTTP API
    serves the same metrics at its own ``/metrics``) in this event loop until ``stop``
    is set."""
    from predictor_service.feedback import FeedbackConsumer, FeedbackOptions, build_quality_monitor
    from predictor_service.metrics import predictor_registry
    from predictor_service.online import OnlineRefitOptions, OnlineRefitter

    consumer_name = getattr(args, "consumer_name", None)
    stage = PredictorStage(client, settings, predictor, token_counter,
                           consumer_name=consumer_name or default_consumer_name("predict"),
                           options=StageOptions(batch_size=args.batch_size))
    refitter = None
    if args.online_refit:
        refit_options = OnlineRefitOptions(
            refit_every_samples=args.refit_every_samples, refit_interval_s=args.refit_interval_s,
            min_samples=args.refit_min_samples, save_dir=args.refit_save_dir)
        refitter = OnlineRefitter(stage, refit_options, base_manifest=read_manifest(args.model_dir))
        stage.on_annotated = refitter.remember
    feedback_options = FeedbackOptions(window_size=args.feedback_window,
                                       count_all_versions=args.feedback_all_versions)
    feedback = FeedbackConsumer(
        client, settings, build_quality_monitor(args.model_dir, predictor.version, feedback_options),
        served_versions=stage.served_versions, consumer_name=consumer_name or default_consumer_name("feedback"),
        options=feedback_options, on_counted=refitter.observe_done if refitter else None)
    runner = None
    if args.http_port is not None:
        from predictor_service.http_api import (
            API_APP_KEY,
            HttpApiOptions,
            create_app,
            start_http_api,
        )

        app = create_app(stage, token_counter, options=HttpApiOptions.from_limits(settings.limits),
                         stage=stage, feedback=feedback, refitter=refitter, access=http_access_from_args(args))
        registry = app[API_APP_KEY].registry
        if args.refine_model:
            from predictor_service.models.refine import RefineModel
            from predictor_service.refine_api import add_refine_route

            add_refine_route(app, RefineModel.load(args.refine_model))
        runner = await start_http_api(app, args.http_host, args.http_port)
    else:
        registry = predictor_registry(stage, stage=stage, feedback=feedback, refitter=refitter)
    try:
        async with (serving_metrics(registry, metrics_endpoint_from_args(args), "predictor"),
                    asyncio.TaskGroup() as group):
            group.create_task(stage.run(stop))
            group.create_task(feedback.run(stop))
            if refitter is not None:
                group.create_task(refitter.run(stop))
    finally:
        if runner is not None:
            await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m predictor_service", description="the predictor stage")
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))
