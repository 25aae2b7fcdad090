"""The packed (compiled) scheduler's runs against the reference scheduler stepped one step
at a time, under every stop rule; and the packed state's own bookkeeping.

The packed kernel runs every step as :meth:`EngineScheduler.step` does, in the same order
of floating-point operations, so the comparison is exact: same integers, same times."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from blockq.engine_model import EngineConfig, EngineRequest, EngineScheduler, get_preset
from blockq.engine_model import packed_layout as layout
from blockq.engine_model.packed import PackedScheduler
from tests.factories import (
    A30,
    StopRule,
    all_requests,
    build_preset_state,
    build_random_state,
    num_preemptions,
    random_progress,
    random_request,
    random_rule,
    random_small_config,
    step_reference,
)

NUM_RANDOM_STATES = 1200
FIELDS = ("prompt_tokens", "output_target_tokens", "num_computed_tokens", "num_generated_tokens",
          "num_preemptions", "num_blocks", "arrival_s", "first_scheduled_at_s", "first_token_at_s",
          "finished_at_s")


def assert_packed_matches(packed: PackedScheduler, reference: EngineScheduler,
                          requests: dict[str, EngineRequest]) -> None:
    """Same clock, free blocks, queue orders, and every row equal to the request of its id
    in ``requests`` (which must hold the reference's finished requests too), exactly."""
    ids = packed.request_ids
    assert packed.now_s == reference.now_s
    assert packed.num_free_blocks == reference.num_free_blocks
    assert [ids[row] for row in packed.running_rows()] == [r.request_id for r in reference.running]
    assert [ids[row] for row in packed.waiting_rows()] == [r.request_id for r in reference.waiting]
    assert sorted(ids) == sorted(requests)
    for row, request_id in enumerate(ids):
        got, want = packed.request(row), requests[request_id]
        for name in FIELDS:
            assert getattr(got, name) == getattr(want, name), (request_id, name)


def assert_packed_equals_stepping(scheduler: EngineScheduler, rule: StopRule) -> tuple[int, PackedScheduler]:
    """Run ``rule`` on a packed copy and by stepping a clone; both must end identical
    (steps run and preemptions made included). Returns the steps and the packed copy."""
    packed = PackedScheduler.from_scheduler(scheduler)
    reference = scheduler.clone()
    requests = all_requests(reference)
    stop_row = -1 if rule.stop_when_finished is None else packed.request_ids.index(rule.stop_when_finished)
    expected = step_reference(reference, rule)
    num_steps = packed.simulate(until_s=rule.until_s, stop_row=stop_row, max_steps=rule.max_steps)
    assert num_steps == len(expected)
    assert packed.num_preemptions == num_preemptions(expected)
    assert_packed_matches(packed, reference, requests)
    return num_steps, packed


def test_packed_equals_stepping_on_random_states() -> None:
    rng = random.Random(99)
    num_preempting = num_long = num_to_end = num_cut_by_time = num_stopped_on_row = 0
    for case in range(NUM_RANDOM_STATES):
        scheduler = build_random_state(rng, case)
        rule = random_rule(rng, scheduler)
        num_steps, packed = assert_packed_equals_stepping(scheduler, rule)
        unfinished = bool(packed.running_rows() or packed.waiting_rows())
        num_preempting += packed.num_preemptions > 0
        num_long += num_steps >= 20
        num_to_end += not unfinished and num_steps > 0
        num_cut_by_time += unfinished and rule.until_s is not None and packed.now_s >= rule.until_s
        stop_id = rule.stop_when_finished
        num_stopped_on_row += unfinished and stop_id is not None and packed.finished_at_s(
            packed.request_ids.index(stop_id)) is not None
    # the states must exercise preemption, every stop rule and long runs, not only trivial ones
    assert num_preempting >= NUM_RANDOM_STATES // 20
    assert num_long >= NUM_RANDOM_STATES // 3
    assert num_to_end >= NUM_RANDOM_STATES // 4
    assert num_cut_by_time >= NUM_RANDOM_STATES // 10
    assert num_stopped_on_row >= NUM_RANDOM_STATES // 10


@pytest.mark.parametrize("case", range(8))
def test_packed_equals_stepping_on_preset_sized_states(case: int) -> None:
    """48 running + 20 waiting on the A30 preset; half with a cache small enough to preempt."""
    rng = random.Random(500 + case)
    scheduler = build_preset_state(rng, 1052 if case % 2 else 400)
    rules = [StopRule(), StopRule(stop_when_finished="new"),
             StopRule(until_s=scheduler.now_s + rng.uniform(0.5, 5.0)),
             StopRule(max_steps=rng.randint(50, 500))]
    num_steps, _ = assert_packed_equals_stepping(scheduler, rules[case % len(rules)])
    assert num_steps >= 20


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
    requests = all_requests(scheduler)
    packed.simulate()
    step_reference(scheduler)
    assert all(packed.finished_at_s(row) is not None for row in range(packed.num_rows))
    assert_packed_matches(packed, scheduler, requests)


def test_adding_rows_in_one_call_equals_adding_them_one_by_one() -> None:
    """``add_requests`` (a rebuild re-adds placed requests with it) writes what repeated
    ``add_request`` writes, behind a moved queue head and across capacity doublings."""
    preset = get_preset("llama2-7b-a30")
    scheduler = EngineScheduler(preset.config, preset.latency_model)
    for index in range(6):
        scheduler.add_request(EngineRequest(f"r{index}", 600, 5))
    scheduler.step()
    one_by_one = PackedScheduler.from_scheduler(scheduler, spare_rows=2)
    one_by_one.simulate(until_s=one_by_one.now_s + 1e-9)  # one more admitted: the head moves
    assert one_by_one.counters[layout.WAITING_HEAD] > 0
    in_one_call = one_by_one.clone()
    new = [(f"n{index}", 20 + index, 4080) for index in range(30)]
    for request_id, prompt_tokens, output_tokens in new:
        one_by_one.add_request(request_id, prompt_tokens, output_tokens)
    in_one_call.add_requests(new)
    assert in_one_call.waiting_rows() == one_by_one.waiting_rows()
    assert in_one_call.request_ids == one_by_one.request_ids
    rows = one_by_one.num_rows
    assert np.array_equal(in_one_call.requests[:rows], one_by_one.requests[:rows])
    assert np.array_equal(in_one_call.times[:rows], one_by_one.times[:rows], equal_nan=True)
    assert in_one_call.requests[rows - 1, layout.TARGET] == preset.config.max_model_len - 49  # clipped alike
    with pytest.raises(ValueError, match="prompt_tokens"):
        in_one_call.add_requests([("bad", 0, 5)])


def restored_rows(requests: list[EngineRequest]) -> list[tuple[str, int, int, int, int]]:
    return [(r.request_id, r.prompt_tokens, r.output_target_tokens, r.num_computed_tokens,
             r.num_generated_tokens) for r in requests]


def test_restoring_packed_equals_restoring_the_reference_then_packing() -> None:
    """``PackedScheduler.restored`` (a replica rebuild) builds exactly what the reference's
    ``restore`` and ``from_scheduler`` build: rows, queues, free blocks, and running rows
    that no longer fit (sequence slots, blocks) queued ahead of the waiting ones."""
    rng = random.Random(17)
    num_overflowing = 0
    for case in range(400):
        config = random_small_config(rng) if case % 4 else EngineConfig(num_gpu_blocks=rng.choice([300, 400, 1052]))
        running = [random_progress(rng, random_request(rng, config, f"run{i}"))
                   for i in range(rng.randint(0, config.max_num_seqs + 3))]
        running = [r for r in running if r.prompt_tokens + r.num_generated_tokens < config.max_model_len
                   and r.num_generated_tokens < min(r.output_target_tokens, config.max_model_len - r.prompt_tokens)]
        waiting = [random_request(rng, config, f"wait{i}") for i in range(rng.randint(0, 6))]
        now_s = rng.uniform(0.0, 100.0)
        packed = PackedScheduler.restored(config, A30.latency_model, now_s, restored_rows(running),
                                          restored_rows(waiting), spare_rows=3)
        reference = EngineScheduler(config, A30.latency_model, now_s=now_s)
        reference.restore([r.copy() for r in running], [r.copy() for r in waiting])
        num_overflowing += len(reference.running) < len(running)
        assert_packed_matches(packed, reference, all_requests(reference))
        assert_packed_matches(PackedScheduler.from_scheduler(reference), reference, all_requests(reference))
        assert np.array_equal(packed.counters, PackedScheduler.from_scheduler(reference).counters)
    assert num_overflowing >= 40


def test_restoring_packed_refuses_what_the_reference_refuses() -> None:
    config = A30.config
    for row, field in [(("", 10, 5, 0, 0), "request_id"), (("a", 0, 5, 0, 0), "prompt_tokens"),
                       (("a", 4096, 5, 0, 0), "prompt_tokens"), (("a", 10, 0, 0, 0), "output_target_tokens"),
                       (("a", 10, 5, 0, -1), "num_generated_tokens"), (("a", 10, 5, 9, 5), "num_generated_tokens"),
                       (("a", 4090, 50, 0, 6), "num_generated_tokens")]:
        with pytest.raises(ValueError, match=field) as packed_error:
            PackedScheduler.restored(config, A30.latency_model, 0.0, [row], [])
        with pytest.raises(ValueError) as reference_error:
            EngineScheduler(config, A30.latency_model).restore([EngineRequest(row[0], *row[1:3], num_computed_tokens=row[3],
                                                                               num_generated_tokens=row[4])], [])
        assert str(packed_error.value) == str(reference_error.value)
    with pytest.raises(ValueError, match="already in this engine"):
        PackedScheduler.restored(config, A30.latency_model, 0.0, [("a", 10, 5, 0, 0)], [("a", 10, 5, 0, 0)])


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
