"""Consumer-group upkeep against a real Redis: dead letters bounded in bytes and count,
idle consumers deleted (never one with pending entries), a group Redis lost recreated,
and own pending entries read again after an outage without counting as failed deliveries."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator

import pytest
import redis
import redis.asyncio as aioredis

from blockq.config import ConfigError, Settings
from blockq.wire.dead_letters import DEAD_LETTER_MAX_RAW_BYTES, DEAD_LETTER_MAXLEN
from blockq.wire.keys import PAYLOAD_FIELD
from blockq.wire.streams import GroupConsumer, StreamEntry, connect_async

STREAM, GROUP = "bq:test-stream", "g"


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[aioredis.Redis]:
    client = connect_async(settings.redis_url)
    yield client
    await client.aclose()


def consumer(client: aioredis.Redis, settings: Settings, name: str = "me", **options: object) -> GroupConsumer:
    return GroupConsumer(client, STREAM, GROUP, name, dead_letter_stream=settings.keys.dead_letters,
                         settings=settings, **options)  # type: ignore[arg-type]


async def dead_letter(client: aioredis.Redis, group_consumer: GroupConsumer, payloads: list[bytes]) -> None:
    pipe = client.pipeline(transaction=False)
    for index, payload in enumerate(payloads):
        group_consumer.dead_letter(pipe, StreamEntry(f"{index + 1}-0", payload), "unreadable")
    await pipe.execute()


async def test_a_dead_letter_keeps_a_bounded_head_of_a_large_payload(client: aioredis.Redis, settings: Settings,
                                                                     sync_redis: redis.Redis) -> None:
    large = bytes(range(256)) * (4 * 1024 * 1024 // 256)  # 4 MiB, the protocol's message limit
    await dead_letter(client, consumer(client, settings), [large, b"small"])
    (_, cut), (_, whole) = sync_redis.xrange(settings.keys.dead_letters)
    assert len(cut[b"raw"]) == DEAD_LETTER_MAX_RAW_BYTES == 64 * 1024 and large.startswith(cut[b"raw"])
    assert int(cut[b"raw_bytes"]) == len(large)
    assert cut[b"raw_sha256"].decode() == hashlib.sha256(large).hexdigest()
    assert whole[b"raw"] == b"small" and int(whole[b"raw_bytes"]) == 5
    assert whole[b"reason"] == b"unreadable" and whole[b"source"] == STREAM.encode()
    # Configured per consumer: a smaller cut.
    await dead_letter(client, consumer(client, settings, dead_letter_max_raw_bytes=1024), [large])
    assert len(sync_redis.xrevrange(settings.keys.dead_letters, count=1)[0][1][b"raw"]) == 1024


async def test_the_dead_letter_stream_is_trimmed_by_count(client: aioredis.Redis, settings: Settings,
                                                          sync_redis: redis.Redis) -> None:
    group_consumer = consumer(client, settings)
    for _ in range(3):
        await dead_letter(client, group_consumer, [b"junk"] * (DEAD_LETTER_MAXLEN // 2))
    # Trimmed with "~": whole radix-tree nodes (100 entries by default) at a time.
    assert DEAD_LETTER_MAXLEN <= sync_redis.xlen(settings.keys.dead_letters) <= DEAD_LETTER_MAXLEN + 100


async def make_consumer_state(client: aioredis.Redis, name: str, *, keep_pending: bool) -> None:
    """``name`` reads one entry; it ACKs it unless ``keep_pending``."""
    await client.xadd(STREAM, {PAYLOAD_FIELD: b"x"})
    reply = await client.xreadgroup(GROUP, name, {STREAM: ">"}, count=1)
    if not keep_pending:
        await client.xack(STREAM, GROUP, reply[0][1][0][0])


async def consumer_names(client: aioredis.Redis) -> set[str]:
    return {c["name"].decode() for c in await client.xinfo_consumers(STREAM, GROUP)}


async def test_idle_consumers_without_pending_entries_are_deleted(client: aioredis.Redis,
                                                                  settings: Settings) -> None:
    me = consumer(client, settings, idle_consumer_ms=300)
    me.sweep_interval_s = 1.0
    await me.ensure_group()
    await make_consumer_state(client, "pod-gone-empty", keep_pending=False)
    await make_consumer_state(client, "pod-gone-with-work", keep_pending=True)
    await asyncio.sleep(0.4)
    await make_consumer_state(client, "pod-alive", keep_pending=False)  # read just now
    await me.read(10, block_ms=10)
    # The idle one with pending entries stays: deleting it would drop its work from the
    # pending list. The live one and this consumer stay.
    assert await consumer_names(client) == {"me", "pod-gone-with-work", "pod-alive"}
    pending = await client.xpending(STREAM, GROUP)
    assert pending["pending"] == 1 and pending["consumers"][0]["name"] == b"pod-gone-with-work"
    # At most one sweep per interval: another idle consumer waits for the next one.
    await make_consumer_state(client, "pod-gone-later", keep_pending=False)
    await asyncio.sleep(0.4)
    await me.read(10, block_ms=10)
    assert "pod-gone-later" in await consumer_names(client)
    await asyncio.sleep(0.7)
    await me.read(10, block_ms=10)
    assert await consumer_names(client) == {"me", "pod-gone-with-work"}


async def test_idle_consumers_are_kept_when_the_sweep_is_off(client: aioredis.Redis, settings: Settings) -> None:
    me = consumer(client, settings, idle_consumer_ms=None)
    await me.ensure_group()
    await make_consumer_state(client, "pod-gone-empty", keep_pending=False)
    await asyncio.sleep(0.05)
    await me.read(10, block_ms=10)
    assert "pod-gone-empty" in await consumer_names(client)


async def test_a_read_recreates_a_group_redis_lost(client: aioredis.Redis, settings: Settings) -> None:
    me = consumer(client, settings)
    await me.ensure_group()
    await client.delete(STREAM)  # Redis came back without the stream and its group
    assert await me.read(10, block_ms=10) == []
    await client.xadd(STREAM, {PAYLOAD_FIELD: b"after"})
    (entry,) = await me.read(10, block_ms=100)
    assert entry.payload == b"after"


async def test_own_pending_read_again_after_an_outage_spares_held_entries(client: aioredis.Redis,
                                                                          settings: Settings,
                                                                          sync_redis: redis.Redis) -> None:
    me = consumer(client, settings, claim_stale=False)
    await me.ensure_group()
    await client.xadd(STREAM, {PAYLOAD_FIELD: b"running"})
    await client.xadd(STREAM, {PAYLOAD_FIELD: b"read-but-reply-lost"})
    running, unseen = await me.read(10, block_ms=100)
    for _ in range(settings.max_deliveries + 2):  # outage after outage
        me.reread_own_pending()
        entries = await me.read(10, block_ms=10, held_ids={running.entry_id})
        assert running.entry_id in {e.entry_id for e in entries}
    assert sync_redis.xlen(settings.keys.dead_letters) == 1  # only the entry nobody held
    (_, fields), = sync_redis.xrange(settings.keys.dead_letters)
    assert fields[b"entry_id"].decode() == unseen.entry_id


def test_dead_letter_and_idle_consumer_limits_come_from_the_environment() -> None:
    settings = Settings.from_env({"BLOCKQ_DEAD_LETTER_MAX_BYTES": "2048", "BLOCKQ_IDLE_CONSUMER_MS": "0",
                                  "BLOCKQ_SUBMIT_CHECK_MS": "250"})
    configured = GroupConsumer(None, "s", "g", "c", dead_letter_stream="d", settings=settings)  # type: ignore[arg-type]
    assert configured.dead_letter_max_raw_bytes == 2048 and configured.idle_consumer_ms is None
    default = GroupConsumer(None, "s", "g", "c", dead_letter_stream="d", settings=Settings())  # type: ignore[arg-type]
    assert default.dead_letter_max_raw_bytes == DEAD_LETTER_MAX_RAW_BYTES and default.idle_consumer_ms == 3_600_000
    with pytest.raises(ConfigError, match="dead_letter_max_bytes"):
        Settings.from_env({"BLOCKQ_DEAD_LETTER_MAX_BYTES": "-1"})
    with pytest.raises(ConfigError, match="submit_check_ms"):
        Settings(submit_check_ms=0)
