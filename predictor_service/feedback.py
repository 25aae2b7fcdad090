"""Online prediction quality from the ``done`` stream (the I/O shell of :mod:`.quality`).

:class:`FeedbackConsumer` reads the ``done`` stream through the ``feedback`` consumer
group in batches, feeds each finished request's predicted and true output tokens to a
:class:`~predictor_service.quality.QualityMonitor` (rolling MAE / Acc-50 / Acc-100 over
the last ``window_size`` records, prompt-length drift), logs every alert as a
structured ``predictor_alert`` warning, and keeps the counts that ``GET /metrics``
exports.

Which records count: status ``ok`` (a cancelled or failed request's length is not its
natural length), a prediction present, ``output_tokens >= 1``, and a
``predictor_version`` this process served (the stage's ``served_versions``, which grows
with every online refit). ``count_all_versions`` counts every predictor's records
instead, e.g. to watch a fleet of replicas from one process. Other records are skipped
(counted by reason); undecodable entries are dead-lettered.

Every read entry is ACKed (XACK) after it is processed, but not deleted: unlike the
work streams, ``done`` is a capped record of finished requests that other readers may
scan, so its length is not a backlog. With several predictor replicas in one group,
each replica sees a share of the records.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog

from blockq.config import Settings
from blockq.wire.keys import GROUP_FEEDBACK, PAYLOAD_FIELD
from blockq.wire.protocol import DoneRecord, ValidationError, decode_done_record
from blockq.wire.streams import GroupConsumer, StreamEntry
from predictor_service.manifest import read_manifest
from predictor_service.quality import QualityAlert, QualityMonitor, QualitySnapshot

log = structlog.get_logger(__name__)

# Reasons a done record is not counted (label values of the skip counter).
SKIP_STATUS = "status"
SKIP_VERSION = "version"
SKIP_NO_PREDICTION = "no_prediction"
SKIP_NO_OUTPUT = "no_output"


@dataclass(frozen=True)
class FeedbackOptions:
    """Settings of the feedback consumer.

    ``window_size``: rolling window (records); ``min_samples``: records in the window
    before alerts may fire; ``acc50_drop_points``: percentage points below the
    validation Acc-50 that raise ``accuracy_drop``; ``psi_threshold``: prompt-length PSI
    that raises ``prompt_drift``; ``batch_size``/``block_ms``: stream reads (entries,
    milliseconds); ``count_all_versions``: count records of any predictor version.
    """

    window_size: int = 1000
    min_samples: int = 100
    acc50_drop_points: float = 15.0
    psi_threshold: float = 0.25
    batch_size: int = 256
    block_ms: int = 500
    count_all_versions: bool = False

    def __post_init__(self) -> None:
        for name in ("window_size", "min_samples", "batch_size", "block_ms"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1 (got {getattr(self, name)})")
        if not 0.0 <= self.acc50_drop_points <= 100.0:
            raise ValueError(f"acc50_drop_points: must be in [0, 100] (got {self.acc50_drop_points})")
        if self.psi_threshold <= 0.0:
            raise ValueError(f"psi_threshold: must be > 0 (got {self.psi_threshold})")


def build_quality_monitor(
    model_dir: str | None, model_version: str, options: FeedbackOptions
) -> QualityMonitor:
    """A monitor for the model in ``model_dir`` (its manifest's validation Acc-50 and
    prompt-length bins); without a manifest (``heuristic``, ``oracle``, ``trace``) the
    validation Acc-50 is 0, so ``accuracy_drop`` never fires, and there is no drift
    statistic."""
    settings: dict[str, float | int] = {
        "window_size": options.window_size,
        "min_samples": options.min_samples,
        "acc50_drop_points": options.acc50_drop_points,
        "psi_threshold": options.psi_threshold,
    }
    if model_dir is not None:
        try:
            return QualityMonitor.from_manifest(read_manifest(model_dir), **settings)
        except FileNotFoundError:
            log.warning("predictor_manifest_missing", model_dir=model_dir)
    return QualityMonitor(validation_acc50=0.0, model_version=model_version, **settings)  # type: ignore[arg-type]


class FeedbackConsumer:
    """Consumes ``done`` and keeps the rolling quality of the served predictor.

    ``served_versions`` is read live (the stage adds each version it stamps), so records
    of a version swapped in later count too. ``on_counted`` (optional) is called with
    each counted record, after the monitor saw it: the online refit joins it with the
    request's prompt there.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        settings: Settings,
        monitor: QualityMonitor,
        *,
        served_versions: Collection[str],
        consumer_name: str,
        options: FeedbackOptions | None = None,
        on_counted: Callable[[DoneRecord], None] | None = None,
    ) -> None:
        self.client = client
        self.monitor = monitor
        self.served_versions = served_versions
        self.options = options or FeedbackOptions()
        self.on_counted = on_counted
        self.consumer = GroupConsumer(
            client, settings.keys.done, GROUP_FEEDBACK, consumer_name,
            dead_letter_stream=settings.keys.dead_letters, claim_idle_ms=settings.claim_idle_ms,
            settings=settings,
        )  # fmt: skip
        self.num_counted = 0
        self.num_dead_lettered = 0
        self.skip_reason_to_num_records: Counter[str] = Counter()
        self.alert_kind_to_num_alerts: Counter[str] = Counter()
        self.last_alerts: list[QualityAlert] = []

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set."""
        await self.consumer.ensure_group()
        log.info("feedback_consumer_started", stream=self.consumer.stream,
                 count_all_versions=self.options.count_all_versions)  # fmt: skip
        while not stop.is_set():
            entries = await self.consumer.read(self.options.batch_size, self.options.block_ms)
            if entries:
                await self.process(entries)

    async def process(self, entries: Sequence[StreamEntry]) -> int:
        """Ingest one batch, then ACK it (and dead-letter what cannot be decoded) in one
        pipeline; returns the number of records counted."""
        pipe = self.client.pipeline(transaction=False)
        num_counted = 0
        processed_ids = []
        for entry in entries:
            try:
                if entry.payload is None:
                    raise ValidationError("message", f"entry has no '{PAYLOAD_FIELD}' field")
                record = decode_done_record(entry.payload)
            except (ValidationError, TypeError) as exc:
                self.consumer.dead_letter(pipe, entry, f"invalid done record: {exc}")
                self.num_dead_lettered += 1
                continue
            num_counted += self.ingest(record)
            processed_ids.append(entry.entry_id)
        if processed_ids:
            pipe.xack(self.consumer.stream, self.consumer.group, *processed_ids)
        await pipe.execute()
        return num_counted

    def ingest(self, record: DoneRecord) -> bool:
        """Feed one record to the monitor when it counts (see the module docstring);
        logs the alerts it raises. Returns whether it counted."""
        reason = self._skip_reason(record)
        predicted = record.predicted_output_tokens
        if reason is not None or predicted is None:
            self.skip_reason_to_num_records[reason or SKIP_NO_PREDICTION] += 1
            return False
        alerts = self.monitor.ingest(predicted, record.output_tokens, record.prompt_tokens)
        self.num_counted += 1
        for alert in alerts:
            self.alert_kind_to_num_alerts[alert.kind] += 1
            log.warning(
                "predictor_alert", kind=alert.kind, value=alert.value, threshold=alert.threshold,
                num_samples=alert.num_samples, model_version=alert.model_version,
                served_version=record.predictor_version, message=alert.message,
            )  # fmt: skip
        if alerts:
            self.last_alerts = alerts
        if self.on_counted is not None:
            self.on_counted(record)
        return True

    def _skip_reason(self, record: DoneRecord) -> str | None:
        if record.status != "ok":
            return SKIP_STATUS
        if record.predicted_output_tokens is None:
            return SKIP_NO_PREDICTION
        if not isinstance(record.output_tokens, int) or record.output_tokens < 1:
            return SKIP_NO_OUTPUT
        if not self.options.count_all_versions and record.predictor_version not in self.served_versions:
            return SKIP_VERSION
        return None

    def snapshot(self) -> QualitySnapshot:
        """The monitor's current rolling figures (NaN while nothing counted)."""
        return self.monitor.snapshot()
