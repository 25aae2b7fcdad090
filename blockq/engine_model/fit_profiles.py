"""Fit the step-latency profiles shipped in ``profiles.json`` from public GPU profiles.

Run as::

    python -m blockq.engine_model.fit_profiles --data-dir PROFILES_DIR \
        --out blockq/engine_model/profiles.json

``PROFILES_DIR`` holds Vidur-format CSV profiles (the layout is in :data:`MLP_PROFILE_PATHS`
and :data:`ATTENTION_PROFILE_PATH`). Only fitted figures are written: a piecewise-linear
table of the linear-layer time per step, the attention coefficients and a few check points.

What each figure is, and where it comes from:

* **Linear layers** (everything but attention): per-layer medians of the nine per-layer
  operators at tensor-parallel 1, summed and multiplied by the 32 layers of Llama-2-7B.
  The embedding lookup is left out (it runs once per forward pass, not per layer, and is
  negligible). Bad cells (blank, or below a quarter of the operator's largest time at
  fewer tokens: the A30 file has such cells) are treated as missing and interpolated per
  operator along the token axis.
* **Decode attention**: memory bound. Seconds per KV token read =
  KV bytes per token / (HBM bandwidth x efficiency). The efficiency (about 0.8) and a
  fixed per-layer cost are calibrated on the A30 from the Qwen2-7B decode-attention
  profile (FlashInfer; batch x context swept) and assumed to carry over to the A100 and
  H100, whose nominal bandwidths are used.
* **Prefill attention**: compute bound. Seconds per (query, key) pair, calibrated on the
  A30 from the Qwen2-7B prefill-attention profile (chunk x context swept), scaled to
  Llama-2-7B's 32 query heads and 32 layers, and to the A100 / H100 by their dense FP16
  tensor throughput relative to the A30.
* **Per-step overhead**: the calibrated fixed attention cost of 32 layers plus one read of
  the LM-head weights.
* **Tensor parallel** (entries ``a100-tp2``, ``h100-tp4``, ...: :data:`TENSOR_PARALLEL_SIZES`):
  the linear table from the same file's rows at that ``num_tensor_parallel_workers`` (the
  per-GPU time of the sharded operators); attention heads and the LM head are sharded too,
  so ``kv_token_s``, ``prefill_pair_s`` and the LM-head read are divided by the degree and
  the fixed per-layer attention cost is kept. The profiles hold no communication: the
  all-reduces are added from the interconnect's bandwidth when the presets are built
  (:mod:`blockq.engine_model.tensor_parallel`). The CPU-side scheduling overhead of a real engine is not in these
  profiles; the online refit (:meth:`StepLatencyModel.refit`) absorbs it.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

NUM_LAYERS = 32
HIDDEN_SIZE = 4096
VOCAB_SIZE = 32_000
# K and V, every layer, fp16.
KV_BYTES_PER_TOKEN = 2 * NUM_LAYERS * HIDDEN_SIZE * 2
LM_HEAD_BYTES = HIDDEN_SIZE * VOCAB_SIZE * 2
MAX_PROFILE_TOKENS = 4096
PER_LAYER_OPERATORS = (
    "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
    "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add",
)
# A cell below this fraction of the operator's largest time at fewer tokens is a
# measurement failure, not a real speed-up (real times never fall fourfold as tokens grow).
BAD_CELL_FRACTION = 0.25
CHECK_POINT_TOKENS = (1, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet figures of one GPU: HBM bandwidth (TB/s) and dense FP16 tensor TFLOPS."""

    hbm_tb_s: float
    fp16_dense_tflops: float


GPU_SPECS: dict[str, GpuSpec] = {
    "a30": GpuSpec(hbm_tb_s=0.93, fp16_dense_tflops=165.0),
    "a100": GpuSpec(hbm_tb_s=2.0, fp16_dense_tflops=312.0),
    "h100": GpuSpec(hbm_tb_s=3.35, fp16_dense_tflops=989.0),
}
MLP_PROFILE_PATHS: dict[str, str] = {
    "a30": "block-a30/Llama-2-7b-hf/mlp.csv",
    "a100": "vidur/compute/a100/meta-llama/Llama-2-7b-hf/mlp.csv",
    "h100": "vidur/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv",
}
ATTENTION_PROFILE_PATH = "block-a30/Qwen-2-7B/attention.csv"
# Tensor-parallel degrees fitted beside tensor-parallel 1, per GPU with Vidur's TP rows.
TENSOR_PARALLEL_SIZES: dict[str, tuple[int, ...]] = {"a100": (2, 4), "h100": (2, 4)}
CALIBRATION_GPU = "a30"


