"""The dispatcher under crashes, pauses and outages, against a real Redis: owner keys
move with every placement, a leader whose term is over writes nothing, silence the
dispatcher could not hear kills no instance, stopped instances' queues are emptied, and
a restarted dispatcher resumes its predecessor's pending entries at once."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import replace

import msgpack
import pytest
import redis

from blockq.config import Settings
from blockq.wire.keys import GROUP_DISPATCH, GROUP_WORK, PAYLOAD_FIELD
from blockq.wire.output import FENCED, WRITTEN, queue_chunk
from blockq.wire.protocol import encode
from blockq.wire.streams import connect_async, ensure_group
from dispatcher.service import Dispatcher, DispatcherOptions, LeaseLost, create_dispatcher
from tests.factories import make_heartbeat, make_request
from tests.test_dispatcher_service import queue_ids

_seq = itertools.count(1)


def beat(sync_redis: redis.Redis, settings: Settings, instance_id: str, state: str = "live") -> None:
    sync_redis.xadd(settings.keys.heartbeats,
                    {PAYLOAD_FIELD: encode(make_heartbeat(instance_id, seq=next(_seq), state=state))})


def submit(sync_redis: redis.Redis, settings: Settings, count: int) -> list[str]:
    requests = [make_request(keys=settings.keys) for _ in range(count)]
    for request in requests:
        sync_redis.xadd(settings.keys.ready, {PAYLOAD_FIELD: encode(request)})
    return [r.id for r in requests]


async def make_dispatcher(settings: Settings, name: str = "d-test", **options: object) -> Dispatcher:
    dispatcher = create_dispatcher(connect_async(settings.redis_url), settings, "round_robin", seed=1,
                                   dispatcher_id=name, options=DispatcherOptions(**options))
    await dispatcher.consumer.ensure_group()
    return dispatcher


async def lead(dispatcher: Dispatcher) -> None:
    assert await dispatcher.acquire_lease(asyncio.Event())


def owner(sync_redis: redis.Redis, settings: Settings, request_id: str) -> bytes | None:
    return sync_redis.get(settings.keys.owner(request_id))  # type: ignore[return-value]


async def test_placement_sets_owner_with_reply_ttl(settings: Settings, sync_redis: redis.Redis) -> None:
    beat(sync_redis, settings, "a")
    beat(sync_redis, settings, "b")
    dispatcher = await make_dispatcher(settings)
    await lead(dispatcher)
    ids = submit(sync_redis, settings, 4)
    while dispatcher.num_placed < 4:
        await dispatcher.step()
    for instance_id in ("a", "b"):
        for request_id in queue_ids(sync_redis, settings, instance_id):
            assert owner(sync_redis, settings, request_id) == instance_id.encode()
            assert 0 < sync_redis.ttl(settings.keys.owner(request_id)) <= settings.reply_ttl_s
    assert sorted(queue_ids(sync_redis, settings, "a") + queue_ids(sync_redis, settings, "b")) == sorted(ids)
    await dispatcher.client.aclose()


async def test_dead_instance_taken_entries_move_with_their_owner(settings: Settings, sync_redis: redis.Redis) -> None:
    beat(sync_redis, settings, "a")
    beat(sync_redis, settings, "b")
    dispatcher = await make_dispatcher(settings, dead_after_s=0.3)
    await lead(dispatcher)
    queue_a = settings.keys.instance_queue("a")
    await ensure_group(dispatcher.client, queue_a, GROUP_WORK)
    ids = submit(sync_redis, settings, 6)
    while dispatcher.num_placed < 6:
        await dispatcher.step()
    on_a = queue_ids(sync_redis, settings, "a")
    # "a" takes two of its entries (they are running there), then falls silent.
    sync_redis.xreadgroup(GROUP_WORK, "a", {queue_a: ">"}, count=2)
    assert sync_redis.xpending(queue_a, GROUP_WORK)["pending"] == 2
    deadline = time.monotonic() + 5
    while queue_ids(sync_redis, settings, "a"):
        assert time.monotonic() < deadline, "the dead instance's queue was not re-placed"
        beat(sync_redis, settings, "b")
        await dispatcher.step()
        await asyncio.sleep(0.05)
    assert dispatcher.view.instances["a"].health == "dead"
    assert sorted(queue_ids(sync_redis, settings, "b")) == sorted(ids)
    assert sync_redis.xpending(queue_a, GROUP_WORK)["pending"] == 0  # a returning "a" does not resume them
    assert all(owner(sync_redis, settings, request_id) == b"b" for request_id in ids)
    # "a" was only paused: its late write for a request it had taken is refused.
    pipe = sync_redis.pipeline(transaction=False)
    queue_chunk(pipe, settings.keys, on_a[0], settings.keys.reply(on_a[0]), "a", b"late", 60)
    queue_chunk(pipe, settings.keys, on_a[0], settings.keys.reply(on_a[0]), "b", b"new", 60)
    assert pipe.execute() == [FENCED, WRITTEN]
    await dispatcher.client.aclose()


async def test_leader_whose_lease_is_taken_writes_nothing_and_stands_by(settings: Settings,
                                                                       sync_redis: redis.Redis) -> None:
    beat(sync_redis, settings, "a")
    dispatcher = await make_dispatcher(settings)
    await lead(dispatcher)
    sync_redis.set(settings.keys.dispatcher_lease, "someone-else")  # our term ended while we were paused
    (request_id,) = submit(sync_redis, settings, 1)
    with pytest.raises(LeaseLost):
        await dispatcher.step()
    assert queue_ids(sync_redis, settings, "a") == []
    assert owner(sync_redis, settings, request_id) is None
    assert sync_redis.xpending(settings.keys.ready, GROUP_DISPATCH)["pending"] == 1  # left for the next leader
    assert sync_redis.get(settings.keys.dispatcher_lease) == b"someone-else"
    # Through the loop: the term ends, the batch in hand is dropped, nothing is written.
    await dispatcher.client.aclose()
    sync_redis.delete(settings.keys.dispatcher_lease)
    beat(sync_redis, settings, "a", state="stopped")
    dispatcher = await make_dispatcher(settings)
    await lead(dispatcher)
    await dispatcher.step()  # takes the pending entry (no live instance: held)
    assert len(dispatcher.unplaced) == 1
    sync_redis.set(settings.keys.dispatcher_lease, "someone-else")
    beat(sync_redis, settings, "a")
    await asyncio.wait_for(dispatcher.lead(asyncio.Event()), timeout=5)
    assert dispatcher.lease_token is None and not dispatcher.unplaced
    assert queue_ids(sync_redis, settings, "a") == []
    await dispatcher.client.aclose()


async def test_expired_lease_fences_a_resumed_leader(settings: Settings, sync_redis: redis.Redis) -> None:
    beat(sync_redis, settings, "a")
    dispatcher = await make_dispatcher(settings, lease_ms=200)
    await lead(dispatcher)
    submit(sync_redis, settings, 1)
    await asyncio.sleep(0.3)  # paused past its lease; nobody took it
    beat(sync_redis, settings, "a")
    with pytest.raises(LeaseLost):
        await dispatcher.step()
    assert queue_ids(sync_redis, settings, "a") == []
    await dispatcher.client.aclose()


async def test_release_deletes_only_its_own_lease(settings: Settings, sync_redis: redis.Redis) -> None:
    first = await make_dispatcher(settings, lease_ms=200)
    await lead(first)
    await asyncio.sleep(0.3)
    second = await make_dispatcher(settings, name="d-test")  # same consumer name, another process
    await lead(second)
    assert first.lease_token != second.lease_token
    assert await first.release_lease() is False
    assert sync_redis.get(settings.keys.dispatcher_lease) == second.lease_token.encode()  # type: ignore[union-attr]
    assert await second.release_lease() is True
    assert sync_redis.get(settings.keys.dispatcher_lease) is None
    await first.client.aclose()
    await second.client.aclose()


async def fail_reads_for(dispatcher: Dispatcher, duration_s: float) -> None:
    """Steps whose Redis is unreachable (a client of a closed port) for ``duration_s``."""
    good = dispatcher.client
    dispatcher.client = connect_async("redis://127.0.0.1:1", socket_connect_timeout=0.05)
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        with pytest.raises(redis.ConnectionError):
            await dispatcher.follow_heartbeats()
        await asyncio.sleep(0.05)
    await dispatcher.client.aclose()
    dispatcher.client = good


async def test_no_instance_dies_for_silence_during_an_outage(settings: Settings, sync_redis: redis.Redis) -> None:
    for instance_id in ("a", "b"):
        beat(sync_redis, settings, instance_id)
    dispatcher = await make_dispatcher(settings, dead_after_s=0.5)
    await lead(dispatcher)
    submit(sync_redis, settings, 4)
    while dispatcher.num_placed < 4:
        await dispatcher.step()
    before = {i: queue_ids(sync_redis, settings, i) for i in ("a", "b")}
    await fail_reads_for(dispatcher, 0.8)  # no beat is written or read for longer than dead_after_s
    beat(sync_redis, settings, "a")  # "a" beats first after the outage; "b" a moment later
    started = time.monotonic()
    while time.monotonic() - started < 0.3:
        await dispatcher.step()
        assert all(v.health != "dead" for v in dispatcher.view.instances.values())
        await asyncio.sleep(0.02)
    assert {i: queue_ids(sync_redis, settings, i) for i in ("a", "b")} == before
    # The grace ends: "b", still silent, is dead now and its queue moves to "a".
    deadline = time.monotonic() + 3
    while queue_ids(sync_redis, settings, "b"):
        assert time.monotonic() < deadline
        beat(sync_redis, settings, "a")
        await dispatcher.step()
        await asyncio.sleep(0.05)
    assert dispatcher.view.instances["b"].health == "dead"
    assert sorted(queue_ids(sync_redis, settings, "a")) == sorted(before["a"] + before["b"])
    await dispatcher.client.aclose()


async def test_new_leader_dates_replayed_beats_by_age(settings: Settings, sync_redis: redis.Redis) -> None:
    # An instance whose last beat is 30 s old (by the Redis clock), as its worker left it
    # in the stream and the registry of instances, and one beating now.
    old = make_heartbeat("old", seq=1)
    sync_redis.xadd(settings.keys.heartbeats, {PAYLOAD_FIELD: encode(old)},
                    id=f"{int(time.time() * 1000) - 30_000}-0")
    sync_redis.hset(settings.keys.instances, "old", encode(old))
    beat(sync_redis, settings, "fresh")
    dispatcher = await make_dispatcher(settings, dead_after_s=0.5)
    await lead(dispatcher)
    (request_id,) = submit(sync_redis, settings, 1)
    await dispatcher.step()
    assert dispatcher.view.instances["old"].health == "suspect"  # not live, not yet dead (grace)
    assert queue_ids(sync_redis, settings, "fresh") == [request_id]
    started = time.monotonic()
    while dispatcher.view.instances["old"].health != "dead":
        assert time.monotonic() - started < 2, "the grace did not end"
        beat(sync_redis, settings, "fresh")
        await dispatcher.step()
        await asyncio.sleep(0.05)
    assert time.monotonic() - started > 0.4  # not before dead_after_s from the start of the term
    await dispatcher.client.aclose()


async def test_stopped_instance_leftover_entries_are_replaced(settings: Settings, sync_redis: redis.Redis) -> None:
    beat(sync_redis, settings, "a")
    beat(sync_redis, settings, "b")
    dispatcher = await make_dispatcher(settings, dead_after_s=60)
    await lead(dispatcher)
    ids = submit(sync_redis, settings, 6)
    while dispatcher.num_placed < 6:
        await dispatcher.step()
    assert len(queue_ids(sync_redis, settings, "a")) == 3
    beat(sync_redis, settings, "a", state="stopped")  # crashed after saying so, entries left
    beat(sync_redis, settings, "b")
    await dispatcher.step()
    assert queue_ids(sync_redis, settings, "a") == []
    assert sorted(queue_ids(sync_redis, settings, "b")) == sorted(ids)
    assert all(owner(sync_redis, settings, request_id) == b"b" for request_id in ids)
    await dispatcher.client.aclose()


async def test_restarted_dispatcher_resumes_pending_entries_at_once(settings: Settings,
                                                                   sync_redis: redis.Redis) -> None:
    settings = replace(settings, claim_idle_ms=60_000)  # XAUTOCLAIM cannot be what places them
    crashed = await make_dispatcher(settings, name="dispatch-host1", lease_ms=200)
    await lead(crashed)
    ids = submit(sync_redis, settings, 3)
    await crashed.step()  # no instance yet: held in memory, pending in `ready`
    assert len(crashed.unplaced) == 3
    await crashed.client.aclose()  # crashed: lease left to expire
    beat(sync_redis, settings, "a")
    stranger = await make_dispatcher(settings, name="dispatch-host2", lease_ms=200)
    await asyncio.wait_for(lead(stranger), timeout=5)
    beat(sync_redis, settings, "a")
    assert await stranger.step() == 0  # another name sees none of them before claim_idle_ms
    assert not stranger.unplaced and stranger.view.instances["a"].health == "live"
    await stranger.release_lease()
    await stranger.client.aclose()
    restarted = await make_dispatcher(settings, name="dispatch-host1")
    await lead(restarted)
    started = time.monotonic()
    while restarted.num_placed < 3:
        assert time.monotonic() - started < 2
        beat(sync_redis, settings, "a")
        await restarted.step()
    assert sorted(queue_ids(sync_redis, settings, "a")) == sorted(ids)
    assert sync_redis.xpending(settings.keys.ready, GROUP_DISPATCH)["pending"] == 0
    await restarted.client.aclose()


async def test_bad_beat_never_stops_the_leader(settings: Settings, sync_redis: redis.Redis) -> None:
    sync_redis.xadd(settings.keys.heartbeats, {PAYLOAD_FIELD: b"\xc1garbage"})
    sync_redis.xadd(settings.keys.heartbeats, {"other": b"x"})
    beat(sync_redis, settings, "a")
    dispatcher = await make_dispatcher(settings)
    await lead(dispatcher)
    (request_id,) = submit(sync_redis, settings, 1)
    assert await dispatcher.step() == 1
    assert dispatcher.core.stats.num_beats_rejected == 2
    assert queue_ids(sync_redis, settings, "a") == [request_id]
    await dispatcher.client.aclose()



async def test_a_beat_with_an_infinite_block_count_is_refused_and_the_leader_places_on(
        settings: Settings, sync_redis: redis.Redis) -> None:
    # Decodable msgpack, every field present, prefix caching on and num_gpu_blocks = inf:
    # before, it raised inside the cluster view on every read of the stream.
    hostile = make_heartbeat("b", seq=next(_seq)).to_map()
    hostile["engine_config"] = {**hostile["engine_config"], "num_gpu_blocks": float("inf"),
                                "enable_prefix_caching": True}
    sync_redis.xadd(settings.keys.heartbeats, {PAYLOAD_FIELD: msgpack.packb(hostile, use_bin_type=True)})
    beat(sync_redis, settings, "a")
    dispatcher = await make_dispatcher(settings)
    await lead(dispatcher)
    (request_id,) = submit(sync_redis, settings, 1)
    assert await dispatcher.step() == 1
    assert dispatcher.core.stats.num_beats_rejected == 1
    assert "b" not in dispatcher.core.view.instances
    assert queue_ids(sync_redis, settings, "a") == [request_id]
    await dispatcher.client.aclose()


def test_cli_defaults_to_the_stable_consumer_name() -> None:
    import argparse

    from dispatcher.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--consumer-name", "dispatch-east-1"]).consumer_name == "dispatch-east-1"
    assert parser.parse_args([]).consumer_name is None  # then blockq.wire.streams.default_consumer_name("dispatch")
