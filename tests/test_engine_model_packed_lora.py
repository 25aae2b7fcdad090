"""The packed (compiled) scheduler with LoRA adapters against the reference stepped one
step at a time: vLLM's ``max_loras`` skip, the resident adapters' LRU and the loads' time,
on random states with random adapters, ``max_loras`` and resident lists; the decode spans,
the queue-drain snapshot and what-if runs with adapters. Every comparison is exact."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from blockq.engine_model import (
    EngineConfig,
    EngineRequest,
    EngineScheduler,
    packed_span,
    step_builder,
)
from blockq.engine_model import packed_kernel as kernel
from blockq.engine_model import packed_layout as layout
from blockq.engine_model.lora import skips_for_lora
from blockq.engine_model.packed import PackedScheduler
from tests.factories import (
    A30,
    CONSTANT,
    LATENCY_MODELS,
    StopRule,
    all_requests,
    random_progress,
    random_request,
    random_rule,
    random_small_config,
    step_reference,
)
from tests.test_engine_model_fast import packed_what_if, what_if_by_stepping
from tests.test_engine_model_packed import assert_packed_matches, restored_rows

NUM_RANDOM_STATES = 1200


def random_lora_id(rng: random.Random, num_adapters: int) -> int:
    """0 (the base model) a fifth of the time, else adapter k with weight 1/k."""
    if rng.random() < 0.2:
        return 0
    return rng.choices(range(1, num_adapters + 1), weights=[1 / k for k in range(1, num_adapters + 1)])[0]


def lora_config(rng: random.Random, config: EngineConfig) -> EngineConfig:
    return dataclasses.replace(config, max_loras=rng.randint(1, 4), lora_load_ms=rng.choice([0.0, 1.5, 7, 30.0]))


def lora_request(rng: random.Random, config: EngineConfig, request_id: str, num_adapters: int) -> EngineRequest:
    request = random_request(rng, config, request_id)
    request.lora_id = random_lora_id(rng, num_adapters)
    return request


def build_lora_state(rng: random.Random, case: int) -> EngineScheduler:
    """A small random LoRA state: every third one restored (its running requests may hold
    more adapters than ``max_loras``, the resident list one more too), the rest stepped
    from requests arriving over a few steps; every tenth A30-sized."""
    if case % 10 == 0:
        return build_preset_lora_state(rng)
    config = lora_config(rng, random_small_config(rng))
    num_adapters = rng.randint(1, 3 * config.max_loras)
    scheduler = EngineScheduler(config, rng.choice(LATENCY_MODELS), now_s=rng.uniform(0.0, 50.0))
    if case % 3 == 0:
        running = [random_progress(rng, lora_request(rng, config, f"run{i}", num_adapters))
                   for i in range(rng.randint(0, config.max_num_seqs + 2))]
        running = [r for r in running if r.prompt_tokens + r.num_generated_tokens < config.max_model_len]
        waiting = [lora_request(rng, config, f"wait{i}", num_adapters) for i in range(rng.randint(0, 8))]
        scheduler.restore(running, waiting)
        scheduler.loaded_loras = rng.sample(range(1, num_adapters + 1),
                                            rng.randint(0, min(num_adapters, config.max_loras + 1)))
        return scheduler
    num_requests = rng.randint(1, 16)
    arrivals = sorted(rng.randint(0, 20) for _ in range(num_requests))
    index = 0
    for step_index in range(rng.randint(0, 60) + 1):
        while index < num_requests and arrivals[index] <= step_index:
            scheduler.add_request(lora_request(rng, config, f"r{index}", num_adapters))
            index += 1
        if scheduler.has_unfinished_requests:
            scheduler.step()
    while index < num_requests:
        scheduler.add_request(lora_request(rng, config, f"r{index}", num_adapters))
        index += 1
    return scheduler


def build_preset_lora_state(rng: random.Random) -> EngineScheduler:
    """A loaded A30-sized instance serving 12 adapters (Zipf): 48 running restored
    mid-flight, 20 waiting, a few steps run so that the resident list is the engine's own."""
    config = dataclasses.replace(A30.config, num_gpu_blocks=rng.choice([400, 1052]),
                                 max_loras=rng.choice([2, 4, 8]), lora_load_ms=30.0)
    scheduler = EngineScheduler(config, A30.latency_model, now_s=rng.uniform(0.0, 50.0))
    running = [random_progress(rng, lora_request(rng, config, f"run{i}", 12)) for i in range(48)]
    running = [r for r in running if r.prompt_tokens + r.num_generated_tokens < config.max_model_len]
    scheduler.restore(running, [lora_request(rng, config, f"wait{i}", 12) for i in range(20)])
    for _ in range(rng.randint(0, 5)):
        scheduler.step()
    return scheduler


def assert_lora_matches(packed: PackedScheduler, reference: EngineScheduler, requests: dict[str, EngineRequest],
                        num_loads: int) -> None:
    """:func:`assert_packed_matches`, and the same adapters by row, resident list and loads."""
    assert_packed_matches(packed, reference, requests)
    assert [packed.request(row).lora_id for row in range(packed.num_rows)] == [
        requests[request_id].lora_id for request_id in packed.request_ids]
    assert packed.loaded_loras == reference.loaded_loras
    assert packed.num_lora_loads == num_loads


