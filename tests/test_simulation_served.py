"""Models and LoRA adapters in the cluster simulation: what each instance serves, what each
request names, and that no request lands where its model is not served."""

from __future__ import annotations

import argparse

import pytest

from loadgen.simulation.config import SimulationConfig
from loadgen.simulation.served import (
    ModelShare,
    ServedModels,
    add_served_model_arguments,
    parse_models,
    served_models_from_args,
)
from loadgen.simulation.single_run import simulate_run
from loadgen.simulation.workload import annotate_sample, sample_trace


def _sample(num_requests: int, seed: int):  # noqa: ANN202
    return annotate_sample(sample_trace("synthetic", num_requests, seed, redraw=False), seed, predictor="heuristic")


def test_the_draws_are_seeded_and_follow_zipf() -> None:
    served = ServedModels(num_adapters=10, adapter_zipf=1.0, max_loras=2)
    first = served.draw(5000, seed=1)
    assert first == served.draw(5000, seed=1) and first != served.draw(5000, seed=2)
    assert first.count("lora-00") > 2.5 * first.count("lora-02") > 0
    assert ServedModels().draw(3, seed=1) == [None, None, None]
    two = ServedModels(models=(ModelShare("chat", 0.8, 3), ModelShare("code", 0.2, 1)))
    assert [two.model_of_instance(i) for i in range(4)] == ["chat", "chat", "chat", "code"]
    assert 0.75 < two.draw(4000, seed=1).count("chat") / 4000 < 0.85


def test_one_parser_validates_the_flags() -> None:
    parser = argparse.ArgumentParser()
    add_served_model_arguments(parser)
    args = parser.parse_args(["--adapters", "50", "--adapter-zipf", "1.2", "--max-loras", "8"])
    assert served_models_from_args(args) == ServedModels(num_adapters=50, adapter_zipf=1.2, max_loras=8)
    with pytest.raises(SystemExit, match="max_loras"):
        served_models_from_args(parser.parse_args(["--adapters", "5", "--max-loras", "0"]))
    assert parse_models("a:0.7:2, b:0.3:1") == (ModelShare("a", 0.7, 2), ModelShare("b", 0.3, 1))
    with pytest.raises(argparse.ArgumentTypeError, match="NAME:SHARE:INSTANCES"):
        parse_models("a:x:2")
    with pytest.raises(ValueError, match="add up to 3"):
        SimulationConfig(instances=4, served=ServedModels(models=parse_models("a:0.7:2,b:0.3:1")))


@pytest.mark.parametrize("policy", ["llumnix", "block"])
def test_two_models_are_placed_only_where_served(policy: str) -> None:
    served = ServedModels(models=(ModelShare("chat", 0.7, 2), ModelShare("code", 0.3, 1)))
    run = simulate_run(SimulationConfig(instances=3, policy=policy, seed=2, served=served), _sample(120, 2),
                       rate_per_s=4.0)
    assert run.summary["model_misplaced"] == 0 and run.summary["completed"] == 120
    assert run.summary["models"] == ["chat", "code"]


def test_adapter_loads_are_counted_and_fewer_under_block() -> None:
    served = ServedModels(num_adapters=12, adapter_zipf=1.0, max_loras=2)
    loads, p99_ms = {}, {}
    for policy in ("llumnix", "block"):
        run = simulate_run(SimulationConfig(instances=3, policy=policy, seed=1, served=served), _sample(200, 1),
                           rate_per_s=3.0)
        assert run.summary["completed"] + run.summary["failed"] == 200 and run.summary["model_misplaced"] == 0
        loads[policy] = run.summary["adapter_loads"]
        p99_ms[policy] = run.summary["ttft_p99_ms"]
    assert 0 < loads["block"] < loads["llumnix"]
    # Far past capacity (llumnix's TTFTs run to tens of seconds waiting for adapter slots):
    # block's replicas simulate the slot waits, so it refuses the requests no instance would
    # answer within the TTFT objective instead of queueing them.
    assert p99_ms["block"] < 3000 < p99_ms["llumnix"]
