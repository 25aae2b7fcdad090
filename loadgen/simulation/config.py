"""What a cluster simulation models, in one validated place.

The simulation's clock is the cluster's wall clock, as the live services read it: the
heartbeat period, the delays, the intake's polls and the dispatcher's replica resyncs are
wall-clock seconds or milliseconds (``_s``, ``_ms``). The emulated engines run
``time_scale`` wall seconds per model second, as ``blockq bench --time-scale`` runs them,
and every reported latency is model time: ``time_scale`` 1 (the default) is a cluster at
real speed; 2 mirrors a bench run at ``--time-scale 2``, where the same wall-clock pipeline
costs half as much model time. The delays stand for what the live pipeline adds between
its parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from blockq.engine_model.fleet_spec import FleetSpec
from blockq.forecast_check import ForecastCheckOptions
from dispatcher.policies import policy_spec
from dispatcher.policies.shortlist import DEFAULT_SIMULATED_CANDIDATES
from dispatcher.what_if import DEFAULT_OBJECTIVE, OBJECTIVES
from loadgen.simulation.served import ServedModels

# One placement decision, ms (p50 of `blockq dispatch-bench --instances 16 --running 48
# --waiting 20`, one core: docs/results/decision-cost.md). A policy not listed
# costs the simulating policies' figure when it simulates, else the static rules'.
DECISION_COST_MS = {
    "round_robin": 0.003, "random": 0.004, "least_requests": 0.010, "least_kv": 0.021,
    "llumnix": 0.025, "power_of_two": 0.085, "block": 0.393, "block_kv_guard": 0.396, "oracle": 0.341,
}


@dataclass(frozen=True)
class SimulationConfig:
    """One simulated cluster run.

    ``ingress_delay_ms``: from a client's submit until the dispatcher can read the
    annotated request (the predictor stage and two stream hops): the median of a lognormal
    with ``ingress_delay_sigma`` (0: the same for every request), in submit order (a request
    is never readable before an earlier one). ``heartbeat_ms`` /
    ``heartbeat_delay_ms``: a worker's beat period, and how long a beat takes to reach the
    dispatcher. ``decision_delay_ms``: the cost of one placement (None: the policy's
    measured cost, :data:`DECISION_COST_MS`); a batch's queue writes land after all of its
    decisions. ``queue_delay_ms``: from the dispatcher's write until the instance's intake
    can read it. ``noise_sigma``: lognormal step-time noise of the emulated engines (as
    ``blockq worker --noise``). ``step_lag_ms``: how late each step's end is reported (as
    an emulated engine's event loop wakes late on a busy host; 0 for a real engine, and the
    default). ``warmup_s``: instances beat this long before the first
    request, so that the dispatcher knows them all. ``time_scale``: wall seconds per model
    second of the engines (see the module docstring). ``slo_ttft_ms``: the TTFT objective
    the summaries count goodput against and the dispatcher judges placements by
    (:mod:`dispatcher.admission`); ``best_effort``: every request is submitted with
    ``best_effort`` (served however late: none is answered ``infeasible``).
    ``prefix_caching``: every instance's engine reuses cached prompt prefixes (as
    ``blockq worker --prefix-caching``), and the summary reports ``prefix_hit_rate``.
    ``slow_instances``: the last this many instances run every step ``slow_factor`` times
    as long as their published profile says (a degraded GPU); ``slow_published``: they
    publish the slowed profile instead (the dispatcher's replicas know the truth);
    ``slow_hidden``: the time is lost after each step (a starved host) instead of in it, so
    the step timings the replicas refit from do not show it.
    ``forecast_check``: the dispatcher's per-instance forecast check and its fallback
    (:mod:`blockq.forecast_check`). ``num_simulated_candidates``: the candidates a
    simulating policy simulates per decision at most (0: every one; None: by the fleet's
    size, :func:`dispatcher.policies.shortlist.default_size`).
    ``cells``: the fleet of ``instances`` split evenly into this many cells, each with its
    own dispatcher, behind one front (:mod:`loadgen.simulation.multi_cell`; a mixed ``fleet``
    is split by :meth:`~blockq.engine_model.fleet_spec.FleetSpec.split`, interleaved, and
    its cells may differ in size by one); each cell's leader
    publishes its load every ``cell_load_interval_ms`` and the front reads the loads as
    often; ``cell_stale_after_ms`` and ``cell_choices`` as ``BLOCKQ_CELL_STALE_MS`` and
    ``BLOCKQ_CELL_CHOICES``. ``served``: the base models and LoRA adapters the fleet serves
    and which one each request names (:mod:`loadgen.simulation.served`).
    ``fleet``: a mixed fleet (:mod:`blockq.engine_model.fleet_spec`), instance ``i`` running
    the preset of its group; ``instances`` must be its size and ``preset`` is unused (None:
    ``instances`` of ``preset``).
    """

    instances: int = 12
    preset: str = "llama2-7b-a30"
    policy: str = "round_robin"
    objective: str = DEFAULT_OBJECTIVE
    seed: int = 1
    heartbeat_ms: float = 100.0
    heartbeat_delay_ms: float = 1.0
    decision_delay_ms: float | None = None
    ingress_delay_ms: float = 2.0
    ingress_delay_sigma: float = 0.0
    queue_delay_ms: float = 1.0
    dispatch_batch_size: int = 128
    bundle_size: int = 16
    idle_poll_ms: float = 50.0
    noise_sigma: float = 0.05
    step_lag_ms: float = 0.0
    warmup_s: float = 1.0
    slo_ttft_ms: float = 3000.0
    best_effort: bool = False
    time_scale: float = 1.0
    prefix_caching: bool = False
    slow_instances: int = 0
    slow_factor: float = 2.0
    slow_published: bool = False
    slow_hidden: bool = False
    forecast_check: ForecastCheckOptions = field(default_factory=ForecastCheckOptions)
    cells: int = 1
    cell_load_interval_ms: float = 250.0
    cell_stale_after_ms: float = 2000.0
    cell_choices: int = 0
    num_simulated_candidates: int | None = DEFAULT_SIMULATED_CANDIDATES
    served: ServedModels = field(default_factory=ServedModels)
    fleet: FleetSpec | None = None

    def __post_init__(self) -> None:
        policy_spec(self.policy)  # ValueError naming the valid policies
        self.served.check_fleet(self.instances, self.cells)
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective: must be one of {', '.join(OBJECTIVES)} (got {self.objective!r})")
        if self.num_simulated_candidates is not None and self.num_simulated_candidates < 0:
            raise ValueError(f"num_simulated_candidates: must be >= 0 (got {self.num_simulated_candidates})")
        if self.instances < 1:
            raise ValueError(f"instances: must be >= 1 (got {self.instances})")
        if self.heartbeat_ms <= 0:
            raise ValueError(f"heartbeat_ms: must be > 0 (got {self.heartbeat_ms})")
        for name in ("heartbeat_delay_ms", "ingress_delay_ms", "queue_delay_ms", "step_lag_ms", "warmup_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0 (got {getattr(self, name)})")
        if self.decision_delay_ms is not None and self.decision_delay_ms < 0:
            raise ValueError(f"decision_delay_ms: must be >= 0 (got {self.decision_delay_ms})")
        if self.dispatch_batch_size < 1 or self.bundle_size < 1:
            raise ValueError("dispatch_batch_size, bundle_size: must be >= 1")
        if not 0 < self.time_scale <= 1000:
            raise ValueError(f"time_scale: must be in (0, 1000] (got {self.time_scale})")
        if not 0 <= self.ingress_delay_sigma <= 5:
            raise ValueError(f"ingress_delay_sigma: must be in [0, 5] (got {self.ingress_delay_sigma})")
        if not 0 <= self.noise_sigma <= 1:
            raise ValueError(f"noise_sigma: must be in [0, 1] (got {self.noise_sigma})")
        if not 0 <= self.slow_instances <= self.instances:
            raise ValueError(f"slow_instances: must be in [0, instances] (got {self.slow_instances})")
        if self.fleet is not None and self.fleet.num_instances != self.instances:
            raise ValueError(f"fleet: {self.fleet.num_instances} instances, but instances is {self.instances}")
        if self.fleet is not None:
            self.fleet.split(self.cells)  # ValueError naming cells when a cell would be empty
        elif self.cells < 1 or self.instances % self.cells:
            raise ValueError(f"cells: must be >= 1 and divide instances (got {self.cells} cells, "
                             f"{self.instances} instances)")
        if self.cell_load_interval_ms <= 0:
            raise ValueError(f"cell_load_interval_ms: must be > 0 (got {self.cell_load_interval_ms})")
        if not 0 < self.slow_factor <= 100:
            raise ValueError(f"slow_factor: must be in (0, 100] (got {self.slow_factor})")

    def preset_of(self, index: int) -> str:
        """The engine preset of the ``index``-th instance started."""
        return self.fleet.preset_of(index) if self.fleet is not None else self.preset

    @property
    def decision_s(self) -> float:
        """Model seconds one placement decision takes."""
        if self.decision_delay_ms is not None:
            return self.decision_delay_ms / 1000
        fallback = DECISION_COST_MS["block" if policy_spec(self.policy).simulates else "llumnix"]
        return DECISION_COST_MS.get(self.policy, fallback) / 1000
