"""Exactly-once answers from the reader's point of view, against a real Redis and the
emulated engine: restarts, re-execution elsewhere, fencing, dying loops, cancel races and
poison requests."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import pytest
import redis

from blockq.client import ReplyReader
from blockq.config import Settings
from blockq.wire.beats import decode_heartbeat
from blockq.wire.keys import GROUP_WORK, PAYLOAD_FIELD
from blockq.wire.protocol import FinalRecord, Request, encode, unpack_map
from blockq.wire.streams import StreamEntry, connect_async
from tests.factories import make_request
from workers.engines.base import EngineRequestSpec, EngineStepOutput
from workers.engines.emulated import EmulatedEngine, EmulatedEngineOptions, synthetic_token_text
from workers.worker import InstanceWorker, WorkerFailed, WorkerOptions


def engine() -> EmulatedEngine:
    return EmulatedEngine(EmulatedEngineOptions(time_scale=0.2, noise_sigma=0.0))


def clean_text(num_tokens: int) -> str:
    return "".join(synthetic_token_text(i) for i in range(num_tokens))


def enqueue(sync_redis: redis.Redis, settings: Settings, instance_id: str, *, output_tokens: int,
            owner: str | None = None, prompt: str = "hello world") -> Request:
    request = make_request(prompt, max_tokens=4000, keys=settings.keys, predicted=output_tokens,
                           true_output_tokens=output_tokens)
    if owner is not None:
        sync_redis.set(settings.keys.owner(request.id), owner)
    sync_redis.xadd(settings.keys.instance_queue(instance_id), {PAYLOAD_FIELD: encode(request)})
    return request


def read_reply(sync_redis: redis.Redis, settings: Settings, request_id: str) -> tuple[ReplyReader, list[FinalRecord]]:
    """A reader fed the whole reply stream, and every final record on it."""
    entries = sync_redis.xrange(settings.keys.reply(request_id))
    reader = ReplyReader()
    reader.feed(entries)
    records = [FinalRecord.from_map(m) for m in (unpack_map(f[PAYLOAD_FIELD.encode()]) for _, f in entries)
               if m["kind"] == "final"]
    return reader, records


def pending(sync_redis: redis.Redis, settings: Settings, instance_id: str) -> int:
    return int(sync_redis.xpending(settings.keys.instance_queue(instance_id), GROUP_WORK)["pending"])


async def eventually(predicate: Callable[[], object], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


class Running:
    """One worker task on its own client; ``crash`` cancels it without a drain."""

    def __init__(self, settings: Settings, instance_id: str, the_engine: EmulatedEngine | None = None) -> None:
        self.client = connect_async(settings.redis_url)
        self.worker = InstanceWorker(self.client, settings, instance_id, the_engine or engine(),
                                     WorkerOptions(stream_interval_ms=0))
        self.stop = asyncio.Event()
        self.task = asyncio.create_task(self.worker.run(self.stop))

    async def crash(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self.client.aclose()

    async def finish(self) -> None:
        self.stop.set()
        await self.task
        await self.client.aclose()


def streamed_tokens(sync_redis: redis.Redis, settings: Settings, request_id: str) -> int:
    return read_reply(sync_redis, settings, request_id)[0].num_tokens_received


async def test_restarted_twice_answers_once(settings: Settings, sync_redis: redis.Redis) -> None:
    request = enqueue(sync_redis, settings, "r0", output_tokens=300)
    marks = []
    for _ in range(2):
        run = Running(settings, "r0")
        floor = marks[-1] if marks else 0
        await eventually(lambda floor=floor: streamed_tokens(sync_redis, settings, request.id) > floor + 20)
        await run.crash()
        marks.append(streamed_tokens(sync_redis, settings, request.id))
        assert marks[-1] < 300 and pending(sync_redis, settings, "r0") == 1  # the entry survived the crash
    run = Running(settings, "r0")
    await eventually(lambda: read_reply(sync_redis, settings, request.id)[1])
    await run.finish()
    reader, records = read_reply(sync_redis, settings, request.id)
    assert len(records) == 1 and records[0].status == "ok"
    assert reader.text == records[0].text == clean_text(300) and records[0].output_tokens == 300
    assert pending(sync_redis, settings, "r0") == 0


async def test_re_reading_the_running_entry_never_acks_it(settings: Settings, sync_redis: redis.Redis) -> None:
    request = enqueue(sync_redis, settings, "e", output_tokens=300)
    run = Running(settings, "e")
    await eventually(lambda: run.worker.in_flight)
    (entry_id, fields), = sync_redis.xrange(settings.keys.instance_queue("e"))
    # The running entry read again (own pending re-read), and a second entry for it.
    await run.worker.admit([StreamEntry(entry_id.decode(), fields[PAYLOAD_FIELD.encode()])])
    assert pending(sync_redis, settings, "e") == 1 and request.id in run.worker.in_flight
    duplicate_id = sync_redis.xadd(settings.keys.instance_queue("e"), {PAYLOAD_FIELD: encode(request)})
    await eventually(lambda: duplicate_id not in [i for i, _ in sync_redis.xrange(settings.keys.instance_queue("e"))])
    assert pending(sync_redis, settings, "e") == 1  # the duplicate ACKed, the running entry kept
    await run.crash()
    assert pending(sync_redis, settings, "e") == 1  # still there for the restart


async def test_re_execution_elsewhere_streams_the_final_text(settings: Settings, sync_redis: redis.Redis) -> None:
    request = enqueue(sync_redis, settings, "a", output_tokens=400, owner="a")
    first = Running(settings, "a")
    await eventually(lambda: streamed_tokens(sync_redis, settings, request.id) > 30)
    await first.crash()
    num_streamed = streamed_tokens(sync_redis, settings, request.id)
    # What the dispatcher does when it places the request again: move the owner, re-queue.
    sync_redis.set(settings.keys.owner(request.id), "b")
    sync_redis.xadd(settings.keys.instance_queue("b"), {PAYLOAD_FIELD: encode(request)})
    second = Running(settings, "b")
    await eventually(lambda: read_reply(sync_redis, settings, request.id)[1])
    await second.finish()
    reader, (record,) = read_reply(sync_redis, settings, request.id)
    assert 30 < num_streamed < 400 and record.instance == "b"
    assert reader.text == record.text == clean_text(400) and record.output_tokens == 400
    offsets = [m["offset_tokens"] for m in (unpack_map(f[PAYLOAD_FIELD.encode()])
                                            for _, f in sync_redis.xrange(settings.keys.reply(request.id)))
               if m["kind"] == "chunk"]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)  # nothing re-sent


async def test_fenced_worker_drops_the_request_and_writes_nothing(settings: Settings,
                                                                 sync_redis: redis.Redis) -> None:
    request = enqueue(sync_redis, settings, "s", output_tokens=2000, owner="s")
    run = Running(settings, "s")
    await eventually(lambda: streamed_tokens(sync_redis, settings, request.id) > 5)
    sync_redis.set(settings.keys.owner(request.id), "elsewhere")
    await eventually(lambda: not run.worker.in_flight)
    length = sync_redis.xlen(settings.keys.reply(request.id))
    await asyncio.sleep(0.3)
    assert sync_redis.xlen(settings.keys.reply(request.id)) == length
    assert not run.worker.engine.has_unfinished_requests() and run.worker.stats.num_dropped == 1
    assert not read_reply(sync_redis, settings, request.id)[1]  # no final record from the stale worker
    await run.finish()


@pytest.mark.parametrize("loop", ["intake", "cancel"])
async def test_a_dead_loop_stops_the_worker(settings: Settings, sync_redis: redis.Redis, loop: str) -> None:
    request = enqueue(sync_redis, settings, "d", output_tokens=3000)
    run = Running(settings, "d")
    await eventually(lambda: run.worker.in_flight)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{loop} broke")

    if loop == "intake":
        run.worker.consumer.read = broken  # type: ignore[method-assign]
    else:
        run.worker.cancels.remember = broken  # type: ignore[method-assign]
        # The cancel loop reads from the stream's end when it starts: a notice sent before
        # its first read is not seen, so send until one is.
        await eventually(lambda: sync_redis.xadd(settings.keys.cancellations, {PAYLOAD_FIELD: "someone-else"})
                         and run.task.done(), timeout_s=10)
    with pytest.raises(WorkerFailed, match=f"{loop} broke"):
        await asyncio.wait_for(run.task, 10)
    await run.client.aclose()
    assert decode_heartbeat(sync_redis.hget(settings.keys.instances, "d")).state == "stopped"
    assert pending(sync_redis, settings, "d") == 1  # unfinished work left for the restart
    assert not read_reply(sync_redis, settings, request.id)[1]


async def test_cancel_while_admitting_is_not_lost(settings: Settings, sync_redis: redis.Redis) -> None:
    run = Running(settings, "c")
    # Wait until the cancel loop reads the stream (it starts at the stream's end, so a
    # notice sent before its first read is not seen): send warm-ups until one is.
    await eventually(lambda: sync_redis.xadd(settings.keys.cancellations, {PAYLOAD_FIELD: "warm-up"})
                     and "warm-up" in run.worker.cancels)
    real_admit = run.worker.admit
    request: Request | None = None

    async def admit_during_cancel(entries: list) -> None:
        # The cancel notice (without its flag) is handled while this bundle is in hand.
        assert request is not None
        sync_redis.xadd(settings.keys.cancellations, {PAYLOAD_FIELD: request.id})
        await eventually(lambda: request.id in run.worker.cancels)
        await real_admit(entries)

    run.worker.admit = admit_during_cancel  # type: ignore[method-assign]
    request = enqueue(sync_redis, settings, "c", output_tokens=50)
    await eventually(lambda: read_reply(sync_redis, settings, request.id)[1])
    await run.finish()
    (record,) = read_reply(sync_redis, settings, request.id)[1]
    assert record.status == "cancelled" and record.output_tokens == 0


async def test_cancel_in_the_finishing_step_gives_one_answer(settings: Settings, sync_redis: redis.Redis) -> None:
    the_engine = engine()
    real_step = the_engine.step
    run = Running(settings, "f", the_engine)
    request = enqueue(sync_redis, settings, "f", output_tokens=20)

    async def step_then_cancel() -> EngineStepOutput:
        output = await real_step()
        if any(e.finished and e.request_id == request.id for e in output.events):
            sync_redis.xadd(settings.keys.cancellations, {PAYLOAD_FIELD: request.id})
            await eventually(lambda: request.id in run.worker._cancels_to_apply)
        return output

    the_engine.step = step_then_cancel  # type: ignore[method-assign]
    await eventually(lambda: read_reply(sync_redis, settings, request.id)[1])
    await asyncio.sleep(0.2)
    await run.finish()
    reader, records = read_reply(sync_redis, settings, request.id)
    assert [r.status for r in records] == ["ok"] and reader.text == records[0].text == clean_text(20)
    assert (run.worker.stats.num_finished, run.worker.stats.num_cancelled) == (1, 0)


async def test_poison_request_is_answered_and_others_served(settings: Settings, sync_redis: redis.Redis) -> None:
    the_engine = engine()
    real_add = the_engine.add_request
    def add_request(spec: EngineRequestSpec) -> None:
        if spec.prompt == "poison":
            raise RuntimeError("engine refused it")
        real_add(spec)

    the_engine.add_request = add_request  # type: ignore[method-assign]
    run = Running(settings, "p", the_engine)
    requests = [enqueue(sync_redis, settings, "p", output_tokens=10, prompt=prompt)
                for prompt in ("hello", "poison", "world")]
    await eventually(lambda: all(read_reply(sync_redis, settings, r.id)[1] for r in requests))
    later = enqueue(sync_redis, settings, "p", output_tokens=10)
    await eventually(lambda: read_reply(sync_redis, settings, later.id)[1])
    assert not run.task.done()
    await run.finish()
    statuses = {r.id: read_reply(sync_redis, settings, r.id)[1] for r in [*requests, later]}
    bad = statuses.pop(requests[1].id)
    assert len(bad) == 1 and bad[0].status == "error" and "engine refused it" in (bad[0].error or "")
    assert len(bad[0].error or "") <= 500
    assert all(len(v) == 1 and v[0].status == "ok" for v in statuses.values())
    assert sync_redis.xlen(settings.keys.instance_queue("p")) == 0  # every entry ACKed


async def test_chunks_refused_by_redis_are_sent_again(settings: Settings, sync_redis: redis.Redis) -> None:
    """Writes refused for a while (Redis at maxmemory) leave no hole in the stream: the
    refused chunks go out again, first, with the next write, so the streamed text still
    equals the final text."""
    request = enqueue(sync_redis, settings, "m", output_tokens=300)
    run = Running(settings, "m")
    await eventually(lambda: streamed_tokens(sync_redis, settings, request.id) > 20)
    limit = sync_redis.config_get("maxmemory")["maxmemory"]
    num_entries = sync_redis.xlen(settings.keys.reply(request.id))
    sync_redis.config_set("maxmemory", 1)
    try:
        await asyncio.sleep(0.3)  # steps go on; their chunks are refused (OOM)
        assert sync_redis.xlen(settings.keys.reply(request.id)) == num_entries
        assert streamed_tokens(sync_redis, settings, request.id) < 300
    finally:
        sync_redis.config_set("maxmemory", limit)
    await eventually(lambda: read_reply(sync_redis, settings, request.id)[1])
    await run.finish()
    reader, records = read_reply(sync_redis, settings, request.id)
    assert len(records) == 1 and records[0].status == "ok"
    assert reader.text == records[0].text == clean_text(300)
