"""The shortlist: which candidates ``block`` simulates on a fleet larger than its size."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from blockq.wire.beats import RequestProgress
from dispatcher.cluster_view import AS_IS_S, ClusterView
from dispatcher.core import DispatcherCore, Placed
from dispatcher.policies import make_policy, predictive
from dispatcher.policies.predictive import lane_ids
from dispatcher.policies.shortlist import (
    AGE_WEIGHT,
    LANE_CANDIDATES,
    LARGE_FLEET_ABOVE_INSTANCES,
    LARGE_FLEET_CANDIDATES,
    SMALL_FLEET_CANDIDATES,
    Shortlist,
)
from dispatcher.policies.shortlist_kernel import shortlist_positions
from dispatcher.what_if import forecast_ttft
from tests.factories import make_heartbeat, make_request

NOW_S = 1000.0


def loaded_beat(instance_id: str, rng: random.Random, *, num_waiting: int) -> object:
    """An instance with a full batch and ``num_waiting`` prompts queued."""
    running = tuple(RequestProgress(f"{instance_id}-r{i}", 200, 200 + g - 1, g, 300, 600)
                    for i, g in enumerate(rng.randrange(1, 250) for _ in range(48)))
    waiting = tuple(RequestProgress(f"{instance_id}-w{i}", rng.randrange(50, 600), 0, 0, 300, 600)
                    for i in range(num_waiting))
    return make_heartbeat(instance_id, running=running, waiting=waiting, num_used_blocks=800,
                          sent_at_s=NOW_S, engine_time_s=NOW_S)


def fleet(num_instances: int, seed: int = 0, *, idle: str | None = None) -> list:
    rng = random.Random(seed)
    return [make_heartbeat(f"i{k:02d}", sent_at_s=NOW_S, engine_time_s=NOW_S) if f"i{k:02d}" == idle
            else loaded_beat(f"i{k:02d}", rng, num_waiting=rng.randrange(0, 12)) for k in range(num_instances)]


def decisions(beats: list, simulated_candidates: int, num_requests: int = 12) -> list[tuple[str, float]]:
    core = DispatcherCore("block", seed=7, num_simulated_candidates=simulated_candidates)
    for beat in beats:
        core.apply_heartbeat(beat, NOW_S)
    rng = random.Random(3)
    made = []
    for index in range(num_requests):
        request = make_request("x " * rng.randrange(10, 400), max_tokens=800, predicted=rng.randrange(20, 500),
                               submitted_at_s=NOW_S)
        (outcome,) = core.place([request], NOW_S + index * 0.01)
        assert isinstance(outcome, Placed)
        made.append((outcome.request.assignment.instance_id, outcome.request.assignment.predicted_ttft_ms))
    return made


def test_a_fleet_no_larger_than_the_shortlist_decides_as_without_one() -> None:
    beats = fleet(10)
    assert decisions(beats, 10) == decisions(beats, 0)
    assert decisions(beats, 64) == decisions(beats, 0)


def test_the_shortlist_finds_the_idle_instance_as_full_simulation_does() -> None:
    # 40 loaded instances and one idle: a shortlist of 4 explores one untried instance a
    # decision, so it reaches the idle one within 41 decisions; from then on it is the
    # best known, and the shortlist chooses what simulating every instance chooses.
    beats = fleet(41, idle="i17")
    full = decisions(beats, 0, num_requests=50)
    short = decisions(beats, 4, num_requests=50)
    assert {instance for instance, _ in full} == {"i17"}
    first = next(i for i, (instance, _) in enumerate(short) if instance == "i17")
    assert first <= 41
    assert {instance for instance, _ in short[first:]} == {"i17"}


def test_a_shortlisted_decision_is_the_best_of_those_it_simulated() -> None:
    view = ClusterView(keep_replicas=True)
    for beat in fleet(30, seed=2):
        view.apply_heartbeat(beat, NOW_S)
    policy = make_policy("block", view, seed=1, num_simulated_candidates=5)
    candidates = view.live_instances()
    request = make_request("x " * 50, max_tokens=800, predicted=100, submitted_at_s=NOW_S)
    simulated = policy.shortlist.select(candidates, lane_ids([c.instance_id for c in candidates]), NOW_S)
    assert 5 <= len(simulated) <= 10  # the best 5, and the best 5 outside the lanes
    ttft_s = {c.instance_id: forecast_ttft(view.replica(c, NOW_S), *view.replica(c, NOW_S).request_size(request))[0]
              for c in candidates}
    decision = policy.choose(request, candidates, NOW_S)
    assert decision.instance_id in policy.shortlist.beliefs()
    learnt = set(policy.shortlist.beliefs())
    assert 5 <= len(learnt) <= 10
    best_learnt = min(ttft_s[i] for i in learnt)
    assert decision.predicted_ttft_ms / 1000 <= best_learnt + 0.05  # lane slack at most


def test_select_takes_the_best_known_and_explores_the_untried_then_the_oldest() -> None:
    view = ClusterView()
    for k in range(6):
        view.apply_heartbeat(make_heartbeat(f"i{k}", sent_at_s=NOW_S), NOW_S)
    candidates = view.live_instances()
    shortlist = Shortlist(2, random.Random(0))
    for k in range(5):
        shortlist.learn({f"i{k}": NOW_S + 10 + k}, NOW_S - 1)
    shortlist.learn({"i3": NOW_S + 1}, NOW_S)  # the best known: ready 1 s from now
    # One best known (i3), one explored: i5 was never simulated.
    assert [c.instance_id for c in shortlist.select(candidates, frozenset(), NOW_S)] == ["i3", "i5"]
    shortlist.learn({"i5": NOW_S + 20}, NOW_S)
    # Explored next: the oldest belief (i0, learnt first among ties of age, by jitter: any of i0-i2, i4).
    explored = {c.instance_id for c in shortlist.select(candidates, frozenset(), NOW_S)} - {"i3"}
    assert len(explored) == 1 and explored <= {"i0", "i1", "i2", "i4"}
    # A start that has passed counts as now; of two ready now, the one learnt last is the best known.
    shortlist.learn({"i1": NOW_S - 3}, NOW_S - 0.5)
    shortlist.learn({"i2": NOW_S - 4}, NOW_S - 0.9)
    assert shortlist.select(candidates, frozenset(), NOW_S)[0].instance_id == "i1"
    # A request kept off the lanes (i1 is one): the best known outside them (i2), the best
    # lanes (i1), one explored.
    chosen = [c.instance_id for c in shortlist.select(candidates, frozenset({"i1"}), NOW_S, off_lanes=True)]
    assert chosen[:2] == ["i1", "i2"] and len(chosen) == 3  # best known first
    # Any other request: the lanes count as any instance.
    assert [c.instance_id for c in shortlist.select(candidates, frozenset({"i1"}), NOW_S)][0] == "i1"
    assert not Shortlist(6, random.Random(0)).cuts(6) and Shortlist(5, random.Random(0)).cuts(6)
    assert not Shortlist(0, random.Random(0)).cuts(1000)


def test_unless_told_a_large_fleet_simulates_fewer_candidates() -> None:
    # None: by the fleet's size. Up to the limit, every one of 16 instances is simulated
    # (exactly as without a shortlist) and 17 are cut to 16; above it, 8.
    view = ClusterView()
    for k in range(LARGE_FLEET_ABOVE_INSTANCES + 1):
        view.apply_heartbeat(make_heartbeat(f"i{k:03d}", sent_at_s=NOW_S), NOW_S)
    candidates = view.live_instances()
    shortlist = Shortlist(None, random.Random(0))
    assert not shortlist.cuts(SMALL_FLEET_CANDIDATES) and shortlist.cuts(SMALL_FLEET_CANDIDATES + 1)
    assert shortlist.size_for(LARGE_FLEET_ABOVE_INSTANCES) == SMALL_FLEET_CANDIDATES
    assert len(shortlist.select(candidates[:LARGE_FLEET_ABOVE_INSTANCES], frozenset(), NOW_S)) == SMALL_FLEET_CANDIDATES
    assert len(shortlist.select(candidates, frozenset(), NOW_S)) == LARGE_FLEET_CANDIDATES
    assert Shortlist(16, random.Random(0)).size_for(len(candidates)) == 16  # a size given holds at any size


def test_a_negative_shortlist_is_refused() -> None:
    with pytest.raises(ValueError, match="num_simulated_candidates"):
        DispatcherCore("block", num_simulated_candidates=-1)


def test_a_replica_ranked_as_it_is_is_advanced_until_it_is_too_old_then_rebuilt() -> None:
    view = ClusterView(keep_replicas=True)
    (beat,) = fleet(1)
    view.apply_heartbeat(beat, NOW_S)
    (candidate,) = view.live_instances()
    view.replica(candidate, NOW_S, keep_current=False)  # not kept current by the beats
    assert view.num_replica_rebuilds == 1 and view.is_current(candidate)
    newer = loaded_beat(candidate.instance_id, random.Random(5), num_waiting=3)
    view.apply_heartbeat(replace(newer, seq=2, sent_at_s=NOW_S + 0.1), NOW_S + 0.1)
    assert not view.is_current(candidate)
    # A look to rank by: advanced along its own trajectory, not rebuilt from the newer beat.
    replica = view.replica(candidate, NOW_S + 0.5, keep_current=False, as_is=True)
    assert view.num_replica_rebuilds == 1 and not view.is_current(candidate)
    assert replica.now_s == pytest.approx(NOW_S + 0.5)
    # Built too long ago to rank by as it is (or asked for without as_is): rebuilt.
    view.replica(candidate, NOW_S + 0.5 + AS_IS_S, keep_current=False, as_is=True)
    assert view.num_replica_rebuilds == 2 and view.is_current(candidate)


@pytest.mark.parametrize("rank_as_is_above", [16, 1000])
def test_a_decision_places_by_a_replica_rebuilt_from_the_latest_beat(monkeypatch: pytest.MonkeyPatch,
                                                                     rank_as_is_above: int) -> None:
    # 41 instances, a shortlist of 4: after every instance beats again, each replica is
    # older than its beat. Ranked on them as they are (a fleet larger than the limit), the
    # instance taken is simulated again on its rebuilt replica, and its forecast is the one
    # placed with; on a smaller fleet the replicas simulated were rebuilt first, and those
    # used lately are kept current beat by beat.
    monkeypatch.setattr(predictive, "LARGE_FLEET_ABOVE_INSTANCES", rank_as_is_above)
    beats = fleet(41, seed=4)
    core = DispatcherCore("block", seed=7, num_simulated_candidates=4)
    for beat in beats:
        core.apply_heartbeat(beat, NOW_S)
    rng = random.Random(3)
    for index in range(60):
        now_s = NOW_S + index * 0.01
        if index % 10 == 0:
            for beat in beats:
                core.apply_heartbeat(replace(beat, seq=beat.seq + index + 1, sent_at_s=now_s), now_s)
        request = make_request("x " * rng.randrange(10, 400), max_tokens=800, predicted=rng.randrange(20, 500),
                               submitted_at_s=NOW_S)
        (outcome,) = core.place([request], now_s)
        assert isinstance(outcome, Placed)
        chosen = core.view.instances[outcome.request.assignment.instance_id]
        assert core.view.is_current(chosen)
    simulated = [view for view in core.view.instances.values() if view.replica is not None]
    num_current = sum(core.view.is_current(view) for view in simulated)
    if rank_as_is_above == 1000:  # kept current: the hot replicas were rebuilt on the last beats
        assert num_current == len(simulated)
    else:
        assert num_current < len(simulated)


def _numpy_cut(starts: np.ndarray, learnt: np.ndarray, outside_lanes: np.ndarray, jitter: np.ndarray,
               now_s: float, num_best: int, num_explored: int, num_lanes: int) -> list[int]:
    """The shortlist's cut written with numpy calls."""

    def smallest(keys: np.ndarray, eligible: np.ndarray, count: int) -> set[int]:
        order = np.lexsort((jitter, keys))  # by key, equal keys by jitter
        return set(order[eligible[order]][:count].tolist())

    best = np.maximum(starts, now_s) + (now_s - learnt) * AGE_WEIGHT + jitter
    best[np.isnan(best)] = np.inf
    if num_lanes >= 0:  # kept off the lanes: the best outside them, the few best lanes
        chosen = smallest(best, outside_lanes, num_best) | smallest(best, ~outside_lanes, num_lanes)
    else:
        chosen = smallest(best, np.ones(len(starts), bool), num_best)
    chosen |= smallest(learnt + jitter, np.array([p not in chosen for p in range(len(starts))]), num_explored)
    return sorted(chosen, key=lambda p: (best[p], jitter[p]))


