"""Placement policies, registered by name in one place.

Each factory receives its dependencies (the cluster view, a seeded random generator, the
:class:`PolicyOptions`) and returns an object with ``name`` and ``choose(request, candidates, now_s)``.
The view is built for the policy from its :class:`PolicySpec` (:func:`make_view`); a policy
never changes what the view keeps.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from dispatcher.cluster_view import ClusterView
from dispatcher.policies.base import Decision, Policy, PolicyOptions
from dispatcher.policies.hardware import Topology, WeightedLeastRequests
from dispatcher.policies.load import LeastKv, Llumnix
from dispatcher.policies.predictive import Block, BlockKvGuard, Oracle, PowerOfTwo
from dispatcher.policies.prefix import PrefixAffinity
from dispatcher.policies.simple import LeastRequests, RandomChoice, RoundRobin
from dispatcher.what_if import DEFAULT_OBJECTIVE

PolicyFactory = Callable[[ClusterView, random.Random, PolicyOptions], Policy]


@dataclass(frozen=True)
class PolicySpec:
    """How to build a policy, and what its cluster view must keep for it: ``simulates``
    (a replica of every instance, rebuilt from beats) and ``lengths`` (the output lengths
    those replicas simulate with, :data:`blockq.lengths.LENGTH_MODES`)."""

    factory: PolicyFactory
    simulates: bool = False
    lengths: str = "median"


POLICIES: dict[str, PolicySpec] = {
    "round_robin": PolicySpec(lambda view, rng, options: RoundRobin(rng)),
    "random": PolicySpec(lambda view, rng, options: RandomChoice(rng)),
    "least_requests": PolicySpec(lambda view, rng, options: LeastRequests(rng)),
    "least_kv": PolicySpec(lambda view, rng, options: LeastKv(rng)),
    "llumnix": PolicySpec(lambda view, rng, options: Llumnix(rng)),
    "weighted_least_requests": PolicySpec(lambda view, rng, options: WeightedLeastRequests(view, rng)),
    "topology": PolicySpec(lambda view, rng, options: Topology(view, rng)),
    "prefix_affinity": PolicySpec(lambda view, rng, options: PrefixAffinity(rng)),
    "power_of_two": PolicySpec(PowerOfTwo, simulates=True),
    "block": PolicySpec(Block, simulates=True),
    "block_kv_guard": PolicySpec(BlockKvGuard, simulates=True),
    "oracle": PolicySpec(Oracle, simulates=True, lengths="truth"),
}


def policy_spec(name: str) -> PolicySpec:
    """The spec registered as ``name``; ValueError listing the valid names otherwise."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"policy: unknown {name!r} (valid: {', '.join(sorted(POLICIES))})") from None


def make_view(name: str, *, lengths: str | None = None, **options: object) -> ClusterView:
    """A cluster view keeping what policy ``name`` needs, its replicas simulating with
    ``lengths`` (default: the policy's); other options are :class:`ClusterView`'s."""
    spec = policy_spec(name)
    return ClusterView(keep_replicas=spec.simulates, lengths=lengths or spec.lengths, **options)  # type: ignore[arg-type]


def make_policy(name: str, view: ClusterView | None = None, *, seed: int | None = None,
                objective: str = DEFAULT_OBJECTIVE, slo_ttft_ms: float | None = None,
                num_simulated_candidates: int | None = 0) -> Policy:
    """The policy registered as ``name`` on ``view`` (a new one for it when None); the
    options are :class:`PolicyOptions`'."""
    spec = policy_spec(name)
    return spec.factory(view if view is not None else make_view(name), random.Random(seed),
                        PolicyOptions(objective=objective, slo_ttft_ms=slo_ttft_ms,
                                      num_simulated_candidates=num_simulated_candidates))


__all__ = ["Decision", "Policy", "PolicyOptions", "POLICIES", "PolicySpec", "make_policy", "make_view", "policy_spec"]
