"""How a worker answers its requests: deciding each answer, and writing the engine's
output (chunks, final records, ``done`` entries) with the ACKs that follow.

One phase of :class:`workers.worker.InstanceWorker`, kept in a module of its own: the
step loop calls :meth:`Answering._write_outputs` after each engine step. A write refused
because the request now belongs to another instance (``FENCED``) or already has its
final record (``ALREADY_FINAL``) drops the request here; a write that failed is sent
again. While Redis is unreachable the engine steps on and the output waits in the
flights, tried again with a backoff; after an outage, what Redis may have lost of the
streams (its last second, in a crash) is put back first
(:func:`workers.replies.restore_lost_output`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import redis.asyncio as aioredis
import structlog

from blockq.wire.protocol import Request, encode
from blockq.wire.streams import GroupConsumer, StreamEntry
from workers.engines.base import Engine, EngineStepOutput
from workers.heartbeat import HeartbeatBuilder
from workers.intake import WorkerOptions
from workers.metrics import InstanceMetrics, WorkerStats
from workers.redis_outage import REDIS_DOWN, RedisOutage
from workers.refine_client import RefinementClient
from workers.replies import (
    Answer,
    InFlight,
    OutputWrite,
    ReplyWriter,
    record_step_output,
    restore_lost_output,
    settle_writes,
)

log = structlog.get_logger(__name__)

MAX_ERROR_CHARS = 500


class Answering:
    """The answering phase of a worker (a base class of :class:`workers.worker.InstanceWorker`,
    which sets these attributes)."""

    client: aioredis.Redis
    instance_id: str
    engine: Engine
    options: WorkerOptions
    consumer: GroupConsumer
    replies: ReplyWriter
    refiner: RefinementClient | None
    beats: HeartbeatBuilder
    stats: WorkerStats
    metrics: InstanceMetrics
    in_flight: dict[str, InFlight]
    _to_answer: dict[str, InFlight]  # answer decided, final record not confirmed yet
    _cancels_to_apply: set[str]
    _work_arrived: asyncio.Event

    def _init_answering(self) -> None:
        self.in_flight = {}
        self._to_answer = {}
        self._cancels_to_apply = set()
        # Output writes during a Redis outage: paced by a backoff while the engine steps on;
        # after one, what Redis may have lost of the streams is put back first.
        self._write_outage = RedisOutage(self.instance_id, "output")
        self._writes_resume_at_s = 0.0
        self._output_maybe_lost = False

    def _decide(self, flight: InFlight, answer: Answer) -> None:
        """Fix ``flight``'s answer (first decision wins); the step loop writes it."""
        if flight.answer is not None:
            return
        flight.answer = answer
        self.in_flight[flight.request.id] = flight
        self._to_answer[flight.request.id] = flight
        self._work_arrived.set()

    def _answer_failure(self, entry: StreamEntry, request: Request, now_wall_s: float, reason: str) -> None:
        """Answer ``request`` with status ``error`` after an exception handling it."""
        with contextlib.suppress(Exception):
            self.engine.abort_request(request.id)
        flight = self.in_flight.get(request.id) or InFlight(request=request, entry_id=entry.entry_id,
                                                             received_at_s=now_wall_s, prompt_tokens=0)
        flight.answer = None
        self._decide(flight, Answer("error", "abort", reason[:MAX_ERROR_CHARS]))

    async def _write_outputs(self, output: EngineStepOutput | None) -> None:
        """Write a step's chunks, then the answers decided (finished this step, cancelled,
        failed at admission, or not confirmed last time), in one pipeline."""
        pipe = self.client.pipeline(transaction=False)
        writes: list[OutputWrite] = []
        now_wall_s = time.time()
        # Redis down: outputs wait in the flights (text, decided answers) until the next try.
        can_write = time.monotonic() >= self._writes_resume_at_s
        if can_write and self._output_maybe_lost:
            can_write = await self._restore_lost_output()
        if output is not None:
            for event, flight in record_step_output(self.in_flight, output, now_wall_s):
                if flight.answer is not None:
                    continue
                if event.error is not None:
                    self._decide(flight, Answer("error", "abort", event.error[:MAX_ERROR_CHARS]))
                elif event.finished:
                    self._decide(flight, Answer("ok", event.finish_reason or "stop"))
                elif can_write and (event.is_first
                                    or flight.due_for_flush(now_wall_s, self.options.stream_interval_ms)):
                    self._queue_flush(pipe, flight, writes)
        # After the step's events: a request that finished in the step its cancel came
        # in is answered `ok` once, not also `cancelled`.
        for request_id in self._cancels_to_apply:
            flight = self.in_flight.get(request_id)
            if flight is not None and flight.answer is None:
                self.engine.abort_request(request_id)
                self._decide(flight, Answer("cancelled", "abort"))
        self._cancels_to_apply.clear()
        for flight in list(self._to_answer.values()) if can_write else []:
            self._queue_answer(pipe, flight, writes)
        num_commands = len(pipe)  # a failed execute empties the pipeline
        if num_commands:
            try:
                results = await pipe.execute(raise_on_error=False)
            except REDIS_DOWN as exc:
                # Every write failed: chunks are kept to send again and answers stay to
                # answer (one that did get through comes back ALREADY_FINAL next time).
                self._writes_resume_at_s = time.monotonic() + self._write_outage.note(exc)
                self._output_maybe_lost = True
                results = [exc] * num_commands
            else:
                self._write_outage.ended()
            await self._settle(results, writes)

    async def _restore_lost_output(self) -> bool:
        """Put back what Redis lost of the streams (see :func:`restore_lost_output`);
        False when Redis is still unreachable."""
        try:
            num_repaired = await restore_lost_output(self.client, list(self.in_flight.values()))
        except REDIS_DOWN as exc:
            self._writes_resume_at_s = time.monotonic() + self._write_outage.note(exc)
            return False
        self._output_maybe_lost = False
        if num_repaired:
            log.warning("lost_output_restored", instance=self.instance_id, num_requests=num_repaired)
        return True

    def _queue_flush(self, pipe: Any, flight: InFlight, writes: list[OutputWrite]) -> None:
        try:
            chunks = self.replies.flush(pipe, flight)
        except Exception as exc:
            log.exception("flush_failed", instance=self.instance_id, request_id=flight.request.id)
            self._answer_failure(StreamEntry(flight.entry_id, None), flight.request, time.time(),
                                 f"writing output failed: {exc!r}")
            return
        writes.extend(OutputWrite(position, flight, False, payload) for position, payload in chunks)

    def _queue_answer(self, pipe: Any, flight: InFlight, writes: list[OutputWrite]) -> None:
        """Queue the rest of ``flight``'s output and its final record; when that raises,
        answer ``error`` instead, and when even that raises, dead-letter the entry."""
        if flight.answer is None:
            return
        try:
            chunks = self.replies.flush(pipe, flight)
            writes.extend(OutputWrite(position, flight, False, payload) for position, payload in chunks)
            writes.append(OutputWrite(self.replies.finish(pipe, flight, flight.answer), flight, is_final=True))
            return
        except Exception as exc:
            log.exception("answer_failed", instance=self.instance_id, request_id=flight.request.id)
            reason = f"answering failed: {exc!r}"[:MAX_ERROR_CHARS]
        try:
            flight.answer = Answer("error", "abort", reason)
            writes.append(OutputWrite(self.replies.finish(pipe, flight, flight.answer), flight, is_final=True))
        except Exception:
            payload = None
            with contextlib.suppress(Exception):
                payload = encode(flight.request)
            self.consumer.dead_letter(pipe, StreamEntry(flight.entry_id, payload), reason)
            self.stats.num_dead_lettered += 1
            self._forget(flight.request.id)

    async def _settle(self, results: list[Any], writes: list[OutputWrite]) -> None:
        """Read each output write's outcome; ACK the entries of requests answered (here
        or elsewhere) or no longer owned, then forget them. A final record whose write
        failed stays to answer, and is written again next round."""
        done, failed = settle_writes(results, writes)
        if failed and not isinstance(failed[0][1], REDIS_DOWN):  # an outage is logged once, as such
            write, error = failed[0]
            log.error("output_write_failed", instance=self.instance_id, request_id=write.flight.request.id,
                      final=write.is_final, num_failed=len(failed), error=repr(error)[:200])
        if not done:
            return
        pipe = self.client.pipeline(transaction=False)
        for flight, _ in done.values():
            self.consumer.ack(pipe, [flight.entry_id])
        try:
            await pipe.execute()
        except REDIS_DOWN as exc:
            # Kept: an answered request is still to answer, its write comes back
            # ALREADY_FINAL and is ACKed then; a fenced one is fenced again.
            log.warning("ack_failed", instance=self.instance_id, num_entries=len(done), error=repr(exc)[:200])
            return
        # Settled requests leave `in_flight` only once their ACK is written: until then
        # they still count against the bundle room, so the queue's pending entries never
        # exceed what the engine holds.
        for request_id, (flight, outcome) in done.items():
            self._forget(request_id)
            self._count(flight, outcome)

    def _forget(self, request_id: str) -> None:
        self.engine.abort_request(request_id)  # a no-op for a request the engine finished
        self.in_flight.pop(request_id, None)
        self._to_answer.pop(request_id, None)
        self.beats.record_finished(request_id)
        if self.refiner is not None:
            self.refiner.book.forget(request_id)

    def _count(self, flight: InFlight, outcome: str) -> None:
        status = flight.answer.status if flight.answer else "ok"
        self.stats.count_settled(outcome, status)
        if outcome != "answered":
            log.info("request_dropped", instance=self.instance_id, request_id=flight.request.id, reason=outcome)
        elif status == "ok":
            self.beats.record_answered(flight.prompt_tokens, flight.num_answered_tokens)
            self.metrics.record_answered(flight)
