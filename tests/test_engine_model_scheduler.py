"""Hand-computed cases for the engine model's scheduler (vLLM policy, step by step)."""

from __future__ import annotations

import pytest

from blockq.engine_model import (
    EngineConfig,
    EngineRequest,
    EngineScheduler,
    StepLatencyModel,
    StepResult,
)

STEP_S = 0.01


def constant_latency(step_s: float = STEP_S) -> StepLatencyModel:
    """A latency model where every step takes ``step_s`` seconds."""
    return StepLatencyModel(linear_knot_tokens=(1,), linear_knot_s=(0.0,), kv_token_s=0.0,
                            prefill_pair_s=0.0, step_overhead_s=step_s)


def make_scheduler(**config_fields: object) -> EngineScheduler:
    config = EngineConfig(**{"num_gpu_blocks": 1052, "block_size": 16, "max_num_seqs": 48,
                             "max_num_batched_tokens": 512, "max_model_len": 4096,
                             "watermark": 0.0, **config_fields})
    return EngineScheduler(config, constant_latency())


def add(scheduler: EngineScheduler, request_id: str, prompt_tokens: int, output_tokens: int,
        **fields: object) -> EngineRequest:
    request = EngineRequest(request_id, prompt_tokens, output_tokens, **fields)
    scheduler.add_request(request)
    return request


def step(scheduler: EngineScheduler) -> StepResult:
    result = scheduler.step()
    assert result is not None
    return result


def test_chunked_prefill_splits_the_token_budget_in_fcfs_order() -> None:
    scheduler = make_scheduler()
    first = add(scheduler, "a", 400, 3)
    second = add(scheduler, "b", 400, 3)

    result = step(scheduler)
    assert (result.num_prefill_tokens, result.num_decode_seqs) == (512, 0)
    assert (first.num_computed_tokens, second.num_computed_tokens) == (400, 112)
    assert result.produced_token_ids == ("a",) and result.first_token_ids == ("a",)
    assert result.num_kv_tokens_attended == 512
    assert result.num_prefill_attention_pairs == 400 * 401 // 2 + 112 * 113 // 2

    result = step(scheduler)  # a decodes, b's remaining 288 prompt tokens
    assert (result.num_prefill_tokens, result.num_decode_seqs) == (288, 1)
    assert result.produced_token_ids == ("a", "b") and result.first_token_ids == ("b",)
    assert result.num_kv_tokens_attended == 401 + 400

    result = step(scheduler)
    assert [r.request_id for r in result.finished] == ["a"]
    result = step(scheduler)
    assert [r.request_id for r in result.finished] == ["b"]
    assert scheduler.step() is None
    assert first.first_token_at_s == pytest.approx(STEP_S)
    assert second.first_token_at_s == pytest.approx(2 * STEP_S)
    assert second.finished_at_s == pytest.approx(4 * STEP_S)
    assert (first.num_generated_tokens, second.num_generated_tokens) == (3, 3)


def test_running_decodes_take_the_budget_before_prefills() -> None:
    scheduler = make_scheduler(max_num_seqs=8, max_num_batched_tokens=8)
    decoder = add(scheduler, "a", 8, 10)
    late = add(scheduler, "b", 30, 2)

    result = step(scheduler)  # the budget is spent on a's prompt: b is not admitted
    assert result.num_prefill_tokens == 8 and late.first_scheduled_at_s is None
    result = step(scheduler)
    assert (result.num_decode_seqs, result.num_prefill_tokens) == (1, 7)
    result = step(scheduler)  # b is now an ongoing prefill, still after the decode
    assert (result.num_decode_seqs, result.num_prefill_tokens) == (1, 7)
    assert (decoder.num_computed_tokens, late.num_computed_tokens) == (10, 14)


def test_a_block_is_allocated_exactly_when_a_token_crosses_a_block_boundary() -> None:
    scheduler = make_scheduler(block_size=4, num_gpu_blocks=16, max_model_len=32)
    request = add(scheduler, "a", 6, 8)
    used_after_each_step = [step(scheduler).num_used_blocks for _ in range(5)]
    # computed tokens after each step: 6, 7, 8, 9, 10 -> ceil(n / 4) blocks
    assert used_after_each_step == [2, 2, 2, 3, 3]
    assert request.num_blocks == 3


