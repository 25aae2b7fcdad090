"""``blockq dispatch-bench --redis`` ends whatever each request's outcome, and counts each
one, against a real Redis and a real dispatcher (small sizes: a few seconds each)."""

from __future__ import annotations

import itertools
import json
import random
import time
from dataclasses import replace

import redis

from blockq.wire.keys import Keys
from blockq.wire.protocol import Request
from loadgen.benches.dispatch import make_request
from loadgen.benches.dispatch_redis import RequestFactory, run_placements
from tests.conftest import run_blockq


def mixed_requests() -> RequestFactory:
    """Of every five requests: three placed, one ``batch`` (held: the instances beat
    waiting work, so none has idle capacity), one whose deadline passed before it was sent
    (refused as infeasible)."""
    index = itertools.count()

    def make(rng: random.Random, keys: Keys, submitted_at_s: float) -> Request:
        request = make_request(rng, keys, submitted_at_s)
        kind = next(index) % 5
        if kind == 3:
            return replace(request, priority="batch")
        if kind == 4:
            return replace(request, deadline_s=submitted_at_s - 1.0)
        return request

    return make


def test_cli_places_every_request_and_returns() -> None:
    # The reported hang: every request was refused as having waited since 1970, and the
    # loop waited for all of them to be placed.
    done = run_blockq("dispatch-bench", "--redis", "embedded", "--policy", "round_robin", "--instances", "4",
                      "--running", "6", "--waiting", "2", "--requests", "50", "--json", timeout_s=30)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["placed"] == result["in_redis"]["num_placed"] == result["in_redis"]["num_queue_entries"] == 50
    assert result["ended_by"] == "all decided" and result["held"] == result["unread"] == result["refused"] == 0
    assert result["placements_per_s"] > 0


def test_bench_ends_with_held_and_refused_requests_and_counts_each(redis_url: str, sync_redis: redis.Redis) -> None:
    started = time.monotonic()
    result = run_placements(redis_url, policy="round_robin", instances=3, running=4, waiting=2, requests=100,
                            undecided_wait_s=1.0, request_factory=mixed_requests())
    took_s = time.monotonic() - started
    assert 1.0 < took_s < 20  # it waited for the held requests, a bounded time
    assert (result["placed"], result["held"], result["refused"], result["rejected"], result["unread"]) == \
        (60, 20, 20, 0, 0)
    assert result["ended_by"] == "none decided for 1.0 s"
    # Redis agrees: one outcome per request, one queue entry per placement.
    in_redis = result["in_redis"]
    assert (in_redis["num_placed"], in_redis["num_held"], in_redis["num_refused"], in_redis["num_unread"]) == \
        (60, 20, 20, 0)
    assert in_redis["num_queue_entries"] == 60
    assert in_redis["num_placed_and_refused"] == in_redis["num_dead_lettered"] == 0
    # The window ends at the last decision: the wait for the held ones is not in it.
    assert result["placements_per_s"] > 0 and result["seconds"] < took_s - 1.0
    assert sync_redis.keys("bench*") == []  # its keys are deleted


def test_bench_stops_at_its_time_limit_with_every_request_accounted_for(redis_url: str) -> None:
    result = run_placements(redis_url, policy="round_robin", instances=2, running=4, waiting=2, requests=10_000,
                            max_seconds=0.3)
    assert result["ended_by"] == "max_seconds (0.3 s)"
    assert result["placed"] > 0 and result["unread"] > 0
    in_redis = result["in_redis"]
    assert (in_redis["num_placed"], in_redis["num_held"], in_redis["num_unread"]) == \
        (result["placed"], result["held"], result["unread"])
    assert result["placed"] + result["held"] + result["unread"] == 10_000
