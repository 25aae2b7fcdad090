"""Feedback from the `done` stream against a real Redis: rolling figures, which records
count, ACK without delete, the accuracy alert; online refit swapping model versions
while requests keep flowing through the stage (none dropped, none annotated twice)."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
import structlog

from blockq.config import Settings
from blockq.runtime.metrics_server import render_text
from blockq.text.tokenizer import get_token_counter
from blockq.wire.keys import GROUP_FEEDBACK, PAYLOAD_FIELD
from blockq.wire.protocol import DoneRecord, Request, decode_request, encode
from blockq.wire.streams import connect_async
from predictor_service.feedback import (
    SKIP_NO_PREDICTION,
    SKIP_STATUS,
    SKIP_VERSION,
    FeedbackConsumer,
    FeedbackOptions,
)
from predictor_service.http_api import PredictorHttpApi
from predictor_service.manifest import Manifest
from predictor_service.models import PredictionInput, load_predictor
from predictor_service.models.fast import FastLengthModel
from predictor_service.online import OnlineRefitOptions, OnlineRefitter
from predictor_service.quality import ACCURACY_DROP, QualityMonitor
from predictor_service.stage import PredictorStage, StageOptions
from tests.factories import make_request
from tests.test_predictor_stage import make_tiny_fast_model, synthetic_prompts

_ids = itertools.count()


def done_record(predicted: int | None, true: int, version: str | None, *, status: str = "ok",
                request_id: str | None = None, prompt_tokens: int = 20) -> DoneRecord:  # fmt: skip
    return DoneRecord(
        request_id=request_id or f"r{next(_ids)}", instance="i0", status=status,
        prompt_tokens=prompt_tokens, output_tokens=true, predicted_output_tokens=predicted,
        predictor_version=version, policy="round_robin", submitted_at_s=0.0, finished_at_s=1.0,
        queue_wait_ms=None, ttft_ms=None, tpot_ms=None, e2e_ms=None, predicted_ttft_ms=None,
        predicted_e2e_ms=None, num_preemptions=0,
    )  # fmt: skip


def push_done(sync_redis: redis.Redis, settings: Settings, records: list[DoneRecord | bytes]) -> None:
    pipe = sync_redis.pipeline(transaction=False)
    for record in records:
        payload = record if isinstance(record, bytes) else encode(record)
        pipe.xadd(settings.keys.done, {PAYLOAD_FIELD: payload})
    pipe.execute()


async def consume_until(feedback: FeedbackConsumer, num_counted: int, timeout_s: float = 10) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(feedback.run(stop))
    deadline_s = time.monotonic() + timeout_s
    try:
        while feedback.num_counted < num_counted:
            assert time.monotonic() < deadline_s and not task.done(), "feedback did not catch up"
            await asyncio.sleep(0.01)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=5)


def make_feedback(client: aioredis.Redis, settings: Settings, served: set[str],
                  **monitor_settings: int) -> FeedbackConsumer:  # fmt: skip
    monitor = QualityMonitor(validation_acc50=0.8, model_version="v1", **monitor_settings)
    return FeedbackConsumer(client, settings, monitor, served_versions=served, consumer_name="fb-test",
                            options=FeedbackOptions(block_ms=20))  # fmt: skip


async def test_feedback_updates_rolling_figures_from_done_records(
    settings: Settings, sync_redis: redis.Redis
) -> None:
    counted = [done_record(100, true, "v1") for true in (100, 130, 160, 250)]  # errors 0/30/60/150
    skipped = [done_record(100, 100, "other-version"), done_record(100, 3, "v1", status="cancelled"),
               done_record(None, 100, None)]  # fmt: skip
    push_done(sync_redis, settings, [counted[0], *skipped, b"\xc1garbage", *counted[1:]])
    client = connect_async(settings.redis_url)
    feedback = make_feedback(client, settings, {"v1"})
    await consume_until(feedback, 4)
    await client.aclose()

    snapshot = feedback.snapshot()
    assert snapshot.num_samples == 4
    assert snapshot.rolling_mae == pytest.approx((0 + 30 + 60 + 150) / 4)
    assert (snapshot.rolling_acc50, snapshot.rolling_acc100) == (0.5, 0.75)
    assert feedback.skip_reason_to_num_records == {SKIP_VERSION: 1, SKIP_STATUS: 1, SKIP_NO_PREDICTION: 1}
    assert feedback.num_dead_lettered == 1
    # Everything was ACKed; done records stay on the stream (only the garbage was removed).
    assert sync_redis.xpending(settings.keys.done, GROUP_FEEDBACK)["pending"] == 0
    assert sync_redis.xlen(settings.keys.done) == 7


async def test_accuracy_alert_fires_when_predictions_are_bad(
    settings: Settings, sync_redis: redis.Redis
) -> None:
    good = [done_record(100, 100 + i % 40, "v1") for i in range(30)]
    bad = [done_record(100, 600, "v1") for _ in range(40)]
    push_done(sync_redis, settings, good)
    client = connect_async(settings.redis_url)
    feedback = make_feedback(client, settings, {"v1"}, window_size=40, min_samples=20)
    await consume_until(feedback, 30)
    assert feedback.alert_kind_to_num_alerts[ACCURACY_DROP] == 0
    push_done(sync_redis, settings, bad)
    with structlog.testing.capture_logs() as logs:
        await consume_until(feedback, 70)
    await client.aclose()

    alerts = [entry for entry in logs if entry["event"] == "predictor_alert"]
    assert len(alerts) == 1 and alerts[0]["log_level"] == "warning"
    assert alerts[0]["kind"] == ACCURACY_DROP and alerts[0]["threshold"] == pytest.approx(0.65)
    assert alerts[0]["value"] < 0.65 and alerts[0]["served_version"] == "v1"
    assert feedback.alert_kind_to_num_alerts[ACCURACY_DROP] == 1
    stage = PredictorStage(client, settings, load_predictor("heuristic"), get_token_counter())
    text = render_text(PredictorHttpApi(stage, get_token_counter(), stage=stage, feedback=feedback).registry)
    assert 'blockq_predictor_alerts_total{kind="accuracy_drop"} 1' in text
    assert "blockq_predictor_rolling_acc50_ratio 0" in text


# --- online refit -----------------------------------------------------------------------


async def answer_ready(client: aioredis.Redis, settings: Settings, request_id_to_true: dict[str, int],
                       stop: asyncio.Event) -> None:  # fmt: skip
    """A stand-in for dispatcher + workers: every annotated request finishes at once,
    with its true length, on `done`."""
    last_id = "0-0"
    while not stop.is_set():
        reply = await client.xread({settings.keys.ready: last_id}, count=200, block=20)
        if not reply:
            continue
        pipe = client.pipeline(transaction=False)
        for entry_id, fields in reply[0][1]:
            last_id = entry_id
            request = decode_request(fields[PAYLOAD_FIELD.encode()])
            assert request.prediction is not None
            record = done_record(request.prediction.predicted_output_tokens, request_id_to_true[request.id],
                                 request.prediction.predictor_version, request_id=request.id)  # fmt: skip
            pipe.xadd(settings.keys.done, {PAYLOAD_FIELD: encode(record)})
        await pipe.execute()


async def produce(client: aioredis.Redis, settings: Settings, requests: list[Request]) -> None:
    for start in range(0, len(requests), 20):
        pipe = client.pipeline(transaction=False)
        for request in requests[start : start + 20]:
            pipe.xadd(settings.keys.requests, {PAYLOAD_FIELD: encode(request)})
        await pipe.execute()
        await asyncio.sleep(0.01)


async def test_online_refit_swaps_versions_without_dropping_requests(
    settings: Settings, sync_redis: redis.Redis, tmp_path: Path
) -> None:
    base = make_tiny_fast_model()
    pairs = synthetic_prompts(400, seed=3)
    requests = [make_request(pairs[i % 400][0], max_tokens=4096, keys=settings.keys, id=f"q{i:05d}")
                for i in range(1200)]  # fmt: skip
    # Served answers run three times longer than in training: feedback should pull predictions up.
    request_id_to_true = {r.id: 3 * pairs[i % 400][1] for i, r in enumerate(requests)}
    client = connect_async(settings.redis_url)
    stage = PredictorStage(client, settings, base, get_token_counter(),
                           options=StageOptions(batch_size=16, block_ms=20))  # fmt: skip
    manifest = Manifest(backend="fast", version=base.version, tokenizer_name="test", data_sha256="0" * 64,
                        training_max_tokens=base.training_max_tokens, baseline_median_tokens=100.0,
                        num_train_examples=300, num_val_examples=0, seed=0, created_at_s=0.0)  # fmt: skip
    refit_options = OnlineRefitOptions(refit_every_samples=300, min_samples=100, num_rounds=10,
                                       poll_interval_s=0.02, save_dir=str(tmp_path))  # fmt: skip
    refitter = OnlineRefitter(stage, refit_options, base_manifest=manifest)
    stage.on_annotated = refitter.remember
    feedback = FeedbackConsumer(
        client, settings, QualityMonitor(validation_acc50=0.5), served_versions=stage.served_versions,
        consumer_name="fb-test", options=FeedbackOptions(block_ms=20), on_counted=refitter.observe_done,
    )  # fmt: skip
    stop = asyncio.Event()
    tasks = [asyncio.create_task(coroutine) for coroutine in (
        stage.run(stop), feedback.run(stop), refitter.run(stop),
        answer_ready(client, settings, request_id_to_true, stop))]  # fmt: skip
    try:
        await asyncio.wait_for(produce(client, settings, requests), timeout=30)
        deadline_s = time.monotonic() + 20
        while sync_redis.xlen(settings.keys.ready) < len(requests) or feedback.num_counted < len(requests):
            assert time.monotonic() < deadline_s and not any(t.done() for t in tasks), "pipeline stalled"
            await asyncio.sleep(0.02)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)

    ready = [decode_request(f[PAYLOAD_FIELD.encode()]) for _, f in sync_redis.xrange(settings.keys.ready)]
    assert sorted(r.id for r in ready) == sorted(r.id for r in requests)  # each exactly once
    versions = [r.prediction.predictor_version for r in ready if r.prediction]
    runs = [version for version, _ in itertools.groupby(versions)]
    assert runs[0] == base.version and len(runs) == len(set(runs)) >= 2  # old, then new, no mixing
    assert refitter.num_refits >= len(runs) - 1 and refitter.num_failed_refits == 0
    assert set(runs) <= stage.served_versions
    new_model = stage.predictor
    assert isinstance(new_model, FastLengthModel) and new_model.parent_version == base.version
    probe = [PredictionInput(prompt, n, 4096) for (prompt, _), n in
             zip(pairs[:50], get_token_counter().count([p for p, _ in pairs[:50]]), strict=True)]  # fmt: skip
    mean = [sum(p.predicted_output_tokens for p in m.predict(probe)) / 50 for m in (base, new_model)]
    assert mean[1] > mean[0]
    # Each new model was written; the previous one is kept for one rollback.
    assert load_predictor("fast", str(tmp_path / new_model.version)).version == new_model.version
    previous = refitter.previous_model
    assert previous is not None and refitter.rollback() and stage.predictor is previous
    assert not refitter.rollback() and refitter.num_rollbacks == 1
    await client.aclose()
