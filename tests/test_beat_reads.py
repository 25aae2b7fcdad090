"""The leader's reads of the beat stream are bounded: one batch a step, so that it places
between reads however fast the fleet beats (real Redis)."""

from __future__ import annotations

import asyncio

import redis

from blockq.config import Settings
from blockq.wire.keys import PAYLOAD_FIELD
from blockq.wire.protocol import encode
from blockq.wire.streams import connect_async
from dispatcher.beat_reads import READ_COUNT
from dispatcher.service import Dispatcher, DispatcherOptions, create_dispatcher
from tests.factories import make_heartbeat, make_request


async def leader(settings: Settings) -> Dispatcher:
    dispatcher = create_dispatcher(connect_async(settings.redis_url), settings, "round_robin", seed=1,
                                   dispatcher_id="d-beats", options=DispatcherOptions())
    await dispatcher.consumer.ensure_group()
    assert await dispatcher.acquire_lease(asyncio.Event())
    return dispatcher


def beats_then_a_request(settings: Settings, sync_redis: redis.Redis) -> None:
    """Ten beats more than one read takes, then a request to place."""
    pipe = sync_redis.pipeline(transaction=False)
    for k in range(READ_COUNT + 10):
        pipe.xadd(settings.keys.heartbeats, {PAYLOAD_FIELD: encode(make_heartbeat(f"i{k:04d}"))})
    pipe.xadd(settings.keys.ready, {PAYLOAD_FIELD: encode(make_request())})
    pipe.execute()


async def test_a_step_reads_one_batch_of_beats_and_still_places(settings: Settings,
                                                                sync_redis: redis.Redis) -> None:
    dispatcher = await leader(settings)
    beats_then_a_request(settings, sync_redis)
    assert await dispatcher.step() == 1  # placed on what the first batch of beats showed
    assert dispatcher.core.stats.num_beats_applied == READ_COUNT
    assert await dispatcher.follow_heartbeats() is True  # the rest: caught up
    assert dispatcher.core.stats.num_beats_applied == READ_COUNT + 10
    await dispatcher.release_lease()
    await dispatcher.client.aclose()


async def test_a_leader_behind_on_beats_still_places_on_the_beats_it_read(settings: Settings,
                                                                          sync_redis: redis.Redis) -> None:
    dispatcher = await leader(settings)
    beats_then_a_request(settings, sync_redis)
    # By the time the leader reads them, the beats are older than two beat intervals: counted
    # against now, every instance would be suspect and the request held. It has heard nobody
    # since the last beat it read, so their silence counts up to there.
    await asyncio.sleep(3 * dispatcher.view.health_policy.suspect_after_s)
    assert await dispatcher.step() == 1
    assert dispatcher.core.stats.num_beats_applied == READ_COUNT
    await dispatcher.release_lease()
    await dispatcher.client.aclose()
