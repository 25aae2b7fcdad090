"""The cluster a chaos scenario runs on, and the faults it injects (see :mod:`loadgen.chaos`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from blockq.local.state import ClusterState
from blockq.wire.keys import PAYLOAD_FIELD, Keys
from loadgen.benches.live import stop_cluster, up_detached


@dataclass(frozen=True)
class ChaosOptions:
    """One scenario's cluster and load. Times are wall seconds from the first submit."""

    requests: int = 150
    rate_per_s: float = 8.0
    fault_at_s: float = 8.0
    instances: int = 2
    seed: int = 0
    max_output_tokens: int = 160
    answer_timeout_s: float = 90.0
    max_backlog: int | None = None

    def __post_init__(self) -> None:
        if self.requests < 1 or self.rate_per_s <= 0 or self.instances < 1:
            raise ValueError("requests, rate_per_s and instances: must be positive")


class ChaosCluster:
    """A local cluster in a private state directory, and the faults that can hit it."""

    def __init__(self, state_dir: Path, options: ChaosOptions) -> None:
        self.state_dir = state_dir
        self.options = options
        self.extra: list[subprocess.Popen[bytes]] = []

    def up(self) -> ClusterState:
        up_detached(self.state_dir, ["--instances", str(self.options.instances), "--instances-per-process", "1",
                                     "--policy", "round_robin", "--seed", str(self.options.seed)],
                    env=self.env(), timeout_s=180)
        return self.state()

    def env(self) -> dict[str, str]:
        """What the cluster's processes get in their environment besides this one's."""
        return {} if self.options.max_backlog is None else {"BLOCKQ_MAX_BACKLOG": str(self.options.max_backlog)}

    def state(self) -> ClusterState:
        state = ClusterState.read(self.state_dir)
        if state is None:
            raise RuntimeError(f"no cluster state in {self.state_dir}")
        return state

    def down(self, logs_to: Path | None = None) -> None:
        """Stop everything; with ``logs_to``, keep the services' logs there first."""
        if logs_to is not None:
            shutil.copytree(self.state_dir / "logs", logs_to, dirs_exist_ok=True)
        for process in self.extra:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.wait()
        stop_cluster(self.state_dir)

    def start_standby_dispatcher(self) -> None:
        env = {**os.environ, "BLOCKQ_LOG_LEVEL": "warning", **self.env(), "BLOCKQ_REDIS_URL": self.state().redis_url}
        log_file = open(self.state_dir / "logs" / "standby-dispatcher.log", "ab")  # noqa: SIM115 - child's lifetime
        self.extra.append(subprocess.Popen([sys.executable, "-m", "dispatcher", "--policy", "round_robin"],
                                           env=env, stdout=log_file, stderr=subprocess.STDOUT))

    def child_pid(self, name: str) -> int:
        return self.state().children[name]

    def signal_child(self, name: str, signum: int) -> int:
        pid = self.child_pid(name)
        os.kill(pid, signum)
        return pid

    async def wait_for_new_pid(self, name: str, old_pid: int, timeout_s: float = 30.0) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(KeyError, RuntimeError):
                pid = self.child_pid(name)
                if pid != old_pid:
                    return pid
            await asyncio.sleep(0.05)
        raise TimeoutError(f"{name} was not restarted within {timeout_s} s")


# --- faults ------------------------------------------------------------------------------

Fault = Callable[[ChaosCluster, redis.Redis], Awaitable[dict[str, Any]]]


async def kill_worker(cluster: ChaosCluster, client: redis.Redis) -> dict[str, Any]:
    cluster.signal_child("workers-0", signal.SIGKILL)
    return {}


async def kill_worker_twice(cluster: ChaosCluster, client: redis.Redis) -> dict[str, Any]:
    old_pid = cluster.signal_child("workers-0", signal.SIGKILL)
    new_pid = await cluster.wait_for_new_pid("workers-0", old_pid)
    await asyncio.sleep(1.5)  # the restarted worker is running what it resumed
    os.kill(new_pid, signal.SIGKILL)
    return {"second_kill_after_restart_s": 1.5}


async def kill_leader(cluster: ChaosCluster, client: redis.Redis) -> dict[str, Any]:
    cluster.signal_child("dispatcher", signal.SIGKILL)
    return {"standby": True}


async def kill_predictor(cluster: ChaosCluster, client: redis.Redis) -> dict[str, Any]:
    cluster.signal_child("predictor", signal.SIGKILL)
    return {}


