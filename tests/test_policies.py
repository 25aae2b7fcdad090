"""Each policy on constructed cluster states picks what its rule says."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import numpy as np
import pytest

from blockq.engine_model.packed_layout import FINISHED
from blockq.text.block_hashes import PREFIX_BLOCK_TOKENS
from blockq.wire.beats import RequestProgress
from blockq.wire.protocol import Prediction
from dispatcher.cluster_view import ClusterView
from dispatcher.policies import POLICIES, make_policy
from dispatcher.what_if import forecast
from tests.factories import make_heartbeat, make_request


def running(n: int, *, prompt: int = 100, generated: int = 50, predicted: int = 300, prefix: str = "r") -> tuple:
    return tuple(RequestProgress(f"{prefix}{i}", prompt, prompt + generated - 1, generated, predicted, predicted * 2)
                 for i in range(n))


def view_with(*beats) -> ClusterView:  # noqa: ANN002
    view = ClusterView()
    now = time.time()
    for beat in beats:
        view.apply_heartbeat(beat, now)
    return view


def choose(name: str, view: ClusterView, request=None, seed: int = 0) -> str:  # noqa: ANN001
    policy = make_policy(name, view, seed=seed)
    return policy.choose(request or make_request(predicted=200), view.live_instances(), time.time()).instance_id


def test_registry_lists_every_policy() -> None:
    assert set(POLICIES) == {"round_robin", "random", "least_requests", "least_kv", "llumnix", "prefix_affinity",
                                     "power_of_two", "block", "block_kv_guard", "oracle",
                             "topology", "weighted_least_requests"}
    with pytest.raises(ValueError, match="policy: unknown 'nope'"):
        make_policy("nope")


def test_round_robin_cycles_in_id_order() -> None:
    view = view_with(make_heartbeat("b"), make_heartbeat("a"), make_heartbeat("c"))
    policy = make_policy("round_robin", view)
    picks = [policy.choose(make_request(), view.live_instances(), 0).instance_id for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_least_requests_counts_assigned_not_seen() -> None:
    view = view_with(make_heartbeat("a", running=running(3)), make_heartbeat("b", running=running(1)))
    assert choose("least_requests", view) == "b"
    for _ in range(3):
        view.record_assignment("b", make_request())
    assert choose("least_requests", view) == "a"  # b: 1 running + 3 assigned, a: 3


def test_llumnix_prefers_more_free_blocks_per_running_request() -> None:
    # a: 1000 free blocks over 10 running = 100; b: 300 free over 2 running = 150.
    view = view_with(make_heartbeat("a", running=running(10), num_used_blocks=52),
                     make_heartbeat("b", running=running(2), num_used_blocks=752))
    assert choose("llumnix", view) == "b"
    # Waiting prompts reserve blocks: 40 waiting 100-token prompts (7 blocks each) sink b.
    waiting = tuple(RequestProgress(f"w{i}", 100, 0, 0, 300, 600) for i in range(40))
    view = view_with(make_heartbeat("a", running=running(10), num_used_blocks=52),
                     make_heartbeat("b", running=running(2), waiting=waiting, num_used_blocks=752))
    assert choose("llumnix", view) == "a"


def test_least_kv_prefers_free_blocks_per_running_request() -> None:
    view = view_with(make_heartbeat("a", running=running(4), num_used_blocks=900),
                     make_heartbeat("b", running=running(8), num_used_blocks=100))
    assert choose("least_kv", view) == "b"   # 952/8 = 119 > 152/4 = 38


def test_block_avoids_instance_whose_kv_the_request_would_exhaust() -> None:
    # "tight": 4 running requests that will each grow to 3,900 tokens (244 blocks): today
    # 524 blocks are free (131 per request), so a snapshot rule like llumnix prefers it over
    # "roomy" (12 short requests, 82 free blocks per request). But 4 x 244 blocks plus the
    # new request's 100 exceed the 1,052 the instance has: it would preempt.
    tight = make_heartbeat("tight", running=running(4, prompt=2000, generated=100, predicted=1900, prefix="t"),
                           num_used_blocks=4 * 132, num_gpu_blocks=1052)
    roomy = make_heartbeat("roomy", running=running(12, prompt=50, generated=20, predicted=60, prefix="r"),
                           num_used_blocks=12 * 5)
    view = view_with(tight, roomy)
    request = make_request("x " * 100, max_tokens=2000, predicted=1500)
    assert choose("llumnix", view, request) == "tight"
    assert choose("block", view, request) == "roomy"


def test_kv_guard_passes_over_an_instance_whose_kv_the_upper_quantile_would_exhaust() -> None:
    # "edge": 4 long requests that will reach 4,000 tokens (1,000 of its 1,052 blocks). The
    # new request's median (50 tokens) fits there, and edge has the best median score; at
    # its p90 (1,500 tokens) the request would run beside them to the end and preempt.
    edge = make_heartbeat("edge", running=running(4, prompt=2100, generated=300, predicted=1900, prefix="e"),
                          num_used_blocks=4 * 150)
    busy = make_heartbeat("busy", running=running(24, prompt=50, generated=20, predicted=200, prefix="b"),
                          num_used_blocks=24 * 5)
    view = view_with(edge, busy)
    request = make_request("x " * 100, max_tokens=3000).with_prediction(Prediction(100, 50, 20, 1500, "test"))
    policy = make_policy("block_kv_guard", view, seed=0, objective="e2e")  # the scenario is built on e2e scores
    now = time.time()
    median = {c.instance_id: policy.forecast(request, c, now) for c in view.live_instances()}
    assert median["edge"].score("e2e") < median["busy"].score("e2e")
    assert median["edge"].num_preemptions == 0
    edge_replica = view.replica(view.instances["edge"], now)
    upper = forecast(edge_replica, request.id, *edge_replica.request_size(request, lengths="upper"), keep=False)
    assert upper.num_preemptions > 0
    assert policy.choose(request, view.live_instances(), now).instance_id == "busy"
    assert make_policy("block", view, seed=0, objective="e2e").choose(
        request, view.live_instances(), now).instance_id == "edge"


def test_block_records_predicted_latencies() -> None:
    view = view_with(make_heartbeat("a"), make_heartbeat("b", running=running(20)))
    policy = make_policy("block", view, seed=0)
    decision = policy.choose(make_request(predicted=100), view.live_instances(), time.time())
    assert decision.instance_id == "a"
    assert decision.predicted_ttft_ms is not None and 0 < decision.predicted_ttft_ms < decision.predicted_e2e_ms
    # 100 tokens at ~20 ms per decode step on an idle A30: about two seconds.
    assert 1500 < decision.predicted_e2e_ms < 3000


def test_oracle_refuses_requests_without_truth() -> None:
    view = view_with(make_heartbeat("a"))
    with pytest.raises(ValueError, match="true_output_tokens"):
        choose("oracle", view, make_request(predicted=10))
    assert choose("oracle", view, make_request(predicted=10, true_output_tokens=12)) == "a"


@pytest.mark.parametrize("name", ["block", "least_requests", "llumnix", "power_of_two"])
def test_burst_within_one_heartbeat_is_spread(name: str) -> None:
    """50 requests placed before any new beat arrives must not pile onto one idle instance."""
    view = view_with(*(make_heartbeat(f"i{k}") for k in range(4)))
    policy = make_policy(name, view, seed=3)
    now = time.time()
    counts: Counter[str] = Counter()
    for _ in range(50):
        request = make_request(predicted=250)
        chosen = policy.choose(request, view.live_instances(), now).instance_id
        view.record_assignment(chosen, request)
        counts[chosen] += 1
    assert len(counts) == 4
    assert max(counts.values()) <= 18, counts


def test_forecasts_match_a_plain_simulation_as_time_moves() -> None:
    """The block policy's forecast (from cached snapshots) equals a from-scratch what-if
    simulation on a clone of the replica, decision after decision."""
    import random

    from blockq.wire.keys import Keys
    from loadgen.benches.dispatch import heartbeat_of, loaded_scheduler
    from loadgen.benches.dispatch import make_request as bench_request

    rng = random.Random(7)
    view = ClusterView()
    for k in range(3):
        beat = heartbeat_of(f"i{k}", loaded_scheduler(rng, "llama2-7b-a30", rng.randrange(0, 40), rng.randrange(0, 6)),
                            1, 0.0, "llama2-7b-a30")
        view.apply_heartbeat(beat, 0.0)
    policy = make_policy("block", view, seed=0)
    for index in range(60):
        now_s = index * 0.05
        request = bench_request(rng, Keys())
        for candidate in view.live_instances():
            fast = policy.forecast(request, candidate, now_s)
            replica = view.replica(candidate, now_s)
            plain = replica.scheduler.clone()
            started_s = replica.now_s  # the request arrives now, maybe within a step under way
            assert started_s <= plain.now_s
            row = plain.add_request(request.id, *replica.request_size(request))
            plain.simulate()
            finished_s = plain.finished_at_s(row)
            assert finished_s is not None
            assert fast.e2e_s == pytest.approx(finished_s - started_s, rel=1e-9, abs=1e-9)
            assert 0 <= fast.ttft_s <= fast.e2e_s
        decision = policy.choose(request, view.live_instances(), now_s)
        view.record_assignment(decision.instance_id, request)
        # The chosen candidate's what-if run became that replica's baseline: it must be
        # the future a fresh simulation of the new state gives.
        chosen = view.replica(view.instances[decision.instance_id], now_s)
        reused = chosen.baseline()
        fresh = chosen.scheduler.queue_drain_snapshot()
        fresh.simulate()
        num_rows = chosen.scheduler.num_rows
        assert np.array_equal(reused.finished_at_s[:num_rows], fresh.times[:num_rows, FINISHED], equal_nan=True)


def test_a_beat_sent_during_a_step_is_replayed_from_that_steps_end() -> None:
    """The emulated engine applies a step when it starts, so a beat sent during a step
    reports the state that step leaves: it is dated at the step's end (its start plus the
    published latency model's duration), and a request placed then is forecast to wait
    out the rest of the step before its own prefill."""
    from blockq.engine_model import get_preset
    from dispatcher.what_if import forecast_ttft
    from workers.engines.base import EngineRequestSpec
    from workers.engines.emulated import EmulatedEngine, EmulatedEngineOptions
    from workers.heartbeat import HeartbeatBuilder

    wall = [50.0]
    engine = EmulatedEngine(EmulatedEngineOptions(noise_sigma=0.0, stream_tokens=False), clock=lambda: wall[0])
    engine.add_request(EngineRequestSpec("long", "x", 2000, 64, true_output_tokens=64))
    step = engine.start_step()
    assert step is not None and step.num_prefill_tokens == 512
    step_end_s = step.started_at_s + step.duration_s
    wall[0] += 0.25 * step.duration_s  # a quarter into the step
    beat = HeartbeatBuilder("i0", engine, clock=lambda: wall[0]).build("live", ())
    assert beat.engine_time_s == pytest.approx(0.25 * step.duration_s)
    assert beat.state_at_s == pytest.approx(step_end_s)
    assert beat.running[0].num_computed_tokens == 512  # what the step under way leaves

    preset = get_preset("llama2-7b-a30")
    short_s = preset.latency_model.step_seconds(10, 0, 0)  # an idle engine's whole TTFT for it
    view = ClusterView(keep_replicas=True)
    view.apply_heartbeat(beat, wall[0])
    replica = view.replica(view.instances["i0"], wall[0])
    assert replica.now_s == pytest.approx(beat.engine_time_s)
    # Behind the step under way (0.75 of it left) and the long prompt's next chunks.
    assert forecast_ttft(replica, 10, 20)[0] > 0.75 * step.duration_s + short_s
    # The same beat read as if its state held at its sending time misses that wait.
    older = ClusterView(keep_replicas=True)
    older.apply_heartbeat(dataclasses.replace(beat, state_at_s=None), wall[0])
    older_replica = older.replica(older.instances["i0"], wall[0])
    assert forecast_ttft(replica, 10, 20)[0] - forecast_ttft(older_replica, 10, 20)[0] == pytest.approx(
        0.75 * step.duration_s, rel=0.05)


def test_a_step_starting_before_a_placed_request_reaches_the_engine_runs_without_it() -> None:
    """A request placed now reaches the engine ``delivery_s`` later: a step of the
    replica starting within that time is taken without it."""
    from blockq.engine_model import get_preset
    from dispatcher.replica import InstanceReplica
    from dispatcher.what_if import forecast_ttft

    preset = get_preset("llama2-7b-a30")
    decoding = RequestProgress("busy", 40, 44, 5, 500, 900)  # decoding from its 6th token on
    beat = make_heartbeat("i0", running=(decoding,), sent_at_s=0.0, engine_time_s=0.0)
    step_s = preset.latency_model.step_seconds(0, 1, 45)  # its next step, from the beat on
    ttft_s = {}
    for delivery_s in (0.0, 0.003):
        replica = InstanceReplica(preset.config, preset.latency_model, delivery_s=delivery_s)
        replica.sync(beat, (), 0.0)
        replica.advance(step_s - 0.001)  # 1 ms before that step ends
        ttft_s[delivery_s] = forecast_ttft(replica, 10, 20)[0]
    # Taken by the step after it, or (3 ms to arrive) by the one after that.
    assert ttft_s[0.0] == pytest.approx(0.001 + preset.latency_model.step_seconds(10, 1, 56), rel=0.02)
    assert ttft_s[0.003] == pytest.approx(ttft_s[0.0] + preset.latency_model.step_seconds(0, 1, 46), rel=0.02)


def test_a_replica_waits_as_long_for_delivery_as_its_instance_measures() -> None:
    """Where an instance's beats measure a longer way from decision to engine than
    ``DELIVERY_S`` (a loaded host), its replica takes steps starting within that time to
    run without a request placed now, up to ``MAX_DELIVERY_S``; a shorter measurement
    keeps ``DELIVERY_S``."""
    from blockq.engine_model import get_preset
    from dispatcher.replica import DELIVERY_S, MAX_DELIVERY_S, InstanceReplica
    from dispatcher.what_if import forecast_ttft

    preset = get_preset("llama2-7b-a30")
    decoding = RequestProgress("busy", 40, 44, 5, 500, 900)
    step_s = preset.latency_model.step_seconds(0, 1, 45)
    ttft_s = {}
    for measured_ms in (None, 1.0, 1000 * step_s + 2.0, 5000.0):
        beat = make_heartbeat("i0", running=(decoding,), sent_at_s=0.0, engine_time_s=0.0)
        replica = InstanceReplica(preset.config, preset.latency_model)
        replica.sync(dataclasses.replace(beat, delivery_p90_ms=measured_ms), (), 0.0)
        ttft_s[measured_ms] = forecast_ttft(replica, 10, 20)[0]
        assert replica.delivery_s == max(DELIVERY_S, min(MAX_DELIVERY_S, (measured_ms or 0.0) / 1000))
    # 5 s is a skewed clock, not a queue: the replica waits MAX_DELIVERY_S at most.
    assert ttft_s[5000.0] < MAX_DELIVERY_S + 2 * step_s
    assert ttft_s[None] == ttft_s[1.0] == pytest.approx(step_s + preset.latency_model.step_seconds(10, 1, 46),
                                                        rel=0.02)
    # Reaching the engine 2 ms after the next step starts: it waits for that step too.
    assert ttft_s[1000 * step_s + 2.0] == pytest.approx(ttft_s[None] + preset.latency_model.step_seconds(0, 1, 46),
                                                        rel=0.02)


def test_block_keeps_a_lane_light_for_long_prompts() -> None:
    """Of 12 instances the first 2 by id are long-prompt lanes: an ordinary request goes
    elsewhere even where a lane is the idlest; a long prompt and a brief answer take the
    best instance, lane or not; an ordinary request takes a lane when every other
    instance is predicted far slower (here: past its TTFT objective)."""
    ids = [f"i{k:02d}" for k in range(12)]
    busy = {i: running(12, prefix=f"{i}-") for i in ids[2:]}
    view = view_with(*(make_heartbeat(i, running=busy.get(i, ())) for i in ids))
    policy = make_policy("block", view, seed=0, slo_ttft_ms=3000)
    now = time.time()
    instances = view.live_instances()
    ordinary = [policy.choose(make_request("x " * 200, max_tokens=500, predicted=300), instances, now).instance_id
                for _ in range(5)]
    assert not set(ordinary) & {"i00", "i01"}
    long_prompt = make_request("x " * 3000, max_tokens=500, predicted=300)
    assert policy.choose(long_prompt, instances, now).instance_id in {"i00", "i01"}
    brief = make_request("x " * 200, max_tokens=500, predicted=10)
    assert policy.choose(brief, instances, now).instance_id in {"i00", "i01"}
    # Every other instance now holds a queue it cannot start within 3 s.
    waiting = tuple(RequestProgress(f"w{k}", 3000, 0, 0, 300, 600) for k in range(12))
    view = view_with(*(make_heartbeat(i, running=busy.get(i, ()), waiting=waiting if i in busy else ())
                       for i in ids))
    policy = make_policy("block", view, seed=0, slo_ttft_ms=3000)
    chosen = policy.choose(make_request("x " * 200, max_tokens=500, predicted=300), view.live_instances(), now)
    assert chosen.instance_id in {"i00", "i01"}


def test_block_keeps_no_lanes_where_instances_cache_prefixes() -> None:
    ids = [f"i{k:02d}" for k in range(12)]
    config = {**make_heartbeat("x").engine_config, "enable_prefix_caching": True, "block_size": PREFIX_BLOCK_TOKENS}
    view = view_with(*(dataclasses.replace(make_heartbeat(i, running=() if i < "i02" else running(12, prefix=f"{i}-")),
                                           engine_config=config) for i in ids))
    policy = make_policy("block", view, seed=0, slo_ttft_ms=3000)
    chosen = policy.choose(make_request("x " * 200, max_tokens=500, predicted=300), view.live_instances(), time.time())
    assert chosen.instance_id in {"i00", "i01"}   # the idle ones, lanes elsewhere
