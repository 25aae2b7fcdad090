"""``blockq up``: start (embedded Redis and) every service as a child process, and
supervise them: a child that dies is reported and restarted, with backoff.

Faults it recovers from in seconds:

- the embedded Redis dies: it is restarted first thing in the loop, on the same port with
  the same data directory, AOF and password, so accepted requests survive and every URL
  handed out stays valid;
- a service dies (they exit on a lost Redis connection): it is restarted after a backoff
  of 0.5, 1, 2, 4 s at most, and the backoff resets once the child has run healthy for
  :data:`HEALTHY_AFTER_S`, so a cluster whose Redis came back is whole again within
  about 10 s however many outages it had before.

Files the cluster writes (state file, logs, the Redis AOF) are created with umask 0o077.

The supervisor is the only process that owns the children; ``blockq down`` asks it to
stop (SIGTERM) and it stops workers first (they drain), then the other services, then
the embedded Redis.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import structlog

from blockq.embedded_redis import DEFAULT_MAXMEMORY, EmbeddedRedis, start_embedded_redis
from blockq.state import ClusterState, pid_alive

log = structlog.get_logger(__name__)

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 4.0
# A child that ran this long before dying was healthy: its next restart is immediate-ish.
HEALTHY_AFTER_S = 10.0
REDIS_RETRY_S = 1.0


def next_restart(num_restarts: int, ran_for_s: float) -> tuple[int, float]:
    """For a child that died after running ``ran_for_s`` with ``num_restarts`` restarts in
    a row behind it: (restarts in a row now, seconds to wait before starting it again)."""
    if ran_for_s >= HEALTHY_AFTER_S:
        num_restarts = 0  # it was healthy: this is a new fault, not a crash loop
    num_restarts += 1
    return num_restarts, min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** min(num_restarts - 1, 16))


@dataclass(frozen=True)
class ChildSpec:
    """A supervised service: its name and the python -m command line."""

    name: str
    argv: tuple[str, ...]
    stop_timeout_s: float = 30.0


@dataclass
class Child:
    spec: ChildSpec
    process: subprocess.Popen[bytes] | None = None
    num_restarts: int = 0
    next_start_at_s: float = 0.0
    started_at_s: float = 0.0
    log_file: IO[bytes] | None = field(default=None, repr=False)


class Supervisor:
    """Runs children until SIGTERM/SIGINT, restarting those that die."""

    def __init__(self, state_dir: Path, specs: list[ChildSpec], *, redis_url: str | None,
                 num_instances: int, gateway_url: str | None = None,
                 redis_maxmemory: str = DEFAULT_MAXMEMORY) -> None:
        self.state_dir = state_dir
        self.redis_maxmemory = redis_maxmemory
        self._redis_next_start_at_s = 0.0
        self.children = [Child(spec) for spec in specs]
        self.redis_url = redis_url
        self.num_instances = num_instances
        self.gateway_url = gateway_url
        self.embedded: EmbeddedRedis | None = None
        self._stopping = False

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        os.umask(0o077)
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        (self.state_dir / "logs").mkdir(exist_ok=True)
        if self.redis_url is None:
            self.embedded = start_embedded_redis(self.state_dir / "redis", maxmemory=self.redis_maxmemory)
            self.redis_url = self.embedded.url
        state = ClusterState(supervisor_pid=os.getpid(), redis_url=self.redis_url,
                             embedded_redis=self.embedded is not None, gateway_url=self.gateway_url,
                             num_instances=self.num_instances, started_at_s=time.time())
        try:
            for child in self.children:
                self._start(child)
            self._update_state(state, force=True)
            while not self._stopping:
                # Redis first: services restarted before it is back would only die again.
                self._keep_redis_running()
                self._restart_dead_children()
                self._update_state(state)
                time.sleep(0.2)
        finally:
            self._stop_children()
            if self.embedded is not None:
                self.embedded.stop()
            ClusterState.remove(self.state_dir)
            log.info("cluster_stopped")
        return 0

    def _request_stop(self, signum: int, frame: object) -> None:
        self._stopping = True

    def _child_pids(self) -> dict[str, int]:
        return {c.spec.name: c.process.pid for c in self.children if c.process is not None}

    def _update_state(self, state: ClusterState, *, force: bool = False) -> None:
        """Rewrite the state file when a pid changed (a restart), with who each pid is."""
        redis_pid = self.embedded.pid if self.embedded else None
        if not force and state.children == self._child_pids() and state.redis_pid == redis_pid:
            return
        state.children = self._child_pids()
        state.redis_pid = redis_pid
        state.record_identities()
        state.write(self.state_dir)

    def _keep_redis_running(self) -> None:
        """Restart a dead embedded Redis on its port, data directory and password."""
        if self.embedded is None or self.embedded.is_running():
            return
        now_s = time.monotonic()
        if self._redis_next_start_at_s == 0.0:
            log.error("embedded_redis_died", pid=self.embedded.pid, returncode=self.embedded.process.returncode)
        elif now_s < self._redis_next_start_at_s:
            return
        try:
            self.embedded = self.embedded.restart()
        except (RuntimeError, TimeoutError, OSError) as exc:  # e.g. the port is briefly taken
            self._redis_next_start_at_s = now_s + REDIS_RETRY_S
            log.error("embedded_redis_restart_failed", error=str(exc), retry_in_s=REDIS_RETRY_S)
            return
        self._redis_next_start_at_s = 0.0
        log.warning("embedded_redis_restarted", pid=self.embedded.pid, port=self.embedded.port)

    def _start(self, child: Child) -> None:
        env = dict(os.environ, BLOCKQ_REDIS_URL=self.redis_url or "")
        log_path = self.state_dir / "logs" / f"{child.spec.name}.log"
        if child.log_file is not None:
            child.log_file.close()
        child.log_file = open(log_path, "ab")  # noqa: SIM115 - kept open for the child's lifetime
        child.process = subprocess.Popen([sys.executable, "-m", *child.spec.argv], env=env,
                                         stdout=child.log_file, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        child.started_at_s = time.monotonic()
        log.info("child_started", child=child.spec.name, pid=child.process.pid)

    def _restart_dead_children(self) -> None:
        now_s = time.monotonic()
        for child in self.children:
            if child.process is None or child.process.poll() is None:
                continue
            if child.next_start_at_s == 0.0:
                child.num_restarts, backoff_s = next_restart(child.num_restarts, now_s - child.started_at_s)
                child.next_start_at_s = now_s + backoff_s
                log.error("child_died", child=child.spec.name, returncode=child.process.returncode,
                          restart_in_s=backoff_s, restarts=child.num_restarts)
            elif now_s >= child.next_start_at_s:
                child.next_start_at_s = 0.0
                self._start(child)

    def _stop_children(self) -> None:
        # Front doors and workers first (workers drain), the pipeline's middle last.
        for child in self.children:
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        for child in self.children:
            if child.process is None:
                continue
            try:
                child.process.wait(timeout=child.spec.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.error("child_killed", child=child.spec.name)
                child.process.kill()
                child.process.wait()


@dataclass(frozen=True)
class StopReport:
    """What :func:`stop_cluster` did: processes it had to SIGKILL, and recorded pids it left
    alone because they now belong to other processes."""

    num_killed: int
    num_unidentified: int


def stop_cluster(state_dir: Path, timeout_s: float) -> StopReport:
    """``blockq down``: SIGTERM the supervisor (it stops the rest in order), wait up to
    ``timeout_s``, then SIGKILL what is left. Only processes whose start time and command
    line match the state file are signalled: a pid reused by a stranger is never touched."""
    state = ClusterState.read(state_dir)
    if state is None:
        return StopReport(0, 0)
    owned = state.owned_processes()
    owned_pids = {identity.pid for identity in owned}
    recorded = {pid for pid in (state.supervisor_pid, state.redis_pid, *state.children.values()) if pid}
    num_unidentified = sum(1 for pid in recorded if pid not in owned_pids and pid_alive(pid))
    if num_unidentified:
        log.warning("down_pids_not_ours", pids=sorted(recorded - owned_pids))
    for identity in owned:
        if identity.pid == state.supervisor_pid:
            identity.try_signal(signal.SIGTERM)
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s and any(identity.is_alive() for identity in owned):
        time.sleep(0.05)
    num_killed = sum(1 for identity in owned if identity.try_signal(signal.SIGKILL))
    ClusterState.remove(state_dir)
    return StopReport(num_killed, num_unidentified)
