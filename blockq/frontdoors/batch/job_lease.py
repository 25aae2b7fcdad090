"""A batch job's lease: a key with a TTL that the process running the job refreshes from a
thread. A worker that finds a started job without a lease re-enqueues it
(:mod:`blockq.frontdoors.batch.worker`)."""

from __future__ import annotations

import os
import threading
import time

import redis
import structlog

from blockq.config import ConfigError

log = structlog.get_logger(__name__)

DEFAULT_LEASE_S = 30.0


def lease_s_from_env() -> float:
    """``BLOCKQ_BATCH_LEASE_S``: how long a dead job's lease outlives it (default 30 s)."""
    raw = os.environ.get("BLOCKQ_BATCH_LEASE_S") or str(DEFAULT_LEASE_S)
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"BLOCKQ_BATCH_LEASE_S: must be a number of seconds (got {raw!r})") from None
    if value < 0.5:
        raise ConfigError(f"BLOCKQ_BATCH_LEASE_S: must be >= 0.5 (got {value})")
    return value


# Refreshes the lease if this process still holds it (or nobody does); 0 when lost.
_REFRESH_LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""


class LeaseKeeper:
    """Holds ``key`` for this process, refreshing it every third of ``lease_s`` in a thread
    (so that a busy event loop cannot let it lapse). ``lost`` is set if another holder
    took it."""

    def __init__(self, client: redis.Redis, key: str, lease_s: float) -> None:
        self.client = client
        self.key = key
        self.lease_ms = int(lease_s * 1000)
        self.token = f"{os.uname().nodename}:{os.getpid()}:{time.time_ns()}"
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._script = client.register_script(_REFRESH_LEASE)
        self._thread = threading.Thread(target=self._run, name="batch-lease", daemon=True)

    def start(self) -> None:
        """Take the lease, waiting up to one and a half lease periods for a previous
        holder's lease to lapse (a killed holder cannot refresh it)."""
        deadline_s = time.monotonic() + 1.5 * self.lease_ms / 1000
        while not self._script(keys=[self.key], args=[self.token, self.lease_ms]):
            if time.monotonic() > deadline_s:
                raise RuntimeError(f"batch job lease {self.key} is held by another live process")
            time.sleep(0.1)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.lease_ms / 3000):
            try:
                if not self._script(keys=[self.key], args=[self.token, self.lease_ms]):
                    log.error("batch_lease_lost", key=self.key)
                    self.lost.set()
                    return
            except redis.RedisError:
                log.warning("batch_lease_refresh_failed", key=self.key, exc_info=True)

    def release(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.client.get(self.key) == self.token.encode():
            self.client.delete(self.key)
