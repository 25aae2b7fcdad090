"""Trace readers on small files written by the tests themselves."""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from loadgen.traces import (
    TraceRequest,
    detect_format,
    group_sessions,
    load_trace,
    load_trace_with_stats,
)
from loadgen.traces.base import (
    SYNTHETIC_TOKEN_ID_HIGH,
    SYNTHETIC_TOKEN_ID_LOW,
    LengthPolicy,
    synthetic_token_ids,
)


class WordCounter:
    """Stand-in token counter: one token per whitespace-separated word."""

    name = "words"

    def count(self, texts: Sequence[str]) -> list[int]:
        return [len(text.split()) for text in texts]


def _write(path: Path, text: str, *, newline: str = "\n") -> Path:
    path.write_bytes(text.replace("\n", newline).encode())
    return path


def _assert_token_prompt(request: TraceRequest) -> None:
    assert isinstance(request.prompt, tuple)
    assert len(request.prompt) == request.prompt_tokens
    assert all(SYNTHETIC_TOKEN_ID_LOW <= t < SYNTHETIC_TOKEN_ID_HIGH for t in request.prompt)


def test_vidur_crlf_with_predictions(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "pred.csv",
        "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio,num_predicted_decode_tokens\n"
        "25,3,28,0.12,1\n71,692,763,9.7,702\n10,0,10,0.0,1\n4000,200,4200,20.0,150\n",
        newline="\r\n",
    )
    assert detect_format(path) == "vidur"
    loaded = load_trace_with_stats(str(path))
    requests = loaded.requests
    assert [r.trace_id for r in requests] == ["0", "1", "3"]
    assert [(r.prompt_tokens, r.true_output_tokens) for r in requests] == [
        (25, 3), (71, 692), (4000, 96)
    ]  # fmt: skip
    # The prediction is clipped to the same bound as the output.
    assert [r.predicted_output_tokens for r in requests] == [1, 702, 96]
    assert all(r.arrival_offset_s is None for r in requests)
    for request in requests:
        _assert_token_prompt(request)
    assert requests[0].prompt != requests[1].prompt[:25]
    assert loaded.stats.num_skipped_invalid == 1
    assert loaded.stats.num_clipped_output == 1
    assert load_trace(str(path), limit=1) == requests[:1]


def test_vidur_arrivals_and_too_long_rows(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "splitwise.csv",
        "arrived_at,num_prefill_tokens,num_decode_tokens\n1.5,10,5\n2.0,5000,4\n3.25,20,7\n",
    )
    loaded = load_trace_with_stats(f"vidur:{path}", max_model_len=4096)
    assert [r.arrival_offset_s for r in loaded.requests] == [0.0, 1.75]
    assert loaded.stats.num_skipped_too_long == 1
    unlimited = load_trace(str(path), max_model_len=None)
    assert [r.prompt_tokens for r in unlimited] == [10, 5000, 20]


def test_azure_timestamps_relative_to_first_row(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "azure.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:16:46.6805900,12,3\n",
        newline="\r\n",
    )
    assert detect_format(path) == "azure"
    requests = load_trace(str(path))
    assert [r.prompt_tokens for r in requests] == [374, 396, 12]
    assert [r.true_output_tokens for r in requests] == [44, 109, 3]
    assert requests[1].arrival_offset_s == pytest.approx(4.314579)
    assert requests[2].arrival_offset_s == pytest.approx(60.0)
    for request in requests:
        _assert_token_prompt(request)


def test_burstgpt_skips_failures(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "burst.csv",
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45,ChatGPT,1087,0,1087,Conversation log\n"
        "118,GPT-4,417,276,693,Conversation log\n",
    )
    assert detect_format(path) == "burstgpt"
    loaded = load_trace_with_stats(str(path))
    assert [(r.prompt_tokens, r.true_output_tokens) for r in loaded.requests] == [
        (472, 18), (417, 276)
    ]  # fmt: skip
    assert [r.arrival_offset_s for r in loaded.requests] == [0.0, 113.0]
    assert loaded.stats.num_skipped_invalid == 1


