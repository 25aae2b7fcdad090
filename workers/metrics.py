"""A worker process's Prometheus metrics: one registry per process, one label set per
instance it serves (``instance_id``, and ``model_name`` as vLLM labels its own), served on
``--metrics-port``.

Where vLLM has a metric for the figure, it has vLLM's name, so vLLM dashboards work:

- ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (gauges): the engine's
  running and waiting requests, as the latest heartbeat counted them;
- ``vllm:kv_cache_usage_perc`` (gauge): KV blocks in use over the engine's blocks, 0-1;
- ``vllm:num_preemptions_total`` (counter): preemptions the engine reported, per step;
- ``vllm:prompt_tokens_total`` (counter): prompt tokens of the requests answered ``ok``;
- ``vllm:generation_tokens_total`` (counter): output tokens the engine produced;
- ``vllm:time_to_first_token_seconds``, ``vllm:time_per_output_token_seconds``,
  ``vllm:e2e_request_latency_seconds`` (histograms): per request answered ``ok``.
  Unlike vLLM's (from the engine's arrival; TPOT per iteration), these are the blockq
  figures of the final record and the ``done`` stream: model time (wall time over the
  engine's ``time_scale``; the same for vLLM) from the request's submission, TPOT the
  request's mean time per output token after the first;

and blockq's own:

- ``blockq_worker_kv_blocks_used``, ``blockq_worker_kv_blocks_total`` (gauges);
- ``blockq_worker_emulator_lag_seconds`` (gauge): how far the emulated engine's steps ran
  behind real time, the p99 of the recent steps the heartbeat reports (``lag_p99_ms``;
  0 for vLLM, whose steps are real);
- ``blockq_worker_delivery_seconds`` (gauge): the p90 of the recent requests' wall time
  from the dispatcher's decision to the engine (the heartbeat's ``delivery_p90_ms``; 0
  before the first placed request), which the dispatcher's replica waits for;
- ``blockq_worker_requests_total{outcome}`` (counter): requests settled, by outcome:
  ``ok``, ``cancelled``, ``error``, ``dropped`` (fenced off or answered elsewhere),
  ``dead_lettered``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from blockq.wire.beats import Heartbeat
from workers.engines.base import EngineStepOutput
from workers.replies import InFlight, flight_timings

if TYPE_CHECKING:
    from workers.worker import InstanceWorker

LABELS = ["instance_id", "model_name"]
# vLLM's buckets, with 3.0 added to TTFT's so that the share within the 3 s objective is exact.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 3.0, 5.0, 7.5,
                  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 3.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                 240.0, 480.0, 960.0, 1920.0, 7680.0)
OUTCOMES = ("ok", "cancelled", "error", "dropped", "dead_lettered")


@dataclass
class WorkerStats:
    """One worker's own counts (``blockq_worker_requests_total`` reads them)."""

    num_received: int = 0
    num_finished: int = 0
    num_cancelled: int = 0
    num_errors: int = 0
    num_dropped: int = 0          # fenced off, or answered elsewhere
    num_dead_lettered: int = 0
    lag_ms: deque[float] = field(default_factory=lambda: deque(maxlen=2000))

    def count_settled(self, outcome: str, status: str) -> None:
        """A request settled (``outcome`` as :func:`workers.replies.settle_writes` says;
        ``status`` its final record's, for one answered here)."""
        if outcome != "answered":
            self.num_dropped += 1
        elif status == "cancelled":
            self.num_cancelled += 1
        elif status == "error":
            self.num_errors += 1
        else:
            self.num_finished += 1


class _RequestsCollector(Collector):
    """``blockq_worker_requests_total`` from each worker's own counts (WorkerStats)."""

    def __init__(self) -> None:
        self.workers: list[InstanceWorker] = []

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("blockq_worker_requests", "Requests settled, by outcome.",
                                     labels=["instance_id", "outcome"])
        for worker in self.workers:
            stats = worker.stats
            counts = (stats.num_finished, stats.num_cancelled, stats.num_errors, stats.num_dropped,
                      stats.num_dead_lettered)
            for outcome, count in zip(OUTCOMES, counts, strict=True):
                family.add_metric([worker.instance_id, outcome], count)
        yield family


