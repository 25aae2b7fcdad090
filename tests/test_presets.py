"""The engine presets' numbers: model shapes, KV blocks, the scaled Llama-3-8B latency model."""

from __future__ import annotations

import pytest

from blockq.engine_model import PRESETS, get_preset, kv_blocks_for_gpu_memory
from blockq.engine_model.presets import LLAMA2_7B, LLAMA3_8B


def test_model_shapes_give_the_published_parameter_counts() -> None:
    assert LLAMA2_7B.num_parameters == 6_738_415_616
    assert LLAMA3_8B.num_parameters == 8_030_261_248
    assert LLAMA2_7B.kv_bytes_per_token == 2 * 32 * 4096 * 2 == 524_288
    assert LLAMA3_8B.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert LLAMA3_8B.num_parameters * 2 / 1024**3 == pytest.approx(14.96, abs=0.01)


def test_llama2_presets_keep_their_blocks() -> None:
    assert kv_blocks_for_gpu_memory(80.0) == 7481
    assert PRESETS["llama2-7b-a100"].config.num_gpu_blocks == 7481
    assert PRESETS["llama2-7b-h100"].config.num_gpu_blocks == 7481
    assert PRESETS["llama2-7b-a30"].config.num_gpu_blocks == 1052


def test_llama3_8b_h100_config() -> None:
    config = get_preset("llama3-8b-h100").config
    expected_blocks = kv_blocks_for_gpu_memory(
        80.0, num_parameters=LLAMA3_8B.num_parameters, kv_bytes_per_token=131_072)
    # (72 - 14.96 - 1) GiB over 16 tokens x 128 KiB.
    assert config.num_gpu_blocks == expected_blocks == 28_693
    assert config.max_model_len == 131_072
    h100 = PRESETS["llama2-7b-h100"].config
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.block_size) == (
        h100.max_num_seqs, h100.max_num_batched_tokens, h100.block_size)
    assert get_preset("llama3-8b-h100", max_num_batched_tokens=2048).config.max_num_batched_tokens == 2048


def test_llama3_8b_h100_latency_is_the_llama2_model_scaled() -> None:
    base = PRESETS["llama2-7b-h100"].latency_model
    model = PRESETS["llama3-8b-h100"].latency_model
    linear_ratio = 6_979_321_856 / 6_476_005_376
    assert linear_ratio == pytest.approx(1.0777, abs=1e-4)
    assert model.linear_knot_tokens == base.linear_knot_tokens
    assert model.linear_knot_s == pytest.approx([v * linear_ratio for v in base.linear_knot_s])
    assert model.kv_token_s == pytest.approx(base.kv_token_s * 0.25)
    assert model.prefill_pair_s == pytest.approx(base.prefill_pair_s)
    lm_head_delta_s = (128_256 - 32_000) * 4096 * 2 / 3.35e12
    assert model.step_overhead_s == pytest.approx(base.step_overhead_s + lm_head_delta_s)
    # Decode of 48 long sequences is cheaper (a quarter of the KV read); a prefill chunk dearer.
    assert model.step_seconds(0, 48, 48 * 2000) < base.step_seconds(0, 48, 48 * 2000)
    assert model.step_seconds(512, 0, 0) > base.step_seconds(512, 0, 0)
