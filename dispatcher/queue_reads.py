"""Reading an instance's queue for re-placement, a chunk at a time: all of it (the
instance left), or only what its worker has not read yet (it drains: what it took runs to
the end there)."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis

from blockq.wire.keys import GROUP_WORK

Entries = list[tuple[bytes, dict[bytes, bytes]]]


async def read_chunk(client: aioredis.Redis, queue: str, count: int, *, after_id: str | None = None,
                     unread_only: bool = False) -> Entries:
    """Up to ``count`` entries of ``queue`` past ``after_id`` (None: from its start), oldest
    first. ``unread_only``: only those the ``work`` group has not delivered yet, ids past
    its last-delivered id (all of them while the group does not exist), read again at
    every chunk since a draining worker keeps reading. An entry the worker reads in the
    instant after this read is still moved safely: the request's owner moves with it, so
    the old instance's writes for it are refused."""
    start = after_id
    if unread_only:
        try:
            groups = await client.xinfo_groups(queue)
        except redis.ResponseError:  # no such stream: nothing queued
            return []
        delivered = next((_text(g["last-delivered-id"]) for g in groups if _text(g["name"]) == GROUP_WORK), None)
        if delivered is not None and (start is None or _id_key(delivered) > _id_key(start)):
            start = delivered
    return list(await client.xrange(queue, min=f"({start}" if start else "-", count=count))


def _id_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id as a sortable pair (ms, sequence)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