def test_mooncake_shared_prefix_blocks(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 1000, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 700, "output_length": 20, "hash_ids": [0, 3]},
        {"timestamp": 2500, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1]},
    ]
    path = _write(
        tmp_path / "mooncake.jsonl",
        "\n".join(json.dumps(line) for line in lines) + '\n{"timestamp": 30',
    )
    assert detect_format(path) == "mooncake"
    loaded = load_trace_with_stats(str(path), seed=3)
    first, second, third = loaded.requests
    for request in loaded.requests:
        _assert_token_prompt(request)
    assert first.prompt[:512] == second.prompt[:512]
    assert first.prompt[512:700] != second.prompt[512:700]
    assert first.prompt[:1024] == third.prompt
    assert [r.arrival_offset_s for r in loaded.requests] == [0.0, 0.5, 1.5]
    assert loaded.stats.num_skipped_invalid == 1  # the truncated last line
    assert load_trace(str(path), seed=3) == loaded.requests
    assert load_trace(str(path), seed=4)[0].prompt != first.prompt


def test_synthetic_token_ids_are_blockwise() -> None:
    a = synthetic_token_ids([7, 8], 20, block_size_tokens=16)
    b = synthetic_token_ids([7, 9], 20, block_size_tokens=16)
    assert a[:16] == b[:16] and a[16:] != b[16:]
    with pytest.raises(ValueError):
        synthetic_token_ids([7], 20, block_size_tokens=16)


def _sharegpt_records() -> list[dict]:
    return [
        {"id": "a", "conversations": [
            {"from": "human", "value": "tell me a story"},
            {"from": "gpt", "value": "once upon a time there was"},
        ]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "no human first"}]},
        {"id": "c", "conversations": [
            {"from": "human", "value": "two words"},
            {"from": "gpt", "value": "ok"},
            {"from": "human", "value": "later turn"},
            {"from": "gpt", "value": "ignored"},
        ]},
        {"id": "d", "conversations": [
            {"from": "human", "value": "cut off"},
            {"from": "gpt", "value": "this record is never complete"},
        ]},
    ]  # fmt: skip


def test_sharegpt_truncated_gzip(tmp_path: Path) -> None:
    text = json.dumps(_sharegpt_records())
    truncated = text[: text.index('"id": "d"') + 12]  # ends inside the last record
    path = tmp_path / "sharegpt.json.gz"
    path.write_bytes(gzip.compress(truncated.encode()))
    assert detect_format(path) == "sharegpt"
    requests = load_trace(str(path), token_counter=WordCounter())
    assert [r.trace_id for r in requests] == ["a", "c"]
    assert requests[0] == TraceRequest(
        prompt="tell me a story", prompt_tokens=4, true_output_tokens=6, trace_id="a",
        output_text="once upon a time there was",
    )
    assert requests[1].true_output_tokens == 1


def test_sharegpt_plain_limit_and_clipping(tmp_path: Path) -> None:
    path = tmp_path / "conversations.json"
    path.write_text(json.dumps(_sharegpt_records()))
    requests = load_trace(f"sharegpt:{path}", token_counter=WordCounter(), max_model_len=5)
    assert [(r.trace_id, r.prompt_tokens, r.true_output_tokens) for r in requests] == [
        ("a", 4, 1), ("c", 2, 1), ("d", 2, 3)
    ]  # fmt: skip
    assert len(load_trace(str(path), token_counter=WordCounter(), limit=1)) == 1


