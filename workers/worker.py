"""The per-instance worker: its queue stream → its engine → reply streams, ``done``, beats.

Reads its queue (``inst:{id}``, group ``work``, consumer name = instance id, so that a
restarted worker resumes its own pending entries first) in bundles of up to
``bundle_size``, and only as many as the engine can admit soon: excess requests stay in
Redis, where the dispatcher can still move them. Per engine step, one pipeline carries
every request's new chunks (the first token at once, then at most every
``stream_interval_ms``), final records, ``done`` entries and ACKs. A queue entry is
ACKed only with its final record. SIGTERM drains: no new reads, running requests finish,
the last beats say ``draining`` then ``stopped``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

import redis.asyncio as aioredis
import structlog

from blockq.config import Settings
from blockq.keys import GROUP_WORK, PAYLOAD_FIELD
from blockq.protocol import Request, ValidationError, decode_request, encode
from blockq.streams import GroupConsumer, StreamEntry
from workers.engines.base import Engine, EngineRequestSpec, EngineStepOutput
from workers.heartbeat import HeartbeatBuilder
from workers.replies import InFlight, ReplyWriter, record_step_output

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class WorkerOptions:
    bundle_size: int = 16
    stream_interval_ms: float = 50.0
    idle_poll_ms: int = 50

    def __post_init__(self) -> None:
        if self.bundle_size < 1:
            raise ValueError(f"bundle_size: must be >= 1 (got {self.bundle_size})")
        if self.stream_interval_ms < 0:
            raise ValueError(f"stream_interval_ms: must be >= 0 (got {self.stream_interval_ms})")


@dataclass
class WorkerStats:
    num_received: int = 0
    num_finished: int = 0
    num_cancelled: int = 0
    num_dead_lettered: int = 0
    lag_ms: deque[float] = field(default_factory=lambda: deque(maxlen=2000))


class InstanceWorker:
    """Serves one engine instance."""

    def __init__(self, client: aioredis.Redis, settings: Settings, instance_id: str, engine: Engine,
                 options: WorkerOptions | None = None) -> None:
        self.client = client
        self.settings = settings
        self.instance_id = instance_id
        self.engine = engine
        self.options = options or WorkerOptions()
        self.keys = settings.keys
        self.consumer = GroupConsumer(client, self.keys.instance_queue(instance_id), GROUP_WORK, instance_id,
                                      dead_letter_stream=self.keys.dead_letters,
                                      claim_idle_ms=settings.claim_idle_ms, claim_stale=False)
        self.in_flight: dict[str, InFlight] = {}
        self.replies = ReplyWriter(settings, instance_id, engine.time_scale)
        self.beats = HeartbeatBuilder(instance_id, engine, clock=time.time)
        self.stats = WorkerStats()
        self.draining = False
        self._work_arrived = asyncio.Event()
        self._stopping = False
        # Requests handed to the engine and not yet ACKed: at most one engine's worth.
        self.max_in_flight = int(engine.engine_config().get("max_num_seqs") or 1)

    # --- lifecycle ----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then drain: finish what was started, then return."""
        await self.consumer.ensure_group()
        await self.publish_heartbeat("joining")
        tasks = [asyncio.create_task(self._intake_loop(stop), name=f"intake-{self.instance_id}"),
                 asyncio.create_task(self._cancel_loop(stop), name=f"cancel-{self.instance_id}"),
                 asyncio.create_task(self._heartbeat_loop(), name=f"beat-{self.instance_id}")]
        try:
            await self._step_loop(stop)
        finally:
            self._stopping = True  # loops also check it: a swallowed cancellation cannot keep one alive
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=5.0)
            await self.publish_heartbeat("stopped")
            log.info("worker_stopped", instance=self.instance_id, finished=self.stats.num_finished)

    async def _step_loop(self, stop: asyncio.Event) -> None:
        while True:
            if stop.is_set() and not self.draining:
                self.draining = True
                log.info("worker_draining", instance=self.instance_id, in_flight=len(self.in_flight))
                await self.publish_heartbeat("draining")
            if self.engine.has_unfinished_requests():
                output = await self.engine.step()
                await self._publish_step(output)
            elif self.draining:
                return
            else:
                self._work_arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._work_arrived.wait(), self.options.idle_poll_ms / 1000)

    # --- intake -------------------------------------------------------------------------

    async def _intake_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set() and not self._stopping:
            room = bundle_room(self.options, self.engine, self.max_in_flight, len(self.in_flight))
            if room <= 0:
                await asyncio.sleep(self.options.idle_poll_ms / 1000 / 4)
                continue
            entries = await self.consumer.read(room, self.options.idle_poll_ms)
            if entries:
                await self.admit(entries)

    async def admit(self, entries: list[StreamEntry]) -> None:
        """Hand a bundle to the engine; cancelled, invalid or unservable entries are
        answered (or dead-lettered) at once."""
        flags_pipe = self.client.pipeline(transaction=False)
        decoded: list[tuple[StreamEntry, Request]] = []
        pipe = self.client.pipeline(transaction=False)
        for entry in entries:
            try:
                if entry.payload is None:
                    raise ValidationError("message", f"entry has no '{PAYLOAD_FIELD}' field")
                request = decode_request(entry.payload, self.settings.limits)
            except ValidationError as exc:
                self.consumer.dead_letter(pipe, entry, str(exc))
                self.stats.num_dead_lettered += 1
                continue
            decoded.append((entry, request))
            flags_pipe.exists(self.keys.cancel_flag(request.id))
        cancelled = await flags_pipe.execute() if decoded else []
        now_wall_s = time.time()
        for (entry, request), is_cancelled in zip(decoded, cancelled, strict=True):
            self.stats.num_received += 1
            if request.id in self.in_flight:
                # A second entry for a request already running here (placed again after
                # this instance looked dead): the running copy answers; drop this one.
                self.consumer.ack(pipe, [entry.entry_id])
                continue
            spec = engine_spec(request)
            flight = InFlight(request=request, entry_id=entry.entry_id, received_at_s=now_wall_s,
                              prompt_tokens=spec.prompt_tokens)
            problem = "cancelled" if is_cancelled else self.engine.validate(spec)
            if problem is not None:
                self.replies.finish(pipe, flight, status="cancelled" if is_cancelled else "error",
                                    finish_reason="abort", error=None if is_cancelled else problem)
                self.consumer.ack(pipe, [entry.entry_id])
                continue
            self.engine.add_request(spec)
            self.in_flight[request.id] = flight
        if len(pipe):
            await pipe.execute()
        self._work_arrived.set()

    # --- output -------------------------------------------------------------------------

    async def _publish_step(self, output: EngineStepOutput) -> None:
        self.stats.lag_ms.append(output.lag_ms)
        self.beats.record_step(output)
        pipe = self.client.pipeline(transaction=False)
        now_wall_s = time.time()
        finished_ids: list[str] = []
        for event, flight in record_step_output(self.in_flight, output, now_wall_s):
            if event.finished:
                self.replies.flush(pipe, flight)
                self.replies.finish(pipe, flight, status="ok", finish_reason=event.finish_reason or "stop")
                self.consumer.ack(pipe, [flight.entry_id])
                finished_ids.append(event.request_id)
            elif event.is_first or flight.due_for_flush(now_wall_s, self.options.stream_interval_ms):
                self.replies.flush(pipe, flight)
        if len(pipe):
            await pipe.execute()
        # Finished requests leave `in_flight` only once their ACK is written: until then
        # they still count against the bundle room, so the queue's pending entries never
        # exceed what the engine holds.
        for request_id in finished_ids:
            self.in_flight.pop(request_id, None)
            self.beats.record_finished(request_id)
            self.stats.num_finished += 1

    # --- cancellation and heartbeats ----------------------------------------------------

    async def _cancel_loop(self, stop: asyncio.Event) -> None:
        last_id = "$"
        while not stop.is_set():
            reply = await self.client.xread({self.keys.cancellations: last_id}, count=100, block=500)
            if not reply:
                continue
            pipe = self.client.pipeline(transaction=False)
            for entry_id, fields in reply[0][1]:
                last_id = entry_id
                request_id = fields.get(PAYLOAD_FIELD.encode(), b"").decode()
                flight = self.in_flight.pop(request_id, None)
                if flight is None:
                    continue
                self.engine.abort_request(request_id)
                self.replies.flush(pipe, flight)
                self.replies.finish(pipe, flight, status="cancelled", finish_reason="abort")
                self.consumer.ack(pipe, [flight.entry_id])
                self.stats.num_cancelled += 1
            if len(pipe):
                await pipe.execute()

    async def _heartbeat_loop(self) -> None:
        interval_s = self.settings.heartbeat_interval_ms / 1000
        while not self._stopping:
            await self.publish_heartbeat("draining" if self.draining else "live")
            await asyncio.sleep(interval_s)

    async def publish_heartbeat(self, state: str) -> None:
        beat = self.beats.build(state, self.stats.lag_ms)
        payload = encode(beat)
        pipe = self.client.pipeline(transaction=False)
        pipe.xadd(self.keys.heartbeats, {PAYLOAD_FIELD: payload}, maxlen=20_000, approximate=True)
        pipe.hset(self.keys.instances, self.instance_id, payload)
        await pipe.execute()


def bundle_room(options: WorkerOptions, engine: Engine, max_in_flight: int, num_in_flight: int) -> int:
    """How many queue entries the intake may read now: at most a bundle, only what the
    engine can admit soon, and never more in flight than one engine's worth (<= 0: none)."""
    return min(options.bundle_size, engine.num_admittable(), max_in_flight - num_in_flight)


def engine_spec(request: Request) -> EngineRequestSpec:
    """``request`` as the engine is handed it."""
    prediction = request.prediction
    if prediction is not None:
        prompt_tokens = prediction.prompt_tokens
    elif isinstance(request.prompt, str):
        prompt_tokens = max(1, len(request.prompt) // 4)  # no predictor ran: a rough count
    else:
        prompt_tokens = len(request.prompt)
    return EngineRequestSpec(
        request_id=request.id, prompt=request.prompt, prompt_tokens=prompt_tokens,
        max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
        stop=request.stop, true_output_tokens=request.true_output_tokens,
        predicted_output_tokens=prediction.predicted_output_tokens if prediction else None,
        p90_tokens=prediction.p90_tokens if prediction else None)
