"""The dispatcher leader's lease, and writes that Redis applies only while it is held.

One leader per cluster: the lease is a key set with NX and a TTL, renewed while leading.
Its value, ``{holder id}:{token}``, is new for each term, so two dispatchers under one
consumer name never take each other's lease for their own, and renewal and release
compare it in one script (a GET then DEL could delete a successor's lease).

A leader that was paused past its lease must not place anything when it resumes: every
placement goes through :meth:`Lease.write_fenced`, a MULTI/EXEC guarded by WATCH on the
lease key whose value is checked first.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable

import redis
import redis.asyncio as aioredis
import structlog

log = structlog.get_logger(__name__)

# Errors of an unreachable Redis: the leader backs off and retries instead of exiting.
REDIS_UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError)

Pipeline = aioredis.client.Pipeline

# Renewal: extend only while we still hold it.
_RENEW_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# Release: delete only our own term's lease.
_RELEASE_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class LeaseLost(Exception):
    """This dispatcher's term is over (another holds the lease, or it expired); the write
    that found out wrote nothing."""


class Lease:
    """The lease on ``key`` for ``holder_id``; ``token`` is this term's value (None when
    not leading)."""

    def __init__(self, client: aioredis.Redis, key: str, holder_id: str, lease_ms: int, *,
                 token_factory: Callable[[], str] | None = None) -> None:
        self.client = client
        self.key = key
        self.holder_id = holder_id
        self.lease_ms = lease_ms
        # The random part of each term's lease value.
        self.token_factory = token_factory or (lambda: secrets.token_hex(6))
        self.token: str | None = None
        # Set by the first term: from then on every write checks the lease.
        self.fences_writes = False
        self._renew = client.register_script(_RENEW_LEASE)
        self._release = client.register_script(_RELEASE_LEASE)

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait until the lease is ours (True) or ``stop`` is set (False)."""
        token = f"{self.holder_id}:{self.token_factory()}"
        while not stop.is_set():
            try:
                if await self.client.set(self.key, token, nx=True, px=self.lease_ms):
                    self.token = token
                    self.fences_writes = True
                    return True
            except REDIS_UNAVAILABLE as exc:
                log.warning("dispatcher_redis_unavailable", error=str(exc))
            await asyncio.sleep(self.lease_ms / 3000)
        return False

    async def renew(self) -> bool:
        """Extend this term's lease; False when it is no longer ours (or there is no term)."""
        if self.token is None:
            return False
        return bool(await self._renew(keys=[self.key], args=[self.token, self.lease_ms]))

    async def release(self) -> bool:
        """End the term: delete the lease if it is still this term's. Returns whether a
        lease was deleted."""
        token, self.token = self.token, None
        if token is None:
            return False
        return bool(await self._release(keys=[self.key], args=[token]))

    async def write_fenced(self, queue_writes: Callable[[Pipeline], None]) -> None:
        """Apply the writes ``queue_writes`` queues on a pipeline as one MULTI/EXEC that
        Redis runs only while this term holds the lease: WATCH on the lease key, its value
        checked, then the transaction (EXEC fails if the lease changed or expired since).
        Raises :class:`LeaseLost` when the term is over; nothing was written then.

        A holder that never took the lease (a dispatcher driven step by step, as
        benchmarks and differential tests do) writes the same commands in one plain
        pipeline. Redis Cluster: one transaction's keys must share a slot; the lease,
        ``ready``, instance queues, owner keys and reply streams do, because there the key
        prefix carries a hash tag (:mod:`blockq.wire.keys`), and redis-py's cluster pipelines
        run WATCH/MULTI/EXEC on the node of that slot."""
        if not self.fences_writes:
            pipe = self.client.pipeline(transaction=False)
            queue_writes(pipe)
            await pipe.execute()
            return
        if self.token is None:
            raise LeaseLost("not leading")
        async with self.client.pipeline(transaction=True) as pipe:
            await pipe.watch(self.key)
            holder = await pipe.get(self.key)
            if holder != self.token.encode():
                raise LeaseLost(f"the lease is held by {holder!r}")
            pipe.multi()
            queue_writes(pipe)
            try:
                await pipe.execute()
            except redis.WatchError as exc:
                raise LeaseLost("the lease changed during the write") from exc
