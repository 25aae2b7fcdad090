"""Rules for mixed fleets that weigh each instance by its hardware, without simulating.

Both read what an instance publishes with its beat: its engine config (KV blocks,
``max_num_seqs``, token budget, ``gpu``, ``tensor_parallel_size``, ``interconnect``) and
its step-latency model, from which :func:`instance_capacity` derives two figures once per
published model (the beat's dicts change only when the engine restarts or refits):

* ``num_slots``: the requests the instance runs at once, ``max_num_seqs`` or fewer where the
  KV cache cannot hold that many contexts of :data:`TYPICAL_CONTEXT_TOKENS`;
* ``decode_tokens_s``: tokens per second of a full decode batch (``num_slots`` sequences,
  each attending to :data:`TYPICAL_CONTEXT_TOKENS`) as the latency model predicts it;
* ``prefill_step_s``: one step of a full token budget of prompt tokens.

``weighted_least_requests`` is what a careful operator configures: the fewest outstanding
requests (running, waiting and placed but not yet in a beat, plus this one) per unit of
capacity, ``(outstanding + 1) / decode_tokens_s``.

``topology`` is the design's topology-aware rule: score = ``0.9 x perf + 0.1 x latency`` on
instances whose GPUs talk over NVLink, ``0.7 x perf + 0.3 x latency`` on the others (single
GPUs and PCIe); the highest score wins. Both scores are in [0, 1], normalised over the
candidates of the decision:

* ``perf``: decode-throughput headroom, ``decode_tokens_s x max(0, 1 - outstanding /
  num_slots)``, divided by the candidates' largest (all 0: 0);
* ``latency``: the inverse of the predicted TTFT, ``min over candidates / this one's``, where
  the predicted TTFT is the prompt tokens queued before the request's first token
  (waiting prompts' uncomputed tokens, the unseen placements' prompts and the request's
  own) in full-budget steps, ``ceil(tokens / budget) x prefill_step_s``, plus, when every
  slot is taken, the wait for a slot: ``(outstanding + 1 - num_slots) x
  TYPICAL_OUTPUT_TOKENS / decode_tokens_s``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from blockq.engine_model.config import EngineConfig
from blockq.engine_model.latency import StepLatencyModel
from blockq.wire.protocol import Request
from dispatcher.cluster_view import ClusterView
from dispatcher.instance_view import InstanceView
from dispatcher.policies.base import Decision
from dispatcher.policies.load import pick_highest

# The context a running request attends to on average and its output length: the paper's
# ShareGPT trace has prompts of 246 tokens and outputs of 326 on average, so a request
# mid-decode holds about 246 + 326 / 2 ~ 410 tokens; 512 leaves room for longer ones.
TYPICAL_CONTEXT_TOKENS = 512
TYPICAL_OUTPUT_TOKENS = 326
NVLINK_WEIGHTS = (0.9, 0.1)   # (perf, latency)
OTHER_WEIGHTS = (0.7, 0.3)


@dataclass(frozen=True)
class InstanceCapacity:
    """What an instance can do, from its published engine config and latency model."""

    num_slots: int
    decode_tokens_s: float
    prefill_step_s: float
    token_budget: int
    has_nvlink: bool


def instance_capacity(engine_config: dict[str, Any], model: StepLatencyModel) -> InstanceCapacity:
    """:class:`InstanceCapacity` of one published engine (see the module docstring)."""
    config = EngineConfig.from_dict(engine_config)
    fitting = config.kv_capacity_tokens // TYPICAL_CONTEXT_TOKENS
    num_slots = max(1, min(config.max_num_seqs, fitting))
    decode_s = model.step_seconds(0, num_slots, num_slots * TYPICAL_CONTEXT_TOKENS)
    budget = config.max_num_batched_tokens
    prefill_s = model.step_seconds(budget, 0, budget)
    return InstanceCapacity(num_slots=num_slots, decode_tokens_s=num_slots / max(decode_s, 1e-9),
                            prefill_step_s=prefill_s, token_budget=budget, has_nvlink=config.has_nvlink)


class CapacityCache:
    """Each instance's :class:`InstanceCapacity`, recomputed only when the engine config or
    latency model it published differs from those it was computed from. The latency model is
    the one the view simulates the instance with (:meth:`ClusterView.latency_model_of`: the
    published one, else its preset's, else the view's prior)."""

    def __init__(self, view: ClusterView) -> None:
        self.view = view
        self._by_instance: dict[str, tuple[Any, Any, InstanceCapacity]] = {}

    def of(self, view: InstanceView) -> InstanceCapacity:
        beat = view.heartbeat
        cached = self._by_instance.get(view.instance_id)
        if cached is not None and (cached[0] is beat.engine_config or cached[0] == beat.engine_config) \
                and (cached[1] is beat.latency_model or cached[1] == beat.latency_model):
            return cached[2]
        capacity = instance_capacity(beat.engine_config, self.view.latency_model_of(beat))
        self._by_instance[view.instance_id] = (beat.engine_config, beat.latency_model, capacity)
        return capacity


def queued_prompt_tokens(view: InstanceView) -> int:
    """Prompt tokens the instance must still compute before a new request's: its waiting
    requests' uncomputed ones and the prompts placed there but not yet in a beat."""
    waiting = sum(max(0, w.prompt_tokens - w.num_computed_tokens) for w in view.heartbeat.waiting)
    return waiting + sum(r.num_prompt_tokens for r in view.assigned_not_seen.values())


