"""The fast simulator (:class:`PackedScheduler`) against the reference scheduler stepped by
hand: decode-only runs at the edge of the cache and cut by ``until_s``, the queue-drain
snapshot, and what-if runs. Every comparison is exact (same integers, same times)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest

from blockq.engine_model import EngineConfig, EngineRequest, EngineScheduler, StepLatencyModel
from blockq.engine_model import packed_layout as layout
from blockq.engine_model.packed import PackedScheduler
from tests.factories import (
    A30,
    CONSTANT,
    HEAVY_KV,
    KV_BOUND,
    LATENCY_MODELS,
    StopRule,
    all_requests,
    build_preset_state,
    build_random_state,
    num_preemptions,
    random_progress,
    random_request,
    step_reference,
)
from tests.test_engine_model_packed import assert_packed_equals_stepping, assert_packed_matches

# dyadic step times add up exactly in any order
DYADIC = StepLatencyModel(linear_knot_tokens=(1,), linear_knot_s=(0.0,), kv_token_s=2.0**-20,
                          prefill_pair_s=0.0, step_overhead_s=2.0**-6)
WHAT_IF_ID = "what-if"


def decoding_scheduler(latency_model: StepLatencyModel = CONSTANT, **config_fields: object) -> EngineScheduler:
    """Requests a (5 + 40 tokens) and b (3 + 30) on a small cache, nothing run yet."""
    fields: dict[str, object] = {"num_gpu_blocks": 64, "block_size": 4, "max_model_len": 64,
                                 "watermark": 0.0, **config_fields}
    config = EngineConfig(**fields)  # type: ignore[arg-type]
    scheduler = EngineScheduler(config, latency_model)
    scheduler.add_request(EngineRequest("a", 5, 40))
    scheduler.add_request(EngineRequest("b", 3, 30))
    return scheduler


# --- simulate: hand-computed runs and edge cases ---------------------------------------------

def test_a_decode_run_stops_at_the_stop_rows_finish() -> None:
    scheduler = decoding_scheduler()
    packed = PackedScheduler.from_scheduler(scheduler)
    # step 1 prefills both (and samples their first tokens); steps 2-30 only decode
    assert packed.simulate(stop_row=packed.request_ids.index("b")) == 30
    a, b = packed.request(0), packed.request(1)
    assert a.first_token_at_s == b.first_token_at_s == pytest.approx(0.01)
    assert b.finished_at_s == packed.now_s == pytest.approx(0.30)
    assert a.finished_at_s is None and a.num_generated_tokens == 30
    assert a.num_blocks == -(-(5 + 29) // 4) and packed.num_free_blocks == 64 - a.num_blocks
    assert_packed_equals_stepping(scheduler, StopRule(stop_when_finished="b"))


def test_until_s_stops_before_the_step_that_would_start_too_late() -> None:
    packed = PackedScheduler.from_scheduler(decoding_scheduler())
    assert packed.simulate(until_s=0.105) == 11  # steps start at 0, 0.01, ..., 0.10
    assert packed.now_s == pytest.approx(0.11)
    packed.simulate()
    assert packed.simulate(until_s=5.0) == 0 and packed.now_s == 5.0  # idle: time moves on
    assert_packed_equals_stepping(decoding_scheduler(), StopRule(until_s=0.105))


def test_until_s_on_a_step_boundary_does_not_start_that_step() -> None:
    rng = random.Random(3)
    for case in range(80):
        # a third request waiting for a sequence slot: every finish may admit it
        scheduler = decoding_scheduler(rng.choice([DYADIC, CONSTANT, KV_BOUND, HEAVY_KV, A30.latency_model]),
                                       num_gpu_blocks=rng.randint(17, 40), max_num_seqs=2 + case % 2)
        scheduler.add_request(EngineRequest("c", 2, 3))
        reference = scheduler.clone()
        requests = all_requests(reference)
        step_reference(reference, StopRule(max_steps=rng.randint(1, 45)))
        boundary_s = reference.now_s  # exactly when the next step would start
        packed = PackedScheduler.from_scheduler(scheduler)
        packed.simulate(until_s=boundary_s)
        assert_packed_matches(packed, reference, requests)
        assert_packed_equals_stepping(scheduler, StopRule(until_s=boundary_s))


def test_decoding_at_the_edge_of_the_cache_equals_stepping() -> None:
    """Decoding batches with nobody waiting, in caches from a few blocks short of what
    they need to finish (finishes give blocks back on the way) to just enough."""
    rng = random.Random(4242)
    num_cases = num_preempting = 0
    for _ in range(120):
        block_size = rng.choice([1, 2, 4, 8])
        max_model_len = rng.randint(8, 48)
        big = EngineConfig(num_gpu_blocks=10_000, block_size=block_size, max_model_len=max_model_len)
        running = []
        for index in range(rng.randint(1, 8)):
            request = random_progress(rng, random_request(rng, big, f"r{index}"))
            request.num_generated_tokens = max(1, request.num_generated_tokens)
            at_limit = request.num_tokens >= max_model_len
            if at_limit or request.num_generated_tokens >= request.output_target_tokens:
                continue
            request.num_computed_tokens = request.num_tokens - 1
            running.append(request)
        held = sum(-(-r.num_computed_tokens // block_size) for r in running)
        needed = sum(-(-(r.prompt_tokens + r.output_target_tokens - 1) // block_size)
                     for r in running) - held
        min_blocks = -(-max_model_len // block_size) + 1
        for num_gpu_blocks in range(max(min_blocks, held + needed - 6), held + needed + 2):
            config = EngineConfig(num_gpu_blocks=num_gpu_blocks, block_size=block_size,
                                  max_num_seqs=8, max_num_batched_tokens=64,
                                  max_model_len=max_model_len, watermark=0.0)
            scheduler = EngineScheduler(config, rng.choice(LATENCY_MODELS))
            scheduler.restore([r.copy() for r in running], [])
            _, packed = assert_packed_equals_stepping(scheduler, StopRule())
            num_cases += 1
            num_preempting += packed.num_preemptions > 0
    assert num_cases >= 500 and num_preempting >= 50


# --- the queue-drain snapshot ------------------------------------------------------------------

def steps_to_queue_drain(scheduler: EngineScheduler) -> int:
    """How many steps the reference runs before the first step that leaves its waiting
    queue empty (0 when nothing waits), on clones.

    Checks on a twin with a request appended at the tail that, in those steps, that request
    is not looked at: it stays waiting last, untouched, and the twin runs the very same
    steps."""
    plain = scheduler.clone()
    twin = scheduler.clone()
    probe = EngineRequest("probe", 1, 1, arrival_s=scheduler.now_s)
    twin.add_request(probe)
    num_steps = 0
    while plain.waiting:
        result, twin_result = plain.step(), twin.step()
        assert result is not None and twin_result is not None
        if not plain.waiting:
            return num_steps
        num_steps += 1
        assert (twin_result.produced_token_ids, twin_result.preempted_ids, twin_result.duration_s) == (
            result.produced_token_ids, result.preempted_ids, result.duration_s)
        assert twin.waiting[-1] is probe and probe.first_scheduled_at_s is None
        assert [r.request_id for r in twin.waiting] == [*(r.request_id for r in plain.waiting), "probe"]
        assert [r.request_id for r in twin.running] == [r.request_id for r in plain.running]
        assert (twin.now_s, twin.num_free_blocks) == (plain.now_s, plain.num_free_blocks)
    return num_steps


def random_or_preset_state(rng: random.Random, case: int) -> EngineScheduler:
    """Every tenth state A30-sized (half of those with a cache that preempts), the rest small."""
    if case % 10 == 0:
        return build_preset_state(rng, rng.choice([400, 1052]))
    return build_random_state(rng, case)


def test_queue_drain_snapshot_is_the_reference_before_its_queue_empties() -> None:
    rng = random.Random(5)
    num_advanced = num_long = 0
    for case in range(300):
        scheduler = random_or_preset_state(rng, case)
        packed = PackedScheduler.from_scheduler(scheduler)
        snapshot = packed.queue_drain_snapshot()
        num_steps = steps_to_queue_drain(scheduler)
        reference = scheduler.clone()
        requests = all_requests(reference)
        step_reference(reference, StopRule(max_steps=num_steps))
        assert_packed_matches(snapshot, reference, requests)
        assert packed.now_s == scheduler.now_s  # the original is not changed
        num_advanced += num_steps > 0
        num_long += num_steps >= 20
    assert num_advanced >= 60 and num_long >= 10


# --- what-if runs ------------------------------------------------------------------------------

@dataclass(frozen=True)
class WhatIf:
    """A what-if run's outputs (as :meth:`PackedScheduler.what_if` returns them), in
    seconds after the new request's arrival, and each row's finish (the new one last)."""

    ttft_s: float
    e2e_s: float
    added_delay_s: float
    max_latency_s: float
    num_preemptions: int
    finished_at_s: list[float]


def finish_times(requests: dict[str, EngineRequest], row_ids: list[str]) -> list[float]:
    """When each of ``row_ids`` finished (all must have)."""
    times_s = [requests[request_id].finished_at_s for request_id in row_ids]
    assert None not in times_s
    return times_s  # type: ignore[return-value]


def what_if_by_stepping(scheduler: EngineScheduler, row_ids: list[str], size: tuple[int, int],
                        arrival_s: float, skip_steps: int = 0, *, lora_id: int = 0) -> tuple[WhatIf, list[float]]:
    """The what-if run, stepped: the reference run to the end without and with a request of
    ``size`` appended at ``arrival_s``. Returns the outputs and the run without it (each
    row's finish: the baseline). Preemptions are those made after the first ``skip_steps``
    steps (the run from a queue-drain snapshot ``skip_steps`` ahead); rows are ``row_ids``;
    ``lora_id``: the request's adapter."""
    without = scheduler.clone()
    baseline = all_requests(without)
    step_reference(without)
    with_request = scheduler.clone()
    finishes = all_requests(with_request)
    with_request.add_request(EngineRequest(WHAT_IF_ID, *size, arrival_s=arrival_s, lora_id=lora_id))
    finishes[WHAT_IF_ID] = with_request.waiting[-1]
    results = step_reference(with_request)
    baseline_s = finish_times(baseline, row_ids)
    finished_s = finish_times(finishes, [*row_ids, WHAT_IF_ID])
    # the sum runs in row order, as the kernel's does, so that it comes out equal exactly
    added_delay_s = 0.0
    for finish_s, before_s in zip(finished_s[:-1], baseline_s, strict=True):
        if finish_s > before_s:
            added_delay_s += finish_s - before_s
    first_token_s = finishes[WHAT_IF_ID].first_token_at_s
    assert first_token_s is not None
    outputs = WhatIf(first_token_s - arrival_s, finished_s[-1] - arrival_s, added_delay_s,
                     max(finished_s) - arrival_s, num_preemptions(results[skip_steps:]), finished_s)
    return outputs, baseline_s


def packed_what_if(start: PackedScheduler, size: tuple[int, int], arrival_s: float,
                   baseline_s: list[float], *, lora_id: int = 0) -> WhatIf:
    """:meth:`PackedScheduler.what_if` from ``start``, as a :class:`WhatIf`."""
    rows_before = start.clone()
    *outputs, num_preempted, finished_s, drain_snapshot = start.what_if(*size, arrival_s, np.array(baseline_s),
                                                                        lora_id=lora_id)
    # the run that stops at the first token gives the same TTFT
    ttft_s, prefill_s = start.first_token_if(*size, arrival_s, lora_id)
    assert ttft_s == outputs[0]
    # and the prefill alone, as the latency model prices one chunk of the budget after another
    budget = start.config.max_num_batched_tokens
    num_full, rest = divmod(size[0], budget)
    model = start.latency_model
    assert prefill_s == (num_full * model.step_seconds(budget, 0, 0) if num_full else 0.0) + (
        model.step_seconds(rest, 0, 0) if rest else 0.0)
    assert np.array_equal(start.times, rows_before.times, equal_nan=True)  # the state is not changed
    # the run's queue-drain point is what appending the request then advancing there gives
    rows_before.add_request(WHAT_IF_ID, *size, arrival_s=arrival_s, lora_id=lora_id)
    assert_same_state(drain_snapshot, rows_before.queue_drain_snapshot())
    return WhatIf(*outputs, num_preempted, finished_s.tolist())


def assert_same_state(state: PackedScheduler, expected: PackedScheduler) -> None:
    """Row for row, queue for queue (the arrays' spare capacity and ring layout aside)."""
    num_rows = expected.num_rows
    assert state.request_ids == expected.request_ids
    assert np.array_equal(state.requests[:num_rows], expected.requests[:num_rows])
    assert np.array_equal(state.times[:num_rows], expected.times[:num_rows], equal_nan=True)
    assert state.running_rows() == expected.running_rows() and state.waiting_rows() == expected.waiting_rows()
    for field in (layout.NUM_ROWS, layout.NUM_RUNNING, layout.NUM_WAITING, layout.NUM_FREE_BLOCKS,
                  layout.NUM_PREEMPTIONS, layout.NUM_LORA_LOADS):
        assert state.counters[field] == expected.counters[field]
    assert state.loaded_loras == expected.loaded_loras
    assert state.now_s == expected.now_s


def test_what_if_equals_stepping_the_reference_with_the_request() -> None:
    """All five outputs and every finish, from the state itself and from its queue-drain
    snapshot (as the dispatcher runs it), against the reference stepped to the end; and
    the TTFT-only run's TTFT."""
    rng = random.Random(11)
    num_preempting = num_delaying = num_waited = 0
    for case in range(300):
        scheduler = random_or_preset_state(rng, case)
        max_model_len = scheduler.config.max_model_len
        size = (rng.randint(1, min(max_model_len - 1, 600)), rng.randint(1, min(max_model_len, 600)))
        arrival_s = scheduler.now_s - rng.choice([0.0, rng.uniform(0.0, 2.0)])
        packed = PackedScheduler.from_scheduler(scheduler)
        expected, baseline_s = what_if_by_stepping(scheduler, packed.request_ids, size, arrival_s)
        assert packed_what_if(packed, size, arrival_s, baseline_s) == expected
        num_steps = steps_to_queue_drain(scheduler)
        from_snapshot, _ = what_if_by_stepping(scheduler, packed.request_ids, size, arrival_s, num_steps)
        assert packed_what_if(packed.queue_drain_snapshot(), size, arrival_s, baseline_s) == from_snapshot
        num_preempting += expected.num_preemptions > 0
        num_delaying += expected.added_delay_s > 0
        num_waited += expected.ttft_s > 0.5
    # the runs must preempt, delay others and keep the new request waiting, not only trivially
    assert num_preempting >= 50 and num_delaying >= 75 and num_waited >= 100
