"""The dispatcher service: ``ready`` → choose an instance → ``inst:{id}``.

The decisions are :class:`~dispatcher.core.DispatcherCore`'s; this module is its I/O
shell: reading, writing, the lease and one ``now_s`` per batch (the wall clock). One
active leader per cluster (a lease in Redis); standbys wait for the lease. The leader
follows every heartbeat (plain XREAD: each dispatcher sees all beats; a beat the core
rejects is logged and skipped), reads ``ready`` in batches through the ``dispatch``
group, has the core place each request in order (each decision sees the previous ones)
and writes all queue XADDs, owner keys and ACKs of a batch in one transaction. Requests
that cannot be placed (no live instance) stay un-ACKed in memory (pending in ``ready``)
and are retried; they are never dropped. When an instance dies or stops, the entries
still in its queue are placed again on live instances.

Crashes and pauses:

* **Ownership.** Each placement sets ``owner:{id}`` (:func:`blockq.wire.output.set_owner`)
  in the transaction that queues the request; a re-placement moves it. So the entries a
  dead instance had already taken can be moved too: if its executor was only paused, its
  writes are refused when it resumes.
* **Fenced writes.** Every write of a leader is a MULTI/EXEC under WATCH of the lease key
  whose value is checked first (:meth:`dispatcher.lease.Lease.write_fenced`): a leader paused past its
  lease writes nothing when it resumes, drops what it held in memory (still pending in
  ``ready`` for the next leader) and goes back to standby. The lease value is new for
  each term, and it is released by compare-and-delete.
* **Silence it could not hear.** At the start of a term and after Redis errors, no
  instance is declared dead until ``dead_after_s`` after beats could be read again
  (:meth:`ClusterView.hear_again`), and each beat is dated by when it reached Redis (its
  entry id, against Redis' own clock), so a replayed beat 30 s old is not fresh.
* **Stable consumer name.** ``dispatcher_id`` is the consumer name in ``dispatch``: a
  restarted dispatcher under the same name reads its predecessor's pending entries first.

Metrics: :attr:`Dispatcher.metrics` (:mod:`dispatcher.metrics`); the leader's loop also
follows ``done`` for the forecast errors (:class:`dispatcher.metrics.DoneFollower`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog

from blockq.config import AutoscaleOptions, Settings
from blockq.engine_model.latency import StepLatencyModel
from blockq.engine_model.packed import warm_up as warm_up_packed_kernel
from blockq.wire.beats import decode_heartbeat
from blockq.wire.health import HealthPolicy, InstanceState
from blockq.wire.keys import GROUP_DISPATCH, GROUP_WORK, PAYLOAD_FIELD
from blockq.wire.output import queue_final, set_owner
from blockq.wire.protocol import Placement, Request, ValidationError, decode_request, encode
from blockq.wire.streams import GroupConsumer, StreamEntry, queue_redis_time, redis_time_ms
from dispatcher.admission import Infeasible, infeasible_final
from dispatcher.autoscale.service import AutoscalingService, create_autoscaling
from dispatcher.cluster_view import ClusterView
from dispatcher.core import DispatcherCore, Held, Placed
from dispatcher.lease import REDIS_UNAVAILABLE, Lease, LeaseLost, Pipeline
from dispatcher.metrics import DispatcherMetrics, DoneFollower
from dispatcher.queue_reads import read_queue
from dispatcher.what_if import DEFAULT_OBJECTIVE

log = structlog.get_logger(__name__)

GC_YOUNG_THRESHOLD = 20_000  # allocations between young-generation collections (CPython's default: 700)

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
                 clock: Callable[[], float] = time.time,
                 token_factory: Callable[[], str] | None = None) -> None:
        """``clock``: wall seconds, read once per batch of beats and once per batch of
        requests; the core decides with what it says. ``dispatcher_id``: the consumer
        name in ``dispatch`` (keep it across restarts). ``token_factory``: the random part
        of each term's lease value."""
        self.client = client
        self.clock = clock
        self.settings = settings
        self.core = core
        self.dispatcher_id = dispatcher_id
        self.options = options or DispatcherOptions()
        self.keys = settings.keys
        self.consumer = self._new_consumer()
        self.lease = Lease(client, self.keys.dispatcher_lease, dispatcher_id, self.options.lease_ms,
                           token_factory=token_factory)
        # Beats may have gone unread (new term, failed reads): the next read starts a grace.
        self._beats_unheard = False
        self._beats_read_at_s = float("-inf")
        self.unplaced: deque[tuple[StreamEntry, Request]] = deque()
        # Entry ids held in `unplaced`: a slow batch can outlive claim_idle_ms, and the
        # entries XAUTOCLAIM hands back then are ones this dispatcher already holds.
        self._unplaced_ids: set[str] = set()
        self._last_beat_id = "0-0"
        self._queues_to_redispatch: set[str] = set()
        self._last_num_placed = 0
        self.num_placed = 0
        self.autoscaling: AutoscalingService | None = None  # set by create_dispatcher with autoscale
        self.metrics = DispatcherMetrics(core, num_held=lambda: len(self.unplaced),
                                         is_leading=lambda: self.lease.token is not None)
        self.done_follower = DoneFollower(client, self.keys, self.metrics)

    def _new_consumer(self) -> GroupConsumer:
        # A new consumer reads this name's pending entries first: what a predecessor (or
        # this dispatcher before it dropped its batch) left un-ACKed.
        return GroupConsumer(self.client, self.keys.ready, GROUP_DISPATCH, self.dispatcher_id,
                             dead_letter_stream=self.keys.dead_letters, claim_idle_ms=self.settings.claim_idle_ms,
                             settings=self.settings)

    @property
    def view(self) -> ClusterView:
        return self.core.view

    @property
    def decision_ms(self) -> deque[float]:
        return self.core.stats.decision_ms

    # --- leadership ---------------------------------------------------------------------

    @property
    def lease_token(self) -> str | None:
        """The lease value of the current term; None: not leading."""
        return self.lease.token

    async def acquire_lease(self, stop: asyncio.Event) -> bool:
        """Wait until this dispatcher holds the leader lease (or ``stop``), then start a term."""
        if not await self.lease.acquire(stop):
            return False
        self._begin_term()
        return True

    async def renew_lease(self) -> bool:
        return await self.lease.renew()

    async def release_lease(self) -> bool:
        return await self.lease.release()

    def _begin_term(self) -> None:
        """A new term starts from what Redis holds, not from what this dispatcher knew when
        it last led: a fresh view rebuilt from the whole beat history (dated by age, with
        a grace), and this name's pending entries read first."""
        self._reset_after_interruption()
        self.done_follower.start_term()
        log.info("dispatcher_leader", dispatcher_id=self.dispatcher_id, lease=self.lease.token)

    def _reset_after_interruption(self) -> None:
        """Forget the batch in hand (its entries stay pending in ``ready`` under this
        consumer name) and the view (its assignments may include writes that never
        happened); the next reads rebuild both, and the beats read next start a grace."""
        self.unplaced.clear()
        self._unplaced_ids.clear()
        self._queues_to_redispatch.clear()
        self.view.forget(list(self.view.instances))
        self._last_beat_id = "0-0"
        self._beats_unheard = True
        self.consumer = self._new_consumer()

    def _step_down(self, reason: str) -> None:
        log.warning("dispatcher_lost_lease", dispatcher_id=self.dispatcher_id, reason=reason,
                    num_dropped=len(self.unplaced))
        self.lease.token = None
        self._reset_after_interruption()

    # --- main loop ----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Stand by for the lease, lead until it is lost, stand by again; until ``stop``."""
        await self.consumer.ensure_group()
        try:
            while await self.acquire_lease(stop):
                await self.lead(stop)
        finally:
            if self.autoscaling is not None:
                await self.autoscaling.close()
            with contextlib.suppress(*REDIS_UNAVAILABLE):
                await self.release_lease()

    async def lead(self, stop: asyncio.Event) -> None:
        """Run steps until ``stop`` or the end of the term. A Redis error does not end the
        term: the batch in hand is dropped (:meth:`_reset_after_interruption`), the loop
        backs off and retries, and the renewal after it says whether the term survived."""
        next_renew_s = time.monotonic() + self.options.lease_ms / 3000
        while not stop.is_set():
            try:
                if time.monotonic() >= next_renew_s:
                    if not await self.renew_lease():
                        raise LeaseLost("renewal refused")
                    next_renew_s = time.monotonic() + self.options.lease_ms / 3000
                await self.step()
            except LeaseLost as exc:
                self._step_down(str(exc))
                return
            except REDIS_UNAVAILABLE as exc:
                log.warning("dispatcher_redis_unavailable", error=str(exc))
                self._reset_after_interruption()
                next_renew_s = 0.0  # first thing after the outage: is the lease still ours?
                await asyncio.sleep(self.options.lease_ms / 3000)

    async def step(self) -> int:
        """One round: follow beats, re-place the queues of dead or stopped instances (the
        unread part of draining ones'), place a batch, size the fleet when due (autoscale).
        Returns the number of requests placed. Raises :class:`LeaseLost` when a write
        found the term over (nothing of it was written)."""
        await self.follow_heartbeats()
        self._queues_to_redispatch.update(self.core.refresh_health(self.clock()))
        for instance_id in sorted(self._queues_to_redispatch):
            view = self.view.instances.get(instance_id)
            health = view.health if view is not None else None
            # Draining: only what its worker has not read moves; what it took finishes there.
            if (health not in (InstanceState.DEAD, InstanceState.STOPPED, InstanceState.DRAINING)
                    or await self.redispatch_queue(instance_id, unread_only=health == InstanceState.DRAINING) is not None):
                self._queues_to_redispatch.discard(instance_id)
        entries: list[StreamEntry] = []
        if len(self.unplaced) < self.options.max_unplaced:
            # Requests in hand that could be placed: poll briefly. Only held (batch) work,
            # or none: block, so that held work does not spin the loop.
            block_ms = 1 if self.unplaced and self._last_num_placed else self.options.block_ms
            entries = await self.consumer.read(self.options.batch_size, block_ms, held_ids=self._unplaced_ids)
        elif not self.view.live_instances():
            await asyncio.sleep(self.options.block_ms / 1000)
        num_placed = await self.place_batch(entries)
        if self.autoscaling is not None:
            await self.autoscaling.step(self.clock(), len(self.unplaced))
        await self.done_follower.poll()
        return num_placed

    async def follow_heartbeats(self) -> None:
        """Apply every heartbeat published since the last call (non-blocking).

        Each beat is dated by when it reached Redis: its entry id (Redis' clock, in ms)
        against Redis' TIME, read in the same round trip, so neither the workers' clocks
        nor this host's enter the age. A read that succeeds after beats may have gone
        unheard starts a grace (:meth:`DispatcherCore.hear_again`): after a failed read,
        at the start of a term, or when more than half of ``dead_after_s`` passed since
        the previous read (Redis stalled, e.g. clients paused for a failover, or this
        process was). A beat that cannot be decoded or applied is logged, counted, skipped."""
        try:
            while True:
                pipe = self.client.pipeline(transaction=False)
                queue_redis_time(pipe, self.keys.heartbeats)  # the clock that stamped the beats
                pipe.xread({self.keys.heartbeats: self._last_beat_id}, count=1000)
                redis_time, reply = await pipe.execute()
                now_s = self.clock()
                if self._beats_unheard or now_s - self._beats_read_at_s > self.view.health_policy.dead_after_s / 2:
                    self._beats_unheard = False
                    self.core.hear_again(now_s)
                self._beats_read_at_s = now_s
                entries = reply[0][1] if reply else []
                for entry_id, fields in entries:
                    self._apply_beat_entry(entry_id.decode(), fields, now_s, redis_time_ms(redis_time))
                if len(entries) < 1000:
                    return
        except REDIS_UNAVAILABLE:
            self._beats_unheard = True
            raise

    def _apply_beat_entry(self, entry_id: str, fields: dict[bytes, bytes], now_s: float, redis_now_ms: int) -> None:
        self._last_beat_id = entry_id
        age_s = max(0, redis_now_ms - int(entry_id.split("-", 1)[0])) / 1000
        try:
            problem = self.core.apply_heartbeat(decode_heartbeat(fields[PAYLOAD_FIELD.encode()]), now_s,
                                                heard_at_s=now_s - age_s)
        except (ValueError, KeyError, TypeError) as exc:  # ValidationError is a ValueError
            problem = f"{type(exc).__name__}: {exc}"
            self.core.stats.num_beats_rejected += 1
        if problem is not None:
            log.warning("heartbeat_rejected", entry_id=entry_id, error=problem,
                        num_rejected=self.core.stats.num_beats_rejected)

    async def place_batch(self, entries: list[StreamEntry]) -> int:
        """Place retried and new requests in order; all writes in one fenced transaction
        (:meth:`Lease.write_fenced`). Held requests stay in memory, pending in ``ready``."""
        dead: list[tuple[StreamEntry, str]] = []
        num_offered_again = len(self.unplaced)
        for entry in entries:
            if entry.entry_id in self._unplaced_ids:
                continue
            try:
                if entry.payload is None:
                    raise ValidationError("message", f"entry has no '{PAYLOAD_FIELD}' field")
                self.unplaced.append((entry, decode_request(entry.payload, self.settings.limits, keys=self.keys)))
                self._unplaced_ids.add(entry.entry_id)
            except ValidationError as exc:
                dead.append((entry, str(exc)))
        queued = list(self.unplaced)
        self.unplaced.clear()
        placed: list[tuple[StreamEntry, Request]] = []
        refused: list[tuple[StreamEntry, Infeasible]] = []
        now_s = self.clock()
        if self.autoscaling is not None:  # the arrivals it forecasts from: new requests only
            self.autoscaling.observe([request for _, request in queued[num_offered_again:]], now_s)
        outcomes = self.core.place([r for _, r in queued], now_s)
        self.metrics.record_placed(outcomes)
        for (entry, _), outcome in zip(queued, outcomes, strict=True):
            if isinstance(outcome, Held):
                self.unplaced.append((entry, outcome.request))
            elif isinstance(outcome, Placed):
                placed.append((entry, outcome.request))
            elif isinstance(outcome, Infeasible):
                refused.append((entry, outcome))
            else:
                dead.append((entry, outcome.reason))
        if placed or dead or refused:
            await self.lease.write_fenced(lambda pipe: self._queue_batch_writes(pipe, placed, dead, refused, now_s))
        for entry, _ in [*placed, *dead, *refused]:
            self._unplaced_ids.discard(entry.entry_id)
        self._last_num_placed = len(placed)
        self.num_placed += len(placed)
        return len(placed)

    def _queue_batch_writes(self, pipe: Pipeline, placed: list[tuple[StreamEntry, Request]],
                            dead: list[tuple[StreamEntry, str]], refused: list[tuple[StreamEntry, Infeasible]],
                            now_s: float) -> None:
        for entry, reason in dead:
            self.consumer.dead_letter(pipe, entry, reason)
        for entry, outcome in refused:
            # Answered, not failed: the client learns at once, with the best forecast.
            request = outcome.request
            queue_final(pipe, self.keys, request.id, request.reply_stream, "",
                        encode(infeasible_final(outcome, now_s)), None, self.settings.reply_ttl_s)
            self.consumer.ack(pipe, [entry.entry_id])
            log.info("request_infeasible", request_id=request.id, reason=outcome.reason)
        for entry, request in placed:
            self._queue_placement(pipe, request)
            self.consumer.ack(pipe, [entry.entry_id])

    def _queue_placement(self, pipe: Pipeline, request: Request) -> None:
        """Hand ``request``'s output to its instance and queue it there, on ``pipe``."""
        instance_id = request.assignment.instance_id  # type: ignore[union-attr]
        set_owner(pipe, self.keys, request.id, instance_id, self.settings.reply_ttl_s)
        pipe.xadd(self.keys.instance_queue(instance_id), {PAYLOAD_FIELD: encode(request)})
        # The client learns where its request went, and the forecast, before its first token.
        pipe.xadd(request.reply_stream, {PAYLOAD_FIELD: encode(Placement.of(request))})
        pipe.expire(request.reply_stream, self.settings.reply_ttl_s)

    async def redispatch_queue(self, instance_id: str, *, unread_only: bool = False) -> int | None:
        """Move every entry left in a dead or stopped instance's queue, unread or taken
        (pending), to live instances, moving each request's owner in the same transaction:
        an executor of the old instance that still runs is refused its writes, so moving
        what it had taken cannot answer a request twice. Held requests (batch work, no
        idle capacity) go back to ``ready``; rejected ones stay. The moved entries are
        also ACKed in the old queue's ``work`` group, so a worker that comes back under
        that id does not resume them. ``unread_only`` (a draining instance): only what its
        worker has not read (:func:`read_queue`). Returns how many were placed, or None
        when no instance is live (the caller retries later)."""
        queue = self.keys.instance_queue(instance_id)
        if not self.view.live_instances():
            return None
        entries = await read_queue(self.client, queue, unread_only=unread_only)
        decoded: list[tuple[bytes, Request]] = []
        for entry_id, fields in entries:
            try:
                decoded.append((entry_id, decode_request(fields.get(PAYLOAD_FIELD.encode()), self.settings.limits,
                                                          keys=self.keys)))
            except ValidationError:
                continue  # the worker dead-letters it if it ever comes back
        outcomes = self.core.replace_unstarted(instance_id, [r for _, r in decoded], self.clock())
        self.metrics.record_placed(outcomes)
        moved = [(entry_id, o.request) for (entry_id, _), o in zip(decoded, outcomes, strict=True)
                 if isinstance(o, Placed)]
        returned = [(entry_id, o.request) for (entry_id, _), o in zip(decoded, outcomes, strict=True)
                    if isinstance(o, Held)]
        if moved or returned:
            await self.lease.write_fenced(lambda pipe: self._queue_moves(pipe, queue, moved, returned))
        log.warning("instance_queue_replaced", instance=instance_id, unread_only=unread_only,
                    moved=len(moved), returned_to_ready=len(returned))
        return len(moved)

    def _queue_moves(self, pipe: Pipeline, queue: str, moved: list[tuple[bytes, Request]],
                     returned: list[tuple[bytes, Request]]) -> None:
        for _, request in moved:
            self._queue_placement(pipe, request)
        for _, request in returned:
            pipe.xadd(self.keys.ready, {PAYLOAD_FIELD: encode(request)})
        entry_ids = [entry_id for entry_id, _ in [*moved, *returned]]
        pipe.xack(queue, GROUP_WORK, *entry_ids)
        pipe.xdel(queue, *entry_ids)


