"""The one small interface every placement policy implements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from blockq.wire.protocol import Request
from dispatcher.instance_view import InstanceView
from dispatcher.what_if import DEFAULT_OBJECTIVE


@dataclass(frozen=True)
class Decision:
    """Where a request goes and what the policy expects there (``None``: no estimate)."""

    instance_id: str
    predicted_ttft_ms: float | None = None
    predicted_e2e_ms: float | None = None


@dataclass(frozen=True)
class PolicyOptions:
    """What a policy is told at construction: the objective it scores by (policies that
    simulate), the TTFT objective of interactive requests that carry none (None: none;
    see :mod:`dispatcher.admission`) and, for ``block`` and ``oracle``, how many
    candidates a decision simulates at most (0: every one; None: by the fleet's size;
    :mod:`dispatcher.policies.shortlist`)."""

    objective: str = DEFAULT_OBJECTIVE
    slo_ttft_ms: float | None = None
    num_simulated_candidates: int | None = 0

    def __post_init__(self) -> None:
        if self.num_simulated_candidates is not None and self.num_simulated_candidates < 0:
            raise ValueError(f"num_simulated_candidates: must be >= 0, 0 for every candidate "
                             f"(got {self.num_simulated_candidates})")


class Policy(Protocol):
    name: str

    def choose(self, request: Request, candidates: Sequence[InstanceView], now_s: float,
               bus_now_s: float | None = None) -> Decision:
        """Pick one of ``candidates`` (non-empty, live instances) for ``request`` at ``now_s``
        (the caller's clock); ``bus_now_s``: the caller's estimate of Redis' now, which the
        time a request waited is measured against (:func:`dispatcher.admission.time_waited_s`;
        None: no estimate)."""
        ...