def predicted_ttft_s(view: InstanceView, capacity: InstanceCapacity, prompt_tokens: int) -> float:
    """The topology rule's TTFT estimate (module docstring), seconds."""
    tokens = queued_prompt_tokens(view) + max(1, prompt_tokens)
    prefill_s = math.ceil(tokens / capacity.token_budget) * capacity.prefill_step_s
    num_over = view.num_outstanding + 1 - capacity.num_slots
    slot_wait_s = max(0, num_over) * TYPICAL_OUTPUT_TOKENS / capacity.decode_tokens_s
    return prefill_s + slot_wait_s


class WeightedLeastRequests:
    """Fewest (outstanding + 1) per decode token/s of capacity; ties at random."""

    name = "weighted_least_requests"

    def __init__(self, view: ClusterView, rng: random.Random) -> None:
        self.rng = rng
        self.capacities = CapacityCache(view)

    def choose(self, request: Request, candidates: Sequence[InstanceView], now_s: float,
               bus_now_s: float | None = None) -> Decision:
        def free_capacity(view: InstanceView) -> float:
            return -(view.num_outstanding + 1) / self.capacities.of(view).decode_tokens_s

        return Decision(pick_highest(candidates, free_capacity, self.rng).instance_id)


class Topology:
    """The design's topology-aware score (module docstring); the highest wins."""

    name = "topology"

    def __init__(self, view: ClusterView, rng: random.Random) -> None:
        self.rng = rng
        self.capacities = CapacityCache(view)

    def choose(self, request: Request, candidates: Sequence[InstanceView], now_s: float,
               bus_now_s: float | None = None) -> Decision:
        scores = self.scores(request, candidates)
        return Decision(pick_highest(candidates, lambda view: scores[view.instance_id], self.rng).instance_id)

    def scores(self, request: Request, candidates: Sequence[InstanceView]) -> dict[str, float]:
        """Each candidate's score, by instance id."""
        capacities = [self.capacities.of(view) for view in candidates]
        headroom = [c.decode_tokens_s * max(0.0, 1.0 - view.num_outstanding / c.num_slots)
                    for view, c in zip(candidates, capacities, strict=True)]
        ttft_s = [predicted_ttft_s(view, c, request.num_prompt_tokens)
                  for view, c in zip(candidates, capacities, strict=True)]
        best_headroom = max(headroom)
        best_ttft_s = min(ttft_s)
        scores = {}
        for view, capacity, room, ttft in zip(candidates, capacities, headroom, ttft_s, strict=True):
            perf = room / best_headroom if best_headroom > 0 else 0.0
            latency = best_ttft_s / ttft if ttft > 0 else 1.0
            perf_weight, latency_weight = NVLINK_WEIGHTS if capacity.has_nvlink else OTHER_WEIGHTS
            scores[view.instance_id] = perf_weight * perf + latency_weight * latency
        return scores
