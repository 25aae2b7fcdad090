"""``blockq top`` against the test session's real Redis, fed hand-written heartbeats, queue
entries and done records through the project's own encoders."""

from __future__ import annotations

import dataclasses
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from blockq.cli.main import main
from blockq.config import Settings
from blockq.local.top import build_view, kv_bar, read_sample, render_text
from blockq.wire.beats import Heartbeat, RequestProgress
from blockq.wire.keys import GROUP_DISPATCH, PAYLOAD_FIELD, Keys
from blockq.wire.protocol import DoneRecord, encode
from tests.conftest import REPO_ROOT, wait_until
from tests.factories import make_heartbeat, make_request

KEYS = Keys()


def _progress(request_id: str, generated: int) -> RequestProgress:
    return RequestProgress(request_id, 100, 100 + generated, generated, 120, 300)


def _done(request_id: str, instance: str, ttft_ms: float, *, predicted: int = 120, output: int = 100,
          version: str = "fast-v3", finished_at_s: float | None = None) -> DoneRecord:
    now_s = time.time() if finished_at_s is None else finished_at_s
    return DoneRecord(
        request_id=request_id, instance=instance, status="ok", prompt_tokens=100, output_tokens=output,
        predicted_output_tokens=predicted, predictor_version=version, policy="block",
        submitted_at_s=now_s - 3.0, finished_at_s=now_s, queue_wait_ms=5.0, ttft_ms=ttft_ms, tpot_ms=25.0,
        e2e_ms=ttft_ms + 25.0 * (output - 1), predicted_ttft_ms=ttft_ms + 10.0, predicted_e2e_ms=None,
        num_preemptions=0)


def _add_done(client: redis.Redis, records: list[DoneRecord]) -> None:
    for record in records:
        client.xadd(KEYS.done, {PAYLOAD_FIELD: encode(record)})


def _queue(client: redis.Redis, instance: str, num_entries: int) -> None:
    for _ in range(num_entries):
        client.xadd(KEYS.instance_queue(instance), {PAYLOAD_FIELD: encode(make_request(predicted=50))})


class _BeatingWorker:
    """Publishes the given beats every 50 ms (fresh ``sent_at_s``, next ``seq``), as a worker
    does, so that the instances stay live however long the reader takes."""

    def __init__(self, client: redis.Redis, beats: list[Heartbeat]) -> None:
        self.client = client
        self.beats = beats
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _publish(self, seq_step: int) -> None:
        for beat in self.beats:
            fresh = dataclasses.replace(beat, seq=beat.seq + seq_step, sent_at_s=time.time())
            self.client.hset(KEYS.instances, beat.instance_id, encode(fresh))

    def _run(self) -> None:
        seq_step = 1
        while not self.stop.wait(0.05):
            self._publish(seq_step)
            seq_step += 1


@pytest.fixture
def cluster(sync_redis: redis.Redis) -> Iterator[redis.Redis]:
    """Two live instances and a dead one, a leader, a dispatch group and 20 finished requests."""
    gpu0 = make_heartbeat("gpu0", seq=7, num_used_blocks=526, running=tuple(_progress(f"r{i}", 10) for i in range(3)),
                          waiting=(_progress("w0", 0),))
    gpu1 = make_heartbeat("gpu1", seq=9, num_used_blocks=1000, running=tuple(_progress(f"s{i}", 5) for i in range(5)))
    gone = make_heartbeat("gpu2", seq=2, sent_at_s=time.time() - 60.0)
    sync_redis.hset(KEYS.instances, gone.instance_id, encode(gone))
    worker = _BeatingWorker(sync_redis, [gpu0, gpu1])
    worker._publish(0)
    worker.thread.start()
    _queue(sync_redis, "gpu0", 2)
    _queue(sync_redis, "gpu1", 6)
    sync_redis.set(KEYS.dispatcher_lease, "dispatcher-testhost:1a2b3c", px=5000)
    sync_redis.xgroup_create(KEYS.ready, GROUP_DISPATCH, id="0", mkstream=True)
    # gpu0: TTFT 100..190 ms; gpu1: 1,000..1,900 ms; the predictor is off by 20 tokens on each.
    _add_done(sync_redis, [_done(f"a{i}", "gpu0", 100.0 + 10 * i) for i in range(10)]
              + [_done(f"b{i}", "gpu1", 1000.0 + 100 * i) for i in range(10)])
    try:
        yield sync_redis
    finally:
        worker.stop.set()
        worker.thread.join(timeout=5)


def _table_rows(frame: str) -> dict[str, list[str]]:
    """First cell -> the row's cells, from the table's lines (``│ a │ b │``; the header ``┃``)."""
    rows = {}
    for line in frame.splitlines():
        if line[:1] in ("│", "┃"):
            cells = [cell.strip() for cell in re.split("[│┃]", line.strip("│┃"))]
            rows[cells[0]] = cells
    return rows


