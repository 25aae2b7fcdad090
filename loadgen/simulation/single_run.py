"""One simulated run: a sample at a rate under a policy → the summary ``blockq bench``
writes, plus per-request records and KV samples for the report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from blockq.wire.protocol import FinalRecord, Request
from dispatcher.core import CoreStats, DispatcherCore
from loadgen.replay import failed_record, record_of
from loadgen.simulation.cluster import ClusterSimulation
from loadgen.simulation.config import SimulationConfig
from loadgen.simulation.multi_cell import CellsSimulation
from loadgen.simulation.prefix_report import ideal_prefix_hit_rate, predicted_prefix_hit_rate
from loadgen.simulation.workload import AnnotatedSample, arrivals_for, submitted
from loadgen.summaries import KvSample, RequestRecord, summarize


@dataclass
class SimulatedRun:
    summary: dict[str, Any]
    records: list[RequestRecord]
    kv_samples: list[KvSample]


def simulate_run(config: SimulationConfig, sample: AnnotatedSample, *, rate_per_s: float | None,
                 burstiness: float = 1.0, use_trace_times: bool = False,
                 on_progress: Callable[[int, int], None] | None = None) -> SimulatedRun:
    """Simulate ``sample`` arriving at ``rate_per_s`` on the cluster ``config`` describes.

    The summary has :func:`loadgen.summaries.summarize`'s keys and ``blockq bench``'s run
    fields (``policy``, ``rate``, ``instances``, ``preset``, ``seed``), plus ``events``
    and ``steps`` (what the simulation did); ``lag_p99_ms`` is None (virtual time has no lag).
    ``prefix_hit_rate``: the share of prompt tokens the engines found in their prefix caches
    at admission, over every instance (None without prefix caching, or nothing admitted);
    ``prefix_hit_rate_predicted`` and ``prefix_hit_rate_ideal`` beside it
    (:mod:`loadgen.simulation.prefix_report`)."""
    schedule = arrivals_for(sample, rate_per_s=rate_per_s, burstiness=burstiness, use_trace_times=use_trace_times)
    simulation: ClusterSimulation | CellsSimulation = (
        CellsSimulation(config, refinements=sample.refinements) if config.cells > 1
        else ClusterSimulation(config, refinements=sample.refinements))
    origin_s = config.warmup_s  # the first request is submitted after the warm-up
    models = config.served.draw(len(sample.requests), sample.seed)  # the model each request names
    arrivals = [(offset_s, submitted(replace(request, model=models[index]), origin_s + offset_s * config.time_scale,
                                     best_effort=config.best_effort))
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
                        delivery_samples_ms=result.delivery_samples_ms, slo_ttft_ms=config.slo_ttft_ms)
    summary.update(policy=config.policy, rate=rate_per_s, instances=config.instances,
                   preset=str(config.fleet) if config.fleet is not None else config.preset,
                   seed=sample.seed, time_scale=config.time_scale, mode="simulated", events=result.counters["events"],
                   steps=result.counters["steps"], beats_rejected=result.counters["beats_rejected"],
                   **_prefix_hit_rates(config, result.counters, simulation.cores, [r for _, r in arrivals]))
    if isinstance(simulation, ClusterSimulation) and (config.served.num_adapters or config.served.models):
        summary.update(_served_figures(config, simulation, result.finals, [r for _, r in arrivals]))
    if config.cells > 1:  # the cells, and how many requests the front sent each
        summary["cells"] = config.cells
        summary["cells_sent"] = {k[len("sent_"):]: v for k, v in result.counters.items() if k.startswith("sent_")}
    summary["forecast_check"] = _forecast_check(config, simulation.cores, result.trust_changes)
    return SimulatedRun(summary, records, result.kv_samples)


def _served_figures(config: SimulationConfig, simulation: ClusterSimulation,
                    finals: dict[str, FinalRecord], requests: list[Request]) -> dict[str, Any]:
    """``adapter_loads`` (every engine's), and ``model_misplaced``: requests answered by an
    instance that does not serve the model they named (the dispatcher must place none)."""
    served = {instance_id: {instance.engine.model, *instance.engine.options.lora_adapters}
              for instance_id, instance in simulation.instances.items()}
    misplaced = sum(1 for request in requests if request.model is not None and (final := finals.get(request.id))
                    and final.instance and request.model not in served[final.instance])
    return {"adapter_loads": sum(i.engine.scheduler.num_lora_loads for i in simulation.instances.values()),
            "model_misplaced": misplaced, "adapters": config.served.num_adapters,
            "max_loras": config.served.max_loras if config.served.num_adapters else None,
            "models": [m.name for m in config.served.models] or None,
            "per_model": _per_model_ttft(config, finals, requests)}


def _per_model_ttft(config: SimulationConfig, finals: dict[str, FinalRecord],
                    requests: list[Request]) -> dict[str, dict[str, float | int | None]] | None:
    """Several base models: each one's requests, answered ok, and their mean and P99 TTFT (ms)."""
    if not config.served.models:
        return None
    figures = {}
    for model in config.served.models:
        ttfts = [final.ttft_ms for request in requests if request.model == model.name
                 and (final := finals.get(request.id)) is not None and final.status == "ok" and final.ttft_ms is not None]
        ordered = sorted(ttfts)
        figures[model.name] = {"requests": sum(1 for r in requests if r.model == model.name), "ok": len(ttfts),
                               "ttft_mean_ms": sum(ttfts) / len(ttfts) if ttfts else None,
                               "ttft_p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ttfts else None}
    return figures


def _prefix_hit_rates(config: SimulationConfig, counters: dict[str, int], cores: list[DispatcherCore],
                      requests_in_arrival_order: list[Request]) -> dict[str, float | None]:
    """Measured (prompt tokens served from cache / queried), predicted and ideal; all None
    without prefix caching (see simulate_run)."""
    if not config.prefix_caching:
        return dict.fromkeys(("prefix_hit_rate", "prefix_hit_rate_predicted", "prefix_hit_rate_ideal"))
    num_queried_tokens = counters["prefix_cache_queries_tokens"]
    return {"prefix_hit_rate": counters["prefix_cache_hits_tokens"] / num_queried_tokens if num_queried_tokens else None,
            "prefix_hit_rate_predicted": predicted_prefix_hit_rate(_summed_stats(cores)),
            "prefix_hit_rate_ideal": ideal_prefix_hit_rate(requests_in_arrival_order)}


def _summed_stats(cores: list[DispatcherCore]) -> CoreStats:
    """The prompt-token counts of every cell's dispatcher, summed."""
    stats = CoreStats()
    for core in cores:
        stats.num_placed_prompt_tokens += core.stats.num_placed_prompt_tokens
        stats.num_predicted_cached_tokens += core.stats.num_predicted_cached_tokens
    return stats


def _forecast_check(config: SimulationConfig, cores: list[DispatcherCore],
                    trust_changes: list[dict[str, Any]]) -> dict[str, Any]:
    """The forecast check's setting, its changes of trust and every instance's final
    figures (:class:`blockq.forecast_check.InstanceError`), over every cell's dispatcher."""
    options = cores[0].forecast_check.options
    errors = {i: e.to_dict() for core in cores for i, e in core.forecast_check.instance_errors().items()}
    return {"fallback": options.fallback, "window": options.window, "bound": options.bound,
            "slow_instances": config.slow_instances, "slow_factor": config.slow_factor,
            "slow_published": config.slow_published, "slow_hidden": config.slow_hidden, "changes": trust_changes,
            "instances": errors}
