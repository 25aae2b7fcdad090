"""Mixed fleets: the spec parser, the tensor-parallel presets, hardware in the beat, the
simulation's per-instance presets."""

from __future__ import annotations

import argparse
import dataclasses
from types import SimpleNamespace

import pytest

from blockq.cli.main import build_parser
from blockq.config import ConfigError
from blockq.engine_model import get_preset, kv_blocks_for_gpu_memory
from blockq.engine_model.config import EngineConfig
from blockq.engine_model.fleet_spec import FleetGroup, parse_fleet
from blockq.engine_model.tensor_parallel import LINKS, all_reduce_seconds_per_token
from blockq.local.cluster_config import ClusterConfig
from blockq.local.up import _cluster_config
from blockq.wire.beats import HeartbeatDecoder, decode_heartbeat
from blockq.wire.protocol import ValidationError, encode
from loadgen.benches.live import BenchConfig, _served_per_cell
from loadgen.cli import add_bench_arguments, config_from_args
from loadgen.simulation.cluster import ClusterSimulation
from loadgen.simulation.config import SimulationConfig
from tests.factories import make_heartbeat


def test_fleet_spec_parses_groups_in_order() -> None:
    fleet = parse_fleet("6:llama2-7b-a30, 4:llama2-7b-a100,llama2-7b-h100-tp2")
    assert fleet.groups == (FleetGroup(6, "llama2-7b-a30"), FleetGroup(4, "llama2-7b-a100"),
                            FleetGroup(1, "llama2-7b-h100-tp2"))
    assert fleet.num_instances == 11
    assert fleet.instance_presets[5:7] == ("llama2-7b-a30", "llama2-7b-a100")
    assert fleet.preset_of(10) == fleet.preset_of(99) == "llama2-7b-h100-tp2"
    assert str(fleet) == "6:llama2-7b-a30,4:llama2-7b-a100,1:llama2-7b-h100-tp2"
    assert fleet.min_max_model_len == 4096


