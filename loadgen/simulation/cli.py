"""``blockq simulate``: ``blockq bench`` in virtual time.

It takes ``blockq bench``'s flags (``--instances-per-process`` and ``--lag-bound-ms`` are
accepted so that a bench command line runs unchanged; virtual time has no use for them;
``--time-scale`` mirrors a bench run at that time scale, see
:mod:`loadgen.simulation.config`) plus ``--seeds`` and the pipeline's delays. With ``--seed S`` (the
default) a run replays exactly what ``blockq bench --seed S`` replays: the trace's first
``--requests`` requests at arrivals seeded with S. With ``--seeds 1,2,3`` each seed draws
its own random sample of the trace and its own arrivals, and the tables show mean ± sd
over the seeds. The JSON printed with ``--json`` and written to ``--out`` is a pure
function of the inputs; the wall time and events/s go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from loadgen.cli import add_bench_arguments, print_results
from loadgen.metrics import KvSample, RequestRecord
from loadgen.plots import run_key
from loadgen.report import capacity_search, write_report
from loadgen.simulation.config import SimulationConfig
from loadgen.simulation.report import capacity_table, mean_sd, mean_sd_table
from loadgen.simulation.runner import SimulatedRun, simulate_run
from loadgen.simulation.workload import AnnotatedSample, annotate_sample, sample_trace


def _seeds(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_arguments(parser)
    # Virtual time makes runs cheap: bisect to 0.25 req/s, as many steps as that takes.
    parser.set_defaults(out=None, capacity_tolerance=0.25, capacity_iterations=16)
    parser.add_argument("--seeds", type=_seeds, default=None,
                        help="comma-separated seeds; each draws its own sample and arrivals (tables: mean ± sd)")
    parser.add_argument("--heartbeat-ms", type=float, default=100.0, help="worker heartbeat period (wall-clock ms)")
    parser.add_argument("--heartbeat-delay-ms", type=float, default=SimulationConfig.heartbeat_delay_ms,
                        help="from a beat's publication to the dispatcher (wall-clock ms)")
    parser.add_argument("--decision-delay-ms", type=float, default=None,
                        help="one placement decision (wall-clock ms; default: the policy's measured cost)")
    parser.add_argument("--ingress-delay-ms", type=float, default=SimulationConfig.ingress_delay_ms,
                        help="from a client's submit to the dispatcher, predictor included (wall-clock ms)")
    parser.add_argument("--ingress-delay-sigma", type=float, default=SimulationConfig.ingress_delay_sigma,
                        help="lognormal sigma of the ingress delay (0: the same for every request)")
    parser.add_argument("--queue-delay-ms", type=float, default=SimulationConfig.queue_delay_ms,
                        help="from the dispatcher's write to the instance's intake (wall-clock ms)")
    parser.add_argument("--step-lag-ms", type=float, default=SimulationConfig.step_lag_ms,
                        help="wall-clock ms each step ends late (an emulator on a busy host; 0: a real engine)")
    parser.add_argument("--noise", type=float, default=SimulationConfig.noise_sigma,
                        help="lognormal sigma of step-time noise (0 disables)")
    parser.add_argument("--best-effort", action="store_true",
                        help="serve every request however late: no 'infeasible' answers past the SLO")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


@dataclass(frozen=True)
class Plan:
    """What to run: the samples by seed and how to configure each cluster."""

    args: argparse.Namespace
    samples: dict[int, AnnotatedSample]

    def config(self, policy: str, seed: int) -> SimulationConfig:
        args = self.args
        return SimulationConfig(
            instances=args.instances, preset=args.preset, policy=policy, objective=args.objective or "e2e",
            seed=seed, heartbeat_ms=args.heartbeat_ms, heartbeat_delay_ms=args.heartbeat_delay_ms,
            decision_delay_ms=args.decision_delay_ms, ingress_delay_ms=args.ingress_delay_ms,
            ingress_delay_sigma=args.ingress_delay_sigma,
            queue_delay_ms=args.queue_delay_ms, noise_sigma=args.noise, slo_ttft_ms=args.slo_ttft_ms,
            step_lag_ms=args.step_lag_ms, time_scale=args.time_scale, best_effort=args.best_effort)

    def run(self, policy: str, rate: float, seed: int, progress: Progress) -> SimulatedRun:
        started = time.perf_counter()
        run = simulate_run(self.config(policy, seed), self.samples[seed], rate_per_s=rate,
                           burstiness=self.args.burstiness, use_trace_times=self.args.trace_times,
                           on_progress=progress.callback(f"{policy}@{rate:.4g} seed {seed}"))
        progress.add_run(run.summary["events"], time.perf_counter() - started)
        run.summary.update(predictor=self.args.predictor, trace=self.args.trace)
        return run


def build_plan(args: argparse.Namespace) -> Plan:
    seeds = args.seeds or (args.seed,)
    samples = {}
    for seed in seeds:
        trace_requests = sample_trace(args.trace, args.requests, seed, redraw=args.seeds is not None)
        samples[seed] = annotate_sample(trace_requests, seed, predictor=args.predictor,
                                        predictor_model=args.predictor_model)
    return Plan(args, samples)


class Progress:
    """A tqdm bar over every request of every run (stderr), and the events counted."""

    def __init__(self, total_requests: int, enabled: bool) -> None:
        self.bar = tqdm(total=total_requests, unit="req", disable=not enabled, file=sys.stderr,
                        mininterval=0.5, dynamic_ncols=True)
        self.num_events = 0
        self.num_runs = 0
        self.simulating_s = 0.0  # wall time inside the simulations (not loading, predicting, reports)
        self._done_in_run = 0

    def add_run(self, num_events: int, wall_s: float) -> None:
        self.num_events += num_events
        self.num_runs += 1
        self.simulating_s += wall_s

    def callback(self, label: str) -> Callable[[int, int], None]:
        self.bar.set_description(label)
        self._done_in_run = 0

        def advance(done: int, total: int) -> None:
            self.bar.update(done - self._done_in_run)
            self._done_in_run = done

        return advance

    def close(self) -> None:
        self.bar.close()


def run_simulate_command(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    plan = build_plan(args)
    if args.mode == "capacity":
        return _run_capacity(args, plan, started)
    seeds = list(plan.samples)
    progress = Progress(len(args.policies) * len(args.rates) * len(seeds) * args.requests, not args.no_progress)
    results: list[dict[str, Any]] = []
    per_request: dict[str, list[RequestRecord]] = {}
    kv_samples: dict[str, list[KvSample]] = {}
    for rate in args.rates:
        for policy in args.policies:
            for seed in seeds:
                run = plan.run(policy, rate, seed, progress)
                results.append(run.summary)
                if seed == seeds[0]:  # the plots show the first seed's runs
                    per_request[run_key(policy, rate)] = run.records
                    kv_samples[run_key(policy, rate)] = run.kv_samples
    progress.close()
    out_dir = args.out or _default_out("simulate")
    files = write_report(out_dir, results, per_request=per_request, kv_samples=kv_samples)
    (out_dir / "summary.md").write_text(mean_sd_table(results))
    _report_speed(started, progress)
    print_results(results, [*files.values(), out_dir / "summary.md"], as_json=args.json, table=mean_sd_table(results))
    return 0


def _run_capacity(args: argparse.Namespace, plan: Plan, started: float) -> int:
    """Per policy and seed: the highest rate with P99 TTFT <= SLO, bisected to ±0.25 req/s."""
    if len(args.rates) < 2:
        raise SystemExit("simulate capacity: give --rates LOW,HIGH (the search range)")
    low, high = min(args.rates), max(args.rates)
    progress = Progress(0, not args.no_progress)
    capacities: list[dict[str, Any]] = []
    all_runs: list[dict[str, Any]] = []
    for policy in args.policies:
        per_seed = []
        for seed in plan.samples:
            def run_at(rate: float, policy: str = policy, seed: int = seed) -> dict[str, Any]:
                progress.bar.total = (progress.bar.total or 0) + args.requests
                return plan.run(policy, rate, seed, progress).summary

            capacity, runs = capacity_search(run_at, low=low, high=high, slo_ttft_p99_ms=args.slo_ttft_ms,
                                             tolerance=args.capacity_tolerance,
                                             max_iterations=args.capacity_iterations)
            per_seed.append({"seed": seed, "capacity_rps": capacity,
                             "runs": [{k: r.get(k) for k in ("rate", "ttft_p99_ms", "ttft_mean_ms")} for r in runs]})
            all_runs.extend(runs)
        capacities.append(_capacity_entry(policy, per_seed))
    progress.close()
    out_dir = args.out or _default_out("simulate-capacity")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "capacity.json").write_text(json.dumps({"capacities": capacities, "runs": all_runs},
                                                      indent=1, default=str) + "\n")
    (out_dir / "capacity.md").write_text(capacity_table(capacities, args.slo_ttft_ms))
    _report_speed(started, progress)
    if args.json:
        sys.stdout.write(json.dumps(capacities, indent=2) + "\n")
    else:
        sys.stdout.write(capacity_table(capacities, args.slo_ttft_ms) + "\n")
    return 0


def _capacity_entry(policy: str, per_seed: Sequence[dict[str, Any]]) -> dict[str, Any]:
    mean, sd = mean_sd([entry["capacity_rps"] for entry in per_seed])
    return {"policy": policy, "capacity_rps": mean, "capacity_rps_sd": sd, "per_seed": list(per_seed)}


def _default_out(name: str) -> Path:
    return Path("out") / name


def _report_speed(started: float, progress: Progress) -> None:
    total_s = time.perf_counter() - started
    rate = progress.num_events / max(progress.simulating_s, 1e-9)
    sys.stderr.write(f"simulated {progress.num_runs} run(s): {progress.num_events:,} events in "
                     f"{progress.simulating_s:.1f} s of wall time ({rate:,.0f} events/s); "
                     f"{total_s:.1f} s in all, with loading, predictions and reports\n")
