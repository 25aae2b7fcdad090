"""The predictor's stream stage: ``req`` → annotate with token counts and a predicted
output-length distribution → ``ready``.

Reads in batches through the ``predict`` consumer group so that N replicas share the
work; one model call per batch. Each request is stamped with its admission time, its
entry id in ``req`` (:func:`admitted`). Each entry is ACKed in the same pipeline that writes
its annotated copy to ``ready``; an entry that cannot be decoded, validated (its reply
stream must be its own, ``keys.reply(id)``) or predicted, whatever the exception, is
dead-lettered with the reason, its client gets an error final record, and the stage
carries on.

The consumer name is stable (:func:`blockq.wire.streams.default_consumer_name`, or
``--consumer-name``), so a restarted stage finishes its predecessor's pending entries
first; an entry that keeps killing the stage is dead-lettered after
``Settings.max_deliveries`` deliveries.

The process that runs it with the feedback consumer and the HTTP API: :mod:`.serve`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import redis.asyncio as aioredis
import structlog

from blockq.config import Settings
from blockq.text.block_hashes import PROJECT_SCHEME, PrefixScheme, prompt_block_hashes
from blockq.text.tokenizer import TokenCounter
from blockq.wire.keys import GROUP_PREDICT, PAYLOAD_FIELD
from blockq.wire.protocol import Prediction, Request, ValidationError, decode_request, encode
from blockq.wire.streams import GroupConsumer, StreamEntry, default_consumer_name
from predictor_service.models import (
    LengthPrediction,
    LengthPredictor,
    PredictionInput,
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
                request = decode_request(entry.payload, self.settings.limits, keys=self.settings.keys)
                decoded.append((entry, admitted(request, entry.entry_id)))
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
        results = annotate(predictor, requests, inputs, self.settings.prefix_scheme)
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
        (result,) = annotate(predictor, [request], inputs, self.settings.prefix_scheme)
        if self.on_annotated is not None and not isinstance(result, str):
            self.on_annotated(request.id, inputs[0])
        return result


def admitted(request: Request, entry_id: str) -> Request:
    """``request`` stamped with when Redis admitted it: the ms part of its ``req`` entry id
    (Redis' clock; a value the client sent is replaced). The dispatcher judges SLOs by the
    time waited since (:mod:`dispatcher.admission`), so no client's clock enters."""
    return request.with_admission(int(entry_id.split("-", 1)[0]))


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
             inputs: Sequence[PredictionInput], scheme: PrefixScheme = PROJECT_SCHEME) -> list[Request | str]:
    """One model call for the batch: each request with its :class:`Prediction`, or the
    reason it could not be predicted (a bad request does not sink its batch, and no
    exception of the model escapes: an escaping one would crash the stage on the same
    entries after every restart). Each annotated request also carries its
    ``prompt_block_hashes`` under ``scheme`` (:mod:`blockq.text.block_hashes`; kept when it came
    with them), so they are computed once, here, for the dispatcher and the engine alike."""
    requests = _with_block_hashes(requests, scheme)
    try:
        predictions = predictor.predict(list(inputs))
    except Exception:
        return [_annotate_one(predictor, request, one) for request, one in zip(requests, inputs, strict=True)]
    return [request.with_prediction(_prediction(one, p, predictor.version))
            for request, one, p in zip(requests, inputs, predictions, strict=True)]


def _with_block_hashes(requests: Sequence[Request], scheme: PrefixScheme) -> list[Request]:
    """``requests`` with their prompt block hashes (text prompts tokenized in one call).
    A prompt the tokenizer fails on gets none: the hashes only help placement, so they
    never cost a request its answer."""
    prompts = [request.prompt for request in requests if not request.prompt_block_hashes]
    try:
        hashes = iter(prompt_block_hashes(prompts, scheme))
    except Exception:
        hashes = iter([_block_hashes_or_none(prompt, scheme) for prompt in prompts])
    return [replace(request, prompt_block_hashes=next(hashes)) if not request.prompt_block_hashes else request
            for request in requests]


def _block_hashes_or_none(prompt: str | tuple[int, ...], scheme: PrefixScheme) -> tuple[int, ...]:
    try:
        return prompt_block_hashes([prompt], scheme)[0]
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
