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

The intake, cancel and heartbeat loops ride out Redis outages of any length: a Redis
connection or timeout error ends one iteration, and the loop backs off (0.1 s doubling to
2 s) and tries again (:mod:`workers.redis_outage`). The engine steps on; its output waits
and is written after, what Redis lost of the streams put back first
(:mod:`workers.answering`). After an outage the intake reads its own pending entries again
(an entry read whose reply was lost would otherwise wait for a restart). Anything else
that ends a loop is a bug: the
worker stops (unfinished work stays pending in Redis, the last beat says ``stopped``) and
:meth:`InstanceWorker.run` raises :class:`WorkerFailed`, so the process exits non-zero
and its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from typing import Any

import redis
import redis.asyncio as aioredis
import structlog

from blockq.client_reader import ReplyReader
from blockq.config import Settings
from blockq.wire.health import InstanceState
from blockq.wire.keys import GROUP_WORK, PAYLOAD_FIELD
from blockq.wire.protocol import Request, encode
from blockq.wire.streams import GroupConsumer, StreamEntry
from workers.answering import MAX_ERROR_CHARS, Answering
from workers.cancels import CancelNotices
from workers.engines.base import Engine
from workers.heartbeat import HeartbeatBuilder
from workers.intake import WorkerOptions, bundle_room, engine_spec, sort_bundle
from workers.metrics import InstanceMetrics, WorkerMetrics, WorkerStats
from workers.redis_outage import REDIS_DOWN, RedisOutage, run_riding_out_redis
from workers.refine_client import RefinementClient
from workers.refinement import RefinementBook
from workers.replies import Answer, InFlight, ReplyWriter, resume_from

log = structlog.get_logger(__name__)


class WorkerFailed(Exception):
    """One of the worker's loops died; the worker stopped and should be restarted."""


class InstanceWorker(Answering):
    """Serves one engine instance (its answering phase: :class:`workers.answering.Answering`)."""

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
        self.replies = ReplyWriter(settings, instance_id, engine.time_scale)
        self.refiner = (RefinementClient(self.options.refine_url, RefinementBook(self.options.refine_every_tokens),
                                         token=self.options.refine_token)
                        if self.options.refine_url else None)
        self.beats = HeartbeatBuilder(instance_id, engine, clock=time.time,
                                      refinements=self.refiner.book if self.refiner else None)
        self.stats = WorkerStats()
        self.draining = False
        self._work_arrived = asyncio.Event()
        self._stopping = False
        self._failure: BaseException | None = None
        self._init_answering()
        self.cancels = CancelNotices(client, self.keys.cancellations)
        # Requests handed to the engine and not yet ACKed: at most one engine's worth.
        self.max_in_flight = int(engine.engine_config().get("max_num_seqs") or 1)
        self.metrics: InstanceMetrics = (metrics or WorkerMetrics()).attach(self)

    # --- lifecycle ----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then drain: finish what was started, then return.
        Raises :class:`WorkerFailed` when a loop died (the worker stopped without draining)."""
        await self._start(stop)
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

    async def _start(self, stop: asyncio.Event) -> None:
        """Create the group and publish the first beat, however long Redis takes to answer
        (a worker started during an outage waits instead of exiting)."""
        started = False

        async def start_once() -> None:
            nonlocal started
            await self.consumer.ensure_group()
            await self.publish_heartbeat(InstanceState.JOINING)
            started = True

        await run_riding_out_redis(start_once, lambda: not started and not stop.is_set(),
                                   RedisOutage(self.instance_id, "start"))

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
                with contextlib.suppress(*REDIS_DOWN):  # the heartbeat loop says it too
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
        # An iteration cut off by an outage may have read entries whose reply was lost:
        # they are pending here and nobody else claims them, so read own pending again.
        await run_riding_out_redis(self._take_bundle,
                                   lambda: not stop.is_set() and not self._stopping and self._failure is None,
                                   RedisOutage(self.instance_id, "intake"), on_error=self._after_redis_error)

    def _after_redis_error(self) -> None:
        self.consumer.reread_own_pending()
        self._output_maybe_lost = True

    async def _take_bundle(self) -> None:
        room = bundle_room(self.options, self.engine, self.max_in_flight, len(self.in_flight))
        if room <= 0:
            await asyncio.sleep(self.options.idle_poll_ms / 1000 / 4)
            return
        # Running entries are held on purpose: re-reading them is not a failed delivery.
        held_ids = {flight.entry_id for flight in self.in_flight.values()}
        entries = await self.consumer.read(room, self.options.idle_poll_ms, held_ids=held_ids)
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
        bundle = sort_bundle(entries, {rid: flight.entry_id for rid, flight in self.in_flight.items()},
                             self.settings)
        for entry, reason in bundle.invalid:
            self.consumer.dead_letter(pipe, entry, reason)
            self.stats.num_dead_lettered += 1
        self.consumer.ack(pipe, [entry.entry_id for entry in bundle.duplicates])
        return bundle.fresh

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
        # cancel loop saw while this bundle was being read is in `self.cancels`.
        if is_flagged or request.id in self.cancels:
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

    # --- cancellation and heartbeats ----------------------------------------------------

    async def _cancel_loop(self, stop: asyncio.Event) -> None:
        """Note cancel notices; the step loop applies them (one writer per request)."""
        await run_riding_out_redis(self._read_cancels, lambda: not stop.is_set() and not self._stopping,
                                   RedisOutage(self.instance_id, "cancel"), on_error=self._after_redis_error)

    async def _read_cancels(self) -> None:
        for request_id in await self.cancels.read():
            if request_id in self.in_flight:
                self._cancels_to_apply.add(request_id)
                self._work_arrived.set()

    async def _heartbeat_loop(self) -> None:
        await run_riding_out_redis(self._beat, lambda: not self._stopping, RedisOutage(self.instance_id, "heartbeat"),
                                   on_error=self._after_redis_error)

    async def _beat(self) -> None:
        try:
            await self.publish_heartbeat(InstanceState.DRAINING if self.draining else InstanceState.LIVE)
        except redis.ResponseError as exc:
            # Redis refused the write (e.g. maxmemory reached) but is there: beat again next time.
            log.warning("heartbeat_refused", instance=self.instance_id, error=str(exc)[:200])
        await asyncio.sleep(self.settings.heartbeat_interval_ms / 1000)

    async def publish_heartbeat(self, state: str) -> None:
        beat = self.beats.build(state, self.stats.lag_ms)
        self.metrics.record_beat(beat)
        payload = encode(beat)
        pipe = self.client.pipeline(transaction=False)
        pipe.xadd(self.keys.heartbeats, {PAYLOAD_FIELD: payload}, maxlen=20_000, approximate=True)
        pipe.hset(self.keys.instances, self.instance_id, payload)
        await pipe.execute()
