"""Riding out Redis outages in a worker's loops (docs/delivery.md, "Workers").

redis-py retries a failed command a few times, within about a second; an outage longer
than that (a Redis restart loading its AOF, a Sentinel failover, a network partition)
used to end the loop that met it, and the worker process with it: with vLLM, a model
reload for a Redis restart. A worker's loops instead treat a Redis connection or timeout
error as the end of one iteration: they log the outage once, wait with a capped
exponential backoff, and try again (redis-py reconnects on the next command). Any other
exception is a bug and still ends the loop, and the worker with it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import redis
import structlog

log = structlog.get_logger(__name__)

# What an unreachable Redis raises (BusyLoadingError, a restarted Redis still loading
# its AOF, is a ConnectionError; so is a Sentinel client's "no primary found").
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 2.0


class Backoff:
    """Capped exponential waits: ``first_s``, twice that, ... up to ``max_s``."""

    def __init__(self, first_s: float = FIRST_BACKOFF_S, max_s: float = MAX_BACKOFF_S) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"backoff: need 0 < first_s <= max_s (got {first_s}, {max_s})")
        self.first_s = first_s
        self.max_s = max_s
        self._next_s = first_s

    def next_s(self) -> float:
        wait_s = self._next_s
        self._next_s = min(self.max_s, 2 * self._next_s)
        return wait_s

    def reset(self) -> None:
        self._next_s = self.first_s


class RedisOutage:
    """One loop's view of Redis being unreachable: logs the start and the end of each
    outage once (not every retry) and paces the retries."""

    def __init__(self, instance_id: str, loop: str, backoff: Backoff | None = None) -> None:
        self.instance_id = instance_id
        self.loop = loop
        self.backoff = backoff or Backoff()
        self.down_since_s: float | None = None
        self.num_outages = 0

    def note(self, error: BaseException) -> float:
        """Redis failed with ``error``: note the outage; the seconds to wait before the
        next try."""
        if self.down_since_s is None:
            self.down_since_s = time.monotonic()
            self.num_outages += 1
            log.warning("redis_unreachable", instance=self.instance_id, loop=self.loop, error=repr(error)[:200])
        return self.backoff.next_s()

    async def wait(self, error: BaseException) -> None:
        """:meth:`note`, then wait."""
        await asyncio.sleep(self.note(error))

    def ended(self) -> bool:
        """Redis answered; True when that ends an outage (the caller may need to catch up)."""
        if self.down_since_s is None:
            return False
        log.info("redis_reachable_again", instance=self.instance_id, loop=self.loop,
                 outage_s=round(time.monotonic() - self.down_since_s, 2))
        self.down_since_s = None
        self.backoff.reset()
        return True


async def run_riding_out_redis(iteration: Callable[[], Awaitable[None]], should_run: Callable[[], bool],
                               outage: RedisOutage, on_error: Callable[[], None] | None = None) -> None:
    """Run ``iteration()`` while ``should_run()``. A Redis connection or timeout error ends
    only that iteration: ``on_error`` is called (an iteration cut off may have left state
    in Redis it did not see, e.g. entries read whose reply was lost), ``outage`` waits,
    then it runs again. Any other exception propagates."""
    while should_run():
        try:
            await iteration()
        except REDIS_DOWN as exc:
            if on_error is not None:
                on_error()
            await outage.wait(exc)
            continue
        outage.ended()

