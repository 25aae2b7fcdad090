"""One simulated run: a sample at a rate under a policy → the summary ``blockq bench``
writes, plus per-request records and KV samples for the report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loadgen.metrics import KvSample, RequestRecord, summarize
from loadgen.replay import failed_record, record_of
from loadgen.simulation.cluster import ClusterSimulation
from loadgen.simulation.config import SimulationConfig
from loadgen.simulation.workload import AnnotatedSample, arrivals_for, submitted


@dataclass
class SimulatedRun:
    summary: dict[str, Any]
    records: list[RequestRecord]
    kv_samples: list[KvSample]


def simulate_run(config: SimulationConfig, sample: AnnotatedSample, *, rate_per_s: float | None,
                 burstiness: float = 1.0, use_trace_times: bool = False,
                 on_progress: Callable[[int, int], None] | None = None) -> SimulatedRun:
    """Simulate ``sample`` arriving at ``rate_per_s`` on the cluster ``config`` describes.

    The summary has :func:`loadgen.metrics.summarize`'s keys and ``blockq bench``'s run
    fields (``policy``, ``rate``, ``instances``, ``preset``, ``seed``), plus ``events``
    and ``steps`` (what the simulation did); ``lag_p99_ms`` is None (virtual time has no lag)."""
    schedule = arrivals_for(sample, rate_per_s=rate_per_s, burstiness=burstiness, use_trace_times=use_trace_times)
    simulation = ClusterSimulation(config, refinements=sample.refinements)
    origin_s = config.warmup_s  # the first request is submitted after the warm-up
    arrivals = [(offset_s, submitted(request, origin_s + offset_s * config.time_scale, best_effort=config.best_effort))
                for offset_s, index in schedule
                if (request := sample.requests[index]) is not None]
    result = simulation.run(arrivals, on_progress)
    records: list[RequestRecord] = []
    for offset_s, index in schedule:
        trace_request = sample.trace_requests[index]
        request = sample.requests[index]
        if request is None:
            records.append(failed_record(trace_request, offset_s, sample.rejected[index]))
        elif request.id in result.rejected:
            records.append(failed_record(trace_request, offset_s, result.rejected[request.id]))
        elif request.id in result.finals:
            records.append(record_of(request.id, trace_request, offset_s, result.finals[request.id]))
        else:
            records.append(failed_record(trace_request, offset_s, "not answered"))
    duration_s = max(0.0, result.end_s - origin_s) / config.time_scale
    summary = summarize(records, duration_s=duration_s, kv_samples=result.kv_samples,
                        slo_ttft_ms=config.slo_ttft_ms)
    summary.update(policy=config.policy, rate=rate_per_s, instances=config.instances, preset=config.preset,
                   seed=sample.seed, time_scale=config.time_scale, mode="simulated", events=result.counters["events"],
                   steps=result.counters["steps"], beats_rejected=result.counters["beats_rejected"])
    return SimulatedRun(summary, records, result.kv_samples)
