"""``blockq simulate --cells``: several simulated cells behind the client library's front."""

from __future__ import annotations

import json

from loadgen.simulation.config import SimulationConfig
from loadgen.simulation.single_run import simulate_run
from loadgen.simulation.workload import annotate_sample, sample_trace


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
