"""The predictor stream stage against a real Redis: it annotates and forwards a load of
requests in order with a trained `fast` model, dead-letters bad input (garbage bytes,
invalid requests, an `oracle` request without its true length) and keeps serving."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import redis

from blockq.config import Settings
from blockq.text.tokenizer import get_token_counter
from blockq.wire.keys import GROUP_PREDICT, PAYLOAD_FIELD
from blockq.wire.protocol import Request, decode_request, encode
from blockq.wire.streams import connect_async
from predictor_service.models import load_predictor
from predictor_service.models.fast import FastConfig, FastLengthModel
from predictor_service.models.fast_fit import train_fast
from predictor_service.stage import PredictorStage, StageOptions
from tests.factories import make_request
from tests.predictor_synthetic import make_conversations

# A small, quick model: no calibration folds, no text score, one thread.
TINY_FAST_CONFIG = FastConfig(
    num_rounds=40, learning_rate=0.15, min_data_in_leaf=5, spread_num_rounds=20,
    spread_min_data_in_leaf=5, num_calibration_folds=0, num_threads=1, text_score=None,
)  # fmt: skip


def synthetic_prompts(num_prompts: int, seed: int) -> list[tuple[str, int]]:
    """(prompt, true output tokens) pairs whose lengths follow the prompt text."""
    pairs = []
    for record in make_conversations(num_prompts * 2, seed=seed):
        turns = record["conversations"]
        if turns[0]["from"] == "human":
            pairs.append((turns[0]["value"], turns[1]["value"]))
        if len(pairs) == num_prompts:
            break
    output_tokens = get_token_counter().count([answer for _, answer in pairs])
    return [(prompt, max(1, n)) for (prompt, _), n in zip(pairs, output_tokens, strict=True)]


def make_tiny_fast_model(seed: int = 0, num_prompts: int = 300) -> FastLengthModel:
    """A `fast` model trained in about 0.1 s on generated prompts."""
    pairs = synthetic_prompts(num_prompts, seed)
    prompts = [prompt for prompt, _ in pairs]
    return train_fast(prompts, get_token_counter().count(prompts), [1] * len(prompts),
                      [n for _, n in pairs], TINY_FAST_CONFIG, seed=seed)  # fmt: skip


def push(sync_redis: redis.Redis, settings: Settings, payloads: list[bytes]) -> None:
    pipe = sync_redis.pipeline(transaction=False)
    for payload in payloads:
        pipe.xadd(settings.keys.requests, {PAYLOAD_FIELD: payload})
    pipe.execute()


def ready_requests(sync_redis: redis.Redis, settings: Settings) -> list[Request]:
    return [decode_request(fields[PAYLOAD_FIELD.encode()])
            for _, fields in sync_redis.xrange(settings.keys.ready)]  # fmt: skip


def dead_reasons(sync_redis: redis.Redis, settings: Settings) -> list[str]:
    return [fields[b"reason"].decode() for _, fields in sync_redis.xrange(settings.keys.dead_letters)]


async def serve_until(stage: PredictorStage, predicate: Callable[[], bool], timeout_s: float) -> float:
    """Run the stage until ``predicate`` holds (polled); returns the seconds it took."""
    stop = asyncio.Event()
    started_at_s = time.perf_counter()
    task = asyncio.create_task(stage.run(stop))
    try:
        deadline_s = started_at_s + timeout_s
        while not predicate():
            assert time.perf_counter() < deadline_s, "stage did not finish in time"
            assert not task.done(), f"stage stopped: {task.exception() if task.done() else ''}"
            await asyncio.sleep(0.01)
        return time.perf_counter() - started_at_s
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=5)


@pytest.fixture(scope="module")
def tiny_model() -> FastLengthModel:
    return make_tiny_fast_model()


async def test_stage_annotates_and_forwards_a_load_in_order(
    settings: Settings, sync_redis: redis.Redis, tiny_model: FastLengthModel
) -> None:
    pairs = synthetic_prompts(400, seed=7)
    requests = [make_request(pairs[i % len(pairs)][0], max_tokens=(i % 7) * 100 + 50, keys=settings.keys,
                             id=f"load-{i:05d}") for i in range(2000)]  # fmt: skip
    push(sync_redis, settings, [encode(r) for r in requests])
    client = connect_async(settings.redis_url)
    stage = PredictorStage(client, settings, tiny_model, get_token_counter(),
                           options=StageOptions(batch_size=64, block_ms=50))  # fmt: skip
    await serve_until(stage, lambda: sync_redis.xlen(settings.keys.ready) >= 2000, timeout_s=30)
    await client.aclose()

    forwarded = ready_requests(sync_redis, settings)
    assert [r.id for r in forwarded] == [r.id for r in requests]  # one consumer: order kept
    counts = get_token_counter().count([r.prompt for r in requests])  # type: ignore[misc]
    for request, original, prompt_tokens in zip(forwarded, requests, counts, strict=True):
        prediction = request.prediction
        assert prediction is not None and prediction.prompt_tokens == prompt_tokens
        assert prediction.predictor_version == tiny_model.version
        assert 1 <= prediction.p10_tokens <= prediction.predicted_output_tokens <= prediction.p90_tokens
        assert prediction.p90_tokens <= original.max_tokens
        assert request.prompt == original.prompt and request.max_tokens == original.max_tokens
    assert stage.num_annotated == 2000 and stage.num_dead_lettered == 0
    assert sum(size * n for size, n in stage.batch_size_to_num_batches.items()) == 2000
    assert max(stage.batch_size_to_num_batches) <= 64
    assert stage.served_versions == {tiny_model.version}
    # Every entry was ACKed and deleted from `req`.
    assert sync_redis.xlen(settings.keys.requests) == 0
    assert sync_redis.xpending(settings.keys.requests, GROUP_PREDICT)["pending"] == 0


async def test_stage_dead_letters_bad_input_and_keeps_serving(
    settings: Settings, sync_redis: redis.Redis
) -> None:
    good = [make_request(f"question {i}?", keys=settings.keys) for i in range(3)]
    token_ids = make_request((5, 6, 7, 8), keys=settings.keys)
    push(sync_redis, settings, [encode(good[0]), b"\xc1garbage",
                                encode(make_request("x", max_tokens=0, keys=settings.keys)),
                                encode(good[1]), encode(token_ids)])  # fmt: skip
    sync_redis.xadd(settings.keys.requests, {"other": b"no payload field"})
    push(sync_redis, settings, [encode(good[2])])
    client = connect_async(settings.redis_url)
    stage = PredictorStage(client, settings, load_predictor("heuristic"), get_token_counter(),
                           options=StageOptions(batch_size=4, block_ms=50))  # fmt: skip
    await serve_until(stage, lambda: sync_redis.xlen(settings.keys.ready) >= 4, timeout_s=10)
    await client.aclose()

    forwarded = ready_requests(sync_redis, settings)
    assert [r.id for r in forwarded] == [good[0].id, good[1].id, token_ids.id, good[2].id]
    assert forwarded[2].prediction is not None and forwarded[2].prediction.prompt_tokens == 4
    reasons = dead_reasons(sync_redis, settings)
    assert len(reasons) == 3 and stage.num_dead_lettered == 3
    assert "msgpack" in reasons[0] and reasons[1].startswith("max_tokens") and "message" in reasons[2]
    assert sync_redis.xpending(settings.keys.requests, GROUP_PREDICT)["pending"] == 0


async def test_oracle_request_without_true_length_is_dead_lettered_alone(
    settings: Settings, sync_redis: redis.Redis
) -> None:
    with_truth = [make_request(f"q{i}", max_tokens=500, keys=settings.keys, true_output_tokens=40 + i)
                  for i in range(5)]  # fmt: skip
    without = make_request("no truth here", keys=settings.keys)
    later = make_request("later", max_tokens=20, keys=settings.keys, true_output_tokens=99)
    push(sync_redis, settings, [encode(r) for r in (*with_truth[:2], without, *with_truth[2:])])
    client = connect_async(settings.redis_url)
    stage = PredictorStage(client, settings, load_predictor("oracle"), get_token_counter(),
                           options=StageOptions(batch_size=16, block_ms=50))  # fmt: skip
    await serve_until(stage, lambda: sync_redis.xlen(settings.keys.ready) >= 5, timeout_s=10)
    push(sync_redis, settings, [encode(later)])
    await serve_until(stage, lambda: sync_redis.xlen(settings.keys.ready) >= 6, timeout_s=10)
    await client.aclose()

    forwarded = ready_requests(sync_redis, settings)
    assert [r.id for r in forwarded] == [r.id for r in (*with_truth, later)]
    predicted = [r.prediction.predicted_output_tokens for r in forwarded if r.prediction]
    assert predicted == [40, 41, 42, 43, 44, 20]  # the truth, clipped to max_tokens
    (reason,) = dead_reasons(sync_redis, settings)
    assert reason.startswith("prediction failed: true_output_tokens")
