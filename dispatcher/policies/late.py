"""Late binding: ``block_late`` commits a request to an instance only when that instance
can start it at once, and offers the requests it holds shortest predicted first.

Pushing every request into some instance's queue makes it wait behind work it cannot
see past, on an instance chosen from forecasts that are already stale by the time it
starts. Held in the dispatcher instead (pending in ``ready``, :class:`~dispatcher.core.Held`),
a request keeps its options open until an instance has a free slot and the KV for its
prompt with nothing queued ahead (:meth:`PackedScheduler.can_start_now` on the replica),
and is then placed by ``block``'s what-if among the instances that can. Held requests are
offered again in order of predicted output length minus ``AGING_TOKENS_PER_S`` for every
second waited (shortest first, starvation bounded by age); one that has waited
``MAX_HOLD_S`` (or two thirds of its own ``slo_ttft_ms``, when that is sooner) is placed
where ``block`` would place it, queue or not, and judged against its objective there
(:mod:`dispatcher.admission`: a forecast past the SLO answers it ``infeasible``).
"""

from __future__ import annotations

from collections.abc import Sequence

from blockq.protocol import Request
from dispatcher.cluster_view import InstanceView
from dispatcher.policies.base import Decision
from dispatcher.policies.predictive import Block

AGING_TOKENS_PER_S = 100.0
MAX_HOLD_S = 2.0
HOLD_SHARE_OF_SLO = 2 / 3


class BlockLate(Block):
    """``block`` with late binding (see the module docstring)."""

    name = "block_late"

    def choose(self, request: Request, candidates: Sequence[InstanceView], now_s: float) -> Decision | None:
        if now_s - request.submitted_at_s >= hold_limit_s(request):
            return self._best(request, candidates, now_s)
        ready = []
        for candidate in candidates:
            replica = self.view.replica(candidate, now_s)
            if replica.scheduler.can_start_now(replica.request_size(request)[0]):
                ready.append(candidate)
        return self._best(request, ready, now_s) if ready else None

    def order(self, requests: Sequence[Request], now_s: float) -> list[Request]:
        """Shortest predicted output first, aged (see the module docstring)."""
        def key(request: Request) -> float:
            predicted = request.prediction.predicted_output_tokens if request.prediction else 0
            return predicted - AGING_TOKENS_PER_S * (now_s - request.submitted_at_s)
        return sorted(requests, key=key)


def hold_limit_s(request: Request) -> float:
    """How long ``request`` may wait for an instance that can start it at once."""
    if request.slo_ttft_ms is None:
        return MAX_HOLD_S
    return min(MAX_HOLD_S, HOLD_SHARE_OF_SLO * request.slo_ttft_ms / 1000)
