"""Engine configuration and presets."""

from __future__ import annotations

import pytest

from blockq.engine_model import PRESETS, EngineConfig, get_preset, kv_blocks_for_gpu_memory


def test_defaults_are_the_block_paper_a30_engine() -> None:
    config = EngineConfig()
    assert (config.num_gpu_blocks, config.block_size, config.max_num_seqs,
            config.max_num_batched_tokens, config.max_model_len) == (1052, 16, 48, 512, 4096)
    assert config.watermark_blocks == 10 and not config.enable_prefix_caching


def test_dict_round_trip_ignores_unknown_keys() -> None:
    config = EngineConfig(num_gpu_blocks=500, enable_prefix_caching=True)
    assert EngineConfig.from_dict({**config.to_dict(), "preemption_mode": "recompute"}) == config
    assert EngineConfig.from_dict({}) == EngineConfig()


@pytest.mark.parametrize(("fields", "named"), [
    ({"num_gpu_blocks": 0}, "num_gpu_blocks"),
    ({"block_size": 1.5}, "block_size"),
    ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "max_num_batched_tokens"),
    ({"watermark": 1.0}, "watermark"),
    ({"num_gpu_blocks": 100}, "max_model_len"),  # 4096 tokens need 256 blocks
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
])
def test_invalid_values_name_the_field(fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        EngineConfig(**fields)


def test_presets_and_overrides() -> None:
    assert set(PRESETS) == {"llama2-7b-a30", "llama2-7b-a100", "llama2-7b-h100", "llama3-8b-h100",
                            *(f"llama2-7b-{gpu}-tp{size}{link}" for gpu in ("a100", "h100") for size in (2, 4)
                              for link in ("", "-pcie"))}
    assert get_preset("llama2-7b-a30").config == EngineConfig(gpu="a30")
    assert get_preset("llama2-7b-a100").config.num_gpu_blocks == kv_blocks_for_gpu_memory(80.0) == 7481
    preset = get_preset("llama2-7b-h100", max_num_seqs=24, max_num_batched_tokens=2048)
    assert (preset.config.max_num_seqs, preset.config.max_num_batched_tokens) == (24, 2048)
    assert preset.latency_model is PRESETS["llama2-7b-h100"].latency_model
    with pytest.raises(ValueError, match="llama2-7b-a30"):
        get_preset("llama2-7b-v100")
    with pytest.raises(ValueError, match="max_batch"):
        get_preset("llama2-7b-a30", max_batch=4)


def test_kv_block_formula_is_close_to_the_measured_a30() -> None:
    assert kv_blocks_for_gpu_memory(24.0) == pytest.approx(1052, rel=0.03)
