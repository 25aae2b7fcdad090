"""A client with cells against a real Redis: each request goes to one cell by the cells'
published loads, a stale cell is avoided, nothing is lost; a dispatcher leader publishes
its cell's load."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter

import pytest
import redis

from blockq.cells import CellLoad, CellSpec
from blockq.client import AsyncClient, Client
from blockq.config import Settings
from blockq.wire.keys import PAYLOAD_FIELD, Keys
from blockq.wire.protocol import decode_request, encode
from tests.factories import make_heartbeat

CELLS = (CellSpec("{a}:"), CellSpec("{b}:"))


def front_settings(settings: Settings, **options: object) -> Settings:
    return dataclasses.replace(settings, cells=CELLS, **options)


def publish(sync_redis: redis.Redis, prefix: str, load: CellLoad) -> None:
    """What a cell's leader writes (dispatcher.cell_load.CellLoadPublisher)."""
    sync_redis.hset(Keys(prefix).cell_load, mapping=load.to_fields())


def ingress_ids(sync_redis: redis.Redis, prefix: str) -> list[str]:
    """The ids of the requests in a cell's ingress stream."""
    return [decode_request(fields[PAYLOAD_FIELD.encode()]).id
            for _, fields in sync_redis.xrange(Keys(prefix).requests)]


def test_requests_follow_the_published_load_and_none_is_lost(settings: Settings, sync_redis: redis.Redis) -> None:
    now_s = time.time()
    publish(sync_redis, "{a}:", CellLoad(now_s, 2, 40))   # 20 requests an instance
    publish(sync_redis, "{b}:", CellLoad(now_s, 2, 0))    # idle
    with Client(settings=front_settings(settings)) as client:
        handles = [client.submit(f"prompt {i}", max_tokens=4) for i in range(60)]
    cells = Counter(h.cell for h in handles)
    # b takes the first 40 alone, then the two cells are level and share what is left.
    assert cells["{b}:"] == 50 and cells["{a}:"] == 10
    for prefix in ("{a}:", "{b}:"):
        sent = {h.id for h in handles if h.cell == prefix}
        assert set(ingress_ids(sync_redis, prefix)) == sent
        assert all(h.request.reply_stream == Keys(prefix).reply(h.id) for h in handles if h.cell == prefix)


def test_a_stale_cell_is_avoided_and_a_silent_front_still_spreads(settings: Settings,
                                                                  sync_redis: redis.Redis) -> None:
    now_s = time.time()
    publish(sync_redis, "{a}:", CellLoad(now_s - 30, 8, 0))  # idle but 30 s old: its leader is gone
    publish(sync_redis, "{b}:", CellLoad(now_s, 2, 100))
    with Client(settings=front_settings(settings)) as client:
        assert {client.submit("x", max_tokens=1).cell for _ in range(10)} == {"{b}:"}
    sync_redis.delete(Keys("{a}:").cell_load, Keys("{b}:").cell_load)
    with Client(settings=front_settings(settings)) as client:  # no cell publishes: the front's own sends
        assert Counter(client.submit("x", max_tokens=1).cell for _ in range(10)) == {"{a}:": 5, "{b}:": 5}


def test_an_overloaded_cell_passes_the_request_to_the_next(settings: Settings, sync_redis: redis.Redis) -> None:
    now_s = time.time()
    publish(sync_redis, "{a}:", CellLoad(now_s, 2, 0))
    publish(sync_redis, "{b}:", CellLoad(now_s, 2, 50))
    tight = front_settings(settings, max_ingress_backlog=3)
    for _ in range(3):  # fill a's backlog from outside the front
        sync_redis.xadd(Keys("{a}:").requests, {PAYLOAD_FIELD: b"x"})
    with Client(settings=tight) as client:
        assert client.submit("x", max_tokens=1).cell == "{b}:"


async def test_the_async_client_routes_and_reads_its_cell(settings: Settings, sync_redis: redis.Redis) -> None:
    from blockq.wire.protocol import FinalRecord

    now_s = time.time()
    publish(sync_redis, "{a}:", CellLoad(now_s, 1, 5))
    publish(sync_redis, "{b}:", CellLoad(now_s, 4, 0))
    async with AsyncClient(settings=front_settings(settings)) as client:
        handles = await asyncio.gather(*(client.submit(f"p{i}", max_tokens=2) for i in range(10)))
        assert Counter(h.cell for h in handles) == {"{b}:": 10}
        handle = handles[0]
        final = FinalRecord(request_id=handle.id, index=0, status="ok", text="hi", output_tokens=1, prompt_tokens=1,
                            instance="i", finish_reason="stop")
        sync_redis.xadd(handle.request.reply_stream, {PAYLOAD_FIELD: encode(final)})
        assert (await handle.result(timeout_s=5)).text == "hi"


async def test_a_leader_publishes_its_cells_load(settings: Settings, sync_redis: redis.Redis) -> None:
    from blockq.wire.streams import connect_async
    from dispatcher.service import create_dispatcher

    cell = dataclasses.replace(settings, key_prefix="{a}:", cell_load_interval_ms=50)
    for index, instance_id in enumerate(("a0", "a1")):
        sync_redis.xadd(cell.keys.heartbeats, {PAYLOAD_FIELD: encode(make_heartbeat(instance_id, seq=index + 1))})
    dispatcher = create_dispatcher(connect_async(settings.redis_url), cell, "round_robin", seed=1,
                                   dispatcher_id="d-a")
    await dispatcher.consumer.ensure_group()
    assert await dispatcher.acquire_lease(asyncio.Event())
    await dispatcher.step()
    load = CellLoad.from_fields(sync_redis.hgetall(cell.keys.cell_load))
    assert load.num_live_instances == 2 and load.dispatcher_id == "d-a"
    assert abs(load.published_at_s - time.time()) < 5
    await dispatcher.client.aclose()


@pytest.mark.parametrize("cells", ["", "{a}: {b}:"])
def test_without_a_url_for_a_cell_the_client_says_so(cells: str) -> None:
    from blockq.config import ConfigError

    with pytest.raises(ConfigError, match="redis_url|Redis URL"):
        Client(settings=Settings.from_env({"BLOCKQ_CELLS": cells}))
