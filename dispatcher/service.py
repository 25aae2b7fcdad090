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
* **A new term knows the fleet** from the registry of instances, and reads only the
  latest beats, not the whole capped history, which took longer than the lease
  (:mod:`dispatcher.beat_reads`).
* **Long queues move in chunks** between which the lease is renewed
  (:mod:`dispatcher.replacement`).
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
from blockq.forecast_check import ForecastCheckOptions
from blockq.wire.health import HealthPolicy
from blockq.wire.keys import GROUP_DISPATCH, PAYLOAD_FIELD
from blockq.wire.output import queue_final
from blockq.wire.protocol import DoneRecord, Request, ValidationError, decode_request, encode
from blockq.wire.streams import GroupConsumer, StreamEntry
from dispatcher.admission import Infeasible, infeasible_final
from dispatcher.autoscale.service import AutoscalingService, create_autoscaling
from dispatcher.beat_reads import BeatFollower
from dispatcher.cell_load import CellLoadPublisher
from dispatcher.cluster_view import ClusterView
from dispatcher.core import DispatcherCore, Held, Placed
from dispatcher.lease import REDIS_UNAVAILABLE, Lease, LeaseLost, Pipeline
from dispatcher.metrics import DispatcherMetrics, DoneFollower
from dispatcher.policies.shortlist import DEFAULT_SIMULATED_CANDIDATES
from dispatcher.policies.shortlist_kernel import warm_up as warm_up_shortlist_kernel
from dispatcher.replacement import DEFAULT_CHUNK_ENTRIES, QueueReplacer, queue_placement
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
    replace_chunk_entries: int = DEFAULT_CHUNK_ENTRIES  # queue entries re-placed per step at most
    # Candidates a simulating policy simulates per decision at most (0: every live instance;
    # None: by the fleet's size, dispatcher.policies.shortlist.default_size).
    num_simulated_candidates: int | None = DEFAULT_SIMULATED_CANDIDATES

    def __post_init__(self) -> None:
        if self.num_simulated_candidates is not None and self.num_simulated_candidates < 0:
            raise ValueError(f"num_simulated_candidates: must be >= 0 (got {self.num_simulated_candidates})")


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
        # The beat stream and the registry; it reads this dispatcher's clock as it is now.
        self.beats = BeatFollower(self.keys, core, lambda: self.clock())
        self.unplaced: deque[tuple[StreamEntry, Request]] = deque()
        # Entry ids held in `unplaced`: a slow batch can outlive claim_idle_ms, and the
        # entries XAUTOCLAIM hands back then are ones this dispatcher already holds.
        self._unplaced_ids: set[str] = set()
        self._last_num_placed = 0
        self.num_placed = 0
        self.autoscaling: AutoscalingService | None = None  # set by create_dispatcher with autoscale
        self.metrics = DispatcherMetrics(core, num_held=lambda: len(self.unplaced),
                                         is_leading=lambda: self.lease.token is not None)
        self.done_follower = DoneFollower(client, self.keys, self.metrics, on_record=self._check_forecast)
        # The cell's load for the fronts that route between cells (blockq.cells).
        self.cell_load = CellLoadPublisher(client, self.keys, core, interval_s=settings.cell_load_interval_ms / 1000,
                                           dispatcher_id=dispatcher_id)
        # A step's share of re-placement: a sixth of the lease, renewed every third of it.
        self.replacer = QueueReplacer(client, settings, core, self.lease, record=self.metrics.record_placed,
                                      time_budget_s=self.options.lease_ms / 6000,
                                      chunk_entries=self.options.replace_chunk_entries)

    def _new_consumer(self) -> GroupConsumer:
        # A new consumer reads this name's pending entries first: what a predecessor (or
        # this dispatcher before it dropped its batch) left un-ACKed.
        return GroupConsumer(self.client, self.keys.ready, GROUP_DISPATCH, self.dispatcher_id,
                             dead_letter_stream=self.keys.dead_letters, claim_idle_ms=self.settings.claim_idle_ms,
                             settings=self.settings)

    def _check_forecast(self, record: DoneRecord) -> None:
        """Score a ``done`` record's forecast; log each change of an instance's trust."""
        change = self.core.observe_answer(record)
        if change is not None:
            log.warning("instance_untrusted" if not change.trusted else "instance_trusted_again",
                        instance_id=change.instance_id, reason=change.reason, num_observed=change.num_observed,
                        fallback=self.core.forecast_check.options.fallback)

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
        it last led: a fresh view seeded from the registry of instances and the latest
        beats (dated by age, with a grace), and this name's pending entries read first."""
        self._reset_after_interruption()
        self.done_follower.start_term()
        self.cell_load.restart()
        log.info("dispatcher_leader", dispatcher_id=self.dispatcher_id, lease=self.lease.token)

    def _reset_after_interruption(self) -> None:
        """Forget the batch in hand (its entries stay pending in ``ready`` under this
        consumer name) and the view (its assignments may include writes that never
        happened); the next reads rebuild both, and the beats read next start a grace."""
        self.unplaced.clear()
        self._unplaced_ids.clear()
        self.replacer.clear()
        self.view.forget(list(self.view.instances))
        self.beats.restart()
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
        """One round: follow beats, re-place a chunk of the queues of dead or stopped
        instances (the unread part of draining ones'), place a batch, size the fleet when
        due (autoscale). Returns the number of requests placed. Raises :class:`LeaseLost`
        when a write found the term over (nothing of it was written)."""
        caught_up = await self.follow_heartbeats()
        now_s = self.clock()
        self.replacer.add(self.core.refresh_health(now_s))
        await self.replacer.step(now_s, self.beats.bus_now_s(now_s))
        entries: list[StreamEntry] = []
        if len(self.unplaced) < self.options.max_unplaced:
            # Requests in hand that could be placed, queues being moved or beats left to
            # read: poll briefly. Only held (batch) work, or none: block, so that held work
            # does not spin the loop.
            busy = (self.unplaced and self._last_num_placed) or self.replacer.pending or not caught_up
            entries = await self.consumer.read(self.options.batch_size, 1 if busy else self.options.block_ms,
                                               held_ids=self._unplaced_ids)
        elif not self.view.live_instances():
            await asyncio.sleep(self.options.block_ms / 1000)
        num_placed = await self.place_batch(entries)
        if self.autoscaling is not None:
            await self.autoscaling.step(self.clock(), len(self.unplaced))
        await self.done_follower.poll()
        await self.cell_load.step(self.clock(), len(self.unplaced))
        return num_placed

    async def follow_heartbeats(self) -> bool:
        """Apply the heartbeats published since the last call, one bounded read of them
        (non-blocking), dated by Redis' clock; at the start of a term, seed the view from
        the registry first (:class:`dispatcher.beat_reads.BeatFollower`). A beat that
        cannot be decoded or applied is logged, counted, skipped. True when caught up
        with the beat stream."""
        return await self.beats.follow(self.client)

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
        outcomes = self.core.place([r for _, r in queued], now_s, bus_now_s=self.beats.bus_now_s(now_s))
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
            queue_placement(pipe, self.keys, request, self.settings.reply_ttl_s)
            self.consumer.ack(pipe, [entry.entry_id])


