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
the embedded Redis. So that ``down`` can always find what it started, the supervisor
records itself (``supervisor.json``) before it starts anything, rewrites ``cluster.json``
after each process it starts, and gives every child ``BLOCKQ_CLUSTER`` in its environment
(:mod:`blockq.local.state`, :mod:`blockq.local.teardown`).

Under autoscale (:class:`WorkerScaling`) it is also the local actuator of the dispatcher
leader's decisions: about once a second it reads ``autoscaler:desired`` and grows the
fleet with new one-instance worker processes (the lowest indexes no worker holds, so a
draining worker's index is never reused while it runs) or shrinks it by SIGTERM (the
worker drains: it takes nothing new, finishes what it runs; the dispatcher re-places its
unread queue), the instances named in ``autoscaler:drain`` first, then the newest. A
retired worker is not restarted when it exits, and is forgotten then; a worker that
crashes is restarted as ever.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import redis
import structlog

from blockq.local.cluster_config import WILL_NOT_START_EXIT_CODE
from blockq.local.embedded_redis import DEFAULT_MAXMEMORY, EmbeddedRedis, start_embedded_redis
from blockq.local.state import (
    CLUSTER_ENV,
    ClusterState,
    ProcessIdentity,
    cluster_marker,
    record_supervisor,
)
from blockq.wire.streams import connect

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
    """A supervised service: its name, the python -m command line and where it serves its
    Prometheus metrics (None: nowhere), recorded in the state file."""

    name: str
    argv: tuple[str, ...]
    stop_timeout_s: float = 30.0
    metrics_url: str | None = None
    env: tuple[tuple[str, str], ...] = ()  # set in its environment on top of the supervisor's


@dataclass(frozen=True)
class WorkerScaling:
    """What the supervisor needs to follow the autoscaler: the worker child serving
    instance ``index`` and that instance's id, the fleet to start with, the bounds a
    desired size is held to, the keys it reads (``desired_key``: an integer,
    ``drain_key``: JSON list of instance ids) and how often (seconds)."""

    worker_spec: Callable[[int], ChildSpec]
    instance_id: Callable[[int], str]
    initial: int
    min_instances: int
    max_instances: int
    desired_key: str
    drain_key: str
    poll_s: float = 1.0


@dataclass
class Child:
    spec: ChildSpec
    process: subprocess.Popen[bytes] | None = None
    num_restarts: int = 0
    next_start_at_s: float = 0.0
    started_at_s: float = 0.0
    log_file: IO[bytes] | None = field(default=None, repr=False)
    index: int | None = None    # the instance index of a worker the autoscaler sizes
    retired: bool = False       # drained on a scale-down: not restarted, forgotten on exit
    will_not_start: bool = False  # exited saying its options cannot work: not restarted


