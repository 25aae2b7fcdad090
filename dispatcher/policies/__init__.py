"""Placement policies, registered by name in one place.

Each factory receives its dependencies (the cluster view, a seeded random generator, the
objective) and returns an object with ``name`` and ``choose(request, candidates, now_s)``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from dispatcher.cluster_view import ClusterView
from dispatcher.policies.base import Decision, Policy
from dispatcher.policies.load import LeastKv, Llumnix
from dispatcher.policies.predictive import Block, BlockKvGuard, Oracle, PowerOfTwo
from dispatcher.policies.simple import LeastRequests, RandomChoice, RoundRobin

PolicyFactory = Callable[[ClusterView, random.Random, str], Policy]

POLICY_FACTORIES: dict[str, PolicyFactory] = {
    "round_robin": lambda view, rng, objective: RoundRobin(rng),
    "random": lambda view, rng, objective: RandomChoice(rng),
    "least_requests": lambda view, rng, objective: LeastRequests(rng),
    "least_kv": lambda view, rng, objective: LeastKv(rng),
    "llumnix": lambda view, rng, objective: Llumnix(rng),
    "power_of_two": PowerOfTwo,
    "block": Block,
    "block_kv_guard": BlockKvGuard,
    "oracle": Oracle,
}

# Policies whose replicas simulate with true output lengths.
TRUE_LENGTH_POLICIES = frozenset({"oracle"})


def make_policy(name: str, view: ClusterView | None = None, *, seed: int | None = None,
                objective: str = "e2e") -> Policy:
    """The policy registered as ``name``; ValueError listing the valid names otherwise."""
    try:
        factory = POLICY_FACTORIES[name]
    except KeyError:
        raise ValueError(f"policy: unknown {name!r} (valid: {', '.join(sorted(POLICY_FACTORIES))})") from None
    if view is None:
        view = ClusterView(use_true_lengths=name in TRUE_LENGTH_POLICIES)
    return factory(view, random.Random(seed), objective)


__all__ = ["Decision", "Policy", "POLICY_FACTORIES", "TRUE_LENGTH_POLICIES", "make_policy"]
