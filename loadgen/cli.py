"""``blockq bench`` and ``blockq demo``: policy comparisons on fresh emulated clusters
(the demo adds a simulated comparison, :mod:`loadgen.simulation`)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any

from blockq.config import add_refine_arguments
from blockq.engine_model.fleet_spec import FleetSpec, parse_fleet
from loadgen.arrivals import DEFAULT_THINK_TIME_S
from loadgen.benches.live import BenchConfig, load_requests, run_bench, run_one
from loadgen.progress import run_progress_printer
from loadgen.report import capacity_search, markdown_table, with_improvement_ratios, write_report
from loadgen.simulation.seed_tables import mean_sd_table


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def _seeds(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _fleet(text: str) -> FleetSpec:
    try:
        return parse_fleet(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_bench_arguments(parser: argparse.ArgumentParser, *, modes: tuple[str, ...] = ("run", "capacity"),
                        mode_help: str = "") -> None:
    parser.add_argument("mode", nargs="?", choices=list(modes), default="run",
                        help="run: every policy at every rate; capacity: per policy, the highest rate "
                             "meeting the SLO (binary search between the lowest and highest --rates)" + mode_help)
    parser.add_argument("--capacity-tolerance", type=float, default=2.0, help="req/s: stop bisecting below this")
    parser.add_argument("--capacity-iterations", type=int, default=3, help="bisection runs at most, per policy")
    parser.add_argument("--trace", default="synthetic", help="trace path (format detected) or 'synthetic'")
    parser.add_argument("--instances", type=int, default=12)
    parser.add_argument("--instances-per-process", type=int, default=6)
    parser.add_argument("--cells", type=int, default=1,
                        help="split the --instances evenly (a --fleet interleaved: instance i to cell i %% N) "
                             "into this many cells (each its own dispatcher and streams) behind one front that "
                             "routes by their published loads (default 1)")
    parser.add_argument("--preset", "--profile", dest="preset", default="llama2-7b-a30",
                        help="engine preset, or a measured PROFILE.json (blockq profile)")
    parser.add_argument("--fleet", type=_fleet, default=None, metavar="COUNT:PRESET[,...]",
                        help="a mixed fleet, e.g. 6:llama2-7b-a30,3:llama2-7b-a100 (replaces --instances and "
                             "--preset; instances numbered group by group)")
    parser.add_argument("--policies", type=_names, default=("round_robin", "llumnix", "block", "oracle"))
    parser.add_argument("--rates", type=_floats, default=(20.0, 24.0, 28.0, 32.0), help="requests/s (model time)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seeds", type=_seeds, default=None,
                        help="comma-separated seeds; each draws its own sample and arrivals (tables: mean ± sd)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    parser.add_argument("--trace-times", action="store_true", help="use the trace's own timestamps (rescaled to the rate)")
    parser.add_argument("--multi-turn", action="store_true",
                        help="ShareGPT: every turn of each conversation, as sessions (prompts repeat the conversation so far)")
    parser.add_argument("--think-time-s", type=float, default=DEFAULT_THINK_TIME_S,
                        help="--multi-turn: mean seconds (exponential, model time) from a turn's arrival to the next's")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="every instance reuses cached prompt prefixes (as `blockq worker --prefix-caching`); "
                             "simulate's summaries report the measured, predicted and ideal hit rates")
    parser.add_argument("--time-scale", type=float, default=1.0, help="wall seconds per model second")
    parser.add_argument("--predictor", default="heuristic", help="fast | transformer | ensemble | heuristic | trace | oracle")
    parser.add_argument("--predictor-model", default=None)
    add_refine_arguments(parser)
    parser.add_argument("--objective", default=None, help="block objective: e2e | ttft | max_latency")
    parser.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    parser.add_argument("--lag-bound-ms", type=float, default=50.0)
    parser.add_argument("--out", type=Path, default=Path("out/bench"))
    parser.add_argument("--json", action="store_true", help="print the results as a JSON list")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """``blockq bench``'s engines: emulated, or real vLLM engines with ``up``'s options."""
    from blockq.local.up import VLLM_UP_OPTIONS

    parser.add_argument("--engine", choices=["emulated", "vllm", "vllm-http"], default="emulated",
                        help="the instances' engine; vllm: real engines on --model (--preset PROFILE.json: "
                             "the latency model they publish, from `blockq profile`); vllm-http: the running "
                             "vLLM servers of --url, one instance each")
    parser.add_argument("--model", default=None, help="--engine vllm: the model directory")
    parser.add_argument("--url", default=None, help="--engine vllm-http: the servers, URL[,URL...]")
    vllm = parser.add_argument_group("--engine vllm (passed to `blockq up`)")
    for option, kind, text in VLLM_UP_OPTIONS:
        vllm.add_argument(option, dest="vllm_" + option[2:].replace("-", "_"), type=kind, default=None, help=text)
    vllm.add_argument("--enforce-eager", action="store_true", help="vLLM without graph capture or compilation")
    vllm.add_argument("--pin-cores", action="store_true", help="vLLM on CPU: each instance's kernels on its own core")
    vllm.add_argument("--engine-nice", type=int, default=0,
                      help="run the engines this many steps nicer, so that on a small shared machine they "
                           "yield to the dispatcher, Redis and the load generator")


def _engine_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The `blockq up` flags of the engine options :func:`add_engine_arguments` added."""
    engine = getattr(args, "engine", "emulated")
    if engine == "emulated":
        return ()
    if engine == "vllm-http":
        if not args.url:
            raise SystemExit("bench: --engine vllm-http needs --url URL[,URL...]")
        seqs = ["--max-num-seqs", str(args.vllm_max_num_seqs)] if args.vllm_max_num_seqs else []
        return ("--url", args.url, *seqs)
    if not args.model:
        raise SystemExit("bench: --engine vllm needs --model DIR")
    from blockq.local.up import VLLM_UP_OPTIONS

    flags = ["--model", args.model]
    for option, _, _ in VLLM_UP_OPTIONS:
        value = getattr(args, "vllm_" + option[2:].replace("-", "_"))
        if value is not None:
            flags += [option, str(value)]
    flags += ["--enforce-eager"] if args.enforce_eager else []
    flags += ["--pin-cores"] if args.pin_cores else []
    return (*flags, *(["--engine-nice", str(args.engine_nice)] if args.engine_nice else []))


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        seeds=args.seeds or (), engine=getattr(args, "engine", "emulated"), engine_flags=_engine_flags(args),
        max_model_len=getattr(args, "vllm_max_model_len", None),
        trace=args.trace, instances=args.fleet.num_instances if args.fleet else args.instances, fleet=args.fleet,
        instances_per_process=args.instances_per_process,
        cells=args.cells,
        preset=args.preset, policies=args.policies, rates=args.rates, requests=args.requests, seed=args.seed,
        burstiness=args.burstiness, use_trace_times=args.trace_times, time_scale=args.time_scale,
        multi_turn=args.multi_turn, think_time_s=args.think_time_s, prefix_caching=args.prefix_caching,
        predictor=args.predictor, predictor_model=args.predictor_model, objective=args.objective,
        refine_model=args.refine_model, refine_every_tokens=args.refine_every_tokens,
        slo_ttft_ms=args.slo_ttft_ms, lag_bound_ms=args.lag_bound_ms, out_dir=args.out)


