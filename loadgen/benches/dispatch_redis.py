"""``blockq dispatch-bench --redis``: placements/s of a real dispatcher through Redis.

A real :class:`~dispatcher.service.Dispatcher`, stepped in this process, places the
requests of a pre-filled ``ready`` on the instance queues of a fleet emulated in a child
process (:mod:`loadgen.benches.beating_fleet`): instances that beat every 100 ms and
report what was placed on them as finished.

**It ends whatever the outcomes.** Each request is placed, refused (infeasible: answered
at once), dead-lettered (rejected), or held (no instance may take it now: it stays
pending in ``ready`` and is offered again); one the dispatcher has not read yet is
unread. The bench stops once every request is decided, once none has been decided for
``undecided_wait_s``, or after ``max_seconds``. The outcomes are counted by the
dispatcher and read back from Redis (:func:`read_outcomes`), so a request with no
outcome, or two, shows as a mismatch.

**A dispatcher the beats outpace** reads one bounded batch of beats a step
(:meth:`dispatcher.beat_reads.BeatFollower.follow`) and places between them, falling ever
further behind the beat stream: ``beat_lag_s`` at the end says by how much (the age of
the last beat applied, by Redis' clock; a dispatcher that keeps up is within a read of
now). Before the clock starts, the bench reads beats until it has caught up, for at most
``undecided_wait_s``, then places whether or not it has (``caught_up_before``).

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
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from blockq.config import Settings
from blockq.wire.connections import connect_async
from blockq.wire.keys import GROUP_DISPATCH, PAYLOAD_FIELD, Keys
from blockq.wire.protocol import Request, encode
from dispatcher.policies.shortlist import DEFAULT_SIMULATED_CANDIDATES
from dispatcher.service import (
    Dispatcher,
    DispatcherOptions,
    create_dispatcher,
    prepare_for_decisions,
)
from loadgen.benches.beating_fleet import EmulatedFleet
from loadgen.benches.dispatch import make_request

REDIS_CHUNK = 10_000  # commands per pipeline when filling ``ready`` and reading outcomes back
WINDOW_S = 10.0  # the placements of each such stretch of a run are reported (was the rate sustained?)

RequestFactory = Callable[[random.Random, Keys, float], Request]


def num_decided(dispatcher: Dispatcher) -> int:
    """Requests the dispatcher has placed, refused or rejected (what it holds is not)."""
    stats = dispatcher.core.stats
    return stats.num_placed + stats.num_infeasible + stats.num_rejected


@dataclass(frozen=True)
class Stretch:
    """The counts at the start of a stretch of the run, for the beat rates over it."""

    started_at: float
    num_beats_applied: int
    num_beats_sent: int

    @classmethod
    def begin(cls, dispatcher: Dispatcher, fleet: EmulatedFleet) -> Stretch:
        return cls(time.perf_counter(), dispatcher.core.stats.num_beats_applied, fleet.num_beats_sent)

    def beat_rates(self, dispatcher: Dispatcher, fleet: EmulatedFleet) -> dict[str, float]:
        """Beats/s the dispatcher applied and the fleet sent, from the start to now."""
        seconds = max(time.perf_counter() - self.started_at, 1e-9)
        return {"beats_per_s": (dispatcher.core.stats.num_beats_applied - self.num_beats_applied) / seconds,
                "beats_sent_per_s": (fleet.num_beats_sent - self.num_beats_sent) / seconds}


async def _catch_up_with_beats(dispatcher: Dispatcher, wait_s: float) -> bool:
    """Apply the beats published so far; False when that took over ``wait_s``."""
    deadline = time.perf_counter() + wait_s
    while not await dispatcher.follow_heartbeats():
        if time.perf_counter() > deadline:
            return False
    return True


async def _place_until_decided(dispatcher: Dispatcher, num_requests: int, undecided_wait_s: float,
                               max_seconds: float | None) -> tuple[float, str, list[int]]:
    """Step ``dispatcher`` until ``num_requests`` are decided, none has been for
    ``undecided_wait_s`` or ``max_seconds`` have passed (checked between steps: each reads
    one bounded batch of beats). Returns the seconds from the first step to the last
    decision (with none, to the end), why it ended, and the placements in each
    :data:`WINDOW_S` of the run (whether a rate was sustained)."""
    started_at = last_decided_at = time.perf_counter()
    stop_at = started_at + (max_seconds if max_seconds is not None else float("inf"))
    decided, window_ends_at, placed_by_window = 0, started_at + WINDOW_S, [dispatcher.core.stats.num_placed]
    while decided < num_requests:
        now = time.perf_counter()
        if now >= stop_at or now - last_decided_at > undecided_wait_s:
            break
        if now >= window_ends_at:
            placed_by_window.append(dispatcher.core.stats.num_placed)
            window_ends_at += WINDOW_S
        await dispatcher.step()
        if num_decided(dispatcher) > decided:
            decided, last_decided_at = num_decided(dispatcher), time.perf_counter()
    if decided == num_requests:
        ended_by = "all decided"
    elif time.perf_counter() >= stop_at:
        ended_by = f"max_seconds ({max_seconds} s)"
    else:
        ended_by = f"none decided for {undecided_wait_s} s"
    windows = [b - a for a, b in zip(placed_by_window, placed_by_window[1:], strict=False)]
    return (last_decided_at if decided else time.perf_counter()) - started_at, ended_by, windows


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


async def _beat_lag_s(client: aioredis.Redis, dispatcher: Dispatcher) -> float:
    """How far behind the beat stream the dispatcher is: the age, by Redis' clock, of the
    last beat it applied."""
    seconds, microseconds = await client.time()
    return max(0.0, seconds + microseconds / 1e6 - _entry_order(dispatcher.beats.last_beat_id)[0] / 1000)


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
                           request_factory: RequestFactory = make_request,
                           simulated_candidates: int | None = DEFAULT_SIMULATED_CANDIDATES) -> dict[str, Any]:
    """Placements/s of a real dispatcher from ``ready`` to the instance queues, and every
    request's outcome (see the module docstring). Keys live under a fresh prefix, deleted
    at the end; the fleet's process is always stopped."""
    settings = Settings(redis_url=redis_url, key_prefix=f"bench{uuid.uuid4().hex[:6]}:", log_level="warning",
                        slo_ttft_ms=slo_ttft_ms)
    keys = settings.keys
    client = connect_async(redis_url)
    dispatcher = create_dispatcher(client, settings, policy, dispatcher_id="bench", seed=seed,
                                   options=DispatcherOptions(batch_size=256, dead_after_s=3600,
                                                             num_simulated_candidates=simulated_candidates))
    fleet: EmulatedFleet | None = None
    try:
        await dispatcher.consumer.ensure_group()
        fleet = await asyncio.to_thread(EmulatedFleet.start, redis_url, keys, instances, running, waiting, seed)
        stretch = Stretch.begin(dispatcher, fleet)
        caught_up = await _catch_up_with_beats(dispatcher, undecided_wait_s)
        prepare_for_decisions(dispatcher.core)
        request_of_entry = await _fill_ready(client, keys, requests, random.Random(seed + 1), request_factory)
        # With the beats of the start-up (compiling can take seconds), outside the window.
        caught_up = await _catch_up_with_beats(dispatcher, undecided_wait_s) and caught_up
        stretch = Stretch.begin(dispatcher, fleet)
        elapsed_s, ended_by, placed_by_window = await _place_until_decided(dispatcher, requests, undecided_wait_s,
                                                                           max_seconds)
        beat_rates = {**stretch.beat_rates(dispatcher, fleet), "beat_lag_s": await _beat_lag_s(client, dispatcher),
                      "caught_up_before": caught_up, "placed_by_window": placed_by_window}
        if fleet.process.exitcode not in (None, 0):
            raise RuntimeError(f"dispatch-bench: the emulated fleet failed ({fleet.process.exitcode}) during the run")
        in_redis = await read_outcomes(client, keys, request_of_entry, [f"i{k}" for k in range(instances)])
    finally:
        if fleet is not None:
            await asyncio.to_thread(fleet.close)
        await _delete_keys(client, keys)
        await client.aclose()
    return {"policy": policy, "instances": instances, "requests": requests, "ended_by": ended_by,
            **_summary(dispatcher, requests, elapsed_s), **beat_rates, "in_redis": in_redis}


def _summary(dispatcher: Dispatcher, requests: int, elapsed_s: float) -> dict[str, Any]:
    """The dispatcher's counts, and its rates over ``elapsed_s``."""
    stats = dispatcher.core.stats
    decision_ms = np.array(dispatcher.decision_ms or [0.0])
    elapsed_s = max(elapsed_s, 1e-9)
    num_held = len(dispatcher.unplaced)
    return {"placed": stats.num_placed, "refused": stats.num_infeasible, "rejected": stats.num_rejected,
            "held": num_held, "unread": requests - num_decided(dispatcher) - num_held, "seconds": elapsed_s,
            "placements_per_s": stats.num_placed / elapsed_s, "decisions_per_s": num_decided(dispatcher) / elapsed_s,
            "decision_p50_ms": float(np.percentile(decision_ms, 50)),
            "decision_p99_ms": float(np.percentile(decision_ms, 99))}


def run_placements(redis_url: str, **kwargs: Any) -> dict[str, Any]:
    return asyncio.run(bench_placements(redis_url, **kwargs))
