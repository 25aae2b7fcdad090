"""The mixed-fleet rules (topology, weighted_least_requests) on small hand-built fleets,
and the simulating policies' per-instance replicas there."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from blockq.engine_model import get_preset
from blockq.wire.beats import Heartbeat
from dispatcher.cluster_view import ClusterView
from dispatcher.policies import make_policy, make_view
from dispatcher.policies.hardware import NVLINK_WEIGHTS, OTHER_WEIGHTS, Topology, instance_capacity
from tests.factories import make_heartbeat, make_request
from tests.test_policies import running


def preset_beat(instance_id: str, preset: str, *, num_running: int = 0, **config: object) -> Heartbeat:
    """A beat of an instance of ``preset`` (its config and latency model), ``num_running``
    requests running."""
    chosen = get_preset(preset)
    beat = make_heartbeat(instance_id, running=running(num_running, prefix=instance_id))
    return dataclasses.replace(beat, preset=preset, engine_config={**chosen.config.to_dict(), **config},
                               latency_model=chosen.latency_model.to_dict())


def fleet_view(*beats: Heartbeat, policy: str = "llumnix") -> ClusterView:
    view = make_view(policy)
    for beat in beats:
        view.apply_heartbeat(beat, time.time())
    return view


def choose(policy: str, *beats: Heartbeat, prompt_tokens: int = 100) -> str:
    view = fleet_view(*beats, policy=policy)
    request = make_request(" ".join(["w"] * prompt_tokens), predicted=200)
    return make_policy(policy, view, seed=0).choose(request, view.live_instances(), time.time()).instance_id


def capacity_of(preset: str) -> float:
    chosen = get_preset(preset)
    return instance_capacity(chosen.config.to_dict(), chosen.latency_model).decode_tokens_s


def test_capacity_follows_the_hardware() -> None:
    a30, a100, h100_tp2 = (capacity_of(f"llama2-7b-{gpu}") for gpu in ("a30", "a100", "h100-tp2"))
    assert a30 < a100 < h100_tp2
    # an A30 cannot hold 48 contexts of 512 tokens: its slots are its KV cache's
    chosen = get_preset("llama2-7b-a30")
    assert instance_capacity(chosen.config.to_dict(), chosen.latency_model).num_slots == 1052 * 16 // 512


def test_weighted_least_requests_divides_by_capacity() -> None:
    ratio = capacity_of("llama2-7b-h100-tp2") / capacity_of("llama2-7b-a30")
    busy_h100 = int(ratio * 3) - 2   # (n + 1) / h100 < (2 + 1) / a30
    assert choose("weighted_least_requests", preset_beat("a30", "llama2-7b-a30", num_running=2),
                  preset_beat("h100", "llama2-7b-h100-tp2", num_running=busy_h100)) == "h100"
    busier_h100 = int(ratio * 3) + 2
    assert choose("weighted_least_requests", preset_beat("a30", "llama2-7b-a30", num_running=2),
                  preset_beat("h100", "llama2-7b-h100-tp2", num_running=busier_h100)) == "a30"
    # least_requests would send it to the A30 in the first case
    assert choose("least_requests", preset_beat("a30", "llama2-7b-a30", num_running=2),
                  preset_beat("h100", "llama2-7b-h100-tp2", num_running=busy_h100)) == "a30"


def test_topology_prefers_the_fast_idle_instance_and_avoids_a_full_one() -> None:
    assert choose("topology", preset_beat("a30", "llama2-7b-a30"),
                  preset_beat("h100", "llama2-7b-h100-tp2")) == "h100"
    assert choose("topology", preset_beat("a30", "llama2-7b-a30"),
                  preset_beat("h100", "llama2-7b-h100-tp2", num_running=48)) == "a30"


def test_topology_weighs_nvlink_instances_by_perf_and_others_by_latency_too() -> None:
    nvlink = preset_beat("nvlink", "llama2-7b-a100-tp2", num_running=12)
    pcie_model = get_preset("llama2-7b-a100-tp2").latency_model.to_dict()  # the same speed
    pcie = dataclasses.replace(preset_beat("pcie", "llama2-7b-a100-tp2", interconnect="pcie"),
                               latency_model=pcie_model)
    view = fleet_view(nvlink, pcie)
    request = make_request("a short prompt", predicted=200)
    scores = Topology(view, random.Random(0)).scores(request, view.live_instances())
    # equal predicted TTFTs (latency 1 each); perf: 36 of 48 slots free against all 48
    assert scores["nvlink"] == pytest.approx(NVLINK_WEIGHTS[0] * 36 / 48 + NVLINK_WEIGHTS[1])
    assert scores["pcie"] == pytest.approx(OTHER_WEIGHTS[0] + OTHER_WEIGHTS[1])


@pytest.mark.parametrize("policy", ["block", "llumnix"])
def test_simulating_and_load_policies_see_each_instances_own_engine(policy: str) -> None:
    view = fleet_view(preset_beat("a30", "llama2-7b-a30"), preset_beat("h100", "llama2-7b-h100-tp2"),
                      policy=policy)
    by_id = {v.instance_id: v for v in view.live_instances()}
    assert (by_id["a30"].num_free_blocks, by_id["h100"].num_free_blocks) == (1052, 16_569)
    if policy == "block":
        for instance_id, preset in (("a30", "llama2-7b-a30"), ("h100", "llama2-7b-h100-tp2")):
            replica = view.replica(by_id[instance_id], time.time())
            assert replica.config == get_preset(preset).config
            assert replica.latency_model == get_preset(preset).latency_model
