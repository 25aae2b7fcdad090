"""``blockq simulate calibrate --live RESULTS``: a live ``blockq bench`` run replayed in
virtual time, run by run, as that host ran it.

A live run's latencies depend on its host as well as on the policy: on a busy machine an
emulated engine's event loop wakes late and every step ends that much later (its beats
report how late: ``lag_mean_ms``, model ms). Each live summary is simulated with that
measured lag as ``--step-lag-ms`` (wall ms: model ms times the run's time scale) and
the same policy and rate; the other flags are the command line's, which must be the bench
command's (a differing seed, time scale, cluster or predictor is refused). Nothing is
fitted: the lag is read off the live run.

Prints, per run, the live and simulated TTFT mean / P90 / P99 and TPOT and the simulated
figure's relative error (``--json``: a list of those as dicts)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from loadgen.simulation.plan import Progress, build_plan

_FIGURES = ("ttft_mean_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_mean_ms")


def live_summaries(path: Path) -> list[dict[str, Any]]:
    """The run summaries of a ``blockq bench`` report (``results.json``) or of its ``--json``
    output (a list)."""
    data = json.loads(path.read_text())
    results = data["results"] if isinstance(data, dict) else data
    if not results or not all("policy" in r and "rate" in r for r in results):
        raise SystemExit(f"calibrate: {path} holds no blockq bench run summaries")
    return results


def run_calibrate_command(args: argparse.Namespace) -> int:
    if args.live is None:
        raise SystemExit("simulate calibrate: --live RESULTS (a blockq bench results.json) is required")
    if args.seeds:
        raise SystemExit("simulate calibrate: --seeds draws new samples; a live run is replayed with its --seed")
    live = live_summaries(args.live)
    plan = build_plan(args)
    progress = Progress(len(live) * args.requests, not args.no_progress)
    rows = []
    for summary in live:
        _check_same_schedule(summary, args)
        step_lag_ms = (summary.get("lag_mean_ms") or 0.0) * args.time_scale
        lagged = dataclasses.replace(plan, args=argparse.Namespace(**{**vars(args), "step_lag_ms": step_lag_ms}))
        simulated = lagged.run(str(summary["policy"]), float(summary["rate"]), args.seed, progress).summary
        rows.append(_row(summary, simulated, step_lag_ms))
    progress.close()
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
    else:
        sys.stdout.write(_table(rows) + "\n")
    return 0


def _check_same_schedule(live: dict[str, Any], args: argparse.Namespace) -> None:
    """A live run is replayed only on its own schedule: the command line's cluster, seed
    and time scale must be the run's (a summary that does not record one is taken as is)."""
    for name in ("instances", "preset", "seed", "time_scale", "predictor"):
        if live.get(name) is not None and live[name] != getattr(args, name):
            raise SystemExit(f"calibrate: --{name.replace('_', '-')} is {getattr(args, name)!r} but the live "
                             f"{live['policy']}@{live['rate']:g} run had {live[name]!r}")


def _row(live: dict[str, Any], simulated: dict[str, Any], step_lag_ms: float) -> dict[str, Any]:
    row: dict[str, Any] = {"policy": live["policy"], "rate": live["rate"], "step_lag_ms": round(step_lag_ms, 3)}
    for figure in _FIGURES:
        live_value, simulated_value = live.get(figure), simulated.get(figure)
        row[f"live_{figure}"] = live_value
        row[f"simulated_{figure}"] = simulated_value
        row[f"{figure}_error"] = (simulated_value / live_value - 1
                                  if live_value and simulated_value is not None else None)
    return row


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| policy | rate req/s | step lag ms | TTFT mean ms: live / simulated | TTFT P90 ms | TTFT P99 ms "
             "| TPOT mean ms |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [f"{row['live_' + f]:,.0f} / {row['simulated_' + f]:,.0f} ({row[f + '_error']:+.0%})"
                 if row[f + "_error"] is not None else "–" for f in _FIGURES[:3]]
        cells.append(f"{row['live_tpot_mean_ms']:.2f} / {row['simulated_tpot_mean_ms']:.2f}"
                     if row["tpot_mean_ms_error"] is not None else "–")
        lines.append(f"| {row['policy']} | {row['rate']:g} | {row['step_lag_ms']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