def test_packed_lora_equals_stepping_on_random_states(monkeypatch: pytest.MonkeyPatch) -> None:
    skips: list[bool] = []

    def counted_skips(lora_id: int, scheduled_loras: set[int], max_loras: int) -> bool:
        skips.append(skips_for_lora(lora_id, scheduled_loras, max_loras))
        return skips[-1]

    monkeypatch.setattr(step_builder, "skips_for_lora", counted_skips)  # counts the reference's skips
    rng = random.Random(40)
    num_skipping = num_loading = num_over_slots = num_long = 0
    for case in range(NUM_RANDOM_STATES):
        scheduler = build_lora_state(rng, case)
        rule = random_rule(rng, scheduler)
        packed = PackedScheduler.from_scheduler(scheduler)
        reference = scheduler.clone()
        requests = all_requests(reference)
        stop_row = -1 if rule.stop_when_finished is None else packed.request_ids.index(rule.stop_when_finished)
        loads_before = reference.num_lora_loads
        del skips[:]
        expected = step_reference(reference, rule)
        num_steps = packed.simulate(until_s=rule.until_s, stop_row=stop_row, max_steps=rule.max_steps)
        assert num_steps == len(expected)
        assert_lora_matches(packed, reference, requests, reference.num_lora_loads - loads_before)
        num_skipping += any(skips)
        num_loading += packed.num_lora_loads > 0
        num_over_slots += len(packed.counters) > layout.NUM_COUNTERS + 2 * scheduler.config.max_loras
        num_long += num_steps >= 20
    # the states must skip rows, load adapters and run long, not only trivially
    assert num_skipping >= NUM_RANDOM_STATES // 10
    assert num_loading >= NUM_RANDOM_STATES // 3
    assert num_over_slots >= 20
    assert num_long >= NUM_RANDOM_STATES // 3


def test_restoring_packed_with_adapters_equals_restoring_the_reference_then_packing() -> None:
    rng = random.Random(41)
    for case in range(300):
        config = lora_config(rng, random_small_config(rng))
        num_adapters = rng.randint(1, 10)
        running = [random_progress(rng, lora_request(rng, config, f"run{i}", num_adapters))
                   for i in range(rng.randint(0, config.max_num_seqs + 3))]
        running = [r for r in running if r.prompt_tokens + r.num_generated_tokens < config.max_model_len
                   and r.num_generated_tokens < min(r.output_target_tokens, config.max_model_len - r.prompt_tokens)]
        waiting = [lora_request(rng, config, f"wait{i}", num_adapters) for i in range(rng.randint(0, 6))]
        loaded = rng.sample(range(1, num_adapters + 1), rng.randint(0, min(num_adapters, config.max_loras)))
        rows = restored_rows([*running, *waiting])
        packed = PackedScheduler.restored_columns(
            config, CONSTANT, 1.0, [row[0] for row in rows], np.array([row[1:] for row in rows], np.int64).reshape(-1, 4),
            len(running), lora_ids=[r.lora_id for r in [*running, *waiting]], loaded_loras=loaded)
        reference = EngineScheduler(config, CONSTANT, now_s=1.0)
        reference.restore([r.copy() for r in running], [r.copy() for r in waiting])
        reference.loaded_loras = list(loaded)
        assert_lora_matches(packed, reference, all_requests(reference), 0)
        # (the slots may differ: restored counts those the running rows asked for, before overflow)
        repacked = PackedScheduler.from_scheduler(reference)
        assert np.array_equal(packed.counters[:layout.NUM_COUNTERS], repacked.counters[:layout.NUM_COUNTERS])
        if case % 7 == 0:  # and they run alike
            requests = all_requests(reference)
            step_reference(reference)
            packed.simulate()
            assert_lora_matches(packed, reference, requests, reference.num_lora_loads)


def test_without_lora_adapter_ids_change_nothing() -> None:
    """max_loras 0: rows' adapter ids are ignored, as the reference ignores them."""
    rng = random.Random(42)
    for _ in range(100):
        config = random_small_config(rng)
        requests = [random_request(rng, config, f"r{i}") for i in range(rng.randint(1, 12))]
        plain = PackedScheduler(config, CONSTANT)
        with_ids = PackedScheduler(config, CONSTANT, loaded_loras=[3])
        for request in requests:
            plain.add_request(request.request_id, request.prompt_tokens, request.output_target_tokens)
            with_ids.add_request(request.request_id, request.prompt_tokens, request.output_target_tokens,
                                 lora_id=rng.randint(0, 5))
        assert len(with_ids.counters) == layout.NUM_COUNTERS and with_ids.loaded_loras == []
        plain.simulate()
        with_ids.simulate()
        assert np.array_equal(plain.times, with_ids.times, equal_nan=True)
        assert with_ids.num_lora_loads == 0


