"""Consumer-group plumbing shared by every stage: reading in batches, reclaiming the
entries of dead peers, acknowledging, and the dead-letter stream.

Delivery is at-least-once: a stage writes its next hop, then ACKs (and deletes) the
entry in the same pipeline. Entries are deleted after ACK so that a stream's length is
its backlog (unread + pending), which admission control reads.

Retries are bounded: an entry delivered more than ``max_deliveries`` times (its consumer
kept dying on it, or kept failing without ACKing it) is dead-lettered instead of being
handed out again. A dead-lettered request's client is told with an error final record.
Dead letters are bounded in bytes (:mod:`blockq.wire.dead_letters`), and a group's idle,
empty consumers are deleted (:mod:`blockq.wire.consumer_sweep`).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import redis
import redis.asyncio as aioredis
import structlog

from blockq.config import Settings
from blockq.wire.connections import connect, connect_async, connect_pinned
from blockq.wire.consumer_sweep import (
    DEFAULT_IDLE_CONSUMER_MS,
    SWEEP_INTERVAL_S,
    delete_idle_consumers,
)
from blockq.wire.dead_letters import (
    DEAD_LETTER_MAX_RAW_BYTES,
    DEAD_LETTER_MAXLEN,
    MAX_REASON_CHARS,
    bound_reason,
    dead_letter_fields,
)
from blockq.wire.keys import PAYLOAD_FIELD
from blockq.wire.output import queue_final
from blockq.wire.protocol import FinalRecord, ValidationError, encode, unpack_map

# Names this module has always offered (the connection and dead-letter modules are newer).
__all__ = ["DEAD_LETTER_MAXLEN", "MAX_REASON_CHARS", "GroupConsumer", "StreamEntry", "bound_reason", "connect",
           "connect_async", "connect_pinned", "dead_letter_fields", "default_consumer_name", "ensure_group",
           "queue_redis_time", "redis_time_ms"]

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class StreamEntry:
    """One stream entry: its id and the raw payload bytes (``None`` when the entry has
    no payload field: such an entry is dead-lettered as malformed)."""

    entry_id: str
    payload: bytes | None
    fields: dict[bytes, bytes] = field(default_factory=dict, repr=False)
    num_deliveries: int = 1


# Redis' clock as the node holding KEYS[1] reads it. Beside a read of that key it dates
# the entries by the clock that stamped them; a bare TIME would go to some other node on a
# cluster (which refuses it in pipelines anyway).
_TIME_SCRIPT = "return redis.call('TIME')"


def queue_redis_time(pipe: Any, key: str) -> None:
    """Queue a read of Redis' clock, on the node that holds ``key``, on ``pipe`` (sync or
    asyncio); :func:`redis_time_ms` turns its result into milliseconds since the epoch."""
    pipe.eval(_TIME_SCRIPT, 1, key)


def redis_time_ms(reply: list[Any]) -> int:
    """Milliseconds since the epoch from a TIME reply (seconds, microseconds)."""
    return int(reply[0]) * 1000 + int(reply[1]) // 1000


def default_consumer_name(role: str, env: Mapping[str, str] | None = None) -> str:
    """The consumer name of a ``role`` process: ``BLOCKQ_CONSUMER_NAME`` when set, else
    ``{role}-{hostname}``. Stable across restarts, so that a restarted process reads its
    predecessor's pending entries at once instead of leaving them to a peer's claim after
    ``claim_idle_ms``. Two processes of one role on one host must be given distinct names:
    under one name they would share (and re-read) each other's pending entries."""
    env = os.environ if env is None else env
    return env.get("BLOCKQ_CONSUMER_NAME") or f"{role}-{socket.gethostname()}"


