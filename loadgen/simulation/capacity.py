"""``blockq simulate capacity``: per policy (and per prediction error, for noise curves)
and seed, the highest rate with P99 TTFT <= SLO, bisected; optionally each policy's
goodput at an overload rate, a multiple of a reference policy's capacity."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadgen.plots import capacity_noise_plot
from loadgen.report import capacity_search
from loadgen.simulation.plan import Plan, Progress, reads_predictions
from loadgen.simulation.seed_tables import capacity_table, mean_sd

OVERLOAD_KEYS = ("goodput", "infeasible", "answered_within_slo", "ttft_mean_ms", "ttft_p99_ms")


def run_capacity(args: argparse.Namespace, plan: Plan, out_dir: Path) -> tuple[list[dict[str, Any]], Progress]:
    """The capacity entries, written to ``out_dir`` (capacity.json, capacity.md and, for
    several prediction errors, noise.png) and printed (a table, or JSON with ``--json``);
    and the progress (runs, events) for the speed report."""
    if len(args.rates) < 2:
        raise SystemExit("simulate capacity: give --rates LOW,HIGH (the search range)")
    progress = Progress(0, not args.no_progress)
    entries: list[dict[str, Any]] = []
    all_runs: list[dict[str, Any]] = []
    for policy in args.policies:
        for mae_tokens in plan.maes if reads_predictions(policy) else [None]:
            entry, runs = _capacity_entry(args, plan, progress, policy, mae_tokens)
            entries.append(entry)
            all_runs.extend(runs)
    if args.overload_factor:
        rate = args.overload_factor * _reference_capacity(entries, args.overload_reference or args.policies[0])
        for entry in entries:
            entry["overload"] = _overload(plan, progress, entry, rate)
    progress.close()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "capacity.json").write_text(json.dumps({"capacities": entries, "runs": all_runs},
                                                      indent=1, default=str) + "\n")
    table = capacity_table(entries, args.slo_ttft_ms)
    (out_dir / "capacity.md").write_text(table)
    if len(plan.maes) > 1:
        capacity_noise_plot(entries, out_dir / "noise.png")
    sys.stdout.write(json.dumps(entries, indent=2) + "\n" if args.json else table + "\n")
    return entries, progress


def _capacity_entry(args: argparse.Namespace, plan: Plan, progress: Progress, policy: str,
                    mae_tokens: float | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    per_seed, all_runs = [], []
    for seed in plan.samples:
        def run_at(rate: float, seed: int = seed) -> dict[str, Any]:
            progress.bar.total = (progress.bar.total or 0) + args.requests
            return plan.run(policy, rate, seed, progress, mae_tokens).summary

        capacity, runs = capacity_search(run_at, low=min(args.rates), high=max(args.rates),
                                         slo_ttft_p99_ms=args.slo_ttft_ms, tolerance=args.capacity_tolerance,
                                         max_iterations=args.capacity_iterations)
        per_seed.append({"seed": seed, "capacity_rps": capacity,
                         "runs": [{k: r.get(k) for k in ("rate", "ttft_p99_ms", "ttft_mean_ms", "goodput")}
                                  for r in runs]})
        all_runs.extend(runs)
    mean, sd = mean_sd([entry["capacity_rps"] for entry in per_seed])
    return ({"policy": policy, "length_mae_tokens": mae_tokens, "capacity_rps": mean, "capacity_rps_sd": sd,
             "per_seed": per_seed}, all_runs)


def _reference_capacity(entries: Sequence[dict[str, Any]], policy: str) -> float:
    for entry in entries:
        if entry["policy"] == policy:
            return float(entry["capacity_rps"])
    raise SystemExit(f"--overload-reference: {policy!r} is not among --policies")


def _overload(plan: Plan, progress: Progress, entry: dict[str, Any], rate: float) -> dict[str, Any]:
    """Mean and sd over the seeds of :data:`OVERLOAD_KEYS` at ``rate``."""
    summaries = []
    for seed in plan.samples:
        progress.bar.total = (progress.bar.total or 0) + plan.args.requests
        summaries.append(plan.run(entry["policy"], rate, seed, progress, entry["length_mae_tokens"]).summary)
    figures: dict[str, Any] = {"rate": rate}
    for key in OVERLOAD_KEYS:
        values = [s[key] for s in summaries if s.get(key) is not None]
        figures[key], figures[key + "_sd"] = mean_sd(values) if values else (None, None)
    return figures
