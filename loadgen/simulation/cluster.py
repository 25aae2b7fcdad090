"""A cluster in virtual time: discrete events over N simulated instances and the
dispatcher core.

The dispatcher is :class:`~dispatcher.core.DispatcherCore`, the object the live service
drives; here it is driven as the live service's loop would drive it: beats are applied
as they arrive while it is idle (or before its next batch while it is busy), requests
are read in batches of up to ``dispatch_batch_size`` and placed with one ``now_s`` per
batch, the batch's writes land after all of its decisions, and held requests are
offered again whenever a beat arrives. Instances are
:class:`~loadgen.simulation.instance.SimulatedInstance`.

Events are ordered by (time, sequence number), so a run is a pure function of its
inputs and seed.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from blockq.wire.beats import Heartbeat
from blockq.wire.health import InstanceState
from blockq.wire.protocol import FinalRecord, Request
from dispatcher.admission import Infeasible, infeasible_final
from dispatcher.core import DispatcherCore, Held, Placed
from loadgen.simulation.config import SimulationConfig
from loadgen.simulation.instance import SimulatedInstance
from loadgen.summaries import KvSample
from workers.engines.emulated import EmulatedEngineOptions
from workers.intake import WorkerOptions
from workers.refinement import RefinementSource

# Event kinds, in the order same-time events are handled.
_STEP_END, _INTAKE, _ENQUEUE, _BEAT, _BEAT_ARRIVES, _ARRIVE, _DISPATCH_DONE, _SCALE = range(8)


@dataclass
class ClusterResult:
    """Final records by request id, the reasons of the requests the dispatcher rejected
    (by id), KV samples from the beats, and counts."""

    finals: dict[str, FinalRecord]
    rejected: dict[str, str]
    kv_samples: list[KvSample]
    num_events: int
    end_s: float
    counters: dict[str, int] = field(default_factory=dict)
    delivery_samples_ms: list[float] = field(default_factory=list)  # the beats' delivery p90s
    num_missed: int = 0     # answers that missed the TTFT objective (or were not ``ok``)
    # The forecast check's changes of trust, in order: instance, trusted, when (model s
    # from the first request), the instance's answers scored and the fleet's answers then.
    trust_changes: list[dict[str, Any]] = field(default_factory=list)
    aborted: bool = False   # stopped early: more than ``abort_after_misses`` missed


class ClusterSimulation:
    """One run: ``run(arrivals)`` with (arrival time s, annotated request) pairs."""

    def __init__(self, config: SimulationConfig, *, refinements: RefinementSource | None = None,
                 instance_prefix: str = "") -> None:
        """``instance_prefix`` starts every instance id (a cell's name, where several cells
        run side by side: :mod:`loadgen.simulation.multi_cell`)."""
        self.config = config
        self.refinements = refinements  # running requests' refined lengths, as workers report them
        self.now_s = 0.0
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.core = DispatcherCore(config.policy, seed=config.seed, objective=config.objective,
                                   slo_ttft_ms=config.slo_ttft_ms, forecast_check=config.forecast_check,
                                   num_simulated_candidates=config.num_simulated_candidates)
        self._rng = random.Random(config.seed)
        self._worker_options = WorkerOptions(bundle_size=config.bundle_size, idle_poll_ms=int(config.idle_poll_ms))
        self.instances: dict[str, SimulatedInstance] = {}
        for index in range(config.instances):
            self.add_instance(f"{instance_prefix}gpu{index}", 0.0)
        self._ready: deque[Request] = deque()
        self._held: list[Request] = []
        self._pending_beats: list[Heartbeat] = []
        self._dispatcher_busy = False
        self._intake_scheduled: set[str] = set()
        self._num_expected = 0
        self._abort_after_misses: int | None = None
        self.result = ClusterResult({}, {}, [], 0, 0.0)
        self._handlers = (self._on_step_end, self._on_intake, self._on_enqueue, self._on_beat,
                          self._on_beat_arrives, self._on_arrive, self._on_dispatch_done, self._on_scale)

    def add_instance(self, instance_id: str, up_at_s: float) -> SimulatedInstance:
        """A new instance whose worker beats from ``up_at_s`` on (its engine started)."""
        config = self.config
        overrides = (("enable_prefix_caching", True),) if config.prefix_caching else ()
        index = len(self.instances)
        served = config.served.engine_options(index)  # its model and adapters
        options = EmulatedEngineOptions(preset=config.preset_of(index), noise_sigma=config.noise_sigma,
                                        stream_tokens=False, time_scale=config.time_scale,
                                        seed=self._rng.randrange(2**31),
                                        **{**served, "config_overrides": overrides + served.get("config_overrides", ())})
        clock: Callable[[], float] = lambda: self.now_s  # noqa: E731 - the instance's wall clock
        # The last slow_instances of the first fleet are slow (not gpu0: a long-prompt lane).
        slow = config.instances - config.slow_instances <= index < config.instances
        instance = self.instances[instance_id] = SimulatedInstance.create(
            instance_id, options, self._worker_options, clock, self.refinements,
            slow_factor=config.slow_factor if slow else 1.0, slow_published=config.slow_published,
            slow_hidden=config.slow_hidden)
        # Beats start at a random phase, as independently started workers do.
        self._push(up_at_s + self._rng.random() * config.heartbeat_ms / 1000, _BEAT, instance_id)
        return instance

    # --- the loop -----------------------------------------------------------------------

    def run(self, arrivals: Sequence[tuple[float, Request]],
            on_progress: Callable[[int, int], None] | None = None, *,
            abort_after_misses: int | None = None) -> ClusterResult:
        """Simulate until every request is answered. Arrival times are model seconds from
        the first request, submitted on the wall clock as a replay submits them (model time
        × ``time_scale``), after the instances' ``warmup_s``. ``abort_after_misses``: stop
        early (``aborted``) once more answers than that missed the TTFT objective."""
        self._abort_after_misses = abort_after_misses
        warmup_s, time_scale = self.config.warmup_s, self.config.time_scale
        ingress_s, sigma = self.config.ingress_delay_ms / 1000, self.config.ingress_delay_sigma
        rng = random.Random(f"ingress-{self.config.seed}")
        readable_at_s = -math.inf
        for arrival_s, request in arrivals:
            delay_s = ingress_s * math.exp(rng.gauss(0.0, sigma)) if sigma else ingress_s
            # The way in is a chain of streams: a request is never read before one submitted
            # earlier (independent draws alone would reorder them, and round robin's result
            # depends on the order).
            readable_at_s = max(readable_at_s, warmup_s + arrival_s * time_scale + delay_s)
            self._push(readable_at_s, _ARRIVE, request)
        self._num_expected = len(arrivals)
        handlers = (self._on_step_end, self._on_intake, self._on_enqueue, self._on_beat,
                    self._on_beat_arrives, self._on_arrive, self._on_dispatch_done, self._on_scale)
        result = self.result
        num_answered = 0
        events = self._events
        while events and num_answered < self._num_expected:
            time_s, _, kind, payload = heapq.heappop(events)
            self.now_s = time_s
            result.num_events += 1
            handlers[kind](payload)
            answered = len(result.finals) + len(result.rejected)
            if answered != num_answered:
                num_answered = answered
                if on_progress is not None:
                    on_progress(num_answered, self._num_expected)
                if abort_after_misses is not None and result.num_missed > abort_after_misses:
                    result.aborted = True
                    break
        result.end_s = self.now_s
        result.counters = self._counters()
        return result

    # --- driven from outside (several cells behind a front: loadgen.simulation.multi_cell) ----

    def next_event_s(self) -> float:
        """When the next event happens (inf: none left)."""
        return self._events[0][0] if self._events else math.inf

    def handle_next_event(self) -> None:
        """Handle the next event, as :meth:`run` does (no progress, no abort)."""
        time_s, _, kind, payload = heapq.heappop(self._events)
        self.now_s = time_s
        self.result.num_events += 1
        self._handlers[kind](payload)

    def submit(self, readable_at_s: float, request: Request) -> None:
        """A request the dispatcher can read from ``readable_at_s`` (the caller keeps the
        ingress order); :attr:`num_answered` counts it once answered."""
        self._push(readable_at_s, _ARRIVE, request)
        self._num_expected += 1

    @property
    def cores(self) -> list[DispatcherCore]:
        return [self.core]

    @property
    def num_answered(self) -> int:
        return len(self.result.finals) + len(self.result.rejected)

    @property
    def num_unplaced(self) -> int:
        """Requests the dispatcher holds: what the live leader counts as unplaced."""
        return len(self._held)

    def finish(self) -> ClusterResult:
        self.result.end_s = self.now_s
        self.result.counters = self._counters()
        return self.result

    def _on_scale(self, payload: Any) -> None:
        """Autoscaling decisions (a subclass's): none here."""

    def _answer(self, final: FinalRecord) -> None:
        if final.request_id in self.result.finals:  # the simulation's own invariant: one answer each
            raise RuntimeError(f"{final.request_id}: answered twice")
        self.result.finals[final.request_id] = final
        # The live dispatcher scores done records as it reads them (within a second).
        change = self.core.observe_answer(final)
        if change is not None:
            self.result.trust_changes.append({
                "instance": change.instance_id, "trusted": change.trusted,
                "at_s": round((self.now_s - self.config.warmup_s) / self.config.time_scale, 3),
                "num_observed": change.num_observed, "num_answered": len(self.result.finals),
                "ttft_mape": change.ttft_mape, "e2e_mape": change.e2e_mape})
        if final.status != "ok" or final.ttft_ms is None or final.ttft_ms > self.config.slo_ttft_ms:
            self.result.num_missed += 1

    def _push(self, time_s: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time_s, self._seq, kind, payload))

    # --- dispatcher ---------------------------------------------------------------------

    def _on_arrive(self, request: Request) -> None:
        self._ready.append(request)
        if not self._dispatcher_busy:
            self._dispatch()

    def _on_beat_arrives(self, beat: Heartbeat) -> None:
        if self._dispatcher_busy:
            self._pending_beats.append(beat)
            return
        self.core.apply_heartbeat(beat, self.now_s)
        if beat.state != InstanceState.LIVE:  # it drains or stopped: its unread queue goes elsewhere
            for instance_id in self.core.refresh_health(self.now_s):
                self._replace_queue(self.instances[instance_id])
        if self._held:
            self._dispatch()

    def _replace_queue(self, instance: SimulatedInstance) -> None:
        """What the live dispatcher does with a draining or stopped instance's unread
        queue entries: places them again on the live instances."""
        queued = list(instance.queue)
        instance.queue.clear()
        placed: list[Request] = []
        for outcome in self.core.replace_unstarted(instance.instance_id, queued, self.now_s):
            if isinstance(outcome, Placed):
                placed.append(outcome.request)
            elif isinstance(outcome, Held):
                self._held.append(outcome.request)
            else:
                self.result.rejected[outcome.request.id] = getattr(outcome, "reason", "not placed")
        queue_s = self.config.queue_delay_ms / 1000
        for request in placed:
            self._push(self.now_s + queue_s, _ENQUEUE, request)

    def _on_dispatch_done(self, written: tuple[list[Request], list[Infeasible]]) -> None:
        placed, infeasible = written
        for outcome in infeasible:
            self._answer(infeasible_final(outcome, self.now_s))
        queue_s = self.config.queue_delay_ms / 1000
        for request in placed:
            self._push(self.now_s + queue_s, _ENQUEUE, request)
        self._dispatcher_busy = False
        if self._ready:
            self._dispatch()

    def _dispatch(self) -> None:
        """One dispatcher loop iteration: beats, then held and new requests, one now_s."""
        now_s = self.now_s
        for beat in self._pending_beats:
            self.core.apply_heartbeat(beat, now_s)
        self._pending_beats.clear()
        for instance_id in self.core.refresh_health(now_s):
            self._replace_queue(self.instances[instance_id])
        batch = self._held
        for _ in range(min(self.config.dispatch_batch_size, len(self._ready))):
            batch.append(self._ready.popleft())
        self._held = []
        placed: list[Request] = []
        infeasible: list[Infeasible] = []
        for outcome in self.core.place(batch, now_s):
            if isinstance(outcome, Placed):
                placed.append(outcome.request)
            elif isinstance(outcome, Held):
                self._held.append(outcome.request)
            elif isinstance(outcome, Infeasible):
                infeasible.append(outcome)
            else:
                self.result.rejected[outcome.request.id] = outcome.reason
        if not batch:
            return
        self._dispatcher_busy = True
        self._push(now_s + len(batch) * self.config.decision_s, _DISPATCH_DONE, (placed, infeasible))

    # --- instances ----------------------------------------------------------------------

    def _on_enqueue(self, request: Request) -> None:
        if request.assignment is None:
            raise RuntimeError(f"{request.id}: enqueued without an assignment")
        instance = self.instances[request.assignment.instance_id]
        instance.queue.append(request)
        if instance.intake_blocked_since_s is None:  # the intake waits in XREAD: it reads at once
            self._take(instance)
        else:
            self._schedule_intake(instance)

    def _on_intake(self, instance_id: str) -> None:
        self._intake_scheduled.discard(instance_id)
        self._take(self.instances[instance_id])

    def _take(self, instance: SimulatedInstance) -> None:
        for final in instance.take_from_queue(self.now_s):
            self._answer(final)
        if not instance.stepping:
            self._start_step(instance)

    def _start_step(self, instance: SimulatedInstance) -> None:
        end_s = instance.start_step()
        if end_s is not None:
            # A late end moves the engine's clock on when the step is finished, as live.
            self._push(end_s + self.config.step_lag_ms / 1000, _STEP_END, instance.instance_id)

    def _on_step_end(self, instance_id: str) -> None:
        instance = self.instances[instance_id]
        for final in instance.finish_step(self.now_s):
            self._answer(final)
        self._start_step(instance)
        self._schedule_intake(instance)
        if instance.state == InstanceState.DRAINING and instance.is_idle:
            self._stop(instance)

    def _schedule_intake(self, instance: SimulatedInstance) -> None:
        if instance.instance_id in self._intake_scheduled:
            return
        check_s = instance.next_intake_check_s(self.now_s)
        if check_s is not None:
            self._intake_scheduled.add(instance.instance_id)
            self._push(check_s, _INTAKE, instance.instance_id)

    def drain(self, instance: SimulatedInstance) -> None:
        """Stop the instance's intake (as SIGTERM does a worker's): what it runs finishes,
        its beats say ``draining``, then ``stopped`` once it is idle."""
        if instance.state != InstanceState.LIVE:
            return
        instance.state = InstanceState.DRAINING
        if instance.is_idle:
            self._stop(instance)

    def _stop(self, instance: SimulatedInstance) -> None:
        """The drained instance is done: its next beat says ``stopped`` and is its last."""
        instance.state = InstanceState.STOPPED
        self._on_stopped(instance)

    def _on_stopped(self, instance: SimulatedInstance) -> None:
        """An instance stopped (a subclass accounts for it)."""

    def _on_beat(self, instance_id: str) -> None:
        instance = self.instances[instance_id]
        if instance.sent_last_beat:
            return
        instance.sent_last_beat = instance.state == InstanceState.STOPPED
        beat = instance.heartbeat()
        num_blocks = instance.engine.config.num_gpu_blocks
        at_s = (self.now_s - self.config.warmup_s) / self.config.time_scale  # model time, as a replay samples
        self.result.kv_samples.append(KvSample(at_s, instance_id,
                                               beat.num_used_blocks / num_blocks))
        if beat.delivery_p90_ms is not None:
            self.result.delivery_samples_ms.append(beat.delivery_p90_ms)
        self._push(self.now_s + self.config.heartbeat_delay_ms / 1000, _BEAT_ARRIVES, beat)
        if not instance.sent_last_beat:
            self._push(self.now_s + self.config.heartbeat_ms / 1000, _BEAT, instance_id)

    def _counters(self) -> dict[str, int]:
        stats = self.core.stats
        instances = self.instances.values()
        # The engines' own prefix-cache counters (zero without prefix caching), in prompt tokens.
        engine_stats = [instance.engine.engine_stats() for instance in instances]
        return {"events": self.result.num_events, "steps": sum(i.counters.num_steps for i in instances),
                "beats": sum(i.counters.num_beats for i in instances),
                "beats_rejected": stats.num_beats_rejected, "placed": stats.num_placed,
                "held": stats.num_held, "rejected": stats.num_rejected, "infeasible": stats.num_infeasible,
                "prefix_cache_queries_tokens": sum(s["prefix_cache_queries_total"] for s in engine_stats),
                "prefix_cache_hits_tokens": sum(s["prefix_cache_hits_total"] for s in engine_stats),
                "adapter_loads": sum(i.engine.scheduler.num_lora_loads for i in instances)}
