"""What-if simulation: how a request would fare on an instance, and what it would cost
the requests already there. Pure; drives the engine model's own scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from blockq.engine_model import EngineRequest, EngineScheduler
from dispatcher.replica import InstanceReplica

OBJECTIVES = ("e2e", "ttft", "max_latency")


@dataclass(frozen=True, slots=True)
class Forecast:
    """Model-time seconds from the decision. ``added_delay_s`` sums, over the requests
    already on the instance, how much later each finishes because of the new one."""

    ttft_s: float
    e2e_s: float
    added_delay_s: float
    max_latency_s: float
    num_preemptions: int

    def score(self, objective: str) -> float:
        """Lower is better."""
        if objective == "e2e":
            return self.e2e_s + self.added_delay_s
        if objective == "ttft":
            return self.ttft_s
        return self.max_latency_s


@dataclass(frozen=True)
class Baseline:
    """One replica's future without the new request: the snapshot where a request
    appended now would first be looked at (:meth:`EngineScheduler.queue_drain_snapshot`;
    every what-if run is identical to the baseline up to there), and the finish time of
    every request still unfinished at that point."""

    snapshot: EngineScheduler
    finish_s: dict[str, float]


class BaselineCache:
    """Baselines, simulated once per replica version (a replica advancing along its own
    deterministic trajectory keeps its version, and its future)."""

    def __init__(self) -> None:
        self._by_replica: dict[int, tuple[int, Baseline]] = {}

    def baseline(self, replica: InstanceReplica) -> Baseline:
        cached = self._by_replica.get(id(replica))
        if cached is not None and cached[0] == replica.version:
            return cached[1]
        snapshot = replica.scheduler.queue_drain_snapshot()
        baseline = Baseline(snapshot, snapshot.clone().simulate().finished_at_s)
        self._by_replica[id(replica)] = (replica.version, baseline)
        return baseline


def forecast(replica: InstanceReplica, request: EngineRequest, baseline: Baseline) -> Forecast:
    """Simulate ``request`` added to ``replica`` now, until every request finishes.

    The run starts from the baseline's snapshot (exactly where it would diverge) or from
    the present, whichever is later, with the request's arrival at the present."""
    now_s = replica.scheduler.now_s
    # The snapshot was taken when the baseline was computed; once the replica has moved
    # past it (the queue has drained since), the divergence point is now.
    start = baseline.snapshot if baseline.snapshot.now_s >= now_s else replica.scheduler
    scheduler = start.clone()
    request.arrival_s = now_s
    scheduler.add_request(request)
    simulation = scheduler.simulate()
    baseline_finish_s = baseline.finish_s
    finished = simulation.finished_at_s
    new_finish_s = finished[request.request_id]
    added_delay_s = 0.0
    for request_id, finish_s in finished.items():
        before_s = baseline_finish_s.get(request_id)
        if before_s is not None and finish_s > before_s:
            added_delay_s += finish_s - before_s
    return Forecast(
        ttft_s=simulation.first_token_at_s.get(request.request_id, new_finish_s) - now_s,
        e2e_s=new_finish_s - now_s, added_delay_s=added_delay_s,
        max_latency_s=max(finished.values()) - now_s, num_preemptions=simulation.num_preemptions)
