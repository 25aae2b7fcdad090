"""Named engine presets: Llama-2-7B on an A30, an A100-80GB and an H100-80GB, and
Llama-3.1-8B (long context) on an H100-80GB.

The Llama-2 latency models come from ``profiles.json`` (fitted by
:mod:`blockq.engine_model.fit_profiles`). KV capacity:

* ``llama2-7b-a30``: 1,052 blocks of 16 tokens, as measured by the Block paper's vLLM on
  a 24 GB A30.
* ``llama2-7b-a100`` / ``llama2-7b-h100``: :func:`kv_blocks_for_gpu_memory` for 80 GiB:
  (80 GiB x 0.9 utilisation - 12.55 GiB fp16 weights - 1 GiB activation/runtime reserve)
  / (16 tokens x 0.5 MiB per token) = 7,481 blocks (about 120k tokens). The same formula
  gives 1,030 blocks for 24 GiB, within 2 % of the A30's measured 1,052.

``llama3-8b-h100``: Llama-3.1-8B (32 layers, hidden 4,096, 32 query heads and 8 KV heads
of 128 dims (GQA), SwiGLU MLP of 14,336, vocabulary 128,256, untied embeddings:
8,030,261,248 parameters, 14.96 GiB in fp16) on an H100-80GB, for long-context
workloads such as the Mooncake traces (prompts up to 126k tokens in the conversation
trace, median 6.9k):

* KV bytes per token: K and V x 32 layers x 8 KV heads x 128 dims x 2 bytes = 131,072
  (a quarter of Llama-2-7B's 524,288).
* KV blocks: the same formula, (72 - 14.96 - 1) GiB / (16 x 128 KiB) = 28,693 blocks
  (about 459k tokens), so ``max_model_len`` = 131,072 (the model's context, 8,192 blocks)
  fits 3.5 times beside the watermark. ``max_num_seqs`` 48 and ``max_num_batched_tokens``
  512 as in ``llama2-7b-h100``, so the two H100 presets differ only in the model.
* Latency: no public profile of Llama-3-8B is in ``profiles.json``, so the
  ``llama2-7b-h100`` model is scaled part by part (:func:`scale_latency_model`):

  - linear layers (the table): by the ratio of the transformer layers' matmul
    parameters, each of which a token multiplies once (the table is weight-read bound at
    few tokens and FLOP bound at many; both scale with the parameters). Per layer,
    Llama-3-8B: q and o 2 x 4096 x 4096 + k and v 2 x 4096 x 1024 + MLP 3 x 4096 x 14336
    = 218,103,808; Llama-2-7B: 4 x 4096 x 4096 + 3 x 4096 x 11008 = 202,375,168; x 32
    layers: 6,979,321,856 / 6,476,005,376 = 1.0777. This is (8.03e9 - 1.05e9
    embeddings) / (6.74e9 - 0.26e9): the embeddings and the LM head are not in the
    per-layer profile the table was fitted from.
  - decode attention, seconds per KV token read: x 131,072 / 524,288 = 0.25 (memory
    bound: bytes read).
  - prefill attention, seconds per (query, key) pair: x (32 layers x 32 query heads x
    128 dims) / (32 x 32 x 128) = 1.0 (GQA shares K and V between heads but every query
    head still computes its scores).
  - per-step overhead: the fixed attention cost of 32 layers is kept and the LM-head
    read changes with the vocabulary: + (128,256 - 32,000) x 4,096 x 2 bytes / 3.35 TB/s
    = + 0.235 ms (0.699 -> 0.935 ms).

  The online refit (:meth:`StepLatencyModel.refit`) corrects all four from real step
  timings.

Tensor-parallel presets (``llama2-7b-a100-tp2`` ... ``llama2-7b-h100-tp4``, and ``-pcie``
variants): :mod:`blockq.engine_model.tensor_parallel`. Every preset's config names its
hardware (``gpu``, ``tensor_parallel_size``, ``interconnect``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, fields, replace
from importlib import resources
from typing import Any

from blockq.engine_model.config import EngineConfig
from blockq.engine_model.latency import StepLatencyModel
from blockq.engine_model.measured_profile import load_profile
from blockq.engine_model.tensor_parallel import (
    TENSOR_PARALLEL_PRESET_SIZES,
    tensor_parallel_presets,
)

_GIB = 1024**3
_FP16_BYTES = 2


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-family decoder (SwiGLU MLP, untied embeddings, RMSNorm)."""

    num_layers: int
    hidden_size: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @property
    def num_layer_matmul_parameters(self) -> int:
        """Weights of the layers' projections and MLP: each multiplies every token once."""
        query_width = self.num_query_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        attention = 2 * self.hidden_size * query_width + 2 * self.hidden_size * kv_width
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attention + mlp)

    @property
    def num_parameters(self) -> int:
        """All weights: layers, two norms per layer and a final one, embedding, LM head."""
        norms = (2 * self.num_layers + 1) * self.hidden_size
        embeddings = 2 * self.vocab_size * self.hidden_size
        return self.num_layer_matmul_parameters + norms + embeddings

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, fp16."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * _FP16_BYTES

    @property
    def lm_head_bytes(self) -> int:
        """The LM-head weights (fp16), read once per step."""
        return self.vocab_size * self.hidden_size * _FP16_BYTES

    @property
    def attention_score_width(self) -> int:
        """Dims of all query heads of all layers: the work of one (query, key) pair."""
        return self.num_layers * self.num_query_heads * self.head_dim


