"""The per-instance worker: its queue stream → its engine → reply streams, ``done``, beats.

Reads its queue (``inst:{id}``, group ``work``, consumer name = instance id, so that a
restarted worker resumes its own pending entries first) in bundles of up to
``bundle_size``, and only as many as the engine can admit soon: excess requests stay in
Redis, where the dispatcher can still move them. Per engine step, one pipeline carries
every request's new chunks (the first token at once, then at most every
``stream_interval_ms``) and final records (each with its ``done`` entry); a queue entry
is ACKed once its final record's write is confirmed, in the next round trip. SIGTERM
drains: no new reads, running requests finish, the last beats say ``draining`` then
``stopped``.

Delivery rules. Output goes through :mod:`blockq.wire.output`: a write refused because the
request now belongs to another instance (``FENCED``) or already has its final record
(``ALREADY_FINAL``) drops the request here (aborted in the engine, entry ACKed). A queue
entry re-read while it runs here is ignored; a *different* entry for a running request
is a duplicate and is ACKed. A request admitted again resumes from what its reply
stream holds (:mod:`workers.replies`). Cancels are handled by the step loop, so a
request gets one answer even when it finishes in the step its cancel arrives; cancel
notices are remembered (bounded) so one that arrives while its request is being
admitted is not lost. An exception while admitting or answering one entry answers that
request with status ``error`` (or dead-letters the entry) and the worker goes on.

The intake, cancel and heartbeat loops are supervised: when one dies the worker stops
(unfinished work stays pending in Redis, the last beat says ``stopped``) and
:meth:`InstanceWorker.run` raises :class:`WorkerFailed`, so the process exits non-zero
and its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis
import structlog

from blockq.client import ReplyReader
from blockq.config import Settings
from blockq.wire.health import InstanceState
from blockq.wire.keys import GROUP_WORK, PAYLOAD_FIELD
from blockq.wire.output import ALREADY_FINAL, FENCED, WRITTEN
from blockq.wire.protocol import Request, ValidationError, decode_request, encode
from blockq.wire.streams import GroupConsumer, StreamEntry
from workers.engines.base import Engine, EngineStepOutput
from workers.heartbeat import HeartbeatBuilder
from workers.intake import WorkerOptions, bundle_room, engine_spec
from workers.metrics import InstanceMetrics, WorkerMetrics
from workers.refine_client import RefinementClient
from workers.refinement import RefinementBook
from workers.replies import Answer, InFlight, ReplyWriter, record_step_output, resume_from

log = structlog.get_logger(__name__)

MAX_ERROR_CHARS = 500
MAX_RECENT_CANCELS = 10_000


class WorkerFailed(Exception):
    """One of the worker's loops died; the worker stopped and should be restarted."""


@dataclass(frozen=True)
class _Write:
    """An output script queued on a pipeline: its position there, its request, and for a
    chunk its payload (sent again if the write fails)."""

    position: int
    flight: InFlight
    is_final: bool
    chunk: bytes | None = None


@dataclass
class WorkerStats:
    num_received: int = 0
    num_finished: int = 0
    num_cancelled: int = 0
    num_errors: int = 0
    num_dropped: int = 0          # fenced off, or answered elsewhere
    num_dead_lettered: int = 0
    lag_ms: deque[float] = field(default_factory=lambda: deque(maxlen=2000))