def test_max_num_seqs_caps_the_running_batch() -> None:
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for name in "abc":
        add(scheduler, name, 4, 2)
    result = step(scheduler)
    assert result.num_prefill_tokens == 8 and result.num_running == 2
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    result = step(scheduler)  # a and b finish; c must wait for a free slot
    assert len(result.finished) == 2 and scheduler.waiting[0].request_id == "c"
    result = step(scheduler)
    assert result.num_prefill_tokens == 4 and not scheduler.waiting


def test_preemption_takes_the_most_recently_started_request() -> None:
    scheduler = make_scheduler(block_size=4, num_gpu_blocks=6, max_num_seqs=4,
                               max_num_batched_tokens=16, max_model_len=24)
    requests = [add(scheduler, name, 4, 10) for name in "abc"]
    results = [step(scheduler) for _ in range(5)]  # all computed to 8 tokens: 6 blocks used
    assert results[-1].num_used_blocks == 6 and not any(r.preempted_ids for r in results)

    result = step(scheduler)  # a needs a 3rd block: c (started last) is preempted
    assert result.preempted_ids == ("c",) and result.produced_token_ids == ("a", "b")
    victim = requests[2]
    assert scheduler.waiting[0] is victim and victim.num_preemptions == 1
    assert (victim.num_computed_tokens, victim.num_generated_tokens, victim.num_blocks) == (0, 5, 0)


def test_a_request_that_is_last_preempts_itself_and_recomputes() -> None:
    scheduler = make_scheduler(block_size=4, num_gpu_blocks=4, max_num_seqs=4,
                               max_num_batched_tokens=16, max_model_len=16)
    first = add(scheduler, "a", 7, 8)
    last = add(scheduler, "b", 3, 8)
    step(scheduler)
    step(scheduler)  # a: 8 computed (2 blocks), b: 4 computed (1 block)
    result = step(scheduler)  # a takes the last block; b needs one and is itself the last
    assert result.preempted_ids == ("b",) and result.produced_token_ids == ("a",)
    assert last.num_generated_tokens == 2 and scheduler.waiting[0] is last

    results = []
    while last.finished_at_s is None:
        results.append(step(scheduler))
    resumed = next(r for r in results if "b" in r.produced_token_ids)
    # b recomputes its prompt and both generated tokens as one prefill, then samples token 3
    assert resumed.num_prefill_tokens == 3 + 2
    assert first.num_generated_tokens == 8 and last.num_generated_tokens == 8
    assert last.num_preemptions == 1
    assert sum(r.produced_token_ids.count("b") for r in results) == 8 - 2


def test_admission_is_fcfs_without_skipping() -> None:
    scheduler = make_scheduler(block_size=4, num_gpu_blocks=10, max_model_len=40,
                               max_num_batched_tokens=64)
    running = add(scheduler, "a", 20, 20)
    step(scheduler)  # a holds 5 blocks
    add(scheduler, "b", 24, 1)  # needs 6 blocks
    add(scheduler, "c", 4, 1)  # would fit, but stands behind b
    step(scheduler)  # a decodes into a 6th block: 4 left
    assert scheduler.running == [running]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]


def test_admission_keeps_the_watermark_free() -> None:
    scheduler = make_scheduler(block_size=1, num_gpu_blocks=100, watermark=0.1,
                               max_model_len=64, max_num_batched_tokens=64)
    add(scheduler, "a", 30, 40)
    step(scheduler)  # 30 blocks used
    add(scheduler, "b", 61, 1)  # 100 - 31 - 61 = 8 < 10 watermark blocks
    step(scheduler)
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    assert scheduler.can_admit(58) is False and scheduler.can_admit(1) is False


def test_prefix_cache_hits_skip_cached_prompt_blocks() -> None:
    hashes = (11, 12, 13)
    for enabled, expected_prefill in ((False, 14), (True, 2)):
        scheduler = make_scheduler(block_size=4, num_gpu_blocks=32, max_model_len=64,
                                   enable_prefix_caching=enabled)
        add(scheduler, "a", 14, 1, prefix_block_hashes=hashes)
        step(scheduler)
        assert scheduler.num_used_blocks == 0  # a finished; its hashed blocks stay cached
        add(scheduler, "b", 14, 1, prefix_block_hashes=hashes)
        assert step(scheduler).num_prefill_tokens == expected_prefill


