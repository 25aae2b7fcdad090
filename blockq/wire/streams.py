"""Consumer-group plumbing shared by every stage: reading in batches, reclaiming the
entries of dead peers, acknowledging, and the dead-letter stream.

Delivery is at-least-once: a stage writes its next hop, then ACKs (and deletes) the
entry in the same pipeline. Entries are deleted after ACK so that a stream's length is
its backlog (unread + pending), which admission control reads.

Retries are bounded: an entry delivered more than ``max_deliveries`` times (its consumer
kept dying on it, or kept failing without ACKing it) is dead-lettered instead of being
handed out again. A dead-lettered request's client is told with an error final record.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel
import structlog

from blockq.config import Settings
from blockq.wire.keys import PAYLOAD_FIELD
from blockq.wire.output import queue_final
from blockq.wire.protocol import FinalRecord, ValidationError, encode, unpack_map
from blockq.wire.redis_url import RedisTarget, parse_redis_url

log = structlog.get_logger(__name__)

DEAD_LETTER_MAXLEN = 1_000_000
# Reasons often embed an exception message, which can embed the input: keep them short
# enough for a log line, a dead-letter entry and a client's error field.
MAX_REASON_CHARS = 500


@dataclass(frozen=True)
class StreamEntry:
    """One stream entry: its id and the raw payload bytes (``None`` when the entry has
    no payload field: such an entry is dead-lettered as malformed)."""

    entry_id: str
    payload: bytes | None
    fields: dict[bytes, bytes] = field(default_factory=dict, repr=False)
    num_deliveries: int = 1


def connect(url: str, **kwargs: Any) -> redis.Redis:
    """A synchronous client for ``url``, in any form of :mod:`blockq.wire.redis_url`: a plain
    client for one server; for Sentinel, one that asks the Sentinels for the primary at
    each (re)connect and drops its connections when the primary changes (``master_for``);
    for a cluster, a ``RedisCluster`` (typed ``redis.Redis`` here: blockq uses the commands
    both have). ``kwargs``: client options (``socket_timeout``, ``max_connections`` (per
    node on a cluster), ...), over those of the URL. The one place clients are built."""
    target = parse_redis_url(url)
    if target.kind == "server":
        return redis.Redis.from_url(url, **kwargs)
    options = {**_node_options(target), **kwargs}
    if target.kind == "sentinel":
        sentinel = redis.sentinel.Sentinel(list(target.nodes), sentinel_kwargs=_sentinel_options(target, options))
        return sentinel.master_for(target.service_name or "", **options)
    return redis.RedisCluster(startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in target.nodes],
                              **options)  # type: ignore[return-value]


def connect_async(url: str, *, wait_for_connection: bool = False, **kwargs: Any) -> aioredis.Redis:
    """The asyncio twin of :func:`connect`. ``wait_for_connection``: a call that finds
    ``max_connections`` in use waits for one to be free instead of failing (one server
    and Sentinel; a cluster client has no such pool, and fails past ``max_connections``
    connections to one node)."""
    target = parse_redis_url(url)
    if target.kind == "server":
        if wait_for_connection:
            return aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(url, timeout=None,
                                                                                           **kwargs))
        return aioredis.Redis.from_url(url, **kwargs)
    options = {**_node_options(target), **kwargs}
    if target.kind == "sentinel":
        sentinel = aioredis.sentinel.Sentinel(list(target.nodes), sentinel_kwargs=_sentinel_options(target, options))
        pool_class = _BlockingSentinelPool if wait_for_connection else aioredis.sentinel.SentinelConnectionPool
        extra = {"timeout": None} if wait_for_connection else {}
        return sentinel.master_for(target.service_name or "", connection_pool_class=pool_class, **options, **extra)
    return aioredis.RedisCluster(startup_nodes=[aioredis.cluster.ClusterNode(h, p) for h, p in target.nodes],
                                 **options)  # type: ignore[return-value]


def connect_pinned(url: str, key: str, **kwargs: Any) -> redis.Redis:
    """A synchronous plain client (its own connection pool, real MULTI/EXEC) whose
    connections go to the primary serving ``key``'s slot, for libraries that cannot use a
    cluster client (rq: it reads its client's pool and runs transactions over its own
    keys). Every key it touches must hash to that slot (share ``key``'s hash tag). Each new
    connection asks the cluster where the slot is; a ``MOVED``, ``ASK``, ``TRYAGAIN`` or
    ``CLUSTERDOWN`` reply (a failover or a resharding moved it) drops the connection as a
    ConnectionError, so the library's reconnect finds the slot's new primary. One server
    or Sentinel: :func:`connect` (its keys are all on the one primary anyway)."""
    target = parse_redis_url(url)
    if not target.is_cluster:
        return connect(url, **kwargs)
    options = {**_node_options(target), **kwargs}
    locator = connect(url, **{k: v for k, v in options.items() if k != "max_connections"})
    slot = locator.keyslot(key)  # type: ignore[attr-defined]

    def locate_primary() -> tuple[str, int]:
        locator.nodes_manager.initialize()  # type: ignore[attr-defined]  # the slot map as it is now
        node = locator.nodes_manager.get_node_from_slot(slot)  # type: ignore[attr-defined]
        return node.host, node.port

    connection_class = _SlotPrimarySSLConnection if options.pop("ssl", False) else _SlotPrimaryConnection
    pool = redis.ConnectionPool(connection_class=connection_class, locate_primary=locate_primary, **options)
    return redis.Redis(connection_pool=pool)


def _node_options(target: RedisTarget) -> dict[str, Any]:
    """The data-node connection options of a Sentinel or cluster URL, parsed by redis-py
    (types, TLS options) from the equivalent one-server URL; TLS as ``ssl=True``, which
    the Sentinel and cluster clients turn into their own connection classes."""
    options = dict(redis.connection.parse_url(target.node_url()))
    for name in ("host", "port", "connection_class"):
        options.pop(name, None)
    if target.tls:
        options["ssl"] = True
    if target.is_cluster:
        options.pop("db", None)
    return options


def _sentinel_options(target: RedisTarget, options: dict[str, Any]) -> dict[str, Any]:
    """How to reach the Sentinels: the data nodes' socket and TLS options, and the
    Sentinels' own credentials (none unless the URL's ``sentinel_*`` options give them)."""
    shared = {k: v for k, v in options.items() if k.startswith(("socket_", "ssl"))}
    own = {name.removeprefix("sentinel_"): value for name, value in target.sentinel_options}
    return {**shared, **own}


class _BlockingSentinelPool(aioredis.sentinel.SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Sentinel's pool (connections to the current primary) with the blocking pool's
    wait for a free connection past ``max_connections``."""


