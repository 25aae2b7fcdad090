"""The worker's side of remaining-length refinement: ask the predictor, keep the answers.

After each engine step the worker hands its in-flight requests to
:meth:`RefinementClient.collect`; those that crossed a checkpoint (every
``every_tokens`` generated tokens, :class:`~workers.refinement.RefinementBook`) are
queued with their partial output. One background loop per worker sends what is queued
as one ``POST /refine`` to the predictor (:mod:`predictor_service.refine_api`), at most
one call in flight, and records the answers in the book its beats read.

Refinement is advisory: a failed or slow call is logged and counted, the requests keep
their first guess (or their previous refinement), and the next checkpoint asks again.
A request resumed from an earlier execution is not refined: its engine-side token count
restarts while its text does not, and the two must describe the same output.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog

from workers.refinement import RefinedLength, RefinementBook
from workers.replies import InFlight

log = structlog.get_logger(__name__)

MAX_REFINE_BATCH = 256
RETRY_AFTER_FAILURE_S = 1.0


@dataclass
class RefineStats:
    num_asked: int = 0
    num_refined: int = 0
    num_failed_calls: int = 0


class RefinementClient:
    """Queues refinement inputs and sends them to ``{url}/refine`` in batches."""

    def __init__(self, url: str, book: RefinementBook, *, timeout_s: float = 2.0, token: str | None = None) -> None:
        self.url = url.rstrip("/") + "/refine"
        # the predictor's bearer token when its HTTP API requires one
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.book = book
        self.timeout_s = timeout_s
        self.stats = RefineStats()
        self._queued: dict[str, dict[str, Any]] = {}  # by request id: only the newest input counts
        self._wake = asyncio.Event()

    def collect(self, in_flight: Mapping[str, InFlight]) -> None:
        """Queue every request that crossed a checkpoint since it was last asked for."""
        for request_id, flight in in_flight.items():
            prediction = flight.request.prediction
            if prediction is None or flight.num_resumed_tokens or flight.answer is not None:
                continue
            checkpoint = self.book.due(request_id, flight.num_output_tokens)
            if checkpoint is None:
                continue
            self.book.mark_requested(request_id, checkpoint)
            prompt = flight.request.prompt
            self._queued[request_id] = {
                "request_id": request_id, "prompt": prompt if isinstance(prompt, str) else "",
                "prompt_tokens": flight.prompt_tokens,
                "first_guess": [prediction.p10_tokens or prediction.predicted_output_tokens,
                                prediction.predicted_output_tokens,
                                prediction.p90_tokens or prediction.predicted_output_tokens],
                "generated_tokens": flight.num_output_tokens, "partial_text": "".join(flight.text_parts),
                "max_tokens": flight.request.max_tokens,
            }
        if self._queued:
            self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Send what is queued until ``stop``; one call at a time."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await self._wake.wait()
                self._wake.clear()
                while self._queued:
                    batch = self._take_batch()
                    if not await self._send(session, batch):
                        await asyncio.sleep(RETRY_AFTER_FAILURE_S)
                        break

    def _take_batch(self) -> list[dict[str, Any]]:
        ids = list(self._queued)[:MAX_REFINE_BATCH]
        return [self._queued.pop(request_id) for request_id in ids]

    async def _send(self, session: aiohttp.ClientSession, batch: list[dict[str, Any]]) -> bool:
        self.stats.num_asked += len(batch)
        try:
            async with session.post(self.url, json={"requests": batch}, headers=self._headers) as response:
                body = await response.json()
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {body.get('error')}")
        except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as exc:
            self.stats.num_failed_calls += 1
            log.warning("refine_call_failed", url=self.url, num_requests=len(batch), error=repr(exc))
            return False
        for item in body["refinements"]:
            self.book.record(item["request_id"], RefinedLength.from_remaining(
                int(item["at_tokens"]), int(item["remaining_p10_tokens"]), int(item["remaining_p50_tokens"]),
                int(item["remaining_p90_tokens"])))
            self.stats.num_refined += 1
        return True
