"""``blockq simulate autoscale``: scalers compared on one workload in virtual time.

The workload is a trace replayed at its own timestamps (``--trace-times``: every request
of the trace) or the trace's requests drawn (with replacement) onto Poisson arrivals whose
rate follows ``--rate-profile``. Every scaler sees the same requests at the same times
(per seed). Requests are served best-effort (none is answered ``infeasible``), so the SLO
attainment is the share of requests whose TTFT was within the objective; requests no
instance can run (a prompt past the model's context) are counted apart (``num_refused``)
and left out of every figure, the same for every scaler.

The static fleet is the smallest size whose P99 TTFT over the whole run meets the SLO
(bisection between the bounds; a run stops as soon as more than 1 % of its requests
missed); the autoscalers start from ``--initial-instances`` (default: the minimum).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dispatcher.autoscale import (
    ScalerTuning,
    ScalingRules,
    count_reversals,
    make_autoscaler,
)
from dispatcher.autoscale.futures import p99
from loadgen.arrivals import parse_rate_profile, profile_arrivals
from loadgen.simulation.config import SimulationConfig
from loadgen.simulation.fleet import AutoscaledSimulation, FleetTimeline
from loadgen.simulation.workload import (
    AnnotatedSample,
    annotate_sample,
    arrivals_for,
    sample_trace,
    submitted,
)

REVERSAL_WINDOW_S = 600.0


@dataclass(frozen=True)
class AutoscaleSettings:
    """What the autoscalers may do (:class:`ScalingRules`), how they are tuned, and the
    fleet they start from."""

    rules: ScalingRules
    initial_instances: int
    startup_s: float = 90.0
    cycle_s: float = 60.0
    tuning: ScalerTuning = field(default_factory=ScalerTuning)
    schedule: tuple[tuple[float, int], ...] = ()   # the scheduled scaler's (seconds, size) steps


@dataclass
class ScalerRun:
    summary: dict[str, Any]
    timeline: FleetTimeline
    ttft_by_arrival: list[tuple[float, float]]   # (arrival offset s, TTFT ms; inf when missed)
    aborted: bool = False


def workload(args: argparse.Namespace, seed: int) -> tuple[AnnotatedSample, list[tuple[float, int]]]:
    """The annotated sample and its schedule ((offset s, index), in submit order)."""
    if args.rate_profile:
        offsets = profile_arrivals(parse_rate_profile(args.rate_profile), seed)
        trace_requests = sample_trace(args.trace, len(offsets), seed, redraw=True)
        sample = annotate_sample(trace_requests, seed, predictor=args.predictor, predictor_model=args.predictor_model)
        return sample, [(float(at_s), index) for index, at_s in enumerate(offsets)]
    if not args.trace_times:
        raise SystemExit("simulate autoscale: give --trace-times or --rate-profile")
    trace_requests = sample_trace(args.trace, 10**9, seed, redraw=False)
    sample = annotate_sample(trace_requests, seed, predictor=args.predictor, predictor_model=args.predictor_model)
    return sample, arrivals_for(sample, rate_per_s=None, use_trace_times=True)


def run_scaler(config: SimulationConfig, sample: AnnotatedSample, schedule: list[tuple[float, int]], name: str,
               settings: AutoscaleSettings, *, static_size: int | None = None,
               abort_after_misses: int | None = None,
               on_progress: Callable[[int, int], None] | None = None) -> ScalerRun:
    """One scaler over the workload (``static_size``: the static fleet's size)."""
    autoscaler = make_autoscaler(name, settings.rules, cycle_s=settings.cycle_s, startup_s=settings.startup_s,
                                 slo_ttft_s=config.slo_ttft_ms / 1000, seed=sample.seed, static_size=static_size,
                                 tuning=settings.tuning, schedule=settings.schedule,
                                 schedule_origin_s=config.warmup_s)
    initial = (static_size if name == "static" else settings.schedule[0][1] if name == "scheduled"
               else settings.initial_instances)
    config = replace(config, instances=initial, best_effort=True)
    simulation = AutoscaledSimulation(config, autoscaler, startup_s=settings.startup_s)
    origin_s = config.warmup_s
    arrivals = [(offset_s, submitted(request, origin_s + offset_s, best_effort=True))
                for offset_s, index in schedule if (request := sample.requests[index]) is not None]
    result = simulation.run(arrivals, on_progress, abort_after_misses=abort_after_misses)
    ttft: list[tuple[float, float]] = []
    num_refused = len(sample.rejected) + len(result.rejected)
    for offset_s, index in schedule:
        request = sample.requests[index]
        if request is None or request.id in result.rejected:
            continue
        final = result.finals.get(request.id)
        if final is not None and final.status == "error" and final.finish_reason == "abort":
            num_refused += 1  # the engine cannot run it (e.g. its prompt is past the context)
            continue
        ok = final is not None and final.status == "ok" and final.ttft_ms is not None
        ttft.append((offset_s, final.ttft_ms if ok else float("inf")))  # type: ignore[union-attr]
    values = np.array([t for _, t in ttft]) if ttft else np.zeros(0)
    timeline = simulation.timeline
    actions = timeline.actions()
    summary = {
        "scaler": name, "seed": sample.seed, "gpu_hours": round(timeline.gpu_hours(result.end_s), 3),
        "slo_attainment": round(float(np.mean(values <= config.slo_ttft_ms)), 4) if len(values) else None,
        "ttft_p99_ms": round(min(p99(values), 1e12), 1) if len(values) else None,
        "ttft_mean_ms": round(float(np.mean(values[np.isfinite(values)])), 1) if len(values) else None,
        "num_scale_actions": len(actions), "num_reversals_10min": count_reversals(actions, REVERSAL_WINDOW_S),
        "instances_peak": max((d.target for d in timeline.decisions), default=initial),
        "num_requests": len(values), "num_refused": num_refused, "duration_s": round(result.end_s, 1),
        "policy": config.policy, "preset": config.preset,
    }
    return ScalerRun(summary, timeline, ttft, aborted=result.aborted)


def find_static_size(config: SimulationConfig, sample: AnnotatedSample, schedule: list[tuple[float, int]],
                     settings: AutoscaleSettings,
                     progress: Callable[[str], Callable[[int, int], None] | None] = lambda label: None,
                     ) -> tuple[int, ScalerRun]:
    """The smallest fleet within the bounds whose P99 TTFT meets the SLO (the largest when
    none does), by bisection, and its run."""
    rules = settings.rules
    low, high = max(1, rules.min_instances), rules.max_instances
    best: tuple[int, ScalerRun] | None = None
    max_misses = len(schedule) // 100
    while low <= high:
        size = (low + high) // 2
        run = run_scaler(config, sample, schedule, "static", settings, static_size=size, abort_after_misses=max_misses,
                         on_progress=progress(f"static {size}"))
        if not run.aborted and run.summary["ttft_p99_ms"] is not None \
                and run.summary["ttft_p99_ms"] <= config.slo_ttft_ms:
            best = (size, run)
            high = size - 1
        else:
            low = size + 1
    if best is None:
        size = rules.max_instances
        return size, run_scaler(config, sample, schedule, "static", settings, static_size=size,
                                on_progress=progress(f"static {size}"))
    return best
