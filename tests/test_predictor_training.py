"""train / evaluate and the train/eval CLI functions on a synthetic ShareGPT file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from blockq.prediction_accuracy import METRIC_KEYS
from predictor_service.cli import add_predictor_commands
from predictor_service.dataset import is_validation_conversation
from predictor_service.manifest import read_manifest
from tests.predictor_synthetic import make_synthetic_sharegpt

pytestmark = pytest.mark.usefixtures("stdlib_logging")


@pytest.fixture(scope="module")
def data_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_synthetic_sharegpt(tmp_path_factory.mktemp("data") / "train.json.gz", 400)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_predictor_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_validation_split_is_stable() -> None:
    ids = [f"conversation-{i}" for i in range(2000)]
    held_out = [i for i in ids if is_validation_conversation(i, 0.1)]
    assert 150 < len(held_out) < 250
    assert held_out == [i for i in ids if is_validation_conversation(i, 0.1)]


def test_train_cli_writes_model_and_manifest(
    tmp_path: Path, data_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "fast"
    args = _parse(
        ["train", "--data", str(data_path), "--backend", "fast", "--out", str(out_dir),
         "--seed", "3", "--num-rounds", "60", "--num-threads", "1"]
    )  # fmt: skip
    assert args.handler(args) == 0
    assert "trained fast model fast-" in capsys.readouterr().out
    manifest = read_manifest(out_dir)
    assert manifest.backend == "fast" and manifest.seed == 3
    assert manifest.version.startswith("fast-") and len(manifest.data_sha256) == 64
    assert manifest.num_train_examples > 200 and manifest.num_val_examples > 10
    assert manifest.metrics["mae"] < manifest.metrics["baseline"]["mae"]
    assert set(METRIC_KEYS) <= set(manifest.metrics["baseline"])
    assert len(manifest.prompt_token_bin_fractions) == len(manifest.prompt_token_bin_edges) + 1

    eval_args = _parse(["eval", "--model", str(out_dir), "--data", str(data_path), "--json"])
    assert eval_args.handler(eval_args) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1
    result = json.loads(printed[0])
    for key in (*METRIC_KEYS, "predictions_per_s", "baseline", "mape_definition"):
        assert key in result
    assert set(METRIC_KEYS) <= set(result["baseline"])
    assert result["split"] == "val" and result["count"] == manifest.num_val_examples
    assert result["mae"] == pytest.approx(manifest.metrics["mae"])
    assert result["mae"] < 0.6 * result["baseline"]["mae"]
    assert result["predictions_per_s"] > 0


def test_eval_on_other_data_uses_every_example(tmp_path: Path, data_path: Path) -> None:
    from predictor_service.training import evaluate, train

    out_dir = tmp_path / "fast"
    from predictor_service.models.fast import FastConfig

    train(data_path, "fast", out_dir, fast_config=FastConfig(num_rounds=30, num_threads=1))
    other = make_synthetic_sharegpt(tmp_path / "other.json", 60, seed=9)
    result = evaluate(out_dir, other)
    assert result["split"] == "all" and result["count"] > 40


def test_train_rejects_untrainable_backend(tmp_path: Path, data_path: Path) -> None:
    from predictor_service.training import train

    with pytest.raises(ValueError, match="backend must be one of"):
        train(data_path, "oracle", tmp_path / "x")


def test_multi_turn_examples_include_history_and_dedupe(tmp_path: Path) -> None:
    from blockq.text.tokenizer import get_token_counter
    from predictor_service.dataset import load_examples
    from tests.predictor_synthetic import make_conversations, write_sharegpt

    records = make_conversations(40, seed=1)
    path = write_sharegpt(tmp_path / "multi.json", records + records[:5])  # 5 duplicates
    first_only = load_examples(path, get_token_counter())
    every_turn = load_examples(path, get_token_counter(), first_turn_only=False)
    assert len({example.prompt for example in first_only}) == len(first_only)
    later = [example for example in every_turn if example.num_turns == 2]
    assert later and len(every_turn) == len(first_only) + len(later)
    assert all(example.prompt_tokens > 20 and "\n" in example.prompt for example in later)
    # Rendered as a chat client sends them (the gateway's plain template).
    assert all(example.prompt.startswith("user: ") and example.prompt.endswith("\nassistant:") for example in later)
