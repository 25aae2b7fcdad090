"""Autoscaling, live: the leader's decisions in Redis (keys, stream, command hook,
metrics), the supervisor following them, and a real ``blockq up --autoscale`` cluster
(about 50 s) under a load that rises fourfold and falls again, every request answered
exactly once."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis

from blockq.config import AutoscaleOptions, ConfigError, MetricsEndpoint, Settings
from blockq.engine_model.packed import PackedScheduler
from blockq.local.supervisor import ChildSpec, Supervisor, WorkerScaling
from blockq.runtime.metrics_server import serve_metrics
from blockq.wire.beats import RequestProgress
from blockq.wire.keys import DECISION_FIELD, PAYLOAD_FIELD
from blockq.wire.protocol import FinalRecord, decode_reply_entry, encode
from blockq.wire.streams import connect_async
from dispatcher.autoscale import (
    DRAINING,
    LIVE,
    STARTING,
    FleetSnapshot,
    InstanceState,
    ScalingDecision,
)
from dispatcher.autoscale.service import instances_to_drain, starting_instances, with_draining
from dispatcher.service import Dispatcher, create_dispatcher
from tests.conftest import run_blockq, wait_until
from tests.factories import A30, make_heartbeat

# --- the pure parts -------------------------------------------------------------------------


def test_starting_entries_fill_the_target() -> None:
    assert starting_instances(4, 2, 1, 10.0) == {"starting-0": 10.0, "starting-1": 10.0}
    assert starting_instances(2, 3, 0, 10.0) == {}
    assert starting_instances(None, 2, 1, 10.0) == {"starting-0": 10.0}  # no target: the joining ones


def test_history_windows_count_in_cycles_and_default_at_a_minute() -> None:
    from dispatcher.autoscale import ArrivalHistory

    names = ("window_s", "level_window_s", "trend_window_s", "peak_window_s", "bin_s")
    assert [getattr(ArrivalHistory.for_cycle(60.0), n) for n in names] == [getattr(ArrivalHistory(), n) for n in names]
    assert [getattr(ArrivalHistory.for_cycle(2.0), n) for n in names] == [30.0, 4.0, 20.0, 10.0, 1.0]


def _snapshot(*states: InstanceState) -> FleetSnapshot:
    return FleetSnapshot(100.0, states, A30.config, A30.latency_model)


def test_drain_names_live_instances_in_drain_order_and_marks_show_draining() -> None:
    busy = PackedScheduler(A30.config, A30.latency_model, 100.0)
    busy.add_request("r", 500, 400, arrival_s=100.0)
    snapshot = _snapshot(InstanceState("a", LIVE, busy), InstanceState("b", LIVE, PackedScheduler(
        A30.config, A30.latency_model, 100.0)), InstanceState("starting-0", STARTING, ready_at_s=150.0))
    down = ScalingDecision(100.0, "predictive", 3, 1, 1, "", {})
    # The starting one is cancelled first (not named: an actuator stops its newest), then
    # the live one whose work finishes soonest.
    assert instances_to_drain(down, snapshot) == ["b"]
    assert instances_to_drain(ScalingDecision(100.0, "predictive", 3, 4, 4, "", {}), snapshot) == []
    marked = with_draining(snapshot, {"a"})
    assert [s.status for s in marked.instances] == [DRAINING, LIVE, STARTING]
    assert marked.num_provisioned == 2


def test_options_name_the_field() -> None:
    from dispatcher.cli import add_arguments, autoscale_options

    parser = __import__("argparse").ArgumentParser()
    add_arguments(parser)
    assert autoscale_options(parser.parse_args([])) is None
    cases = [(["--min-instances", "0"], "min_instances"), (["--max-instances", "0"], "max_instances"),
             (["--cooldown-s", "700"], "reversal_hold_s"), (["--cycle-s", "0"], "cycle_s"),
             (["--max-step-fraction", "1.5"], "max_step_fraction")]
    for argv, field in cases:
        with pytest.raises(ConfigError, match=field):
            autoscale_options(parser.parse_args(["--autoscale", "predictive", *argv]))


# --- the leader against a real Redis -----------------------------------------------------------


def _beat(sync_redis: redis.Redis, settings: Settings, instance_id: str, seq: int, num_waiting: int = 0) -> None:
    waiting = tuple(RequestProgress(f"{instance_id}-w{i}", 100, 0, 0, 100, 200) for i in range(num_waiting))
    sync_redis.xadd(settings.keys.heartbeats, {PAYLOAD_FIELD: encode(make_heartbeat(instance_id, seq=seq,
                                                                                    waiting=waiting))})


def _decisions(sync_redis: redis.Redis, settings: Settings) -> list[dict[str, Any]]:
    return [json.loads(fields[DECISION_FIELD.encode()])
            for _, fields in sync_redis.xrange(settings.keys.autoscaler_decisions)]


async def _step_at(dispatcher: Dispatcher, clock: list[float], at_s: float) -> None:
    clock[0] = at_s
    await dispatcher.step()


async def test_leader_writes_decisions_runs_the_hook_and_serves_metrics(
        settings: Settings, sync_redis: redis.Redis, tmp_path: Path) -> None:
    hook_file = tmp_path / "targets"
    options = AutoscaleOptions(scaler="reactive", min_instances=1, max_instances=4, cooldown_s=0, reversal_hold_s=0,
                               cycle_s=1.0, startup_s=5.0, scale_command=f"echo {{n}} >> {hook_file}")
    sync_redis.set(settings.keys.autoscaler_desired, 1)  # as the supervisor seeds it
    client = connect_async(settings.redis_url)
    dispatcher = create_dispatcher(client, settings, "round_robin", dispatcher_id="d-auto", autoscale=options)
    await dispatcher.consumer.ensure_group()
    start_s = time.time()
    clock = [start_s]
    dispatcher.clock = lambda: clock[0]
    autoscaling = dispatcher.autoscaling
    assert autoscaling is not None and autoscaling.metrics is not None and autoscaling.command is not None
    # The autoscaler's metrics are served with the dispatcher's, on one port.
    server = await serve_metrics(dispatcher.metrics.registry, MetricsEndpoint(0))
    try:
        _beat(sync_redis, settings, "a", 1, num_waiting=3)  # a queue: the reactive rule wants 3
        await _step_at(dispatcher, clock, start_s)
        assert _decisions(sync_redis, settings) == []  # the first decision waits one cycle
        _beat(sync_redis, settings, "a", 2, num_waiting=3)  # (fresh beats: the clock is the test's)
        await _step_at(dispatcher, clock, start_s + 1.1)
        (up,) = _decisions(sync_redis, settings)
        assert (up["current"], up["desired"], up["target"], up["direction"], up["drain"]) == (1, 3, 2, "up", [])
        assert sync_redis.get(settings.keys.autoscaler_desired) == b"2"
        assert json.loads(sync_redis.get(settings.keys.autoscaler_drain)) == []
        # Idle now, and a second instance came up: one must go, the first in drain order.
        _beat(sync_redis, settings, "a", 3)
        _beat(sync_redis, settings, "b", 1)
        await _step_at(dispatcher, clock, start_s + 1.5)
        assert len(_decisions(sync_redis, settings)) == 1  # not due yet
        _beat(sync_redis, settings, "a", 4)
        _beat(sync_redis, settings, "b", 2)
        await _step_at(dispatcher, clock, start_s + 2.2)
        down = _decisions(sync_redis, settings)[-1]
        assert (down["current"], down["target"], down["direction"], down["drain"]) == (2, 1, "down", ["a"])
        assert sync_redis.get(settings.keys.autoscaler_desired) == b"1"
        assert json.loads(sync_redis.get(settings.keys.autoscaler_drain)) == ["a"]
        # "a" still beats live: it is counted as draining, not as serving.
        assert autoscaling.snapshot(start_s + 2.3, 0).num_provisioned == 1
        await autoscaling.command.wait_idle()
        assert hook_file.read_text().split() == ["2", "1"]
        # The server runs in this loop: read it from another thread.
        with await asyncio.to_thread(urllib.request.urlopen, server.url, timeout=5) as reply:
            text = reply.read().decode()
        assert "blockq_autoscaler_desired_instances 1.0" in text
        assert "blockq_autoscaler_current_instances 2.0" in text
        assert 'blockq_autoscaler_actions_total{direction="up"} 1.0' in text
        assert 'blockq_autoscaler_actions_total{direction="down"} 1.0' in text
        assert 'blockq_dispatcher_decisions_total{outcome="placed",policy="round_robin"} 0.0' in text
    finally:
        await autoscaling.close()
        await server.close()
    # A new leader picks up the target and the cooldown clock from Redis.
    successor = create_dispatcher(client, settings, "round_robin", dispatcher_id="d-next",
                                  autoscale=AutoscaleOptions(scaler="reactive", cycle_s=1.0))
    successor.clock = lambda: clock[0]
    await successor.consumer.ensure_group()
    await successor.step()
    assert successor.autoscaling is not None and successor.autoscaling.target == 1
    actions = successor.autoscaling.autoscaler.actions
    assert (actions.last_up_s, actions.last_down_s) == (up["at_s"], down["at_s"])
    await client.aclose()


# --- the supervisor following the keys ----------------------------------------------------------

# A child that runs until signalled (python -m timeit runs the statement once).
SLEEPER = ("timeit", "-n", "1", "-r", "1", "import time; time.sleep(120)")


def test_supervisor_grows_drains_named_workers_and_restarts_crashed_ones(
        settings: Settings, sync_redis: redis.Redis, tmp_path: Path) -> None:
    keys = settings.keys
    scaling = WorkerScaling(worker_spec=lambda i: ChildSpec(f"workers-{i}", SLEEPER), instance_id=lambda i: f"inst-{i}",
                            initial=2, min_instances=1, max_instances=5, desired_key=keys.autoscaler_desired,
                            drain_key=keys.autoscaler_drain, poll_s=0.0)
    (tmp_path / "logs").mkdir()
    supervisor = Supervisor(tmp_path, [], redis_url=settings.redis_url, num_instances=2, scaling=scaling)
    sync_redis.set(keys.autoscaler_desired, 9)  # an earlier run's: the supervisor's own size wins
    sync_redis.set(keys.autoscaler_drain, '["inst-0"]')

    def workers() -> dict[int, tuple[bool, int | None]]:
        return {c.index: (c.retired, c.process.pid if c.process else None) for c in supervisor.children}

    try:
        supervisor._seed_scaling(scaling)
        assert sync_redis.get(keys.autoscaler_desired) == b"2" and not sync_redis.exists(keys.autoscaler_drain)
        for child in supervisor.children:
            supervisor._start(child)
        sync_redis.set(keys.autoscaler_desired, 4)
        supervisor._follow_scaling(scaling)
        assert sorted(workers()) == [0, 1, 2, 3]
        # Shrink to 2: the named instance first, then the newest.
        sync_redis.set(keys.autoscaler_drain, '["inst-1"]')
        sync_redis.set(keys.autoscaler_desired, 2)
        supervisor._follow_scaling(scaling)
        assert {i for i, (retired, _) in workers().items() if retired} == {1, 3}
        # Grow again while they drain: their indexes stay theirs.
        sync_redis.set(keys.autoscaler_desired, 3)
        supervisor._follow_scaling(scaling)
        assert sorted(i for i, (retired, _) in workers().items() if not retired) == [0, 2, 4]
        # Retired workers are forgotten once they exit, never restarted.
        wait_until(lambda: (supervisor._restart_dead_children(), sorted(workers()) == [0, 2, 4])[1], timeout_s=10)
        # A crashed worker is restarted as before.
        crashed = next(c for c in supervisor.children if c.index == 2)
        old_pid = crashed.process.pid  # type: ignore[union-attr]
        crashed.process.kill()  # type: ignore[union-attr]
        wait_until(lambda: (supervisor._restart_dead_children(), workers()[2][1] not in (None, old_pid))[1],
                   timeout_s=10)
        assert supervisor._num_workers() == 3
    finally:
        supervisor._stop_children()


# --- a real cluster -------------------------------------------------------------------------------

WORDS = ("alpha", "river", "stone", "cloud", "green", "seven", "paper", "light")
PROMPT_WORDS = 400  # about 400 tokens; with 200 output tokens one emulated A30 holds ~2 req/s
OUTPUT_TOKENS = 200
LOW_RATE_PER_S = 1.5
TIMINGS = {"cycle_s": 2.0, "cooldown_s": 6.0, "reversal_hold_s": 12.0, "startup_s": 3.0}


class LoadRun:
    """Submits Poisson arrivals at a rate the test changes; every handle is awaited."""

    def __init__(self, redis_url: str) -> None:
        from blockq import AsyncClient

        # Reply streams kept past the run, to count each one's final records at the end.
        self.client = AsyncClient(settings=Settings(redis_url=redis_url, reply_read_ttl_s=3600))
        self.rate_per_s = LOW_RATE_PER_S
        self.rng = random.Random(7)
        self.results: list[asyncio.Task[FinalRecord]] = []
        self.ids: list[str] = []
        self.stopped = asyncio.Event()

    async def submit_until_stopped(self) -> None:
        from blockq import SubmitSpec

        while not self.stopped.is_set():
            await asyncio.sleep(self.rng.expovariate(self.rate_per_s))
            prompt = " ".join(self.rng.choice(WORDS) for _ in range(PROMPT_WORDS))
            (handle,) = await self.client.submit_many([SubmitSpec(
                prompt=prompt, max_tokens=OUTPUT_TOKENS, ignore_eos=True, best_effort=True)])
            self.ids.append(handle.id)
            self.results.append(asyncio.create_task(handle.result(timeout_s=300)))


async def _sizes(client: Any, keys: Any, state_dir: Path) -> tuple[int, int]:
    """(desired size, workers the supervisor runs)."""
    from blockq.local.state import ClusterState

    desired = await client.get(keys.autoscaler_desired)
    state = ClusterState.read(state_dir)
    return int(desired or 0), state.num_instances if state else 0


async def _drive(redis_url: str, state_dir: Path) -> tuple[LoadRun, list[FinalRecord], list[tuple[float, int, int]]]:
    """Low load for 12 s, then 4x until the fleet grew to 3 (or to 2 and 30 s passed),
    then low again until it shrank; returns the run, every request's answer and the
    (t s, desired, workers) samples."""
    keys = Settings().keys
    monitor = connect_async(redis_url)
    load = LoadRun(redis_url)
    submitter = asyncio.create_task(load.submit_until_stopped())
    started_s = time.monotonic()
    samples: list[tuple[float, int, int]] = []

    async def until(predicate: Any, timeout_s: float) -> None:
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            desired, workers = await _sizes(monitor, keys, state_dir)
            samples.append((round(time.monotonic() - started_s, 1), desired, workers))
            if predicate(desired, workers):
                return
            await asyncio.sleep(0.5)
        raise AssertionError(f"fleet did not get there within {timeout_s} s: {samples[-10:]}")

    try:
        await until(lambda d, w: time.monotonic() - started_s >= 12, 15)
        load.rate_per_s = 4 * LOW_RATE_PER_S
        high_s = time.monotonic()
        await until(lambda d, w: w >= min(d, 3) and (d >= 3 or d >= 2 and time.monotonic() - high_s > 30), 90)
        load.rate_per_s = LOW_RATE_PER_S
        await until(lambda d, w: max(d for _, d, _ in samples) > d and w <= d, 120)
    finally:
        load.stopped.set()
        await submitter
        await monitor.aclose()
        try:
            finals = list(await asyncio.gather(*load.results))
        finally:
            await load.client.close()
    return load, finals, samples


def _check_rules(decisions: list[dict[str, Any]]) -> None:
    actions = [d for d in decisions if d["direction"] is not None]
    for action in actions:
        step = abs(action["target"] - action["current"])
        assert 1 <= step <= max(1, math.floor(0.2 * action["current"])), action
        assert 1 <= action["target"] <= 4, action
    for before, after in zip(actions, actions[1:], strict=False):
        gap_s = after["at_s"] - before["at_s"]
        limit_s = TIMINGS["cooldown_s"] if after["direction"] == before["direction"] else TIMINGS["reversal_hold_s"]
        assert gap_s >= limit_s - 0.01, (before, after)  # at_s is rounded to ms


def _finals(sync: redis.Redis, request_id: str) -> list[FinalRecord]:
    keys = Settings().keys
    return [message for _, fields in sync.xrange(keys.reply(request_id))
            if isinstance(message := decode_reply_entry(fields[PAYLOAD_FIELD.encode()]), FinalRecord)]


def test_fleet_grows_under_load_and_shrinks_after_it(tmp_path: Path) -> None:
    """About 50 s here: short timings (2 s cycles, 6 s cooldown, 12 s reversal hold) and
    the predictive scaler at time scale 1 (its futures run on the wall clock)."""
    state_dir = tmp_path / "state"
    env = {"BLOCKQ_STATE_DIR": str(state_dir), "BLOCKQ_REDIS_URL": ""}
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in TIMINGS.items()]
    started_s = time.monotonic()
    try:
        up = run_blockq("up", "--detach", "--json", "--autoscale", "predictive", "--min-instances", "1",
                        "--max-instances", "4", "--metrics-base-port", "0", *flags, env=env, timeout_s=180)
        assert up.returncode == 0, up.stderr + up.stdout
        report = json.loads(up.stdout)
        assert report["num_live_instances"] == 1
        from blockq.local.state import ClusterState

        state = ClusterState.read(state_dir)
        assert state is not None
        load, finals, samples = asyncio.run(_drive(state.redis_url, state_dir))
        sync = redis.Redis.from_url(state.redis_url)
        try:
            decisions = [json.loads(fields[DECISION_FIELD.encode()])
                         for _, fields in sync.xrange(Settings().keys.autoscaler_decisions)]
            once = [len(_finals(sync, request_id)) for request_id in load.ids]
        finally:
            sync.close()
    finally:
        down = run_blockq("down", env=env)
        assert down.returncode == 0, down.stderr
    actions = [(round(d["at_s"] - decisions[0]["at_s"], 1), d["current"], d["target"])
               for d in decisions if d["direction"]]
    print(f"\nlive autoscale: {time.monotonic() - started_s:.0f} s, {len(finals)} requests, "
          f"(desired, workers) seen {sorted({(d, w) for _, d, w in samples})}, actions (t s, from, to) {actions}")
    _check_rules(decisions)
    directions = [d["direction"] for d in decisions if d["direction"]]
    assert directions[0] == "up" and "down" in directions and max(d["target"] for d in decisions) >= 2
    assert len(finals) == len(load.ids) > 40
    assert all(final.status == "ok" and final.output_tokens == OUTPUT_TOKENS for final in finals)
    assert once == [1] * len(load.ids)  # one final record per request: none lost, none twice
