"""The dispatcher's side of prefix caching: what it believes each instance holds, the
``prefix_affinity`` rule, and ``block`` simulating a candidate's hit."""

from __future__ import annotations

import dataclasses
import time

import pytest

from blockq.wire.beats import Heartbeat, RequestProgress
from dispatcher.core import DispatcherCore, Placed
from dispatcher.policies.prefix import BALANCE_ABS_REQUESTS
from dispatcher.prefix_index import PrefixIndex
from tests.factories import make_heartbeat, make_request


def test_the_index_finds_leading_blocks_and_forgets_the_least_recently_used() -> None:
    index = PrefixIndex(capacity_blocks=4)
    index.record([1, 2, 3])
    assert index.cached_prefix_blocks([1, 2, 9]) == 2
    assert index.cached_prefix_blocks([9, 2, 3]) == 0  # a prefix, not any shared block
    assert index.cached_prompt_tokens([1, 2, 3], 48) == 47  # the last prompt token is always computed
    index.record([1, 7])     # 1 used again; 7 new: 4 blocks held
    index.record([8])        # over capacity: 2, the least recently used, goes
    assert index.cached_prefix_blocks([1, 2]) == 1 and index.cached_prefix_blocks([7]) == 1
    with pytest.raises(ValueError, match="capacity_blocks"):
        PrefixIndex(0)


def _beat(instance_id: str, *, prefix_caching: bool = True, running: int = 0) -> Heartbeat:
    progress = tuple(RequestProgress(f"{instance_id}-r{i}", 100, 100, 1, 200, 400) for i in range(running))
    beat = make_heartbeat(instance_id, running=progress, sent_at_s=time.time())
    return dataclasses.replace(beat, engine_config={**beat.engine_config, "enable_prefix_caching": prefix_caching})


def _request(block_hashes: tuple[int, ...], prompt_tokens: int = 1024):  # noqa: ANN202
    request = make_request(" ".join(["w"] * prompt_tokens), max_tokens=256, predicted=100)  # one token a word
    return dataclasses.replace(request, prompt_block_hashes=block_hashes)


def _core(policy: str, beats: list[Heartbeat]) -> DispatcherCore:
    core = DispatcherCore(policy, seed=0, slo_ttft_ms=None)
    now_s = time.time()
    for beat in beats:
        core.apply_heartbeat(beat, now_s)
    return core


def _placed_on(core: DispatcherCore, request) -> str:  # noqa: ANN001
    (outcome,) = core.place([request], time.time())
    assert isinstance(outcome, Placed)
    assert outcome.request.assignment is not None
    return outcome.request.assignment.instance_id


SHARED = tuple(range(100, 164))  # 64 blocks: a 1,024-token prompt


def test_prefix_affinity_follows_the_cache_until_the_load_is_imbalanced() -> None:
    core = _core("prefix_affinity", [_beat("a"), _beat("b"), _beat("c")])
    first = _placed_on(core, _request(SHARED))
    for _ in range(5):
        assert _placed_on(core, _request(SHARED[:60] + (1, 2, 3, 4))) == first  # 60 of 64 blocks cached
    # Another prefix goes to an instance that holds nothing yet (the smallest cache).
    other = _placed_on(core, _request(tuple(range(500, 564))))
    assert other != first
    # The holder of the hot prefix grows busy: past the imbalance guard, the idlest wins.
    busy = _core("prefix_affinity", [_beat("a", running=BALANCE_ABS_REQUESTS + 5), _beat("b"), _beat("c")])
    busy.view.instances["a"].prefix_index.record(SHARED)
    assert _placed_on(busy, _request(SHARED)) in ("b", "c")


def test_block_simulates_the_hit_and_the_core_counts_what_it_predicted() -> None:
    core = _core("block", [_beat("a"), _beat("b")])
    core.view.instances["a"].prefix_index.record(SHARED)
    request = _request(SHARED)
    replicas = {i: core.view.replica(core.view.instances[i], time.time()) for i in ("a", "b")}
    assert replicas["a"].request_size(request)[0] == 1  # only the last prompt token is computed
    assert replicas["b"].request_size(request)[0] == 1024
    assert _placed_on(core, request) == "a"  # the same queue, a prefill of 1 token instead of 1,024
    assert core.stats.num_predicted_cached_tokens == 1023
    assert core.stats.num_placed_prompt_tokens == 1024


def test_instances_without_prefix_caching_have_no_index() -> None:
    core = _core("block", [_beat("a", prefix_caching=False)])
    assert core.view.instances["a"].prefix_index is None
    request = _request(SHARED)
    assert _placed_on(core, request) == "a"
    assert core.stats.num_predicted_cached_tokens == 0
