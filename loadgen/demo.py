"""``blockq demo``: a short live replay through the whole pipeline, then a simulated
comparison at the paper's scale (the same dispatcher and engine code in virtual time)."""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import replace
from pathlib import Path

from loadgen.benches.live import BenchConfig, load_requests, run_one
from loadgen.cli import progress_printer
from loadgen.report import markdown_table, write_report
from loadgen.simulation.cli import add_simulate_arguments, run_simulate_command


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("out/demo"))
    parser.add_argument("--skip-live", action="store_true", help="only the simulated comparison")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


# The live part: the whole pipeline on 4 emulated A30s, lightly loaded (about 40 s).
DEMO_LIVE = BenchConfig(trace="synthetic", instances=4, instances_per_process=4, policies=("block",),
                        rates=(8.0,), requests=160, seed=1, time_scale=1.0)
# The simulated part: the paper's cluster (12 A30s) near the knee of the synthetic
# workload, 6,000 requests; `block` with the out-of-box heuristic predictor, and `oracle`
# (block with the true lengths) for what better predictions are worth.
DEMO_SIMULATED = ("--trace", "synthetic", "--instances", "12", "--preset", "llama2-7b-a30",
                  "--policies", "round_robin,llumnix,block,oracle", "--rates", "{rate}", "--requests", "6000",
                  "--seed", "1")
DEMO_SIMULATED_RATE = 44.0


def run_demo_command(args: argparse.Namespace) -> int:
    """A short live replay that proves the pipeline, then a simulated comparison at the
    paper's scale that shows what placement is for; each labelled as what it is."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if not args.skip_live:
        live = replace(DEMO_LIVE, out_dir=args.out / "live")
        sys.stdout.write(f"== live pipeline: embedded Redis, predictor, dispatcher ({live.policies[0]}), "
                         f"{live.instances} emulated A30s in real time, {live.requests} synthetic requests "
                         f"at {live.rates[0]:g} req/s ==\n")
        show = progress_printer()
        output = run_one(live, live.policies[0], live.rates[0], load_requests(live),
                         lambda done, total: show("live", done, total))
        write_report(live.out_dir, [output.summary], per_request={"live": output.records})
        sys.stdout.write(markdown_table([output.summary]) + "\n")
    sys.stdout.write("== simulated in virtual time (blockq simulate: the same dispatcher and engine code): "
                     f"12 emulated A30s near the knee, 6,000 synthetic requests at {DEMO_SIMULATED_RATE:g} req/s; "
                     "block predicts with the heuristic predictor, oracle is block with the true lengths ==\n")
    sys.stdout.flush()
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    argv = [a.format(rate=DEMO_SIMULATED_RATE) for a in DEMO_SIMULATED]
    argv += ["--out", str(args.out / "simulated")] + (["--no-progress"] if args.no_progress else [])
    return run_simulate_command(parser.parse_args(argv))
