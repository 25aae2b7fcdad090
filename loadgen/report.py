"""Benchmark reports: results JSON, a Markdown comparison table, PNG plots, capacity search.

A *result* is one :func:`loadgen.summaries.summarize` dict with ``policy`` and ``rate``
(requests/s, or None for a trace replayed at its own times) added. Per-run maps
(per-request records, KV samples) are keyed by :func:`loadgen.plots.run_key`
(``"block@32"``). Improvement ratios compare each run with ``round_robin`` at the same
rate; invalid runs (see ``valid`` in the summary) are shown but never used in a ratio.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadgen.plots import plot_kv_usage, plot_latency_cdf, plot_latency_vs_rate, run_key
from loadgen.summaries import KvSample, RequestRecord

BASELINE_POLICY = "round_robin"
# (ratio key, figure, True when lower is better): ratio > 1 always means "better than baseline".
RATIO_FIGURES: tuple[tuple[str, str, bool], ...] = (
    ("ttft_mean_speedup_vs_round_robin", "ttft_mean_ms", True),
    ("ttft_p99_speedup_vs_round_robin", "ttft_p99_ms", True),
    ("e2e_mean_speedup_vs_round_robin", "e2e_mean_ms", True),
    ("e2e_p99_speedup_vs_round_robin", "e2e_p99_ms", True),
    ("throughput_ratio_vs_round_robin", "throughput_tokens_per_s", False),
)
# (header, key, format) of the Markdown table's figure columns.
_TABLE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("TTFT mean ms", "ttft_mean_ms", "ms"),
    ("TTFT p50 ms", "ttft_p50_ms", "ms"),
    ("TTFT p99 ms", "ttft_p99_ms", "ms"),
    ("TPOT mean ms", "tpot_mean_ms", "ms1"),
    ("E2E mean ms", "e2e_mean_ms", "ms"),
    ("E2E p99 ms", "e2e_p99_ms", "ms"),
    ("out tok/s", "throughput_tokens_per_s", "ms"),
    ("goodput", "goodput", "pct"),
    ("KV var", "kv_usage_variance_mean", "small"),
    ("len MAE tok", "length_mae_tokens", "ms1"),
    ("lag p99 ms", "lag_p99_ms", "ms1"),
    ("lag mean ms", "lag_mean_ms", "ms1"),
)
_RATIO_COLUMNS: tuple[tuple[str, str], ...] = (
    ("TTFT mean ×rr", "ttft_mean_speedup_vs_round_robin"),
    ("TTFT p99 ×rr", "ttft_p99_speedup_vs_round_robin"),
    ("E2E p99 ×rr", "e2e_p99_speedup_vs_round_robin"),
)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _ratio(baseline: Any, value: Any, lower_is_better: bool) -> float | None:
    if not (_is_number(baseline) and _is_number(value)):
        return None
    numerator, denominator = (baseline, value) if lower_is_better else (value, baseline)
    return float(numerator) / float(denominator) if denominator > 0 else None


def with_improvement_ratios(results: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the results with ``*_vs_round_robin`` ratios added (>1: better than it).

    A ratio is None when the run or the valid ``round_robin`` run at the same rate is
    missing, invalid, or lacks the figure.
    """
    rate_to_baseline = {
        result.get("rate"): result
        for result in results
        if result.get("policy") == BASELINE_POLICY and result.get("valid", True)
    }
    enriched: list[dict[str, Any]] = []
    for result in results:
        baseline = rate_to_baseline.get(result.get("rate"))
        usable = baseline is not None and result.get("valid", True)
        row = dict(result)
        for ratio_key, figure, lower_is_better in RATIO_FIGURES:
            row[ratio_key] = (
                _ratio(baseline.get(figure), result.get(figure), lower_is_better)
                if usable and baseline is not None
                else None
            )
        enriched.append(row)
    return enriched