class Supervisor:
    """Runs children until SIGTERM/SIGINT, restarting those that die."""

    def __init__(self, state_dir: Path, specs: list[ChildSpec], *, redis_url: str | None,
                 num_instances: int, gateway_url: str | None = None,
                 redis_maxmemory: str = DEFAULT_MAXMEMORY, scaling: WorkerScaling | None = None) -> None:
        """``scaling``: the workers are sized by the autoscaler (``specs`` then holds the
        other services; the supervisor starts ``scaling.initial`` workers itself)."""
        self.state_dir = state_dir
        self.redis_maxmemory = redis_maxmemory
        self._redis_next_start_at_s = 0.0
        self.children = [Child(spec) for spec in specs]
        self.redis_url = redis_url
        self.num_instances = num_instances
        self.gateway_url = gateway_url
        self.embedded: EmbeddedRedis | None = None
        self._stopping = False
        self.scaling = scaling
        self._redis: redis.Redis | None = None
        self._scaling_seeded = False
        self._next_poll_at_s = 0.0
        # child name -> deaths in a row and the last exit code, for the state file
        self._failures: dict[str, dict[str, int]] = {}
        # Inherited by every child and by what it starts: `down` finds them all by it.
        self._marker_env = {CLUSTER_ENV: cluster_marker(state_dir)}
        if scaling is not None:
            self.children += [Child(scaling.worker_spec(index), index=index) for index in range(scaling.initial)]

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        os.umask(0o077)
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        (self.state_dir / "logs").mkdir(exist_ok=True)
        identity = ProcessIdentity.try_of(os.getpid())
        if identity is not None:  # first thing: from now on `down` finds this supervisor
            record_supervisor(self.state_dir, identity)
        try:
            state = self._start_cluster()
            while not self._stopping:
                # Redis first: services restarted before it is back would only die again.
                self._keep_redis_running()
                self._restart_dead_children()
                if self.scaling is not None:
                    self._follow_scaling(self.scaling)
                self._update_state(state)
                time.sleep(0.2)
        finally:
            if self._redis is not None:
                self._redis.close()
            self._stop_children()
            if self.embedded is not None:
                self.embedded.stop()
            ClusterState.remove(self.state_dir)
            log.info("cluster_stopped")
        return 0

    def _start_cluster(self) -> ClusterState:
        """Redis, then every child, the state file rewritten after each start so that it
        names every process as soon as it runs; a stop asked for meanwhile starts no more."""
        if self.redis_url is None:
            self.embedded = start_embedded_redis(self.state_dir / "redis", maxmemory=self.redis_maxmemory,
                                                 env=self._marker_env)
            self.redis_url = self.embedded.url
        state = ClusterState(supervisor_pid=os.getpid(), redis_url=self.redis_url,
                             embedded_redis=self.embedded is not None, gateway_url=self.gateway_url,
                             num_instances=self.num_instances, started_at_s=time.time())
        self._update_state(state, force=True)
        if self.scaling is not None:
            self._seed_scaling(self.scaling)  # before the dispatcher starts: it reads the size there
        for child in self.children:
            if self._stopping:
                break
            self._start(child)
            self._update_state(state)
        return state

    def _request_stop(self, signum: int, frame: object) -> None:
        self._stopping = True

    def _child_pids(self) -> dict[str, int]:
        return {c.spec.name: c.process.pid for c in self.children if c.process is not None}

    def _num_workers(self) -> int:
        """Workers serving or starting (retired ones, still draining, not counted)."""
        if self.scaling is None:
            return self.num_instances
        return sum(1 for c in self.children if c.index is not None and not c.retired)

    def _update_state(self, state: ClusterState, *, force: bool = False) -> None:
        """Rewrite the state file when a pid changed (a restart, a worker added or gone),
        with who each pid is."""
        redis_pid = self.embedded.pid if self.embedded else None
        if (not force and state.children == self._child_pids() and state.redis_pid == redis_pid
                and state.num_instances == self._num_workers() and state.child_failures == self._failures):
            return
        state.children = self._child_pids()
        state.child_failures = {name: dict(failure) for name, failure in self._failures.items()}
        state.metrics_urls = {c.spec.name: c.spec.metrics_url for c in self.children if c.spec.metrics_url}
        state.num_instances = self._num_workers()
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
        env = dict(os.environ, BLOCKQ_REDIS_URL=self.redis_url or "", **self._marker_env, **dict(child.spec.env))
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
        for child in list(self.children):
            if child.process is None or child.process.poll() is None:
                continue
            if child.retired:
                self._forget(child)
            elif child.will_not_start:
                continue
            elif child.process.returncode == WILL_NOT_START_EXIT_CODE:
                # the child said its options cannot work (e.g. vLLM refused the memory it was
                # given): starting it again with the same options would only fail again
                child.will_not_start = True
                self._failures[child.spec.name] = {"num_restarts": child.num_restarts,
                                                   "returncode": child.process.returncode}
                log.error("child_will_not_start", child=child.spec.name, returncode=child.process.returncode)
            elif child.next_start_at_s == 0.0:
                child.num_restarts, backoff_s = next_restart(child.num_restarts, now_s - child.started_at_s)
                child.next_start_at_s = now_s + backoff_s
                self._failures[child.spec.name] = {"num_restarts": child.num_restarts,
                                                   "returncode": child.process.returncode}
                log.error("child_died", child=child.spec.name, returncode=child.process.returncode,
                          restart_in_s=backoff_s, restarts=child.num_restarts)
            elif now_s >= child.next_start_at_s:
                child.next_start_at_s = 0.0
                self._start(child)

    # --- following the autoscaler --------------------------------------------------------

    def _client(self) -> redis.Redis:
        if self._redis is None:
            self._redis = connect(self.redis_url or "", socket_timeout=2.0, socket_connect_timeout=2.0)
        return self._redis

    def _seed_scaling(self, scaling: WorkerScaling) -> None:
        """The fleet starts at ``initial``: say so (what an earlier run left in a Redis that
        kept its data is not this fleet's size); retried by the loop until it worked."""
        try:
            pipe = self._client().pipeline(transaction=True)
            pipe.set(scaling.desired_key, scaling.initial)
            pipe.delete(scaling.drain_key)
            pipe.execute()
            self._scaling_seeded = True
        except (redis.RedisError, OSError) as exc:
            log.warning("scaling_seed_failed", error=str(exc))

    def _follow_scaling(self, scaling: WorkerScaling) -> None:
        """Once per ``poll_s``: bring the number of workers to the desired size."""
        now_s = time.monotonic()
        if now_s < self._next_poll_at_s:
            return
        self._next_poll_at_s = now_s + scaling.poll_s
        if not self._scaling_seeded:
            self._seed_scaling(scaling)
            return
        try:
            raw_desired, raw_drain = self._client().mget(scaling.desired_key, scaling.drain_key)
        except (redis.RedisError, OSError) as exc:  # Redis restarting: the next poll retries
            log.warning("scaling_poll_failed", error=str(exc))
            return
        try:
            desired = int(raw_desired) if raw_desired is not None else None
            drain = [str(i) for i in json.loads(raw_drain)] if raw_drain else []
        except (ValueError, TypeError) as exc:
            log.warning("scaling_keys_unreadable", error=str(exc))
            return
        if desired is not None:
            self._resize(scaling, min(scaling.max_instances, max(scaling.min_instances, desired)), drain)

    def _resize(self, scaling: WorkerScaling, desired: int, drain: list[str]) -> None:
        active = [c for c in self.children if c.index is not None and not c.retired]
        if desired > len(active):
            held = {c.index for c in self.children if c.index is not None}  # draining ones too
            free = (index for index in itertools.count() if index not in held)
            for index in [next(free) for _ in range(desired - len(active))]:
                child = Child(scaling.worker_spec(index), index=index)
                self.children.append(child)
                self._start(child)
                log.info("worker_added", child=child.spec.name, instance=scaling.instance_id(index), desired=desired)
        elif desired < len(active):
            by_id = {scaling.instance_id(c.index): c for c in active if c.index is not None}
            named = [by_id[i] for i in dict.fromkeys(drain) if i in by_id]
            newest = [c for c in reversed(active) if c not in named]  # children are kept in creation order
            for child in [*named, *newest][:len(active) - desired]:
                self._retire(child, desired)

    def _retire(self, child: Child, desired: int) -> None:
        """SIGTERM ``child`` (it drains) and never restart it; one not running (waiting
        for a restart) is forgotten at once."""
        child.retired = True
        if child.process is not None and child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
            log.info("worker_draining", child=child.spec.name, pid=child.process.pid, desired=desired)
        else:
            self._forget(child)

    def _forget(self, child: Child) -> None:
        self.children.remove(child)
        if child.log_file is not None:
            child.log_file.close()
        returncode = child.process.returncode if child.process is not None else None
        log.info("worker_retired", child=child.spec.name, returncode=returncode)

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
