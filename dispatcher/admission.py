"""SLO admission: answer a request ``infeasible`` at once rather than serve it late.

A request's TTFT objective is its own ``slo_ttft_ms``, else the cluster's (interactive
requests only: batch work is background and has none unless it says so). When a policy
has chosen an instance, its forecast for that instance (the best one it found) is
judged here: the time the request already waited since its admission plus the forecast
TTFT must fit in the objective, and the forecast E2E must fit in what is left of the time
``deadline_s`` gave it from its submission. A policy without forecasts is judged on the
time waited alone. ``best_effort`` requests are never refused.

Which clock measures the wait (:func:`time_waited_s`): a request the predictor stamped
with its admission (``admitted_at_ms``, its entry id in ``req``: Redis' clock) against the
caller's estimate of Redis' now (``bus_now_s``), so that neither the client's clock nor the
dispatcher's enters (a client 3 s off used to be refused at once, or never). Older
messages, and the simulation (one clock for everything), are measured from
``submitted_at_s`` against ``now_s``. Pure: the caller passes both clocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from blockq.wire.protocol import STATUS_INFEASIBLE as INFEASIBLE
from blockq.wire.protocol import FinalRecord, Request

if TYPE_CHECKING:  # the policies import this module
    from dispatcher.policies.base import Decision


@dataclass(frozen=True, slots=True)
class Infeasible:
    """``request`` is predicted to miss its objective everywhere; ``predicted_ttft_ms`` /
    ``predicted_e2e_ms`` are the best figures found, counted from its admission, which was
    ``waited_ms`` ago."""

    request: Request
    reason: str
    predicted_ttft_ms: float | None
    predicted_e2e_ms: float | None
    waited_ms: float


def ttft_slo_ms(request: Request, default_slo_ttft_ms: float | None) -> float | None:
    """The TTFT objective ``request`` is held to (None: none)."""
    if request.slo_ttft_ms is not None:
        return request.slo_ttft_ms
    return default_slo_ttft_ms if request.priority == "interactive" else None


def time_waited_s(request: Request, now_s: float, bus_now_s: float | None = None) -> float:
    """Seconds ``request`` has waited since it was admitted (>= 0): from ``admitted_at_ms``
    to ``bus_now_s`` (Redis' clock) when it carries one and the caller has an estimate of
    Redis' now; else from ``submitted_at_s`` to ``now_s`` (see the module docstring)."""
    if request.admitted_at_ms is not None and bus_now_s is not None:
        return max(0.0, bus_now_s - request.admitted_at_ms / 1000)
    return max(0.0, now_s - request.submitted_at_s)


def ttft_budget_s(request: Request, default_slo_ttft_ms: float | None, now_s: float,
                  bus_now_s: float | None = None) -> float | None:
    """How long from ``now_s`` the request's first token may take and keep its objective
    (None: it has none; negative: already missed): the rule :func:`judge` applies, for a
    policy ranking candidates by it."""
    slo_ms = ttft_slo_ms(request, default_slo_ttft_ms)
    return None if slo_ms is None else slo_ms / 1000 - time_waited_s(request, now_s, bus_now_s)


def judge(request: Request, decision: Decision, now_s: float, default_slo_ttft_ms: float | None,
          bus_now_s: float | None = None) -> Infeasible | None:
    """None when ``request`` may go where ``decision`` says; otherwise why not. A deadline
    is the time it gives from the submission (both on the client's clock, so its skew
    cancels out), less the time waited since."""
    if request.best_effort:
        return None
    waited_s = time_waited_s(request, now_s, bus_now_s)
    waited_ms = waited_s * 1000
    ttft_ms = waited_ms + (decision.predicted_ttft_ms or 0.0)
    e2e_ms = waited_ms + decision.predicted_e2e_ms if decision.predicted_e2e_ms is not None else None
    slo_ms = ttft_slo_ms(request, default_slo_ttft_ms)
    if slo_ms is not None and ttft_ms > slo_ms:
        return Infeasible(request, f"{INFEASIBLE}: predicted TTFT {ttft_ms:.0f} ms > SLO {slo_ms:.0f} ms "
                          f"(waited {waited_ms:.0f} ms)", ttft_ms, e2e_ms, waited_ms)
    if request.deadline_s is not None:
        late_s = (decision.predicted_e2e_ms or 0.0) / 1000 - (request.deadline_s - request.submitted_at_s - waited_s)
        if late_s > 0:
            return Infeasible(request, f"{INFEASIBLE}: predicted to finish {late_s:.3f} s after deadline_s",
                              ttft_ms, e2e_ms, waited_ms)
    return None


def infeasible_final(outcome: Infeasible, now_s: float) -> FinalRecord:
    """The final record that answers an infeasible request (nothing ran); its ``e2e_ms`` is
    the wait the judgement measured (``now_s``, the caller's clock, is not needed for it)."""
    request = outcome.request
    prompt_tokens = request.prediction.prompt_tokens if request.prediction else 0
    predicted_tokens = request.prediction.predicted_output_tokens if request.prediction else None
    return FinalRecord(
        request_id=request.id, index=0, status=INFEASIBLE, text="", output_tokens=0, prompt_tokens=prompt_tokens,
        instance="", finish_reason=INFEASIBLE, e2e_ms=outcome.waited_ms,
        predicted_output_tokens=predicted_tokens, predicted_ttft_ms=outcome.predicted_ttft_ms,
        predicted_e2e_ms=outcome.predicted_e2e_ms, error=outcome.reason)