def _to_entries(raw_entries: list[Any]) -> list[StreamEntry]:
    entries = []
    for entry_id, fields in raw_entries:
        if fields is None:  # deleted while pending
            entries.append(StreamEntry(_text(entry_id), None))
            continue
        entries.append(StreamEntry(_text(entry_id), fields.get(PAYLOAD_FIELD.encode()), fields))
    return entries


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _claimed_entries(requested_ids: list[str], reply: list[Any]) -> list[StreamEntry]:
    """XCLAIM's reply as entries. Redis 6.2 answers nil in the place of an entry deleted
    while pending (and keeps it pending); it becomes an entry without payload, which the
    stage dead-letters, so it leaves the pending list. Redis 7 drops such entries itself."""
    if len(reply) == len(requested_ids):
        reply = [(entry_id, None) if item is None or item[0] is None else item
                 for entry_id, item in zip(requested_ids, reply, strict=True)]
    return _to_entries([item for item in reply if item is not None and item[0] is not None])


def _reply_target(payload: bytes | None, settings: Settings) -> str | None:
    """The id of the request ``payload`` holds, when its reply stream is that request's
    own (``keys.reply(id)``); None when there is no client to tell, or telling it could
    write into another request's output. The rest of the request need not be valid:
    its client still waits for an answer."""
    if payload is None:
        return None
    try:
        data = unpack_map(payload, settings.limits)
    except ValidationError:
        return None
    request_id = data.get("id")
    if (data.get("kind") != "request" or not isinstance(request_id, str) or not request_id
            or len(request_id) > settings.limits.max_id_chars):
        return None
    return request_id if data.get("reply_stream") == settings.keys.reply(request_id) else None


