"""A prompt that is a rendered conversation, read as its new message and its history.

A chat client resends the whole conversation each turn; the gateway renders it with its
``plain`` template (:func:`blockq.frontdoors.gateway.chat_template.render_plain`: ``user: ...\\n
assistant: ...\\nuser: <new>\\nassistant:``). What the next answer's length depends on is
mostly the new message and how long this conversation's answers have been: on later
ShareGPT turns the previous answer's length alone predicts the next with a smaller error
than a model of the whole rendered prompt. A prompt that is not such a rendering is one
new message with no history.

The split is a parse of the template, so a message that itself contains a line starting
``user: `` or ``assistant: `` is cut there: the features then describe a shorter message,
nothing fails.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

_ROLE_RE = re.compile(r"(?:^|\n)(user|assistant): ")
_GENERATION_PROMPT = "\nassistant:"

CONVERSATION_FEATURE_NAMES: tuple[str, ...] = (
    "num_earlier_answers", "log_last_answer_chars", "log_mean_answer_chars", "log_conversation_tokens",
)  # fmt: skip


@dataclass(frozen=True)
class Conversation:
    """``message``: the new user message (the whole prompt when it is no rendering);
    ``answer_chars``: the earlier assistant messages' lengths in characters, oldest first."""

    message: str
    answer_chars: tuple[int, ...] = ()

    @property
    def num_turns(self) -> int:
        return len(self.answer_chars) + 1


def split_conversation(prompt: str) -> Conversation:
    """``prompt`` as a new message and its history (see the module docstring)."""
    if not prompt.startswith("user: ") or not prompt.endswith(_GENERATION_PROMPT):
        return Conversation(prompt)
    body = prompt[: -len(_GENERATION_PROMPT)]
    parts = _ROLE_RE.split(body)
    # parts: ["", role, content, role, content, ...]
    roles, contents = parts[1::2], parts[2::2]
    if not roles or roles[-1] != "user":
        return Conversation(prompt)
    answers = tuple(len(content) for role, content in zip(roles, contents, strict=True) if role == "assistant")
    return Conversation(contents[-1], answers)


def conversation_features(conversations: Sequence[Conversation],
                          prompt_tokens: Sequence[int]) -> npt.NDArray[np.float32]:
    """An ``(n, len(CONVERSATION_FEATURE_NAMES))`` matrix: earlier answers, the last
    one's and their mean length (ln 1 + chars), and the whole prompt's tokens (ln 1 + n)."""
    matrix = np.zeros((len(conversations), len(CONVERSATION_FEATURE_NAMES)), dtype=np.float32)
    for row, (conversation, num_tokens) in enumerate(zip(conversations, prompt_tokens, strict=True)):
        answers = conversation.answer_chars
        if answers:
            matrix[row, 0] = len(answers)
            matrix[row, 1] = math.log1p(answers[-1])
            matrix[row, 2] = math.log1p(sum(answers) / len(answers))
        matrix[row, 3] = math.log1p(num_tokens)
    return matrix


def message_tokens(conversation: Conversation, prompt: str, prompt_tokens: int) -> int:
    """The new message's share of the prompt's tokens, by characters (no second count)."""
    if not prompt:
        return prompt_tokens
    return max(1, round(prompt_tokens * len(conversation.message) / len(prompt)))