def test_a_decode_span_does_not_jump_a_step_that_loads() -> None:
    """Two decoding rows, one of an adapter evicted: the span refuses the step (it loads);
    once stepped, the span runs and leaves the resident list as stepping does."""
    config = EngineConfig(num_gpu_blocks=64, block_size=4, max_model_len=64, watermark=0.0, max_loras=2,
                          lora_load_ms=30.0)
    scheduler = EngineScheduler(config, CONSTANT)
    scheduler.add_request(EngineRequest("a", 5, 40, lora_id=1))
    scheduler.add_request(EngineRequest("b", 3, 30, lora_id=2))
    scheduler.add_request(EngineRequest("c", 3, 9, lora_id=0))
    scheduler.step()
    scheduler.loaded_loras = [1, 3]  # as if adapter 2 had been evicted since
    packed = PackedScheduler.from_scheduler(scheduler)
    assert _span(packed) == 0
    requests = all_requests(scheduler)
    step_reference(scheduler, StopRule(max_steps=1))
    assert scheduler.num_lora_loads == 3 and scheduler.loaded_loras == [1, 2]
    packed.simulate(max_steps=1)
    # two steps of 10 ms; the first loaded adapters 1 and 2, the second 2 again (30 ms each)
    assert packed.now_s == scheduler.now_s == pytest.approx(0.02 + 0.09)
    num_steps = _span(packed)
    assert num_steps == 38  # to the end: c, b and a finish inside it
    step_reference(scheduler, StopRule(max_steps=num_steps))
    assert_lora_matches(packed, scheduler, requests, 1)
    assert packed.loaded_loras == [2, 1]  # a's adapter was used last, after b finished


def _span(packed: PackedScheduler) -> int:
    blocks_by_phase = np.empty(max(packed.config.block_size, 1), np.int64)
    remaining = np.empty(len(packed.requests), np.int64)
    return packed_span.decode_span(
        packed.requests, packed.times, packed.running, packed.waiting, packed.counters, packed.clock,
        packed._config_array, packed._latency_array, packed._linear_table_s, np.inf, 1 << 62, -1,
        blocks_by_phase, remaining)


def test_queue_drain_snapshot_with_lora_is_a_state_before_a_tail_row_is_looked_at() -> None:
    """The snapshot is the reference stepped as many steps as the kernel advanced, and in
    those steps a request appended at the tail (of any adapter) is not looked at: it stays
    last, untouched, and the run with it is the run without it."""
    rng = random.Random(43)
    num_advanced = num_past_skipped = 0
    for case in range(300):
        scheduler = build_lora_state(rng, case)
        snapshot = PackedScheduler.from_scheduler(scheduler)
        num_steps = _advance_to_queue_drain(snapshot)
        plain, twin = scheduler.clone(), scheduler.clone()
        probe = EngineRequest("probe", 1, 1, arrival_s=scheduler.now_s, lora_id=rng.randint(0, 3))
        twin.add_request(probe)
        requests, loads_before = all_requests(plain), plain.num_lora_loads
        for _ in range(num_steps):
            result, twin_result = plain.step(), twin.step()
            assert result is not None and twin_result is not None
            assert (twin_result.produced_token_ids, twin_result.duration_s) == (
                result.produced_token_ids, result.duration_s)
            assert twin.waiting[-1] is probe and probe.first_scheduled_at_s is None
        assert_lora_matches(snapshot, plain, requests, plain.num_lora_loads - loads_before)
        num_advanced += num_steps > 0
        num_past_skipped += bool(plain.waiting) and num_steps > 0
    assert num_advanced >= 60 and num_past_skipped >= 10


def test_what_if_with_adapters_equals_stepping_the_reference_with_the_request() -> None:
    rng = random.Random(44)
    num_waited = num_loading = 0
    for case in range(150):
        scheduler = build_lora_state(rng, case)
        max_model_len = scheduler.config.max_model_len
        size = (rng.randint(1, min(max_model_len - 1, 600)), rng.randint(1, min(max_model_len, 600)))
        lora_id = rng.randint(0, 4)
        arrival_s = scheduler.now_s
        packed = PackedScheduler.from_scheduler(scheduler)
        expected, baseline_s = what_if_by_stepping(scheduler, packed.request_ids, size, arrival_s, lora_id=lora_id)
        assert packed_what_if(packed, size, arrival_s, baseline_s, lora_id=lora_id) == expected
        snapshot = packed.queue_drain_snapshot()
        num_steps = _advance_to_queue_drain(packed.clone())
        from_snapshot, _ = what_if_by_stepping(scheduler, packed.request_ids, size, arrival_s, num_steps,
                                               lora_id=lora_id)
        assert packed_what_if(snapshot, size, arrival_s, baseline_s, lora_id=lora_id) == from_snapshot
        num_waited += expected.ttft_s > 0.5
        num_loading += lora_id > 0 and lora_id not in scheduler.loaded_loras
    assert num_waited >= 25 and num_loading >= 50


def _advance_to_queue_drain(packed: PackedScheduler) -> int:
    """Advance ``packed`` in place as its queue-drain snapshot is made; returns the steps."""
    return kernel.advance_to_queue_drain(
        packed.requests, packed.times, packed.running, packed.waiting, packed.counters, packed.clock,
        packed._config_array, packed._latency_array, packed._linear_table_s)
