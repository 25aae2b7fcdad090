"""The shortlist: which candidates ``block`` simulates on a fleet larger than its size."""

from __future__ import annotations

import random

import pytest

from blockq.wire.beats import RequestProgress
from dispatcher.cluster_view import ClusterView
from dispatcher.core import DispatcherCore, Placed
from dispatcher.policies import make_policy
from dispatcher.policies.predictive import lane_ids
from dispatcher.policies.shortlist import Shortlist
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
    ttft_s = {c.instance_id: forecast_ttft(view.replica(c, NOW_S), *view.replica(c, NOW_S).request_size(request))
              for c in candidates}
    decision = policy.choose(request, candidates, NOW_S)
    assert decision.instance_id in policy.shortlist.start_at_s
    learnt = set(policy.shortlist.start_at_s)
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
        shortlist.learn(f"i{k}", NOW_S + 10 + k, NOW_S - 1)
    shortlist.learn("i3", NOW_S + 1, NOW_S)  # the best known: ready 1 s from now
    # One best known (i3), one explored: i5 was never simulated.
    assert [c.instance_id for c in shortlist.select(candidates, frozenset(), NOW_S)] == ["i3", "i5"]
    shortlist.learn("i5", NOW_S + 20, NOW_S)
    # Explored next: the oldest belief (i0, learnt first among ties of age, by jitter: any of i0-i2, i4).
    explored = {c.instance_id for c in shortlist.select(candidates, frozenset(), NOW_S)} - {"i3"}
    assert len(explored) == 1 and explored <= {"i0", "i1", "i2", "i4"}
    # A start that has passed counts as now; of two ready now, the one learnt last is the best known.
    shortlist.learn("i1", NOW_S - 3, NOW_S - 0.5)
    shortlist.learn("i2", NOW_S - 4, NOW_S - 0.9)
    assert shortlist.select(candidates, frozenset(), NOW_S)[0].instance_id == "i1"
    # With lanes, as many again outside them.
    assert len(shortlist.select(candidates, frozenset({"i1"}), NOW_S)) in (3, 4)
    assert not Shortlist(6, random.Random(0)).cuts(6) and Shortlist(5, random.Random(0)).cuts(6)
    assert not Shortlist(0, random.Random(0)).cuts(1000)


def test_a_negative_shortlist_is_refused() -> None:
    with pytest.raises(ValueError, match="num_simulated_candidates"):
        DispatcherCore("block", num_simulated_candidates=-1)
