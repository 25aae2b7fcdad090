"""The client library against a real Redis: admission control, de-duplicated streaming,
cancel, reply expiry."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from pathlib import Path

import pytest
import redis

from blockq import AsyncClient, Client, Overloaded, SubmitSpec
from blockq.config import Settings
from blockq.local.embedded_redis import start_embedded_redis
from blockq.wire.keys import PAYLOAD_FIELD
from blockq.wire.protocol import Chunk, FinalRecord, decode_request, encode


def write_reply(sync_redis: redis.Redis, stream: str, messages: list) -> None:
    for message in messages:
        sync_redis.xadd(stream, {PAYLOAD_FIELD: encode(message)})


def final_for(request_id: str, index: int, text: str) -> FinalRecord:
    return FinalRecord(request_id=request_id, index=index, status="ok", text=text, output_tokens=index,
                       prompt_tokens=1, instance="i0", finish_reason="stop")


def test_submit_writes_a_valid_request(settings: Settings, sync_redis: redis.Redis) -> None:
    with Client(settings=settings) as client:
        handle = client.submit("hello", max_tokens=8, priority="batch", tenant="acme")
    ((_, fields),) = sync_redis.xrange(settings.keys.requests)
    request = decode_request(fields[PAYLOAD_FIELD.encode()])
    assert request.id == handle.id
    assert (request.max_tokens, request.priority, request.tenant) == (8, "batch", "acme")
    assert request.reply_stream == settings.keys.reply(handle.id)


def test_admission_control_refuses_past_backlog_and_loses_nothing(settings: Settings,
                                                                   sync_redis: redis.Redis) -> None:
    limited = dataclasses.replace(settings, max_ingress_backlog=50)
    accepted = []
    refused = 0
    with Client(settings=limited) as client:
        for i in range(80):
            try:
                accepted.append(client.submit(f"prompt {i}", max_tokens=4).id)
            except Overloaded as exc:
                refused += 1
                assert exc.limit == 50 and exc.backlog >= 50
        with pytest.raises(Overloaded):  # all or nothing for a batch past the limit
            client.submit_many([SubmitSpec(prompt="x")] * 3)
    assert len(accepted) == 50 and refused == 30
    stored = [decode_request(f[PAYLOAD_FIELD.encode()]).id for _, f in sync_redis.xrange(settings.keys.requests)]
    assert stored == accepted


def test_stream_yields_each_chunk_once_in_order(settings: Settings, sync_redis: redis.Redis) -> None:
    with Client(settings=settings) as client:
        handle = client.submit("hi", max_tokens=3)
        stream = handle.request.reply_stream
        rid = handle.id
        # A worker died after two chunks; its replacement re-sent everything from index 0.
        write_reply(sync_redis, stream, [Chunk(rid, 0, "a", 1), Chunk(rid, 1, "b", 1), Chunk(rid, 0, "a", 1),
                                         Chunk(rid, 1, "b", 1), Chunk(rid, 2, "c", 1), final_for(rid, 3, "abc"),
                                         final_for(rid, 3, "abc")])
        chunks = list(handle.stream(timeout_s=5))
        assert [c.index for c in chunks] == [0, 1, 2]
        assert "".join(c.text for c in chunks) == "abc"
        assert handle.result(timeout_s=1).text == "abc"
    ttl = sync_redis.ttl(stream)
    assert 0 < ttl <= settings.reply_read_ttl_s


def test_result_times_out_without_final_record(settings: Settings) -> None:
    with Client(settings=settings) as client:
        handle = client.submit("hi", max_tokens=3)
        with pytest.raises(TimeoutError):
            handle.result(timeout_s=0.3)


def test_cancel_sets_flag_and_notifies(settings: Settings, sync_redis: redis.Redis) -> None:
    with Client(settings=settings) as client:
        handle = client.submit("hi", max_tokens=3)
        handle.cancel()
    assert sync_redis.exists(settings.keys.cancel_flag(handle.id))
    ((_, fields),) = sync_redis.xrange(settings.keys.cancellations)
    assert fields[PAYLOAD_FIELD.encode()].decode() == handle.id


async def test_async_client_streams_and_submits_many(settings: Settings, sync_redis: redis.Redis) -> None:
    async with AsyncClient(settings=settings) as client:
        handles = await client.submit_many([SubmitSpec(prompt=f"p{i}", max_tokens=2) for i in range(5)])
        assert len({h.id for h in handles}) == 5
        target = handles[2]

        async def produce() -> None:
            await asyncio.sleep(0.05)
            write_reply(sync_redis, target.request.reply_stream,
                        [Chunk(target.id, 0, "x", 1), Chunk(target.id, 0, "x", 1), Chunk(target.id, 1, "y", 1),
                         final_for(target.id, 2, "xy")])

        producer = asyncio.create_task(produce())
        texts = [chunk.text async for chunk in target.stream(timeout_s=5)]
        await producer
        assert texts == ["x", "y"]
        assert (await target.result(timeout_s=1)).output_tokens == 2
    assert sync_redis.xlen(settings.keys.requests) == 5


def test_reader_de_duplicates_by_token_offset_across_executions() -> None:
    from blockq.client import ReplyReader

    rid = "r1"
    reader = ReplyReader()
    # First run streamed tokens 0-2 in two chunks; a second run re-sent from token 0 with
    # other boundaries (wholly seen, then overlapping at a boundary), then went on.
    messages = [Chunk(rid, 0, "a b", 2, 0), Chunk(rid, 1, " c", 1, 2),
                Chunk(rid, 0, "a", 1, 0), Chunk(rid, 1, " b c d", 3, 1),  # not at a boundary: dropped
                Chunk(rid, 1, " c d", 2, 2), Chunk(rid, 2, " e", 1, 4), final_for(rid, 3, "a b c d e")]
    chunks = reader.feed((f"{i}-0", {PAYLOAD_FIELD.encode(): encode(m)}) for i, m in enumerate(messages, 1))
    assert [(c.text, c.offset_tokens, c.num_tokens) for c in chunks] == [
        ("a b", 0, 2), (" c", 2, 1), (" d", 3, 1), (" e", 4, 1)]
    assert reader.text == reader.final.text == "a b c d e" and reader.num_tokens_received == 5
    assert reader.next_index == 3


def test_chunk_offset_round_trips_and_old_chunks_decode() -> None:
    from blockq.wire.protocol import decode_reply_entry, unpack_map

    assert decode_reply_entry(encode(Chunk("r", 2, "x", 1, 7))) == Chunk("r", 2, "x", 1, 7)
    old = {k: v for k, v in unpack_map(encode(Chunk("r", 2, "x", 1))).items()}
    assert "offset_tokens" not in old
    assert decode_reply_entry(encode(old)).offset_tokens is None


def test_a_reader_outlives_a_redis_restart(tmp_path: Path) -> None:
    """A handle reading when its Redis dies and comes back (same port, data) carries on
    from the last entry it saw: each chunk once, then the final record."""
    server = start_embedded_redis(tmp_path / "redis")
    client = Client(settings=Settings(redis_url=server.url))
    try:
        handle = client.submit("hello", max_tokens=4)
        reply_stream = handle.request.reply_stream
        client.redis.xadd(reply_stream, {PAYLOAD_FIELD: encode(Chunk(handle.id, 0, "one ", 1, offset_tokens=0))})
        time.sleep(1.2)  # past the AOF's once-a-second fsync: the chunk survives the crash
        seen: list[str] = []
        reader = threading.Thread(target=lambda: seen.extend(c.text for c in handle.stream(timeout_s=30)))
        reader.start()
        server.process.kill()
        server.process.wait()
        server = start_embedded_redis(tmp_path / "redis", port=server.port)
        writer = redis.Redis.from_url(server.url)
        writer.xadd(reply_stream, {PAYLOAD_FIELD: encode(Chunk(handle.id, 1, "two", 1, offset_tokens=1))})
        final = FinalRecord(handle.id, 2, "ok", "one two", 2, 1, "inst-0", "stop")
        writer.xadd(reply_stream, {PAYLOAD_FIELD: encode(final)})
        reader.join(timeout=30)
        assert not reader.is_alive()
        assert seen == ["one ", "two"]
        assert handle.result(timeout_s=1).text == "one two"
        writer.close()
    finally:
        client.close()
        server.stop()
