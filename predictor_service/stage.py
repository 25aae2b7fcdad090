"""The predictor's stream stage: ``req`` → annotate with token counts and a predicted
output-length distribution → ``ready``.

Reads in batches through the ``predict`` consumer group so that N replicas share the
work; one model call per batch. Each entry is ACKed in the same pipeline that writes
its annotated copy to ``ready``; an entry that cannot be decoded or predicted is
dead-lettered with the reason and the stage carries on.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog

from blockq.config import Settings
from blockq.keys import GROUP_PREDICT, PAYLOAD_FIELD
from blockq.protocol import Prediction, Request, ValidationError, decode_request, encode
from blockq.service import add_common_arguments, run_service, settings_from_args
from blockq.streams import GroupConsumer, StreamEntry, connect_async
from blockq.tokenizer import TokenCounter, get_token_counter
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


def default_consumer_name(role: str) -> str:
    """A consumer name unique per process and stable per host+pid."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


class PredictorStage:
    """Annotates requests with ``prompt_tokens`` and a :class:`Prediction`."""

    def __init__(self, client: aioredis.Redis, settings: Settings, predictor: LengthPredictor,
                 token_counter: TokenCounter, *, consumer_name: str | None = None,
                 options: StageOptions | None = None) -> None:
        self.client = client
        self.settings = settings
        self.predictor = predictor
        self.token_counter = token_counter
        self.options = options or StageOptions()
        keys = settings.keys
        self.consumer = GroupConsumer(
            client, keys.requests, GROUP_PREDICT, consumer_name or default_consumer_name("predict"),
            dead_letter_stream=keys.dead_letters, claim_idle_ms=settings.claim_idle_ms,
        )
        self.num_annotated = 0
        self.num_dead_lettered = 0

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
        decoded: list[tuple[StreamEntry, Request]] = []
        for entry in entries:
            try:
                if entry.payload is None:
                    raise ValidationError("message", f"entry has no '{PAYLOAD_FIELD}' field")
                decoded.append((entry, decode_request(entry.payload, self.settings.limits)))
            except ValidationError as exc:
                self.consumer.dead_letter(pipe, entry, str(exc))
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
        texts = [r.prompt for r in requests if isinstance(r.prompt, str)]
        text_counts = iter(self.token_counter.count(texts)) if texts else iter(())
        inputs = []
        for request in requests:
            prompt_tokens = next(text_counts) if isinstance(request.prompt, str) else len(request.prompt)
            inputs.append(PredictionInput(
                prompt=request.prompt if isinstance(request.prompt, str) else "",
                prompt_tokens=prompt_tokens, max_tokens=request.max_tokens,
                num_turns=request.num_turns, true_output_tokens=request.true_output_tokens,
                trace_predicted_output_tokens=request.trace_predicted_output_tokens,
            ))
        try:
            predictions = self.predictor.predict(inputs)
        except ValueError:
            # One bad request (e.g. `oracle` without a true length) must not sink its batch.
            return [self._annotate_one(request, one) for request, one in zip(requests, inputs, strict=True)]
        return [request.with_prediction(self._prediction(one, p))
                for request, one, p in zip(requests, inputs, predictions, strict=True)]

    def _annotate_one(self, request: Request, one: PredictionInput) -> Request | str:
        try:
            (p,) = self.predictor.predict([one])
        except ValueError as exc:
            return f"prediction failed: {exc}"
        return request.with_prediction(self._prediction(one, p))

    def _prediction(self, one: PredictionInput, p: LengthPrediction) -> Prediction:
        return Prediction(prompt_tokens=one.prompt_tokens, predicted_output_tokens=p.predicted_output_tokens,
                          p10_tokens=p.p10_tokens, p90_tokens=p.p90_tokens,
                          predictor_version=self.predictor.version)


# --- command line: `blockq predictor serve` / `python -m predictor_service` ----------------


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--backend", default="heuristic",
                        help="heuristic | fast | roberta | oracle | trace (oracle/trace: benchmarks only)")
    parser.add_argument("--model-dir", default=None, help="trained model directory (fast, roberta)")
    parser.add_argument("--tokenizer", default=None, help="token counter name (env BLOCKQ_TOKENIZER)")
    parser.add_argument("--batch-size", type=int, default=64, help="max requests per read and model call")
    parser.add_argument("--http-port", type=int, default=None, help="also serve the HTTP API on this port")
    parser.add_argument("--http-host", default="127.0.0.1")


def run_serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    predictor = load_predictor(args.backend, args.model_dir)
    token_counter = get_token_counter(args.tokenizer)

    async def main(stop: asyncio.Event) -> None:
        client = connect_async(settings.redis_url)
        stage = PredictorStage(client, settings, predictor, token_counter,
                               options=StageOptions(batch_size=args.batch_size))
        try:
            await stage.run(stop)
        finally:
            await client.aclose()

    return run_service(settings, "predictor", main)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m predictor_service", description="the predictor stage")
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))
