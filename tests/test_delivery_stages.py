"""Delivery guarantees of the stages against a real Redis: own pending entries are handed
out once, retries are bounded (a poison entry is dead-lettered and its client told),
reply streams cannot be spoofed, submits are idempotent, admission bounds the whole
backlog, and a restarted predictor resumes its predecessor's entries at once."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Sequence

import pytest
import redis

from blockq import AsyncClient, Client, Overloaded, SubmitSpec
from blockq.client import _admission_call
from blockq.config import ConfigError, Settings
from blockq.text.tokenizer import get_token_counter
from blockq.wire.keys import GROUP_PREDICT, PAYLOAD_FIELD, Keys
from blockq.wire.protocol import ValidationError, decode_request, encode
from blockq.wire.streams import (
    MAX_REASON_CHARS,
    GroupConsumer,
    StreamEntry,
    connect_async,
    default_consumer_name,
)
from predictor_service.models import LengthPrediction, PredictionInput, load_predictor
from predictor_service.stage import PredictorStage, StageOptions
from tests.factories import make_request
from tests.test_predictor_stage import dead_reasons, push, ready_requests, serve_until


def group_consumer(settings: Settings, name: str = "c1", **options: object) -> GroupConsumer:
    client = connect_async(settings.redis_url)  # type: ignore[arg-type]
    return GroupConsumer(client, settings.keys.requests, GROUP_PREDICT, name,
                         dead_letter_stream=settings.keys.dead_letters, settings=settings,
                         **options)  # type: ignore[arg-type]


def pending_count(sync_redis: redis.Redis, settings: Settings) -> int:
    return int(sync_redis.xpending(settings.keys.requests, GROUP_PREDICT)["pending"])


class FailingOnBoom:
    """The heuristic model, except that a prompt containing "boom" makes it raise."""

    def __init__(self) -> None:
        self.inner = load_predictor("heuristic")
        self.backend = self.inner.backend
        self.version = self.inner.version

    def predict(self, inputs: Sequence[PredictionInput]) -> list[LengthPrediction]:
        if any("boom" in one.prompt for one in inputs):
            raise RuntimeError("model blew up")
        return self.inner.predict(inputs)


# --- own pending entries and bounded retries ------------------------------------------------


async def test_own_pending_entries_are_handed_out_once(settings: Settings, sync_redis: redis.Redis) -> None:
    push(sync_redis, settings, [encode(make_request(f"p{i}", keys=settings.keys)) for i in range(3)])
    first = group_consumer(settings, claim_idle_ms=60_000)
    await first.ensure_group()
    assert len(await first.read(10, 10)) == 3  # then "dies" without ACKing
    await first.client.aclose()

    restarted = group_consumer(settings, claim_idle_ms=60_000)
    batches = [await restarted.read(2, 10) for _ in range(4)]
    assert [len(b) for b in batches] == [2, 1, 0, 0]  # not the running entries again
    assert all(e.num_deliveries == 2 for b in batches for e in b)
    push(sync_redis, settings, [encode(make_request("new", keys=settings.keys))])
    (new,) = await restarted.read(10, 10)
    assert decode_request(new.payload).prompt == "new" and new.num_deliveries == 1  # type: ignore[arg-type]
    await restarted.client.aclose()


async def test_entry_killing_its_consumer_is_dead_lettered_and_client_told(settings: Settings,
                                                                           sync_redis: redis.Redis) -> None:
    settings = dataclasses.replace(settings, max_deliveries=3)
    with Client(settings=settings) as client:
        handle = client.submit("poison", max_tokens=4)

        def process(entries: list[StreamEntry]) -> None:
            raise RuntimeError("stage crashed")

        num_runs = 0
        for _ in range(10):  # every run processes, crashes, and is restarted under its name
            consumer = group_consumer(settings, claim_idle_ms=60_000)
            await consumer.ensure_group()
            entries = await consumer.read(10, 10)
            await consumer.client.aclose()
            if not entries:
                break
            num_runs += 1
            with pytest.raises(RuntimeError):
                process(entries)
        assert num_runs == 3
        (reason,) = dead_reasons(sync_redis, settings)
        assert reason == "delivered 4 times without being processed"
        final = handle.result(timeout_s=5)
    assert (final.status, final.finish_reason, final.error) == ("error", "error", reason)
    assert final.request_id == handle.id
    assert sync_redis.xlen(settings.keys.requests) == 0 and pending_count(sync_redis, settings) == 0


async def test_entry_failed_without_ack_is_reclaimed_then_dead_lettered(settings: Settings,
                                                                        sync_redis: redis.Redis) -> None:
    settings = dataclasses.replace(settings, max_deliveries=2)
    push(sync_redis, settings, [encode(make_request("fails", keys=settings.keys))])
    consumer = group_consumer(settings, claim_idle_ms=30)
    await consumer.ensure_group()
    deliveries = []
    for _ in range(100):  # a live consumer that catches its failure and does not ACK
        deliveries += [e.num_deliveries for e in await consumer.read(10, 10)]
        if dead_reasons(sync_redis, settings):
            break
        await asyncio.sleep(0.01)
    await consumer.client.aclose()
    assert deliveries == [1, 2]
    assert dead_reasons(sync_redis, settings) == ["delivered 3 times without being processed"]


async def test_held_entries_are_not_claimed_back(settings: Settings, sync_redis: redis.Redis) -> None:
    push(sync_redis, settings, [encode(make_request("held", keys=settings.keys))])
    consumer = group_consumer(settings, claim_idle_ms=30)
    await consumer.ensure_group()
    (held,) = await consumer.read(10, 10)
    for _ in range(5):
        await asyncio.sleep(0.04)
        assert await consumer.read(10, 10, held_ids={held.entry_id}) == []
    (pending,) = sync_redis.xpending_range(settings.keys.requests, GROUP_PREDICT, "-", "+", 10)
    assert pending["times_delivered"] == 1
    assert [e.entry_id for e in await consumer.read(10, 10)] == [held.entry_id]  # released: claimed
    await consumer.client.aclose()


async def test_dead_letter_reason_is_bounded(settings: Settings, sync_redis: redis.Redis) -> None:
    with Client(settings=settings) as client:
        handle = client.submit("x", max_tokens=4)
        consumer = group_consumer(settings)
        await consumer.ensure_group()
        (entry,) = await consumer.read(10, 10)
        pipe = consumer.client.pipeline(transaction=False)
        consumer.dead_letter(pipe, entry, "bad input: " + "y" * 10_000)
        await pipe.execute()
        await consumer.client.aclose()
        final = handle.result(timeout_s=5)
    (reason,) = dead_reasons(sync_redis, settings)
    assert reason.startswith("bad input: yyy") and len(reason) == MAX_REASON_CHARS
    assert final.error == reason


# --- input validation: reply streams ----------------------------------------------------


def test_spoofed_reply_stream_is_rejected_naming_the_field() -> None:
    keys = Keys("bq:")
    victim = make_request("victim", keys=keys)
    for stream in (keys.reply(victim.id), keys.instances, "elsewhere"):
        spoof = dataclasses.replace(make_request("spoof", keys=keys), reply_stream=stream)
        assert decode_request(encode(spoof)).reply_stream == stream  # without keys: not checked
        with pytest.raises(ValidationError) as caught:
            decode_request(encode(spoof), keys=keys)
        assert caught.value.field == "reply_stream" and keys.reply(spoof.id) in str(caught.value)
    assert decode_request(encode(victim), keys=keys) == victim


async def test_predictor_stage_dead_letters_spoofed_reply_streams_untouched(settings: Settings,
                                                                           sync_redis: redis.Redis) -> None:
    keys = settings.keys
    victim = make_request("victim", keys=keys)
    sync_redis.hset(keys.instances, "i0", b"beat")
    spoofs = [dataclasses.replace(make_request(f"spoof {i}", keys=keys), reply_stream=stream)
              for i, stream in enumerate((keys.reply(victim.id), keys.instances))]
    good = make_request("good", keys=keys)
    push(sync_redis, settings, [*(encode(s) for s in spoofs), encode(good)])
    client = connect_async(settings.redis_url)  # type: ignore[arg-type]
    stage = PredictorStage(client, settings, load_predictor("heuristic"), get_token_counter(),
                           consumer_name="p1", options=StageOptions(block_ms=20))
    await serve_until(stage, lambda: sync_redis.xlen(keys.ready) >= 1, timeout_s=10)
    await client.aclose()
    assert [r.id for r in ready_requests(sync_redis, settings)] == [good.id]
    reasons = dead_reasons(sync_redis, settings)
    assert len(reasons) == 2 and all(r.startswith("reply_stream: must be") for r in reasons)
    assert not sync_redis.exists(keys.reply(victim.id))  # nothing, not even an error, written there
    assert sync_redis.hgetall(keys.instances) == {b"i0": b"beat"}


async def test_predictor_stage_dead_letters_model_faults_and_tells_clients(settings: Settings,
                                                                           sync_redis: redis.Redis) -> None:
    with Client(settings=settings) as client:
        boom = client.submit("boom now", max_tokens=8)
        fine = client.submit("fine", max_tokens=8)
        redis_client = connect_async(settings.redis_url)  # type: ignore[arg-type]
        stage = PredictorStage(redis_client, settings, FailingOnBoom(), get_token_counter(),  # type: ignore[arg-type]
                               consumer_name="p1", options=StageOptions(block_ms=20))
        await serve_until(stage, lambda: sync_redis.xlen(settings.keys.ready) >= 1, timeout_s=10)
        await redis_client.aclose()
        final = boom.result(timeout_s=5)
    assert [r.id for r in ready_requests(sync_redis, settings)] == [fine.id]
    assert (final.status, final.error) == ("error", "prediction failed: RuntimeError: model blew up")
    assert stage.num_dead_lettered == 1 and pending_count(sync_redis, settings) == 0


# --- admission: idempotent, bounded by the whole backlog ------------------------------------


def test_submit_retried_with_the_same_id_enqueues_once(settings: Settings, sync_redis: redis.Redis) -> None:
    with Client(settings=dataclasses.replace(settings, max_ingress_backlog=2)) as client:
        first = client.submit("once", max_tokens=4, request_id="r-1")
        again = client.submit("once", max_tokens=4, request_id="r-1")
        assert again.id == first.id and again.request.reply_stream == first.request.reply_stream
        client.submit_many([SubmitSpec(prompt="twin", request_id="r-2")] * 2)
        # Backlog full (2): a retry of an accepted request is still answered, a new one is not.
        client.submit("once", max_tokens=4, request_id="r-1")
        with pytest.raises(Overloaded):
            client.submit("new", max_tokens=4, request_id="r-3")
        # A lost reply: redis-py runs the same script call again and gets the same entry id.
        requests = [first.request]
        script_keys, args = _admission_call(requests, client.settings)
        ids = {client._admit(keys=script_keys, args=args)[0] for _ in range(2)}
    stored = [(entry_id.decode(), decode_request(f[PAYLOAD_FIELD.encode()]).id)
              for entry_id, f in sync_redis.xrange(settings.keys.requests)]
    assert [request_id for _, request_id in stored] == ["r-1", "r-2"]
    assert ids == {stored[0][0].encode()}
    assert 0 < sync_redis.ttl(settings.keys.submitted("r-1")) <= settings.reply_ttl_s


async def test_async_submit_retried_with_the_same_id_enqueues_once(settings: Settings,
                                                                    sync_redis: redis.Redis) -> None:
    async with AsyncClient(settings=settings) as client:
        for _ in range(3):
            await client.submit("once", max_tokens=4, request_id="a-1")
    assert sync_redis.xlen(settings.keys.requests) == 1


def test_overloaded_when_instance_queues_are_full(settings: Settings, sync_redis: redis.Redis) -> None:
    keys = settings.keys
    for instance_id, num_queued in (("i0", 5), ("i1", 3)):
        sync_redis.hset(keys.instances, instance_id, b"beat")
        for _ in range(num_queued):
            sync_redis.xadd(keys.instance_queue(instance_id), {PAYLOAD_FIELD: b"x"})
    sync_redis.xadd(keys.ready, {PAYLOAD_FIELD: b"x"})  # e.g. held by the dispatcher, pending
    with Client(settings=dataclasses.replace(settings, max_ingress_backlog=10)) as client:
        client.submit("fits", max_tokens=4)  # 9 waiting + 1
        # The request went on to an instance: `req` is empty, the backlog is not smaller.
        sync_redis.delete(keys.requests)
        sync_redis.xadd(keys.instance_queue("i1"), {PAYLOAD_FIELD: b"x"})
        assert sync_redis.xlen(keys.requests) == 0
        with pytest.raises(Overloaded) as caught:
            client.submit("one too many", max_tokens=4)
        assert (caught.value.backlog, caught.value.limit) == (10, 10)
        sync_redis.delete(keys.instance_queue("i0"))  # i0 finished its work
        client.submit("fits again", max_tokens=4)
    assert sync_redis.xlen(keys.requests) == 1


# --- restarts: a stable consumer name ------------------------------------------------------


def test_default_consumer_name_is_stable_and_overridable() -> None:
    assert default_consumer_name("predict", env={}) == default_consumer_name("predict", env={})
    assert default_consumer_name("predict", env={}).startswith("predict-")
    assert str(os.getpid()) not in default_consumer_name("predict", env={}).split("-")
    assert default_consumer_name("predict", env={"BLOCKQ_CONSUMER_NAME": "p-7"}) == "p-7"


async def test_restarted_predictor_stage_resumes_pending_entries_at_once(settings: Settings,
                                                                         sync_redis: redis.Redis) -> None:
    settings = dataclasses.replace(settings, claim_idle_ms=60_000)  # a claim would take a minute
    requests = [make_request(f"question {i}?", keys=settings.keys) for i in range(5)]
    push(sync_redis, settings, [encode(r) for r in requests])
    died = group_consumer(settings, name=default_consumer_name("predict", env={}))
    await died.ensure_group()
    assert len(await died.read(10, 10)) == 5  # read, then the process died
    await died.client.aclose()

    client = connect_async(settings.redis_url)  # type: ignore[arg-type]
    stage = PredictorStage(client, settings, load_predictor("heuristic"), get_token_counter(),
                           consumer_name=default_consumer_name("predict", env={}),
                           options=StageOptions(block_ms=20))
    took_s = await serve_until(stage, lambda: sync_redis.xlen(settings.keys.ready) >= 5, timeout_s=10)
    await client.aclose()
    assert took_s < 5
    assert [r.id for r in ready_requests(sync_redis, settings)] == [r.id for r in requests]
    assert pending_count(sync_redis, settings) == 0


# --- settings and keys ------------------------------------------------------------------


def test_max_deliveries_setting_and_submitted_key() -> None:
    assert Settings().max_deliveries == 5
    assert Settings.from_env({"BLOCKQ_MAX_DELIVERIES": "7"}).max_deliveries == 7
    with pytest.raises(ConfigError, match="max_deliveries"):
        Settings.from_env({"BLOCKQ_MAX_DELIVERIES": "0"})
    assert Keys("bq:").submitted("r1") == "bq:submitted:{r1}"
