"""The dispatcher's Prometheus metrics: one registry per dispatcher process, served on
``--metrics-port`` together with the autoscaler's (:class:`dispatcher.autoscale.actuators.AutoscaleMetrics`).

Metrics (``policy`` is the placement policy's name):

- ``blockq_dispatcher_decisions_total{policy,outcome}`` (counter): outcomes of the
  core's placement decisions, ``placed`` | ``held`` | ``rejected`` | ``infeasible``
  (:class:`dispatcher.core.CoreStats`). A held request is counted at every offer: each
  batch offers again what the dispatcher holds;
- ``blockq_dispatcher_decision_seconds{policy}`` (histogram): per placed decision, the
  seconds the policy took to choose the instance (the candidates' simulation), not the
  Redis writes of the batch;
- ``blockq_dispatcher_held_requests`` (gauge): requests held in memory (no instance may
  take them yet), pending in ``ready``;
- ``blockq_dispatcher_leader`` (gauge): 1 while this dispatcher holds the lease;
- ``blockq_dispatcher_ttft_forecast_error_seconds{instance_id}`` and
  ``blockq_dispatcher_e2e_forecast_error_seconds{instance_id}`` (histograms): measured
  minus forecast, model-time seconds (negative: faster than forecast), from the ``done``
  records of requests answered ``ok`` that carry a forecast;
- ``blockq_dispatcher_forecast_error_ratio{instance_id,signal}`` (gauge): the forecast
  check's median absolute percentage error (a fraction: 0.25 = 25 %) over each
  instance's latest answers, ``signal`` ``ttft`` or ``e2e``; and
  ``blockq_dispatcher_instance_trusted{instance_id}`` (gauge): 1 while the instance's
  replica is trusted, 0 once its error passed the bound (docs/dispatcher.md, "The
  forecast check"). By instance: a fleet's instances are bounded, and the check forgets none
  only while the process lives;
- ``blockq_dispatcher_replica_rebuilds_total`` (counter): replicas rebuilt from a beat;
- ``blockq_dispatcher_beats_rejected_total{reason}`` (counter): beats that changed
  nothing, by why: ``undecodable`` (refused at decoding), ``unusable`` (the view refused
  its engine config or contents), ``error`` (applying it raised anything else: logged
  with its traceback and instance id; the leader carries on). Not by instance: a fleet's
  ids are unbounded, the log names them;
- ``blockq_dispatcher_dead_letters`` (gauge): entries in the dead-letter stream (which is
  capped, so the figure stops growing at the cap), as the leader last read it.

**Where the forecast errors come from.** The policy's forecast for the chosen instance
travels with the request (its :class:`~blockq.wire.protocol.Assignment`); the worker copies it
into the request's ``done`` record next to the measured TTFT and E2E (model time from
submission, the figures ``loadgen`` compares too, so the error also holds the little
time between submission and the decision). :class:`DoneFollower` reads ``done`` in the
leader's loop at most once per :data:`DONE_POLL_S` with a plain ``XREAD`` cursor, not a
consumer group: it only observes, so it has nothing to ACK and leaves no pending
entries, and a standby reads nothing. A new term starts its cursor at the stream's end:
records finished before are the previous leader's to count.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import redis
import redis.asyncio as aioredis
import structlog
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from blockq.wire.keys import PAYLOAD_FIELD, Keys
from blockq.wire.protocol import DoneRecord, ValidationError, unpack_map
from dispatcher.core import BEAT_REJECTION_REASONS, Placed

if TYPE_CHECKING:
    from dispatcher.core import DispatcherCore, Outcome

log = structlog.get_logger(__name__)

DECISION_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# Signed: a forecast is as likely too long as too short; 0 is a bound, so the share of
# requests faster than forecast is read from the buckets.
FORECAST_ERROR_BUCKETS_S = (-60.0, -30.0, -10.0, -5.0, -3.0, -2.0, -1.0, -0.5, -0.25, -0.1, -0.05, 0.0,
                            0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)
DONE_POLL_S = 1.0
DONE_READ_COUNT = 1000


class _CoreCollector(Collector):
    """The core's counts and the service's state, read at scrape time (in the loop)."""

    def __init__(self, core: DispatcherCore, num_held: Callable[[], int], is_leading: Callable[[], bool],
                 num_dead_letters: Callable[[], int]) -> None:
        self.core = core
        self.num_held = num_held
        self.is_leading = is_leading
        self.num_dead_letters = num_dead_letters

    def collect(self) -> Iterator[Metric]:
        stats = self.core.stats
        decisions = CounterMetricFamily("blockq_dispatcher_decisions", "Placement decisions by outcome "
                                        "(a held request is counted at every offer).", labels=["policy", "outcome"])
        for outcome, count in (("placed", stats.num_placed), ("held", stats.num_held),
                               ("rejected", stats.num_rejected), ("infeasible", stats.num_infeasible)):
            decisions.add_metric([self.core.policy.name, outcome], count)
        yield decisions
        yield CounterMetricFamily("blockq_dispatcher_replica_rebuilds", "Instance replicas rebuilt from a beat "
                                  "(when a decision needed one older than its latest beat).",
                                  value=self.core.view.num_replica_rebuilds)
        rejected = CounterMetricFamily("blockq_dispatcher_beats_rejected", "Heartbeats that changed nothing, by "
                                       "reason (undecodable, unusable, error).", labels=["reason"])
        for reason in BEAT_REJECTION_REASONS:
            rejected.add_metric([reason], stats.beats_rejected[reason])
        yield rejected
        yield GaugeMetricFamily("blockq_dispatcher_held_requests", "Requests held in memory, pending in ready "
                                "(no instance may take them yet).", value=self.num_held())
        yield GaugeMetricFamily("blockq_dispatcher_leader", "1 while this dispatcher holds the leader lease.",
                                value=1.0 if self.is_leading() else 0.0)
        yield from self._forecast_check()
        yield GaugeMetricFamily("blockq_dispatcher_dead_letters", "Entries in the dead-letter stream (capped), "
                                "as the leader last read it.", value=self.num_dead_letters())

    def _forecast_check(self) -> Iterator[Metric]:
        errors = GaugeMetricFamily("blockq_dispatcher_forecast_error_ratio", "Median absolute percentage error "
                                   "(fraction) of the forecasts of each instance's latest answers, by signal.",
                                   labels=["instance_id", "signal"])
        trusted = GaugeMetricFamily("blockq_dispatcher_instance_trusted", "1 while the instance's replica is "
                                    "trusted by the forecast check, 0 once its error passed the bound.",
                                    labels=["instance_id"])
        for instance_id, error in self.core.forecast_check.instance_errors().items():
            for signal, value in (("ttft", error.ttft_mape), ("e2e", error.e2e_mape)):
                if value is not None:
                    errors.add_metric([instance_id, signal], value)
            trusted.add_metric([instance_id], 1.0 if error.trusted else 0.0)
        yield errors
        yield trusted


class DispatcherMetrics:
    """Every metric of one dispatcher (see the module docstring) on ``registry``."""

    def __init__(self, core: DispatcherCore, *, num_held: Callable[[], int], is_leading: Callable[[], bool],
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.num_dead_letters = 0
        self.registry.register(_CoreCollector(core, num_held, is_leading, lambda: self.num_dead_letters))
        self.decision_s = Histogram("blockq_dispatcher_decision_seconds",
                                    "Per placed decision: seconds the policy took to choose the instance "
                                    "(simulating the candidates), not the batch's Redis writes.",
                                    ["policy"], buckets=DECISION_BUCKETS_S, registry=self.registry)
        self.ttft_error_s = Histogram("blockq_dispatcher_ttft_forecast_error_seconds",
                                      "Measured minus forecast TTFT of answered requests, model-time seconds.",
                                      ["instance_id"], buckets=FORECAST_ERROR_BUCKETS_S, registry=self.registry)
        self.e2e_error_s = Histogram("blockq_dispatcher_e2e_forecast_error_seconds",
                                     "Measured minus forecast E2E latency of answered requests, model-time seconds.",
                                     ["instance_id"], buckets=FORECAST_ERROR_BUCKETS_S, registry=self.registry)

    def record_placed(self, outcomes: list[Outcome]) -> None:
        """Observe the decision time of every placed outcome."""
        for outcome in outcomes:
            assignment = outcome.request.assignment
            if isinstance(outcome, Placed) and assignment is not None:
                self.decision_s.labels(policy=assignment.policy).observe(assignment.decision_ms / 1000)

    def record_done(self, record: DoneRecord) -> None:
        """Observe the forecast errors of one ``done`` record (ok and forecast only)."""
        if record.status != "ok" or not isinstance(record.instance, str):
            return
        for measured_ms, forecast_ms, histogram in ((record.ttft_ms, record.predicted_ttft_ms, self.ttft_error_s),
                                                    (record.e2e_ms, record.predicted_e2e_ms, self.e2e_error_s)):
            if isinstance(measured_ms, int | float) and isinstance(forecast_ms, int | float):
                histogram.labels(instance_id=record.instance).observe((measured_ms - forecast_ms) / 1000)


class DoneFollower:
    """Follows ``done`` (and the dead-letter stream's length) for the leader's metrics and
    forecast check; see the module docstring. ``poll`` is cheap when not due. A lost connection propagates to
    the caller's loop, which handles it like any other; a command Redis refuses is logged
    and skipped: metrics never stop placement."""

    def __init__(self, client: aioredis.Redis, keys: Keys, metrics: DispatcherMetrics, *,
                 poll_s: float = DONE_POLL_S, clock: Callable[[], float] = time.monotonic,
                 on_record: Callable[[DoneRecord], None] | None = None) -> None:
        """``on_record``: also given every record read (the dispatcher's forecast check)."""
        self.client = client
        self.keys = keys
        self.metrics = metrics
        self.on_record = on_record
        self.poll_s = poll_s
        self.clock = clock
        self._cursor: str | None = None
        self._next_poll_at_s = 0.0
        self.num_read = 0

    def start_term(self) -> None:
        """Read from the stream's end at the next poll (a new term)."""
        self._cursor = None
        self._next_poll_at_s = 0.0

    async def poll(self) -> int:
        """Observe the ``done`` records written since the last poll, when one is due;
        returns how many were read."""
        now_s = self.clock()
        if now_s < self._next_poll_at_s:
            return 0
        self._next_poll_at_s = now_s + self.poll_s
        pipe = self.client.pipeline(transaction=False)
        pipe.xlen(self.keys.dead_letters)
        if self._cursor is None:
            pipe.xrevrange(self.keys.done, count=1)
        else:
            pipe.xread({self.keys.done: self._cursor}, count=DONE_READ_COUNT)
        try:
            num_dead_letters, reply = await pipe.execute()
        except redis.ResponseError as exc:
            log.warning("done_follow_failed", error=str(exc)[:200])
            return 0
        self.metrics.num_dead_letters = int(num_dead_letters)
        if self._cursor is None:
            self._cursor = reply[0][0].decode() if reply else "0-0"
            return 0
        entries = reply[0][1] if reply else []
        for entry_id, fields in entries:
            self._cursor = entry_id.decode()
            self._observe(fields.get(PAYLOAD_FIELD.encode()))
        if len(entries) == DONE_READ_COUNT:
            self._next_poll_at_s = now_s  # more are waiting: read on at the next step
        self.num_read += len(entries)
        return len(entries)

    def _observe(self, payload: bytes | None) -> None:
        try:
            if payload is None:
                raise ValidationError("message", f"entry has no '{PAYLOAD_FIELD}' field")
            record = DoneRecord.from_map(unpack_map(payload))
        except (ValidationError, TypeError) as exc:
            # Not ours to dead-letter: the predictor's feedback consumer owns done's garbage.
            log.debug("done_record_unreadable", error=str(exc))
            return
        self.metrics.record_done(record)
        if self.on_record is not None:
            self.on_record(record)
