"""LoRA in the engine model: vLLM's ``max_loras`` admission rule and adapter loads."""

from __future__ import annotations

import pytest

from blockq.engine_model import EngineConfig, EngineRequest, EngineScheduler
from blockq.engine_model.lora import load_adapters, skips_for_lora
from tests.factories import CONSTANT


def make_scheduler(max_loras: int, lora_load_ms: float = 0.0, max_num_seqs: int = 48) -> EngineScheduler:
    config = EngineConfig(num_gpu_blocks=1052, block_size=16, max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                          max_model_len=4096, watermark=0.0, max_loras=max_loras, lora_load_ms=lora_load_ms)
    return EngineScheduler(config, CONSTANT)


def add(scheduler: EngineScheduler, request_id: str, lora_id: int, prompt_tokens: int = 8,
        output_tokens: int = 4) -> EngineRequest:
    request = EngineRequest(request_id, prompt_tokens, output_tokens, lora_id=lora_id)
    scheduler.add_request(request)
    return request


def test_a_waiting_request_of_one_adapter_too_many_is_skipped_and_keeps_its_place() -> None:
    scheduler = make_scheduler(max_loras=2)
    add(scheduler, "a", 1)
    add(scheduler, "b", 2)
    add(scheduler, "c", 3)   # a third adapter: skipped while 1 and 2 are in the batch
    add(scheduler, "d", 1)   # admitted past it (vLLM's `continue`, not FCFS)
    add(scheduler, "e", 0)   # the base model needs no adapter slot
    result = scheduler.step()
    assert result is not None
    assert [r.request_id for r in scheduler.running] == ["a", "b", "d", "e"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    assert result.num_lora_loads == 2
    while scheduler.waiting:  # c runs once a and b (adapters 1, 2) have finished and freed a slot
        scheduler.step()
    assert scheduler.num_lora_loads == 3


def test_running_requests_keep_the_batch_within_max_loras_every_step() -> None:
    scheduler = make_scheduler(max_loras=3, max_num_seqs=16)
    for index in range(40):
        add(scheduler, f"r{index}", 1 + index % 7, prompt_tokens=8 + index, output_tokens=3 + index % 5)
    while scheduler.has_unfinished_requests:
        scheduler.step()
        assert len({r.lora_id for r in scheduler.running if r.lora_id}) <= 3
        assert len(scheduler.loaded_loras) <= 3


def test_an_adapter_load_lengthens_the_step_that_needs_it_and_not_its_latency_sample() -> None:
    scheduler = make_scheduler(max_loras=1, lora_load_ms=50.0)
    add(scheduler, "a", 1)
    first = scheduler.step()
    assert first is not None
    assert first.num_lora_loads == 1
    assert first.duration_s == pytest.approx(0.01 + 0.05)
    assert first.to_step_sample().duration_s == pytest.approx(0.01)
    second = scheduler.step()  # resident now: no load
    assert second is not None and second.num_lora_loads == 0
    assert second.duration_s == pytest.approx(0.01)


def test_without_lora_nothing_changes() -> None:
    plain, lora_off = make_scheduler(max_loras=0), make_scheduler(max_loras=0)
    for scheduler in (plain, lora_off):
        for index in range(5):
            add(scheduler, f"r{index}", 0 if scheduler is plain else 1 + index)
    results = [(plain.step(), lora_off.step()) for _ in range(4)]
    for ours, theirs in results:
        assert ours is not None and theirs is not None
        assert ours.produced_token_ids == theirs.produced_token_ids and theirs.num_lora_loads == 0


def test_load_adapters_evicts_the_least_recently_used_one_the_batch_does_not_use() -> None:
    loaded = [1, 2, 3]
    assert load_adapters(loaded, [3, 4], max_loras=3) == 1
    assert loaded == [2, 3, 4]
    assert load_adapters(loaded, [0, 2, 2], max_loras=3) == 0
    assert loaded == [3, 4, 2]
    assert skips_for_lora(5, {3, 4, 2}, 3) and not skips_for_lora(4, {3, 4, 2}, 3)
    assert not skips_for_lora(0, {3, 4, 2}, 3) and not skips_for_lora(5, {3}, 3)


def test_clone_keeps_the_resident_adapters_apart() -> None:
    scheduler = make_scheduler(max_loras=2)
    add(scheduler, "a", 1)
    scheduler.step()
    other = scheduler.clone()
    add(other, "b", 2)
    other.step()
    assert scheduler.loaded_loras == [1] and other.loaded_loras == [1, 2]


def test_config_refuses_bad_lora_settings() -> None:
    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig(max_loras=-1)
    with pytest.raises(ValueError, match="lora_load_ms"):
        EngineConfig(lora_load_ms=-1.0)