def _format(value: Any, style: str) -> str:
    if not _is_number(value):
        return "—"
    if style == "ms":
        return f"{value:,.0f}"
    if style == "ms1":
        return f"{value:,.1f}"
    if style == "pct":
        return f"{100.0 * value:.1f}%"
    if style == "ratio":
        return f"{value:.2f}×"
    return f"{value:.4f}"


def _sorted_results(results: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Policies in first-seen order, rates ascending within a policy."""
    policy_order: dict[str, int] = {}
    for result in results:
        policy_order.setdefault(str(result.get("policy")), len(policy_order))
    return sorted(
        results,
        key=lambda r: (
            policy_order[str(r.get("policy"))],
            r.get("rate") is None,
            r.get("rate") or 0.0,
        ),
    )


def markdown_table(results: Sequence[Mapping[str, Any]]) -> str:
    """A Markdown table, one row per (policy, rate), with ratios vs round_robin when present.

    Missing figures print as "—". Invalid runs say "no" under *valid*, with the reason in
    a numbered note under the table.
    """
    rows = _sorted_results(with_improvement_ratios(results))
    has_baseline = any(r.get("policy") == BASELINE_POLICY for r in rows)
    headers = ["policy", "rate req/s", "done/req"] + [h for h, _, _ in _TABLE_COLUMNS] + ["valid"]
    if has_baseline:
        headers += [h for h, _ in _RATIO_COLUMNS]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(["---"] * len(headers)) + "|"]
    notes: list[str] = []
    for row in rows:
        rate = row.get("rate")
        cells = [
            str(row.get("policy")),
            "trace" if rate is None else f"{rate:g}",
            f"{row.get('completed', '—')}/{row.get('requests', '—')}",
        ]
        cells += [_format(row.get(key), style) for _, key, style in _TABLE_COLUMNS]
        if row.get("valid", True):
            cells.append("yes")
        else:
            notes.append(
                f"{len(notes) + 1}. {row.get('policy')} @ {cells[1]}: "
                f"{row.get('invalid_reason') or 'invalid'}"
            )
            cells.append(f"no ({len(notes)})")
        if has_baseline:
            cells += [_format(row.get(key), "ratio") for _, key in _RATIO_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    if has_baseline:
        text += (
            "\n×rr: round_robin's figure divided by this run's at the same rate (>1 is better).\n"
        )
    if notes:
        text += "\nInvalid runs (not results):\n" + "\n".join(notes) + "\n"
    return text


def _json_safe(value: Any) -> Any:
    """Replace NaN/inf by None and tuples by lists, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _run_to_policy_rate(
    results: Sequence[Mapping[str, Any]],
) -> dict[str, tuple[str, float | None]]:
    return {
        run_key(str(r.get("policy")), r.get("rate")): (str(r.get("policy")), r.get("rate"))
        for r in results
    }


def _highest_rate_runs(
    kv_samples: Mapping[str, Sequence[KvSample]],
    run_to_policy_rate: Mapping[str, tuple[str, float | None]],
) -> dict[str, Sequence[KvSample]]:
    """For each policy, the KV samples of its highest-rate run that has any."""
    policy_to_best: dict[str, tuple[float, str]] = {}
    for key, samples in kv_samples.items():
        if not samples:
            continue
        policy, rate = run_to_policy_rate.get(key, (key, None))
        rank = -math.inf if rate is None else float(rate)
        if policy not in policy_to_best or rank > policy_to_best[policy][0]:
            policy_to_best[policy] = (rank, key)
    return {key: kv_samples[key] for _, key in policy_to_best.values()}


def write_report(
    out_dir: str | Path,
    results: Sequence[Mapping[str, Any]],
    *,
    per_request: Mapping[str, Sequence[RequestRecord]] | None = None,
    kv_samples: Mapping[str, Sequence[KvSample]] | None = None,
) -> dict[str, Path]:
    """Write results.json, results.md and the PNG plots into ``out_dir`` (created if needed).

    ``per_request`` and ``kv_samples`` are keyed by :func:`loadgen.plots.run_key`.
    results.json holds ``{"results": [... with ratios], "per_request": {run: [records]},
    "kv_samples": {run: [samples]}}``. Plots: ttft_cdf.png, e2e_cdf.png (per policy, a
    panel per rate), latency_vs_rate.png, kv_usage.png (each policy's highest-rate run).
    Overwrites existing files. Returns {"results.json": path, ...} for every file written.
    """
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    per_request = per_request or {}
    kv_samples = kv_samples or {}
    run_to_policy_rate = _run_to_policy_rate(results)
    document = {
        "results": with_improvement_ratios(results),
        "per_request": {key: [asdict(r) for r in records] for key, records in per_request.items()},
        "kv_samples": {key: [asdict(s) for s in samples] for key, samples in kv_samples.items()},
    }
    written: dict[str, Path] = {}
    json_path = out_path / "results.json"
    json_path.write_text(json.dumps(_json_safe(document), indent=1, allow_nan=False) + "\n")
    written["results.json"] = json_path
    md_path = out_path / "results.md"
    md_path.write_text(markdown_table(results))
    written["results.md"] = md_path
    for name, field_name, title in (
        ("ttft_cdf.png", "ttft_ms", "TTFT CDF"),
        ("e2e_cdf.png", "e2e_ms", "E2E latency CDF"),
    ):
        written[name] = plot_latency_cdf(
            out_path / name, per_request, run_to_policy_rate, field_name=field_name, title=title
        )
    written["latency_vs_rate.png"] = plot_latency_vs_rate(out_path / "latency_vs_rate.png", results)
    written["kv_usage.png"] = plot_kv_usage(
        out_path / "kv_usage.png", _highest_rate_runs(kv_samples, run_to_policy_rate)
    )
    return written


def meets_slo(result: Mapping[str, Any], slo_ttft_p99_ms: float) -> bool:
    """True when the run is valid, its measured P99 TTFT is at most the SLO and at least
    99 % of all requests were served within it (``goodput``, where the run has one): a
    policy that answers requests ``infeasible`` buys no capacity by refusing them."""
    p99 = result.get("ttft_p99_ms")
    goodput = result.get("goodput")
    served = goodput is None or goodput >= 0.99
    return bool(result.get("valid", True)) and _is_number(p99) and p99 <= slo_ttft_p99_ms and served


def capacity_search(
    run_at_rate: Callable[[float], dict],
    *,
    low: float,
    high: float,
    slo_ttft_p99_ms: float = 3000.0,
    tolerance: float = 0.5,
    max_iterations: int = 8,
) -> tuple[float, list[dict]]:
    """Binary search for the highest rate (req/s) whose run meets the SLO (:func:`meets_slo`).

    Assumes meeting the SLO is monotone in the rate. Runs ``low`` first: if it fails the
    capacity is below the range and 0.0 is returned. Then ``high``: if it passes, ``high``
    is returned. Otherwise it bisects until the bracket is at most ``tolerance`` wide or
    ``max_iterations`` bisection runs were made, and returns the highest passing rate.
    Returns (capacity, every run's result in the order run, each with ``rate`` set).
    """
    if not (math.isfinite(low) and math.isfinite(high) and 0 < low < high):
        raise ValueError(f"need 0 < low < high, got low={low}, high={high}")
    if tolerance <= 0 or max_iterations < 0:
        raise ValueError("tolerance must be > 0 and max_iterations >= 0")
    runs: list[dict] = []

    def run(rate: float) -> bool:
        result = dict(run_at_rate(rate))
        result.setdefault("rate", rate)
        runs.append(result)
        return meets_slo(result, slo_ttft_p99_ms)

    if not run(low):
        return 0.0, runs
    if run(high):
        return high, runs
    passing, failing = low, high
    for _ in range(max_iterations):
        if failing - passing <= tolerance:
            break
        middle = (passing + failing) / 2.0
        if run(middle):
            passing = middle
        else:
            failing = middle
    return passing, runs
