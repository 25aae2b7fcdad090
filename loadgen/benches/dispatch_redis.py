"""``blockq dispatch-bench --redis``: placements/s of a real dispatcher through Redis.

A real :class:`~dispatcher.service.Dispatcher`, stepped in this process, places the
requests of a pre-filled ``ready`` on the instance queues. The fleet is emulated in a
child process (:func:`beat_fleet`), so that the figure is the dispatcher's work and not
the emulation's: every 100 ms each instance beats the same load (``running`` /
``waiting``) and reports as finished what was placed on it since its last beat (read
back from its queue), as a fleet that keeps pace with its arrivals would.

**It ends whatever the outcomes.** Each request is placed, refused (infeasible: answered
at once), dead-lettered (rejected), or held (no instance may take it now: it stays
pending in ``ready`` and is offered again); one the dispatcher has not read yet is
unread. The bench stops once every request is decided, once none has been decided for
``undecided_wait_s`` (held requests, or a dispatcher stuck in a step: the step is
cancelled), or after ``max_seconds``. The outcomes are counted by the dispatcher and read
back from Redis (:func:`read_outcomes`), so a request with no outcome, or two, shows as a
mismatch.

No cluster-wide TTFT objective by default (``slo_ttft_ms=0``): ``ready`` is filled before
the clock starts, so the tail of a large backlog waits for its head, and with an
objective it would be refused for that wait rather than placed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.process import BaseProcess
from multiprocessing.sharedctypes import Synchronized
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
HEARTBEATS_MAXLEN = 20_000  # the beat stream's cap, as the workers keep it (workers/worker.py)

RequestFactory = Callable[[random.Random, Keys, float], Request]


def beat_fleet(redis_url: str, key_prefix: str, num_instances: int, running: int, waiting: int, seed: int,
               num_rounds: Synchronized, stop: Event) -> None:
    """Child process: ``num_instances`` instances beating every 100 ms until ``stop``;
    ``num_rounds`` counts the rounds of beats written (late rounds are not skipped).

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
                pipe.xadd(keys.heartbeats, {PAYLOAD_FIELD: encode(beat)}, maxlen=HEARTBEATS_MAXLEN,
                          approximate=True)
            pipe.execute()
            num_rounds.value = seq
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


@dataclass
class EmulatedFleet:
    """The fleet's process (:func:`beat_fleet`), its stop event and its count of rounds."""

    process: BaseProcess
    stop: Event
    num_rounds: Synchronized

    @classmethod
    def start(cls, redis_url: str, keys: Keys, instances: int, running: int, waiting: int,
              seed: int) -> EmulatedFleet:
        """Spawn it (this process runs an event loop and holds connections: no fork) and
        wait until its first round of beats is in Redis."""
        context = get_context("spawn")
        stop, num_rounds = context.Event(), context.Value("q", 0)
        process = context.Process(target=beat_fleet, name="dispatch-bench-fleet", daemon=True,
                                  args=(redis_url, keys.prefix, instances, running, waiting, seed, num_rounds, stop))
        fleet = cls(process, stop, num_rounds)
        process.start()
        deadline = time.monotonic() + FLEET_START_TIMEOUT_S
        while fleet.num_rounds.value < 1:
            if not fleet.process.is_alive() or time.monotonic() > deadline:
                fleet.close()
                raise RuntimeError(f"dispatch-bench: the emulated fleet did not beat "
                                   f"(exit code {fleet.process.exitcode})")
            time.sleep(0.05)
        return fleet

    def close(self) -> None:
        self.stop.set()
        self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()


async def _fill_ready(client: aioredis.Redis, keys: Keys, num_requests: int, rng: random.Random,
                      request_factory: RequestFactory) -> dict[str, str]:
    """Add ``num_requests`` requests to ``ready``, stamped with the wall clock; their ids
    by their entry ids there."""
    request_of_entry: dict[str, str] = {}
    for first in range(0, num_requests, REDIS_CHUNK):
        pipe = client.pipeline(transaction=False)
        request_ids = []
        for _ in range(first, min(num_requests, first + REDIS_CHUNK)):
            request = request_factory(rng, keys, time.time())
            request_ids.append(request.id)
            pipe.xadd(keys.ready, {PAYLOAD_FIELD: encode(request)})
        entry_ids = await pipe.execute()
        request_of_entry.update((entry_id.decode(), request_id) for entry_id, request_id
                                in zip(entry_ids, request_ids, strict=True))
    return request_of_entry


def num_decided(dispatcher: Dispatcher) -> int:
    """Requests the dispatcher has placed, refused or rejected (what it holds is not)."""
    stats = dispatcher.core.stats
    return stats.num_placed + stats.num_infeasible + stats.num_rejected


