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
    # 40 loaded instances and one idle: a shortlist of 4 first tries instances never
    # simulated, learns how long each one's wait is, and reaches the idle one within
    # about 41 / 8 decisions (4 of all, 4 outside the lanes); from then on it chooses
    # what simulating every instance chooses.
    beats = fleet(41, idle="i17")
    full = decisions(beats, 0, num_requests=20)
    short = decisions(beats, 4, num_requests=20)
    assert {instance for instance, _ in full} == {"i17"}
    first = next(i for i, (instance, _) in enumerate(short) if instance == "i17")
    assert first <= 6
    assert short[first + 1:] == full[first + 1:]


def test_a_shortlisted_decision_is_the_best_of_those_it_simulated() -> None:
    view = ClusterView(keep_replicas=True)
    for beat in fleet(30, seed=2):
        view.apply_heartbeat(beat, NOW_S)
    policy = make_policy("block", view, seed=1, num_simulated_candidates=5)
    candidates = view.live_instances()
    request = make_request("x " * 50, max_tokens=800, predicted=100, submitted_at_s=NOW_S)
    simulated = policy.shortlist.select(candidates, lane_ids([c.instance_id for c in candidates]))
    assert 5 <= len(simulated) <= 10  # the best 5, and the best 5 outside the lanes
    ttft_s = {c.instance_id: forecast_ttft(view.replica(c, NOW_S), *view.replica(c, NOW_S).request_size(request))
              for c in candidates}
    decision = policy.choose(request, candidates, NOW_S)
    assert decision.instance_id in policy.shortlist.start_at_s
    learnt = set(policy.shortlist.start_at_s)
    assert 5 <= len(learnt) <= 10
    best_learnt = min(ttft_s[i] for i in learnt)
    assert decision.predicted_ttft_ms / 1000 <= best_learnt + 0.05  # lane slack at most


def test_select_ranks_untried_then_the_earliest_start_times() -> None:
    view = ClusterView()
    for k in range(6):
        view.apply_heartbeat(make_heartbeat(f"i{k}", sent_at_s=NOW_S), NOW_S)
    candidates = view.live_instances()
    shortlist = Shortlist(2, random.Random(0))
    for k in range(5):
        shortlist.learn(f"i{k}", NOW_S + 10 + k)
    shortlist.learn("i4", NOW_S - 5)  # ready since long ago: checked again first
    # Half known best (i4), half untried first (i5); with lanes, as many outside them.
    assert [c.instance_id for c in shortlist.select(candidates, frozenset())] == ["i5", "i4"]
    assert [c.instance_id for c in shortlist.select(candidates, frozenset({"i5"}))] == ["i5", "i4", "i0"]
    assert [c.instance_id for c in shortlist.select(candidates, frozenset({"i5", "i4"}))] == \
        ["i5", "i4", "i0", "i1"]
    assert not Shortlist(6, random.Random(0)).cuts(6) and Shortlist(5, random.Random(0)).cuts(6)
    assert not Shortlist(0, random.Random(0)).cuts(1000)


def test_a_negative_shortlist_is_refused() -> None:
    with pytest.raises(ValueError, match="num_simulated_candidates"):
        DispatcherCore("block", num_simulated_candidates=-1)
