"""Autoscaling in the dispatcher leader: the pure policy of :mod:`dispatcher.autoscale`
run every ``cycle_s`` on the leader's view of the fleet, its decisions written to Redis
for the actuators.

Each cycle (while leading; :meth:`AutoscalingService.step`, called from the placement
loop):

1. **The fleet.** :meth:`DispatcherCore.fleet_snapshot` (live and draining instances
   with their replicas), plus the instances asked for and not live yet as ``starting``:
   ``target - live`` synthetic entries (``starting-K``), expected to serve ``startup_s``
   after the target last rose. The dispatcher cannot name them (an actuator picks their
   ids) and need not: a starting instance is an empty engine either way. Live instances
   this leader asked to drain are shown ``draining`` until their own beat says so.
2. **The decision.** :meth:`Autoscaler.decide` (the rules apply there), logged as one
   ``autoscale_decision`` line.
3. **The writes**, in one transaction: ``autoscaler:desired`` = the target,
   ``autoscaler:drain`` = JSON list of the live instances to drain first (the decision
   shrank the fleet; else ``[]``), and the decision on the capped stream
   ``autoscaler:decisions``. They go through :meth:`Lease.write_fenced`, like
   placements: decisions are advisory (an actuator may drain other instances than the
   ones named), but a leader paused past its term must not resize the fleet its
   successor sizes, and the fenced helper makes that free.
4. **The actuators** this process runs: the command hook (when the target changed, or
   at a term's first decision when Redis held none) and the metrics
   (:mod:`dispatcher.autoscale.actuators`).

A new term starts from Redis: the target from ``autoscaler:desired`` (the local
supervisor seeds it with the fleet it starts), the last scale-up and scale-down times
from the decisions stream (cooldowns survive a failover), and its first decision one
cycle after it began, once the beats have been heard.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import redis.asyncio as aioredis
import structlog
from prometheus_client import CollectorRegistry

from blockq.config import AutoscaleOptions
from blockq.wire.health import InstanceState
from blockq.wire.keys import DECISION_FIELD, Keys
from blockq.wire.protocol import Request
from dispatcher.autoscale import (
    DRAINING,
    LIVE,
    ActionHistory,
    Autoscaler,
    FleetSnapshot,
    ScalingDecision,
    drain_order,
    make_autoscaler,
)
from dispatcher.autoscale.actuators import AutoscaleMetrics, ScaleCommand
from dispatcher.core import DispatcherCore
from dispatcher.lease import Lease, Pipeline

log = structlog.get_logger(__name__)

MAX_DECISIONS_STREAM = 1000
NUM_DECISIONS_KEPT = 100  # in memory (Autoscaler.decisions); the stream keeps the rest
_NEW_TERM = object()


def make_live_autoscaler(options: AutoscaleOptions, *, slo_ttft_s: float, seed: int = 0) -> Autoscaler:
    """The autoscaler ``options`` describe (:func:`dispatcher.autoscale.make_autoscaler`,
    the one the simulation runs). ``slo_ttft_s``: the TTFT objective it keeps."""
    return make_autoscaler(options.scaler, options.rules, cycle_s=options.cycle_s, startup_s=options.startup_s,
                           slo_ttft_s=slo_ttft_s, seed=seed, max_decisions=NUM_DECISIONS_KEPT)


def starting_instances(target: int | None, num_serving: int, num_joining: int, ready_at_s: float) -> dict[str, float]:
    """Synthetic ``starting`` entries (id → ready time) for a fleet whose target is
    ``target`` while ``num_serving`` instances are live (not asked to drain). Without a
    target (none in Redis yet), the instances seen joining or suspect."""
    num_starting = max(0, target - num_serving) if target is not None else num_joining
    return {f"starting-{k}": ready_at_s for k in range(num_starting)}


def with_draining(snapshot: FleetSnapshot, instance_ids: set[str]) -> FleetSnapshot:
    """``snapshot`` with the live instances in ``instance_ids`` shown draining."""
    if not instance_ids:
        return snapshot
    return replace(snapshot, instances=tuple(
        replace(state, status=DRAINING) if state.status == LIVE and state.instance_id in instance_ids else state
        for state in snapshot.instances))


def instances_to_drain(decision: ScalingDecision, snapshot: FleetSnapshot) -> list[str]:
    """The live instances a shrinking ``decision`` drains first (:func:`drain_order`);
    the starting ones it cancels first are not named (an actuator stops its newest)."""
    if decision.target >= decision.current:
        return []
    leaving = drain_order(snapshot)[:decision.current - decision.target]
    live = {state.instance_id for state in snapshot.with_status(LIVE)}
    return [instance_id for instance_id in leaving if instance_id in live]


def decision_record(decision: ScalingDecision, drain: list[str]) -> dict[str, Any]:
    """The decision as the stream and the log carry it: strict JSON (an infinite P99,
    a forecast with no first token, is written as the string ``"inf"``)."""
    return _json_safe({**decision.as_dict(), "direction": decision.direction, "drain": drain})


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


class AutoscalingService:
    """The leader's autoscaling loop (see the module docstring). ``step`` is called from
    the placement loop with the dispatcher's clock; it decides at most once per cycle."""

    def __init__(self, client: aioredis.Redis, keys: Keys, core: DispatcherCore, lease: Lease,
                 autoscaler: Autoscaler, options: AutoscaleOptions, *,
                 metrics: AutoscaleMetrics | None = None, command: ScaleCommand | None = None) -> None:
        self.client = client
        self.keys = keys
        self.core = core
        self.lease = lease
        self.autoscaler = autoscaler
        self.options = options
        self.metrics = metrics
        self.command = command
        self.target: int | None = None       # the size last asked for (None: unknown)
        self._raised_at_s = 0.0              # when the target last rose: starting ones serve startup_s later
        self._asked_to_drain: set[str] = set()
        self._not_before_s = math.inf
        self._term: object = _NEW_TERM

    def observe(self, requests: list[Request], now_s: float) -> None:
        """Requests the dispatcher read for the first time at ``now_s`` (not re-offers)."""
        for request in requests:
            self.autoscaler.observe(request, now_s)

    async def step(self, now_s: float, num_unplaced: int) -> ScalingDecision | None:
        """Decide and write when a cycle is due; None when it was not. Raises what a
        fenced write raises (:class:`~dispatcher.lease.LeaseLost`: nothing written)."""
        if self._term is _NEW_TERM or self.lease.token != self._term:
            await self._begin_term(now_s)
        if now_s < self._not_before_s or not self.autoscaler.due(now_s):
            return None
        try:
            snapshot = self.snapshot(now_s, num_unplaced)
            decision = self.autoscaler.decide(snapshot)
            drain = instances_to_drain(decision, snapshot)
            record = decision_record(decision, drain)
        except Exception:  # a fault in the policy must not stop placement: said, retried next cycle
            log.exception("autoscale_decision_failed")
            self._not_before_s = now_s + self.options.cycle_s
            return None
        await self.lease.write_fenced(lambda pipe: self._queue_writes(pipe, decision.target, drain, record))
        log.info("autoscale_decision", **record)
        previous, self.target = self.target, decision.target
        if previous is None or decision.target > previous:
            self._raised_at_s = now_s
        self._asked_to_drain.update(drain)
        if self.metrics is not None:
            self.metrics.record(decision)
        if self.command is not None and decision.target != previous:
            self.command.request(decision.target)
        return decision

    def snapshot(self, now_s: float, num_unplaced: int) -> FleetSnapshot:
        """The fleet as this cycle's decision sees it (see the module docstring, 1.)."""
        views = list(self.core.view.instances.values())
        live = {view.instance_id for view in views if view.health == LIVE}
        # Marks last until the instance stops being live, or the fleet reached the target
        # whichever instances left (an actuator such as a StatefulSet picks its own).
        self._asked_to_drain &= live
        if self.target is not None and len(live) <= self.target:
            self._asked_to_drain.clear()
        # Known only from the registry of instances (a new term): not heard, not joining.
        num_joining = sum(1 for view in views
                          if view.health in (InstanceState.JOINING, InstanceState.SUSPECT) and view.heard)
        starting = starting_instances(self.target, len(live - self._asked_to_drain), num_joining,
                                      self._raised_at_s + self.options.startup_s)
        return with_draining(self.core.fleet_snapshot(now_s, starting, num_unplaced), self._asked_to_drain)

    def _queue_writes(self, pipe: Pipeline, target: int, drain: list[str], record: dict[str, Any]) -> None:
        pipe.set(self.keys.autoscaler_desired, target)
        pipe.set(self.keys.autoscaler_drain, json.dumps(drain))
        pipe.xadd(self.keys.autoscaler_decisions, {DECISION_FIELD: json.dumps(record)},
                  maxlen=MAX_DECISIONS_STREAM, approximate=True)

    async def _begin_term(self, now_s: float) -> None:
        """Start a term from what Redis holds (see the module docstring)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self.keys.autoscaler_desired)
        pipe.xrevrange(self.keys.autoscaler_decisions, count=NUM_DECISIONS_KEPT)
        desired, recent = await pipe.execute()
        try:
            self.target = int(desired) if desired is not None else None
        except ValueError:
            log.warning("autoscale_desired_unreadable", value=repr(desired))
            self.target = None
        actions = ActionHistory()
        for _, fields in reversed(recent):
            try:
                record = json.loads(fields[DECISION_FIELD.encode()])
                if record.get("direction") in ("up", "down"):
                    actions.record(record["direction"], float(record["at_s"]))
            except (KeyError, TypeError, ValueError):
                continue  # not ours to fail on: an entry written by someone else
        self.autoscaler.actions = actions
        self._raised_at_s = now_s
        self._asked_to_drain.clear()
        self._not_before_s = now_s + self.options.cycle_s
        self._term = self.lease.token
        log.info("autoscale_term", target=self.target, last_up_s=actions.last_up_s, last_down_s=actions.last_down_s)

    async def close(self) -> None:
        """Stop the actuators this process runs (a command in progress is killed)."""
        if self.command is not None:
            await self.command.close()


def create_autoscaling(client: aioredis.Redis, keys: Keys, core: DispatcherCore, lease: Lease,
                       options: AutoscaleOptions, *, slo_ttft_s: float, seed: int = 0,
                       registry: CollectorRegistry | None = None) -> AutoscalingService:
    """The service ``options`` describe; its metrics go on ``registry`` (the dispatcher's;
    none without one)."""
    metrics = AutoscaleMetrics(registry, lambda: lease.token is not None) if registry is not None else None
    command = ScaleCommand(options.scale_command, options.scale_command_timeout_s) if options.scale_command else None
    return AutoscalingService(client, keys, core, lease, make_live_autoscaler(options, slo_ttft_s=slo_ttft_s, seed=seed),
                              options, metrics=metrics, command=command)
