"""``prefix_affinity``: cache-aware routing as SGLang's router does it, the baseline that
every prefix-aware router builds on.

1. When the load is imbalanced (the busiest candidate has more than
   ``BALANCE_ABS_REQUESTS`` outstanding requests above the idlest, and more than
   ``BALANCE_REL`` times as many), go to the least loaded: affinity would pile more on a
   hot instance.
2. Otherwise go where the longest prefix of the request is cached (the instance's prefix
   index: :mod:`dispatcher.prefix_index`), if it covers at least ``CACHE_THRESHOLD`` of the
   prompt's blocks; ties go to the less loaded.
3. Otherwise (no instance holds enough of it) go to the instance whose cache holds the
   least, where the new prefix evicts the least.

Outstanding = running + waiting + assigned but not in a beat yet. Instances without
prefix caching have no index and count as holding nothing.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from blockq.wire.protocol import Request
from dispatcher.instance_view import InstanceView
from dispatcher.policies.base import Decision
from dispatcher.policies.load import pick_highest

# SGLang router's defaults (cache_threshold, balance_abs_threshold, balance_rel_threshold).
CACHE_THRESHOLD = 0.5
BALANCE_ABS_REQUESTS = 32
BALANCE_REL = 1.0001


def _cached_blocks(view: InstanceView, request: Request) -> int:
    index = view.prefix_index
    return index.cached_prefix_blocks(request.prompt_block_hashes) if index is not None else 0


class PrefixAffinity:
    name = "prefix_affinity"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choose(self, request: Request, candidates: Sequence[InstanceView], now_s: float,
               bus_now_s: float | None = None) -> Decision:
        loads = {view.instance_id: view.num_outstanding for view in candidates}
        least, most = min(loads.values()), max(loads.values())
        if most - least > BALANCE_ABS_REQUESTS and most > BALANCE_REL * least:
            return Decision(pick_highest(candidates, lambda v: -loads[v.instance_id], self.rng).instance_id)
        num_blocks = len(request.prompt_block_hashes)
        if num_blocks:
            cached = {view.instance_id: _cached_blocks(view, request) for view in candidates}
            best = max(cached.values())
            if best / num_blocks >= CACHE_THRESHOLD:
                holders = [view for view in candidates if cached[view.instance_id] == best]
                return Decision(pick_highest(holders, lambda v: -loads[v.instance_id], self.rng).instance_id)
        return Decision(pick_highest(candidates, lambda v: -len(v.prefix_index or ()), self.rng).instance_id)
