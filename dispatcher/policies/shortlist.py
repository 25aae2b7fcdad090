"""Which candidates a simulating policy simulates on a large fleet: the shortlist.

Simulating every live instance for every request makes a decision cost grow with the fleet
(15.7 ms p50 at 1,024 instances). A decision instead simulates the ``size`` candidates
believed best, and only those replicas are advanced (or rebuilt from a newer beat).

What "believed best" means: each instance has a *start time*, on the caller's clock, from
which a new request's prefill is believed able to start there. It is learnt from the
simulations themselves: every candidate simulated for a request, the chosen one included,
gets ``now`` plus its simulated TTFT less the request's own prefill (what the wait there
was). Most of the shortlist is the best known: the earliest start times (one that has
passed counts as now), ties going to the instances simulated most recently, whose replicas
are likeliest to be current. The rest, an eighth (at least one), explores: of the other
instances, those never simulated, then those simulated longest ago, so that a new instance is tried soon
and a belief that may be out of date is checked again (the simulation corrects it).
Exploring is what costs: an instance not simulated for a while is older than its latest
beat, and its replica is rebuilt first. Ties are broken at random. It is a ranking, not a
bound: the chosen instance is the best of the shortlist, which is not always the best of
the fleet. docs/dispatcher.md ("Decisions and heartbeats at fleet scale") and
docs/results/decisions-at-scale.md give what that costs in capacity.

On a fleet with long-prompt lanes, a request the lane rule keeps off them
(:meth:`dispatcher.policies.predictive.Block._lanes_last`) has its best known taken among
the other instances, and of the lanes only the :data:`LANE_CANDIDATES` best known: what the
rule needs of them is the best TTFT there, and a lane wins only when it is far better.

Pure: no clock, no I/O; the random tie-breaks come from the policy's seeded generator,
drawn only once a shortlist is first cut (a fleet no larger than ``size`` decides exactly
as with no shortlist).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from dispatcher.instance_view import InstanceView
from dispatcher.policies.shortlist_kernel import shortlist_positions

# What the dispatcher, the simulation and dispatch-bench use unless told: a size by the
# fleet's (None: :func:`default_size`).
DEFAULT_SIMULATED_CANDIDATES: int | None = None
# Fleets larger than this rank the shortlist's candidates on their replicas as they are
# (only the instance taken is rebuilt: dispatcher.policies.predictive.Block._best) and
# simulate fewer of them unless told (default_size); smaller ones keep the replicas
# decisions use current, rebuilt on their beats. Ranking as they are cost capacity at 96
# instances and keeping them current cost the beat path a core at 1,024
# (docs/decisions/placement.md, "Ranking as they are on large fleets only").
LARGE_FLEET_ABOVE_INSTANCES = 128
# Up to LARGE_FLEET_ABOVE_INSTANCES: 16, so that a fleet of up to 16 instances (the paper's
# 12, the demo's) decides exactly as without a shortlist and every figure measured on one
# stands, and 96 instances keep their capacity within 1 % of simulating all
# (docs/results/decisions-at-scale.md). Above: 8, a third fewer simulations a decision at
# 1,024 instances (2,381-2,543 against 1,749-1,920 decisions/s) for 0.994x the capacity
# where candidates are ranked as they are (96 instances, seeds 1-3: docs/decisions/placement.md,
# "Eight candidates on large fleets").
SMALL_FLEET_CANDIDATES = 16
LARGE_FLEET_CANDIDATES = 8
# Start times of equal worth are told apart by how long ago they were learnt, this many
# seconds per second: far below any difference a simulation makes.
AGE_WEIGHT = 1e-6
# The share of the shortlist that explores (at least one candidate).
EXPLORE_SHARE = 1 / 8
# When an instance never simulated was, for exploring it first: before any clock's time
# (wall seconds, or virtual ones from 0), and small enough for the jitter to tell ties apart.
NEVER_S = -1e9
# Exact ties are broken by up to this much random jitter, in seconds.
TIE_JITTER_S = 1e-6
# The lanes simulated for a request kept off them (the module docstring).
LANE_CANDIDATES = 2


def default_size(num_candidates: int) -> int:
    """The shortlist's size, unless one is given, for a decision among ``num_candidates``."""
    return SMALL_FLEET_CANDIDATES if num_candidates <= LARGE_FLEET_ABOVE_INSTANCES else LARGE_FLEET_CANDIDATES


