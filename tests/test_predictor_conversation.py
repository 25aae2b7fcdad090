"""Later turns of a conversation: the prompt read as its new message and its history, and
the ``fast`` model learning from the history's answer lengths."""

from __future__ import annotations

import random

import numpy as np

from blockq.text.sharegpt_reader import SharegptPair, render_turn_prompt
from predictor_service.conversation import (
    CONVERSATION_FEATURE_NAMES,
    conversation_features,
    split_conversation,
)
from predictor_service.models.base import PredictionInput
from predictor_service.models.fast import FastConfig
from predictor_service.models.fast_fit import train_fast

WORDS = ("tea", "river", "code", "list", "plan", "sky", "graph", "note", "table", "bridge")


def test_a_rendered_conversation_splits_into_its_new_message_and_answers() -> None:
    pair = SharegptPair("c", "And in Rust?", "...", 1, history=("How do I sort a list?", "Use sorted(x)."))
    conversation = split_conversation(render_turn_prompt(pair))
    assert conversation.message == "And in Rust?"
    assert conversation.answer_chars == (len("Use sorted(x)."),) and conversation.num_turns == 2
    first = split_conversation(render_turn_prompt(SharegptPair("c", "Hi there", "...", 0)))
    assert first.message == "Hi there" and first.answer_chars == ()
    # Not a rendering: the whole prompt is the message.
    assert split_conversation("Write a poem.\nuser: x").message == "Write a poem.\nuser: x"
    matrix = conversation_features([conversation, first], [40, 5])
    assert matrix.shape == (2, len(CONVERSATION_FEATURE_NAMES))
    assert matrix[0, 0] == 1 and matrix[0, 1] == np.float32(np.log1p(14)) and matrix[1, 0] == 0


def _conversations(num: int, seed: int) -> list[tuple[str, int, int]]:
    """(prompt, prompt tokens, output tokens) of two-turn conversations whose second answer
    is about as long as the first (a style the conversation keeps); the text says nothing,
    and the first question (a pasted text of any length) hides the answer in the total."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        first_length = int(rng.lognormvariate(5.0, 0.8)) + 1
        question = " ".join(rng.choice(WORDS) for _ in range(int(rng.lognormvariate(5.0, 1.0)) + 3))
        answer = " ".join(rng.choice(WORDS) for _ in range(first_length))
        follow = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        prompt = render_turn_prompt(SharegptPair("c", follow, "", 1, history=(question, answer)))
        rows.append((prompt, len(prompt.split()), max(1, int(first_length * rng.uniform(0.8, 1.25)))))
    return rows


def test_the_fast_model_reads_the_history_when_told_to() -> None:
    train, held_out = _conversations(600, seed=1), _conversations(200, seed=2)
    truth = np.array([row[2] for row in held_out])
    errors = {}
    for enabled in (False, True):
        config = FastConfig(num_rounds=80, learning_rate=0.1, min_data_in_leaf=5, num_threads=1,
                            conversation_features=enabled)
        model = train_fast([r[0] for r in train], [r[1] for r in train], [2] * len(train),
                           [r[2] for r in train], config)
        predicted = np.array([p.predicted_output_tokens for p in model.predict(
            [PredictionInput(prompt=r[0], prompt_tokens=r[1], max_tokens=100_000, num_turns=2) for r in held_out])])
        errors[enabled] = float(np.abs(predicted - truth).mean())
        assert ("log_last_answer_chars" in model.manifest_extra()["feature_names"]) is enabled
    # The whole prompt's length carries the first answer's too, mixed with the question's.
    assert errors[True] < 0.6 * errors[False]