async def _place_until_decided(dispatcher: Dispatcher, num_requests: int, undecided_wait_s: float,
                               max_seconds: float | None) -> tuple[float, str]:
    """Step ``dispatcher`` until ``num_requests`` are decided, none has been for
    ``undecided_wait_s`` or ``max_seconds`` have passed. Returns the seconds from the first
    step to the last decision, and why it ended."""
    started_at = last_decided_at = time.perf_counter()
    stop_at = started_at + (max_seconds if max_seconds is not None else float("inf"))
    decided = 0
    while decided < num_requests and time.perf_counter() < stop_at:
        # A step may not end at all (one that reads beats until it has caught up with a
        # fleet beating faster than it reads): it gets what is left of the wait. The time
        # limit is checked between steps only, so that no decision is cut off from its write.
        wait_left_s = last_decided_at + undecided_wait_s - time.perf_counter()
        if wait_left_s <= 0:
            break
        try:
            await asyncio.wait_for(dispatcher.step(), wait_left_s)
        except TimeoutError:
            break
        if num_decided(dispatcher) > decided:
            decided, last_decided_at = num_decided(dispatcher), time.perf_counter()
    if decided == num_requests:
        ended_by = "all decided"
    elif time.perf_counter() >= stop_at:
        ended_by = f"max_seconds ({max_seconds} s)"
    else:
        ended_by = f"none decided for {undecided_wait_s} s"
    # The window ends at the last decision; with none, it is all the time stepped.
    return (last_decided_at if decided else time.perf_counter()) - started_at, ended_by


def _entry_order(entry_id: str) -> tuple[int, int]:
    milliseconds, sequence = entry_id.split("-")
    return int(milliseconds), int(sequence)


async def read_outcomes(client: aioredis.Redis, keys: Keys, request_of_entry: dict[str, str],
                        instance_ids: list[str]) -> dict[str, int]:
    """Each request's outcome as Redis holds it: placed (its owner key, set with its queue
    entry), refused (its final flag: the infeasible answer), dead-lettered, held (read and
    pending in ``ready``), unread. ``num_queue_entries`` counts the instance queues' entries
    (one per placement); ``num_placed_and_refused``: requests with both marks."""
    request_ids = list(request_of_entry.values())
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
    # Redis 6.2 has no group lag: the entries after the last delivered one were never read.
    last_delivered = _entry_order(group["last-delivered-id"].decode())
    num_unread = sum(1 for entry_id in request_of_entry if _entry_order(entry_id) > last_delivered)
    return {"num_placed": sum(placed), "num_refused": sum(refused), "num_dead_lettered": num_dead,
            "num_held": group["pending"], "num_unread": num_unread, "num_queue_entries": sum(queue_lengths),
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
                           slo_ttft_ms: int = 0, undecided_wait_s: float = 5.0, max_seconds: float | None = None,
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
    fleet: EmulatedFleet | None = None
    try:
        await dispatcher.consumer.ensure_group()
        fleet = await asyncio.to_thread(EmulatedFleet.start, redis_url, keys, instances, running, waiting, seed)
        await _catch_up_with_beats(dispatcher, undecided_wait_s)
        prepare_for_decisions(dispatcher.core)
        request_of_entry = await _fill_ready(client, keys, requests, random.Random(seed + 1), request_factory)
        # The beats of the start-up (compiling the simulation can take seconds) are not
        # the window's work: read them before the clock starts.
        await _catch_up_with_beats(dispatcher, undecided_wait_s)
        num_beats_before, num_rounds_before = dispatcher.core.stats.num_beats_applied, fleet.num_rounds.value
        elapsed_s, ended_by = await _place_until_decided(dispatcher, requests, undecided_wait_s, max_seconds)
        num_beats = dispatcher.core.stats.num_beats_applied - num_beats_before
        num_beats_sent = (fleet.num_rounds.value - num_rounds_before) * instances
        if not fleet.process.is_alive():
            raise RuntimeError(f"dispatch-bench: the emulated fleet exited ({fleet.process.exitcode}) during the run")
        in_redis = await read_outcomes(client, keys, request_of_entry, [f"i{k}" for k in range(instances)])
    finally:
        if fleet is not None:
            await asyncio.to_thread(fleet.close)
        await _delete_keys(client, keys)
        await client.aclose()
    return {"policy": policy, "instances": instances, "requests": requests, "ended_by": ended_by,
            **_summary(dispatcher, requests, elapsed_s, num_beats), "beats_sent_per_s": num_beats_sent / max(elapsed_s, 1e-9),
            "in_redis": in_redis}


async def _catch_up_with_beats(dispatcher: Dispatcher, wait_s: float) -> None:
    """Apply the beats published so far; at most ``wait_s``, since a dispatcher that reads
    beats slower than the fleet writes them never catches up (the read is cancelled)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(dispatcher.follow_heartbeats(), wait_s)


def _summary(dispatcher: Dispatcher, requests: int, elapsed_s: float, num_beats: int) -> dict[str, Any]:
    """The dispatcher's counts and rates over the window (from the first step to the last
    decision)."""
    stats = dispatcher.core.stats
    decision_ms = np.array(dispatcher.decision_ms or [0.0])
    elapsed_s = max(elapsed_s, 1e-9)
    num_held = len(dispatcher.unplaced)
    return {"placed": stats.num_placed, "refused": stats.num_infeasible, "rejected": stats.num_rejected,
            "held": num_held, "unread": requests - num_decided(dispatcher) - num_held, "seconds": elapsed_s, "placements_per_s": stats.num_placed / elapsed_s,
            "decisions_per_s": num_decided(dispatcher) / elapsed_s, "beats_per_s": num_beats / elapsed_s,
            "decision_p50_ms": float(np.percentile(decision_ms, 50)),
            "decision_p99_ms": float(np.percentile(decision_ms, 99))}


def run_placements(redis_url: str, **kwargs: Any) -> dict[str, Any]:
    return asyncio.run(bench_placements(redis_url, **kwargs))
