"""The dispatcher core without I/O: beats it cannot use, assignments only once a replica
took them, one length mode handed in, unstarted requests placed again."""

from __future__ import annotations

import dataclasses

import pytest

from blockq.wire.health import HealthPolicy
from blockq.wire.protocol import Prediction
from dispatcher.core import DispatcherCore, Held, Placed, Rejected
from tests.factories import make_heartbeat, make_request


def test_a_beat_the_core_cannot_use_is_rejected_counted_and_changes_nothing() -> None:
    core = DispatcherCore("block", seed=0)
    assert core.apply_heartbeat(make_heartbeat("a", sent_at_s=0.0), 0.0) is None
    bad = dataclasses.replace(make_heartbeat("b", sent_at_s=0.0), engine_config={"num_gpu_blocks": 0})
    rejection = core.apply_heartbeat(bad, 0.1)
    assert rejection is not None and rejection.reason == "unusable" and "num_gpu_blocks" in rejection.detail
    bad_latency = dataclasses.replace(make_heartbeat("c", sent_at_s=0.0), latency_model={"linear_scale": "x"})
    assert core.apply_heartbeat(bad_latency, 0.1) is not None
    assert core.stats.num_beats_rejected == 2 and core.stats.num_beats_applied == 1
    assert [v.instance_id for v in core.live_instances()] == ["a"]
    # The core carries on: a request is still placed on the instance it could use.
    (outcome,) = core.place([make_request(predicted=50)], 0.2)
    assert isinstance(outcome, Placed) and outcome.request.assignment.instance_id == "a"


def test_an_instance_without_preset_or_latency_model_starts_from_the_prior() -> None:
    """A vLLM engine publishes neither: its replica starts from the prior profile (and
    is refitted from its step samples), and prefix caching does not stop it."""
    from blockq.engine_model import get_preset
    from dispatcher.cluster_view import PRIOR_PRESET

    core = DispatcherCore("block", seed=0)
    beat = make_heartbeat("v", sent_at_s=0.0)
    beat = dataclasses.replace(beat, preset="vllm", latency_model=None,
                               engine_config={**beat.engine_config, "enable_prefix_caching": True, "watermark": 0.0})
    assert core.apply_heartbeat(beat, 0.0) is None
    replica = core.view.instances["v"].replica
    assert replica is not None and replica.latency_model == get_preset(PRIOR_PRESET).latency_model
    (outcome,) = core.place([make_request(predicted=50)], 0.1)
    assert isinstance(outcome, Placed) and outcome.request.assignment.instance_id == "v"


def test_replicas_belong_to_the_core_and_lengths_are_one_value() -> None:
    assert DispatcherCore("round_robin").view.keep_replicas is False
    assert DispatcherCore("block").view.keep_replicas is True
    assert DispatcherCore("oracle").lengths == "truth"
    core = DispatcherCore("block", lengths="upper")
    core.apply_heartbeat(make_heartbeat("a", sent_at_s=0.0), 0.0)
    replica = core.view.instances["a"].replica
    assert replica is not None and replica.lengths == "upper"
    request = make_request().with_prediction(Prediction(10, 100, 50, 400, "t"))
    assert replica.request_size(request) == (10, 400)
    assert replica.request_size(request, lengths="median") == (10, 100)
    with pytest.raises(ValueError, match="lengths"):
        DispatcherCore("block", lengths="mean")


def test_an_assignment_the_replica_refuses_is_not_recorded() -> None:
    core = DispatcherCore("oracle", seed=0)
    core.apply_heartbeat(make_heartbeat("a", sent_at_s=0.0), 0.0)
    no_truth = make_request(predicted=50)
    with_truth = make_request(predicted=50, true_output_tokens=40)
    rejected, placed = core.place([no_truth, with_truth], 0.0)
    assert isinstance(rejected, Rejected) and "true_output_tokens" in rejected.reason
    assert isinstance(placed, Placed)
    view = core.view.instances["a"]
    assert list(view.assigned_not_seen) == [with_truth.id] and view.num_assigned_total == 1
    assert view.replica is not None and view.replica.scheduler.request_ids == [with_truth.id]
    assert core.stats.num_rejected == 1 and core.stats.num_placed == 1


