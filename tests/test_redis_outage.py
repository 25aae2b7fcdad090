"""A worker rides out a Redis outage longer than redis-py's retries: a real worker process
(emulated engine) on its own real Redis server, which is stopped for 15 s and started
again on the same port with its data. The process must still be alive, beat again,
finish the request it was running (one final record, the streamed text equal to it) and
serve a request queued after the restart. And a crash that loses Redis' last second of
writes leaves no hole in a stream the worker was writing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from blockq.client_reader import ReplyReader
from blockq.config import Settings
from blockq.local.embedded_redis import EmbeddedRedis, start_embedded_redis
from blockq.wire.beats import decode_heartbeat
from blockq.wire.keys import PAYLOAD_FIELD
from blockq.wire.protocol import FinalRecord, decode_reply_entry, encode
from tests.conftest import REPO_ROOT, wait_until
from tests.factories import make_request

OUTAGE_S = 15.0  # past redis-py's own retries (a few, within about a second)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[dict[str, EmbeddedRedis]]:
    """A Redis server of this test's own (the test stops and restarts it); always stopped."""
    servers = {"server": start_embedded_redis(tmp_path / "redis")}
    yield servers
    servers["server"].stop()


def start_worker(redis_url: str, instance_id: str, log_path: Path) -> subprocess.Popen[bytes]:
    # Logs go to a file: an unread pipe fills up and blocks the worker.
    return subprocess.Popen(
        [sys.executable, "-m", "workers", "--instance-id", instance_id, "--time-scale", "1", "--noise", "0"],
        env={**os.environ, "BLOCKQ_REDIS_URL": redis_url, "BLOCKQ_LOG_LEVEL": "info"},
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=log_path.open("ab"))


def enqueue(client: redis.Redis, settings: Settings, instance_id: str, output_tokens: int) -> str:
    request = make_request("hello world", max_tokens=output_tokens, keys=settings.keys, predicted=output_tokens,
                           true_output_tokens=output_tokens)
    client.xadd(settings.keys.instance_queue(instance_id), {PAYLOAD_FIELD: encode(request)})
    return request.id


def read_reply(client: redis.Redis, settings: Settings, request_id: str) -> tuple[ReplyReader, int]:
    """The reader's view of the reply stream, and how many final records it holds."""
    entries = client.xrange(settings.keys.reply(request_id))
    reader = ReplyReader()
    reader.feed(entries)
    num_finals = sum(isinstance(decode_reply_entry(f[PAYLOAD_FIELD.encode()]), FinalRecord) for _, f in entries)
    return reader, num_finals


def latest_beat_seq(client: redis.Redis, settings: Settings, instance_id: str) -> int:
    raw = client.hget(settings.keys.instances, instance_id)
    return decode_heartbeat(raw).seq if raw else 0


def test_a_worker_outlives_a_long_redis_outage(own_redis: dict[str, EmbeddedRedis], tmp_path: Path) -> None:
    server = own_redis["server"]
    settings = Settings(redis_url=server.url)
    log_path = tmp_path / "worker.log"
    client = redis.Redis.from_url(server.url)
    worker = start_worker(server.url, "o1", log_path)
    try:
        wait_until(lambda: latest_beat_seq(client, settings, "o1") > 0, timeout_s=30, interval_s=0.1)
        # A long request (about 20 s of decoding): running through the outage.
        running_id = enqueue(client, settings, "o1", output_tokens=800)
        wait_until(lambda: read_reply(client, settings, running_id)[0].num_tokens_received > 0, timeout_s=20)
        time.sleep(1.2)  # appendfsync everysec: what was written so far survives the stop
        assert read_reply(client, settings, running_id)[1] == 0  # still running at the outage
        client.close()
        server.stop()
        time.sleep(OUTAGE_S)
        assert worker.poll() is None, "the worker exited during the outage:\n" + log_path.read_text()[-3000:]
        server = own_redis["server"] = start_embedded_redis(server.data_dir, port=server.port)
        client = redis.Redis.from_url(server.url)
        seq_at_restart = latest_beat_seq(client, settings, "o1")
        wait_until(lambda: latest_beat_seq(client, settings, "o1") > seq_at_restart, timeout_s=10, interval_s=0.1)
        after_id = enqueue(client, settings, "o1", output_tokens=8)
        wait_until(lambda: read_reply(client, settings, after_id)[1], timeout_s=30, interval_s=0.1)
        wait_until(lambda: read_reply(client, settings, running_id)[1], timeout_s=60, interval_s=0.2)
        assert worker.poll() is None, log_path.read_text()[-3000:]
        for request_id, num_tokens in ((running_id, 800), (after_id, 8)):
            reader, num_finals = read_reply(client, settings, request_id)
            assert num_finals == 1 and reader.final is not None
            assert reader.final.status == "ok" and reader.final.output_tokens == num_tokens
            assert reader.text == reader.final.text
        assert "redis_unreachable" in log_path.read_text()
    finally:
        if worker.poll() is None:
            worker.terminate()
            worker.wait(timeout=30)
        client.close()


def test_a_worker_puts_back_the_output_a_redis_crash_lost(own_redis: dict[str, EmbeddedRedis],
                                                          tmp_path: Path) -> None:
    """Redis dies as a machine crash kills it under ``appendfsync everysec``: the last
    second of writes, chunks the worker had streamed among them, is gone. The stream must
    not keep the hole: a reader of the whole stream gets the final text."""
    from loadgen.chaos_faults import append_only_file

    server = own_redis["server"]
    settings = Settings(redis_url=server.url)
    log_path = tmp_path / "worker.log"
    client = redis.Redis.from_url(server.url)
    worker = start_worker(server.url, "o2", log_path)
    try:
        wait_until(lambda: latest_beat_seq(client, settings, "o2") > 0, timeout_s=30, interval_s=0.1)
        request_id = enqueue(client, settings, "o2", output_tokens=600)
        wait_until(lambda: read_reply(client, settings, request_id)[0].num_tokens_received > 0, timeout_s=20)
        time.sleep(1.2)  # what was streamed so far is on disk
        aof = append_only_file(server.data_dir)
        size_synced = aof.stat().st_size
        time.sleep(1.0)  # streamed, acknowledged, never fsynced
        num_tokens_streamed = read_reply(client, settings, request_id)[0].num_tokens_received
        server.process.send_signal(signal.SIGSTOP)
        os.truncate(aof, size_synced)
        server.process.kill()
        server.process.wait()
        client.close()
        server = own_redis["server"] = start_embedded_redis(server.data_dir, port=server.port)
        client = redis.Redis.from_url(server.url)
        reader, num_finals = read_reply(client, settings, request_id)
        assert reader.num_tokens_received < num_tokens_streamed and num_finals == 0  # the crash lost output
        wait_until(lambda: read_reply(client, settings, request_id)[1], timeout_s=60, interval_s=0.2)
        reader, num_finals = read_reply(client, settings, request_id)
        assert num_finals == 1 and reader.final is not None and reader.final.output_tokens == 600
        assert reader.text == reader.final.text  # no hole where the lost chunks were
        assert worker.poll() is None, log_path.read_text()[-3000:]
    finally:
        if worker.poll() is None:
            worker.terminate()
            worker.wait(timeout=30)
        client.close()
