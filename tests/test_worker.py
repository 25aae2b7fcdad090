"""The worker against a real Redis: streaming, bundling bounded by what the engine can
admit, heartbeats that match the engine, drain on SIGTERM, resume after a crash."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from blockq.config import Settings
from blockq.wire.beats import decode_heartbeat
from blockq.wire.keys import GROUP_WORK, PAYLOAD_FIELD
from blockq.wire.protocol import Assignment, DoneRecord, FinalRecord, encode, unpack_map
from blockq.wire.streams import connect_async
from tests.conftest import REPO_ROOT, wait_until
from tests.factories import make_request
from workers.engines.emulated import EmulatedEngine, EmulatedEngineOptions
from workers.worker import InstanceWorker, WorkerOptions


def enqueue(sync_redis: redis.Redis, settings: Settings, instance_id: str, n: int, *, output_tokens: int = 8,
            prompt: str = "hello world", decided_at_s: float | None = None) -> list[str]:
    ids = []
    for _ in range(n):
        request = make_request(prompt, max_tokens=64, keys=settings.keys, predicted=output_tokens,
                               true_output_tokens=output_tokens)
        if decided_at_s is not None:  # placed by a dispatcher then
            request = request.with_assignment(Assignment(instance_id, "round_robin", decided_at_s, 0.1))
        sync_redis.xadd(settings.keys.instance_queue(instance_id), {PAYLOAD_FIELD: encode(request)})
        ids.append(request.id)
    return ids


def finals(sync_redis: redis.Redis, settings: Settings, ids: list[str]) -> dict[str, FinalRecord]:
    found = {}
    for request_id in ids:
        for _, fields in sync_redis.xrange(settings.keys.reply(request_id)):
            message = unpack_map(fields[PAYLOAD_FIELD.encode()])
            if message["kind"] == "final":
                found[request_id] = FinalRecord.from_map(message)
    return found


def engine(**overrides: object) -> EmulatedEngine:
    return EmulatedEngine(EmulatedEngineOptions(time_scale=0.2, noise_sigma=0.0,
                                                config_overrides=tuple(overrides.items())))


async def test_worker_streams_output_and_records_done(settings: Settings, sync_redis: redis.Redis) -> None:
    client = connect_async(settings.redis_url)
    worker = InstanceWorker(client, settings, "w0", engine(), WorkerOptions(stream_interval_ms=0))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    ids = enqueue(sync_redis, settings, "w0", 3, output_tokens=5)
    await asyncio.to_thread(wait_until, lambda: len(finals(sync_redis, settings, ids)) == 3)
    records = finals(sync_redis, settings, ids)
    for request_id in ids:
        record = records[request_id]
        assert record.status == "ok" and record.output_tokens == 5 and record.instance == "w0"
        assert record.ttft_ms is not None and record.e2e_ms is not None and record.e2e_ms >= record.ttft_ms
        chunks = [unpack_map(f[PAYLOAD_FIELD.encode()]) for _, f in sync_redis.xrange(settings.keys.reply(request_id))]
        texts = [c["text"] for c in chunks if c["kind"] == "chunk"]
        assert "".join(texts) == record.text and len(record.text.split()) == 5
        assert [c["index"] for c in chunks if c["kind"] == "chunk"] == list(range(len(texts)))
    done = [DoneRecord.from_map(unpack_map(f[PAYLOAD_FIELD.encode()])) for _, f in sync_redis.xrange(settings.keys.done)]
    assert sorted(d.request_id for d in done) == sorted(ids)
    assert all(d.output_tokens == 5 and d.predicted_output_tokens == 5 for d in done)
    # ACKed and deleted, in the round trip after the final record's is confirmed.
    await asyncio.to_thread(wait_until, lambda: sync_redis.xlen(settings.keys.instance_queue("w0")) == 0, 5.0)
    stop.set()
    await task
    await client.aclose()


async def test_bundling_never_pulls_more_than_the_engine_admits(settings: Settings, sync_redis: redis.Redis) -> None:
    client = connect_async(settings.redis_url)
    worker = InstanceWorker(client, settings, "w1", engine(max_num_seqs=4), WorkerOptions(bundle_size=16))
    ids = enqueue(sync_redis, settings, "w1", 20, output_tokens=30)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    max_pending = 0
    deadline = time.monotonic() + 30
    while len(finals(sync_redis, settings, ids)) < 20:
        assert time.monotonic() < deadline
        try:
            pending = sync_redis.xpending(settings.keys.instance_queue("w1"), GROUP_WORK)["pending"]
        except redis.ResponseError:  # the worker has not created its group yet
            pending = 0
        max_pending = max(max_pending, pending)
        await asyncio.sleep(0.01)
    assert 1 <= max_pending <= 4
    stop.set()
    await task
    await client.aclose()


async def test_heartbeat_matches_engine_state(settings: Settings, sync_redis: redis.Redis) -> None:
    client = connect_async(settings.redis_url)
    the_engine = engine()
    worker = InstanceWorker(client, settings, "w2", the_engine)
    enqueue(sync_redis, settings, "w2", 5, output_tokens=200)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await asyncio.to_thread(wait_until, lambda: len(the_engine.scheduler.running) == 5)
    await worker.publish_heartbeat("live")
    beat = decode_heartbeat(sync_redis.hget(settings.keys.instances, "w2"))
    running_ids = {r.request_id for r in the_engine.scheduler.running}
    assert beat.state == "live" and beat.instance_id == "w2"
    assert {r.request_id for r in beat.running} == running_ids
    assert beat.num_running_total == 5 and beat.num_waiting_total == 0
    assert beat.engine_config["num_gpu_blocks"] == 1052
    assert beat.num_used_blocks > 0
    assert all(r.predicted_output_tokens == 200 for r in beat.running)
    assert beat.delivery_p90_ms is None  # no request here came with a placement
    placed_s = time.time() - 0.5  # as if its dispatcher decided half a second ago
    enqueue(sync_redis, settings, "w2", 3, output_tokens=200, decided_at_s=placed_s)
    await asyncio.to_thread(wait_until, lambda: len(the_engine.scheduler.running) == 8)
    await worker.publish_heartbeat("live")
    beat = decode_heartbeat(sync_redis.hget(settings.keys.instances, "w2"))
    # From the decision to the engine: the half second, plus the queue hop and the read.
    assert beat.delivery_p90_ms is not None and 500 <= beat.delivery_p90_ms < 500 + 2000
    stop.set()
    await task
    final_beat = decode_heartbeat(sync_redis.hget(settings.keys.instances, "w2"))
    assert final_beat.state == "stopped"
    await client.aclose()


def pending_count(sync_redis: redis.Redis, queue: str) -> int:
    try:
        return int(sync_redis.xpending(queue, GROUP_WORK)["pending"])
    except redis.ResponseError:  # group not created yet
        return 0


def start_worker_process(settings: Settings, instance_id: str, log_path: Path,
                         time_scale: float = 0.5) -> subprocess.Popen[bytes]:
    # Logs go to a file: an unread pipe fills up and blocks the worker.
    return subprocess.Popen(
        [sys.executable, "-m", "workers", "--instance-id", instance_id, "--time-scale", str(time_scale),
         "--noise", "0", "--bundle-size", "4"],
        env={**os.environ, "BLOCKQ_REDIS_URL": settings.redis_url, "BLOCKQ_CLAIM_IDLE_MS": "1000",
             "BLOCKQ_LOG_LEVEL": "info"},
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=log_path.open("ab"))


def test_sigterm_drains_and_loses_nothing(settings: Settings, sync_redis: redis.Redis, tmp_path: Path) -> None:
    log_path = tmp_path / "worker.log"
    process = start_worker_process(settings, "w3", log_path)
    try:
        ids = enqueue(sync_redis, settings, "w3", 60, output_tokens=40)
        wait_until(lambda: pending_count(sync_redis, settings.keys.instance_queue("w3")) > 0, timeout_s=20)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log_path.read_text()[-4000:]
    finally:
        if process.poll() is None:
            process.kill()
    done = finals(sync_redis, settings, ids)
    assert all(record.status == "ok" and record.output_tokens == 40 for record in done.values())
    queue = settings.keys.instance_queue("w3")
    left = [unpack_map(f[PAYLOAD_FIELD.encode()])["id"] for _, f in sync_redis.xrange(queue)]
    assert sorted(list(done) + left) == sorted(ids)  # each request is finished or still queued
    assert sync_redis.xpending(queue, GROUP_WORK)["pending"] == 0  # nothing half-done
    assert decode_heartbeat(sync_redis.hget(settings.keys.instances, "w3")).state == "stopped"


def test_restart_after_crash_resumes_pending(settings: Settings, sync_redis: redis.Redis, tmp_path: Path) -> None:
    process = start_worker_process(settings, "w4", tmp_path / "worker.log")
    queue = settings.keys.instance_queue("w4")
    try:
        ids = enqueue(sync_redis, settings, "w4", 12, output_tokens=60)
        wait_until(lambda: pending_count(sync_redis, queue) > 0, timeout_s=20)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        pending_at_crash = sync_redis.xpending(queue, GROUP_WORK)["pending"]
        assert pending_at_crash > 0
        process = start_worker_process(settings, "w4", tmp_path / "worker-restarted.log")
        wait_until(lambda: len(finals(sync_redis, settings, ids)) == 12, timeout_s=60)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    records = finals(sync_redis, settings, ids)
    assert all(r.status == "ok" and r.output_tokens == 60 for r in records.values())
    assert sync_redis.xpending(queue, GROUP_WORK)["pending"] == 0


def test_the_emulated_engine_reports_its_counters_as_beats_carry_them() -> None:
    """``engine_stats``: the same names the vLLM adapter reports, counted from the steps
    (a 20-block cache that six long requests overflow, so that it preempts)."""
    from workers.engines.base import EngineRequestSpec

    engine = EmulatedEngine(EmulatedEngineOptions(noise_sigma=0.0, config_overrides=(("num_gpu_blocks", 20),
                                                                            ("max_model_len", 256))))
    for index in range(6):
        engine.add_request(EngineRequestSpec(request_id=f"r{index}", prompt="p", prompt_tokens=40, max_tokens=100,
                                             true_output_tokens=100))
    num_preempted = 0
    while (result := engine.start_step()) is not None:
        num_preempted += len(engine.finish_step(result).preempted_ids)
        running, waiting, num_used_blocks = engine.progress()
        stats = engine.engine_stats()
        assert (stats["num_running_reqs"], stats["num_waiting_reqs"]) == (len(running), len(waiting))
        assert stats["kv_cache_usage"] == round(num_used_blocks / 20, 4)
    assert num_preempted > 0 and engine.engine_stats()["num_preemptions_total"] == num_preempted
