"""Secure by default: a password-protected embedded Redis configured from a private file,
private state files, no secret on any argv, JSON-only batch jobs, ``down`` that never
signals a stranger, a gateway that will not serve a network without keys, bounded logs."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis
from rq import Queue
from rq.job import JobStatus
from rq.serializers import DefaultSerializer

from blockq.config import ConfigError, Settings
from blockq.frontdoors.batch.files import BatchFilesConfig
from blockq.frontdoors.batch.jobs import JOB_SERIALIZER, fetch_batch_job, submit_batch
from blockq.frontdoors.batch.keys import BatchKeys
from blockq.frontdoors.batch.runner import BatchOptions
from blockq.frontdoors.gateway.config import GatewayConfig
from blockq.local.embedded_redis import EmbeddedRedis, start_embedded_redis
from blockq.local.state import ClusterState, ProcessIdentity
from blockq.runtime.logs import MAX_VALUE_CHARS, bound_value
from tests.conftest import REPO_ROOT, run_blockq, wait_until


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- the embedded Redis ---------------------------------------------------------------------


def test_redis_needs_its_password(redis_server: EmbeddedRedis) -> None:
    anonymous = redis.Redis(host="127.0.0.1", port=redis_server.port)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    anonymous.close()
    wrong = redis.Redis(host="127.0.0.1", port=redis_server.port, password="not-it")
    with pytest.raises(redis.AuthenticationError):
        wrong.ping()
    wrong.close()
    client = redis.Redis.from_url(redis_server.url)
    assert client.ping()
    client.close()


def test_redis_files_are_private_and_argv_holds_no_password(redis_server: EmbeddedRedis) -> None:
    data_dir = redis_server.data_dir
    for name in ("redis.password", "redis.conf", "appendonly.aof", "redis.log"):
        assert mode_of(data_dir / name) == 0o600, name
    assert (data_dir / "redis.password").read_text().strip() == redis_server.password
    assert len(redis_server.password) >= 32
    assert redis_server.password not in " ".join(map(str, redis_server.process.args))
    assert redis_server.password not in " ".join(psutil.Process(redis_server.pid).cmdline())


def test_redis_memory_is_bounded_without_eviction(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_server.url)
    assert client.config_get("maxmemory") == {"maxmemory": str(1024 ** 3)}
    assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    client.close()
    small = start_embedded_redis(tmp_path / "small", maxmemory="4mb")
    client = redis.Redis.from_url(small.url)
    try:
        with pytest.raises(redis.ResponseError, match="maxmemory"):
            for i in range(64):  # writes fail loudly once full; nothing accepted is evicted
                client.set(f"k{i}", b"x" * 512 * 1024)
        assert client.exists("k0")
    finally:
        client.close()
        small.stop()
    with pytest.raises(ConfigError, match="redis_maxmemory"):
        start_embedded_redis(tmp_path / "bad", maxmemory="lots")


def test_restart_keeps_port_password_and_data(tmp_path: Path) -> None:
    server = start_embedded_redis(tmp_path / "redis")
    try:
        client = redis.Redis.from_url(server.url)
        client.set("kept", "1")
        client.close()
        restarted = server.restart()
        assert (restarted.port, restarted.url) == (server.port, server.url)
        client = redis.Redis.from_url(restarted.url)
        assert client.get("kept") == b"1"  # SIGTERM flushed the AOF
        client.close()
        server = restarted
    finally:
        server.stop()


# --- state files and argv of a cluster --------------------------------------------------------


def test_state_file_is_private(tmp_path: Path) -> None:
    state = ClusterState(supervisor_pid=os.getpid(), redis_url="redis://:secret@127.0.0.1:1/0")
    state.write(tmp_path / "state")
    assert mode_of(tmp_path / "state" / "cluster.json") == 0o600
    assert mode_of(tmp_path / "state") == 0o700
    assert ClusterState.read(tmp_path / "state") == state


@pytest.fixture
def outside_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    server = start_embedded_redis(tmp_path / "outside-redis")
    yield server
    server.stop()


def test_detached_up_with_redis_url_keeps_it_off_argv(tmp_path: Path, outside_redis: EmbeddedRedis) -> None:
    state_dir = tmp_path / "state"
    env = {"BLOCKQ_STATE_DIR": str(state_dir), "BLOCKQ_REDIS_URL": ""}
    try:
        up = run_blockq("up", "--redis", outside_redis.url, "--instances", "1", "--time-scale", "0.1",
                        "--metrics-base-port", "0", "--detach", env=env)
        assert up.returncode == 0, up.stderr + up.stdout
        assert outside_redis.password not in up.stdout
        state = ClusterState.read(state_dir)
        assert state is not None and state.redis_url == outside_redis.url
        pids = [state.supervisor_pid, *state.children.values()]
        assert len(pids) >= 4  # supervisor, predictor, dispatcher, workers
        for pid in pids:
            assert outside_redis.password not in " ".join(psutil.Process(pid).cmdline()), pid
        assert mode_of(state_dir / "cluster.json") == 0o600
        for log_file in (state_dir / "logs").iterdir():
            assert mode_of(log_file) == 0o600, log_file
    finally:
        assert run_blockq("down", env=env).returncode == 0


# --- down never signals a stranger --------------------------------------------------------------


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def _state_naming(pid: int, identity: ProcessIdentity, state_dir: Path) -> None:
    state = ClusterState(supervisor_pid=pid, redis_url="redis://127.0.0.1:1/0",
                         identities={str(pid): identity.to_map()})
    state.write(state_dir)


def test_down_leaves_a_reused_pid_alone(tmp_path: Path, stranger: subprocess.Popen[bytes]) -> None:
    identity = wait_until(lambda: ProcessIdentity.try_of(stranger.pid))
    assert isinstance(identity, ProcessIdentity)
    # As if our supervisor had this pid and exited, and the pid went to this process.
    earlier = ProcessIdentity(identity.pid, identity.started_at_s - 100, identity.cmdline)
    _state_naming(stranger.pid, earlier, tmp_path / "state")
    down = run_blockq("down", "--timeout-s", "0.5", env={"BLOCKQ_STATE_DIR": str(tmp_path / "state")})
    assert down.returncode == 0, down.stderr
    assert "left 1 recorded pids alone" in down.stdout
    time.sleep(0.3)
    assert stranger.poll() is None


def test_down_stops_its_own_process(tmp_path: Path, stranger: subprocess.Popen[bytes]) -> None:
    identity = wait_until(lambda: ProcessIdentity.try_of(stranger.pid))
    assert isinstance(identity, ProcessIdentity)
    _state_naming(stranger.pid, identity, tmp_path / "state")
    down = run_blockq("down", "--timeout-s", "5", env={"BLOCKQ_STATE_DIR": str(tmp_path / "state")})
    assert down.returncode == 0, down.stderr
    assert stranger.wait(timeout=5) == -15  # SIGTERM


# --- batch jobs are JSON, never pickle ----------------------------------------------------------


def test_batch_job_round_trips_as_json(tmp_path: Path, sync_redis: redis.Redis, settings: Settings) -> None:
    input_path = tmp_path / "in.jsonl"
    input_path.write_text('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "hi"}}\n')
    options = BatchOptions(input_path=str(input_path), output_path=str(tmp_path / "out.jsonl"),
                           errors_path=str(tmp_path / "out.errors.jsonl"), max_rate_per_s=2.5)
    job = submit_batch(sync_redis, settings, options, BatchFilesConfig(input_root=tmp_path, output_root=tmp_path))
    raw = sync_redis.hget(f"rq:job:{job.id}", "data")
    assert raw is not None
    func_name, _instance, args, kwargs = json.loads(zlib.decompress(raw))
    assert func_name == "blockq.frontdoors.batch.runner.execute_batch_job"
    assert (args, kwargs) == ([], {"options": options.to_map()})
    fetched = fetch_batch_job(sync_redis, settings, job.id)
    assert BatchOptions.from_map(fetched.kwargs["options"]) == options
    assert fetched.meta["total"] == 1


def test_batch_worker_does_not_run_pickled_jobs(tmp_path: Path, sync_redis: redis.Redis,
                                                settings: Settings) -> None:
    marker = tmp_path / "pwned"
    queue = Queue(BatchKeys(settings.key_prefix).queue_name, connection=sync_redis, serializer=DefaultSerializer)
    job = queue.enqueue_call("os.system", args=(f"touch {marker}",))
    worker = subprocess.run([sys.executable, "-m", "blockq.frontdoors.batch", "worker", "--burst"], cwd=REPO_ROOT,
                            env={**os.environ, "BLOCKQ_REDIS_URL": settings.redis_url or ""},
                            capture_output=True, timeout=60)
    assert worker.returncode == 0, worker.stderr.decode()[-2000:]
    assert not marker.exists()
    assert sync_redis.hget(f"rq:job:{job.id}", "status") != b"finished"


def test_batch_worker_runs_no_function_but_the_batch_runner(tmp_path: Path, sync_redis: redis.Redis,
                                                             settings: Settings) -> None:
    marker = tmp_path / "pwned"
    queue = Queue(BatchKeys(settings.key_prefix).queue_name, connection=sync_redis, serializer=JOB_SERIALIZER)
    job = queue.enqueue_call("os.system", args=(f"touch {marker}",))  # JSON, as the worker reads
    worker = subprocess.run([sys.executable, "-m", "blockq.frontdoors.batch", "worker", "--burst"], cwd=REPO_ROOT,
                            env={**os.environ, "BLOCKQ_REDIS_URL": settings.redis_url or ""},
                            capture_output=True, timeout=60)
    assert worker.returncode == 0, worker.stderr.decode()[-2000:]
    assert not marker.exists()
    job.refresh()
    assert job.get_status() == JobStatus.FAILED
    assert "runs only blockq.frontdoors.batch.runner.execute_batch_job" in (job.latest_result().exc_string or "")


# --- the gateway will not serve a network without keys ------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.1.2.3", "gateway.example.com"])
def test_gateway_refuses_public_bind_without_keys(host: str) -> None:
    with pytest.raises(ConfigError, match="--allow-unauthenticated"):
        GatewayConfig(host=host)
    assert GatewayConfig(host=host, api_key_to_tenant={"sk-1": "t"}).auth_required
    assert not GatewayConfig(host=host, allow_unauthenticated=True).auth_required


@pytest.mark.parametrize("host", ["127.0.0.1", "127.5.5.5", "::1", "localhost"])
def test_gateway_serves_loopback_without_keys(host: str) -> None:
    assert GatewayConfig(host=host).host == host


def test_gateway_cli_names_the_option() -> None:
    result = subprocess.run([sys.executable, "-m", "blockq.frontdoors.gateway", "--host", "0.0.0.0"], cwd=REPO_ROOT,
                            env={**os.environ, "BLOCKQ_REDIS_URL": "redis://127.0.0.1:1/0",
                                 "BLOCKQ_GATEWAY_API_KEYS": ""},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--allow-unauthenticated" in result.stderr


# --- logs are bounded ---------------------------------------------------------------------------


def test_long_log_values_are_cut() -> None:
    code = ("from blockq.runtime.logs import configure_logging; import structlog; configure_logging('info', 'test'); "
            "structlog.get_logger().info('evil', prompt='A' * 50_000, nested={'x': ['B' * 5000]}, short='ok')")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stderr.strip().splitlines()[-1])
    assert record["prompt"] == "A" * MAX_VALUE_CHARS + f"…[{50_000 - MAX_VALUE_CHARS} chars cut]"
    assert record["nested"]["x"][0].endswith(f"…[{5000 - MAX_VALUE_CHARS} chars cut]")
    assert record["short"] == "ok"
    assert len(result.stderr) < 5000


def test_bound_value_leaves_short_values_and_other_types() -> None:
    assert bound_value("short") == "short"
    assert bound_value(12345) == 12345
    assert bound_value(("a" * 10, None), max_chars=4) == ["aaaa…[6 chars cut]", None]
