"""The cluster view's replicas: a beat costs little, and a replica is rebuilt from the
latest beat only when a decision needs it."""

from __future__ import annotations

from blockq.wire.beats import RequestProgress
from dispatcher.cluster_view import ClusterView
from dispatcher.core import DispatcherCore, Placed
from tests.factories import make_heartbeat, make_request

NOW_S = 500.0


def beat(instance_id: str, seq: int, *, generated: int = 10, finished: tuple[str, ...] = ()) -> object:
    running = tuple(RequestProgress(f"r{i}", 100, 100 + generated - 1, generated, 300, 600) for i in range(8))
    return make_heartbeat(instance_id, seq=seq, running=running, sent_at_s=NOW_S + seq * 0.1,
                          engine_time_s=NOW_S + seq * 0.1, finished_ids=finished)


def test_a_stale_replica_is_rebuilt_only_when_a_decision_needs_it() -> None:
    view = ClusterView(keep_replicas=True)
    view.apply_heartbeat(beat("a", 1), NOW_S)
    a = view.instances["a"]
    assert a.replica is not None and view.num_replica_rebuilds == 0  # made, not built
    for seq in range(2, 12):  # beats no decision looks at: no rebuild
        view.apply_heartbeat(beat("a", seq, generated=10 + seq), NOW_S + seq * 0.1)
    assert view.num_replica_rebuilds == 0
    replica = view.replica(a, NOW_S + 1.2)
    assert view.num_replica_rebuilds == 1 and a.replica_beat is a.heartbeat
    assert replica.scheduler.now_s >= NOW_S + 1.1  # built from the latest beat (seq 11)
    view.replica(a, NOW_S + 1.25)  # current: advanced, not rebuilt
    view.apply_heartbeat(beat("a", 11), NOW_S + 1.3)  # a repeated beat changes nothing
    view.replica(a, NOW_S + 1.3)
    assert view.num_replica_rebuilds == 1
    # Used by a decision just now: the next beat rebuilds it at once, not the next decision.
    view.apply_heartbeat(beat("a", 12), NOW_S + 1.3)
    assert view.num_replica_rebuilds == 2 and a.replica_beat is a.heartbeat
    view.replica(a, NOW_S + 1.3)
    assert view.num_replica_rebuilds == 2
    # Not used for longer than HOT_REPLICA_S: stale again until a decision needs it.
    view.apply_heartbeat(beat("a", 40), NOW_S + 4.0)
    assert view.num_replica_rebuilds == 2 and a.replica_beat is not a.heartbeat


def test_every_beat_reaches_the_replica_even_unbuilt() -> None:
    core = DispatcherCore("block", seed=1)
    core.apply_heartbeat(beat("a", 1), NOW_S)
    request = make_request("x " * 20, max_tokens=100, predicted=50, submitted_at_s=NOW_S)
    (outcome,) = core.place([request], NOW_S)
    assert isinstance(outcome, Placed)
    replica = core.view.instances["a"].replica
    assert request.id in replica.beliefs
    # A beat saying it finished drops its belief though no decision rebuilds the replica.
    core.apply_heartbeat(beat("a", 2, finished=(request.id,)), NOW_S + 0.1)
    assert request.id not in replica.beliefs and not core.view.instances["a"].assigned_not_seen


def test_an_assignment_to_a_stale_replica_is_added_at_its_rebuild() -> None:
    view = ClusterView(keep_replicas=True)
    view.apply_heartbeat(beat("a", 1), NOW_S)
    a = view.instances["a"]
    view.replica(a, NOW_S)
    view.apply_heartbeat(beat("a", 2), NOW_S + 0.1)
    request = make_request("x " * 20, max_tokens=100, predicted=50)
    view.record_assignment("a", request)  # the replica is stale: its rebuild adds it
    replica = view.replica(a, NOW_S + 0.1)
    assert request.id in replica.scheduler.request_ids
    assert request.id in replica.beliefs


def test_a_reader_behind_on_beats_counts_silence_only_up_to_the_last_beat_read() -> None:
    view = ClusterView()
    view.apply_heartbeat(make_heartbeat("a", seq=1, sent_at_s=NOW_S), NOW_S)
    view.apply_heartbeat(make_heartbeat("b", seq=1, sent_at_s=NOW_S), NOW_S, heard_at_s=NOW_S - 0.05)
    # Two seconds later, the last read reached only the beats of NOW_S: nobody was heard
    # after that, so nobody is suspect for it.
    view.read_beats_until(NOW_S)
    view.refresh_health(NOW_S + 2.0)
    assert [v.instance_id for v in view.live_instances()] == ["a", "b"]
    # Once a read catches up, the same silence is real.
    view.read_beats_until(None)
    view.refresh_health(NOW_S + 2.0)
    assert view.live_instances() == []
    assert {v.health for v in view.instances.values()} == {"suspect"}
    # A reader behind still sees an instance whose last beat is older than the others' as silent.
    view.apply_heartbeat(make_heartbeat("a", seq=2, sent_at_s=NOW_S + 3.0), NOW_S + 3.0)
    view.read_beats_until(NOW_S + 3.0)
    view.refresh_health(NOW_S + 9.0)
    assert view.instances["a"].health == "live" and view.instances["b"].health == "suspect"
