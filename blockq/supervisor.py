"""``blockq up``: start (embedded Redis and) every service as a child process, and
supervise them: a child that dies is reported and restarted, with backoff.

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

import structlog

from blockq.embedded_redis import EmbeddedRedis, start_embedded_redis
from blockq.state import ClusterState

log = structlog.get_logger(__name__)


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
    log_file: object | None = field(default=None, repr=False)


class Supervisor:
    """Runs children until SIGTERM/SIGINT, restarting those that die."""

    def __init__(self, state_dir: Path, specs: list[ChildSpec], *, redis_url: str | None,
                 num_instances: int, gateway_url: str | None = None) -> None:
        self.state_dir = state_dir
        self.children = [Child(spec) for spec in specs]
        self.redis_url = redis_url
        self.num_instances = num_instances
        self.gateway_url = gateway_url
        self.embedded: EmbeddedRedis | None = None
        self._stopping = False

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        if self.redis_url is None:
            self.embedded = start_embedded_redis(self.state_dir / "redis")
            self.redis_url = self.embedded.url
        state = ClusterState(supervisor_pid=os.getpid(), redis_url=self.redis_url,
                             redis_pid=self.embedded.pid if self.embedded else None,
                             embedded_redis=self.embedded is not None, gateway_url=self.gateway_url,
                             num_instances=self.num_instances, started_at_s=time.time())
        try:
            for child in self.children:
                self._start(child)
            state.children = self._child_pids()
            state.write(self.state_dir)
            while not self._stopping:
                self._restart_dead_children()
                if state.children != self._child_pids():
                    state.children = self._child_pids()
                    state.write(self.state_dir)
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

    def _start(self, child: Child) -> None:
        env = dict(os.environ, BLOCKQ_REDIS_URL=self.redis_url or "")
        log_path = self.state_dir / "logs" / f"{child.spec.name}.log"
        child.log_file = open(log_path, "ab")  # noqa: SIM115 - kept open for the child's lifetime
        child.process = subprocess.Popen([sys.executable, "-m", *child.spec.argv], env=env,
                                         stdout=child.log_file, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        log.info("child_started", child=child.spec.name, pid=child.process.pid)

    def _restart_dead_children(self) -> None:
        now_s = time.monotonic()
        for child in self.children:
            if child.process is None or child.process.poll() is None:
                continue
            if child.next_start_at_s == 0.0:
                child.num_restarts += 1
                backoff_s = min(30.0, 0.5 * 2 ** min(child.num_restarts, 6))
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
