"""``blockq dispatch-bench --redis``: placements/s of a real dispatcher through Redis.

A real :class:`~dispatcher.service.Dispatcher`, stepped in this process, places the
requests of a pre-filled ``ready`` on the instance queues. The fleet is emulated in a
child process (:func:`beat_fleet`), so that the figure is the dispatcher's work and not
the emulation's: every 100 ms each instance beats the same load (``running`` /
``waiting``) and reports as finished what was placed on it since its last beat (read
back from its queue), as a fleet that keeps pace with its arrivals would.

**It ends whatever the outcomes.** Each request is placed, refused (infeasible: answered
at once), dead-lettered (rejected), or held (no instance may take it now: it stays
pending in ``ready`` and is offered again). The bench stops once every request is
decided, or once none has been decided for ``undecided_wait_s`` (held requests, or a
fleet not heard); the requests left then are reported held. The outcomes are counted by
the dispatcher and read back from Redis (:func:`read_outcomes`), so a request with no
outcome, or two, shows as a mismatch.

No cluster-wide TTFT objective by default (``slo_ttft_ms=0``): ``ready`` is filled before
the clock starts, so the tail of a large backlog waits for its head, and with an
objective it would be refused for that wait rather than placed.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Callable
from multiprocessing import get_context
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from typing import Any

import numpy as np
import redis
import redis.asyncio as aioredis

from blockq.config import Settings
from blockq.wire.connections import connect, connect_async
from blockq.wire.keys import GROUP_DISPATCH, PAYLOAD_FIELD, Keys
from blockq.wire.protocol import Request, encode, unpack_map
from dispatcher.service import (
    Dispatcher,
    DispatcherOptions,
    create_dispatcher,
    prepare_for_decisions,
)
from loadgen.benches.dispatch import (
    HEARTBEAT_INTERVAL_S,
    heartbeat_of,
    loaded_scheduler,
    make_request,
)

PRESET = "llama2-7b-a30"
# How long the fleet's first round of beats may take to appear (1,024 loaded engines
# are built first, in a freshly spawned interpreter).
FLEET_START_TIMEOUT_S = 120.0
REDIS_CHUNK = 10_000  # commands per pipeline when filling ``ready`` and reading outcomes back

RequestFactory = Callable[[random.Random, Keys, float], Request]


def beat_fleet(redis_url: str, key_prefix: str, num_instances: int, running: int, waiting: int, seed: int,
               first_round_done: Event, stop: Event) -> None:
    """Child process: ``num_instances`` instances beating every 100 ms until ``stop``.

    The load never changes, so each instance's beat map is built once and only its
    sequence number, times and finished ids are set per round: a round of 1,024 beats
    built from engine state took ~135 ms, more than the interval."""
    keys = Keys(key_prefix)
    rng = random.Random(seed)
    beat_maps = {f"i{k}": heartbeat_of(f"i{k}", loaded_scheduler(rng, PRESET, running, waiting), 0, 0.0,
                                       PRESET).to_map() for k in range(num_instances)}
    instance_of_queue = {keys.instance_queue(instance_id): instance_id for instance_id in beat_maps}
    queue_positions = dict.fromkeys(instance_of_queue, "0-0")
    client = connect(redis_url)
    started_at = next_round_at = time.perf_counter()
    seq = 0
    try:
        while not stop.is_set():
            seq += 1
            finished = _read_placed(client, queue_positions, instance_of_queue)
            pipe = client.pipeline(transaction=False)
            for instance_id, beat_map in beat_maps.items():
                beat = {**beat_map, "seq": seq, "sent_at_s": time.time(),
                        "engine_time_s": time.perf_counter() - started_at,
                        "finished_ids": finished.get(instance_id, [])}
                pipe.xadd(keys.heartbeats, {PAYLOAD_FIELD: encode(beat)})
            pipe.execute()
            first_round_done.set()
            next_round_at += HEARTBEAT_INTERVAL_S
            stop.wait(max(0.0, next_round_at - time.perf_counter()))
    finally:
        client.close()


def _read_placed(client: redis.Redis, queue_positions: dict[str, str],
                 instance_of_queue: dict[str, str]) -> dict[str, list[str]]:
    """The ids placed on each instance since the last call (its queue read from there on)."""
    finished: dict[str, list[str]] = {}
    for stream, entries in client.xread(queue_positions):  # type: ignore[union-attr]
        queue = stream.decode()
        queue_positions[queue] = entries[-1][0].decode()
        finished[instance_of_queue[queue]] = [unpack_map(fields[PAYLOAD_FIELD.encode()])["id"]
                                              for _, fields in entries]
    return finished


def _start_fleet(redis_url: str, keys: Keys, instances: int, running: int, waiting: int,
                 seed: int) -> tuple[BaseProcess, Event]:
    """The fleet's process (spawned: this one runs an event loop and holds connections)
    and its stop event, once its first round of beats is in Redis."""
    context = get_context("spawn")
    first_round_done, stop = context.Event(), context.Event()
    fleet = context.Process(target=beat_fleet, name="dispatch-bench-fleet", daemon=True,
                            args=(redis_url, keys.prefix, instances, running, waiting, seed, first_round_done, stop))
    fleet.start()
    deadline = time.monotonic() + FLEET_START_TIMEOUT_S
    while not first_round_done.wait(0.1):
        if not fleet.is_alive() or time.monotonic() > deadline:
            _stop_fleet(fleet, stop)
            raise RuntimeError(f"dispatch-bench: the emulated fleet did not beat (exit code {fleet.exitcode})")
    return fleet, stop


def _stop_fleet(fleet: BaseProcess, stop: Event) -> None:
    stop.set()
    fleet.join(10)
    if fleet.is_alive():
        fleet.terminate()
        fleet.join()


async def _fill_ready(client: aioredis.Redis, keys: Keys, num_requests: int, rng: random.Random,
                      request_factory: RequestFactory) -> list[str]:
    """Add ``num_requests`` requests to ``ready``, stamped with the wall clock; their ids."""
    request_ids: list[str] = []
    for first in range(0, num_requests, REDIS_CHUNK):
        pipe = client.pipeline(transaction=False)
        for _ in range(first, min(num_requests, first + REDIS_CHUNK)):
            request = request_factory(rng, keys, time.time())
            request_ids.append(request.id)
            pipe.xadd(keys.ready, {PAYLOAD_FIELD: encode(request)})
        await pipe.execute()
    return request_ids


def num_decided(dispatcher: Dispatcher) -> int:
    """Requests the dispatcher has placed, refused or rejected (what it holds is not)."""
    stats = dispatcher.core.stats
    return stats.num_placed + stats.num_infeasible + stats.num_rejected


async def _place_until_decided(dispatcher: Dispatcher, num_requests: int, undecided_wait_s: float) -> float:
    """Step ``dispatcher`` until ``num_requests`` are decided, or none has been for
    ``undecided_wait_s``; the seconds from the first step to the last decision."""
    started_at = last_decided_at = time.perf_counter()
    decided = 0
    while decided < num_requests and time.perf_counter() - last_decided_at <= undecided_wait_s:
        await dispatcher.step()
        if num_decided(dispatcher) > decided:
            decided, last_decided_at = num_decided(dispatcher), time.perf_counter()
    return last_decided_at - started_at


async def read_outcomes(client: aioredis.Redis, keys: Keys, request_ids: list[str],
                        instance_ids: list[str]) -> dict[str, int]:
    """Each request's outcome as Redis holds it: placed (its owner key, set with its queue
    entry), refused (its final flag: the infeasible answer), dead-lettered, held (pending in
    ``ready``, or never read). ``num_queue_entries`` counts the instance queues' entries
    (one per placement); ``num_placed_and_refused``: requests with both marks."""
    marks: list[int] = []
    for first in range(0, len(request_ids), REDIS_CHUNK):
        pipe = client.pipeline(transaction=False)
        for request_id in request_ids[first:first + REDIS_CHUNK]:
            pipe.exists(keys.owner(request_id))
            pipe.exists(keys.final_flag(request_id))
        marks.extend(await pipe.execute())
    placed, refused = marks[0::2], marks[1::2]
    pipe = client.pipeline(transaction=False)
    for instance_id in instance_ids:
        pipe.xlen(keys.instance_queue(instance_id))
    pipe.xlen(keys.dead_letters)
    pipe.xinfo_groups(keys.ready)
    *queue_lengths, num_dead, groups = await pipe.execute()
    (group,) = [g for g in groups if g["name"].decode() == GROUP_DISPATCH]
    last_delivered = group["last-delivered-id"].decode()
    # Redis 6.2 has no group lag: the entries after the last delivered one were never read.
    never_read = await client.xrange(keys.ready, min=f"({last_delivered}", max="+")
    return {"num_placed": sum(placed), "num_refused": sum(refused), "num_dead_lettered": num_dead,
            "num_held": group["pending"] + len(never_read), "num_queue_entries": sum(queue_lengths),
            "num_placed_and_refused": sum(1 for p, r in zip(placed, refused, strict=True) if p and r)}


async def _delete_keys(client: aioredis.Redis, keys: Keys) -> None:
    batch: list[bytes] = []
    async for key in client.scan_iter(match=f"{keys.prefix}*", count=1000):
        batch.append(key)
        if len(batch) >= REDIS_CHUNK:
            await client.delete(*batch)
            batch.clear()
    if batch:
        await client.delete(*batch)


async def bench_placements(redis_url: str, *, policy: str = "round_robin", instances: int = 16,
                           running: int = 48, waiting: int = 20, requests: int = 10_000, seed: int = 0,
                           slo_ttft_ms: int = 0, undecided_wait_s: float = 5.0,
                           request_factory: RequestFactory = make_request) -> dict[str, Any]:
    """Placements/s of a real dispatcher from ``ready`` to the instance queues, and every
    request's outcome (see the module docstring). Keys live under a fresh prefix, deleted
    at the end; the fleet's process is always stopped."""
    settings = Settings(redis_url=redis_url, key_prefix=f"bench{uuid.uuid4().hex[:6]}:", log_level="warning",
                        slo_ttft_ms=slo_ttft_ms)
    keys = settings.keys
    client = connect_async(redis_url)
    dispatcher = create_dispatcher(client, settings, policy, dispatcher_id="bench", seed=seed,
                                   options=DispatcherOptions(batch_size=256, dead_after_s=3600))
    fleet: tuple[BaseProcess, Event] | None = None
    try:
        await dispatcher.consumer.ensure_group()
        fleet = await asyncio.to_thread(_start_fleet, redis_url, keys, instances, running, waiting, seed)
        await dispatcher.follow_heartbeats()
        prepare_for_decisions(dispatcher.core)
        request_ids = await _fill_ready(client, keys, requests, random.Random(seed + 1), request_factory)
        # The beats of the start-up (compiling the simulation can take seconds) are not
        # the window's work: read them before the clock starts.
        await dispatcher.follow_heartbeats()
        num_beats_before = dispatcher.core.stats.num_beats_applied
        elapsed_s = await _place_until_decided(dispatcher, requests, undecided_wait_s)
        num_beats = dispatcher.core.stats.num_beats_applied - num_beats_before
        if not fleet[0].is_alive():
            raise RuntimeError(f"dispatch-bench: the emulated fleet exited ({fleet[0].exitcode}) during the run")
        in_redis = await read_outcomes(client, keys, request_ids, [f"i{k}" for k in range(instances)])
    finally:
        if fleet is not None:
            await asyncio.to_thread(_stop_fleet, *fleet)
        await _delete_keys(client, keys)
        await client.aclose()
    return _summary(dispatcher, policy, instances, requests, elapsed_s, num_beats, in_redis)


def _summary(dispatcher: Dispatcher, policy: str, instances: int, requests: int, elapsed_s: float,
             num_beats: int, in_redis: dict[str, int]) -> dict[str, Any]:
    stats = dispatcher.core.stats
    decision_ms = np.array(dispatcher.decision_ms or [0.0])
    elapsed_s = max(elapsed_s, 1e-9)
    return {"policy": policy, "instances": instances, "requests": requests,
            "placed": stats.num_placed, "refused": stats.num_infeasible, "rejected": stats.num_rejected,
            "held": requests - num_decided(dispatcher), "all_decided": num_decided(dispatcher) == requests,
            "seconds": elapsed_s, "placements_per_s": stats.num_placed / elapsed_s,
            "decisions_per_s": num_decided(dispatcher) / elapsed_s, "beats_per_s": num_beats / elapsed_s,
            "decision_p50_ms": float(np.percentile(decision_ms, 50)),
            "decision_p99_ms": float(np.percentile(decision_ms, 99)), "in_redis": in_redis}


def run_placements(redis_url: str, **kwargs: Any) -> dict[str, Any]:
    return asyncio.run(bench_placements(redis_url, **kwargs))
