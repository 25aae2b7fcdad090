"""The dispatcher leader under load it was not built for, against a real Redis: a dead
instance's long queue moved in chunks under its lease, exactly once; a beat that raises
inside the view counted and skipped while the leader places on; admission judged by
Redis' clock whatever the client's clock says; a new leader that knows the fleet from
the registry of instances and does not replay the whole beat history inside its lease."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

import pytest
import redis
import structlog

from blockq.config import Settings
from blockq.engine_model.packed import warm_up as warm_up_packed_kernel
from blockq.text.tokenizer import get_token_counter
from blockq.wire.beats import Heartbeat, RequestProgress
from blockq.wire.keys import GROUP_WORK, PAYLOAD_FIELD
from blockq.wire.protocol import (
    STATUS_INFEASIBLE,
    Assignment,
    FinalRecord,
    Request,
    decode_reply_entry,
    decode_request,
    encode,
)
from blockq.wire.streams import connect_async
from dispatcher.core import DispatcherCore, Outcome, Placed
from dispatcher.instance_view import InstanceView
from dispatcher.lease import Pipeline
from dispatcher.service import Dispatcher, DispatcherOptions, create_dispatcher
from loadgen.benches.dispatch import heartbeat_of, loaded_scheduler
from predictor_service.models import load_predictor
from predictor_service.stage import PredictorStage
from tests.factories import make_heartbeat, make_request
from tests.test_dispatcher_service import queue_ids

_seq = iter(range(1, 10**9))


def publish(sink: Any, settings: Settings, beat: Heartbeat | bytes, instance_id: str = "", *,
            entry_id: str = "*") -> None:
    """A beat as a worker publishes it, on ``sink`` (a client or a pipeline, sync or
    asyncio): on the beat stream and in the registry of instances."""
    payload = beat if isinstance(beat, bytes) else encode(beat)
    sink.xadd(settings.keys.heartbeats, {PAYLOAD_FIELD: payload}, id=entry_id)
    sink.hset(settings.keys.instances, instance_id or beat.instance_id, payload)  # type: ignore[union-attr]


def live_beat(instance_id: str) -> Heartbeat:
    return make_heartbeat(instance_id, seq=next(_seq))


async def beat_every(settings: Settings, instance_ids: list[str], stop: asyncio.Event,
                     interval_s: float = 0.05) -> None:
    client = connect_async(settings.redis_url)
    try:
        while not stop.is_set():
            pipe = client.pipeline(transaction=False)
            for instance_id in instance_ids:
                publish(pipe, settings, live_beat(instance_id))
            await pipe.execute()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
    finally:
        await client.aclose()


def new_dispatcher(settings: Settings, policy: str = "round_robin", **options: object) -> Dispatcher:
    return create_dispatcher(connect_async(settings.redis_url), settings, policy, seed=1, dispatcher_id="d-hard",
                             options=DispatcherOptions(**options))  # type: ignore[arg-type]


@contextlib.contextmanager
def counted_terms(dispatcher: Dispatcher) -> Iterator[list[int]]:
    """How many terms ``dispatcher`` starts (more than one: its lease was lost on the way)."""
    terms = [0]
    acquire = dispatcher.acquire_lease

    async def counting(stop: asyncio.Event) -> bool:
        taken = await acquire(stop)
        terms[0] += taken
        return taken

    dispatcher.acquire_lease = counting  # type: ignore[method-assign]
    yield terms


async def run_until(dispatcher: Dispatcher, done: Callable[[], object], timeout_s: float,
                    *background: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> float:
    """Run ``dispatcher`` (lease, renewals, steps) with ``background`` tasks until
    ``done()`` or ``timeout_s``; the seconds it took. Fails at once if the dispatcher's
    loop, or a background task, dies."""
    stop = asyncio.Event()
    await dispatcher.consumer.ensure_group()
    leader = asyncio.create_task(dispatcher.run(stop))
    helpers = [asyncio.create_task(make(stop)) for make in background]
    started = time.monotonic()
    try:
        while not done() and time.monotonic() - started < timeout_s:
            if leader.done():
                leader.result()  # the dispatcher's exception, if it died
                pytest.fail("the dispatcher's loop ended")
            for helper in helpers:
                if helper.done():
                    helper.result()
            await asyncio.sleep(0.05)
        return time.monotonic() - started
    finally:
        stop.set()
        await asyncio.gather(leader, *helpers, return_exceptions=True)
        await dispatcher.client.aclose()


# --- 1. a long dead queue moves in chunks under the lease ----------------------------------------


async def test_a_dead_queue_spanning_several_chunks_moves_once_within_a_short_lease(
        settings: Settings, sync_redis: redis.Redis) -> None:
    """1,536 entries (several chunks) on a host where each re-placed entry costs 1 ms: in
    one step that is longer than the 1.2 s lease, so a leader deciding them all at once
    had every fenced write refused and started over each term."""
    num_entries, num_taken = 1536, 5
    queue = settings.keys.instance_queue("gone")
    requests = [make_request(keys=settings.keys, predicted=10).with_assignment(
        Assignment("gone", "round_robin", time.time(), 0.0)) for _ in range(num_entries)]
    pipe = sync_redis.pipeline(transaction=False)
    for request in requests:
        pipe.set(settings.keys.owner(request.id), "gone")
        pipe.xadd(queue, {PAYLOAD_FIELD: encode(request)})
    pipe.execute()
    sync_redis.xgroup_create(queue, GROUP_WORK, id="0")
    sync_redis.xreadgroup(GROUP_WORK, "gone", {queue: ">"}, count=num_taken)  # running there when it died
    publish(sync_redis, settings, live_beat("gone"))
    dispatcher = new_dispatcher(settings, lease_ms=1200, dead_after_s=0.5)
    replace_unstarted = dispatcher.core.replace_unstarted

    def slowly(instance_id: str, requests: Sequence[Request], now_s: float, **kwargs: Any) -> list[Outcome]:
        time.sleep(0.001 * len(requests))  # CPU the event loop cannot use meanwhile
        return replace_unstarted(instance_id, requests, now_s, **kwargs)

    dispatcher.core.replace_unstarted = slowly  # type: ignore[method-assign]
    num_fenced_writes = [0]
    write_fenced = dispatcher.lease.write_fenced

    async def counting(queue_writes: Callable[[Pipeline], None]) -> None:
        await write_fenced(queue_writes)
        num_fenced_writes[0] += 1

    dispatcher.lease.write_fenced = counting  # type: ignore[method-assign]
    with counted_terms(dispatcher) as terms:
        seconds = await run_until(dispatcher, lambda: sync_redis.xlen(queue) == 0, 20.0,
                                  lambda stop: beat_every(settings, ["a", "b"], stop))
    assert sync_redis.xlen(queue) == 0, f"{sync_redis.xlen(queue)} entries left after {seconds:.1f} s"
    placed = Counter(queue_ids(sync_redis, settings, "a") + queue_ids(sync_redis, settings, "b"))
    assert sorted(placed) == sorted(r.id for r in requests) and max(placed.values()) == 1  # no loss, no duplicate
    for instance_id in ("a", "b"):
        assert all(sync_redis.get(settings.keys.owner(i)) == instance_id.encode()
                   for i in queue_ids(sync_redis, settings, instance_id))
    assert terms[0] == 1 and num_fenced_writes[0] >= 4  # one term, several chunks


# --- 2. a beat that raises inside the view --------------------------------------------------------


def raise_for(dispatcher: Dispatcher, instance_id: str) -> None:
    """Make the view raise OverflowError (not a ValueError) on ``instance_id``'s beats: what a
    bug in the view would do with a beat that passed decoding. Decoding now refuses the
    values that did this (an engine config of 2**64 - 1 KV blocks overflowed the replica's
    int64 counters), so the catch-all is driven by hand here."""
    apply = dispatcher.core.view.apply_heartbeat

    def failing(beat: Heartbeat, now_s: float, heard_at_s: float | None = None) -> InstanceView:
        if beat.instance_id == instance_id:
            raise OverflowError("Python int too large to convert to C long")
        return apply(beat, now_s, heard_at_s)

    dispatcher.core.view.apply_heartbeat = failing  # type: ignore[method-assign]


async def test_a_beat_that_raises_in_the_view_is_counted_logged_and_the_live_leader_places_on(
        settings: Settings, sync_redis: redis.Redis) -> None:
    publish(sync_redis, settings, live_beat("a"))
    dispatcher = new_dispatcher(settings, policy="block")
    raise_for(dispatcher, "hostile")
    requests = [make_request(keys=settings.keys, predicted=10) for _ in range(3)]

    async def plant_then_submit(stop: asyncio.Event) -> None:
        await asyncio.sleep(0.3)  # the leader is running
        publish(sync_redis, settings, live_beat("hostile"), "hostile")
        await asyncio.sleep(0.3)
        for request in requests:
            sync_redis.xadd(settings.keys.ready, {PAYLOAD_FIELD: encode(request)})

    with structlog.testing.capture_logs() as logs:
        await run_until(dispatcher, lambda: len(queue_ids(sync_redis, settings, "a")) == 3, 10.0,
                        plant_then_submit, lambda stop: beat_every(settings, ["a"], stop))
    assert sorted(queue_ids(sync_redis, settings, "a")) == sorted(r.id for r in requests)
    assert "hostile" not in dispatcher.view.instances  # the beat changed nothing
    registry = dispatcher.metrics.registry
    assert registry.get_sample_value("blockq_dispatcher_beats_rejected_total", {"reason": "error"}) >= 1
    (rejected, *_) = [e for e in logs if e["event"] == "heartbeat_rejected" and e.get("instance_id") == "hostile"]
    assert rejected["reason"] == "error" and "OverflowError" in rejected["error"]


def test_a_beat_that_fails_half_way_changes_nothing() -> None:
    """Two entries with one id decode (each entry is valid) but the replica refuses them
    after the view had taken the beat: the instance must keep its previous beat."""
    core = DispatcherCore("block", seed=0)
    good = make_heartbeat("a", seq=1, sent_at_s=0.0)
    assert core.apply_heartbeat(good, 0.0) is None
    twice = RequestProgress("r1", 100, 100, 5, 50, 100)
    bad = make_heartbeat("a", seq=2, sent_at_s=0.05, running=(twice, twice))
    assert core.apply_heartbeat(bad, 0.05) is not None
    assert core.view.instances["a"].heartbeat is good and core.stats.num_beats_rejected == 1
    (outcome,) = core.place([make_request(predicted=20)], 0.1)
    assert isinstance(outcome, Placed)
    # A brand-new instance whose first beat raises is not kept at all.
    hostile = dataclasses.replace(make_heartbeat("h", sent_at_s=0.0),
                                  engine_config={**good.engine_config, "num_gpu_blocks": 2**64 - 1})
    assert core.apply_heartbeat(hostile, 0.1) is not None
    assert "h" not in core.view.instances


@pytest.mark.parametrize("policy", ["llumnix", "least_kv", "prefix_affinity"])
def test_a_config_no_engine_runs_is_refused_whatever_the_policy(policy: str) -> None:
    """block_size 0 decodes (counts >= 0) and policies without replicas never checked it:
    the beat was applied and every placement then divided by it (ZeroDivisionError, the
    leader's loop gone), found by tests/test_fuzz.py."""
    core = DispatcherCore(policy, seed=0)
    assert core.apply_heartbeat(make_heartbeat("a", sent_at_s=0.0), 0.0) is None
    waiting = (RequestProgress("w1", 50, 0, 0, 40, 80),)
    zero = make_heartbeat("z", sent_at_s=0.0, waiting=waiting)
    zero = dataclasses.replace(zero, engine_config={**zero.engine_config, "block_size": 0})
    rejection = core.apply_heartbeat(zero, 0.0)
    assert rejection is not None and rejection.reason == "unusable" and "block_size" in rejection.detail
    outcomes = core.place([make_request(predicted=20) for _ in range(3)], 0.1)
    assert all(isinstance(o, Placed) and o.request.assignment.instance_id == "a" for o in outcomes)
    # The same config arriving later, on an instance already known, is refused too.
    changed = dataclasses.replace(make_heartbeat("a", seq=2, sent_at_s=0.1, waiting=waiting),
                                  engine_config=zero.engine_config)
    assert core.apply_heartbeat(changed, 0.1) is not None and core.view.instances["a"].heartbeat.seq == 1


# --- 3. admission by Redis' clock -----------------------------------------------------------------


async def test_admission_uses_redis_clock_whatever_the_client_clock(settings: Settings,
                                                                    sync_redis: redis.Redis) -> None:
    """A client 3.2 s behind was refused at once (waited "3.2 s" > 3 s); a client 3 s ahead
    skipped the check (waited "0 s") although Redis admitted its request a second ago."""
    publish(sync_redis, settings, live_beat("a"))
    now_s = time.time()
    behind = make_request(keys=settings.keys, predicted=10, submitted_at_s=now_s - 3.2)
    ahead_fresh = make_request(keys=settings.keys, predicted=10, submitted_at_s=now_s + 3.0, slo_ttft_ms=500)
    ahead_stale = make_request(keys=settings.keys, predicted=10, submitted_at_s=now_s + 3.0, slo_ttft_ms=500)
    seconds, micros = sync_redis.time()
    redis_now_ms = int(seconds) * 1000 + int(micros) // 1000
    # Redis admitted ahead_stale a second ago (its entry id), the others now.
    admitted_ms = {ahead_stale.id: redis_now_ms - 1000}
    sync_redis.xadd(settings.keys.requests, {PAYLOAD_FIELD: encode(ahead_stale)}, id=f"{redis_now_ms - 1000}-0")
    for request in (behind, ahead_fresh):
        entry_id = sync_redis.xadd(settings.keys.requests, {PAYLOAD_FIELD: encode(request)})
        admitted_ms[request.id] = int(entry_id.split(b"-")[0])
    client = connect_async(settings.redis_url)
    stage = PredictorStage(client, settings, load_predictor("heuristic"), get_token_counter(), consumer_name="p-t")
    await stage.consumer.ensure_group()
    await stage.process(await stage.consumer.read(10, 10))
    await client.aclose()
    dispatcher = new_dispatcher(settings)
    await dispatcher.consumer.ensure_group()
    for _ in range(3):
        await dispatcher.step()
    await dispatcher.client.aclose()
    assert sorted(queue_ids(sync_redis, settings, "a")) == sorted([behind.id, ahead_fresh.id])
    ((_, fields),) = sync_redis.xrange(settings.keys.reply(ahead_stale.id))
    final = decode_reply_entry(fields[PAYLOAD_FIELD.encode()])
    assert isinstance(final, FinalRecord) and final.status == STATUS_INFEASIBLE
    waited = re.search(r"waited (\d+) ms", final.error or "")
    assert waited is not None and 900 <= int(waited.group(1)) < 2500  # about 1 s, by Redis' clock
    for _, fields in sync_redis.xrange(settings.keys.instance_queue("a")):
        placed = decode_request(fields[PAYLOAD_FIELD.encode()])
        assert placed.admitted_at_ms == admitted_ms[placed.id]


# --- 4. a new leader and the registry of instances -----------------------------------------------


async def test_a_new_leader_knows_instances_whose_beats_left_the_stream(settings: Settings,
                                                                        sync_redis: redis.Redis) -> None:
    """"gone" died long enough ago that the capped beat stream no longer holds its beats;
    only the registry (``instances``) remembers it, and its queue still holds work."""
    ids = [make_request(keys=settings.keys).id for _ in range(4)]
    for request_id in ids:
        request = make_request(keys=settings.keys, id=request_id).with_assignment(
            Assignment("gone", "round_robin", time.time(), 0.0))
        sync_redis.set(settings.keys.owner(request_id), "gone")
        sync_redis.xadd(settings.keys.instance_queue("gone"), {PAYLOAD_FIELD: encode(request)})
    publish(sync_redis, settings, live_beat("gone"))
    sync_redis.xtrim(settings.keys.heartbeats, maxlen=0)  # its beats trimmed away
    publish(sync_redis, settings, live_beat("a"))
    dispatcher = new_dispatcher(settings, dead_after_s=0.5)
    await dispatcher.consumer.ensure_group()
    assert await dispatcher.acquire_lease(asyncio.Event())
    await dispatcher.step()
    # Known from the first step on, and not placed on: nothing was heard from it this term.
    assert dispatcher.view.instances["gone"].health == "suspect"
    assert dispatcher.view.instances["a"].health == "live"
    deadline = time.monotonic() + 5
    while queue_ids(sync_redis, settings, "gone"):
        assert time.monotonic() < deadline, "the queue of the instance known from the registry never moved"
        publish(sync_redis, settings, live_beat("a"))
        await dispatcher.step()
        await asyncio.sleep(0.05)
    assert sorted(queue_ids(sync_redis, settings, "a")) == sorted(ids)
    assert all(sync_redis.get(settings.keys.owner(i)) == b"a" for i in ids)
    await dispatcher.client.aclose()


async def test_a_new_leader_does_not_replay_the_whole_beat_history_inside_its_lease(
        settings: Settings, sync_redis: redis.Redis) -> None:
    """The beat stream is capped by count (20,000 entries), so it holds that many beats
    whatever the fleet's size: a new ``block`` leader that applied them all (a replica
    rebuild each) in its first step outlived its 0.6 s lease, lost it, and started over,
    term after term, never placing."""
    rng = random.Random(0)
    engines = {f"i{k}": loaded_scheduler(rng, "llama2-7b-a30", 24, 5) for k in range(4)}
    first_ms = int(time.time() * 1000) - 120_000
    pipe = sync_redis.pipeline(transaction=False)
    for index in range(4000):  # a minute of history, two minutes ago
        instance_id = f"i{index % 4}"
        beat = heartbeat_of(instance_id, engines[instance_id], index + 1, time.time(), "llama2-7b-a30")
        publish(pipe, settings, beat, entry_id=f"{first_ms + 15 * index}-0")
    pipe.execute()
    request = make_request(keys=settings.keys, predicted=10)
    sync_redis.xadd(settings.keys.ready, {PAYLOAD_FIELD: encode(request)})
    dispatcher = new_dispatcher(settings, policy="block", lease_ms=600)
    warm_up_packed_kernel()

    async def beat_on(stop: asyncio.Event) -> None:
        seq = 10_000
        while not stop.is_set():
            seq += 1
            pipe = sync_redis.pipeline(transaction=False)
            for instance_id, engine in engines.items():
                publish(pipe, settings, heartbeat_of(instance_id, engine, seq, time.time(), "llama2-7b-a30"))
            pipe.execute()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.05)

    with counted_terms(dispatcher) as terms:
        seconds = await run_until(dispatcher, lambda: dispatcher.num_placed == 1, 8.0, beat_on)
    assert dispatcher.num_placed == 1, f"nothing placed in {seconds:.1f} s, over {terms[0]} terms"
    assert terms[0] == 1