class InstanceWorker:
    """Serves one engine instance."""

    def __init__(self, client: aioredis.Redis, settings: Settings, instance_id: str, engine: Engine,
                 options: WorkerOptions | None = None, metrics: WorkerMetrics | None = None) -> None:
        """``metrics``: the process's metrics, shared by its instances (default: a
        registry of this worker's own)."""
        self.client = client
        self.settings = settings
        self.instance_id = instance_id
        self.engine = engine
        self.options = options or WorkerOptions()
        self.keys = settings.keys
        self.consumer = GroupConsumer(client, self.keys.instance_queue(instance_id), GROUP_WORK, instance_id,
                                      dead_letter_stream=self.keys.dead_letters,
                                      claim_idle_ms=settings.claim_idle_ms, claim_stale=False,
                                      settings=settings)
        self.in_flight: dict[str, InFlight] = {}
        self.replies = ReplyWriter(settings, instance_id, engine.time_scale)
        self.refiner = (RefinementClient(self.options.refine_url, RefinementBook(self.options.refine_every_tokens))
                        if self.options.refine_url else None)
        self.beats = HeartbeatBuilder(instance_id, engine, clock=time.time,
                                      refinements=self.refiner.book if self.refiner else None)
        self.stats = WorkerStats()
        self.draining = False
        self._work_arrived = asyncio.Event()
        self._stopping = False
        self._failure: BaseException | None = None
        # Flights whose answer is decided and whose final record is not confirmed yet.
        self._to_answer: dict[str, InFlight] = {}
        self._cancels_to_apply: set[str] = set()
        self._recent_cancels: dict[str, None] = {}  # insertion-ordered, bounded
        # Requests handed to the engine and not yet ACKed: at most one engine's worth.
        self.max_in_flight = int(engine.engine_config().get("max_num_seqs") or 1)
        self.metrics: InstanceMetrics = (metrics or WorkerMetrics()).attach(self)

    # --- lifecycle ----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then drain: finish what was started, then return.
        Raises :class:`WorkerFailed` when a loop died (the worker stopped without draining)."""
        await self.consumer.ensure_group()
        await self.publish_heartbeat(InstanceState.JOINING)
        tasks = [asyncio.create_task(self._intake_loop(stop), name=f"intake-{self.instance_id}"),
                 asyncio.create_task(self._cancel_loop(stop), name=f"cancel-{self.instance_id}"),
                 asyncio.create_task(self._heartbeat_loop(), name=f"beat-{self.instance_id}")]
        if self.refiner is not None:
            tasks.append(asyncio.create_task(self.refiner.run(stop), name=f"refine-{self.instance_id}"))
        for task in tasks:
            task.add_done_callback(functools.partial(self._watch_loop, stop))
        try:
            await self._step_loop(stop)
        finally:
            self._stopping = True  # loops also check it: a swallowed cancellation cannot keep one alive
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=5.0)
            try:
                await self.publish_heartbeat(InstanceState.STOPPED)
            except Exception as exc:  # Redis may be what failed: the original error matters more
                log.warning("last_heartbeat_failed", instance=self.instance_id, error=repr(exc))
            log.info("worker_stopped", instance=self.instance_id, finished=self.stats.num_finished)
        if self._failure is not None:
            raise WorkerFailed(f"worker {self.instance_id}: {self._failure!r}") from self._failure

    def _watch_loop(self, stop: asyncio.Event, task: asyncio.Task[None]) -> None:
        """A loop ended: unless the worker is stopping, that is a failure that stops it
        (the intake and cancel loops return by themselves once ``stop`` is set)."""
        if self._stopping:
            return
        if task.cancelled():
            failure: BaseException = asyncio.CancelledError(f"{task.get_name()} cancelled")
        else:
            failure = task.exception() or RuntimeError(f"{task.get_name()} returned")
            if task.exception() is None and stop.is_set():
                return
        log.error("worker_loop_died", instance=self.instance_id, loop=task.get_name(), error=repr(failure))
        if self._failure is None:
            self._failure = failure
        self._work_arrived.set()

    async def _step_loop(self, stop: asyncio.Event) -> None:
        # Ends at once when a loop failed: unfinished work is left pending, not ACKed.
        this_task = asyncio.current_task()
        while self._failure is None:
            if this_task is not None and this_task.cancelling():
                # A cancellation something below swallowed: honour it anyway.
                raise asyncio.CancelledError
            if stop.is_set() and not self.draining:
                self.draining = True
                log.info("worker_draining", instance=self.instance_id, in_flight=len(self.in_flight))
                await self.publish_heartbeat(InstanceState.DRAINING)
            if self.engine.has_unfinished_requests():
                output = await self.engine.step()
                if self._failure is not None:
                    return
                self.stats.lag_ms.append(output.lag_ms)
                self.beats.record_step(output)
                self.metrics.record_step(output)
                await self._write_outputs(output)
                if self.refiner is not None:
                    self.refiner.collect(self.in_flight)
            elif self._to_answer or self._cancels_to_apply:
                await self._write_outputs(None)
                if self._to_answer:  # a final record's write failed: retry, not in a hot loop
                    await asyncio.sleep(self.options.idle_poll_ms / 1000)
            elif self.draining:
                return
            else:
                self._work_arrived.clear()
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
                # cancellation that lands as the event is set, and the worker then outlives it.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.options.idle_poll_ms / 1000):
                        await self._work_arrived.wait()

    # --- intake -------------------------------------------------------------------------

    async def _intake_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set() and not self._stopping and self._failure is None:
            room = bundle_room(self.options, self.engine, self.max_in_flight, len(self.in_flight))
            if room <= 0:
                await asyncio.sleep(self.options.idle_poll_ms / 1000 / 4)
                continue
            entries = await self.consumer.read(room, self.options.idle_poll_ms)
            if entries and not await self.admit(entries):
                # Only entries already running here came back (own pending re-read): wait
                # rather than spin on Redis.
                await asyncio.sleep(self.options.idle_poll_ms / 1000)

    async def admit(self, entries: list[StreamEntry]) -> int:
        """Hand a bundle to the engine. Invalid entries are dead-lettered; cancelled,
        unservable or failing ones are answered by the step loop; an entry already
        answered (its final record is on the reply stream) is ACKed. Returns how many
        entries were not already running here."""
        pipe = self.client.pipeline(transaction=False)
        fresh = self._decode_bundle(pipe, entries)
        # One round trip for the bundle: cancel flags, and what each reply stream holds.
        state_pipe = self.client.pipeline(transaction=False)
        for _, request in fresh:
            state_pipe.exists(self.keys.cancel_flag(request.id))
            state_pipe.xrange(request.reply_stream)
        state = await state_pipe.execute(raise_on_error=False) if fresh else []
        now_wall_s = time.time()
        for index, (entry, request) in enumerate(fresh):
            self.stats.num_received += 1
            is_flagged, reply_entries = state[2 * index], state[2 * index + 1]
            try:
                self._admit_one(pipe, entry, request, is_flagged, reply_entries, now_wall_s)
            except Exception as exc:  # one poison request must not stop the others
                log.exception("admission_failed", instance=self.instance_id, request_id=request.id)
                self._answer_failure(entry, request, now_wall_s, f"admission failed: {exc!r}")
        if len(pipe):
            await pipe.execute()
        self._work_arrived.set()
        return len(fresh) + len(pipe)

    def _decode_bundle(self, pipe: Any, entries: list[StreamEntry]) -> list[tuple[StreamEntry, Request]]:
        """The entries to admit; undecodable ones are dead-lettered, duplicates ACKed."""
        fresh: list[tuple[StreamEntry, Request]] = []
        seen_ids: set[str] = set()
        for entry in entries:
            try:
                if entry.payload is None:
                    raise ValidationError("message", f"entry has no '{PAYLOAD_FIELD}' field")
                request = decode_request(entry.payload, self.settings.limits, keys=self.keys)
            except Exception as exc:  # ValidationError, or anything else decoding raised
                self.consumer.dead_letter(pipe, entry, str(exc) if isinstance(exc, ValidationError) else repr(exc))
                self.stats.num_dead_lettered += 1
                continue
            running = self.in_flight.get(request.id)
            if running is not None and running.entry_id == entry.entry_id:
                continue  # the very entry running here, re-read: never ACK it
            if running is not None or request.id in seen_ids:
                # A second entry for a request already here (placed again after this
                # instance looked dead): the running copy answers; drop this one.
                self.consumer.ack(pipe, [entry.entry_id])
                continue
            seen_ids.add(request.id)
            fresh.append((entry, request))
        return fresh

    def _admit_one(self, pipe: Any, entry: StreamEntry, request: Request, is_flagged: object,
                   reply_entries: object, now_wall_s: float) -> None:
        for result in (is_flagged, reply_entries):
            if isinstance(result, Exception):
                raise result
        spec = engine_spec(request)
        flight = InFlight(request=request, entry_id=entry.entry_id, received_at_s=now_wall_s,
                          prompt_tokens=spec.prompt_tokens)
        reader = ReplyReader()
        reader.feed(reply_entries)  # type: ignore[arg-type]
        if reader.final is not None:
            # Answered before a crash cut the ACK off: nothing is left to do.
            self.consumer.ack(pipe, [entry.entry_id])
            return
        resume_from(flight, reader)
        # Checked here, with no await before the engine takes it: a cancel notice the
        # cancel loop saw while this bundle was being read is in `_recent_cancels`.
        if is_flagged or request.id in self._recent_cancels:
            self._decide(flight, Answer("cancelled", "abort"))
            return
        problem = self.engine.validate(spec)
        if problem is not None:
            self._decide(flight, Answer("error", "abort", problem[:MAX_ERROR_CHARS]))
            return
        self.in_flight[request.id] = flight
        try:
            self.engine.add_request(spec)
        except Exception:
            self.in_flight.pop(request.id, None)
            raise
        self.beats.record_delivery(request, now_wall_s)

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

    # --- output -------------------------------------------------------------------------

    async def _write_outputs(self, output: EngineStepOutput | None) -> None:
        """Write a step's chunks, then the answers decided (finished this step, cancelled,
        failed at admission, or not confirmed last time), in one pipeline."""
        pipe = self.client.pipeline(transaction=False)
        writes: list[_Write] = []
        now_wall_s = time.time()
        if output is not None:
            for event, flight in record_step_output(self.in_flight, output, now_wall_s):
                if flight.answer is not None:
                    continue
                if event.error is not None:
                    self._decide(flight, Answer("error", "abort", event.error[:MAX_ERROR_CHARS]))
                elif event.finished:
                    self._decide(flight, Answer("ok", event.finish_reason or "stop"))
                elif event.is_first or flight.due_for_flush(now_wall_s, self.options.stream_interval_ms):
                    self._queue_flush(pipe, flight, writes)
        # After the step's events: a request that finished in the step its cancel came
        # in is answered `ok` once, not also `cancelled`.
        for request_id in self._cancels_to_apply:
            flight = self.in_flight.get(request_id)
            if flight is not None and flight.answer is None:
                self.engine.abort_request(request_id)
                self._decide(flight, Answer("cancelled", "abort"))
        self._cancels_to_apply.clear()
        for flight in list(self._to_answer.values()):
            self._queue_answer(pipe, flight, writes)
        if len(pipe):
            await self._settle(await pipe.execute(raise_on_error=False), writes)

    def _queue_flush(self, pipe: Any, flight: InFlight, writes: list[_Write]) -> None:
        try:
            chunks = self.replies.flush(pipe, flight)
        except Exception as exc:
            log.exception("flush_failed", instance=self.instance_id, request_id=flight.request.id)
            self._answer_failure(StreamEntry(flight.entry_id, None), flight.request, time.time(),
                                 f"writing output failed: {exc!r}")
            return
        writes.extend(_Write(position, flight, False, payload) for position, payload in chunks)

    def _queue_answer(self, pipe: Any, flight: InFlight, writes: list[_Write]) -> None:
        """Queue the rest of ``flight``'s output and its final record; when that raises,
        answer ``error`` instead, and when even that raises, dead-letter the entry."""
        if flight.answer is None:
            return
        try:
            chunks = self.replies.flush(pipe, flight)
            writes.extend(_Write(position, flight, False, payload) for position, payload in chunks)
            writes.append(_Write(self.replies.finish(pipe, flight, flight.answer), flight, is_final=True))
            return
        except Exception as exc:
            log.exception("answer_failed", instance=self.instance_id, request_id=flight.request.id)
            reason = f"answering failed: {exc!r}"[:MAX_ERROR_CHARS]
        try:
            flight.answer = Answer("error", "abort", reason)
            writes.append(_Write(self.replies.finish(pipe, flight, flight.answer), flight, is_final=True))
        except Exception:
            payload = None
            with contextlib.suppress(Exception):
                payload = encode(flight.request)
            self.consumer.dead_letter(pipe, StreamEntry(flight.entry_id, payload), reason)
            self.stats.num_dead_lettered += 1
            self._forget(flight.request.id)

    async def _settle(self, results: list[Any], writes: list[_Write]) -> None:
        """Read each output write's outcome; ACK the entries of requests answered (here
        or elsewhere) or no longer owned, then forget them. A final record whose write
        failed stays to answer, and is written again next round."""
        done: dict[str, tuple[InFlight, str]] = {}
        for write in writes:
            result = results[write.position]
            request_id = write.flight.request.id
            if isinstance(result, Exception):
                log.error("output_write_failed", instance=self.instance_id, request_id=request_id,
                          final=write.is_final, error=repr(result))
                if write.chunk is not None:
                    write.flight.unsent_chunks.append(write.chunk)  # in pipeline order
            elif result == FENCED:
                done[request_id] = (write.flight, "fenced")
            elif result == ALREADY_FINAL:
                done.setdefault(request_id, (write.flight, "answered_elsewhere"))
            elif result == WRITTEN and write.is_final:
                done.setdefault(request_id, (write.flight, "answered"))
        if not done:
            return
        pipe = self.client.pipeline(transaction=False)
        for flight, _ in done.values():
            self.consumer.ack(pipe, [flight.entry_id])
        await pipe.execute()
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
        if outcome != "answered":
            self.stats.num_dropped += 1
            log.info("request_dropped", instance=self.instance_id, request_id=flight.request.id, reason=outcome)
            return
        status = flight.answer.status if flight.answer else "ok"
        if status == "cancelled":
            self.stats.num_cancelled += 1
        elif status == "error":
            self.stats.num_errors += 1
        else:
            self.stats.num_finished += 1
            self.beats.record_answered(flight.prompt_tokens, flight.num_answered_tokens)
            self.metrics.record_answered(flight)

    # --- cancellation and heartbeats ----------------------------------------------------

    async def _cancel_loop(self, stop: asyncio.Event) -> None:
        """Note cancel notices; the step loop applies them (one writer per request)."""
        last_id = "$"
        while not stop.is_set() and not self._stopping:
            reply = await self.client.xread({self.keys.cancellations: last_id}, count=100, block=500)
            if not reply:
                continue
            for entry_id, fields in reply[0][1]:
                last_id = entry_id
                request_id = fields.get(PAYLOAD_FIELD.encode(), b"").decode()
                self._remember_cancel(request_id)
                if request_id in self.in_flight:
                    self._cancels_to_apply.add(request_id)
                    self._work_arrived.set()

    def _remember_cancel(self, request_id: str) -> None:
        self._recent_cancels[request_id] = None
        if len(self._recent_cancels) > MAX_RECENT_CANCELS:
            del self._recent_cancels[next(iter(self._recent_cancels))]

    async def _heartbeat_loop(self) -> None:
        interval_s = self.settings.heartbeat_interval_ms / 1000
        while not self._stopping:
            try:
                await self.publish_heartbeat(InstanceState.DRAINING if self.draining else InstanceState.LIVE)
            except redis.ResponseError as exc:
                # Redis refused the write (e.g. maxmemory reached) but is there: beat again
                # next time. Lost connections still end the loop, and the worker with it.
                log.warning("heartbeat_refused", instance=self.instance_id, error=str(exc)[:200])
            await asyncio.sleep(interval_s)

    async def publish_heartbeat(self, state: str) -> None:
        beat = self.beats.build(state, self.stats.lag_ms)
        self.metrics.record_beat(beat)
        payload = encode(beat)
        pipe = self.client.pipeline(transaction=False)
        pipe.xadd(self.keys.heartbeats, {PAYLOAD_FIELD: payload}, maxlen=20_000, approximate=True)
        pipe.hset(self.keys.instances, self.instance_id, payload)
        await pipe.execute()
