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
import sys
import time
from pathlib import Path
from typing import Any

from blockq.forecast_check import add_forecast_check_arguments
from loadgen.cli import add_bench_arguments, print_results
from loadgen.plots import run_key
from loadgen.report import write_report
from loadgen.simulation.autoscale_cli import add_autoscale_arguments, run_autoscale_command
from loadgen.simulation.calibrate import run_calibrate_command
from loadgen.simulation.capacity import run_capacity
from loadgen.simulation.config import SimulationConfig
from loadgen.simulation.plan import Progress, build_plan
from loadgen.simulation.seed_tables import mean_sd_table
from loadgen.simulation.served import add_served_model_arguments
from loadgen.summaries import KvSample, RequestRecord


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _slow_instances(text: str) -> tuple[int, float]:
    """``K`` or ``K:FACTOR`` (default factor 2)."""
    count, _, factor = text.partition(":")
    return int(count), float(factor) if factor else 2.0


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_arguments(parser, modes=("run", "capacity", "autoscale", "calibrate"),
                        mode_help="; autoscale: scalers compared on one workload (see --scalers); calibrate: "
                                  "each run of a live blockq bench report (--live) simulated with its host's "
                                  "measured step lag, live and simulated figures side by side")
    # Virtual time makes runs cheap: bisect to 0.25 req/s, as many steps as that takes.
    parser.set_defaults(out=None, capacity_tolerance=0.25, capacity_iterations=16)
    parser.add_argument("--live", type=Path, default=None,
                        help="calibrate: a blockq bench results.json (or its --json output) to replay")
    parser.add_argument("--heartbeat-ms", type=float, default=100.0, help="worker heartbeat period (wall-clock ms)")
    parser.add_argument("--heartbeat-delay-ms", type=float, default=SimulationConfig.heartbeat_delay_ms,
                        help="from a beat's publication to the dispatcher (wall-clock ms)")
    parser.add_argument("--simulated-candidates", type=int, default=SimulationConfig.num_simulated_candidates,
                        help="block/oracle: candidates simulated per decision at most, the shortlist "
                             "(0: every live instance; default: 16 on fleets of up to 128 instances, "
                             "8 on larger ones)")
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
    parser.add_argument("--length-mae-tokens", type=_floats, default=None,
                        help="replace the predictions by the true lengths perturbed (lognormal) to this mean "
                             "absolute error, in tokens (0: the true lengths); capacity mode: a comma-separated "
                             "list, one capacity per value (a noise curve)")
    parser.add_argument("--overload-factor", type=float, default=None,
                        help="capacity mode: also run every policy at this multiple of the reference policy's "
                             "capacity and report its goodput")
    parser.add_argument("--overload-reference", default=None,
                        help="the policy whose capacity --overload-factor multiplies (default: the first)")
    parser.add_argument("--best-effort", action="store_true",
                        help="serve every request however late: no 'infeasible' answers past the SLO")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    _add_slow_instance_arguments(parser)
    _add_cell_arguments(parser)
    add_served_model_arguments(parser)
    add_autoscale_arguments(parser)


def _add_cell_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cell-load-ms", type=float, default=SimulationConfig.cell_load_interval_ms,
                        help="how often each cell's leader publishes its load, and the front reads them (wall ms)")
    parser.add_argument("--cell-stale-ms", type=float, default=SimulationConfig.cell_stale_after_ms,
                        help="a load older than this is stale: the front avoids its cell while another is fresh")
    parser.add_argument("--cell-choices", type=int, default=SimulationConfig.cell_choices,
                        help="cells the front compares per request: 0 all, k >= 2 a weighted draw of k")


def _add_slow_instance_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slow-instances", type=_slow_instances, default=(0, 2.0), metavar="K[:FACTOR]",
                        help="the last K instances run every step FACTOR times (default 2) as long as the profile "
                             "they publish, which the dispatcher's replicas start from")
    parser.add_argument("--slow-published", action="store_true",
                        help="the slow instances publish their slowed profile: a fleet whose replicas know the truth")
    parser.add_argument("--slow-hidden", action="store_true",
                        help="the slow instances lose the time after each step (a starved host), not in it: the "
                             "step timings their beats report, which replicas refit from, stay nominal")
    add_forecast_check_arguments(parser)


def run_simulate_command(args: argparse.Namespace) -> int:
    if args.mode == "autoscale":
        return run_autoscale_command(args)
    if args.mode == "calibrate":
        return run_calibrate_command(args)
    started = time.perf_counter()
    plan = build_plan(args)
    if args.mode == "capacity":
        _, progress = run_capacity(args, plan, args.out or _default_out("simulate-capacity"))
        _report_speed(started, progress)
        return 0
    if len(plan.maes) > 1:
        raise SystemExit("simulate: several --length-mae-tokens values need the capacity mode")
    seeds = list(plan.samples)
    progress = Progress(len(args.policies) * len(args.rates) * len(seeds) * args.requests, not args.no_progress)
    results: list[dict[str, Any]] = []
    per_request: dict[str, list[RequestRecord]] = {}
    kv_samples: dict[str, list[KvSample]] = {}
    for rate in args.rates:
        for policy in args.policies:
            for seed in seeds:
                run = plan.run(policy, rate, seed, progress, plan.maes[0])
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


def _default_out(name: str) -> Path:
    return Path("out") / name


def _report_speed(started: float, progress: Progress) -> None:
    total_s = time.perf_counter() - started
    rate = progress.num_events / max(progress.simulating_s, 1e-9)
    sys.stderr.write(f"simulated {progress.num_runs} run(s): {progress.num_events:,} events in "
                     f"{progress.simulating_s:.1f} s of wall time ({rate:,.0f} events/s); "
                     f"{total_s:.1f} s in all, with loading, predictions and reports\n")