def prepare_for_decisions(core: DispatcherCore, *, autoscales: bool = False) -> None:
    """Start-up work that would otherwise land inside early or random decisions: load
    the compiled simulation code (policies that simulate; the autoscaler's forecasts when
    ``autoscales``), then take every object alive so far out of the collector's view and
    collect the young generation less often.
    A full collection over the start-up heap took 50-70 ms in ``blockq dispatch-bench``,
    far more than a decision."""
    if core.simulates or autoscales:
        warm_up_packed_kernel()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def create_dispatcher(client: aioredis.Redis, settings: Settings, policy_name: str, *, dispatcher_id: str,
                      seed: int | None = None, objective: str = DEFAULT_OBJECTIVE,
                      options: DispatcherOptions | None = None,
                      autoscale: AutoscaleOptions | None = None,
                      prior_latency_model: StepLatencyModel | None = None) -> Dispatcher:
    """A dispatcher whose core runs the named policy, timing decisions on the wall clock;
    with ``autoscale``, its leader also sizes the fleet (:mod:`dispatcher.autoscale.service`)
    against the cluster's TTFT objective (3 s when the cluster has none)."""
    options = options or DispatcherOptions()
    core = DispatcherCore(policy_name, seed=seed, objective=objective, timer=time.perf_counter,
                          slo_ttft_ms=settings.slo_ttft_ms or None, prior_latency_model=prior_latency_model,
                          health_policy=HealthPolicy(heartbeat_interval_s=settings.heartbeat_interval_ms / 1000,
                                                     dead_after_s=options.dead_after_s))
    dispatcher = Dispatcher(client, settings, core, dispatcher_id=dispatcher_id, options=options)
    if autoscale is not None:
        dispatcher.autoscaling = create_autoscaling(client, settings.keys, core, dispatcher.lease, autoscale,
                                                    slo_ttft_s=(settings.slo_ttft_ms or 3000) / 1000, seed=seed or 0,
                                                    registry=dispatcher.metrics.registry)
    return dispatcher