class WorkerMetrics:
    """The metrics of one worker process (see the module docstring) on ``registry``;
    :meth:`attach` gives each instance's worker its handle."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.num_running = Gauge("vllm:num_requests_running", "Requests running in the engine.", LABELS, registry=r)
        self.num_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting in the engine.", LABELS, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage, 0-1 (1 = every block in use).", LABELS,
                              registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions the engine reported.", LABELS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests answered ok.", LABELS,
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Output tokens the engine produced.", LABELS,
                                         registry=r)
        self.ttft_s = Histogram("vllm:time_to_first_token_seconds", "Submission to first token, model-time "
                                "seconds (requests answered ok).", LABELS, buckets=TTFT_BUCKETS_S, registry=r)
        self.tpot_s = Histogram("vllm:time_per_output_token_seconds", "Mean seconds per output token after the "
                                "first, model time, per request answered ok.", LABELS, buckets=TPOT_BUCKETS_S,
                                registry=r)
        self.e2e_s = Histogram("vllm:e2e_request_latency_seconds", "Submission to last token, model-time seconds "
                               "(requests answered ok).", LABELS, buckets=E2E_BUCKETS_S, registry=r)
        self.kv_blocks_used = Gauge("blockq_worker_kv_blocks_used", "KV blocks in use.", LABELS, registry=r)
        self.kv_blocks_total = Gauge("blockq_worker_kv_blocks_total", "KV blocks of the engine.", LABELS, registry=r)
        self.lag_s = Gauge("blockq_worker_emulator_lag_seconds", "p99 of how far the recent engine steps ran "
                           "behind real time, seconds (0 for a real engine).", LABELS, registry=r)
        self.delivery_s = Gauge("blockq_worker_delivery_seconds", "p90 of the recent requests' wall seconds "
                                "from the dispatcher's decision to the engine.", LABELS, registry=r)
        self._requests = _RequestsCollector()
        r.register(self._requests)

    def attach(self, worker: InstanceWorker) -> InstanceMetrics:
        """The handle ``worker`` records through; its request counts are read from it."""
        self._requests.workers.append(worker)
        return InstanceMetrics(self, worker.instance_id, worker.engine.model or "", worker.engine.time_scale)


class InstanceMetrics:
    """One instance's label set of :class:`WorkerMetrics` (the worker's thin hooks)."""

    def __init__(self, metrics: WorkerMetrics, instance_id: str, model_name: str, time_scale: float) -> None:
        labels = {"instance_id": instance_id, "model_name": model_name}
        self.time_scale = time_scale
        self.num_running = metrics.num_running.labels(**labels)
        self.num_waiting = metrics.num_waiting.labels(**labels)
        self.kv_usage = metrics.kv_usage.labels(**labels)
        self.preemptions = metrics.preemptions.labels(**labels)
        self.prompt_tokens = metrics.prompt_tokens.labels(**labels)
        self.generation_tokens = metrics.generation_tokens.labels(**labels)
        self.ttft_s = metrics.ttft_s.labels(**labels)
        self.tpot_s = metrics.tpot_s.labels(**labels)
        self.e2e_s = metrics.e2e_s.labels(**labels)
        self.kv_blocks_used = metrics.kv_blocks_used.labels(**labels)
        self.kv_blocks_total = metrics.kv_blocks_total.labels(**labels)
        self.lag_s = metrics.lag_s.labels(**labels)
        self.delivery_s = metrics.delivery_s.labels(**labels)

    def record_beat(self, beat: Heartbeat) -> None:
        """The engine's state as the heartbeat just published reports it."""
        num_blocks = int(beat.engine_config.get("num_gpu_blocks") or 0)
        self.num_running.set(beat.num_running_total)
        self.num_waiting.set(beat.num_waiting_total)
        self.kv_blocks_used.set(beat.num_used_blocks)
        self.kv_blocks_total.set(num_blocks)
        self.kv_usage.set(beat.num_used_blocks / num_blocks if num_blocks else 0.0)
        self.lag_s.set(beat.lag_p99_ms / 1000)
        self.delivery_s.set((beat.delivery_p90_ms or 0.0) / 1000)

    def record_step(self, output: EngineStepOutput) -> None:
        if output.preempted_ids:
            self.preemptions.inc(len(output.preempted_ids))
        num_tokens = sum(event.num_new_tokens for event in output.events)
        if num_tokens:
            self.generation_tokens.inc(num_tokens)

    def record_answered(self, flight: InFlight) -> None:
        """A request answered ``ok`` (its final record written): its latencies."""
        timings = flight_timings(flight, self.time_scale)
        self.prompt_tokens.inc(flight.prompt_tokens)
        for histogram, value_ms in ((self.ttft_s, timings["ttft_ms"]), (self.tpot_s, timings["tpot_ms"]),
                                    (self.e2e_s, timings["e2e_ms"])):
            if value_ms is not None:
                histogram.observe(value_ms / 1000)
