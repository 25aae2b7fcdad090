"""The dispatcher service against a real Redis: ACK after write, dead letters, no live
instance → wait (never drop), instance death → queue re-placed, none lost or duplicated."""

from __future__ import annotations

import asyncio
import time

import redis

from blockq.config import Settings
from blockq.wire.keys import GROUP_DISPATCH, GROUP_WORK, PAYLOAD_FIELD
from blockq.wire.protocol import decode_request, encode
from blockq.wire.streams import connect_async, ensure_group
from dispatcher.service import Dispatcher, DispatcherOptions, create_dispatcher
from tests.factories import make_heartbeat, make_request


def publish_beat(sync_redis: redis.Redis, settings: Settings, instance_id: str, **kwargs: object) -> None:
    sync_redis.xadd(settings.keys.heartbeats, {PAYLOAD_FIELD: encode(make_heartbeat(instance_id, **kwargs))})


def queue_ids(sync_redis: redis.Redis, settings: Settings, instance_id: str) -> list[str]:
    return [decode_request(f[PAYLOAD_FIELD.encode()]).id
            for _, f in sync_redis.xrange(settings.keys.instance_queue(instance_id))]


async def make_dispatcher(settings: Settings, policy: str = "round_robin", **options: object) -> Dispatcher:
    client = connect_async(settings.redis_url)
    dispatcher = create_dispatcher(client, settings, policy, seed=1, dispatcher_id="d-test",
                                   options=DispatcherOptions(**options))
    await dispatcher.consumer.ensure_group()
    return dispatcher


async def test_round_robin_places_acks_and_records_assignment(settings: Settings, sync_redis: redis.Redis) -> None:
    for instance_id in ("a", "b"):
        publish_beat(sync_redis, settings, instance_id)
    dispatcher = await make_dispatcher(settings)
    requests = [make_request(keys=settings.keys, predicted=10) for _ in range(6)]
    for request in requests:
        sync_redis.xadd(settings.keys.ready, {PAYLOAD_FIELD: encode(request)})
    sync_redis.xadd(settings.keys.ready, {PAYLOAD_FIELD: b"\xc1garbage"})
    placed = 0
    for _ in range(5):
        placed += await dispatcher.step()
    assert placed == 6
    assert queue_ids(sync_redis, settings, "a") == [r.id for r in requests[0::2]]
    assert queue_ids(sync_redis, settings, "b") == [r.id for r in requests[1::2]]
    ((_, fields),) = sync_redis.xrange(settings.keys.instance_queue("a"), count=1)
    assignment = decode_request(fields[PAYLOAD_FIELD.encode()]).assignment
    assert assignment is not None and assignment.policy == "round_robin" and assignment.instance_id == "a"
    # Everything consumed was ACKed and deleted; the poison message went to the dead letters.
    assert sync_redis.xpending(settings.keys.ready, GROUP_DISPATCH)["pending"] == 0
    assert sync_redis.xlen(settings.keys.ready) == 0
    ((_, dead),) = sync_redis.xrange(settings.keys.dead_letters)
    assert dead[b"raw"] == b"\xc1garbage" and b"msgpack" in dead[b"reason"]
    await dispatcher.client.aclose()


async def test_requests_wait_while_no_instance_is_live(settings: Settings, sync_redis: redis.Redis) -> None:
    dispatcher = await make_dispatcher(settings)
    request = make_request(keys=settings.keys)
    sync_redis.xadd(settings.keys.ready, {PAYLOAD_FIELD: encode(request)})
    for _ in range(3):
        assert await dispatcher.step() == 0
    assert len(dispatcher.unplaced) == 1
    assert sync_redis.xpending(settings.keys.ready, GROUP_DISPATCH)["pending"] == 1  # not ACKed
    publish_beat(sync_redis, settings, "late")
    assert await dispatcher.step() == 1
    assert queue_ids(sync_redis, settings, "late") == [request.id]
    await dispatcher.client.aclose()


async def test_dead_instance_queue_is_replaced_without_loss_or_duplicates(settings: Settings,
                                                                        sync_redis: redis.Redis) -> None:
    dispatcher = await make_dispatcher(settings, dead_after_s=0.3)
    publish_beat(sync_redis, settings, "a")
    publish_beat(sync_redis, settings, "b")
    client = dispatcher.client
    await ensure_group(client, settings.keys.instance_queue("a"), GROUP_WORK)
    requests = [make_request(keys=settings.keys) for _ in range(10)]
    for request in requests:
        sync_redis.xadd(settings.keys.ready, {PAYLOAD_FIELD: encode(request)})
    while dispatcher.num_placed < 10:
        await dispatcher.step()
    on_a = queue_ids(sync_redis, settings, "a")
    assert len(on_a) == 5
    # "b" keeps beating, "a" falls silent and is declared dead.
    deadline = time.monotonic() + 5
    while dispatcher.view.instances["a"].health != "dead":
        assert time.monotonic() < deadline
        publish_beat(sync_redis, settings, "b", seq=int(time.monotonic() * 1000))
        await dispatcher.step()
        await asyncio.sleep(0.05)
    assert queue_ids(sync_redis, settings, "a") == []
    on_b = queue_ids(sync_redis, settings, "b")
    assert sorted(on_b) == sorted(r.id for r in requests)
    assert len(on_b) == len(set(on_b))
    # A new request now only goes to the live instance.
    sync_redis.xadd(settings.keys.ready, {PAYLOAD_FIELD: encode(make_request(keys=settings.keys))})
    publish_beat(sync_redis, settings, "b", seq=10**12)
    await dispatcher.step()
    assert len(queue_ids(sync_redis, settings, "b")) == 11
    await client.aclose()


