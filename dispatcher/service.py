"""The dispatcher service: ``ready`` → choose an instance → ``inst:{id}``.

The decisions are :class:`~dispatcher.core.DispatcherCore`'s; this module is its I/O
shell: reading, writing, the lease and one ``now_s`` per batch (the wall clock). One
active leader per cluster (a lease in Redis); standbys wait for the lease. The leader
follows every heartbeat (plain XREAD: each dispatcher sees all beats; a beat the core
rejects is logged and skipped), reads ``ready`` in batches through the ``dispatch``
group, has the core place each request in order (each decision sees the previous ones)
and writes all queue XADDs and ACKs of a batch in one pipeline. Requests that cannot be
placed (no live instance) stay un-ACKed in memory and are retried; they are never
dropped. When an instance dies, the entries still in its queue are placed again on live
instances.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog

from blockq.config import Settings
from blockq.engine_model.packed import warm_up as warm_up_packed_kernel
from blockq.health import HealthPolicy
from blockq.keys import GROUP_DISPATCH, PAYLOAD_FIELD
from blockq.protocol import Request, ValidationError, decode_heartbeat, decode_request, encode
from blockq.streams import GroupConsumer, StreamEntry
from dispatcher.cluster_view import ClusterView
from dispatcher.core import DispatcherCore, Held, Placed

log = structlog.get_logger(__name__)

GC_YOUNG_THRESHOLD = 20_000  # allocations between young-generation collections (CPython's default: 700)

# Lease renewal: extend only while we still hold it.
_RENEW_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


@dataclass(frozen=True)
class DispatcherOptions:
    batch_size: int = 128
    block_ms: int = 20
    lease_ms: int = 3000
    dead_after_s: float = 5.0
    max_unplaced: int = 10_000


class Dispatcher:
    """Places annotated requests on instances with a :class:`DispatcherCore`."""

    def __init__(self, client: aioredis.Redis, settings: Settings, core: DispatcherCore, *,
                 dispatcher_id: str, options: DispatcherOptions | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """``clock``: wall seconds, read once per batch of beats and once per batch of
        requests; the core decides with what it says."""
        self.client = client
        self.clock = clock
        self.settings = settings
        self.core = core
        self.dispatcher_id = dispatcher_id
        self.options = options or DispatcherOptions()
        self.keys = settings.keys
        self.consumer = GroupConsumer(client, self.keys.ready, GROUP_DISPATCH, dispatcher_id,
                                      dead_letter_stream=self.keys.dead_letters,
                                      claim_idle_ms=settings.claim_idle_ms)
        self.unplaced: deque[tuple[StreamEntry, Request]] = deque()
        # Entry ids held in `unplaced`: a slow batch can outlive claim_idle_ms, and the
        # entries XAUTOCLAIM hands back then are ones this dispatcher already holds.
        self._unplaced_ids: set[str] = set()
        self._last_beat_id = "0-0"
        self._queues_to_redispatch: set[str] = set()
        self._last_num_placed = 0
        self._renew_lease = client.register_script(_RENEW_LEASE)
        self.num_placed = 0

    @property
    def view(self) -> ClusterView:
        return self.core.view

    @property
    def decision_ms(self) -> deque[float]:
        return self.core.stats.decision_ms

    # --- leadership ---------------------------------------------------------------------

    async def acquire_lease(self, stop: asyncio.Event) -> bool:
        """Wait until this dispatcher holds the leader lease (or ``stop``)."""
        while not stop.is_set():
            if await self.client.set(self.keys.dispatcher_lease, self.dispatcher_id, nx=True,
                                     px=self.options.lease_ms):
                log.info("dispatcher_leader", dispatcher_id=self.dispatcher_id)
                return True
            await asyncio.sleep(self.options.lease_ms / 3000)
        return False

    async def renew_lease(self) -> bool:
        return bool(await self._renew_lease(keys=[self.keys.dispatcher_lease],
                                            args=[self.dispatcher_id, self.options.lease_ms]))

    # --- main loop ----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        await self.consumer.ensure_group()
        if not await self.acquire_lease(stop):
            return
        next_renew_s = time.monotonic() + self.options.lease_ms / 3000
        try:
            while not stop.is_set():
                if time.monotonic() >= next_renew_s:
                    if not await self.renew_lease():
                        log.warning("dispatcher_lost_lease", dispatcher_id=self.dispatcher_id)
                        if not await self.acquire_lease(stop):
                            return
                    next_renew_s = time.monotonic() + self.options.lease_ms / 3000
                await self.step()
        finally:
            if await self.client.get(self.keys.dispatcher_lease) == self.dispatcher_id.encode():
                await self.client.delete(self.keys.dispatcher_lease)

    async def step(self) -> int:
        """One round: follow beats, re-place the queues of dead instances, place a batch.
        Returns the number of requests placed."""
        await self.follow_heartbeats()
        self._queues_to_redispatch.update(self.core.refresh_health(self.clock()))
        for instance_id in sorted(self._queues_to_redispatch):
            if self.view.instances[instance_id].health != "dead" or await self.redispatch_queue(instance_id) is not None:
                self._queues_to_redispatch.discard(instance_id)
        entries: list[StreamEntry] = []
        if len(self.unplaced) < self.options.max_unplaced:
            # Requests in hand that could be placed: poll briefly. Only held (batch) work,
            # or none: block, so that held work does not spin the loop.
            block_ms = 1 if self.unplaced and self._last_num_placed else self.options.block_ms
            entries = await self.consumer.read(self.options.batch_size, block_ms)
        elif not self.view.live_instances():
            await asyncio.sleep(self.options.block_ms / 1000)
        return await self.place_batch(entries)

    async def follow_heartbeats(self) -> None:
        """Apply every heartbeat published since the last call (non-blocking)."""
        while True:
            reply = await self.client.xread({self.keys.heartbeats: self._last_beat_id}, count=1000)
            if not reply:
                return
            now_s = self.clock()
            for entry_id, fields in reply[0][1]:
                self._last_beat_id = entry_id.decode()
                try:
                    problem = self.core.apply_heartbeat(decode_heartbeat(fields[PAYLOAD_FIELD.encode()]), now_s)
                except (ValidationError, KeyError, TypeError) as exc:
                    problem = f"{type(exc).__name__}: {exc}"
                    self.core.stats.num_beats_rejected += 1
                if problem is not None:
                    log.warning("heartbeat_rejected", entry_id=self._last_beat_id, error=problem,
                                num_rejected=self.core.stats.num_beats_rejected)
            if len(reply[0][1]) < 1000:
                return

    async def place_batch(self, entries: list[StreamEntry]) -> int:
        """Place retried and new requests in order; one pipeline for all writes."""
        pipe = self.client.pipeline(transaction=False)
        for entry in entries:
            if entry.entry_id in self._unplaced_ids:
                continue
            try:
                if entry.payload is None:
                    raise ValidationError("message", f"entry has no '{PAYLOAD_FIELD}' field")
                self.unplaced.append((entry, decode_request(entry.payload, self.settings.limits)))
                self._unplaced_ids.add(entry.entry_id)
            except ValidationError as exc:
                self.consumer.dead_letter(pipe, entry, str(exc))
        queued = list(self.unplaced)
        self.unplaced.clear()
        num_placed = 0
        now_s = self.clock()
        for (entry, _), outcome in zip(queued, self.core.place([r for _, r in queued], now_s), strict=True):
            if isinstance(outcome, Held):
                self.unplaced.append((entry, outcome.request))
                continue
            self._unplaced_ids.discard(entry.entry_id)
            if isinstance(outcome, Placed):
                placed = outcome.request
                pipe.xadd(self.keys.instance_queue(placed.assignment.instance_id),  # type: ignore[union-attr]
                          {PAYLOAD_FIELD: encode(placed)})
                self.consumer.ack(pipe, [entry.entry_id])
                num_placed += 1
            else:
                self.consumer.dead_letter(pipe, entry, outcome.reason)
        self._last_num_placed = num_placed
        if len(pipe):
            await pipe.execute()
        self.num_placed += num_placed
        return num_placed

    async def redispatch_queue(self, instance_id: str) -> int | None:
        """Move every entry left in a dead instance's queue to live instances; returns how
        many, or None when no instance is live (the caller retries later)."""
        queue = self.keys.instance_queue(instance_id)
        if not self.view.live_instances():
            return None
        entries = await self.client.xrange(queue, count=100_000)
        decoded: list[tuple[bytes, Request]] = []
        for entry_id, fields in entries:
            try:
                decoded.append((entry_id, decode_request(fields.get(PAYLOAD_FIELD.encode()), self.settings.limits)))
            except ValidationError:
                continue  # the worker dead-letters it if it ever comes back
        outcomes = self.core.replace_unstarted(instance_id, [r for _, r in decoded], self.clock())
        pipe = self.client.pipeline(transaction=False)
        moved = 0
        for (entry_id, _), outcome in zip(decoded, outcomes, strict=True):
            if not isinstance(outcome, Placed):
                continue  # stays in the dead queue, visible in `blockq status`
            placed = outcome.request
            pipe.xadd(self.keys.instance_queue(placed.assignment.instance_id),  # type: ignore[union-attr]
                      {PAYLOAD_FIELD: encode(placed)})
            pipe.xdel(queue, entry_id)
            moved += 1
        if moved:
            await pipe.execute()
        log.warning("instance_dead_requeued", instance=instance_id, moved=moved)
        return moved


def prepare_for_decisions(core: DispatcherCore) -> None:
    """Start-up work that would otherwise land inside early or random decisions: load
    the compiled simulation code (policies that simulate), then take every object alive
    so far out of the collector's view and collect the young generation less often.
    A full collection over the start-up heap took 50-70 ms in ``blockq dispatch-bench``,
    far more than a decision."""
    if core.simulates:
        warm_up_packed_kernel()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def create_dispatcher(client: aioredis.Redis, settings: Settings, policy_name: str, *, dispatcher_id: str,
                      seed: int | None = None, objective: str = "e2e",
                      options: DispatcherOptions | None = None) -> Dispatcher:
    """A dispatcher whose core runs the named policy, timing decisions on the wall clock."""
    options = options or DispatcherOptions()
    core = DispatcherCore(policy_name, seed=seed, objective=objective, timer=time.perf_counter,
                          health_policy=HealthPolicy(heartbeat_interval_s=settings.heartbeat_interval_ms / 1000,
                                                     dead_after_s=options.dead_after_s))
    return Dispatcher(client, settings, core, dispatcher_id=dispatcher_id, options=options)