def prepare_for_decisions(core: DispatcherCore, *, autoscales: bool = False) -> None:
    """Start-up work that would otherwise land inside early or random decisions: load
    the compiled simulation code (policies that simulate; the autoscaler's forecasts when
    ``autoscales``), then take every object alive so far out of the collector's view and
    collect the young generation less often.
    A full collection over the start-up heap took 50-70 ms in ``blockq dispatch-bench``,
    far more than a decision."""
    if core.simulates or autoscales:
        warm_up_packed_kernel()
        warm_up_shortlist_kernel()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def create_dispatcher(client: aioredis.Redis, settings: Settings, policy_name: str, *, dispatcher_id: str,
                      seed: int | None = None, objective: str = DEFAULT_OBJECTIVE,
                      options: DispatcherOptions | None = None,
                      autoscale: AutoscaleOptions | None = None,
                      prior_latency_model: StepLatencyModel | None = None,
                      forecast_check: ForecastCheckOptions | None = None) -> Dispatcher:
    """A dispatcher whose core runs the named policy, timing decisions on the wall clock;
    with ``autoscale``, its leader also sizes the fleet (:mod:`dispatcher.autoscale.service`)
    against the cluster's TTFT objective (3 s when the cluster has none)."""
    options = options or DispatcherOptions()
    core = DispatcherCore(policy_name, seed=seed, objective=objective, timer=time.perf_counter,
                          slo_ttft_ms=settings.slo_ttft_ms or None, prior_latency_model=prior_latency_model,
                          forecast_check=forecast_check, prefix_scheme=settings.prefix_scheme,
                          num_simulated_candidates=options.num_simulated_candidates,
                          health_policy=HealthPolicy(heartbeat_interval_s=settings.heartbeat_interval_ms / 1000,
                                                     dead_after_s=options.dead_after_s))
    dispatcher = Dispatcher(client, settings, core, dispatcher_id=dispatcher_id, options=options)
    if autoscale is not None:
        dispatcher.autoscaling = create_autoscaling(client, settings.keys, core, dispatcher.lease, autoscale,
                                                    slo_ttft_s=(settings.slo_ttft_ms or 3000) / 1000, seed=seed or 0,
                                                    registry=dispatcher.metrics.registry)
    return dispatcher