def test_once_prints_a_frame_with_every_instance_and_its_numbers(
        cluster: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str], stdlib_logging: None) -> None:
    assert main(["top", "--once", "--redis", redis_url, "--interval-s", "0.05"]) == 0
    frame = capsys.readouterr().out
    rows = _table_rows(frame)
    header = ["instance", "state", "beat ms", "KV used", "run", "wait", "queued", "done", "TTFT p50 ms",
              "TTFT p99 ms", "lag p99 ms"]
    assert rows["instance"] == header
    assert rows["gpu0"][1] == "live" and rows["gpu0"][3].endswith(" 526/1052 50%")
    assert rows["gpu0"][4:10] == ["3", "1", "2", "10", "145", "189"]
    assert rows["gpu1"][1] == "live" and rows["gpu1"][3] == "█" * 19 + "░ 1000/1052 95%"
    assert rows["gpu1"][4:10] == ["5", "0", "6", "10", "1,450", "1,891"]
    assert rows["gpu2"][1] == "dead" and rows["gpu2"][8] == "—"
    assert rows["all"][1:10] == ["2 live", "", "", "8", "1", "8", "20", "595", "1,881"]
    assert "leader dispatcher-testhost (lease" in frame
    assert "decisions 0.0/s (placements by flow)" in frame or "decisions 0.0/s (entries read)" in frame
    assert "version fast-v3  MAE 20.0 tokens  Acc-50 100%  over its last 20 requests" in frame
    assert "TTFT forecast error 10 ms (predicted - measured)  TPOT mean 25 ms" in frame


def test_refreshes_until_interrupted_printing_frame_after_frame_into_a_pipe(
        cluster: redis.Redis, redis_url: str) -> None:
    process = subprocess.Popen([sys.executable, "-m", "blockq.cli", "top", "--redis", redis_url, "--interval-s", "0.1"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_until(lambda: sum(line.startswith("blockq top") for line in lines) >= 3, timeout_s=60.0, interval_s=0.05)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=20) == 0, process.stderr.read() if process.stderr else ""
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    reader.join(timeout=10)
    frame = "".join(lines)
    assert "\x1b" not in frame  # not a terminal: no cursor moves, no colours
    assert frame.count("│ gpu0 ") >= 3 and "decisions 0.0/s" in frame


def test_rates_come_from_two_samples(cluster: redis.Redis, settings: Settings) -> None:
    first = read_sample(cluster, settings)
    _add_done(cluster, [_done(f"c{i}", "gpu0", 120.0) for i in range(3)])
    _queue(cluster, "gpu1", 2)
    second = dataclasses.replace(read_sample(cluster, settings), taken_at_s=first.taken_at_s + 2.0)
    # Without a read counter (Redis before 7): placements by flow, finished + queue growth.
    by_flow = build_view(dataclasses.replace(second, decisions_read=None), dataclasses.replace(first, decisions_read=None))
    assert by_flow.dispatcher.decisions_counted_by == "placements by flow"
    assert by_flow.dispatcher.decisions_per_s == pytest.approx((3 + 2) / 2.0)
    counted = build_view(dataclasses.replace(second, decisions_read=130),
                         dataclasses.replace(first, decisions_read=100))
    assert counted.dispatcher.decisions_counted_by == "entries read"
    assert counted.dispatcher.decisions_per_s == pytest.approx(15.0)
    assert build_view(second).dispatcher.decisions_per_s is None  # one sample: no rate


def test_recent_means_the_window_and_the_predictor_is_its_newest_version(
        cluster: redis.Redis, settings: Settings) -> None:
    # Older records (outside a 60 s window) of another version, then a newer version, off by 60.
    _add_done(cluster, [_done(f"old{i}", "gpu0", 5000.0, finished_at_s=time.time() - 600) for i in range(4)])
    _add_done(cluster, [_done(f"new{i}", "gpu1", 300.0, predicted=160, version="fast-v4") for i in range(5)])
    view = build_view(read_sample(cluster, settings))
    assert view.recent.num_requests == 25 and view.recent.ttft_p99_ms is not None
    assert view.recent.ttft_p99_ms < 5000.0
    assert (view.predictor.version, view.predictor.num_scored) == ("fast-v4", 5)
    assert view.predictor.mae_tokens == pytest.approx(60.0) and view.predictor.acc50 == 0.0
    assert view.predictor.version_to_num_records == {"fast-v3": 24, "fast-v4": 5}
    assert "(also in the window: fast-v3 (24))" in render_text(view)


def test_an_empty_cluster_renders() -> None:
    sample_status = {"redis_url": "redis://x", "prefix": "bq:", "instances": [], "dead_letters": 0,
                     "pending": {}, "dispatcher_leader": None}
    from blockq.local.top import TopSample

    frame = render_text(build_view(TopSample(time.time(), sample_status, (), None, None)))
    assert "leader none" in frame and "no scored requests yet" in frame


def test_kv_bar() -> None:
    assert kv_bar(0.5, 10) == "█████░░░░░"
    assert kv_bar(1.7, 4) == "████" and kv_bar(0.0, 4) == "░░░░" and kv_bar(None, 3) == "   "
