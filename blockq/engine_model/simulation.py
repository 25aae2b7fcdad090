"""Simulating many steps at once: what a simulation reports, and when jumps are allowed.

:meth:`EngineScheduler.simulate` runs the same steps as :meth:`EngineScheduler.step`, but
collapses the steps in which nothing but decoding happens:

* a *decode span* (:mod:`blockq.engine_model.decode_span`): a run of decode-only steps
  with a fixed batch, up to the first finish, preemption or stop;
* a *drain* (:mod:`blockq.engine_model.decode_drain`): with an empty waiting queue and
  blocks enough for every running request to finish, all the spans up to the last
  finish (or a stop) in one pass.

Jumps are exact with respect to stepping: integer state equal, times equal up to float
rounding (closed-form sums instead of running ones; so a step starting within rounding,
about 1e-15 relative, of ``until_s`` may be decided the other way). They are not used with prefix
caching or with a latency model other than :class:`StepLatencyModel` (for instance a
noisy one); those simulations step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from blockq.engine_model.config import EngineConfig
from blockq.engine_model.latency import StepLatencyModel
from blockq.engine_model.request import EngineRequest, StepResult


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """What one :meth:`EngineScheduler.simulate` call did; times are model seconds.

    ``num_steps``: engine iterations simulated (a jump over ``k`` decode steps counts
    ``k``). ``end_time_s``: the scheduler's ``now_s`` after the call.
    ``finished_at_s`` / ``first_token_at_s``: every request that finished / produced its
    first token during the call, and when. ``num_preemptions``: preemptions during the
    call. ``num_jumps`` / ``num_jumped_steps``: decode spans collapsed, and the steps they
    covered (the rest ran step by step).
    """

    num_steps: int
    end_time_s: float
    finished_at_s: dict[str, float]
    first_token_at_s: dict[str, float]
    num_preemptions: int
    num_jumps: int = 0
    num_jumped_steps: int = 0


@dataclass(slots=True)
class SimulationRecord:
    """Running totals of a simulation, turned into a :class:`SimulationResult` at the end."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_jumps: int = 0
    num_jumped_steps: int = 0
    finished_at_s: dict[str, float] = field(default_factory=dict)
    first_token_at_s: dict[str, float] = field(default_factory=dict)

    def add_step(self, result: StepResult) -> None:
        """Count one step run by :meth:`EngineScheduler.step`."""
        self.num_steps += 1
        ended_at_s = result.started_at_s + result.duration_s
        for request in result.finished:
            self.finished_at_s[request.request_id] = ended_at_s
        for request_id in result.first_token_ids:
            self.first_token_at_s[request_id] = ended_at_s
        self.num_preemptions += len(result.preempted_ids)

    def add_jump(self, num_steps: int, num_spans: int, finished: list[EngineRequest]) -> None:
        """Count ``num_spans`` decode spans jumped over in ``num_steps`` steps, and the
        requests they finished (stamped); spans produce no first token and preempt nothing."""
        self.num_steps += num_steps
        self.num_jumps += num_spans
        self.num_jumped_steps += num_steps
        for request in finished:
            if request.finished_at_s is not None:  # always: the jump stamped it
                self.finished_at_s[request.request_id] = request.finished_at_s

    def to_result(self, end_time_s: float) -> SimulationResult:
        return SimulationResult(self.num_steps, end_time_s, self.finished_at_s,
                                self.first_token_at_s, self.num_preemptions, self.num_jumps,
                                self.num_jumped_steps)


def can_jump(config: EngineConfig, latency_model: object) -> bool:
    """Whether decode spans may be collapsed for this engine and latency model.

    Prefix caching is excluded (allocation may evict cached blocks, which admission probes
    depend on), and so is any latency model whose step time is not :class:`StepLatencyModel`'s
    formula (e.g. one that draws noise per step).
    """
    return (not config.enable_prefix_caching
            and type(latency_model).step_seconds is StepLatencyModel.step_seconds)
