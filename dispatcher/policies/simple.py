"""Static placement rules that do not look ahead: the baselines blockq is measured against."""

from __future__ import annotations

import random
from collections.abc import Sequence

from blockq.wire.protocol import Request
from dispatcher.instance_view import InstanceView
from dispatcher.policies.base import Decision


class RoundRobin:
    """Each request to the next live instance in id order."""

    name = "round_robin"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._next = 0

    def choose(self, request: Request, candidates: Sequence[InstanceView], now_s: float,
               bus_now_s: float | None = None) -> Decision:
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return Decision(chosen.instance_id)


class RandomChoice:
    """Uniformly random live instance."""

    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(self, request: Request, candidates: Sequence[InstanceView], now_s: float,
               bus_now_s: float | None = None) -> Decision:
        return Decision(self.rng.choice(candidates).instance_id)


class LeastRequests:
    """Fewest running + waiting + assigned-not-seen requests; ties at random."""

    name = "least_requests"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(self, request: Request, candidates: Sequence[InstanceView], now_s: float,
               bus_now_s: float | None = None) -> Decision:
        fewest = min(v.num_outstanding for v in candidates)
        return Decision(self.rng.choice([v for v in candidates if v.num_outstanding == fewest]).instance_id)
