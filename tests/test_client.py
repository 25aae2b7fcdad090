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
        handle = client.submit("hello", max_tokens=8, priority="batch", tenant="acme", model="sql-lora")
    ((_, fields),) = sync_redis.xrange(settings.keys.requests)
    request = decode_request(fields[PAYLOAD_FIELD.encode()])
    assert request.id == handle.id
    assert (request.max_tokens, request.priority, request.tenant, request.model) == (8, "batch", "acme", "sql-lora")
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


# --- a request Redis lost after accepting it -------------------------------------------

class Responder:
    """Answers each request that reaches ``req`` with one final record, through the
    final-record script (as a worker does: a second final record for an id is refused),
    and counts the ids it saw."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Responder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        from blockq.wire.output import queue_final

        client = redis.Redis.from_url(self.settings.redis_url)
        keys, last_id = self.settings.keys, "0-0"
        try:
            while not self._stop.is_set():
                for _, entries in client.xread({keys.requests: last_id}, block=100) or []:
                    for entry_id, fields in entries:
                        last_id = entry_id
                        request = decode_request(fields[PAYLOAD_FIELD.encode()])
                        self.seen.append(request.id)
                        pipe = client.pipeline(transaction=False)
                        queue_final(pipe, keys, request.id, request.reply_stream, "",
                                    encode(final_for(request.id, 0, "answered")), None, 60)
                        pipe.execute()
        finally:
            client.close()


def lose_admission(sync_redis: redis.Redis, settings: Settings, request_id: str) -> None:
    """What a Redis crash in the second after an admission (AOF fsynced once a second),
    or a failover before the replica got it, leaves: no submit record, no entry."""
    ((entry_id, _),) = sync_redis.xrange(settings.keys.requests)
    sync_redis.delete(settings.keys.submitted(request_id))
    sync_redis.xdel(settings.keys.requests, entry_id)


def num_finals(sync_redis: redis.Redis, settings: Settings, request_id: str) -> int:
    from blockq.wire.protocol import decode_reply_entry

    return sum(isinstance(decode_reply_entry(f[PAYLOAD_FIELD.encode()]), FinalRecord)
               for _, f in sync_redis.xrange(settings.keys.reply(request_id)))


def test_a_request_redis_lost_is_sent_again_and_answered_once(settings: Settings, sync_redis: redis.Redis) -> None:
    with Client(settings=settings) as client:
        handle = client.submit("hello", max_tokens=4)
        lose_admission(sync_redis, settings, handle.id)
        with Responder(settings) as responder:
            final = handle.result(timeout_s=10)
    assert final.request_id == handle.id and final.text == "answered"
    assert responder.seen == [handle.id] and handle.num_resubmits == 1  # sent again once, its own id
    assert sync_redis.exists(settings.keys.submitted(handle.id))
    assert num_finals(sync_redis, settings, handle.id) == 1


async def test_the_async_client_sends_a_lost_request_again(settings: Settings, sync_redis: redis.Redis) -> None:
    async with AsyncClient(settings=settings) as client:
        handle = await client.submit("hello", max_tokens=4)
        lose_admission(sync_redis, settings, handle.id)
        with Responder(settings) as responder:
            texts = [chunk.text async for chunk in handle.stream(timeout_s=10)]
            final = await handle.result(timeout_s=1)
    assert texts == [] and final.text == "answered"
    assert responder.seen == [handle.id]
    assert num_finals(sync_redis, settings, handle.id) == 1


def test_a_refused_resubmit_is_tried_again_at_the_next_check(settings: Settings, sync_redis: redis.Redis) -> None:
    with Client(settings=settings, submit_check_interval_s=0.2) as client:
        handle = client.submit("hello", max_tokens=4)
        lose_admission(sync_redis, settings, handle.id)
        limit = sync_redis.config_get("maxmemory")["maxmemory"]
        sync_redis.config_set("maxmemory", 1)  # writes refused (noeviction): the resubmit too
        try:
            with pytest.raises(TimeoutError):  # refused resubmits do not end the wait
                handle.result(timeout_s=1.0)
        finally:
            sync_redis.config_set("maxmemory", limit)
        assert handle.num_resubmits == 0 and sync_redis.xlen(settings.keys.requests) == 0
        with Responder(settings) as responder:
            assert handle.result(timeout_s=5).text == "answered"
    assert responder.seen == [handle.id] and handle.num_resubmits == 1


def test_a_request_still_recorded_or_answered_is_not_sent_again(settings: Settings,
                                                                sync_redis: redis.Redis) -> None:
    from blockq.wire.output import queue_final

    with Client(settings=settings, submit_check_interval_s=0.2) as client:
        handle = client.submit("hello", max_tokens=4)
        with pytest.raises(TimeoutError):  # several checks: the submit record is there
            handle.result(timeout_s=1.0)
        assert sync_redis.xlen(settings.keys.requests) == 1
        # Its submit record expired, but it has its final record: nothing to send.
        pipe = sync_redis.pipeline(transaction=True)
        pipe.delete(settings.keys.submitted(handle.id))
        queue_final(pipe, settings.keys, handle.id, handle.request.reply_stream, "",
                    encode(final_for(handle.id, 0, "done")), None, 60)
        pipe.execute()
        assert handle.result(timeout_s=5).text == "done"
    assert sync_redis.xlen(settings.keys.requests) == 1


def test_the_submit_watch_checks_on_schedule_and_at_once_after_a_reconnect() -> None:
    from blockq.client_admission import SubmitWatch
    from blockq.wire.keys import Keys

    now_s = [100.0]
    watch = SubmitWatch(Keys(), "r1", interval_s=1.5, clock=lambda: now_s[0])
    assert watch.check_keys == ("bq:submitted:{r1}", "bq:final:{r1}")
    assert not watch.is_due()
    now_s[0] = 101.6
    assert watch.is_due()
    assert not watch.is_lost(num_existing=1) and not watch.is_due()  # recorded: next in 1.5 s
    watch.after_reconnect()
    assert watch.is_due()  # a reconnect may follow a crash that lost the admission
    assert watch.is_lost(num_existing=0) and not watch.is_due()
    assert watch.num_checks == 2
