"""The flags and the command of ``blockq simulate autoscale`` (see
:mod:`loadgen.simulation.autoscale`). It prints one summary per scaler (the mean over
``--seeds``, each seed's figures under ``per_seed``) and writes ``autoscale.json`` (the
summaries, every decision and the fleet size over time) and ``autoscale.png`` (fleet
size and per-minute P99 TTFT over time, first seed) to ``--out``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from blockq.config import add_scaling_options
from dispatcher.autoscale import SCALERS, ScalerTuning, ScalingRules
from dispatcher.autoscale.scalers import DEFAULT_SCALERS
from loadgen.arrivals import parse_steps
from loadgen.plots import plot_fleet_timelines
from loadgen.simulation.autoscale import (
    AutoscaleSettings,
    ScalerRun,
    find_static_size,
    run_scaler,
    workload,
)
from loadgen.simulation.config import SimulationConfig
from loadgen.simulation.plan import Progress

_MEAN_KEYS = ("gpu_hours", "slo_attainment", "ttft_p99_ms", "ttft_mean_ms", "num_scale_actions",
              "num_reversals_10min", "instances_peak")


def add_autoscale_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("autoscale mode")
    group.add_argument("--scalers", default=",".join(DEFAULT_SCALERS), help=f"comma-separated: {', '.join(SCALERS)}")
    group.add_argument("--schedule", default=None,
                       help="SECONDS:SIZE,...: the scheduled scaler's fleet sizes, back to back from the run's "
                            "start (benchmarks: a schedule written in hindsight, behind the same rules)")
    group.add_argument("--initial-instances", type=int, default=None, help="the autoscalers' first fleet "
                       "(default: --min-instances)")
    group.add_argument("--static-instances", type=int, default=None,
                       help="the static fleet's size (default: the smallest meeting the SLO, searched)")
    group.add_argument("--rate-profile", default=None,
                       help="SECONDS:RATE,...: Poisson arrivals following these steps (instead of --trace-times)")
    add_scaling_options(group)
    group.add_argument("--headroom", type=float, default=ScalerTuning.headroom,
                       help="predictive: the predicted P99 TTFT must stay under headroom x SLO")
    group.add_argument("--rate-margin", type=float, default=ScalerTuning.rate_margin,
                       help="predictive: forecast rates raised by this fraction to grow")
    group.add_argument("--shrink-margin", type=float, default=ScalerTuning.shrink_margin,
                       help="predictive: forecast rates raised by this fraction to shrink")
    group.add_argument("--target-kv-usage", type=float, default=ScalerTuning.target_kv_usage,
                       help="reactive: the mean KV usage it keeps")
    group.add_argument("--target-waiting", type=float, default=ScalerTuning.target_waiting,
                       help="reactive: the mean waiting requests per instance it keeps")


def _settings(args: argparse.Namespace) -> AutoscaleSettings:
    rules = ScalingRules(min_instances=args.min_instances, max_instances=args.max_instances,
                         max_step_fraction=args.max_step_fraction, cooldown_s=args.cooldown_s,
                         reversal_hold_s=args.reversal_hold_s)
    initial = args.initial_instances if args.initial_instances is not None else max(1, args.min_instances)
    tuning = ScalerTuning(headroom=args.headroom, rate_margin=args.rate_margin, shrink_margin=args.shrink_margin,
                          target_kv_usage=args.target_kv_usage, target_waiting=args.target_waiting)
    schedule: tuple[tuple[float, int], ...] = ()
    if args.schedule:
        try:
            steps = parse_steps(args.schedule, "schedule", "SIZE")
        except ValueError as exc:
            raise SystemExit(f"simulate autoscale: --{exc}") from None
        if any(size != int(size) for _, size in steps):
            raise SystemExit("simulate autoscale: --schedule: sizes must be whole instances")
        schedule = tuple((seconds, int(size)) for seconds, size in steps)
    return AutoscaleSettings(rules, initial, startup_s=args.startup_s, cycle_s=args.cycle_s, tuning=tuning,
                             schedule=schedule)


def _config(args: argparse.Namespace, seed: int) -> SimulationConfig:
    return SimulationConfig(
        instances=1, preset=args.preset, policy=args.policies[0], seed=seed, heartbeat_ms=args.heartbeat_ms,
        heartbeat_delay_ms=args.heartbeat_delay_ms, decision_delay_ms=args.decision_delay_ms,
        ingress_delay_ms=args.ingress_delay_ms, queue_delay_ms=args.queue_delay_ms, noise_sigma=args.noise,
        slo_ttft_ms=args.slo_ttft_ms, step_lag_ms=args.step_lag_ms, best_effort=True)


def run_autoscale_command(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    names = [name.strip() for name in args.scalers.split(",") if name.strip()]
    unknown = sorted(set(names) - set(SCALERS))
    if unknown:
        raise SystemExit(f"simulate autoscale: --scalers: unknown {', '.join(unknown)} (valid: {', '.join(SCALERS)})")
    settings = _settings(args)
    if "scheduled" in names and not settings.schedule:
        raise SystemExit("simulate autoscale: --scalers scheduled needs --schedule")
    seeds = args.seeds or (args.seed,)
    runs: dict[str, list[ScalerRun]] = {name: [] for name in names}
    for seed in seeds:
        sample, schedule = workload(args, seed)
        config = _config(args, seed)
        static_size = args.static_instances
        # Static's search runs a few sizes: the bar's total is a guess.
        progress = Progress(len(schedule) * (len(names) + 3), not args.no_progress)
        for name in names:
            if name == "static" and static_size is None:
                static_size, run = find_static_size(config, sample, schedule, settings,
                                                    _labelled(progress, seed))
            else:
                run = run_scaler(config, sample, schedule, name, settings, static_size=static_size,
                                 on_progress=progress.callback(f"seed {seed}: {name}"))
            runs[name].append(run)
        progress.close()
    summaries = [_summary(name, scaler_runs, runs.get("static")) for name, scaler_runs in runs.items()]
    out_dir: Path = args.out or Path("out") / "simulate-autoscale"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "autoscale.json").write_text(json.dumps({"summaries": summaries, "runs": {
        name: [{"summary": r.summary, "decisions": [d.as_dict() for d in r.timeline.decisions]} for r in scaler_runs]
        for name, scaler_runs in runs.items()}}, indent=2, default=str))
    plot = plot_fleet_timelines(out_dir / "autoscale.png", {name: _timeline(r[0]) for name, r in runs.items()},
                                slo_ttft_ms=args.slo_ttft_ms)
    sys.stderr.write(f"simulated autoscaling in {time.perf_counter() - started:.1f} s of wall time\n")
    if args.json:
        sys.stdout.write(json.dumps(summaries, indent=2) + "\n")
    else:
        sys.stdout.write(_table(summaries) + f"\nreport: {out_dir / 'autoscale.json'}, {plot}\n")
    return 0


def _labelled(progress: Progress, seed: int) -> Callable[[str], Callable[[int, int], None]]:
    return lambda label: progress.callback(f"seed {seed}: {label}")


def _summary(name: str, scaler_runs: list[ScalerRun], static_runs: list[ScalerRun] | None) -> dict[str, Any]:
    per_seed = [run.summary for run in scaler_runs]
    summary: dict[str, Any] = {"scaler": name, "seeds": [s["seed"] for s in per_seed]}
    for key in _MEAN_KEYS:
        values = [s[key] for s in per_seed if s[key] is not None]
        summary[key] = round(float(np.mean(values)), 4) if values else None
    if static_runs:
        ratios = [run.summary["gpu_hours"] / static.summary["gpu_hours"]
                  for run, static in zip(scaler_runs, static_runs, strict=True) if static.summary["gpu_hours"]]
        summary["gpu_hours_vs_static"] = round(float(np.mean(ratios)), 4) if ratios else None
        summary["static_instances"] = [int(static.summary["instances_peak"]) for static in static_runs]
    summary["per_seed"] = per_seed
    return summary


def _timeline(run: ScalerRun) -> dict[str, list[float]]:
    """Fleet size per decision and P99 TTFT per minute of arrivals (first seed)."""
    decisions = run.timeline.decisions
    minutes: dict[int, list[float]] = {}
    for at_s, ttft_ms in run.ttft_by_arrival:
        minutes.setdefault(int(at_s // 60), []).append(ttft_ms)
    return {"at_s": [d.at_s for d in decisions], "size": [run.timeline.size_at(d.at_s + 1e-9) for d in decisions],
            "minute_s": [60.0 * m for m in sorted(minutes)],
            "p99_ttft_ms": [float(np.percentile(minutes[m], 99)) for m in sorted(minutes)]}


def _table(summaries: list[dict[str, Any]]) -> str:
    lines = ["| scaler | GPU-hours | vs static | SLO attainment | P99 TTFT ms | actions | reversals < 10 min | peak |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        lines.append(f"| {s['scaler']} | {s['gpu_hours']:.2f} | {s.get('gpu_hours_vs_static') or float('nan'):.3f} | "
                     f"{100 * (s['slo_attainment'] or 0):.2f} % | {s['ttft_p99_ms'] or float('nan'):,.0f} | "
                     f"{s['num_scale_actions']:g} | {s['num_reversals_10min']:g} | {s['instances_peak']:g} |")
    return "\n".join(lines)