@dataclass(frozen=True)
class LinearLayerProfile:
    """Cleaned linear-layer milliseconds per step at the profiled token counts."""

    tokens: np.ndarray
    step_ms: np.ndarray
    num_bad_cells: int


@dataclass(frozen=True)
class AttentionCalibration:
    """Attention figures measured on the calibration GPU, per Llama-2-7B layer."""

    decode_bandwidth_efficiency: float
    decode_fixed_ms_per_layer: float
    prefill_ms_per_pair_per_layer: float
    decode_median_rel_error: float
    prefill_median_rel_error: float


# --- linear layers ------------------------------------------------------------------


def read_operator_medians(path: Path, tensor_parallel: int = 1) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Per-layer median milliseconds per operator at ``tensor_parallel`` (per GPU), by token count.

    Rows repeated for one token count are averaged; blank cells become NaN.
    """
    sums: dict[int, dict[str, list[float]]] = {}
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            if int(row["num_tensor_parallel_workers"]) != tensor_parallel:
                continue
            by_operator = sums.setdefault(int(row["num_tokens"]), {op: [] for op in PER_LAYER_OPERATORS})
            for op in PER_LAYER_OPERATORS:
                cell = row[f"time_stats.{op}.median"].strip()
                by_operator[op].append(float(cell) if cell else float("nan"))
    tokens = np.array(sorted(sums), dtype=np.int64)
    medians = {op: np.array([np.nanmean(sums[n][op]) if not np.all(np.isnan(sums[n][op]))
                             else np.nan for n in tokens]) for op in PER_LAYER_OPERATORS}
    return tokens, medians


def find_bad_cells(values_ms: np.ndarray) -> np.ndarray:
    """Mask of missing cells and of cells far below the largest earlier (fewer-token) time."""
    bad = np.isnan(values_ms)
    running_max = 0.0
    for i, value in enumerate(values_ms):
        if bad[i]:
            continue
        if value < BAD_CELL_FRACTION * running_max:
            bad[i] = True
        else:
            running_max = max(running_max, float(value))
    return bad


def load_linear_layer_profile(path: Path, tensor_parallel: int = 1) -> LinearLayerProfile:
    """Clean every operator (interpolating bad cells) and sum them into a step time."""
    tokens, medians = read_operator_medians(path, tensor_parallel)
    total_ms = np.zeros(len(tokens))
    num_bad_cells = 0
    for op, values in medians.items():
        bad = find_bad_cells(values)
        if bad.all():
            raise ValueError(f"{path}: operator {op} has no usable cells")
        num_bad_cells += int(bad.sum())
        if bad.any():
            logger.info("%s: %s: %d bad cells at tokens %s", path.name, op, int(bad.sum()),
                        tokens[bad].tolist())
        cleaned = np.interp(tokens, tokens[~bad], values[~bad])
        total_ms += cleaned * NUM_LAYERS
    return LinearLayerProfile(tokens=tokens, step_ms=total_ms, num_bad_cells=num_bad_cells)


def _hat_basis(tokens: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """Design matrix whose product with knot values is the piecewise-linear interpolant."""
    basis = np.zeros((len(tokens), len(knots)))
    for j in range(len(knots)):
        unit = np.zeros(len(knots))
        unit[j] = 1.0
        basis[:, j] = np.interp(tokens, knots, unit)
    return basis


def fit_piecewise_linear(
    tokens: np.ndarray, step_ms: np.ndarray, max_knots: int = 24, target_rel_error: float = 0.02,
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy knot placement, then least squares on relative error; values non-decreasing.

    Knots start at the smallest and largest token counts. Each round interpolates the
    profile between the current knots and adds the profiled count it misses most (in
    relative terms), until every miss is within ``target_rel_error`` or ``max_knots`` is
    reached. The knot values are then fitted by least squares, which smooths measurement
    noise, and finally forced non-decreasing: more tokens never make a step faster here.
    """
    knots = [0, len(tokens) - 1]
    while len(knots) < max_knots:
        chord_ms = np.interp(tokens, tokens[knots], step_ms[knots])
        rel_error = np.abs(chord_ms / step_ms - 1.0)
        worst = int(np.argmax(rel_error))
        if rel_error[worst] <= target_rel_error:
            break
        knots = sorted([*knots, worst])
    knot_tokens = tokens[knots].astype(float)
    weights = 1.0 / step_ms
    basis = _hat_basis(tokens, knot_tokens)
    values, *_ = np.linalg.lstsq(basis * weights[:, None], step_ms * weights, rcond=None)
    return knot_tokens, np.maximum.accumulate(values)


