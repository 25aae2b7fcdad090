"""ShareGPT reader: plain/gzip, streaming, truncated files, pair extraction."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from blockq.text.sharegpt_reader import (
    SharegptPair,
    iter_conversations,
    iter_pairs,
    pairs_of_conversation,
)


def _record(conversation_id: str, *speakers_and_texts: tuple[str, str]) -> dict:
    return {
        "id": conversation_id,
        "conversations": [{"from": speaker, "value": text} for speaker, text in speakers_and_texts],
    }


RECORDS = [
    _record("c0", ("human", "hi [0]"), ("gpt", "hello")),
    _record("c1", ("gpt", "I start"), ("human", "so?")),
    _record(
        "c2",
        ("human", "first"),
        ("gpt", "answer one"),
        ("human", "second"),
        ("gpt", "answer two"),
        ("human", "dangling"),
    ),
    _record("c3", ("human", 'unicode é 漢字 "quoted" ]}'), ("gpt", "ok ]")),
]


def _write(path: Path, records: list[dict], *, compress: bool) -> Path:
    payload = json.dumps(records, ensure_ascii=False, indent=1).encode("utf-8")
    if compress:
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)
    return path


@pytest.mark.parametrize("compress", [False, True])
def test_reads_all_records_plain_and_gzip(tmp_path: Path, compress: bool) -> None:
    path = _write(tmp_path / "data.json", RECORDS, compress=compress)
    assert list(iter_conversations(path)) == RECORDS


def test_truncated_final_record_stops_cleanly(tmp_path: Path) -> None:
    payload = json.dumps(RECORDS, ensure_ascii=False)
    cut = payload.index('"c3"') + 10  # inside the last record
    path = tmp_path / "cut.json.gz"
    path.write_bytes(gzip.compress(payload[:cut].encode("utf-8")))
    assert [record["id"] for record in iter_conversations(path)] == ["c0", "c1", "c2"]


def test_missing_closing_bracket_keeps_every_record(tmp_path: Path) -> None:
    payload = json.dumps(RECORDS).rstrip("]")
    path = tmp_path / "open.json"
    path.write_text(payload)
    assert len(list(iter_conversations(path))) == len(RECORDS)


def test_truncated_gzip_stream_is_tolerated(tmp_path: Path) -> None:
    records = [_record(f"id{i}", ("human", f"q{i} " * 50), ("gpt", "a " * 200)) for i in range(300)]
    compressed = gzip.compress(json.dumps(records).encode("utf-8"))
    path = tmp_path / "cut.json.gz"
    path.write_bytes(compressed[: len(compressed) // 2])
    read = list(iter_conversations(path))
    assert 0 < len(read) < len(records)
    assert read == records[: len(read)]


def test_not_an_array_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "object.json"
    path.write_text('{"id": 1}')
    with pytest.raises(ValueError, match="expected a JSON array"):
        list(iter_conversations(path))


def test_empty_file_yields_nothing(tmp_path: Path) -> None:
    path = tmp_path / "empty.json"
    path.write_text("")
    assert list(iter_conversations(path)) == []


def test_first_turn_pairs_skip_conversations_not_starting_human_gpt(tmp_path: Path) -> None:
    path = _write(tmp_path / "data.json.gz", RECORDS, compress=True)
    pairs = list(iter_pairs(path))
    assert [pair.conversation_id for pair in pairs] == ["c0", "c2", "c3"]
    assert pairs[1] == SharegptPair("c2", "first", "answer one", 0, ())


def test_multi_turn_pairs_carry_history() -> None:
    pairs = pairs_of_conversation(RECORDS[2], first_turn_only=False)
    assert [(pair.prompt, pair.turn_index) for pair in pairs] == [("first", 0), ("second", 1)]
    assert pairs[1].history == ("first", "answer one")


def test_missing_id_gets_record_index() -> None:
    record = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    (pair,) = pairs_of_conversation(record, record_index=7)
    assert pair.conversation_id == "record-7"
