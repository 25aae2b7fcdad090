"""Load-aware rules that read the instances' last state but do not simulate."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from blockq.wire.protocol import Request
from dispatcher.instance_view import InstanceView
from dispatcher.policies.base import Decision


def pick_highest(candidates: Sequence[InstanceView], key: Callable[[InstanceView], float],
                 rng: random.Random) -> InstanceView:
    """The candidate with the highest ``key``; ties broken at random."""
    scores = [key(v) for v in candidates]
    best = max(scores)
    return rng.choice([v for v, s in zip(candidates, scores, strict=True) if s >= best - 1e-12])


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def unseen_prompt_blocks(view: InstanceView) -> int:
    """KV blocks the requests assigned but not yet in a beat will need for their prompts."""
    block_size = int(view.heartbeat.engine_config.get("block_size", 16))
    return sum(_blocks(r.num_prompt_tokens, block_size) for r in view.assigned_not_seen.values())


class LeastKv:
    """INFaaS-like: the most free KV blocks per running request."""

    name = "least_kv"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choose(self, request: Request, candidates: Sequence[InstanceView], now_s: float,
               bus_now_s: float | None = None) -> Decision:
        def free_per_request(view: InstanceView) -> float:
            free = view.num_free_blocks - unseen_prompt_blocks(view)
            return free / max(view.num_running + len(view.assigned_not_seen), 1)

        return Decision(pick_highest(candidates, free_per_request, self.rng).instance_id)


class Llumnix:
    """Llumnix's virtual-usage freeness: (free blocks − blocks the waiting prompts need)
    / max(running, 1); the highest wins. Requests assigned but not yet in a beat count as
    waiting."""

    name = "llumnix"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choose(self, request: Request, candidates: Sequence[InstanceView], now_s: float,
               bus_now_s: float | None = None) -> Decision:
        def freeness(view: InstanceView) -> float:
            block_size = int(view.heartbeat.engine_config.get("block_size", 16))
            waiting_blocks = sum(_blocks(w.prompt_tokens + w.num_generated_tokens, block_size)
                                 for w in view.heartbeat.waiting)
            free = view.num_free_blocks - waiting_blocks - unseen_prompt_blocks(view)
            return free / max(view.num_running, 1)

        return Decision(pick_highest(candidates, freeness, self.rng).instance_id)
