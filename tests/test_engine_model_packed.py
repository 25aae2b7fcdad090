"""The packed (compiled) scheduler against the reference scheduler stepped one step at a time.

The packed kernel runs every step as :meth:`EngineScheduler.step` does, in the same order
of floating-point operations, so the comparison is exact: same integers, same times."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from blockq.engine_model import EngineConfig, EngineRequest, EngineScheduler, get_preset
from blockq.engine_model.packed import PackedScheduler
from tests.test_engine_model_fast import (
    LATENCY_MODELS,
    StopRule,
    build_by_restoring,
    build_by_stepping,
    build_preset_state,
    random_rule,
    random_small_config,
    simulate_by_steps,
)

NUM_RANDOM_STATES = 1200
FIELDS = ("prompt_tokens", "output_target_tokens", "num_computed_tokens", "num_generated_tokens",
          "num_preemptions", "num_blocks", "first_scheduled_at_s", "first_token_at_s", "finished_at_s")


def assert_packed_equals_stepping(scheduler: EngineScheduler, rule: StopRule) -> tuple[int, int]:
    """Run ``rule`` on a packed copy and by stepping a clone; both must end identical.
    Returns (steps, preemptions) of the run."""
    packed = PackedScheduler.from_scheduler(scheduler)
    reference = scheduler.clone()
    by_id = {r.request_id: r for r in [*reference.running, *reference.waiting]}
    stop_row = -1 if rule.stop_when_finished is None else packed.request_ids.index(rule.stop_when_finished)
    expected = simulate_by_steps(reference, rule)
    num_steps = packed.simulate(until_s=rule.until_s, stop_row=stop_row, max_steps=rule.max_steps)
    assert num_steps == expected.num_steps
    assert packed.now_s == reference.now_s
    assert packed.num_free_blocks == reference.num_free_blocks
    assert packed.num_preemptions == expected.num_preemptions
    ids = packed.request_ids
    assert [ids[row] for row in packed.running_rows()] == [r.request_id for r in reference.running]
    assert [ids[row] for row in packed.waiting_rows()] == [r.request_id for r in reference.waiting]
    for row, request_id in enumerate(ids):
        got, want = packed.request(row), by_id[request_id]
        for name in FIELDS:
            assert getattr(got, name) == getattr(want, name), (request_id, name)
    return num_steps, expected.num_preemptions


def without_prefix_caching(config: EngineConfig) -> EngineConfig:
    return dataclasses.replace(config, enable_prefix_caching=False)


def test_packed_equals_stepping_on_random_states() -> None:
    rng = random.Random(99)
    num_preempting = num_cut = num_long = 0
    for case in range(NUM_RANDOM_STATES):
        config = without_prefix_caching(random_small_config(rng))
        build = build_by_stepping if case % 3 else build_by_restoring
        scheduler = build(rng, config, rng.choice(LATENCY_MODELS))
        rule = random_rule(rng, scheduler)
        num_steps, num_preemptions = assert_packed_equals_stepping(scheduler, rule)
        num_preempting += num_preemptions > 0
        num_cut += rule.until_s is not None or rule.max_steps < 1_000_000
        num_long += num_steps >= 20
    # the states must exercise preemption, stop rules and long runs, not only trivial ones
    assert num_preempting >= NUM_RANDOM_STATES // 20
    assert num_cut >= NUM_RANDOM_STATES // 4
    assert num_long >= NUM_RANDOM_STATES // 3


@pytest.mark.parametrize("case", range(8))
def test_packed_equals_stepping_on_preset_sized_states(case: int) -> None:
    """48 running + 20 waiting on the A30 preset; half with a cache small enough to preempt."""
    rng = random.Random(500 + case)
    scheduler = build_preset_state(rng, 1052 if case % 2 else 400)
    rules = [StopRule(None, None, 1_000_000), StopRule(None, "new", 1_000_000),
             StopRule(scheduler.now_s + rng.uniform(0.5, 5.0), None, 1_000_000),
             StopRule(None, None, rng.randint(50, 500))]
    assert_packed_equals_stepping(scheduler, rules[case % len(rules)])


def test_queue_drain_snapshot_matches_the_reference() -> None:
    """Same state as :meth:`EngineScheduler.queue_drain_snapshot` (whose jumps sum times in
    closed form, hence the tolerance on the clock)."""
    rng = random.Random(5)
    num_advanced = 0
    for case in range(300):
        if case % 10 == 0:
            scheduler = build_preset_state(rng, rng.choice([400, 1052]))
        else:
            config = without_prefix_caching(random_small_config(rng))
            scheduler = build_by_restoring(rng, config, rng.choice(LATENCY_MODELS))
        packed = PackedScheduler.from_scheduler(scheduler).queue_drain_snapshot()
        reference = scheduler.queue_drain_snapshot()
        ids = packed.request_ids
        assert math.isclose(packed.now_s, reference.now_s, rel_tol=1e-9, abs_tol=1e-12)
        assert [ids[row] for row in packed.running_rows()] == [r.request_id for r in reference.running]
        assert [ids[row] for row in packed.waiting_rows()] == [r.request_id for r in reference.waiting]
        assert packed.num_free_blocks == reference.num_free_blocks
        num_advanced += reference.now_s > scheduler.now_s
    assert num_advanced >= 30


def test_rows_added_past_capacity_keep_queue_order() -> None:
    preset = get_preset("llama2-7b-a30")
    scheduler = EngineScheduler(preset.config, preset.latency_model)
    for index in range(3):
        scheduler.add_request(EngineRequest(f"r{index}", 30, 5))
    scheduler.step()  # all three admitted
    packed = PackedScheduler.from_scheduler(scheduler, spare_rows=1)
    for index in range(3, 40):
        packed.add_request(f"r{index}", 30, 5)
        scheduler.add_request(EngineRequest(f"r{index}", 30, 5, arrival_s=scheduler.now_s))
    assert [packed.request_ids[row] for row in packed.waiting_rows()] == [f"r{i}" for i in range(3, 40)]
    packed.simulate()
    scheduler.simulate()
    assert all(packed.finished_at_s(row) is not None for row in range(packed.num_rows))
    assert math.isclose(packed.now_s, scheduler.now_s, rel_tol=1e-9)


def test_bad_requests_and_unsupported_models_are_refused_by_name() -> None:
    preset = get_preset("llama2-7b-a30")
    packed = PackedScheduler(preset.config, preset.latency_model)
    with pytest.raises(ValueError, match="prompt_tokens"):
        packed.add_request("x", preset.config.max_model_len, 10)
    with pytest.raises(ValueError, match="output_target_tokens"):
        packed.add_request("x", 10, 0)
    row = packed.add_request("y", preset.config.max_model_len - 10, 500)
    assert packed.request(row).output_target_tokens == 10  # clipped to max_model_len, as vLLM stops there
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        PackedScheduler(dataclasses.replace(preset.config, enable_prefix_caching=True), preset.latency_model)