@pytest.mark.parametrize(("spec", "message"), [
    ("", r"^fleet: must be COUNT:PRESET"),
    ("x:llama2-7b-a30", r"^fleet: group 1 \('x:llama2-7b-a30'\): count: must be an integer"),
    ("2:llama2-7b-a30,0:llama2-7b-a100", r"^fleet: group 2 \('0:llama2-7b-a100'\): count: must be >= 1"),
    ("2:llama2-7b-a30,3:", r"^fleet: group 2 \('3:'\): preset: missing"),
    ("2:llama2-7b-a30,3:nope", r"^fleet: group 2 \('3:nope'\): preset: unknown 'nope'"),
    ("2:llama2-7b-a30,,", r"^fleet: group 2 \(''\): empty"),
    ("5000:llama2-7b-a30", r"^fleet: at most 4096 instances"),
])
def test_fleet_spec_errors_name_the_field(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_fleet(spec)


def test_a_split_interleaves_the_instances_and_keeps_the_fleet_order() -> None:
    fleet = parse_fleet("6:llama2-7b-a30,4:llama2-7b-a100,2:llama2-7b-h100-tp2")
    halves = fleet.split(2)
    assert [str(half) for half in halves] == ["3:llama2-7b-a30,2:llama2-7b-a100,1:llama2-7b-h100-tp2"] * 2
    assert fleet.split(1) == (fleet,)
    # Uneven: 12 instances in 5 cells of 3, 3, 2, 2, 2; cell K's instance J is fleet instance K + 5 J.
    cells = fleet.split(5)
    assert [cell.num_instances for cell in cells] == [3, 3, 2, 2, 2]
    assert [str(cell) for cell in cells] == [
        "2:llama2-7b-a30,1:llama2-7b-h100-tp2", "1:llama2-7b-a30,1:llama2-7b-a100,1:llama2-7b-h100-tp2",
        "1:llama2-7b-a30,1:llama2-7b-a100", "1:llama2-7b-a30,1:llama2-7b-a100", "1:llama2-7b-a30,1:llama2-7b-a100"]
    for index, cell in enumerate(cells):
        assert cell.instance_presets == fleet.instance_presets[index::5]
    # Two groups of one preset stay two groups; a group absent from a cell is left out.
    first, second = parse_fleet("2:llama2-7b-a30,2:llama2-7b-a30,1:llama2-7b-a100").split(2)
    assert first.groups == (FleetGroup(1, "llama2-7b-a30"), FleetGroup(1, "llama2-7b-a30"),
                            FleetGroup(1, "llama2-7b-a100"))
    assert second.groups == (FleetGroup(1, "llama2-7b-a30"), FleetGroup(1, "llama2-7b-a30"))
    assert sum(cell.num_instances for cell in fleet.split(12)) == 12


@pytest.mark.parametrize("num_cells", [0, -1, 13])
def test_a_split_that_leaves_a_cell_empty_is_refused(num_cells: int) -> None:
    fleet = parse_fleet("6:llama2-7b-a30,4:llama2-7b-a100,2:llama2-7b-h100-tp2")
    message = rf"^cells: must be between 1 and the fleet's 12 instances.*\(got {num_cells}\)"
    with pytest.raises(ValueError, match=message):
        fleet.split(num_cells)


@pytest.mark.parametrize("gpu", ["a100", "h100"])
def test_tensor_parallel_presets_pool_the_gpus_memory(gpu: str) -> None:
    one, two, four = (get_preset(f"llama2-7b-{gpu}{suffix}") for suffix in ("", "-tp2", "-tp4"))
    assert two.config.num_gpu_blocks == kv_blocks_for_gpu_memory(160.0, reserve_gib=2.0) == 16_569
    assert four.config.num_gpu_blocks == kv_blocks_for_gpu_memory(320.0, reserve_gib=4.0) == 34_745
    # the weights are stored once: two GPUs hold more than twice one GPU's KV cache
    assert two.config.num_gpu_blocks > 2 * one.config.num_gpu_blocks
    assert (one.config.tensor_parallel_size, two.config.tensor_parallel_size, four.config.tensor_parallel_size) \
        == (1, 2, 4)
    assert (one.config.interconnect, two.config.interconnect) == ("none", "nvlink")
    assert {one.config.gpu, two.config.gpu, four.config.gpu} == {gpu}
    assert get_preset(f"llama2-7b-{gpu}-tp2-pcie").config.interconnect == "pcie"


@pytest.mark.parametrize("gpu", ["a100", "h100"])
@pytest.mark.parametrize("batch", [(0, 1, 512), (0, 48, 48 * 600), (512, 0, 512), (256, 32, 32 * 400 + 256)])
def test_latency_falls_with_the_tensor_parallel_degree(gpu: str, batch: tuple[int, int, int]) -> None:
    seconds = [get_preset(f"llama2-7b-{gpu}{suffix}").latency_model.step_seconds(*batch)
               for suffix in ("", "-tp2", "-tp4")]
    assert seconds[0] > seconds[1] > seconds[2]
    # PCIe's all-reduces cost more than NVLink's
    nvlink = get_preset(f"llama2-7b-{gpu}-tp2").latency_model.step_seconds(*batch)
    assert get_preset(f"llama2-7b-{gpu}-tp2-pcie").latency_model.step_seconds(*batch) > nvlink


def test_communication_is_the_ring_all_reduce_of_the_hidden_state() -> None:
    link = LINKS[("a100", "nvlink")]
    # 65 all-reduces x 2 (p-1)/p x 8,192 bytes per token over 240 GB/s
    assert all_reduce_seconds_per_token(link, 2) == pytest.approx(65 * 8192 / 240e9)
    assert all_reduce_seconds_per_token(link, 4) == pytest.approx(65 * 1.5 * 8192 / 240e9)


def test_engine_config_validates_the_hardware() -> None:
    with pytest.raises(ValueError, match="^interconnect: must be one of none, pcie, nvlink"):
        EngineConfig(interconnect="infiniband")
    with pytest.raises(ValueError, match="^tensor_parallel_size: must be an int in"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="^gpu: must be a string"):
        EngineConfig(gpu="x" * 100)
    assert EngineConfig(interconnect="nvlink").has_nvlink


def test_hardware_travels_in_the_beat() -> None:
    beat = make_heartbeat("gpu0")
    config = get_preset("llama2-7b-h100-tp2").config.to_dict()
    beat = dataclasses.replace(beat, engine_config=config)
    decoded = HeartbeatDecoder().decode(encode(beat))
    hardware = EngineConfig.from_dict(decoded.engine_config)
    assert (hardware.gpu, hardware.tensor_parallel_size, hardware.interconnect) == ("h100", 2, "nvlink")
    bad = dataclasses.replace(beat, engine_config={**config, "interconnect": "smoke"})
    with pytest.raises(ValidationError, match="interconnect: must be one of"):
        decode_heartbeat(encode(bad))


def test_simulation_starts_each_instance_with_its_groups_preset() -> None:
    fleet = parse_fleet("2:llama2-7b-a30,1:llama2-7b-h100-tp2")
    simulation = ClusterSimulation(SimulationConfig(instances=3, fleet=fleet, policy="block"))
    presets = [instance.engine.preset for instance in simulation.instances.values()]
    assert presets == ["llama2-7b-a30", "llama2-7b-a30", "llama2-7b-h100-tp2"]
    with pytest.raises(ValueError, match="^fleet: 3 instances, but instances is 12"):
        SimulationConfig(fleet=fleet)


def test_a_local_cluster_starts_each_group_in_its_own_worker_processes() -> None:
    config = ClusterConfig(instances=9, fleet="6:llama2-7b-a30,3:llama2-7b-a100", instances_per_process=4)
    assert config.worker_ranges() == [(0, 4, "llama2-7b-a30"), (4, 2, "llama2-7b-a30"), (6, 3, "llama2-7b-a100")]
    workers = [argv for name, argv in config.child_argvs() if name.startswith("workers-")]
    assert [argv[argv.index("--preset") + 1] for argv in workers] == ["llama2-7b-a30"] * 2 + ["llama2-7b-a100"]
    assert config.num_worker_processes == 3
    with pytest.raises(ConfigError, match="^fleet: 9 instances, but instances is 8"):
        ClusterConfig(instances=8, fleet="6:llama2-7b-a30,3:llama2-7b-a100")
    with pytest.raises(ConfigError, match=r"^fleet: group 1 \('6:x'\): preset: unknown"):
        ClusterConfig(instances=6, fleet="6:x")
    with pytest.raises(ConfigError, match="^fleet: a mixed fleet runs emulated engines, without autoscale"):
        ClusterConfig(instances=9, fleet="6:llama2-7b-a30,3:llama2-7b-a100", engine="vllm", model="m")


def test_a_local_cluster_of_cells_starts_each_cells_share_of_the_fleet() -> None:
    # 7 instances in 2 cells: cell 0 the fleet's instances 0, 2, 4, 6 (inst-0 .. inst-3),
    # cell 1 its instances 1, 3, 5 (inst-4 .. inst-6); each group in worker processes of its own.
    config = ClusterConfig(instances=7, fleet="3:llama2-7b-a30,3:llama2-7b-a100,1:llama2-7b-h100-tp2", cells=2,
                           instances_per_process=2)
    assert config.worker_ranges() == [(0, 2, "llama2-7b-a30"), (2, 1, "llama2-7b-a100"), (3, 1, "llama2-7b-h100-tp2"),
                                      (4, 1, "llama2-7b-a30"), (5, 2, "llama2-7b-a100")]
    workers = [(name, argv) for name, argv in config.child_argvs() if name.startswith("workers-")]
    started = [(name, argv[argv.index("--first-index") + 1], argv[argv.index("--instances") + 1],
                argv[argv.index("--preset") + 1], config.child_env(name)["BLOCKQ_KEY_PREFIX"])
               for name, argv in workers]
    assert started == [
        ("workers-0", "0", "2", "llama2-7b-a30", "{cell0}:"), ("workers-1", "2", "1", "llama2-7b-a100", "{cell0}:"),
        ("workers-2", "3", "1", "llama2-7b-h100-tp2", "{cell0}:"), ("workers-3", "4", "1", "llama2-7b-a30", "{cell1}:"),
        ("workers-4", "5", "2", "llama2-7b-a100", "{cell1}:")]
    assert config.num_worker_processes == 5 and config.child_env("dispatcher-c1") == {"BLOCKQ_KEY_PREFIX": "{cell1}:"}
    assert config.metrics_port("workers-4") == config.metrics_base_port + 2 + 4
    with pytest.raises(ConfigError, match="^cells: must be between 1 and the fleet's 3 instances"):
        ClusterConfig(instances=3, fleet="2:llama2-7b-a30,1:llama2-7b-a100", cells=4)


def test_a_bench_of_cells_counts_each_cells_share_of_the_fleet() -> None:
    fleet = parse_fleet("3:llama2-7b-a30,3:llama2-7b-a100,1:llama2-7b-h100-tp2")
    config = BenchConfig(instances=7, fleet=fleet, cells=2)
    served = [SimpleNamespace(instance=f"inst-{index}") for index in (0, 3, 3, 4, 6)] + [SimpleNamespace(instance="")]
    assert _served_per_cell(served, config) == {"cell0": 3, "cell1": 2, "none": 1}  # cell 0 is inst-0 .. inst-3
    # `blockq bench` starts it with `blockq up --fleet F --cells 2` (no --instances needed).
    up = _cluster_config(build_parser().parse_args(["up", "--fleet", str(fleet), "--cells", "2"]))
    assert (up.instances, up.cells, up.num_worker_processes) == (7, 2, 5)
    with pytest.raises(ValueError, match="^cells: must be between 1 and the fleet's 7 instances"):
        BenchConfig(instances=7, fleet=fleet, cells=8)


def test_bench_and_simulate_accept_the_fleet_flag() -> None:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(["--fleet", "2:llama2-7b-a30,1:llama2-7b-h100-tp2"])
    config = config_from_args(args)
    assert (config.instances, str(config.fleet)) == (3, "2:llama2-7b-a30,1:llama2-7b-h100-tp2")
    with pytest.raises(SystemExit):
        parser.parse_args(["--fleet", "2:nope"])