async def kill_redis(cluster: ChaosCluster, client: redis.Redis) -> dict[str, Any]:
    """SIGKILL of the Redis process: what it acknowledged is in the AOF (written before
    the reply, in the page cache), so nothing is lost."""
    os.kill(_redis_pid(cluster), signal.SIGKILL)
    return {"redis_back_after_s": await _wait_for_redis(client, time.monotonic())}


async def kill_redis_losing_last_second(cluster: ChaosCluster, client: redis.Redis) -> dict[str, Any]:
    """SIGKILL of Redis as a machine crash does it under ``appendfsync everysec``: the
    last second of writes never reached the disk. Redis is frozen (SIGSTOP), its AOF cut
    back to its size a second before, then killed; the supervisor restarts it on what is
    left. Requests accepted in that second are gone with their ``submitted`` records:
    their clients must notice and submit them again (blockq.client_admission)."""
    pid = _redis_pid(cluster)
    aof = append_only_file(cluster.state_dir / "redis")
    size_synced = aof.stat().st_size
    await asyncio.sleep(1.0)  # the second that is written but not fsynced
    os.kill(pid, signal.SIGSTOP)
    num_bytes_lost = aof.stat().st_size - size_synced
    os.truncate(aof, size_synced)
    os.kill(pid, signal.SIGKILL)
    return {"redis_back_after_s": await _wait_for_redis(client, time.monotonic()),
            "aof_bytes_lost": num_bytes_lost}


def _redis_pid(cluster: ChaosCluster) -> int:
    state = cluster.state()
    if not state.redis_pid:
        raise RuntimeError("the cluster has no embedded Redis to kill")
    return state.redis_pid


def append_only_file(data_dir: Path) -> Path:
    """The AOF Redis appends to: ``appendonly.aof`` (Redis < 7), else the newest
    incremental part in ``appendonlydir`` (Redis 7's multi-part AOF)."""
    single = data_dir / "appendonly.aof"
    if single.exists():
        return single
    parts = sorted((data_dir / "appendonlydir").glob("*.incr.aof"), key=lambda path: path.stat().st_mtime)
    if not parts:
        raise RuntimeError(f"no append-only file in {data_dir}")
    return parts[-1]


async def _wait_for_redis(client: redis.Redis, killed_at_s: float, timeout_s: float = 30.0) -> float:
    """Seconds from ``killed_at_s`` until Redis answers again (the supervisor restarts it)."""
    await asyncio.sleep(0.5)
    while time.monotonic() < killed_at_s + timeout_s:
        try:
            await asyncio.to_thread(client.ping)
            return round(time.monotonic() - killed_at_s, 2)
        except redis.RedisError:
            await asyncio.sleep(0.1)
    raise TimeoutError(f"Redis did not come back within {timeout_s:.0f} s")


async def flood_malformed(cluster: ChaosCluster, client: redis.Redis) -> dict[str, Any]:
    keys = Keys()
    pipe = client.pipeline(transaction=False)
    for index in range(10_000):
        fields = {PAYLOAD_FIELD: b"\xc1not msgpack"} if index % 2 else {"junk": b"x"}
        pipe.xadd(keys.requests, fields)
    await asyncio.to_thread(pipe.execute)
    return {"malformed": 10_000}


async def pause_worker(cluster: ChaosCluster, client: redis.Redis) -> dict[str, Any]:
    pid = cluster.signal_child("workers-0", signal.SIGSTOP)
    try:
        await asyncio.sleep(10.0)
    finally:
        os.kill(pid, signal.SIGCONT)
    return {"paused_s": 10.0}


async def no_fault(cluster: ChaosCluster, client: redis.Redis) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: Fault
    options: dict[str, Any] = field(default_factory=dict)
    standby_dispatcher: bool = False


SCENARIOS = {s.name: s for s in [
    Scenario("worker_killed", kill_worker),
    Scenario("worker_killed_twice", kill_worker_twice),
    Scenario("leader_killed", kill_leader, standby_dispatcher=True),
    Scenario("predictor_killed", kill_predictor),
    Scenario("redis_killed", kill_redis),
    Scenario("redis_sigkill", kill_redis_losing_last_second),
    Scenario("malformed_flood", flood_malformed),
    Scenario("worker_paused", pause_worker),
    # Far past what 2 instances serve: the excess must be refused, not queued.
    Scenario("overload", no_fault, options={"requests": 600, "rate_per_s": 40.0, "max_backlog": 60}),
]}
