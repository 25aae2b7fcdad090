"""A cluster simulation whose fleet an :class:`~dispatcher.autoscale.Autoscaler` sizes.

Every ``cycle_s`` the autoscaler sees the fleet as the dispatcher core does
(:meth:`~dispatcher.core.DispatcherCore.fleet_snapshot`: the replicas, plus the instances
still starting) and its decision is carried out as the local actuator carries it out:

* grow: new instances start at once and beat (take requests) ``startup_s`` later;
* shrink: in :func:`~dispatcher.autoscale.drain_order`: a starting instance is cancelled
  at once; a live one drains (its intake stops, its unread queue is placed again by the
  dispatcher, what it runs finishes) and stops when idle.

An instance costs GPU time from the moment it is started until it stopped (or the run
ended), start-up included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from blockq.wire.health import InstanceState
from blockq.wire.protocol import Request
from dispatcher.autoscale import LIVE, Autoscaler, ScalingDecision, drain_order
from loadgen.simulation.cluster import _SCALE, ClusterSimulation
from loadgen.simulation.config import SimulationConfig
from loadgen.simulation.instance import SimulatedInstance


@dataclass
class FleetTimeline:
    """When each instance was started and stopped, and the decisions taken."""

    started_at_s: dict[str, float] = field(default_factory=dict)
    stopped_at_s: dict[str, float] = field(default_factory=dict)
    decisions: Sequence[ScalingDecision] = ()   # the autoscaler's own record

    def gpu_hours(self, end_s: float) -> float:
        return sum(self.stopped_at_s.get(i, end_s) - at_s for i, at_s in self.started_at_s.items()) / 3600

    def size_at(self, at_s: float) -> int:
        """Instances started and not stopped at ``at_s`` (start-up included)."""
        return sum(1 for i, start_s in self.started_at_s.items()
                   if start_s <= at_s < self.stopped_at_s.get(i, float("inf")))

    def actions(self) -> list[tuple[float, str]]:
        return [(d.at_s, d.direction) for d in self.decisions if d.direction is not None]


class AutoscaledSimulation(ClusterSimulation):
    """``config.instances`` to start with (beating from the start), then what the
    autoscaler decides."""

    def __init__(self, config: SimulationConfig, autoscaler: Autoscaler, *, startup_s: float) -> None:
        super().__init__(config)
        self.autoscaler = autoscaler
        self.startup_s = startup_s
        self.timeline = FleetTimeline(started_at_s=dict.fromkeys(self.instances, 0.0),
                                      decisions=autoscaler.decisions)
        self._starting: dict[str, float] = {}
        self._num_created = len(self.instances)
        # The first decision after one cycle of arrivals and beats, as a freshly started scaler's.
        self._push(config.warmup_s + autoscaler.cycle_s, _SCALE, None)

    def _on_arrive(self, request: Request) -> None:
        self.autoscaler.observe(request, self.now_s)
        super()._on_arrive(request)

    def _on_scale(self, payload: Any) -> None:
        now_s = self.now_s
        live = {view.instance_id for view in self.core.view.instances.values() if view.health == LIVE}
        self._starting = {i: at_s for i, at_s in self._starting.items() if i not in live}
        snapshot = self.core.fleet_snapshot(now_s, self._starting, len(self._ready) + len(self._held))
        decision = self.autoscaler.decide(snapshot)
        if decision.target > decision.current:
            for _ in range(decision.target - decision.current):
                instance_id = f"gpu{self._num_created}"
                self._num_created += 1
                self.add_instance(instance_id, now_s + self.startup_s)
                self._starting[instance_id] = now_s + self.startup_s
                self.timeline.started_at_s[instance_id] = now_s
        elif decision.target < decision.current:
            for instance_id in drain_order(snapshot)[:decision.current - decision.target]:
                self._shrink(self.instances[instance_id])
        self._push(now_s + self.autoscaler.cycle_s, _SCALE, None)

    def _shrink(self, instance: SimulatedInstance) -> None:
        if self._starting.pop(instance.instance_id, None) is not None:
            instance.state = InstanceState.STOPPED  # cancelled before its first beat: it never beats
            instance.sent_last_beat = True
            self._on_stopped(instance)
        else:
            self.drain(instance)

    def _on_stopped(self, instance: SimulatedInstance) -> None:
        self.timeline.stopped_at_s[instance.instance_id] = self.now_s
