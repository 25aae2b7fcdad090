"""The predictor's stream stage: ``req`` → annotate with token counts and a predicted
output-length distribution → ``ready``.

Reads in batches through the ``predict`` consumer group so that N replicas share the
work; one model call per batch. Each entry is ACKed in the same pipeline that writes
its annotated copy to ``ready``; an entry that cannot be decoded, validated (its reply
stream must be its own, ``keys.reply(id)``) or predicted, whatever the exception, is
dead-lettered with the reason, its client gets an error final record, and the stage
carries on.

The consumer name is stable (:func:`blockq.streams.default_consumer_name`, or
``--consumer-name``), so a restarted stage finishes its predecessor's pending entries
first; an entry that keeps killing the stage is dead-lettered after
``Settings.max_deliveries`` deliveries.

``serve_predictor`` (the ``serve`` command) runs the stage together with the feedback
consumer (:mod:`.feedback`), the optional online refit (:mod:`.online`) and the HTTP
API (:mod:`.http_api`) in one event loop.
"""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import redis.asyncio as aioredis
import structlog

from blockq.config import ConfigError, Settings
from blockq.keys import GROUP_PREDICT, PAYLOAD_FIELD
from blockq.metrics_server import add_metrics_arguments, metrics_endpoint_from_args, serving_metrics
from blockq.prefix import prompt_block_hashes
from blockq.protocol import Prediction, Request, ValidationError, decode_request, encode
from blockq.service import add_common_arguments, run_service, settings_from_args
from blockq.streams import GroupConsumer, StreamEntry, connect_async, default_consumer_name
from blockq.tokenizer import TokenCounter, get_token_counter
from predictor_service.manifest import read_manifest
from predictor_service.models import (
    LengthPrediction,
    LengthPredictor,
    PredictionInput,
    load_predictor,
)

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class StageOptions:
    batch_size: int = 64
    block_ms: int = 200


