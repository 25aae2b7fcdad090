"""Batch jobs end to end: a real ``blockq up`` cluster, real rq workers (``python -m
blockq.frontdoors.batch worker``) started, killed and replaced by the tests, and the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from blockq.config import Settings
from blockq.frontdoors.batch.jobs import batch_status
from blockq.frontdoors.batch.keys import BatchKeys
from blockq.local.state import ClusterState
from tests.conftest import REPO_ROOT, run_blockq, wait_until

LEASE_S = 2.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A 2-instance cluster at time scale 0.1, without a batch worker; always torn down."""
    state_dir = tmp_path_factory.mktemp("batch") / "state"
    env = {"BLOCKQ_STATE_DIR": str(state_dir), "BLOCKQ_REDIS_URL": "", "BLOCKQ_BATCH_LEASE_S": str(LEASE_S),
           # the jobs' files live in pytest's temporary directory: the worker's and submit's root
           "BLOCKQ_BATCH_INPUT_ROOT": str(tmp_path_factory.getbasetemp())}
    try:
        up = run_blockq("up", "--instances", "2", "--time-scale", "0.1", "--metrics-base-port", "0", "--detach", "--json",
                        env=env)
        assert up.returncode == 0, up.stderr + up.stdout
        state = ClusterState.read(state_dir)
        assert state is not None
        settings = Settings(redis_url=state.redis_url)
        yield {"env": env, "settings": settings, "redis": redis.Redis.from_url(state.redis_url),
               "logs": state_dir / "logs"}
    finally:
        down = run_blockq("down", env=env)
        assert down.returncode == 0, down.stderr


@pytest.fixture
def workers(cluster: dict[str, Any]) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Batch worker processes started by a test; stopped (then killed) afterwards."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in started:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def start_worker(cluster: dict[str, Any], workers: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    log_file = open(cluster["logs"] / f"test-batch-worker-{len(workers)}.log", "ab")  # noqa: SIM115
    process = subprocess.Popen([sys.executable, "-m", "blockq.frontdoors.batch", "worker"], cwd=REPO_ROOT,
                               env={**os.environ, **cluster["env"]}, stdout=log_file, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL)
    log_file.close()
    workers.append(process)
    return process


def write_input(path: Path, num_lines: int, invalid_at: tuple[int, ...] = ()) -> Path:
    with path.open("w") as file:
        for i in range(num_lines):
            if i in invalid_at:
                file.write('{"custom_id": "broken", "url": "/v1/completions"\n')
                continue
            if i % 2:
                url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"question {i}"}]}
            else:
                url, body = "/v1/completions", {"prompt": f"prompt number {i}"}
            body.update(model="blockq", max_tokens=1 + i % 3)
            file.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}) + "\n")
    return path


def submit(cluster: dict[str, Any], input_path: Path, out: Path, *extra: str) -> str:
    result = run_blockq("batch", "submit", str(input_path), "--out", str(out), *extra, "--json", env=cluster["env"])
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["status"] == "queued" and report["total"] > 0
    return str(report["job_id"])


def status_of(cluster: dict[str, Any], job_id: str) -> dict[str, Any]:
    return batch_status(cluster["redis"], cluster["settings"], job_id)