async def test_draining_instance_keeps_what_it_took_and_its_unread_queue_moves(settings: Settings,
                                                                                 sync_redis: redis.Redis) -> None:
    dispatcher = await make_dispatcher(settings)
    publish_beat(sync_redis, settings, "a")
    publish_beat(sync_redis, settings, "b")
    queue_a = settings.keys.instance_queue("a")
    await ensure_group(dispatcher.client, queue_a, GROUP_WORK)
    requests = [make_request(keys=settings.keys) for _ in range(8)]
    for request in requests:
        sync_redis.xadd(settings.keys.ready, {PAYLOAD_FIELD: encode(request)})
    while dispatcher.num_placed < 8:
        await dispatcher.step()
    on_a = queue_ids(sync_redis, settings, "a")
    assert len(on_a) == 4
    # The worker of "a" took two entries (pending in `work`), then drains on SIGTERM.
    taken = sync_redis.xreadgroup(GROUP_WORK, "a", {queue_a: ">"}, count=2)
    taken_ids = [decode_request(fields[PAYLOAD_FIELD.encode()]).id for _, fields in taken[0][1]]
    assert taken_ids == on_a[:2]
    publish_beat(sync_redis, settings, "a", seq=2, state="draining")
    await dispatcher.step()
    # What it took stays there, pending, its owner unchanged: it runs to the end on "a".
    assert queue_ids(sync_redis, settings, "a") == taken_ids
    assert sync_redis.xpending(queue_a, GROUP_WORK)["pending"] == 2
    assert all(sync_redis.get(settings.keys.owner(i)) == b"a" for i in taken_ids)
    # What it never read moved to "b", owner and all; nothing lost, nothing twice.
    on_b = queue_ids(sync_redis, settings, "b")
    assert sorted(on_b) == sorted(set(r.id for r in requests) - set(taken_ids))
    assert all(sync_redis.get(settings.keys.owner(i)) == b"b" for i in on_a[2:])
    # Reported once per drain: a later round moves nothing more, new work goes to "b" only.
    sync_redis.xadd(settings.keys.ready, {PAYLOAD_FIELD: encode(make_request(keys=settings.keys))})
    await dispatcher.step()
    assert queue_ids(sync_redis, settings, "a") == taken_ids
    assert len(queue_ids(sync_redis, settings, "b")) == 7
    # Once it stopped, anything still left in its queue is placed again (the dead path).
    publish_beat(sync_redis, settings, "a", seq=3, state="stopped")
    await dispatcher.step()
    assert queue_ids(sync_redis, settings, "a") == []
    on_b = queue_ids(sync_redis, settings, "b")
    assert len(on_b) == len(set(on_b)) == 9 and {r.id for r in requests} <= set(on_b)
    await dispatcher.client.aclose()


async def test_only_one_leader(settings: Settings) -> None:
    first = await make_dispatcher(settings)
    second = await make_dispatcher(settings)
    second.dispatcher_id = "d-other"
    stop = asyncio.Event()
    assert await first.acquire_lease(stop)
    waiting = asyncio.create_task(second.acquire_lease(stop))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    stop.set()
    assert await waiting is False
    await first.client.aclose()
    await second.client.aclose()


async def test_batch_is_background_work(settings: Settings, sync_redis: redis.Redis) -> None:
    from blockq.wire.beats import RequestProgress

    full = tuple(RequestProgress(f"r{i}", 10, 10, 1, 100, 200) for i in range(48))
    publish_beat(sync_redis, settings, "busy", running=full)
    publish_beat(sync_redis, settings, "idle")
    dispatcher = await make_dispatcher(settings, policy="least_requests")
    batch = [make_request(keys=settings.keys, predicted=50, priority="batch") for _ in range(3)]
    for request in batch:
        sync_redis.xadd(settings.keys.ready, {PAYLOAD_FIELD: encode(request)})
    await dispatcher.step()
    # Batch work only goes where there is idle capacity: "idle", never the full instance.
    assert sorted(queue_ids(sync_redis, settings, "idle")) == sorted(r.id for r in batch)
    # An interactive request is not queued behind that batch work while "busy" exists.
    interactive = make_request(keys=settings.keys, predicted=50)
    sync_redis.xadd(settings.keys.ready, {PAYLOAD_FIELD: encode(interactive)})
    await dispatcher.step()
    assert queue_ids(sync_redis, settings, "busy") == [interactive.id]
    # With no idle capacity anywhere, batch work is held (un-ACKed), interactive work flows.
    publish_beat(sync_redis, settings, "idle", seq=2, running=full)
    publish_beat(sync_redis, settings, "busy", seq=2, running=full)
    held = make_request(keys=settings.keys, predicted=50, priority="batch")
    after = make_request(keys=settings.keys, predicted=50)
    for request in (held, after):
        sync_redis.xadd(settings.keys.ready, {PAYLOAD_FIELD: encode(request)})
    for _ in range(3):
        await dispatcher.step()
    placed = queue_ids(sync_redis, settings, "idle") + queue_ids(sync_redis, settings, "busy")
    assert after.id in placed and held.id not in placed
    assert sync_redis.xpending(settings.keys.ready, GROUP_DISPATCH)["pending"] == 1
    publish_beat(sync_redis, settings, "idle", seq=3)
    await dispatcher.step()
    assert held.id in queue_ids(sync_redis, settings, "idle")
    await dispatcher.client.aclose()