def test_synthetic_is_seeded_and_bounded() -> None:
    requests = load_trace("synthetic", limit=300, seed=5)
    assert len(requests) == 300
    assert requests == load_trace("synthetic", limit=300, seed=5)
    assert requests[:50] == load_trace("synthetic", limit=50, seed=5)
    assert requests != load_trace("synthetic", limit=300, seed=6)
    for request in requests:
        assert isinstance(request.prompt, str)
        assert len(request.prompt.split()) == request.prompt_tokens
        assert request.prompt_tokens + request.true_output_tokens <= 4096
        assert request.true_output_tokens >= 1
    outputs = sorted(r.true_output_tokens for r in requests)
    assert 150 <= outputs[len(outputs) // 2] <= 400
    counted = load_trace("synthetic", limit=5, seed=5, token_counter=WordCounter())
    assert [r.prompt_tokens for r in counted] == [r.prompt_tokens for r in requests[:5]]


def test_length_policy_counts() -> None:
    policy = LengthPolicy(100)
    assert policy.try_fit(10, 50, 200) == (50, 90)
    assert policy.try_fit(60, 50) == (40, None)
    assert policy.try_fit(100, 1) is None
    assert policy.try_fit(0, 5) is None
    stats = policy.stats()
    assert (stats.num_rows_read, stats.num_requests) == (4, 2)
    assert (stats.num_skipped_too_long, stats.num_skipped_invalid) == (1, 1)
    assert stats.num_clipped_output == 1


def test_unknown_inputs(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_trace(str(tmp_path / "missing.csv"))
    odd = _write(tmp_path / "odd.csv", "a,b\n1,2\n")
    with pytest.raises(ValueError, match="unrecognised"):
        load_trace(str(odd))
    headerless = _write(
        tmp_path / "trace.txt",
        '{"timestamp": 0, "input_length": 3, "output_length": 2, "hash_ids": [1]}\n',
    )
    assert detect_format(headerless) == "mooncake"
    with pytest.raises(ValueError, match="missing columns"):
        load_trace(f"azure:{odd}")


def _multi_turn_records() -> list[dict]:
    def conversation(conversation_id: str, *texts: str) -> dict:
        speakers = ("human", "gpt")
        return {"id": conversation_id, "conversations": [
            {"from": speakers[index % 2], "value": text} for index, text in enumerate(texts)]}

    return [
        conversation("s1", "hello there", "hi friend", "how are you", "fine thanks a lot"),
        conversation("s2", "a b", "c", " ".join(["x"] * 13), "long", "y", "z"),
        {"id": "skipped", "conversations": [{"from": "gpt", "value": "no human first"}]},
        conversation("s4", "q", "", "r", "s"),
        conversation("s5", "last one", "yes"),
    ]


def test_sharegpt_multi_turn_sessions(tmp_path: Path) -> None:
    from blockq.frontdoors.gateway.chat_template import render_plain
    from blockq.frontdoors.gateway.openai_requests import ChatMessage

    path = tmp_path / "conversations.json"
    path.write_text(json.dumps(_multi_turn_records()))
    # s2's second turn quotes the first: 4 + 1 + 1 + 13 + 1 = 20 words >= 16.
    loaded = load_trace_with_stats(str(path), token_counter=WordCounter(), max_model_len=16,
                                   multi_turn=True)
    requests = loaded.requests
    assert [(r.session_id, r.turn_index) for r in requests] == [("s1", 0), ("s1", 1), ("s2", 0),
                                                                ("s5", 0)]
    first, second = requests[0], requests[1]
    assert first.prompt == "user: hello there\nassistant:"
    assert second.prompt == "user: hello there\nassistant: hi friend\nuser: how are you\nassistant:"
    assert second.prompt == render_plain([
        ChatMessage("user", "hello there"), ChatMessage("assistant", "hi friend"),
        ChatMessage("user", "how are you")])  # what the gateway would send
    assert second.prompt.startswith(first.prompt)
    assert (second.prompt_tokens, second.true_output_tokens) == (11, 4)
    assert second.output_text == "fine thanks a lot" and second.trace_id == "s1"
    stats = loaded.stats
    # s2: one kept, one too long, one dropped; s4: one malformed (empty answer), one dropped.
    assert (stats.num_requests, stats.num_skipped_too_long, stats.num_skipped_invalid) == (4, 1, 1)
    assert stats.num_dropped_session_turns == 2
    assert stats.num_rows_read == 8
    assert load_trace(str(path), token_counter=WordCounter(), max_model_len=16, multi_turn=True,
                      limit=2) == requests[:2]
    # Without the flag: first turns only, raw text, no sessions.
    single = load_trace(str(path), token_counter=WordCounter(), max_model_len=16)
    assert [(r.trace_id, r.prompt, r.session_id) for r in single][:2] == [
        ("s1", "hello there", ""), ("s2", "a b", "")]


def test_multi_turn_needs_conversations(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multi_turn"):
        load_trace("synthetic", limit=5, multi_turn=True)
    mooncake = _write(tmp_path / "m.jsonl",
                      '{"timestamp": 0, "input_length": 3, "output_length": 2, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match="multi_turn"):
        load_trace(str(mooncake), multi_turn=True)


def test_group_sessions_orders_turns() -> None:
    def request(session_id: str, turn_index: int) -> TraceRequest:
        return TraceRequest(prompt="p", prompt_tokens=1, true_output_tokens=1,
                            session_id=session_id, turn_index=turn_index)

    requests = [request("b", 1), request("a", 0), request("", 0), request("b", 0)]
    sessions = group_sessions(requests)
    assert [[(r.session_id, r.turn_index) for r in turns] for turns in sessions] == [
        [("b", 0), ("b", 1)], [("a", 0)], [("", 0)]]


def test_sample_trace_draws_whole_sessions(tmp_path: Path) -> None:
    from loadgen.simulation.workload import sample_trace

    conversations = [{"id": f"c{i}", "conversations": [
        {"from": ("human", "gpt")[turn % 2], "value": f"conversation {i} message {turn}"}
        for turn in range(2 * (1 + i % 3))]} for i in range(12)]
    path = tmp_path / "sessions.json"
    path.write_text(json.dumps(conversations))
    drawn = sample_trace(str(path), 15, 3, redraw=True, multi_turn=True)
    assert len(drawn) == 15
    assert drawn == sample_trace(str(path), 15, 3, redraw=True, multi_turn=True)
    sessions = group_sessions(drawn)
    for turns in sessions:  # contiguous, whole (the last may be cut), in turn order
        assert [r.turn_index for r in turns] == list(range(len(turns)))
    assert [r.session_id for r in drawn] == [r.session_id for turns in sessions for r in turns]
    # More than the trace holds (24 turns): another pass, under new session ids.
    more = sample_trace(str(path), 40, 3, redraw=True, multi_turn=True)
    assert len(more) == 40 and len({id(r) for r in more}) == 40
    assert all(len(turns) <= 3 for turns in group_sessions(more))


def test_long_context_max_model_len_keeps_mooncake_prompts(tmp_path: Path) -> None:
    from blockq.engine_model import get_preset
    from loadgen.simulation.workload import sample_trace

    lines = [{"timestamp": 1000 * i, "input_length": length, "output_length": 50,
              "hash_ids": list(range(-(-length // 512)))}
             for i, length in enumerate((6000, 30_000, 300, 120_000))]
    path = _write(tmp_path / "long.jsonl", "\n".join(json.dumps(line) for line in lines) + "\n")
    assert [r.prompt_tokens for r in sample_trace(str(path), 4, 1, redraw=False)] == [300]
    max_model_len = get_preset("llama3-8b-h100").config.max_model_len
    kept = sample_trace(str(path), 4, 1, redraw=False, max_model_len=max_model_len)
    assert [r.prompt_tokens for r in kept] == [6000, 30_000, 300, 120_000]
    assert kept[0].prompt[:5120] == kept[1].prompt[:5120]  # shared hash ids: shared prefix