class Shortlist:
    """The candidates to simulate, and what the last simulations taught (see the module
    docstring). ``size``: how many candidates a decision simulates (0: every one; None:
    :func:`default_size`)."""

    def __init__(self, size: int | None, rng: random.Random) -> None:
        if size is not None and size < 0:
            raise ValueError(f"num_simulated_candidates: must be >= 0 (got {size})")
        self.size = size
        self.rng = rng
        self._jitter: np.random.Generator | None = None
        # What was learnt, by instance: start time and when learnt. Kept in arrays aligned
        # with the candidate list last given (the live list, unchanged until the fleet's
        # health changes; rebuilt only when another list is given), and here for the
        # instances outside it.
        self._off_list: dict[str, tuple[float, float]] = {}
        self._candidates: Sequence[InstanceView] | None = None
        self._lanes: frozenset[str] | None = None
        self._position: dict[str, int] = {}
        self._starts = np.empty(0)
        self._learnt = np.empty(0)
        self._outside_lanes = np.empty(0, dtype=bool)

    def size_for(self, num_candidates: int) -> int:
        """How many candidates a decision among ``num_candidates`` simulates at most (0: every one)."""
        return default_size(num_candidates) if self.size is None else self.size

    def cuts(self, num_candidates: int) -> bool:
        """Whether a decision among ``num_candidates`` simulates only some of them."""
        return 0 < self.size_for(num_candidates) < num_candidates

    def select(self, candidates: Sequence[InstanceView], lanes: frozenset[str],
               now_s: float, *, off_lanes: bool = False) -> list[InstanceView]:
        """The candidates to simulate at ``now_s`` (every one when the shortlist does not
        cut), best believed first; ``off_lanes``: for a request kept off ``lanes``."""
        if not self.cuts(len(candidates)):
            return list(candidates)
        self._align(candidates, lanes)
        if self._jitter is None:
            self._jitter = np.random.default_rng(self.rng.getrandbits(64))
        jitter = self._jitter.random(len(candidates)) * TIE_JITTER_S
        size = self.size_for(len(candidates))
        num_explored = max(1, int(size * EXPLORE_SHARE))
        positions = shortlist_positions(self._starts, self._learnt, self._outside_lanes, jitter, now_s, AGE_WEIGHT,
                                        size - num_explored, num_explored,
                                        LANE_CANDIDATES if lanes and off_lanes else -1)
        return [candidates[i] for i in positions]

    def learn(self, start_at_s: dict[str, float], now_s: float) -> None:
        """From the simulations of a decision at ``now_s``: a new request could start its
        prefill on each instance of ``start_at_s`` at the time given (the caller's clock)."""
        position = self._position
        if not position.keys() >= start_at_s.keys():  # not among the candidates last given
            self._off_list.update((instance_id, (start_s, now_s)) for instance_id, start_s in start_at_s.items()
                                  if instance_id not in position)
            start_at_s = {instance_id: start_s for instance_id, start_s in start_at_s.items() if instance_id in position}
        if start_at_s:
            positions = list(map(position.__getitem__, start_at_s))
            self._starts[positions] = list(start_at_s.values())
            self._learnt[positions] = now_s

    def beliefs(self) -> dict[str, tuple[float, float]]:
        """Every instance learnt about: (when a new request could start there, when learnt)."""
        beliefs = dict(self._off_list)
        starts, learnt = self._starts.tolist(), self._learnt.tolist()
        beliefs.update((instance_id, (starts[i], learnt[i])) for instance_id, i in self._position.items()
                       if learnt[i] != NEVER_S)
        return beliefs

    def _align(self, candidates: Sequence[InstanceView], lanes: frozenset[str]) -> None:
        if candidates is self._candidates and lanes is self._lanes:
            return
        beliefs = self.beliefs()
        self._candidates, self._lanes = candidates, lanes
        ids = [candidate.instance_id for candidate in candidates]
        self._position = {instance_id: i for i, instance_id in enumerate(ids)}
        # Untried instances were learnt from at NEVER_S: explored first.
        untried = (np.nan, NEVER_S)
        self._starts, self._learnt = np.array([beliefs.get(instance_id, untried) for instance_id in ids],
                                              np.float64).reshape(-1, 2).T.copy()
        self._outside_lanes = np.array([instance_id not in lanes for instance_id in ids], dtype=bool)
        # Instances gone long ago are forgotten.
        off_list = beliefs.keys() - self._position.keys()
        self._off_list = {instance_id: beliefs[instance_id] for instance_id in off_list} \
            if len(off_list) <= len(ids) else {}