def test_prefix_blocks_are_shared_and_at_least_one_token_is_computed() -> None:
    scheduler = make_scheduler(block_size=4, num_gpu_blocks=32, max_model_len=64,
                               enable_prefix_caching=True)
    hashes = (1, 2, 3)
    first = add(scheduler, "a", 12, 5, prefix_block_hashes=hashes)
    step(scheduler)  # 12 tokens -> 3 hashed blocks
    second = add(scheduler, "b", 12, 5, prefix_block_hashes=hashes)
    result = step(scheduler)
    # a whole-prompt hit still recomputes the last block (the step samples a token)
    assert result.num_prefill_tokens == 4 and second.num_generated_tokens == 1
    # a: 4 blocks (13 tokens); b: 2 shared + 1 private; shared blocks count once
    assert (first.num_blocks, second.num_blocks) == (4, 3)
    assert scheduler.num_used_blocks == 4 + 1


def test_cached_prefix_blocks_are_evicted_when_space_is_needed() -> None:
    scheduler = make_scheduler(block_size=4, num_gpu_blocks=8, max_model_len=32,
                               max_num_batched_tokens=64, enable_prefix_caching=True)
    add(scheduler, "a", 8, 1, prefix_block_hashes=(7, 8))
    step(scheduler)
    add(scheduler, "filler", 32 - 1, 1)  # needs all 8 blocks: evicts a's cached blocks
    step(scheduler)
    add(scheduler, "b", 8, 1, prefix_block_hashes=(7, 8))
    assert step(scheduler).num_prefill_tokens == 8


def test_abort_frees_blocks_and_reports_presence() -> None:
    scheduler = make_scheduler(block_size=4)
    add(scheduler, "a", 10, 5)
    add(scheduler, "b", 10, 5)
    step(scheduler)
    add(scheduler, "c", 10, 5)
    assert scheduler.abort_request("a") and scheduler.abort_request("c")
    assert not scheduler.abort_request("a")
    assert scheduler.num_used_blocks == 3 and [r.request_id for r in scheduler.running] == ["b"]


def test_add_request_clips_the_target_and_names_bad_fields() -> None:
    scheduler = make_scheduler(max_model_len=100, block_size=4, num_gpu_blocks=64)
    request = add(scheduler, "a", 90, 50)
    assert request.output_target_tokens == 10
    with pytest.raises(ValueError, match="prompt_tokens"):
        add(scheduler, "b", 100, 1)
    with pytest.raises(ValueError, match="output_target_tokens"):
        add(scheduler, "c", 10, 0)
    with pytest.raises(ValueError, match="request_id"):
        add(scheduler, "a", 10, 1)


def test_step_duration_override_and_latency_model_inputs() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", 10, 3, arrival_s=0.0)
    result = step_with(scheduler, 0.5)
    assert result.duration_s == 0.5 and scheduler.now_s == 0.5
    sample = result.to_step_sample()
    assert (sample.num_prefill_tokens, sample.num_decode_seqs, sample.duration_s) == (10, 0, 0.5)


def step_with(scheduler: EngineScheduler, duration_s: float) -> StepResult:
    result = scheduler.step(duration_s)
    assert result is not None
    return result


def test_restore_loads_running_requests_with_their_blocks() -> None:
    scheduler = make_scheduler(block_size=4, num_gpu_blocks=8, max_model_len=32)
    running = [EngineRequest("a", 10, 20, num_generated_tokens=3, num_computed_tokens=12),
               EngineRequest("b", 24, 5, num_generated_tokens=1, num_computed_tokens=24)]
    scheduler.restore(running, [EngineRequest("c", 4, 4)])
    assert [r.request_id for r in scheduler.running] == ["a"]  # b's 6 blocks do not fit
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert scheduler.num_used_blocks == 3 and running[0].num_computed_tokens == 12
    result = step(scheduler)
    assert result.num_decode_seqs == 1


def test_can_admit_counts_slots_and_waiting_prompts() -> None:
    scheduler = make_scheduler(block_size=4, num_gpu_blocks=10, max_num_seqs=2, max_model_len=40)
    assert scheduler.can_admit(40 - 1)
    add(scheduler, "a", 20, 5)  # 5 blocks reserved while waiting
    assert scheduler.can_admit(20) and not scheduler.can_admit(21)
    add(scheduler, "b", 4, 5)
    assert not scheduler.can_admit(1)  # no sequence slot left


def test_request_copy_carries_every_field() -> None:
    values = {}
    for index, name in enumerate(EngineRequest.__dataclass_fields__):
        default = EngineRequest.__dataclass_fields__[name].default
        values[name] = (f"id-{index}" if name == "request_id" else (7, 8) if name == "prefix_block_hashes"
                        else 1.5 + index if isinstance(default, float) or default is None
                        else 3 + index)
    request = EngineRequest(**values)
    copied = request.copy()
    assert copied == request and copied is not request