@pytest.mark.parametrize("num_candidates", [3, 20, 1024])
def test_the_compiled_cut_takes_what_the_numpy_one_took(num_candidates: int) -> None:
    rng = np.random.default_rng(num_candidates)
    for trial in range(200):
        starts = rng.uniform(0, 2, num_candidates)
        starts[rng.random(num_candidates) < 0.1 * (trial % 3)] = np.nan  # never simulated ...
        learnt = np.where(np.isnan(starts), -1e9, rng.uniform(0, 1, num_candidates))  # ... learnt at NEVER_S
        outside_lanes = rng.random(num_candidates) > 1 / 6
        jitter = rng.random(num_candidates) * 1e-6
        num_best, num_explored = int(rng.integers(1, 16)), int(rng.integers(1, 3))
        args = (starts, learnt, outside_lanes, jitter, 1.0, num_best, num_explored, trial % 3 - 1)
        got = shortlist_positions(starts, learnt, outside_lanes, jitter, 1.0, AGE_WEIGHT, *args[5:])
        assert got.tolist() == _numpy_cut(*args)


@pytest.mark.parametrize(("prompt_words", "lanes_simulated"), [(50, LANE_CANDIDATES), (3000, 4)])
def test_a_request_kept_off_the_lanes_simulates_only_the_best_lanes(prompt_words: int, lanes_simulated: int) -> None:
    # 30 instances, 5 lanes believed best: an ordinary request simulates the best known
    # others and only the two best lanes; a long prompt (the lanes' purpose) the best of all.
    view = ClusterView(keep_replicas=True)
    for beat in fleet(30, seed=4):
        view.apply_heartbeat(beat, NOW_S)
    policy = make_policy("block", view, seed=1, num_simulated_candidates=5)
    candidates = view.live_instances()
    lanes = lane_ids([c.instance_id for c in candidates])
    policy.shortlist.learn(dict.fromkeys(lanes, NOW_S), NOW_S)
    # The others were learnt earlier: the one explored is one of them.
    policy.shortlist.learn({c.instance_id: NOW_S + 5 for c in candidates if c.instance_id not in lanes}, NOW_S - 1)
    request = make_request("x " * prompt_words, max_tokens=800, predicted=100, submitted_at_s=NOW_S)
    before = policy.shortlist.beliefs()
    policy.choose(request, candidates, NOW_S + 0.01)
    simulated = {i for i, belief in policy.shortlist.beliefs().items() if belief != before.get(i)}
    assert len(simulated & lanes) == lanes_simulated
    # 4 best known (of all, or of the others and the best lanes besides) and 1 explored
    assert len(simulated) == (5 if lanes_simulated == 4 else 4 + LANE_CANDIDATES + 1)


