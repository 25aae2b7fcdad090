"""Which candidates a simulating policy simulates on a large fleet: the shortlist.

Simulating every live instance for every request makes a decision cost grow with the fleet
(15.7 ms p50 at 1,024 instances). A decision instead simulates the ``size`` candidates
believed best, and only those replicas are advanced (or rebuilt from a newer beat).

What "believed best" means: each instance has a *start time*, on the caller's clock, from
which a new request's prefill is believed able to start there; the earliest rank first. It
is learnt from the simulations themselves: every candidate simulated for a request,
the chosen one included, gets ``now`` plus its simulated TTFT less the request's own
prefill (what the wait there was). Half the shortlist is the instances with the
earliest start times of those simulated before (what is known to be good is always
simulated again); the other half ranks the instances never simulated first (a new
instance is tried at once), then the earliest start times: one whose start passed long
ago ranks before one simulated just now, so a belief that may be out of date is checked
again and the simulation corrects it. Ties are broken at random. It is a ranking, not a bound: the chosen instance is the best
of the shortlist, which is not always the best of the fleet. docs/dispatcher.md ("Decisions at fleet
scale") and docs/results/decisions-at-scale.md give what that costs in capacity.

On a fleet with long-prompt lanes the shortlist is the best ``size`` of all candidates
and the best ``size`` of those outside the lanes, so that the lane rule
(:meth:`dispatcher.policies.predictive.Block._lanes_last`) still has both kinds to choose from.

Pure: no clock, no I/O; the random tie-breaks come from the policy's seeded generator,
drawn only once a shortlist is first cut (a fleet no larger than ``size`` decides exactly
as with no shortlist).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from dispatcher.cluster_view import InstanceView

# What the dispatcher, the simulation and dispatch-bench use unless told (``block`` at
# 1,024 instances: docs/results/decisions-at-scale.md).
DEFAULT_SIMULATED_CANDIDATES = 16
# The start time of an instance never simulated: before any other (clocks are wall seconds
# or virtual seconds from 0).
UNTRIED_S = -1e9
# Ties (instances never simulated) are broken by up to this much random jitter, in
# seconds: far below any difference a simulation makes between two instances.
TIE_JITTER_S = 1e-6


class Shortlist:
    """The candidates to simulate, and what the last simulations taught (see the module
    docstring). ``size``: how many candidates a decision simulates (0: every one)."""

    def __init__(self, size: int, rng: random.Random) -> None:
        if size < 0:
            raise ValueError(f"num_simulated_candidates: must be >= 0 (got {size})")
        self.size = size
        self.rng = rng
        self._jitter: np.random.Generator | None = None
        self.start_at_s: dict[str, float] = {}
        # Arrays aligned with the candidate list last given (the live list, unchanged until
        # the fleet's health changes): rebuilt only when another list is given.
        self._candidates: Sequence[InstanceView] | None = None
        self._position: dict[str, int] = {}
        self._starts = np.empty(0)
        self._in_lane = np.empty(0, dtype=bool)

    def cuts(self, num_candidates: int) -> bool:
        """Whether a decision among ``num_candidates`` simulates only some of them."""
        return 0 < self.size < num_candidates

    def select(self, candidates: Sequence[InstanceView], lanes: frozenset[str]) -> list[InstanceView]:
        """The candidates to simulate (every one when the shortlist does not cut), best
        believed first."""
        if not self.cuts(len(candidates)):
            return list(candidates)
        self._align(candidates, lanes)
        if self._jitter is None:
            self._jitter = np.random.default_rng(self.rng.getrandbits(64))
        keys = self._starts + self._jitter.random(len(candidates)) * TIE_JITTER_S
        known = np.where(self._starts > UNTRIED_S, keys, np.inf)
        chosen = np.union1d(_smallest(known, (self.size + 1) // 2), _smallest(keys, self.size // 2))
        if lanes:
            outside = np.flatnonzero(~self._in_lane)
            chosen = np.union1d(chosen, outside[_smallest(keys[outside], self.size)])
        chosen = chosen[np.argsort(keys[chosen], kind="stable")]
        return [candidates[i] for i in chosen]

    def learn(self, instance_id: str, start_at_s: float) -> None:
        """From a simulation: a new request could start its prefill on ``instance_id`` at
        ``start_at_s`` (the caller's clock)."""
        self.start_at_s[instance_id] = start_at_s
        position = self._position.get(instance_id)
        if position is not None:
            self._starts[position] = start_at_s

    def _align(self, candidates: Sequence[InstanceView], lanes: frozenset[str]) -> None:
        if candidates is self._candidates:
            return
        self._candidates = candidates
        ids = [candidate.instance_id for candidate in candidates]
        self._position = {instance_id: i for i, instance_id in enumerate(ids)}
        starts = self.start_at_s
        self._starts = np.array([starts.get(instance_id, UNTRIED_S) for instance_id in ids])
        self._in_lane = np.array([instance_id in lanes for instance_id in ids], dtype=bool)
        if len(starts) > 2 * len(ids):  # instances gone long ago: forget them
            self.start_at_s = {instance_id: starts[instance_id] for instance_id in ids if instance_id in starts}


def _smallest(keys: np.ndarray, count: int) -> np.ndarray:
    """Positions of the ``count`` smallest ``keys`` (all of them when there are fewer)."""
    if count >= len(keys):
        return np.arange(len(keys))
    return np.argpartition(keys, count - 1)[:count]
