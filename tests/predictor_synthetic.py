"""Synthetic ShareGPT files whose answer lengths follow the prompt text.

For the predictor tests that train and evaluate without real data: each conversation's
prompt states (or implies) how long the answer is — "in N words", "list K ideas",
"in one sentence", "briefly", "a detailed essay" — and the answer has about that
length, with some noise. A model that reads the prompt can predict the length well;
a constant cannot.
"""

from __future__ import annotations

import gzip
import json
import os
import random
from pathlib import Path
from typing import Any

_TOPICS = (
    "the ocean", "machine learning", "coffee", "ancient rome", "gardening", "chess",
    "volcanoes", "jazz music", "electric cars", "the moon", "bread baking", "honey bees",
)  # fmt: skip
_FILLER = (
    "the", "a", "system", "water", "history", "people", "often", "make", "light", "simple",
    "because", "every", "small", "large", "change", "time", "world", "idea", "good", "over",
)  # fmt: skip


def _words(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_FILLER) for _ in range(max(1, num_words)))


def _one_pair(rng: random.Random) -> tuple[str, str]:
    """A (prompt, answer) whose answer length the prompt determines."""
    topic = rng.choice(_TOPICS)
    kind = rng.randrange(5)
    if kind == 0:
        num_words = rng.choice((20, 60, 120, 250))
        prompt = f"Write a short text about {topic} in {num_words} words."
        answer = _words(rng, int(num_words * rng.uniform(0.9, 1.1)))
    elif kind == 1:
        num_items = rng.choice((3, 5, 10, 20))
        prompt = f"List {num_items} ideas related to {topic}."
        answer = "\n".join(
            f"{index + 1}. {_words(rng, rng.randint(6, 10))}" for index in range(num_items)
        )
    elif kind == 2:
        prompt = f"Explain {topic} in one sentence."
        answer = _words(rng, rng.randint(10, 18)) + "."
    elif kind == 3:
        prompt = f"Briefly, what is {topic}?"
        answer = _words(rng, rng.randint(25, 40))
    else:
        prompt = f"Write a detailed essay about {topic}, covering its history and future."
        answer = "\n\n".join(_words(rng, rng.randint(70, 90)) for _ in range(5))
    # A reference tag keeps prompts distinct (training deduplicates prompts).
    return f"{prompt} [ref {rng.randrange(10**6)}]", answer


def make_conversations(num_conversations: int, seed: int = 0) -> list[dict[str, Any]]:
    """ShareGPT records; about one in ten starts with a gpt turn (readers skip those)."""
    rng = random.Random(seed)
    records = []
    for index in range(num_conversations):
        prompt, answer = _one_pair(rng)
        turns = [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]
        if rng.random() < 0.3:
            follow_prompt, follow_answer = _one_pair(rng)
            turns += [
                {"from": "human", "value": follow_prompt},
                {"from": "gpt", "value": follow_answer},
            ]
        if rng.random() < 0.1:
            turns.insert(0, {"from": "gpt", "value": "Hello! How can I help?"})
        records.append({"id": f"synthetic-{seed}-{index}", "conversations": turns})
    return records


def write_sharegpt(path: str | os.PathLike[str], records: list[dict[str, Any]]) -> Path:
    """Write records as a ShareGPT JSON array; gzip when the name ends in ``.gz``."""
    target = Path(path)
    payload = json.dumps(records, ensure_ascii=False).encode("utf-8")
    if target.suffix == ".gz":
        with gzip.open(target, "wb") as stream:
            stream.write(payload)
    else:
        target.write_bytes(payload)
    return target


def make_synthetic_sharegpt(
    path: str | os.PathLike[str], num_conversations: int = 400, seed: int = 0
) -> Path:
    """Write a synthetic ShareGPT file (see the module docstring); returns its path."""
    return write_sharegpt(path, make_conversations(num_conversations, seed))
