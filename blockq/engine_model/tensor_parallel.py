"""Tensor-parallel presets: Llama-2-7B sharded over 2 or 4 A100s or H100s.

What each preset is made of:

* **Compute** (``profiles.json``, entries ``a100-tp2`` ... ``h100-tp4``, fitted by
  :mod:`blockq.engine_model.fit_profiles`): the linear layers from Vidur's rows at that
  ``num_tensor_parallel_workers`` (per-GPU time of the sharded operators); decode and
  prefill attention and the LM-head read divided by the degree (heads and vocabulary are
  split over the GPUs); the fixed per-layer attention cost unchanged.
* **Communication** (not in the profiles: Vidur's compute profiles hold no all-reduce, its
  network profiles are not in the data), modelled here from the interconnect's stated
  bandwidth. Megatron-style tensor parallelism, as vLLM runs it, all-reduces the hidden
  state twice per layer (after the attention output projection and after the MLP down
  projection) and once for the vocabulary-parallel embedding: 2 x 32 + 1 = 65 all-reduces
  per step, each of ``num_tokens`` x 4,096 x 2 bytes (fp16). A ring all-reduce over ``p``
  GPUs sends 2 (p - 1) / p of those bytes over each GPU's link, so per step::

      communication_s = 65 x (latency_s + 2 (p - 1) / p x num_tokens x 8,192 B / bandwidth)

  with :data:`LINKS` (achievable figures, about 80 % of the datasheet's one-direction
  bandwidth per GPU, and a per-all-reduce latency as small NCCL all-reduces show it):

  - A100 NVLink 3: 300 GB/s on the datasheet, 240 GB/s used, 8 µs;
  - H100 NVLink 4: 450 GB/s, 360 GB/s used, 8 µs;
  - PCIe 4 x16 (A100 boards): 32 GB/s, 25 GB/s used, 20 µs;
  - PCIe 5 x16 (H100 boards): 64 GB/s, 50 GB/s used, 20 µs.

  The latency term (65 x 8 µs = 0.52 ms over NVLink) is added to ``step_overhead_s``; the
  bandwidth term, linear in the step's tokens, is added to every knot of the linear table
  (a piecewise-linear table plus a linear function is again one on the same knots). The
  all-gather of the sharded logits (32,000 x 2 bytes per sequence) is left out (under 1 µs
  per decode sequence over NVLink). The online refit corrects all of it from real step
  timings.
* **KV cache**: :func:`~blockq.engine_model.presets.kv_blocks_for_gpu_memory` over the
  memory of all ``p`` GPUs, the weights counted once (sharded) and the activation reserve
  once per GPU: 16,569 blocks at TP 2 and 34,745 at TP 4 (80 GiB GPUs).
* **Scheduling limits** as the other Llama-2 presets (``max_num_seqs`` 48, 512-token
  budget), so that only the hardware differs between them.

Names: ``llama2-7b-{a100,h100}-tp{2,4}`` (NVLink, as SXM boards have it) and
``llama2-7b-{a100,h100}-tp{2,4}-pcie``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from blockq.engine_model.config import EngineConfig
from blockq.engine_model.latency import StepLatencyModel

HIDDEN_SIZE = 4096
FP16_BYTES = 2
NUM_ALL_REDUCES_PER_STEP = 2 * 32 + 1  # two per layer, one for the vocabulary-parallel embedding


@dataclass(frozen=True)
class Link:
    """An interconnect as the communication model uses it: achievable GB/s per GPU and
    direction, and the fixed latency of one small all-reduce (µs)."""

    bandwidth_gb_s: float
    latency_us: float


LINKS: dict[tuple[str, str], Link] = {
    ("a100", "nvlink"): Link(bandwidth_gb_s=240.0, latency_us=8.0),
    ("h100", "nvlink"): Link(bandwidth_gb_s=360.0, latency_us=8.0),
    ("a100", "pcie"): Link(bandwidth_gb_s=25.0, latency_us=20.0),
    ("h100", "pcie"): Link(bandwidth_gb_s=50.0, latency_us=20.0),
}
TENSOR_PARALLEL_PRESET_SIZES = (2, 4)


def all_reduce_seconds_per_token(link: Link, tensor_parallel: int) -> float:
    """Seconds the step's all-reduces add per token of the step (the bandwidth term)."""
    bytes_per_token = HIDDEN_SIZE * FP16_BYTES * 2 * (tensor_parallel - 1) / tensor_parallel
    return NUM_ALL_REDUCES_PER_STEP * bytes_per_token / (link.bandwidth_gb_s * 1e9)


def all_reduce_seconds_per_step(link: Link) -> float:
    """Seconds the step's all-reduces add whatever its size (the latency term)."""
    return NUM_ALL_REDUCES_PER_STEP * link.latency_us * 1e-6


def with_communication(compute: StepLatencyModel, link: Link, tensor_parallel: int) -> StepLatencyModel:
    """``compute`` (a tensor-parallel profile without communication) plus the all-reduces."""
    per_token_s = all_reduce_seconds_per_token(link, tensor_parallel)
    return replace(
        compute,
        linear_knot_s=tuple(value + per_token_s * tokens
                            for value, tokens in zip(compute.linear_knot_s, compute.linear_knot_tokens,
                                                     strict=True)),
        step_overhead_s=compute.step_overhead_s + all_reduce_seconds_per_step(link),
    )


def tensor_parallel_presets(gpus: dict[str, Any], base: dict[str, EngineConfig],
                            num_blocks: dict[int, int]) -> dict[str, tuple[EngineConfig, StepLatencyModel]]:
    """Every tensor-parallel preset: name -> (engine config, latency model).

    ``gpus``: ``profiles.json``'s entries; ``base``: the one-GPU config per GPU type (its
    scheduling limits are kept); ``num_blocks``: KV blocks per tensor-parallel degree.
    """
    presets = {}
    for (gpu, interconnect), link in LINKS.items():
        for size in TENSOR_PARALLEL_PRESET_SIZES:
            compute = StepLatencyModel.from_dict(gpus[f"{gpu}-tp{size}"]["latency_model"])
            suffix = "" if interconnect == "nvlink" else f"-{interconnect}"
            config = replace(base[gpu], num_gpu_blocks=num_blocks[size], tensor_parallel_size=size,
                             interconnect=interconnect)
            presets[f"llama2-7b-{gpu}-tp{size}{suffix}"] = (config, with_communication(compute, link, size))
    return presets