class _SlotPrimaryConnection(redis.Connection):
    """A connection to whichever primary serves one slot (see :func:`connect_pinned`)."""

    def __init__(self, *, locate_primary: Callable[[], tuple[str, int]], **kwargs: Any) -> None:
        self._locate_primary = locate_primary
        super().__init__(**kwargs)

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if not self._sock:
            self.host, self.port = self._locate_primary()
        super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except (redis.exceptions.AskError, redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError) as exc:
            self.disconnect()
            raise redis.ConnectionError(f"the slot moved: {exc}") from exc


class _SlotPrimarySSLConnection(_SlotPrimaryConnection, redis.SSLConnection):
    """:class:`_SlotPrimaryConnection` over TLS."""


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


def dead_letter_fields(source_stream: str, entry_id: str, payload: bytes | None, reason: str) -> dict[str, Any]:
    """The fields of a dead-letter entry: the reason (at most :data:`MAX_REASON_CHARS`),
    where it came from, the raw bytes."""
    return {
        "reason": bound_reason(reason),
        "source": source_stream,
        "entry_id": entry_id,
        "raw": payload if payload is not None else b"",
        "at_s": f"{time.time():.6f}",
    }


def bound_reason(reason: str) -> str:
    """``reason`` cut to :data:`MAX_REASON_CHARS` characters."""
    return reason if len(reason) <= MAX_REASON_CHARS else reason[:MAX_REASON_CHARS - 3] + "..."


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
    """

    def __init__(self, client: aioredis.Redis, stream: str, group: str, consumer: str, *,
                 dead_letter_stream: str, claim_idle_ms: int = 30_000, claim_stale: bool = True,
                 settings: Settings | None = None, max_deliveries: int | None = None) -> None:
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
        # Where the pass over this consumer's own pending entries has got to; None once
        # done. Reading them from "0" on every call would hand out again what is running.
        self._own_pending_cursor: str | None = "0"
        self._next_claim_at_s = 0.0

    async def ensure_group(self) -> None:
        """Create the group (at the stream's start) if it does not exist yet."""
        await ensure_group(self.client, self.stream, self.group)

    async def read(self, count: int, block_ms: int, *, held_ids: Collection[str] = ()) -> list[StreamEntry]:
        """Up to ``count`` entries: own pending first, then claimed stale ones, then new.

        ``held_ids``: entries the caller holds unacknowledged on purpose (work it keeps
        for later); they are never claimed back, so holding them does not count as a
        failed delivery. May return an empty list before ``block_ms`` when every entry of
        a batch was dead-lettered."""
        if self._own_pending_cursor is not None:
            own = await self._read_own_pending(self._own_pending_cursor, count)
            if own is not None:
                return own
        now_s = time.monotonic()
        if self.claims_stale_entries and now_s >= self._next_claim_at_s:
            self._next_claim_at_s = now_s + self.claim_idle_ms / 2000
            claimed = await self.claim_stale(count, held_ids=held_ids)
            if claimed:
                return claimed
        reply = await self.client.xreadgroup(self.group, self.consumer, {self.stream: ">"},
                                             count=count, block=block_ms)
        return _to_entries(reply[0][1]) if reply else []

    async def _read_own_pending(self, cursor: str, count: int) -> list[StreamEntry] | None:
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
        counts = {_text(p["message_id"]): int(p["times_delivered"]) for p in pending}
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
        pipe.xadd(self.dead_letter_stream, dead_letter_fields(self.stream, entry.entry_id, entry.payload, reason),
                  maxlen=DEAD_LETTER_MAXLEN, approximate=True)
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
