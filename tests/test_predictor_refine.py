"""The remaining-length refinement model on synthetic answers whose text shows progress.

Prompts say nothing about length ("Give me tips about chess."), answers announce a
count ("Here are 12 tips about chess:") and number their items, so a first guess from
the prompt alone cannot know the length but the partial output can.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from predictor_service.cli import add_predictor_commands
from predictor_service.models.fast import FastConfig
from predictor_service.models.refine import RefineInput, RefineModel
from predictor_service.models.refine_features import ALL_FEATURE_NAMES, all_features
from predictor_service.models.refine_fit import RefineFitConfig
from predictor_service.refine_eval import evaluate_refine_file
from predictor_service.refine_training import RefineTrainOptions, train_refine_file, training_cuts
from predictor_service.training import train
from tests.factories import list_conversations
from tests.predictor_synthetic import write_sharegpt

SMALL_FIT = RefineFitConfig(num_rounds=150, spread_num_rounds=60, min_data_in_leaf=10)


pytestmark = pytest.mark.usefixtures("stdlib_logging")


@pytest.fixture(scope="module")
def data_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_sharegpt(
        tmp_path_factory.mktemp("data") / "lists.json.gz", list_conversations(500)
    )


@pytest.fixture(scope="module")
def fast_dir(data_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("fast")
    train(data_path, "fast", out_dir, fast_config=FastConfig(num_rounds=30, num_threads=1))
    return out_dir


@pytest.fixture(scope="module")
def trained(data_path: Path, fast_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("refine")
    train_refine_file(data_path, fast_dir, out_dir, options=RefineTrainOptions(fit=SMALL_FIT))
    return out_dir


def _input(partial_text: str, generated_tokens: int, **changes: Any) -> RefineInput:
    values: dict[str, Any] = {
        "prompt": "Give me tips about chess.", "prompt_tokens": 8, "first_guess_p10_tokens": 40,
        "first_guess_p50_tokens": 150, "first_guess_p90_tokens": 400,
        "generated_tokens": generated_tokens, "partial_text": partial_text,
    }  # fmt: skip
    values.update(changes)
    return RefineInput(**values)


def _column(matrix: np.ndarray, name: str) -> list[float]:
    return matrix[:, ALL_FEATURE_NAMES.index(name)].tolist()


def test_features_see_code_lists_and_closing_phrases() -> None:
    open_code = _input("Try this:\n```python\nfor x in range(3):\n    print(x)\n", 20)
    closed_code = _input("Try this:\n```python\nprint(1)\n```\nThat prints 1.", 15)
    listing = _input("Here are 10 tips about chess:\n1. a b c\n2. d e f\n3. g h", 30)
    closing = _input("So that is all. In conclusion, practice. I hope this helps", 60)
    matrix = all_features([open_code, closed_code, listing, closing])
    assert _column(matrix, "in_code_block") == [1.0, 0.0, 0.0, 0.0]
    assert _column(matrix, "log_chars_in_open_code")[0] > 0
    assert _column(matrix, "announced_items")[2] == 10.0
    assert _column(matrix, "last_item_number")[2] == 3.0
    assert _column(matrix, "items_left")[2] == 7.0
    assert (
        _column(matrix, "tail_conclusion")[3] == 1.0 and _column(matrix, "tail_courtesy")[3] == 1.0
    )
    assert _column(matrix, "tail_conclusion")[:3] == [0.0, 0.0, 0.0]
    assert np.isnan(_column(matrix, "items_left")[0])  # no count announced: unknown


def test_inputs_are_validated_and_cuts_follow_the_worker_cadence() -> None:
    with pytest.raises(ValueError, match="generated_tokens"):
        _input("", -1)
    with pytest.raises(ValueError, match="first_guess"):
        _input("", 0, first_guess_p50_tokens=0)
    cuts = training_cuts(200, np.random.default_rng(0))
    assert {0, 64, 128, 192} <= set(cuts) and max(cuts) < 200 and cuts == sorted(set(cuts))


def test_predictions_are_ordered_positive_and_capped(trained: Path) -> None:
    model = RefineModel.load(trained)
    inputs = [_input("Here are 20 tips about chess:\n1. a b", 16), _input("", 0)]
    inputs.append(_input("Here are 5 tips:\n1. a\n2. b", 12, max_tokens=15))
    predictions = model.predict(inputs)
    assert all(1 <= p.p10_tokens <= p.predicted_output_tokens <= p.p90_tokens for p in predictions)
    assert predictions[2].p90_tokens <= 3  # at most max_tokens - generated remain
    assert model.predict([]) == []


def test_save_and_load_round_trip(trained: Path, tmp_path: Path) -> None:
    model = RefineModel.load(trained)
    model.save(tmp_path)
    again = RefineModel.load(tmp_path)
    assert again.version == model.version and again.version.startswith("refine-")
    assert again.featurizer.names == model.featurizer.names
    inputs = [_input("Here are 12 tips about bees:\n1. a b c\n2. d e", 25), _input("", 0)]
    assert again.predict(inputs) == model.predict(inputs)
    manifest = json.loads((tmp_path / "refine_manifest.json").read_text())
    assert manifest["version"] == model.version and manifest["feature_names"]


def test_refinement_beats_the_first_guess_conditional_median(
    trained: Path, data_path: Path, fast_dir: Path
) -> None:
    result = evaluate_refine_file(trained, data_path, fast_dir)
    assert result["split"] == "val"
    stages = {stage["fraction"]: stage for stage in result["stages"]}
    assert set(stages) == {0.0, 0.25, 0.5, 0.75}
    for fraction in (0.25, 0.5, 0.75):
        assert stages[fraction]["count"] > 20
        assert stages[fraction]["mae"] < 0.6 * stages[fraction]["first_guess_conditional_mae"]
    assert stages[0.5]["kendall_tau"] > 0.5
    assert result["refinements_per_s"] > 0


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_predictor_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_train_and_eval_json(
    data_path: Path, fast_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "refine"
    train_args = _parse(
        ["refine-train", "--data", str(data_path), "--first-guess-model", str(fast_dir),
         "--out", str(out_dir), "--seed", "1", "--max-examples", "200"]
    )  # fmt: skip
    assert train_args.handler(train_args) == 0
    assert "trained refinement model refine-" in capsys.readouterr().out
    eval_args = _parse(
        ["refine-eval", "--model", str(out_dir), "--data", str(data_path),
         "--first-guess-model", str(fast_dir), "--json", "--max-examples", "200"]
    )  # fmt: skip
    assert eval_args.handler(eval_args) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1
    result = json.loads(printed[0])
    assert set(result) == {"stages", "refinements_per_s", "version"}
    assert result["version"] == RefineModel.load(out_dir).version
    assert [stage["fraction"] for stage in result["stages"]] == [0.0, 0.25, 0.5, 0.75]
    for stage in result["stages"]:
        assert set(stage) == {
            "fraction", "count", "mae", "first_guess_conditional_mae", "mae_ratio",
            "constant_mae", "kendall_tau", "p10_p90_coverage",
        }  # fmt: skip
