"""Tables over several seeds: each figure as mean ± sd of the per-seed runs."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

# (header, summary key, scale, decimals)
_COLUMNS: tuple[tuple[str, str, float, int], ...] = (
    ("TTFT mean ms", "ttft_mean_ms", 1.0, 0),
    ("TTFT p50 ms", "ttft_p50_ms", 1.0, 0),
    ("TTFT p90 ms", "ttft_p90_ms", 1.0, 0),
    ("TTFT p99 ms", "ttft_p99_ms", 1.0, 0),
    ("E2E mean ms", "e2e_mean_ms", 1.0, 0),
    ("E2E p99 ms", "e2e_p99_ms", 1.0, 0),
    ("goodput %", "goodput", 100.0, 1),
    ("infeasible %", "infeasible", 100.0, 1),
    ("preemptions", "preemptions_total", 1.0, 0),
    ("TTFT forecast APE p50 %", "ttft_forecast_ape_p50", 100.0, 1),
    ("E2E forecast APE p50 %", "e2e_forecast_ape_p50", 100.0, 1),
)
# Shown only when some run has them (runs with models or LoRA adapters).
_OPTIONAL_COLUMNS: tuple[tuple[str, str, float, int], ...] = (
    ("adapter loads", "adapter_loads", 1.0, 0),
    ("misplaced (model)", "model_misplaced", 1.0, 0),
)


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _cell(values: Sequence[float], scale: float, decimals: int) -> str:
    if not values:
        return "–"
    mean, sd = mean_sd([v * scale for v in values])
    if len(values) == 1:
        return f"{mean:,.{decimals}f}"
    return f"{mean:,.{decimals}f} ± {sd:,.{decimals}f}"


def mean_sd_table(results: Sequence[Mapping[str, Any]]) -> str:
    """One row per (rate, policy) in first-seen order; each cell mean ± sd over its seeds."""
    groups: dict[tuple[Any, str], list[Mapping[str, Any]]] = {}
    for result in results:
        groups.setdefault((result.get("rate"), str(result.get("policy"))), []).append(result)
    columns = _COLUMNS + tuple(c for c in _OPTIONAL_COLUMNS if any(r.get(c[1]) is not None for r in results))
    header = "| policy | rate req/s | seeds | " + " | ".join(c[0] for c in columns) + " |"
    lines = [header, "|" + "---|" * (len(columns) + 3)]
    for (rate, policy), runs in groups.items():
        cells = [_cell([r[key] for r in runs if r.get(key) is not None], scale, decimals)
                 for _, key, scale, decimals in columns]
        lines.append(f"| {policy} | {rate:g} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def capacity_table(capacities: Sequence[Mapping[str, Any]], slo_ttft_ms: float) -> str:
    """Capacity per policy (mean ± sd over seeds) and each seed's figure; a prediction
    error column when some entry has one, overload columns when some entry was run there."""
    with_mae = any(item.get("length_mae_tokens") is not None for item in capacities)
    overload = next((item["overload"] for item in capacities if item.get("overload")), None)
    header = ["policy", *(["MAE tokens"] if with_mae else []), f"capacity req/s (P99 TTFT <= {slo_ttft_ms:g} ms)",
              "per seed"]
    if overload is not None:
        rate = overload["rate"]
        header += [f"goodput % @{rate:.2f}", f"infeasible % @{rate:.2f}", f"TTFT mean ms @{rate:.2f}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for item in capacities:
        per_seed = ", ".join(f"{entry['seed']}: {entry['capacity_rps']:.2f}" for entry in item["per_seed"])
        mae = item.get("length_mae_tokens")
        cells = [str(item["policy"]), *([("–" if mae is None else f"{mae:g}")] if with_mae else []),
                 f"{item['capacity_rps']:.2f} ± {item['capacity_rps_sd']:.2f}", per_seed]
        if overload is not None:
            figures = item.get("overload") or {}
            cells += [_mean_sd_cell(figures, "goodput", 100.0, 1), _mean_sd_cell(figures, "infeasible", 100.0, 1),
                      _mean_sd_cell(figures, "ttft_mean_ms", 1.0, 0)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _mean_sd_cell(figures: Mapping[str, Any], key: str, scale: float, decimals: int) -> str:
    if figures.get(key) is None:
        return "–"
    return f"{figures[key] * scale:,.{decimals}f} ± {(figures.get(key + '_sd') or 0.0) * scale:,.{decimals}f}"