def read_results(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_thousand_line_job_survives_a_killed_worker(cluster: dict[str, Any], workers: list[Any],
                                                    tmp_path: Path) -> None:
    input_path = write_input(tmp_path / "in.jsonl", 1000)
    first = start_worker(cluster, workers)
    # 100 lines/s: ten seconds of work, so the kill lands mid-job even on a busy host.
    job_id = submit(cluster, input_path, tmp_path / "out.jsonl", "--max-rate", "100")

    wait_until(lambda: status_of(cluster, job_id)["done"] >= 200, timeout_s=30)
    # read in process, not through a CLI process: a busy host can take seconds to start one,
    # and the job must still be running when the kill lands (the CLI is read at the end)
    running = status_of(cluster, job_id)
    assert running["status"] == "started" and running["total"] == 1000
    assert 0 < running["done"] < 1000 and running["failed"] == 0

    first.kill()  # SIGKILL mid-job: no chance to hand the job back
    first.wait()
    lease_key = BatchKeys(cluster["settings"].key_prefix).lease(job_id)
    wait_until(lambda: not cluster["redis"].exists(lease_key), timeout_s=3 * LEASE_S)  # its horse died too
    done_at_kill = status_of(cluster, job_id)["done"]
    assert done_at_kill < 1000

    second = start_worker(cluster, workers)
    wait_until(lambda: status_of(cluster, job_id)["status"] == "finished", timeout_s=60, interval_s=0.1)
    log_text = (cluster["logs"] / f"test-batch-worker-{workers.index(second)}.log").read_text()
    assert '"batch_job_recovered"' in log_text and '"resumed": true' in log_text
    result = run_blockq("batch", "status", job_id, "--json", env=cluster["env"])
    assert result.returncode == 0, result.stderr
    final = json.loads(result.stdout)
    assert (final["status"], final["done"], final["failed"], final["total"]) == ("finished", 1000, 0, 1000)
    results = read_results(tmp_path / "out.jsonl")
    assert [r["custom_id"] for r in results] == [f"req-{i}" for i in range(1000)]  # in order, no duplicates
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in results)
    assert results[1]["response"]["body"]["object"] == "chat.completion"
    assert results[2]["response"]["body"]["usage"]["completion_tokens"] == 3
    assert (tmp_path / "out.errors.jsonl").read_text() == ""


def test_sigterm_hands_the_job_back_and_invalid_lines_are_reported(cluster: dict[str, Any], workers: list[Any],
                                                                   tmp_path: Path) -> None:
    # 6 s of work at 60 lines/s: the SIGTERM lands mid-job on a busy host too.
    input_path = write_input(tmp_path / "in.jsonl", 360, invalid_at=(5, 77))
    first = start_worker(cluster, workers)
    job_id = submit(cluster, input_path, tmp_path / "out.jsonl", "--max-rate", "60", "--priority", "interactive")
    wait_until(lambda: status_of(cluster, job_id)["done"] >= 20, timeout_s=30)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=10) == 0
    assert status_of(cluster, job_id)["status"] == "queued"  # handed back at once, not failed

    start_worker(cluster, workers)
    wait_until(lambda: status_of(cluster, job_id)["status"] == "finished", timeout_s=30, interval_s=0.1)
    status = status_of(cluster, job_id)
    assert (status["done"], status["failed"], status["total"]) == (358, 2, 360)
    results = read_results(tmp_path / "out.jsonl")
    assert [r["custom_id"] for r in results] == [f"req-{i}" for i in range(360) if i not in (5, 77)]
    errors = read_results(tmp_path / "out.errors.jsonl")
    assert [(e["line"], e["error"]["code"]) for e in errors] == [(6, "invalid_json"), (78, "invalid_json")]


def test_cancel_stops_a_running_job(cluster: dict[str, Any], workers: list[Any], tmp_path: Path) -> None:
    # 30 s of work at 50 lines/s: the cancel (a CLI process) lands mid-job on a busy host too.
    input_path = write_input(tmp_path / "in.jsonl", 1500)
    start_worker(cluster, workers)
    job_id = submit(cluster, input_path, tmp_path / "out.jsonl", "--max-rate", "50")
    wait_until(lambda: status_of(cluster, job_id)["done"] >= 10, timeout_s=30)
    result = run_blockq("batch", "cancel", job_id, "--json", env=cluster["env"])
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["status"] == "canceled" and report["canceled"] and report["done"] < 1500
    results = read_results(tmp_path / "out.jsonl")
    assert len(results) == report["done"]
    order = [int(r["custom_id"].split("-")[1]) for r in results]
    assert order == sorted(order)

    missing = run_blockq("batch", "status", "no-such-job", env=cluster["env"])
    assert missing.returncode == 1 and "no batch job" in missing.stderr