def progress_printer() -> Any:
    """Per-run progress on stderr: a bar on a terminal, periodic lines into a file."""
    return run_progress_printer()


def run_bench_command(args: argparse.Namespace) -> int:
    # SIGTERM unwinds like Ctrl-C, so each run's `finally` tears its cluster down.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    config = config_from_args(args)
    if args.mode == "capacity":
        return run_capacity_command(args, config)
    results, per_request, kv_samples = run_bench(config, on_progress=progress_printer())
    files = write_report(config.out_dir, results, per_request=per_request, kv_samples=kv_samples)
    table = mean_sd_table(results) if len(config.all_seeds) > 1 else markdown_table(results)
    print_results(results, list(files.values()), as_json=args.json, table=table)
    return 0


def print_results(results: list[dict[str, Any]], files: list[Path], *, as_json: bool, table: str) -> None:
    """The runs as a JSON list (with improvement ratios), or the table and the report's files."""
    if as_json:
        sys.stdout.write(json.dumps(with_improvement_ratios(results), indent=2, default=str) + "\n")
    else:
        sys.stdout.write(table + "\n")
        sys.stdout.write(f"\nreport: {', '.join(str(p) for p in files)}\n")


def run_capacity_command(args: argparse.Namespace, config: BenchConfig) -> int:
    """Per policy: the highest rate whose P99 TTFT meets the SLO (valid runs only)."""
    if len(config.rates) < 2:
        raise SystemExit("bench capacity: give --rates LOW,HIGH (the search range)")
    low, high = min(config.rates), max(config.rates)
    requests = load_requests(config)
    progress = progress_printer()
    capacities = []
    all_runs: list[dict[str, Any]] = []
    for policy in config.policies:
        def run_at(rate: float, policy: str = policy) -> dict[str, Any]:
            output = run_one(config, policy, rate, requests, lambda d, t: progress(f"{policy}@{rate:g}", d, t))
            return output.summary

        capacity, runs = capacity_search(run_at, low=low, high=high, slo_ttft_p99_ms=config.slo_ttft_ms,
                                         tolerance=args.capacity_tolerance,
                                         max_iterations=args.capacity_iterations)
        capacities.append({"policy": policy, "capacity_rps": capacity, "slo_ttft_p99_ms": config.slo_ttft_ms,
                           "runs": [{k: r.get(k) for k in ("rate", "ttft_p99_ms", "valid")} for r in runs]})
        all_runs.extend(runs)
    config.out_dir.mkdir(parents=True, exist_ok=True)
    (config.out_dir / "capacity.json").write_text(json.dumps({"capacities": capacities, "runs": all_runs},
                                                             indent=2, default=str))
    if args.json:
        sys.stdout.write(json.dumps(capacities, indent=2) + "\n")
    else:
        sys.stdout.write("| policy | capacity req/s (P99 TTFT <= SLO) | runs (rate: P99 TTFT ms) |\n|---|---|---|\n")
        for item in capacities:
            runs_text = ", ".join(f"{r['rate']:g}: {r['ttft_p99_ms'] or 0:.0f}" for r in item["runs"])
            sys.stdout.write(f"| {item['policy']} | {item['capacity_rps']:g} | {runs_text} |\n")
    return 0
