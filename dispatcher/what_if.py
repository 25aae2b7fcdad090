"""What-if simulation: how a request would fare on an instance, and what it would cost
the requests already there. Pure; runs the engine model's packed scheduler."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from blockq.engine_model.packed import PackedScheduler
from dispatcher.replica import Baseline, InstanceReplica, WhatIf

OBJECTIVES = ("e2e", "ttft", "max_latency")
# What `block` scores by unless told: its own predicted TTFT (below the knee it cut mean /
# P99 TTFT to 85 / 575 ms from e2e's 93 / 656 at equal capacity: docs/decisions/placement.md).
DEFAULT_OBJECTIVE = "ttft"


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


# What a run short of the whole one is given for the baseline's finish times (not read).
_UNREAD = np.empty(0)


def forecast(replica: InstanceReplica, request_id: str, prompt_tokens: int, output_tokens: int, *,
             keep: bool = True, whole_run: bool = True, model: str | None = None) -> Forecast:
    """Simulate a request of this size (naming ``model``: with LoRA, its adapter's load and
    slot are simulated) added to ``replica`` now, until every request there finishes.

    The run starts from the baseline's snapshot (exactly where it would diverge) or from
    the replica's state, whichever is later, with the request's arrival at the instance's
    present (:attr:`InstanceReplica.now_s`): the rest of the step under way is part of
    its wait. The run
    is handed to the replica (unless ``keep`` is false): if the request is then placed
    there, it is the replica's new baseline (:meth:`InstanceReplica.add_assignment`).

    Without ``whole_run`` (the ``ttft`` objective reads only the TTFT and E2E), the run
    stops at the request's own finish, and ``added_delay_s`` and ``max_latency_s`` are NaN:
    the added delay needs the baseline's future to the end, a run of its own on a replica
    just rebuilt, and both need every row's finish (the rest of the run: a fifth of its
    cost on dispatch-bench at 1,024 instances, 38 -> 31 us)."""
    baseline = replica.baseline()
    now_s = replica.now_s
    start = _start(replica, baseline)
    finished_before_s = baseline.finished_at_s if whole_run else _UNREAD
    ttft_s, e2e_s, added_delay_s, max_latency_s, num_preemptions, finished_at_s, drain_snapshot = start.what_if(
        prompt_tokens, output_tokens, now_s, finished_before_s, request_id, replica.adapter_id(model), whole_run)
    if keep:  # a partial run's finish times are not the new baseline's: they are simulated on first use
        replica.keep_what_if(WhatIf(replica.version, request_id, (prompt_tokens, output_tokens), drain_snapshot,
                                    finished_at_s if whole_run else None))
    return Forecast(ttft_s=ttft_s, e2e_s=e2e_s, added_delay_s=added_delay_s,
                    max_latency_s=max_latency_s, num_preemptions=num_preemptions)


def _start(replica: InstanceReplica, baseline: Baseline) -> PackedScheduler:
    """Where a what-if run starts: the baseline's snapshot, unless the replica has moved
    past it (the queue drained since), when the divergence point is now."""
    return baseline.snapshot if baseline.snapshot.now_s >= replica.scheduler.now_s else replica.scheduler


def forecast_ttft(replica: InstanceReplica, prompt_tokens: int, output_tokens: int, *,
                  model: str | None = None) -> tuple[float, float]:
    """:func:`forecast`'s ``ttft_s`` alone, from the same starting point, by a run that
    stops at the request's first token: what ranking by the ``ttft`` objective needs of
    every candidate (only the chosen one needs the run to the end); and the request's
    prefill alone there (:meth:`InstanceReplica.prefill_alone_s`). ``model``: as
    :func:`forecast`'s."""
    return _start(replica, replica.baseline()).first_token_if(prompt_tokens, output_tokens, replica.now_s,
                                                              replica.adapter_id(model))
