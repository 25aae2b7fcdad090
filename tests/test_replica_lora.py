"""The dispatcher's replica with LoRA adapters: each request's adapter from the beat (and
from placements since), the resident adapters from ``loaded_loras``, the load and the slot
wait in the forecast, and the affinity charge ``block`` still adds to the rank."""

from __future__ import annotations

import dataclasses

import pytest

from blockq.wire.beats import Heartbeat, RequestProgress
from dispatcher.adapters import (
    ADAPTER_AFFINITY_S,
    adapter_charge,
    adapter_ids,
    resident_adapter_ids,
)
from dispatcher.core import DispatcherCore, Placed
from dispatcher.replica import InstanceReplica
from dispatcher.what_if import forecast, forecast_ttft
from tests.factories import make_heartbeat, make_request

LOAD_S = 0.04  # the beats' lora_load_ms


def lora_beat(instance_id: str, *, running: tuple[RequestProgress, ...] = (),
              waiting: tuple[RequestProgress, ...] = (), loaded: list[str] | None = None, max_loras: int = 2,
              seq: int = 1) -> Heartbeat:
    """An A30-like instance serving base model ``m`` and adapters x, y, z (ids 1, 2, 3)."""
    beat = make_heartbeat(instance_id, sent_at_s=0.0, seq=seq, running=running, waiting=waiting)
    config = {**beat.engine_config, "lora_adapters": ["x", "y", "z"], "loaded_loras": loaded or [],
              "max_loras": max_loras, "lora_load_ms": LOAD_S * 1000}
    return dataclasses.replace(beat, model="m", engine_config=config)


def entry(request_id: str, adapter: str | None, *, generated: int = 5, prompt: int = 100) -> RequestProgress:
    computed = prompt + generated - 1 if generated else 0
    return RequestProgress(request_id, prompt, computed, generated, 400, 800, lora_adapter=adapter)


def ttft_s(replica: InstanceReplica, model: str | None) -> float:
    """The forecast TTFT of a 200-token prompt naming ``model`` there."""
    return forecast_ttft(replica, 200, 20, model=model)[0]


def replica_of(core: DispatcherCore, instance_id: str) -> InstanceReplica:
    return core.view.replica(core.view.instances[instance_id], 0.0)


def test_a_rebuild_gives_each_row_its_adapter_and_restores_the_resident_ones() -> None:
    core = DispatcherCore("block", seed=0)
    beat = lora_beat("a", running=(entry("r1", "y"), entry("r2", None), entry("r3", "nope")),
                     waiting=(entry("w1", "z", generated=0),), loaded=["gone", "z", "x", "y"])
    core.apply_heartbeat(beat, 0.0)
    packed = replica_of(core, "a").scheduler
    ids = packed.request_ids
    # "nope" is not served there: that row runs as the base model (the beat is not refused)
    assert {ids[row]: packed.request(row).lora_id for row in range(packed.num_rows)} == {
        "r1": 2, "r2": 0, "r3": 0, "w1": 3}
    # Restored: x, y ("gone" is not served; of the rest, the max_loras most recently used);
    # then the first step (a rebuild advances to now) runs y and z: z loaded, x evicted.
    assert packed.loaded_loras == [2, 3] and packed.num_lora_loads == 1


def test_placements_since_the_beat_enter_the_replica_with_their_adapter() -> None:
    core = DispatcherCore("block", seed=0)
    core.apply_heartbeat(lora_beat("a", running=(entry("r1", "x"),), loaded=["x"]), 0.0)
    (outcome,) = core.place([make_request(predicted=20, model="z", id="new1")], 0.0)
    assert isinstance(outcome, Placed)
    replica = replica_of(core, "a")
    row = replica.scheduler.request_ids.index("new1")
    assert replica.scheduler.request(row).lora_id == 3
    # a rebuild from a beat that does not show it yet re-adds it with its adapter
    core.apply_heartbeat(lora_beat("a", running=(entry("r1", "x", generated=6),), loaded=["x"], seq=2), 0.05)
    replica = core.view.replica(core.view.instances["a"], 0.05)
    row = replica.scheduler.request_ids.index("new1")
    assert replica.scheduler.request(row).lora_id == 3


def test_the_forecast_holds_the_load_where_the_adapter_is_not_resident() -> None:
    core = DispatcherCore("block", seed=0)
    core.apply_heartbeat(lora_beat("a", loaded=["x"]), 0.0)
    replica = replica_of(core, "a")
    resident = ttft_s(replica, "x")
    assert ttft_s(replica, "y") == pytest.approx(resident + LOAD_S, abs=1e-12)
    assert ttft_s(replica, None) == resident
    assert forecast(replica, "q", 200, 20, model="y", keep=False).ttft_s == ttft_s(replica, "y")


def test_the_forecast_holds_the_wait_for_an_adapter_slot() -> None:
    """max_loras 1 and a long request of x running: a request of y is skipped until x's
    last request finishes (seconds), one of x or of the base model is admitted at once."""
    core = DispatcherCore("block", seed=0)
    core.apply_heartbeat(lora_beat("a", running=(entry("r1", "x"),), loaded=["x"], max_loras=1), 0.0)
    replica = replica_of(core, "a")
    same, base, other = (ttft_s(replica, model) for model in ("x", None, "y"))
    assert same == base < 0.2
    assert other > 5.0  # r1 decodes ~395 more tokens first


def test_block_ranks_a_load_behind_by_the_affinity_charge_only() -> None:
    core = DispatcherCore("block", seed=0)
    core.apply_heartbeat(lora_beat("b", loaded=["x"], max_loras=1), 0.0)
    view = core.view.instances["b"]
    assert adapter_charge(view, "x") == 0.0            # resident
    assert adapter_charge(view, None) == 0.0           # the base model
    assert adapter_charge(view, "m") == 0.0
    assert adapter_charge(view, "y") == ADAPTER_AFFINITY_S
    core.place([make_request(predicted=20, model="y")], 0.1)  # y now in use there
    assert adapter_charge(view, "y") == 0.0


def test_adapter_numbering_and_resident_lists_from_an_engine_config() -> None:
    config = {"lora_adapters": ["x", "y"], "loaded_loras": ["y", "q", "x"]}
    ids = adapter_ids(config)
    assert ids == {"x": 1, "y": 2} and adapter_ids(dict(config)) is ids  # shared, not rebuilt
    assert resident_adapter_ids(config, ids, 4) == [2, 1]
    assert resident_adapter_ids(config, ids, 1) == [1]
    assert resident_adapter_ids(config, ids, 0) == []


def test_the_replica_follows_max_loras_as_the_beats_change_it() -> None:
    """A vllm-http worker learns its server's max_loras after its first beats."""
    core = DispatcherCore("block", seed=0)
    core.apply_heartbeat(lora_beat("a", running=(entry("r1", "x"),), loaded=["x"], max_loras=2), 0.0)
    assert ttft_s(replica_of(core, "a"), "y") < 0.2  # a second slot is free
    core.apply_heartbeat(lora_beat("a", running=(entry("r1", "x"),), loaded=["x"], max_loras=1, seq=2), 0.0)
    replica = replica_of(core, "a")
    assert replica.config.max_loras == 1 and ttft_s(replica, "y") > 5.0