class GroupConsumer:
    """Reads one stream as one consumer of a consumer group (asyncio).

    The first reads return this consumer's own pending entries (left by a previous run
    under the same name), each once; after that, entries idle for ``claim_idle_ms`` are
    claimed (XCLAIM) before new entries are read. A stream with one consumer by design (a
    worker's own queue) passes ``claim_stale=False``: its pending entries are its
    in-flight work, not a dead peer's.

    An entry handed out again (own pending after a restart, or claimed) whose delivery
    count exceeds ``max_deliveries`` is dead-lettered with the reason "delivered N times
    without being processed" instead of being returned. ``settings`` (optional) gives
    ``max_deliveries`` and lets :meth:`dead_letter` tell the request's client; without it
    the limit is the default of ``Settings.max_deliveries`` and no client is told.

    Dead letters keep at most ``dead_letter_max_raw_bytes`` of an entry's payload (default:
    ``settings.dead_letter_max_bytes``; ``idle_consumer_ms`` left at its default follows
    ``settings.idle_consumer_ms``, 0 there meaning never). At
    most every ``sweep_interval_s``, a read first deletes the group's other consumers idle
    for ``idle_consumer_ms`` with no pending entries (None: never;
    :mod:`blockq.wire.consumer_sweep`). A read that finds the group gone (Redis came back
    without it) creates it again and returns nothing.
    """

    sweep_interval_s = SWEEP_INTERVAL_S

    def __init__(self, client: aioredis.Redis, stream: str, group: str, consumer: str, *,
                 dead_letter_stream: str, claim_idle_ms: int = 30_000, claim_stale: bool = True,
                 settings: Settings | None = None, max_deliveries: int | None = None,
                 dead_letter_max_raw_bytes: int | None = None,
                 idle_consumer_ms: int | None = DEFAULT_IDLE_CONSUMER_MS) -> None:
        self.client = client
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.dead_letter_stream = dead_letter_stream
        self.claim_idle_ms = claim_idle_ms
        self.claims_stale_entries = claim_stale
        self.settings = settings
        if max_deliveries is None:
            max_deliveries = Settings.max_deliveries if settings is None else settings.max_deliveries
        if max_deliveries < 1:
            raise ValueError(f"max_deliveries: must be >= 1 (got {max_deliveries})")
        self.max_deliveries = max_deliveries
        if dead_letter_max_raw_bytes is None:
            dead_letter_max_raw_bytes = DEAD_LETTER_MAX_RAW_BYTES if settings is None else settings.dead_letter_max_bytes
        if idle_consumer_ms == DEFAULT_IDLE_CONSUMER_MS and settings is not None:
            idle_consumer_ms = settings.idle_consumer_ms or None  # 0: never
        if dead_letter_max_raw_bytes < 0 or (idle_consumer_ms is not None and idle_consumer_ms < 1):
            raise ValueError("dead_letter_max_raw_bytes: must be >= 0; idle_consumer_ms: >= 1 or None")
        self.dead_letter_max_raw_bytes = dead_letter_max_raw_bytes
        self.idle_consumer_ms = idle_consumer_ms
        # Where the pass over this consumer's own pending entries has got to; None once
        # done. Reading them from "0" on every call would hand out again what is running.
        self._own_pending_cursor: str | None = "0"
        self._next_claim_at_s = 0.0
        self._next_sweep_at_s = 0.0

    async def ensure_group(self) -> None:
        """Create the group (at the stream's start) if it does not exist yet."""
        await ensure_group(self.client, self.stream, self.group)

    def reread_own_pending(self) -> None:
        """Make the next reads pass over this consumer's own pending entries again (after
        a Redis outage: a read whose reply was lost left entries pending here unseen)."""
        self._own_pending_cursor = "0"

    async def read(self, count: int, block_ms: int, *, held_ids: Collection[str] = ()) -> list[StreamEntry]:
        """Up to ``count`` entries: own pending first, then claimed stale ones, then new.

        ``held_ids``: entries the caller holds unacknowledged on purpose (work it keeps
        for later, or is running); they are never claimed back, and reading them again
        from the own pending entries does not count as a failed delivery. May return an
        empty list before ``block_ms`` when every entry of a batch was dead-lettered."""
        try:
            return await self._read(count, block_ms, held_ids)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # Redis came back without the group (no persistence, or a failover to a
            # replica that lacked it): what it held is gone; serve what comes next.
            log.warning("consumer_group_recreated", stream=self.stream, group=self.group)
            await self.ensure_group()
            return []

    async def _read(self, count: int, block_ms: int, held_ids: Collection[str]) -> list[StreamEntry]:
        if self._own_pending_cursor is not None:
            own = await self._read_own_pending(self._own_pending_cursor, count, held_ids)
            if own is not None:
                return own
        now_s = time.monotonic()
        if self.idle_consumer_ms is not None and now_s >= self._next_sweep_at_s:
            self._next_sweep_at_s = now_s + self.sweep_interval_s
            await self._sweep_idle_consumers()
        if self.claims_stale_entries and now_s >= self._next_claim_at_s:
            self._next_claim_at_s = now_s + self.claim_idle_ms / 2000
            claimed = await self.claim_stale(count, held_ids=held_ids)
            if claimed:
                return claimed
        reply = await self.client.xreadgroup(self.group, self.consumer, {self.stream: ">"},
                                             count=count, block=block_ms)
        return _to_entries(reply[0][1]) if reply else []

    async def _sweep_idle_consumers(self) -> None:
        """Delete the group's idle consumers without pending entries (housekeeping: a
        Redis that refuses the script is logged, and reads go on)."""
        try:
            deleted = await delete_idle_consumers(self.client, self.stream, self.group,
                                                  idle_ms=self.idle_consumer_ms or 0, keep=self.consumer)
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc):
                raise
            log.warning("consumer_sweep_failed", stream=self.stream, group=self.group, error=str(exc)[:200])
            return
        if deleted:
            log.info("idle_consumers_deleted", stream=self.stream, group=self.group, consumers=deleted)

    async def _read_own_pending(self, cursor: str, count: int,
                                held_ids: Collection[str] = ()) -> list[StreamEntry] | None:
        """This consumer's own pending entries after ``cursor``, each once; None when the
        pass is over."""
        reply = await self.client.xreadgroup(self.group, self.consumer, {self.stream: cursor}, count=count)
        entries = _to_entries(reply[0][1]) if reply else []
        if not entries:
            self._own_pending_cursor = None
            return None
        self._own_pending_cursor = entries[-1].entry_id
        pending = await self.client.xpending_range(self.stream, self.group, min=entries[0].entry_id,
                                                   max=entries[-1].entry_id, count=len(entries),
                                                   consumername=self.consumer)
        # A held entry read again is not a failed delivery (e.g. running through an outage).
        counts = {_text(p["message_id"]): 1 if _text(p["message_id"]) in held_ids else int(p["times_delivered"])
                  for p in pending}
        return await self._drop_over_delivered(entries, counts)

    async def claim_stale(self, count: int, *, held_ids: Collection[str] = ()) -> list[StreamEntry]:
        """Claim up to ``count`` entries left pending for longer than ``claim_idle_ms``
        (by a dead peer, or by this consumer when it failed on them without ACKing),
        except ``held_ids``."""
        pending = await self.client.xpending_range(self.stream, self.group, min="-", max="+",
                                                   count=count + len(held_ids), idle=self.claim_idle_ms)
        stale = [p for p in pending if _text(p["message_id"]) not in held_ids][:count]
        if not stale:
            return []
        ids = [_text(p["message_id"]) for p in stale]
        # XCLAIM re-checks the idle time, so of two consumers claiming at once one wins.
        reply = await self.client.xclaim(self.stream, self.group, self.consumer,
                                         min_idle_time=self.claim_idle_ms, message_ids=ids)
        entries = _claimed_entries(ids, reply)
        if entries:
            log.info("claimed_stale_entries", stream=self.stream, count=len(entries))
        counts = {_text(p["message_id"]): int(p["times_delivered"]) + 1 for p in stale}
        return await self._drop_over_delivered(entries, counts)

    async def _drop_over_delivered(self, entries: list[StreamEntry], counts: dict[str, int]) -> list[StreamEntry]:
        """Dead-letter the entries delivered more than ``max_deliveries`` times (in one
        pipeline, executed here); the others, with their delivery count."""
        kept: list[StreamEntry] = []
        pipe = self.client.pipeline(transaction=False)
        for entry in entries:
            num_deliveries = counts.get(entry.entry_id, 1)
            if num_deliveries > self.max_deliveries:
                self.dead_letter(pipe, entry, f"delivered {num_deliveries} times without being processed")
            else:
                kept.append(replace(entry, num_deliveries=num_deliveries))
        if len(pipe):
            await pipe.execute()
        return kept

    def ack(self, pipe: aioredis.client.Pipeline, entry_ids: list[str]) -> None:
        """Queue XACK + XDEL of ``entry_ids`` on ``pipe`` (the caller executes it after its
        next-hop writes, in the same pipeline)."""
        if entry_ids:
            pipe.xack(self.stream, self.group, *entry_ids)
            pipe.xdel(self.stream, *entry_ids)

    def dead_letter(self, pipe: aioredis.client.Pipeline, entry: StreamEntry, reason: str) -> None:
        """Queue the move of ``entry`` to the dead-letter stream, its ACK, and, when it
        holds a request whose reply stream is its own and ``settings`` were given, an error
        final record for its client (status and finish_reason "error", ``error`` the
        reason, cut to :data:`MAX_REASON_CHARS`). The final record is written at most once
        per request (:func:`blockq.wire.output.queue_final`), so a request that already has one
        keeps it."""
        reason = bound_reason(reason)
        fields = dead_letter_fields(self.stream, entry.entry_id, entry.payload, reason,
                                    max_raw_bytes=self.dead_letter_max_raw_bytes)
        pipe.xadd(self.dead_letter_stream, fields, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        log.warning("dead_lettered", stream=self.stream, entry_id=entry.entry_id, reason=reason)
        self._queue_error_final(pipe, entry, reason)
        self.ack(pipe, [entry.entry_id])

    def _queue_error_final(self, pipe: aioredis.client.Pipeline, entry: StreamEntry, reason: str) -> None:
        if self.settings is None:
            return
        request_id = _reply_target(entry.payload, self.settings)
        if request_id is None:
            return
        keys = self.settings.keys
        final = FinalRecord(request_id=request_id, index=0, status="error", text="", output_tokens=0,
                            prompt_tokens=0, instance="", finish_reason="error", error=reason)
        queue_final(pipe, keys, request_id, keys.reply(request_id), "", encode(final), None,
                    self.settings.reply_ttl_s)


async def ensure_group(client: aioredis.Redis, stream: str, group: str) -> None:
    """Create consumer group ``group`` on ``stream`` (and the stream) if missing."""
    try:
        await client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