# --- attention ------------------------------------------------------------------------


def _read_attention_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def _weighted_lstsq(design: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, float]:
    """Least squares on relative error; returns coefficients and the median relative error."""
    weights = 1.0 / target
    coefficients, *_ = np.linalg.lstsq(design * weights[:, None], target * weights, rcond=None)
    return coefficients, float(np.median(np.abs(design @ coefficients / target - 1.0)))


def calibrate_attention(path: Path, hbm_tb_s: float) -> AttentionCalibration:
    """Fit decode (fixed + bytes) and prefill (per pair) attention costs; scale to Llama-2-7B.

    The profiled model has 28 query heads and 4 KV heads of 128 dims; a Llama-2-7B layer
    has 32 of each, so prefill compute scales by 32/28 and decode bytes are recomputed.
    """
    rows = _read_attention_rows(path)
    first = rows[0]
    num_q_heads = int(first["n_q_head"])
    head_dim = int(first["n_embd"]) // num_q_heads
    kv_bytes_per_token_layer = 2 * int(first["n_kv_head"]) * head_dim * 2
    decode = [r for r in rows if r["is_prefill"] == "False"]
    batch = np.array([float(r["batch_size"]) for r in decode])
    context = np.array([float(r["kv_cache_size"]) for r in decode])
    decode_ms = np.array([float(r["time_stats.attn_decode.median"]) for r in decode])
    bytes_read = batch * context * kv_bytes_per_token_layer
    (fixed_ms, ms_per_byte), decode_error = _weighted_lstsq(
        np.c_[np.ones(len(decode)), bytes_read], decode_ms)
    effective_tb_s = 1.0 / (float(ms_per_byte) * 1e-3) / 1e12
    prefill = [r for r in rows if r["is_prefill"] == "True" and int(r["prefill_chunk_size"]) > 0]
    chunk = np.array([float(r["prefill_chunk_size"]) for r in prefill])
    cached = np.array([float(r["kv_cache_size"]) for r in prefill])
    prefill_ms = np.array([float(r["time_stats.attn_prefill.median"]) for r in prefill])
    pairs = chunk * (cached + (chunk + 1.0) / 2.0)
    (_, ms_per_pair), prefill_error = _weighted_lstsq(np.c_[np.ones(len(prefill)), pairs], prefill_ms)
    llama_heads_ratio = (HIDDEN_SIZE // head_dim) / num_q_heads
    return AttentionCalibration(
        decode_bandwidth_efficiency=min(1.0, effective_tb_s / hbm_tb_s),
        decode_fixed_ms_per_layer=max(0.0, float(fixed_ms)),
        prefill_ms_per_pair_per_layer=float(ms_per_pair) * llama_heads_ratio,
        decode_median_rel_error=decode_error,
        prefill_median_rel_error=prefill_error,
    )


# --- assembly ---------------------------------------------------------------------------


def _round(value: float, digits: int = 6) -> float:
    return float(f"{value:.{digits}g}")


def build_gpu_profile(
    gpu: str, linear: LinearLayerProfile, attention: AttentionCalibration, tensor_parallel: int = 1,
) -> dict[str, object]:
    """One GPU's entry of profiles.json: the latency model's dict plus fit diagnostics.

    At ``tensor_parallel`` > 1 the attention and the LM-head read are split over the GPUs
    (heads and vocabulary are sharded); communication is not included."""
    spec = GPU_SPECS[gpu]
    calibration_spec = GPU_SPECS[CALIBRATION_GPU]
    knots, knot_ms = fit_piecewise_linear(linear.tokens, linear.step_ms)
    fitted_ms = np.interp(linear.tokens, knots, knot_ms)
    rel_error = np.abs(fitted_ms / linear.step_ms - 1.0)
    effective_bytes_per_s = spec.hbm_tb_s * 1e12 * attention.decode_bandwidth_efficiency
    compute_speedup = spec.fp16_dense_tflops / calibration_spec.fp16_dense_tflops
    prefill_pair_s = (attention.prefill_ms_per_pair_per_layer * 1e-3 * NUM_LAYERS
                      / compute_speedup / tensor_parallel)
    step_overhead_s = (attention.decode_fixed_ms_per_layer * 1e-3 * NUM_LAYERS
                       + LM_HEAD_BYTES / tensor_parallel / (spec.hbm_tb_s * 1e12))
    check_tokens = [n for n in CHECK_POINT_TOKENS if n in set(linear.tokens.tolist())]
    check_ms = [float(linear.step_ms[linear.tokens.tolist().index(n)]) for n in check_tokens]
    return {
        "latency_model": {
            "linear_knot_tokens": [int(k) for k in knots],
            "linear_knot_s": [_round(v * 1e-3) for v in knot_ms],
            "linear_scale": 1.0,
            "kv_token_s": _round(KV_BYTES_PER_TOKEN / tensor_parallel / effective_bytes_per_s),
            "prefill_pair_s": _round(prefill_pair_s),
            "step_overhead_s": _round(step_overhead_s),
        },
        "hbm_tb_s": spec.hbm_tb_s,
        "fp16_dense_tflops": spec.fp16_dense_tflops,
        "source": MLP_PROFILE_PATHS[gpu],
        "tensor_parallel_size": tensor_parallel,
        "fit": {
            "linear_median_rel_error": _round(float(np.median(rel_error)), 3),
            "linear_p90_rel_error": _round(float(np.percentile(rel_error, 90)), 3),
            "linear_max_rel_error": _round(float(rel_error.max()), 3),
            "num_bad_cells_interpolated": linear.num_bad_cells,
        },
        "check_points": {"tokens": check_tokens, "linear_ms": [_round(v, 5) for v in check_ms]},
    }


def build_profiles(data_dir: Path) -> dict[str, object]:
    """Fit every GPU in :data:`MLP_PROFILE_PATHS` from the profiles under ``data_dir``."""
    attention = calibrate_attention(data_dir / ATTENTION_PROFILE_PATH,
                                    GPU_SPECS[CALIBRATION_GPU].hbm_tb_s)
    gpus = {gpu: build_gpu_profile(gpu, load_linear_layer_profile(data_dir / path), attention)
            for gpu, path in MLP_PROFILE_PATHS.items()}
    for gpu, sizes in TENSOR_PARALLEL_SIZES.items():
        for size in sizes:
            linear = load_linear_layer_profile(data_dir / MLP_PROFILE_PATHS[gpu], size)
            gpus[f"{gpu}-tp{size}"] = build_gpu_profile(gpu, linear, attention, size)
    return {
        "format": 1,
        "model": "Llama-2-7b-hf",
        "generated_by": "python -m blockq.engine_model.fit_profiles",
        "attention_calibration": {
            "source": ATTENTION_PROFILE_PATH,
            "decode_bandwidth_efficiency": _round(attention.decode_bandwidth_efficiency, 4),
            "decode_fixed_ms_per_layer": _round(attention.decode_fixed_ms_per_layer, 4),
            "prefill_ms_per_pair_per_layer": _round(attention.prefill_ms_per_pair_per_layer, 4),
            "decode_median_rel_error": _round(attention.decode_median_rel_error, 3),
            "prefill_median_rel_error": _round(attention.prefill_median_rel_error, 3),
        },
        "gpus": gpus,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True,
                        help="directory holding the Vidur-format profiles")
    parser.add_argument("--out", type=Path, required=True, help="profiles.json to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    profiles = build_profiles(args.data_dir)
    args.out.write_text(json.dumps(profiles, indent=1) + "\n")
    for gpu, entry in profiles["gpus"].items():  # type: ignore[union-attr]
        logger.info("%s: %d knots, fit %s", gpu, len(entry["latency_model"]["linear_knot_tokens"]),
                    entry["fit"])
    logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
