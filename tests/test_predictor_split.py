"""``blockq predictor split``: one side of the training split, on a file written here."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from blockq.text.sharegpt_reader import iter_conversations
from loadgen.traces import load_trace
from predictor_service.dataset import (
    DEFAULT_VAL_FRACTION,
    is_validation_conversation,
    load_examples,
    load_split,
    write_split,
)

VAL_FRACTION = 0.3
NUM_CONVERSATIONS = 48


class WordCounter:
    """Stand-in token counter: one token per whitespace-separated word."""

    name = "words"

    def count(self, texts: Sequence[str]) -> list[int]:
        return [len(text.split()) for text in texts]


def _records() -> list[dict[str, Any]]:
    """Made-up conversations: human-first ones, one gpt-first, one without an id."""
    records: list[dict[str, Any]] = [
        {
            "id": f"conv-{index:03d}",
            "conversations": [
                {"from": "human", "value": f"Name {index % 5 + 1} colours, café {index}."},
                {"from": "gpt", "value": " ".join(["blue"] * (index % 5 + 1))},
                {"from": "human", "value": "And one more?"},
                {"from": "gpt", "value": "green"},
            ],
        }
        for index in range(NUM_CONVERSATIONS)
    ]
    records.append({"id": "gpt-first", "conversations": [{"from": "gpt", "value": "Hello."}]})
    no_id = [{"from": "human", "value": "No id here?"}, {"from": "gpt", "value": "None."}]
    records.append({"conversations": no_id})
    return records


@pytest.fixture(scope="module")
def data_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as stream:
        json.dump(_records(), stream, ensure_ascii=False)
    return path


def _ids(records: list[dict[str, Any]]) -> list[str]:
    return [str(record["id"]) for record in records]


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_split_sides_partition_the_file(tmp_path: Path, data_path: Path, suffix: str) -> None:
    sides = {}
    for side in ("val", "train"):
        out = tmp_path / f"{side}{suffix}"
        count = write_split(data_path, out, side, VAL_FRACTION)
        assert (out.read_bytes()[:2] == b"\x1f\x8b") == suffix.endswith(".gz")
        sides[side] = list(iter_conversations(out))
        assert len(sides[side]) == count > 0
        for conversation_id in _ids(sides[side]):
            assert is_validation_conversation(conversation_id, VAL_FRACTION) == (side == "val")
    originals = {r.get("id", f"record-{index}"): r for index, r in enumerate(_records())}
    assert not set(_ids(sides["val"])) & set(_ids(sides["train"]))
    assert sorted(_ids(sides["val"]) + _ids(sides["train"])) == sorted(originals)
    for record in sides["val"] + sides["train"]:
        original = originals[record["id"]]
        assert record == ({"id": record["id"], **original} if "id" not in original else original)


def test_val_side_is_the_training_validation_split(tmp_path: Path, data_path: Path) -> None:
    out = tmp_path / "val.json"
    write_split(data_path, out, "val")
    held_out = load_split(data_path, WordCounter(), val_fraction=DEFAULT_VAL_FRACTION).val
    written = load_examples(out, WordCounter())
    assert [example.conversation_id for example in written] == [
        example.conversation_id for example in held_out
    ]


def test_split_output_loads_as_a_trace(tmp_path: Path, data_path: Path) -> None:
    out = tmp_path / "val.json.gz"
    write_split(data_path, out, "val", VAL_FRACTION)
    requests = load_trace(str(out), limit=None, seed=1, token_counter=WordCounter())
    expected = [
        record["id"]
        for record in iter_conversations(out)
        if record["conversations"][0]["from"] == "human"
    ]
    assert [request.trace_id for request in requests] == expected
    assert requests and all(request.true_output_tokens >= 1 for request in requests)


def test_split_cli_prints_the_count(tmp_path: Path, data_path: Path) -> None:
    out = tmp_path / "out" / "val.json.gz"
    blockq = Path(sys.executable).with_name("blockq")
    command = [str(blockq)] if blockq.exists() else [sys.executable, "-m", "blockq.cli"]
    result = subprocess.run(
        [*command, "predictor", "split", "--data", str(data_path), "--split", "val",
         "--out", str(out), "--val-fraction", str(VAL_FRACTION)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    count = len(list(iter_conversations(out)))
    assert result.stdout == f"wrote {count} val conversations -> {out}\n"
    assert count == write_split(data_path, tmp_path / "again.json", "val", VAL_FRACTION)


def test_split_rejects_bad_arguments(tmp_path: Path, data_path: Path) -> None:
    with pytest.raises(ValueError, match="val_fraction"):
        write_split(data_path, tmp_path / "x.json", "val", 1.5)
    with pytest.raises(ValueError, match="side"):
        write_split(data_path, tmp_path / "x.json", "test", VAL_FRACTION)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        write_split(tmp_path / "missing.json", tmp_path / "x.json", "val")
    assert not list(tmp_path.iterdir())
