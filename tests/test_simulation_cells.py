"""``blockq simulate --cells``: several simulated cells behind the client library's front."""

from __future__ import annotations

import dataclasses
import json

import pytest

from blockq.engine_model import get_preset
from blockq.engine_model.fleet_spec import parse_fleet
from loadgen.simulation.config import SimulationConfig
from loadgen.simulation.multi_cell import CellsSimulation, cell_configs
from loadgen.simulation.single_run import simulate_run
from loadgen.simulation.workload import annotate_sample, arrivals_for, sample_trace, submitted


def test_cells_share_the_load_answer_everything_and_repeat_exactly() -> None:
    sample = annotate_sample(sample_trace("synthetic", 300, 2, redraw=False), 2, predictor="heuristic")
    config = SimulationConfig(instances=4, cells=2, policy="least_requests", seed=2)
    first = simulate_run(config, sample, rate_per_s=6.0)
    summary = first.summary
    assert summary["completed"] + summary["failed"] == 300 and summary["failed"] == 0
    sent = summary["cells_sent"]
    assert set(sent) == {"c0", "c1"} and sum(sent.values()) == 300
    assert abs(sent["c0"] - sent["c1"]) <= 30  # equal cells: within 10 % of an even split
    # Each cell's requests ran on its own instances.
    assert {r.instance.split("-")[0] for r in first.records if r.instance} == {"c0", "c1"}
    again = simulate_run(config, sample, rate_per_s=6.0)
    assert json.dumps(again.summary, sort_keys=True, default=str) == json.dumps(summary, sort_keys=True, default=str)


def test_one_cell_is_the_plain_cluster() -> None:
    sample = annotate_sample(sample_trace("synthetic", 60, 3, redraw=False), 3, predictor="heuristic")
    summary = simulate_run(SimulationConfig(instances=2, policy="round_robin", seed=3), sample, rate_per_s=3.0).summary
    assert "cells" not in summary and "cells_sent" not in summary


def test_a_mixed_fleet_runs_in_cells_each_instance_with_its_own_preset() -> None:
    # 7 instances in 2 cells: cell 0 gets fleet instances 0, 2, 4, 6 and cell 1 gets 1, 3, 5.
    fleet = parse_fleet("3:llama2-7b-a30,3:llama2-7b-a100,1:llama2-7b-h100-tp2")
    config = SimulationConfig(instances=7, fleet=fleet, cells=2, policy="block", seed=2, best_effort=True)
    sample = annotate_sample(sample_trace("synthetic", 200, 2, redraw=False), 2, predictor="heuristic")
    simulation = CellsSimulation(config, refinements=sample.refinements)
    arrivals = [(offset_s, submitted(sample.requests[index], config.warmup_s + offset_s, best_effort=True))
                for offset_s, index in arrivals_for(sample, rate_per_s=8.0) if sample.requests[index] is not None]
    result = simulation.run(arrivals)
    assert len(arrivals) == 200 and not result.rejected
    assert {final.status for final in result.finals.values()} == {"ok"} and len(result.finals) == 200
    # What each cell's dispatcher heard from its instances: their presets and KV caches.
    heard = [{view.instance_id: (view.heartbeat.preset, view.heartbeat.engine_config["num_gpu_blocks"])
              for view in core.view.instances.values()} for core in simulation.cores]
    blocks = {name: get_preset(name).config.num_gpu_blocks
              for name in ("llama2-7b-a30", "llama2-7b-a100", "llama2-7b-h100-tp2")}
    expected = [["llama2-7b-a30", "llama2-7b-a30", "llama2-7b-a100", "llama2-7b-h100-tp2"],
                ["llama2-7b-a30", "llama2-7b-a100", "llama2-7b-a100"]]
    assert heard == [{f"c{cell}-gpu{index}": (preset, blocks[preset]) for index, preset in enumerate(presets)}
                     for cell, presets in enumerate(expected)]
    # Both cells placed requests, each on its own instances, and the front sent every one.
    served = {final.instance.split("-")[0] for final in result.finals.values()}
    assert served == {"c0", "c1"}
    assert result.counters["sent_c0"] + result.counters["sent_c1"] == 200
    with pytest.raises(ValueError, match="^cells: must be between 1 and the fleet's 7 instances"):
        dataclasses.replace(config, cells=8)


def test_cells_must_divide_instances_unless_a_fleet_sizes_them() -> None:
    with pytest.raises(ValueError, match="^cells: must be >= 1 and divide instances"):
        SimulationConfig(instances=7, cells=2)
    fleet = parse_fleet("3:llama2-7b-a30,3:llama2-7b-a100,1:llama2-7b-h100-tp2")
    sizes = [cell.instances for cell in cell_configs(SimulationConfig(instances=7, fleet=fleet, cells=3))]
    assert sizes == [3, 2, 2]