LLAMA2_7B = ModelShape(num_layers=32, hidden_size=4096, num_query_heads=32, num_kv_heads=32,
                       head_dim=128, intermediate_size=11008, vocab_size=32000)
LLAMA3_8B = ModelShape(num_layers=32, hidden_size=4096, num_query_heads=32, num_kv_heads=8,
                       head_dim=128, intermediate_size=14336, vocab_size=128256)
LLAMA2_7B_PARAMETERS = LLAMA2_7B.num_parameters  # 6,738,415,616
LLAMA2_7B_KV_BYTES_PER_TOKEN = LLAMA2_7B.kv_bytes_per_token  # 524,288
LLAMA3_8B_MAX_MODEL_LEN = 131_072


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
    *,
    num_parameters: int = LLAMA2_7B_PARAMETERS,
    kv_bytes_per_token: int = LLAMA2_7B_KV_BYTES_PER_TOKEN,
) -> int:
    """KV blocks vLLM would get for a model (fp16 weights; default Llama-2-7B) on a GPU
    with this much memory: (memory x utilisation - weights - reserve) / block bytes.

    ``reserve_gib`` stands for peak activations and runtime memory outside the weights.
    """
    weights_gib = num_parameters * _FP16_BYTES / _GIB
    kv_gib = gpu_memory_gib * gpu_memory_utilization - weights_gib - reserve_gib
    return max(0, int(kv_gib * _GIB // (block_size * kv_bytes_per_token)))


def scale_latency_model(
    base: StepLatencyModel, base_model: ModelShape, model: ModelShape, hbm_tb_s: float
) -> StepLatencyModel:
    """``base`` (profiled for ``base_model``) carried over to ``model`` on the same GPU.

    Linear layers scale with the layers' matmul parameters, decode attention with the KV
    bytes per token, prefill attention with the query-head width; the per-step overhead
    swaps one LM-head read for the other at ``hbm_tb_s`` (TB/s). The module docstring
    works the numbers for Llama-3-8B.
    """
    linear_ratio = model.num_layer_matmul_parameters / base_model.num_layer_matmul_parameters
    lm_head_delta_s = (model.lm_head_bytes - base_model.lm_head_bytes) / (hbm_tb_s * 1e12)
    return replace(
        base,
        linear_knot_s=tuple(value * linear_ratio for value in base.linear_knot_s),
        kv_token_s=base.kv_token_s * model.kv_bytes_per_token / base_model.kv_bytes_per_token,
        prefill_pair_s=base.prefill_pair_s
        * model.attention_score_width / base_model.attention_score_width,
        step_overhead_s=max(0.0, base.step_overhead_s + lm_head_delta_s),
    )


def load_profiles() -> dict[str, Any]:
    """The fitted profiles shipped with the package (parsed ``profiles.json``)."""
    text = resources.files("blockq.engine_model").joinpath("profiles.json").read_text()
    return json.loads(text)


def _build_presets() -> dict[str, EnginePreset]:
    gpus = load_profiles()["gpus"]
    num_blocks_80gib = kv_blocks_for_gpu_memory(80.0)
    gpu_to_config = {
        "a30": EngineConfig(num_gpu_blocks=1052, gpu="a30"),
        "a100": EngineConfig(num_gpu_blocks=num_blocks_80gib, gpu="a100"),
        "h100": EngineConfig(num_gpu_blocks=num_blocks_80gib, gpu="h100"),
    }
    presets = {}
    for gpu, config in gpu_to_config.items():
        name = f"llama2-7b-{gpu}"
        model = StepLatencyModel.from_dict(gpus[gpu]["latency_model"])
        presets[name] = EnginePreset(name=name, config=config, latency_model=model)
    # The weights once over all GPUs, the activation reserve once per GPU.
    num_blocks = {size: kv_blocks_for_gpu_memory(80.0 * size, reserve_gib=1.0 * size)
                  for size in TENSOR_PARALLEL_PRESET_SIZES}
    for name, (config, model) in tensor_parallel_presets(gpus, gpu_to_config, num_blocks).items():
        presets[name] = EnginePreset(name=name, config=config, latency_model=model)
    presets["llama3-8b-h100"] = EnginePreset(
        name="llama3-8b-h100",
        config=replace(
            presets["llama2-7b-h100"].config,
            num_gpu_blocks=kv_blocks_for_gpu_memory(
                80.0,
                num_parameters=LLAMA3_8B.num_parameters,
                kv_bytes_per_token=LLAMA3_8B.kv_bytes_per_token,
            ),
            max_model_len=LLAMA3_8B_MAX_MODEL_LEN,
        ),
        latency_model=scale_latency_model(
            presets["llama2-7b-h100"].latency_model, LLAMA2_7B, LLAMA3_8B,
            hbm_tb_s=float(gpus["h100"]["hbm_tb_s"]),
        ),
    )
    return presets


PRESETS: dict[str, EnginePreset] = _build_presets()


@functools.lru_cache(maxsize=16)
def _measured_preset(path: str) -> EnginePreset:
    profile = load_profile(path)
    return EnginePreset(path, profile.engine_config, profile.latency_model)


def get_preset(name: str, **config_overrides: Any) -> EnginePreset:
    """The named preset, or a measured profile (a ``.json`` path written by ``blockq
    profile``: the engine configuration and latency model it was measured with), with any
    :class:`EngineConfig` field overridden.

    Raises:
        ValueError: for an unknown name (listing the valid ones) or an invalid profile, an
            unknown field, or an overridden value that fails validation.
    """
    if name.endswith(".json") and name not in PRESETS:
        preset = _measured_preset(name)
    elif name in PRESETS:
        preset = PRESETS[name]
    else:
        raise ValueError(f"preset: unknown {name!r}; valid: {', '.join(sorted(PRESETS))} "
                         f"or a PROFILE.json")
    if not config_overrides:
        return preset
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(config_overrides) - known)
    if unknown:
        raise ValueError(f"{unknown[0]}: not an engine config field; valid: {', '.join(sorted(known))}")
    return replace(preset, config=replace(preset.config, **config_overrides))
