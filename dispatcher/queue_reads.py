"""Reading an instance's queue for re-placement: all of it (the instance left), or only
what its worker has not read yet (it drains: what it took runs to the end there)."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis

from blockq.wire.keys import GROUP_WORK

MAX_ENTRIES = 100_000

Entries = list[tuple[bytes, dict[bytes, bytes]]]


async def read_queue(client: aioredis.Redis, queue: str, *, unread_only: bool = False) -> Entries:
    """The entries of ``queue`` (at most :data:`MAX_ENTRIES`), oldest first. ``unread_only``:
    those the ``work`` group has not delivered yet, ids past its last-delivered id (all of
    them while the group does not exist). An entry the worker reads in the instant after
    this read is still moved safely: the request's owner moves with it, so the old
    instance's writes for it are refused."""
    if not unread_only:
        return list(await client.xrange(queue, count=MAX_ENTRIES))
    try:
        groups = await client.xinfo_groups(queue)
    except redis.ResponseError:  # no such stream: nothing queued
        return []
    last = next((_text(g["last-delivered-id"]) for g in groups if _text(g["name"]) == GROUP_WORK), None)
    return list(await client.xrange(queue, min=f"({last}" if last else "-", count=MAX_ENTRIES))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
