"""Named engine presets: Llama-2-7B on an A30, an A100-80GB and an H100-80GB.

The latency models come from ``profiles.json`` (fitted by
:mod:`blockq.engine_model.fit_profiles`). KV capacity:

* ``llama2-7b-a30``: 1,052 blocks of 16 tokens, as measured by the Block paper's vLLM on
  a 24 GB A30.
* ``llama2-7b-a100`` / ``llama2-7b-h100``: :func:`kv_blocks_for_gpu_memory` for 80 GiB:
  (80 GiB x 0.9 utilisation - 12.55 GiB fp16 weights - 1 GiB activation/runtime reserve)
  / (16 tokens x 0.5 MiB per token) = 7,481 blocks (about 120k tokens). The same formula
  gives 1,030 blocks for 24 GiB, within 2 % of the A30's measured 1,052.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from importlib import resources
from typing import Any

from blockq.engine_model.config import EngineConfig
from blockq.engine_model.latency import StepLatencyModel

LLAMA2_7B_PARAMETERS = 6_738_415_616
# K and V of 32 layers x 4096 dims in fp16.
LLAMA2_7B_KV_BYTES_PER_TOKEN = 2 * 32 * 4096 * 2
_GIB = 1024**3


@dataclass(frozen=True)
class EnginePreset:
    """A named engine: its configuration and step-latency model."""

    name: str
    config: EngineConfig
    latency_model: StepLatencyModel


def kv_blocks_for_gpu_memory(
    gpu_memory_gib: float,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    reserve_gib: float = 1.0,
) -> int:
    """KV blocks vLLM would get for Llama-2-7B (fp16) on a GPU with this much memory.

    ``reserve_gib`` stands for peak activations and runtime memory outside the weights.
    """
    weights_gib = LLAMA2_7B_PARAMETERS * 2 / _GIB
    kv_gib = gpu_memory_gib * gpu_memory_utilization - weights_gib - reserve_gib
    return max(0, int(kv_gib * _GIB // (block_size * LLAMA2_7B_KV_BYTES_PER_TOKEN)))


def load_profiles() -> dict[str, Any]:
    """The fitted profiles shipped with the package (parsed ``profiles.json``)."""
    text = resources.files("blockq.engine_model").joinpath("profiles.json").read_text()
    return json.loads(text)


def _build_presets() -> dict[str, EnginePreset]:
    gpus = load_profiles()["gpus"]
    num_blocks_80gib = kv_blocks_for_gpu_memory(80.0)
    gpu_to_config = {
        "a30": EngineConfig(num_gpu_blocks=1052),
        "a100": EngineConfig(num_gpu_blocks=num_blocks_80gib),
        "h100": EngineConfig(num_gpu_blocks=num_blocks_80gib),
    }
    presets = {}
    for gpu, config in gpu_to_config.items():
        name = f"llama2-7b-{gpu}"
        model = StepLatencyModel.from_dict(gpus[gpu]["latency_model"])
        presets[name] = EnginePreset(name=name, config=config, latency_model=model)
    return presets


PRESETS: dict[str, EnginePreset] = _build_presets()


def get_preset(name: str, **config_overrides: Any) -> EnginePreset:
    """The named preset, with any :class:`EngineConfig` field overridden.

    Raises:
        ValueError: for an unknown name (listing the valid ones), an unknown field, or an
            overridden value that fails validation.
    """
    if name not in PRESETS:
        raise ValueError(f"preset: unknown {name!r}; valid: {', '.join(sorted(PRESETS))}")
    preset = PRESETS[name]
    if not config_overrides:
        return preset
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(config_overrides) - known)
    if unknown:
        raise ValueError(f"{unknown[0]}: not an engine config field; valid: {', '.join(sorted(known))}")
    return replace(preset, config=replace(preset.config, **config_overrides))