class PredictorStage:
    """Annotates requests with ``prompt_tokens`` and a :class:`Prediction`.

    ``predictor`` is read once per batch, so replacing it (online refit, rollback) is
    one attribute assignment that takes effect from the next batch; ``served_versions``
    collects every version stamped so far. ``on_annotated`` (optional) is called with
    each annotated request's id and model input.
    """

    def __init__(self, client: aioredis.Redis, settings: Settings, predictor: LengthPredictor,
                 token_counter: TokenCounter, *, consumer_name: str | None = None,
                 options: StageOptions | None = None,
                 on_annotated: Callable[[str, PredictionInput], None] | None = None) -> None:
        self.client = client
        self.settings = settings
        self.predictor = predictor
        self.served_versions: set[str] = {predictor.version}
        self.on_annotated = on_annotated
        self.token_counter = token_counter
        self.options = options or StageOptions()
        keys = settings.keys
        self.consumer = GroupConsumer(
            client, keys.requests, GROUP_PREDICT, consumer_name or default_consumer_name("predict"),
            dead_letter_stream=keys.dead_letters, claim_idle_ms=settings.claim_idle_ms, settings=settings,
        )
        self.num_annotated = 0
        self.num_dead_lettered = 0
        self.batch_size_to_num_batches: Counter[int] = Counter()

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set."""
        await self.consumer.ensure_group()
        log.info("predictor_stage_started", backend=self.predictor.backend, version=self.predictor.version)
        while not stop.is_set():
            entries = await self.consumer.read(self.options.batch_size, self.options.block_ms)
            if entries:
                await self.process(entries)

    async def process(self, entries: Sequence[StreamEntry]) -> None:
        """Annotate one batch; write ``ready`` entries, dead letters and ACKs in one pipeline."""
        pipe = self.client.pipeline(transaction=False)
        self.batch_size_to_num_batches[len(entries)] += 1
        decoded: list[tuple[StreamEntry, Request]] = []
        for entry in entries:
            try:
                if entry.payload is None:
                    raise ValidationError("message", f"entry has no '{PAYLOAD_FIELD}' field")
                decoded.append((entry, decode_request(entry.payload, self.settings.limits, keys=self.settings.keys)))
            except Exception as exc:  # ValidationError names the field; anything else is a decoder fault
                reason = str(exc) if isinstance(exc, ValidationError) else f"{type(exc).__name__}: {exc}"
                self.consumer.dead_letter(pipe, entry, reason)
                self.num_dead_lettered += 1
        annotated = self._annotate([request for _, request in decoded])
        for (entry, _), result in zip(decoded, annotated, strict=True):
            if isinstance(result, str):
                self.consumer.dead_letter(pipe, entry, result)
                self.num_dead_lettered += 1
                continue
            pipe.xadd(self.settings.keys.ready, {PAYLOAD_FIELD: encode(result)})
            self.consumer.ack(pipe, [entry.entry_id])
            self.num_annotated += 1
        await pipe.execute()

    def _annotate(self, requests: list[Request]) -> list[Request | str]:
        """Annotated requests, or a reason string for each one that could not be predicted."""
        if not requests:
            return []
        predictor = self.predictor  # one model per batch, even if a refit swaps it meanwhile
        self.served_versions.add(predictor.version)
        try:
            inputs = prediction_inputs(requests, self.token_counter)
        except Exception:  # e.g. a tokenizer failing on one prompt: find which, alone
            return [self._annotate_alone(predictor, request) for request in requests]
        results = annotate(predictor, requests, inputs)
        if self.on_annotated is not None:
            for request, one, result in zip(requests, inputs, results, strict=True):
                if not isinstance(result, str):
                    self.on_annotated(request.id, one)
        return results

    def _annotate_alone(self, predictor: LengthPredictor, request: Request) -> Request | str:
        try:
            inputs = prediction_inputs([request], self.token_counter)
        except Exception as exc:
            return _failure_reason(exc)
        (result,) = annotate(predictor, [request], inputs)
        if self.on_annotated is not None and not isinstance(result, str):
            self.on_annotated(request.id, inputs[0])
        return result


def prediction_inputs(requests: Sequence[Request], token_counter: TokenCounter) -> list[PredictionInput]:
    """The model input of each request (text prompts counted in one tokenizer call)."""
    texts = [r.prompt for r in requests if isinstance(r.prompt, str)]
    text_counts = iter(token_counter.count(texts)) if texts else iter(())
    inputs = []
    for request in requests:
        prompt_tokens = next(text_counts) if isinstance(request.prompt, str) else len(request.prompt)
        inputs.append(PredictionInput(
            prompt=request.prompt if isinstance(request.prompt, str) else "",
            prompt_tokens=prompt_tokens, max_tokens=request.max_tokens,
            num_turns=request.num_turns, true_output_tokens=request.true_output_tokens,
            trace_predicted_output_tokens=request.trace_predicted_output_tokens,
        ))
    return inputs


def annotate(predictor: LengthPredictor, requests: Sequence[Request],
             inputs: Sequence[PredictionInput]) -> list[Request | str]:
    """One model call for the batch: each request with its :class:`Prediction`, or the
    reason it could not be predicted (a bad request does not sink its batch, and no
    exception of the model escapes: an escaping one would crash the stage on the same
    entries after every restart). Each annotated request also carries its
    ``prompt_block_hashes`` (:mod:`blockq.prefix`; kept when it came with them), so they
    are computed once, here, for the dispatcher and the engine alike."""
    requests = _with_block_hashes(requests)
    try:
        predictions = predictor.predict(list(inputs))
    except Exception:
        return [_annotate_one(predictor, request, one) for request, one in zip(requests, inputs, strict=True)]
    return [request.with_prediction(_prediction(one, p, predictor.version))
            for request, one, p in zip(requests, inputs, predictions, strict=True)]


def _with_block_hashes(requests: Sequence[Request]) -> list[Request]:
    """``requests`` with their prompt block hashes (text prompts tokenized in one call).
    A prompt the tokenizer fails on gets none: the hashes only help placement, so they
    never cost a request its answer."""
    prompts = [request.prompt for request in requests if not request.prompt_block_hashes]
    try:
        hashes = iter(prompt_block_hashes(prompts))
    except Exception:
        hashes = iter([_block_hashes_or_none(prompt) for prompt in prompts])
    return [replace(request, prompt_block_hashes=next(hashes)) if not request.prompt_block_hashes else request
            for request in requests]


def _block_hashes_or_none(prompt: str | tuple[int, ...]) -> tuple[int, ...]:
    try:
        return prompt_block_hashes([prompt])[0]
    except Exception as exc:
        log.warning("prompt_block_hashes_failed", error=f"{type(exc).__name__}: {exc}")
        return ()


def _annotate_one(predictor: LengthPredictor, request: Request, one: PredictionInput) -> Request | str:
    try:
        (p,) = predictor.predict([one])
    except Exception as exc:
        return _failure_reason(exc)
    return request.with_prediction(_prediction(one, p, predictor.version))


def _failure_reason(exc: Exception) -> str:
    # A ValueError is the model saying why the input does not fit; anything else is a
    # fault, named by its type.
    detail = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    return f"prediction failed: {detail}"


def _prediction(one: PredictionInput, p: LengthPrediction, version: str) -> Prediction:
    return Prediction(prompt_tokens=one.prompt_tokens, predicted_output_tokens=p.predicted_output_tokens,
                      p10_tokens=p.p10_tokens, p90_tokens=p.p90_tokens, predictor_version=version)


# --- command line: `blockq predictor serve` / `python -m predictor_service` ----------------


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
    parser.add_argument("--http-host", default="127.0.0.1")
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


def run_serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if args.online_refit and args.backend != "fast":
        raise ConfigError(f"--online-refit: needs --backend fast (got {args.backend!r})")
    if args.refine_model and args.http_port is None:
        raise ConfigError("--refine-model: needs --http-port (workers ask POST /refine over HTTP)")
    metrics_endpoint_from_args(args)  # validated before the model loads
    predictor = load_predictor(args.backend, args.model_dir)
    token_counter = get_token_counter(args.tokenizer)

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
    from predictor_service.exposition import predictor_registry
    from predictor_service.feedback import FeedbackConsumer, FeedbackOptions, build_quality_monitor
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
                         stage=stage, feedback=feedback, refitter=refitter)
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
