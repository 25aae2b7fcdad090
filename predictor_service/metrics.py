"""The predictor's Prometheus metrics, ``blockq_predictor_*``: a collector that reads the
serving objects' own counts at scrape time (the stage, the HTTP API, the feedback
consumer, the online refit), so that they keep one set of counters each.

Metrics: model info (value 1, labels ``backend``, ``version``); predictions and batch
sizes (requests per model call) by ``source`` (``http``/``stage``); HTTP ``/predict``
responses by ``code``; stream entries the stage dead-lettered; with the feedback
consumer, the rolling figures (samples in the window, MAE in tokens, Acc-50/Acc-100 as
fractions, validation Acc-50, prompt-length PSI; NaN while a figure has no data), alerts
by ``kind`` and done records by ``outcome``; with the online refit, refits by ``outcome``,
rollbacks, feedback samples held and requests awaiting their done record.

Served on the HTTP API's ``/metrics`` (:mod:`.http_api`) and on ``--metrics-port``
(:func:`predictor_service.serve.serve_predictor`), one registry for both.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from predictor_service.online import PredictorSlot

if TYPE_CHECKING:
    from predictor_service.feedback import FeedbackConsumer
    from predictor_service.http_api import HttpApiStats
    from predictor_service.online import OnlineRefitter
    from predictor_service.stage import PredictorStage

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=value)


def _batch_size_buckets(size_to_count: Counter[int]) -> list[tuple[str, float]]:
    return [("+Inf" if math.isinf(bound) else str(bound), sum(n for size, n in size_to_count.items() if size <= bound))
            for bound in (*BATCH_SIZE_BUCKETS, math.inf)]


class PredictorCollector(Collector):
    """Every ``blockq_predictor_*`` metric of one predictor process (see the module
    docstring). ``slot.predictor`` is the serving model; each other source is optional
    (None: its metrics are left out)."""

    def __init__(self, slot: PredictorSlot, *, http_stats: HttpApiStats | None = None,
                 stage: PredictorStage | None = None, feedback: FeedbackConsumer | None = None,
                 refitter: OnlineRefitter | None = None) -> None:
        self.slot = slot
        self.http_stats = http_stats
        self.stage = stage
        self.feedback = feedback
        self.refitter = refitter

    def collect(self) -> Iterator[Metric]:
        predictor = self.slot.predictor
        info = GaugeMetricFamily("blockq_predictor_model_info", "Serving model (value 1).",
                                 labels=["backend", "version"])
        info.add_metric([predictor.backend, predictor.version], 1)
        yield info
        yield from self._served()
        if self.feedback is not None:
            yield from self._feedback(self.feedback)
        if self.refitter is not None:
            yield from self._refit(self.refitter)

    def _served(self) -> Iterator[Metric]:
        predictions = CounterMetricFamily("blockq_predictor_predictions", "Predictions served.", labels=["source"])
        batches = HistogramMetricFamily("blockq_predictor_batch_size", "Requests per model call.", labels=["source"])
        sources: list[tuple[str, int, Counter[int]]] = []
        if self.http_stats is not None:
            sources.append(("http", self.http_stats.num_predictions, self.http_stats.batch_size_to_num_batches))
        if self.stage is not None:
            sources.append(("stage", self.stage.num_annotated, self.stage.batch_size_to_num_batches))
        for source, num_predictions, size_to_count in sources:
            predictions.add_metric([source], num_predictions)
            batches.add_metric([source], _batch_size_buckets(size_to_count),
                               sum(size * n for size, n in size_to_count.items()))
        yield predictions
        yield batches
        if self.http_stats is not None:
            responses = CounterMetricFamily("blockq_predictor_http_responses", "HTTP /predict responses by status.",
                                            labels=["code"])
            for code, count in sorted(self.http_stats.status_to_num_responses.items()):
                responses.add_metric([str(code)], count)
            yield responses
        if self.stage is not None:
            yield CounterMetricFamily("blockq_predictor_dead_letters", "Stream entries dead-lettered by the stage.",
                                      value=self.stage.num_dead_lettered)

    @staticmethod
    def _feedback(feedback: FeedbackConsumer) -> Iterator[Metric]:
        from predictor_service.quality import ACCURACY_DROP, PROMPT_DRIFT

        snapshot = feedback.snapshot()
        yield _gauge("blockq_predictor_rolling_samples", "Done records in the rolling window.", snapshot.num_samples)
        yield _gauge("blockq_predictor_rolling_mae_tokens", "Rolling mean absolute error, tokens.",
                     float(snapshot.rolling_mae))
        yield _gauge("blockq_predictor_rolling_acc50_ratio", "Rolling share within 50 tokens.",
                     float(snapshot.rolling_acc50))
        yield _gauge("blockq_predictor_rolling_acc100_ratio", "Rolling share within 100 tokens.",
                     float(snapshot.rolling_acc100))
        yield _gauge("blockq_predictor_validation_acc50_ratio", "Validation Acc-50 of the model.",
                     float(snapshot.validation_acc50))
        yield _gauge("blockq_predictor_prompt_drift_psi", "Prompt-length PSI against training.",
                     float(snapshot.prompt_psi))
        alerts = CounterMetricFamily("blockq_predictor_alerts", "Quality alerts raised, by kind.", labels=["kind"])
        for kind in (ACCURACY_DROP, PROMPT_DRIFT):
            alerts.add_metric([kind], feedback.alert_kind_to_num_alerts[kind])
        yield alerts
        records = CounterMetricFamily("blockq_predictor_feedback_records", "Done records read, by outcome.",
                                      labels=["outcome"])
        records.add_metric(["counted"], feedback.num_counted)
        for reason, count in sorted(feedback.skip_reason_to_num_records.items()):
            records.add_metric([f"skipped_{reason}"], count)
        records.add_metric(["dead_lettered"], feedback.num_dead_lettered)
        yield records

    @staticmethod
    def _refit(refitter: OnlineRefitter) -> Iterator[Metric]:
        refits = CounterMetricFamily("blockq_predictor_refits", "Online refits, by outcome.", labels=["outcome"])
        refits.add_metric(["ok"], refitter.num_refits)
        refits.add_metric(["failed"], refitter.num_failed_refits)
        yield refits
        yield CounterMetricFamily("blockq_predictor_rollbacks", "Model rollbacks.", value=refitter.num_rollbacks)
        yield _gauge("blockq_predictor_feedback_samples", "Feedback samples held for refit.", len(refitter.samples))
        yield _gauge("blockq_predictor_tracked_requests", "Annotated requests awaiting their done record.",
                     len(refitter.cache))


def predictor_registry(slot: PredictorSlot, **sources: object) -> CollectorRegistry:
    """A registry of its own holding one :class:`PredictorCollector` (``sources``: its
    keyword arguments)."""
    registry = CollectorRegistry()
    registry.register(PredictorCollector(slot, **sources))  # type: ignore[arg-type]
    return registry
