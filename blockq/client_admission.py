"""Admission of requests: the script that accepts them, and the watch that accepts again a
request Redis lost after accepting it (both used by the sync and asyncio clients).

A request is accepted when the admission script has written its entry in ``req`` and its
``submitted:{id}`` record. Redis can still lose both after replying: the AOF is fsynced
once a second (``appendfsync everysec``), so a crash of the machine loses up to the last
second, and a Sentinel failover loses what the replica had not received yet. Redis 7.2's
WAITAOF would make the client wait for the fsync; blockq runs on 6.2 and 7.0, so a
waiting client checks instead (:class:`SubmitWatch`): every ``interval_s``, and at once
after a reconnect, it asks whether ``submitted:{id}`` or ``final:{id}`` still exists
(one EXISTS). Neither means the admission was lost (a loss takes a suffix of the writes,
so everything after the admission went with it) and the request is submitted again, same
id and payload; the admission script is idempotent per id, so a check that races a
legitimate write enqueues nothing twice. Cost and choice: docs/client.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis
import structlog

from blockq.config import Settings
from blockq.wire.keys import Keys
from blockq.wire.protocol import Request, encode

log = structlog.get_logger(__name__)

# How often a waiting handle checks that its request is still known to Redis (s).
SUBMIT_CHECK_INTERVAL_S = 1.0

# Admits a batch of requests, all or none.
# KEYS: ingress stream, ready stream, instances hash, then one `submitted:{id}` key per request.
# ARGV: backlog limit, submitted-key TTL s, instance queue key head and tail (the queue of
# instance X is head..X..tail), then one payload per request.
# The backlog is every request accepted and not finished: entries are deleted on ACK, and
# a stage ACKs only once its next hop is written (the dispatcher keeps the requests it
# holds pending in `ready`), so the lengths of `req`, `ready` and every instance queue add
# up to it. A request whose id was accepted before (a client retrying, or redis-py
# re-sending the script after a lost reply) is not added again: its original entry id is
# returned, and it does not count against the limit.
# Returns the entry ids, or {-1, backlog} when the new requests would pass the limit.
# One script so that concurrent clients cannot all pass the check and then all add.
# It reads keys it is not passed (the instance queues, named by the instances hash):
# Redis Cluster allows that only within the script's slot, which the key prefix's hash
# tag puts every blockq key in (blockq.wire.keys).
ADMIT_SCRIPT = """
local num_requests = #KEYS - 3
local ids = {}
local num_new = 0
local counted = {}
for i = 1, num_requests do
  local existing = redis.call('GET', KEYS[3 + i])
  if existing then
    ids[i] = existing
  elseif not counted[KEYS[3 + i]] then
    counted[KEYS[3 + i]] = true
    num_new = num_new + 1
  end
end
if num_new > 0 then
  local backlog = redis.call('XLEN', KEYS[1]) + redis.call('XLEN', KEYS[2])
  for _, instance_id in ipairs(redis.call('HKEYS', KEYS[3])) do
    backlog = backlog + redis.call('XLEN', ARGV[3] .. instance_id .. ARGV[4])
  end
  if backlog + num_new > tonumber(ARGV[1]) then
    return {-1, backlog}
  end
end
for i = 1, num_requests do
  if not ids[i] then
    -- a second request with the same id in this batch finds the first one's key
    local existing = redis.call('GET', KEYS[3 + i])
    if existing then
      ids[i] = existing
    else
      ids[i] = redis.call('XADD', KEYS[1], '*', 'm', ARGV[4 + i])
      redis.call('SET', KEYS[3 + i], ids[i], 'EX', tonumber(ARGV[2]))
    end
  end
end
return ids
"""


class Overloaded(Exception):
    """The backlog (requests accepted and not finished: waiting in ``req``, ``ready`` or
    an instance queue, or running) is past its limit; nothing of the refused call was
    enqueued. Retry after ``retry_after_s``."""

    def __init__(self, backlog: int, limit: int, retry_after_s: float = 1.0) -> None:
        super().__init__(f"overloaded: backlog {backlog} requests, limit {limit}; retry later")
        self.backlog = backlog
        self.limit = limit
        self.retry_after_s = retry_after_s


def admission_call(requests: list[Request], settings: Settings) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of the admission script for ``requests``."""
    keys = settings.keys
    # The script builds instance queue names itself (from the instances hash): hand it the
    # parts of the name around the instance id, so that key names stay in blockq.wire.keys.
    marker = "\x00"
    queue_head, queue_tail = keys.instance_queue(marker).split(marker)
    script_keys = [keys.requests, keys.ready, keys.instances, *(keys.submitted(r.id) for r in requests)]
    args = [settings.max_ingress_backlog, settings.reply_ttl_s, queue_head, queue_tail,
            *(encode(r) for r in requests)]
    return script_keys, args


def admission_result(reply: list[Any], settings: Settings) -> list[str]:
    """The entry ids of an admission (a request accepted before: its original entry id);
    raises :class:`Overloaded` when it was refused."""
    if reply and reply[0] == -1:
        raise Overloaded(int(reply[1]), settings.max_ingress_backlog)
    return [r.decode() if isinstance(r, bytes) else r for r in reply]


class SubmitWatch:
    """When a waiting handle checks that Redis still knows its request, and what the
    check's answer means. No I/O: the handle runs ``EXISTS *check_keys`` when
    :meth:`is_due`, hands the count to :meth:`is_lost`, and when that says so submits
    the request again and reports how it went (:meth:`record_resubmit`,
    :meth:`record_refusal`: a refused resubmit, :data:`RESUBMIT_REFUSED`, is tried again
    at the next check).

    ``interval_s``: seconds between checks (the first one ``interval_s`` after the
    submit); ``clock``: monotonic seconds."""

    def __init__(self, keys: Keys, request_id: str, *, interval_s: float = SUBMIT_CHECK_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s: must be > 0 (got {interval_s})")
        self.check_keys = (keys.submitted(request_id), keys.final_flag(request_id))
        self.interval_s = interval_s
        self._clock = clock
        self._next_check_at_s = clock() + interval_s
        self.request_id = request_id
        self.num_checks = 0
        self.num_resubmits = 0

    def is_due(self) -> bool:
        return self._clock() >= self._next_check_at_s

    def after_reconnect(self) -> None:
        """Redis was unreachable: it may have restarted without the admission; check at
        the next read."""
        self._next_check_at_s = 0.0

    def is_lost(self, num_existing: int) -> bool:
        """Record a check that found ``num_existing`` of :attr:`check_keys`; True when the
        request must be submitted again (neither its submit record nor a final record is
        left). The next check is ``interval_s`` from now either way: a resubmit refused
        (Overloaded, Redis down) is tried again then."""
        self.num_checks += 1
        self._next_check_at_s = self._clock() + self.interval_s
        return int(num_existing) == 0

    def record_resubmit(self) -> None:
        self.num_resubmits += 1
        log.warning("request_resubmitted", request_id=self.request_id, reason="admission lost by Redis")

    def record_refusal(self, error: Exception) -> None:
        log.warning("resubmit_refused", request_id=self.request_id, error=str(error)[:200])


# A resubmit refused for now (the backlog is full, Redis refuses writes at maxmemory):
# the handle waits on, and the next check tries again.
RESUBMIT_REFUSED = (Overloaded, redis.ResponseError)