def test_held_without_instances_and_unstarted_requests_move_elsewhere() -> None:
    core = DispatcherCore("least_requests", seed=0)
    requests = [make_request(predicted=20) for _ in range(4)]
    assert all(isinstance(o, Held) for o in core.place(requests, 0.0))
    for instance_id in ("a", "b"):
        core.apply_heartbeat(make_heartbeat(instance_id, sent_at_s=0.0), 0.0)
    outcomes = core.place(requests, 0.1)
    on_a = [o.request for o in outcomes if isinstance(o, Placed) and o.request.assignment.instance_id == "a"]
    assert len(on_a) == 2
    moved = core.replace_unstarted("a", on_a, 0.2)
    assert all(isinstance(o, Placed) and o.request.assignment.instance_id == "b" for o in moved)
    assert core.view.instances["a"].assigned_not_seen == {}
    assert len(core.view.instances["b"].assigned_not_seen) == 4




def test_instances_seeded_from_the_registry_are_suspect_until_heard_and_dead_if_never() -> None:
    core = DispatcherCore("block", seed=0, health_policy=HealthPolicy(dead_after_s=1.0))
    core.hear_again(10.0)  # a new term
    for beat in (make_heartbeat("a", seq=7, sent_at_s=9.0), make_heartbeat("gone", seq=3, sent_at_s=1.0),
                 make_heartbeat("left", seq=9, state="stopped", sent_at_s=2.0)):
        core.seed_instance(beat)
    assert {i: v.health for i, v in core.view.instances.items()} == {"a": "suspect", "gone": "suspect",
                                                                      "left": "stopped"}
    assert core.refresh_health(10.1) == ["left"]  # its queue moves at once
    assert isinstance(core.place([make_request(predicted=20)], 10.1)[0], Held)  # nothing heard yet
    # The beat heard replaces the registry's, even with the same seq, and is dated as heard.
    assert core.apply_heartbeat(make_heartbeat("a", seq=7, sent_at_s=9.0), 10.2) is None
    (outcome,) = core.place([make_request(predicted=20)], 10.2)
    assert isinstance(outcome, Placed) and outcome.request.assignment.instance_id == "a"
    core.seed_instance(make_heartbeat("a", seq=1, sent_at_s=0.0))  # a known instance stays as it is
    assert core.view.instances["a"].heartbeat.seq == 7
    assert core.refresh_health(10.9) == [] and core.view.instances["gone"].health == "suspect"
    core.apply_heartbeat(make_heartbeat("a", seq=8, sent_at_s=11.0), 11.05)
    assert core.refresh_health(11.1) == ["gone"]  # dead_after_s into the term, never heard


def test_the_fleet_snapshot_carries_the_sizes_of_answered_requests_from_applied_beats() -> None:
    core = DispatcherCore("block", seed=0)
    core.apply_heartbeat(dataclasses.replace(make_heartbeat("a", sent_at_s=0.0), finished_ids=("x", "y"),
                                             finished_sizes=((120, 33),)), 0.0)
    rejected = dataclasses.replace(make_heartbeat("b", sent_at_s=0.0), engine_config={"num_gpu_blocks": 0},
                                   finished_sizes=((1, 1),))
    assert core.apply_heartbeat(rejected, 0.1) is not None
    core.apply_heartbeat(dataclasses.replace(make_heartbeat("a", seq=2, sent_at_s=0.1),
                                             finished_sizes=((40, 500),)), 0.1)
    assert core.fleet_snapshot(0.2, {}).answered_sizes == ((120, 33), (40, 500))
