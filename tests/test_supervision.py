"""Supervision under faults: the restart backoff of a crashing child, and a real ``blockq
up`` cluster whose embedded Redis is SIGKILLed and comes back on the same port with its
data, the services reconnected and serving requests again."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from blockq.client import Client
from blockq.config import Settings
from blockq.local.cluster_config import WILL_NOT_START_EXIT_CODE
from blockq.local.state import ClusterState, ProcessIdentity
from blockq.local.supervisor import (
    HEALTHY_AFTER_S,
    MAX_BACKOFF_S,
    ChildSpec,
    Supervisor,
    next_restart,
)
from tests.conftest import run_blockq, wait_until


def test_backoff_grows_then_stays_bounded() -> None:
    num_restarts, backoffs = 0, []
    for _ in range(12):
        num_restarts, backoff_s = next_restart(num_restarts, ran_for_s=0.1)
        backoffs.append(backoff_s)
    assert backoffs[:4] == [0.5, 1.0, 2.0, 4.0]
    assert max(backoffs) == MAX_BACKOFF_S <= 5.0
    assert num_restarts == 12


def test_backoff_resets_after_a_healthy_run() -> None:
    num_restarts = 0
    for _ in range(10):  # a crash loop: the backoff is at its cap
        num_restarts, backoff_s = next_restart(num_restarts, ran_for_s=0.2)
    assert backoff_s == MAX_BACKOFF_S
    num_restarts, backoff_s = next_restart(num_restarts, ran_for_s=HEALTHY_AFTER_S + 1)
    assert (num_restarts, backoff_s) == (1, 0.5)
    # Short of healthy, the loop keeps its count.
    assert next_restart(5, ran_for_s=HEALTHY_AFTER_S - 1)[0] == 6


def test_a_child_that_says_it_will_not_start_is_not_restarted(tmp_path: Path, redis_url: str) -> None:
    """Exit status 78 (a vLLM engine refusing its memory, say) means the same options fail
    again: the supervisor records it and does not restart it; a crash is restarted."""
    (tmp_path / "logs").mkdir()
    # `python -m tests.exit_with CODE` exits with CODE at once
    specs = [ChildSpec("refusing", ("tests.exit_with", str(WILL_NOT_START_EXIT_CODE))),
             ChildSpec("crashing", ("tests.exit_with", "1"))]
    supervisor = Supervisor(tmp_path, specs, redis_url=redis_url, num_instances=0)
    refusing_child, crashing_child = supervisor.children
    for child in supervisor.children:
        supervisor._start(child)
        child.process.wait(timeout=30)
    first_refusing_pid = refusing_child.process.pid
    deadline_s = time.monotonic() + 10
    while crashing_child.num_restarts < 2 and time.monotonic() < deadline_s:
        supervisor._restart_dead_children()
        time.sleep(0.05)
    assert crashing_child.num_restarts >= 2  # a crash loop goes on, with backoff
    assert refusing_child.will_not_start and refusing_child.process.pid == first_refusing_pid
    assert supervisor._failures["refusing"]["returncode"] == WILL_NOT_START_EXIT_CODE
    for child in supervisor.children:
        if child.process.poll() is None:
            child.process.kill()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A 1-instance cluster with its own embedded Redis; always torn down."""
    state_dir = tmp_path / "state"
    env = {"BLOCKQ_STATE_DIR": str(state_dir), "BLOCKQ_REDIS_URL": ""}
    try:
        # No metrics ports: a fixed one taken by another cluster on this machine stops `up`.
        up = run_blockq("up", "--instances", "1", "--time-scale", "0.1", "--metrics-base-port", "0", "--detach",
                        "--json", env=env)
        assert up.returncode == 0, up.stderr + up.stdout
        state = ClusterState.read(state_dir)
        assert state is not None
        yield {"env": env, "state_dir": state_dir, "state": state, "report": json.loads(up.stdout)}
    finally:
        down = run_blockq("down", env=env)
        assert down.returncode == 0, down.stderr


def _ready(env: dict[str, str]) -> bool:
    status = run_blockq("status", "--json", env=env, timeout_s=30)
    if status.returncode != 0:
        return False
    data = json.loads(status.stdout)
    return data["num_live_instances"] >= 1 and bool(data["dispatcher_leader"])


def test_killed_redis_comes_back_with_its_data_and_services(cluster: dict[str, Any]) -> None:
    state: ClusterState = cluster["state"]
    before = redis.Redis.from_url(state.redis_url)
    before.set("survives-restart", "yes")
    time.sleep(1.5)  # appendfsync everysec: the write is on disk after at most a second
    before.close()
    identity = ProcessIdentity.try_of(state.redis_pid)
    assert identity is not None and identity.try_signal(signal.SIGKILL)
    killed_at_s = time.monotonic()

    def restarted() -> ClusterState | None:
        now = ClusterState.read(cluster["state_dir"])
        return now if now is not None and now.redis_pid not in (None, state.redis_pid) else None

    after_state = wait_until(restarted, timeout_s=15, interval_s=0.1)
    assert isinstance(after_state, ClusterState)
    assert after_state.redis_url == state.redis_url  # same port, same password
    after = redis.Redis.from_url(state.redis_url)
    try:
        assert after.get("survives-restart") == b"yes"
    finally:
        after.close()
    wait_until(lambda: _ready(cluster["env"]), timeout_s=30, interval_s=0.5)
    recovered_s = time.monotonic() - killed_at_s
    with Client(settings=Settings(redis_url=state.redis_url)) as client:
        final = client.submit("after the outage", max_tokens=4).result(60)
    assert final.status == "ok"
    # Redis back in about a second, services within the bounded backoff after it.
    assert recovered_s < 25, recovered_s
    assert os.path.exists(cluster["state_dir"] / "redis" / "appendonly.aof")
