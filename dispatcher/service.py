"""The dispatcher service: ``ready`` → choose an instance → ``inst:{id}``.

One active leader per cluster (a lease in Redis); standbys wait for the lease. The
leader follows every heartbeat (plain XREAD: each dispatcher sees all beats), reads
``ready`` in batches through the ``dispatch`` group, places each request in order (each
decision sees the previous ones through the cluster view) and writes all queue XADDs
and ACKs of a batch in one pipeline. Requests that cannot be placed (no live instance)
stay un-ACKed in memory and are retried; they are never dropped. When an instance
dies, the entries still in its queue are placed again on live instances.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections import deque
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog

from blockq.config import Settings
from blockq.engine_model.packed import warm_up as warm_up_packed_kernel
from blockq.health import HealthPolicy
from blockq.keys import GROUP_DISPATCH, PAYLOAD_FIELD
from blockq.protocol import (
    Assignment,
    Request,
    ValidationError,
    decode_heartbeat,
    decode_request,
    encode,
)
from blockq.streams import GroupConsumer, StreamEntry
from dispatcher.cluster_view import ClusterView, InstanceView
from dispatcher.policies import TRUE_LENGTH_POLICIES, Policy, make_policy
from dispatcher.priority import eligible_candidates

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
    """Places annotated requests on instances with a :class:`Policy`."""

    def __init__(self, client: aioredis.Redis, settings: Settings, policy: Policy, cluster_view: ClusterView, *,
                 dispatcher_id: str, options: DispatcherOptions | None = None) -> None:
        self.client = client
        self.settings = settings
        self.policy = policy
        self.view = cluster_view
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
        self._queues_to_redispatch: dict[str, InstanceView] = {}
        self._last_num_placed = 0
        self._renew_lease = client.register_script(_RENEW_LEASE)
        self.num_placed = 0
        self.decision_ms: deque[float] = deque(maxlen=10_000)

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
        for dead in self.view.refresh_health(time.time()):
            self._queues_to_redispatch[dead.instance_id] = dead
        for instance_id, dead in list(self._queues_to_redispatch.items()):
            if dead.health != "dead" or await self.redispatch_queue(dead) is not None:
                del self._queues_to_redispatch[instance_id]
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
            now_s = time.time()
            for entry_id, fields in reply[0][1]:
                self._last_beat_id = entry_id.decode()
                try:
                    self.view.apply_heartbeat(decode_heartbeat(fields[PAYLOAD_FIELD.encode()]), now_s)
                except (ValidationError, KeyError, TypeError) as exc:
                    log.warning("bad_heartbeat", entry_id=self._last_beat_id, error=str(exc))
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
        live = self.view.live_instances()
        num_placed = 0
        held: deque[tuple[StreamEntry, Request]] = deque()
        while self.unplaced and live:
            entry, request = self.unplaced.popleft()
            candidates = eligible_candidates(request, live)
            if not candidates:  # batch work waits for idle capacity; interactive work goes on
                held.append((entry, request))
                continue
            self._unplaced_ids.discard(entry.entry_id)
            try:
                placed = self._assign(request, candidates)
            except ValueError as exc:  # the policy cannot place this request (e.g. oracle without truth)
                self.consumer.dead_letter(pipe, entry, f"placement failed: {exc}")
                continue
            pipe.xadd(self.keys.instance_queue(placed.assignment.instance_id), {PAYLOAD_FIELD: encode(placed)})
            self.consumer.ack(pipe, [entry.entry_id])
            num_placed += 1
        self.unplaced.extendleft(reversed(held))
        self._last_num_placed = num_placed
        if len(pipe):
            await pipe.execute()
        self.num_placed += num_placed
        return num_placed

    def _assign(self, request: Request, candidates: list[InstanceView]) -> Request:
        started = time.perf_counter()
        now_s = time.time()
        decision = self.policy.choose(request, candidates, now_s)
        decision_ms = (time.perf_counter() - started) * 1000
        self.decision_ms.append(decision_ms)
        placed = request.with_assignment(Assignment(
            instance_id=decision.instance_id, policy=self.policy.name, decided_at_s=now_s,
            decision_ms=decision_ms, predicted_ttft_ms=decision.predicted_ttft_ms,
            predicted_e2e_ms=decision.predicted_e2e_ms))
        self.view.record_assignment(decision.instance_id, placed)
        log.debug("placed", request_id=request.id, instance=decision.instance_id, decision_ms=decision_ms)
        return placed

    async def redispatch_queue(self, dead: InstanceView) -> int | None:
        """Move every entry left in a dead instance's queue to live instances; returns how
        many, or None when no instance is live (the caller retries later)."""
        queue = self.keys.instance_queue(dead.instance_id)
        candidates = self.view.live_instances()
        if not candidates:
            return None
        entries = await self.client.xrange(queue, count=100_000)
        pipe = self.client.pipeline(transaction=False)
        moved = 0
        for entry_id, fields in entries:
            payload = fields.get(PAYLOAD_FIELD.encode())
            try:
                request = decode_request(payload, self.settings.limits)
            except ValidationError:
                continue  # the worker dead-letters it if it ever comes back
            try:
                placed = self._assign(request, candidates)
            except ValueError:
                continue  # stays in the dead queue, visible in `blockq status`
            pipe.xadd(self.keys.instance_queue(placed.assignment.instance_id), {PAYLOAD_FIELD: encode(placed)})
            pipe.xdel(queue, entry_id)
            moved += 1
        if moved:
            await pipe.execute()
        dead.assigned_not_seen.clear()
        log.warning("instance_dead_requeued", instance=dead.instance_id, moved=moved)
        return moved


def prepare_for_decisions(view: ClusterView) -> None:
    """Start-up work that would otherwise land inside early or random decisions: load
    the compiled simulation code (policies that simulate), then take every object alive
    so far out of the collector's view and collect the young generation less often.
    A full collection over the start-up heap took 50-70 ms in ``blockq dispatch-bench``,
    far more than a decision."""
    if view.keep_replicas:
        warm_up_packed_kernel()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def create_dispatcher(client: aioredis.Redis, settings: Settings, policy_name: str, *, dispatcher_id: str,
                      seed: int | None = None, objective: str = "e2e",
                      options: DispatcherOptions | None = None) -> Dispatcher:
    """A dispatcher with its cluster view and the named policy sharing that view."""
    options = options or DispatcherOptions()
    view = ClusterView(HealthPolicy(heartbeat_interval_s=settings.heartbeat_interval_ms / 1000,
                                    dead_after_s=options.dead_after_s),
                       use_true_lengths=policy_name in TRUE_LENGTH_POLICIES)
    policy = make_policy(policy_name, view, seed=seed, objective=objective)
    return Dispatcher(client, settings, policy, view, dispatcher_id=dispatcher_id, options=options)