def test_a_forecast_short_of_the_whole_run_leaves_out_only_what_needs_it() -> None:
    from dispatcher.what_if import forecast

    view = ClusterView(keep_replicas=True)
    view.apply_heartbeat(loaded_beat("i0", random.Random(5), num_waiting=6), NOW_S)
    full = forecast(view.replica(view.instances["i0"], NOW_S), "a", 300, 200, keep=False)
    view = ClusterView(keep_replicas=True)  # a replica just rebuilt: no baseline future yet
    view.apply_heartbeat(loaded_beat("i0", random.Random(5), num_waiting=6), NOW_S)
    replica = view.replica(view.instances["i0"], NOW_S)
    brief = forecast(replica, "a", 300, 200, keep=False, whole_run=False)
    assert full.added_delay_s > 0 and np.isnan(brief.added_delay_s) and np.isnan(brief.max_latency_s)
    assert full.max_latency_s > full.e2e_s  # others finish after it: the brief run stopped before them
    assert (brief.ttft_s, brief.e2e_s) == (full.ttft_s, full.e2e_s)
    assert replica.baseline()._finished_at_s is None  # the baseline's future was not run


def test_a_request_placed_by_a_brief_run_leaves_a_baseline_whose_future_is_whole() -> None:
    """Placed by a run that stopped at its own finish, the request's run is still the next
    baseline (its queue-drain snapshot), and that baseline's finish times are the whole
    run's, simulated when first asked for."""
    from dispatcher.what_if import forecast

    placed = []
    for whole_run in (True, False):
        view = ClusterView(keep_replicas=True)
        view.apply_heartbeat(loaded_beat("i0", random.Random(5), num_waiting=6), NOW_S)
        replica = view.replica(view.instances["i0"], NOW_S)
        request = make_request("x " * 50, max_tokens=800, predicted=100, submitted_at_s=NOW_S)
        forecast(replica, request.id, *replica.request_size(request), whole_run=whole_run)
        replica.add_assignment(request)
        placed.append(replica.baseline())
    whole, brief = placed
    assert brief._finished_at_s is None
    np.testing.assert_array_equal(brief.finished_at_s, whole.finished_at_s)
    np.testing.assert_array_equal(brief.snapshot.times, whole.snapshot.times)
