"""SLO admission: answer a request ``infeasible`` at once rather than serve it late.

A request's TTFT objective is its own ``slo_ttft_ms``, else the cluster's (interactive
requests only: batch work is background and has none unless it says so). When a policy
has chosen an instance, its forecast for that instance (the best one it found) is
judged here: the time the request already waited since its submission plus the
forecast TTFT must fit in the objective, and ``now_s`` plus the forecast E2E must not
pass ``deadline_s``. A policy without forecasts is judged on the time waited alone.
``best_effort`` requests are never refused.

Pure: the caller passes ``now_s`` on the same clock as ``submitted_at_s`` and
``deadline_s`` (the wall clock, live; virtual time in the simulation). Skew between the
submitting host's clock and the dispatcher's moves the judgement by the skew.
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
    ``predicted_e2e_ms`` are the best figures found, counted from its submission."""

    request: Request
    reason: str
    predicted_ttft_ms: float | None
    predicted_e2e_ms: float | None


def ttft_slo_ms(request: Request, default_slo_ttft_ms: float | None) -> float | None:
    """The TTFT objective ``request`` is held to (None: none)."""
    if request.slo_ttft_ms is not None:
        return request.slo_ttft_ms
    return default_slo_ttft_ms if request.priority == "interactive" else None


def ttft_budget_s(request: Request, default_slo_ttft_ms: float | None, now_s: float) -> float | None:
    """How long from ``now_s`` the request's first token may take and keep its objective
    (None: it has none; negative: already missed): the rule :func:`judge` applies, for a
    policy ranking candidates by it."""
    slo_ms = ttft_slo_ms(request, default_slo_ttft_ms)
    return None if slo_ms is None else slo_ms / 1000 - max(0.0, now_s - request.submitted_at_s)


def judge(request: Request, decision: Decision, now_s: float,
          default_slo_ttft_ms: float | None) -> Infeasible | None:
    """None when ``request`` may go where ``decision`` says; otherwise why not."""
    if request.best_effort:
        return None
    waited_ms = max(0.0, now_s - request.submitted_at_s) * 1000
    ttft_ms = waited_ms + (decision.predicted_ttft_ms or 0.0)
    e2e_ms = waited_ms + decision.predicted_e2e_ms if decision.predicted_e2e_ms is not None else None
    slo_ms = ttft_slo_ms(request, default_slo_ttft_ms)
    if slo_ms is not None and ttft_ms > slo_ms:
        return Infeasible(request, f"{INFEASIBLE}: predicted TTFT {ttft_ms:.0f} ms > SLO {slo_ms:.0f} ms "
                          f"(waited {waited_ms:.0f} ms)", ttft_ms, e2e_ms)
    if request.deadline_s is not None:
        finish_s = now_s + (decision.predicted_e2e_ms or 0.0) / 1000
        if finish_s > request.deadline_s:
            return Infeasible(request, f"{INFEASIBLE}: predicted to finish {finish_s - request.deadline_s:.3f} s "
                              "after deadline_s", ttft_ms, e2e_ms)
    return None


def infeasible_final(outcome: Infeasible, now_s: float) -> FinalRecord:
    """The final record that answers an infeasible request (nothing ran)."""
    request = outcome.request
    prompt_tokens = request.prediction.prompt_tokens if request.prediction else 0
    predicted_tokens = request.prediction.predicted_output_tokens if request.prediction else None
    return FinalRecord(
        request_id=request.id, index=0, status=INFEASIBLE, text="", output_tokens=0, prompt_tokens=prompt_tokens,
        instance="", finish_reason=INFEASIBLE, e2e_ms=max(0.0, now_s - request.submitted_at_s) * 1000,
        predicted_output_tokens=predicted_tokens, predicted_ttft_ms=outcome.predicted_ttft_ms,
        predicted_e2e_ms=outcome.predicted_e2e_ms, error=outcome.reason)
