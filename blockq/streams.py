"""Consumer-group plumbing shared by every stage: reading in batches, reclaiming the
entries of dead peers, acknowledging, and the dead-letter stream.

Delivery is at-least-once: a stage writes its next hop, then ACKs (and deletes) the
entry in the same pipeline. Entries are deleted after ACK so that a stream's length is
its backlog (unread + pending), which admission control reads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis
import structlog

from blockq.keys import PAYLOAD_FIELD

log = structlog.get_logger(__name__)

DEAD_LETTER_MAXLEN = 1_000_000


@dataclass(frozen=True)
class StreamEntry:
    """One stream entry: its id and the raw payload bytes (``None`` when the entry has
    no payload field: such an entry is dead-lettered as malformed)."""

    entry_id: str
    payload: bytes | None
    fields: dict[bytes, bytes] = field(default_factory=dict, repr=False)


def connect(url: str, **kwargs: Any) -> redis.Redis:
    """A synchronous client for ``url`` (``redis://``, ``rediss://``, ``unix://``)."""
    return redis.Redis.from_url(url, **kwargs)


def connect_async(url: str, **kwargs: Any) -> aioredis.Redis:
    """An asyncio client for ``url``."""
    return aioredis.Redis.from_url(url, **kwargs)


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


def dead_letter_fields(source_stream: str, entry_id: str, payload: bytes | None, reason: str) -> dict[str, Any]:
    """The fields of a dead-letter entry: the reason, where it came from, the raw bytes."""
    return {
        "reason": reason[:2000],
        "source": source_stream,
        "entry_id": entry_id,
        "raw": payload if payload is not None else b"",
        "at_s": f"{time.time():.6f}",
    }


class GroupConsumer:
    """Reads one stream as one consumer of a consumer group (asyncio).

    The first reads return this consumer's own pending entries (left by a previous run
    under the same name); after that, entries idle for ``claim_idle_ms`` in any consumer
    are claimed (XAUTOCLAIM) before new entries are read. A stream with one consumer by
    design (a worker's own queue) passes ``claim_stale=False``: its pending entries are
    its in-flight work, not a dead peer's.
    """

    def __init__(self, client: aioredis.Redis, stream: str, group: str, consumer: str, *,
                 dead_letter_stream: str, claim_idle_ms: int = 30_000, claim_stale: bool = True) -> None:
        self.client = client
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.dead_letter_stream = dead_letter_stream
        self.claim_idle_ms = claim_idle_ms
        self.claims_stale_entries = claim_stale
        self._reading_own_pending = True
        self._next_claim_at_s = 0.0

    async def ensure_group(self) -> None:
        """Create the group (at the stream's start) if it does not exist yet."""
        await ensure_group(self.client, self.stream, self.group)

    async def read(self, count: int, block_ms: int) -> list[StreamEntry]:
        """Up to ``count`` entries: own pending first, then claimed stale ones, then new."""
        if self._reading_own_pending:
            reply = await self.client.xreadgroup(self.group, self.consumer, {self.stream: "0"}, count=count)
            entries = _to_entries(reply[0][1]) if reply else []
            if entries:
                return entries
            self._reading_own_pending = False
        now_s = time.monotonic()
        if self.claims_stale_entries and now_s >= self._next_claim_at_s:
            self._next_claim_at_s = now_s + self.claim_idle_ms / 2000
            claimed = await self.claim_stale(count)
            if claimed:
                return claimed
        reply = await self.client.xreadgroup(self.group, self.consumer, {self.stream: ">"},
                                             count=count, block=block_ms)
        return _to_entries(reply[0][1]) if reply else []

    async def claim_stale(self, count: int) -> list[StreamEntry]:
        """Claim entries other consumers left pending for longer than ``claim_idle_ms``."""
        reply = await self.client.xautoclaim(self.stream, self.group, self.consumer,
                                             min_idle_time=self.claim_idle_ms, start_id="0-0", count=count)
        entries = _to_entries(reply[1])
        if entries:
            log.info("claimed_stale_entries", stream=self.stream, count=len(entries))
        return entries

    def ack(self, pipe: aioredis.client.Pipeline, entry_ids: list[str]) -> None:
        """Queue XACK + XDEL of ``entry_ids`` on ``pipe`` (the caller executes it after its
        next-hop writes, in the same pipeline)."""
        if entry_ids:
            pipe.xack(self.stream, self.group, *entry_ids)
            pipe.xdel(self.stream, *entry_ids)

    def dead_letter(self, pipe: aioredis.client.Pipeline, entry: StreamEntry, reason: str) -> None:
        """Queue the move of ``entry`` to the dead-letter stream, then its ACK."""
        pipe.xadd(self.dead_letter_stream, dead_letter_fields(self.stream, entry.entry_id, entry.payload, reason),
                  maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        log.warning("dead_lettered", stream=self.stream, entry_id=entry.entry_id, reason=reason)
        self.ack(pipe, [entry.entry_id])


async def ensure_group(client: aioredis.Redis, stream: str, group: str) -> None:
    """Create consumer group ``group`` on ``stream`` (and the stream) if missing."""
    try:
        await client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
