"""``blockq fidelity``: one real vLLM engine against the engine model, request by request.

1. The engine's profile: ``--profile PROFILE.json``, or measured first (``blockq profile``).
2. Its capacity, in simulation with the profile: the highest Poisson rate at which the P99
   TTFT of ``CAPACITY_SAMPLE_REQUESTS`` rows of the trace (or the sample, when larger)
   stays within ``--slo-ttft-ms`` (bisected).
3. The replay: at each load (a fraction of that capacity) the same sample arrives as a
   Poisson process, lengths enforced (``ignore_eos``, ``max_tokens``); the loads run one
   after the other on one engine, pinned to its own core (docs/fidelity.md).
4. The same phases through the engine model with the profile and the configuration the
   engine reported; every request's TTFT and E2E and every load's preemptions and
   prefix-cache hits compared.

Errors: APE = |simulated - real| / real per request (a fraction); ``*_rel_err`` =
(simulated - real) / real of the load's mean or P99 (signed).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from blockq.engine_model.config import EngineConfig
from blockq.engine_model.latency import StepLatencyModel
from blockq.engine_model.measured_profile import load_profile
from loadgen.fidelity.model_engine import ModelReplayEngine
from loadgen.fidelity.profile import (
    add_engine_process_arguments,
    fit_profile,
    open_engine,
    run_sweep,
    step_errors,
)
from loadgen.fidelity.replay_loop import ReplayResult, replay
from loadgen.fidelity.trace_sample import RequestLengths, build_requests, sample_lengths

DEFAULT_PREFIX_GROUPS = 8
# The capacity is the engine's for the trace, not for the replayed sample: a short sample
# arrives as one burst at any rate and would meet the SLO at every rate.
CAPACITY_SAMPLE_REQUESTS = 500
_BISECT_STEPS = 14


def simulate(config: EngineConfig, latency_model: StepLatencyModel, lengths: Sequence[RequestLengths],
             rates_per_s: Sequence[float], seed: int, prefix_groups: int) -> ReplayResult:
    """The replay of :func:`~loadgen.fidelity.trace_sample.build_requests` on the engine model."""
    requests = build_requests(lengths, rates_per_s, seed, prefix_groups)
    return replay(ModelReplayEngine(config, latency_model), requests)


def find_capacity(config: EngineConfig, latency_model: StepLatencyModel,
                  lengths: Sequence[RequestLengths], seed: int, prefix_groups: int,
                  slo_ttft_s: float) -> float:
    """The highest rate (req/s) whose simulated P99 TTFT is within the SLO, to 0.1 %."""

    def meets_slo(rate_per_s: float) -> bool:
        result = simulate(config, latency_model, lengths, [rate_per_s], seed, prefix_groups)
        return float(np.quantile([r.ttft_s for r in result.requests], 0.99)) <= slo_ttft_s

    low, high = 0.0, 0.25
    while meets_slo(high):
        low, high = high, high * 2
        if high > 1e5:
            raise ValueError("capacity: the SLO holds at any rate; check --slo-ttft-ms")
    for _ in range(_BISECT_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if meets_slo(middle) else (low, middle)
    return low


def score_load(load: float, rate_per_s: float, phase: int, real: ReplayResult,
               sim: ReplayResult) -> dict[str, Any]:
    """One row of the fidelity table (see the module docstring)."""
    real_requests = [r for r in real.requests if r.request_id.startswith(f"L{phase}-")]
    sim_by_id = {r.request_id: r for r in sim.requests}
    pairs = [(r, sim_by_id[r.request_id]) for r in real_requests]
    real_ttft = np.array([r.ttft_s for r, _ in pairs])
    sim_ttft = np.array([s.ttft_s for _, s in pairs])
    real_e2e = np.array([r.e2e_s for r, _ in pairs])
    sim_e2e = np.array([s.e2e_s for _, s in pairs])
    ttft_ape = np.abs(sim_ttft - real_ttft) / real_ttft
    e2e_ape = np.abs(sim_e2e - real_e2e) / real_e2e

    def per_phase(result: ReplayResult, name: str) -> int:
        return int(sum(getattr(step, name) for step in result.steps if step.phase == phase))

    return {
        "load": load, "rate": rate_per_s, "num_requests": len(pairs),
        "ttft_ape_p50": round(float(np.median(ttft_ape)), 4),
        "ttft_ape_p90": round(float(np.quantile(ttft_ape, 0.9)), 4),
        "e2e_ape_p50": round(float(np.median(e2e_ape)), 4),
        "ttft_mean_rel_err": round(float(sim_ttft.mean() / real_ttft.mean() - 1.0), 4),
        "ttft_p99_rel_err": round(float(np.quantile(sim_ttft, 0.99) / np.quantile(real_ttft, 0.99) - 1.0), 4),
        "preemptions_real": per_phase(real, "num_preempted"),
        "preemptions_sim": per_phase(sim, "num_preempted"),
        "prefix_hit_tokens_real": per_phase(real, "num_prefix_hit_tokens"),
        "prefix_hit_tokens_sim": per_phase(sim, "num_prefix_hit_tokens"),
        "ttft_mean_ms_real": round(1000 * float(real_ttft.mean()), 1),
        "ttft_mean_ms_sim": round(1000 * float(sim_ttft.mean()), 1),
        "ttft_p99_ms_real": round(1000 * float(np.quantile(real_ttft, 0.99)), 1),
        "e2e_mean_s_real": round(float(real_e2e.mean()), 3),
    }


def replay_step_errors(latency_model: StepLatencyModel, result: ReplayResult) -> dict[str, float]:
    """How well the profile priced the steps the engine ran during the replay."""
    errors = step_errors(latency_model, result.steps)
    return {"num_steps": int(errors.size), "step_ape_p50": round(float(np.median(errors)), 4),
            "step_ape_p90": round(float(np.quantile(errors, 0.9)), 4)}


def run_fidelity(args: argparse.Namespace) -> dict[str, Any]:
    loads = _parse_loads(args.loads)
    prefix_groups = DEFAULT_PREFIX_GROUPS if args.prefix_caching else 0
    with open_engine(args, enable_prefix_caching=bool(args.prefix_caching)) as engine:
        # Without a profile file the sweep runs on this engine before and after the replay
        # and the profile is fitted to both: one process (a fresh one can run a few %
        # faster or slower) and a drift of its speed during the replay cancels.
        sweep_steps = [] if args.profile else run_sweep(engine)
        profile = (load_profile(args.profile) if args.profile
                   else fit_profile(engine, str(args.model), sweep_steps))
        config = EngineConfig.from_dict(engine.engine_config)
        lengths = sample_lengths(args.trace, args.requests, args.seed, config.max_model_len)
        capacity = find_capacity(
            config, profile.latency_model,
            sample_lengths(args.trace, max(args.requests, CAPACITY_SAMPLE_REQUESTS), args.seed,
                           config.max_model_len),
            args.seed, prefix_groups, args.slo_ttft_ms / 1000.0)
        rates = [load * capacity for load in loads]
        real = engine.replay(build_requests(lengths, rates, args.seed, prefix_groups))
        if not args.profile:
            profile = fit_profile(engine, str(args.model), sweep_steps + run_sweep(engine))
    sim = simulate(config, profile.latency_model, lengths, rates, args.seed, prefix_groups)
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"real": real.to_dict(), "sim": sim.to_dict(),
                       "latency_model": profile.latency_model.to_dict()}, out)
    return {"capacity_rps": capacity,
            "results": [score_load(load, rate, phase, real, sim)
                        for phase, (load, rate) in enumerate(zip(loads, rates, strict=True))],
            "steps": replay_step_errors(profile.latency_model, real), "seed": args.seed,
            "engine_config": engine.engine_config, "profile_fit": profile.fit}


def _parse_loads(text: str) -> list[float]:
    try:
        loads = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"--loads: comma-separated fractions of capacity (got {text!r})") from None
    if not loads or any(not 0.0 < load <= 10.0 for load in loads):
        raise SystemExit(f"--loads: each must be in (0, 10] (got {text!r})")
    return loads


def add_fidelity_arguments(parser: argparse.ArgumentParser) -> None:
    from workers.engines.vllm_options import add_vllm_engine_arguments

    parser.add_argument("--model", required=True, help="the model directory vLLM serves")
    parser.add_argument("--trace", required=True, help="a trace with prompt and output lengths")
    parser.add_argument("--loads", default="0.5,0.8,1.1", help="fractions of the engine's capacity")
    parser.add_argument("--requests", type=int, default=100, help="requests per load")
    parser.add_argument("--seed", type=int, default=1, help="the sample, its arrivals and token ids")
    parser.add_argument("--prefix-caching", action="store_true",
                        help=f"prefix caching on, prompts in {DEFAULT_PREFIX_GROUPS} groups sharing a prefix")
    parser.add_argument("--profile", default=None, help="PROFILE.json (default: measure one first)")
    parser.add_argument("--slo-ttft-ms", type=float, default=3000.0,
                        help="capacity: the highest rate with P99 TTFT within this")
    parser.add_argument("--out", default=None, help="write every request's and step's record here (JSON)")
    parser.add_argument("--json", action="store_true")
    add_engine_process_arguments(parser)
    add_vllm_engine_arguments(parser, for_one_engine=True)


def run_fidelity_command(args: argparse.Namespace) -> int:
    if args.requests < 2:
        raise SystemExit("--requests: must be >= 2")
    report = run_fidelity(args)
    if args.json:
        json.dump(report, sys.stdout)
        sys.stdout.write("\n")
        return 0
    print(f"capacity {report['capacity_rps']:.3f} req/s (simulated, P99 TTFT <= {args.slo_ttft_ms:.0f} ms)")
    print("load  rate   TTFT APE p50/p90  E2E APE p50  mean/P99 TTFT err  preemptions real/sim  prefix hits real/sim")
    for row in report["results"]:
        print(f"{row['load']:<5} {row['rate']:<6.3f} {row['ttft_ape_p50']:6.1%} / {row['ttft_ape_p90']:<6.1%} "
              f"{row['e2e_ape_p50']:9.1%}  {row['ttft_mean_rel_err']:+7.1%} / {row['ttft_p99_rel_err']:+7.1%}"
              f"  {row['preemptions_real']:>8} / {row['preemptions_sim']:<8}"
              f"  {row['prefix_hit_tokens_real']:>9} / {row['prefix_hit_tokens_sim']}")
    return 0
