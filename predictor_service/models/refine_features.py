"""Inputs and features of the remaining-length refinement model (:mod:`.refine`).

Feature groups (:data:`GROUPS`; a model keeps the columns it was trained with):

- ``first_guess``: ln p10/p50/p90 of the first guess and what the dispatcher would
  simulate with today: ln of the lognormal conditional median of the remaining tokens
  given ``g`` generated, and how far ``g`` is through the belief (z-score). The trees
  then learn corrections to the current rule instead of the whole distribution;
- ``progress``: ln(1 + g) and the text's characters per generated token (code and
  non-Latin scripts pack fewer characters per token);
- ``prompt``: a few of the ``fast`` model's prompt features
  (:func:`predictor_service.features.extract_features`): prompt length, explicit length
  requests, brief/detailed/code/writing asks, genre (the rest added noise, not accuracy);
- ``structure``: counts over the whole partial text: lines, paragraphs, words, code
  fences (an odd count means a code block is open) and the characters inside it,
  markdown headers, bullets, numbered-list items (largest and last number), table rows;
- ``plan``: counts announced in the prompt or in the answer's opening ("here are 10
  tips") against what has been written: list items left and the tokens they would take
  at the pace so far; words left of a requested word count;
- ``tail``: the last :data:`TAIL_CHARS` characters: closing phrases ("in conclusion",
  "I hope this helps", "let me know if"), how the text ends (mid-sentence, a colon, a
  list item), and, with a tail model, a bag-of-words ridge score of the tail
  (:class:`~predictor_service.text_score.TextScoreModel`), as ``fast`` scores prompts.

Unknown values (no count announced) are NaN, which LightGBM treats as missing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from blockq.lengths import LengthBelief, conditional_quantile_tokens
from predictor_service.features import FEATURE_NAMES as PROMPT_FEATURE_NAMES
from predictor_service.features import extract_features
from predictor_service.text_score import TextScoreModel

TAIL_CHARS = 300
HEAD_CHARS = 300


@dataclass(frozen=True)
class RefineInput:
    """A running request: its prompt, first guess and what it has generated so far.

    ``generated_tokens`` (``g`` >= 0) is the number of output tokens produced and
    ``partial_text`` their text; first-guess quantiles are total output tokens (>= 1).
    ``max_tokens`` (optional) is the request's cap on total output tokens.
    """

    prompt: str
    prompt_tokens: int
    first_guess_p10_tokens: int
    first_guess_p50_tokens: int
    first_guess_p90_tokens: int
    generated_tokens: int
    partial_text: str
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0:
            raise ValueError(f"prompt_tokens: must be >= 0 (got {self.prompt_tokens})")
        if self.generated_tokens < 0:
            raise ValueError(f"generated_tokens: must be >= 0 (got {self.generated_tokens})")
        if min(self.first_guess_p10_tokens, self.first_guess_p50_tokens) < 1:
            raise ValueError("first_guess_p10_tokens/p50_tokens: must be >= 1")


_FIRST_GUESS = (
    "fg_log_p10", "fg_log_p50", "fg_log_p90", "fg_log_conditional_remaining", "fg_z_generated",
)  # fmt: skip
_PROGRESS = ("log_generated_tokens", "chars_per_generated_token")
_PROMPT_SOURCE = (
    "log_prompt_tokens", "requested_words", "requested_items", "requested_paragraphs",
    "requested_sentences", "very_short_request", "brief_request", "detailed_request",
    "verb_code", "verb_write", "genre_long_form", "genre_short_form", "num_code_fences",
)  # fmt: skip
_PROMPT_COLUMNS = [PROMPT_FEATURE_NAMES.index(name) for name in _PROMPT_SOURCE]
_PROMPT = tuple(f"prompt_{name}" for name in _PROMPT_SOURCE)
_STRUCTURE = (
    "log_num_lines", "num_paragraphs", "log_num_words", "num_code_fences", "in_code_block",
    "log_chars_in_open_code", "num_headers", "num_bullets", "num_numbered_items",
    "max_item_number", "last_item_number", "num_table_rows",
)  # fmt: skip
_PLAN = (
    "announced_items", "planned_items", "items_left", "log_tokens_for_items_left",
    "words_left", "log_tokens_for_words_left",
)  # fmt: skip
_TAIL = (
    "tail_conclusion", "tail_courtesy", "tail_offer", "ends_sentence", "ends_colon",
    "ends_newline", "last_line_is_item", "tail_score",
)  # fmt: skip
GROUPS: dict[str, tuple[str, ...]] = {
    "first_guess": _FIRST_GUESS,
    "progress": _PROGRESS,
    "prompt": _PROMPT,
    "structure": _STRUCTURE,
    "plan": _PLAN,
    "tail": _TAIL,
}
ALL_FEATURE_NAMES: tuple[str, ...] = tuple(name for names in GROUPS.values() for name in names)
_TEXT_NAMES = (*_STRUCTURE, *_PLAN[:1], *_TAIL[:-1])  # computed from the partial text alone

_NUMBERED_RE = re.compile(r"^[ \t]*(\d{1,3})[.)][ \t]", re.MULTILINE)
_BULLET_RE = re.compile(r"^[ \t]*[-*•+][ \t]", re.MULTILINE)
_HEADER_RE = re.compile(r"^(?:#{1,6} |\*\*[^\n]{1,80}\*\*:?$)", re.MULTILINE)
_TABLE_RE = re.compile(r"^[^\n]*\|[^\n]*\|", re.MULTILINE)
_CONCLUSION_RE = re.compile(
    r"in conclusion|in summary|to summari[sz]e|to sum up|overall,|conclusion|ultimately,|"
    r"all in all|final thoughts"
)
_COURTESY_RE = re.compile(
    r"hope (?:this|that|these|it) helps|good luck|best regards|sincerely|happy to help|"
    r"best of luck|enjoy|cheers"
)
_OFFER_RE = re.compile(
    r"let me know|feel free|if you have any|don't hesitate|do not hesitate|any (?:other|further|"
    r"more) questions|i can help|i'd be happy"
)
_ITEM_COLUMN = PROMPT_FEATURE_NAMES.index("requested_items")
_WORD_COLUMN = PROMPT_FEATURE_NAMES.index("requested_words")


def tail_text(partial_text: str) -> str:
    """The last :data:`TAIL_CHARS` characters (where a closing phrase would be)."""
    return partial_text[-TAIL_CHARS:]


def _first_guess_features(one: RefineInput) -> list[float]:
    """ln quantiles, and what the dispatcher simulates with: the belief's conditional
    median of the remaining tokens (:mod:`blockq.lengths`) and how far ``g`` is
    through it (z-score; -8 before the first token)."""
    p10 = max(1, min(one.first_guess_p10_tokens, one.first_guess_p50_tokens))
    p50 = max(1, one.first_guess_p50_tokens)
    p90 = max(p50, one.first_guess_p90_tokens, p10 + 1)
    sigma = LengthBelief(p50, p10, p90).sigma
    generated = one.generated_tokens
    mu = math.log(p50)
    z = (math.log(generated) - mu) / sigma if generated > 0 else -8.0
    conditional_total = conditional_quantile_tokens(p50, sigma, generated, 0.5)
    return [
        math.log(p10),
        mu,
        math.log(p90),
        math.log(max(conditional_total - generated, 1.0)),
        z,
    ]


def _open_code_chars(text: str, num_fences: int) -> float:
    if num_fences % 2 == 0:
        return 0.0
    return math.log1p(len(text) - text.rfind("```") - 3)


def _text_features(text: str, head_items: float) -> list[float]:
    """The partial-text-only columns (:data:`_TEXT_NAMES`), in order."""
    numbers = [int(found) for found in _NUMBERED_RE.findall(text)]
    num_fences = text.count("```")
    tail = tail_text(text).lower()
    stripped = text.rstrip(" \t")
    last_line = stripped.rsplit("\n", 1)[-1]
    last_char = stripped[-1:] if stripped else ""
    return [
        math.log1p(text.count("\n")),
        float(text.count("\n\n")),
        math.log1p(len(text.split())),
        float(num_fences),
        float(num_fences % 2),
        _open_code_chars(text, num_fences),
        float(len(_HEADER_RE.findall(text))),
        float(len(_BULLET_RE.findall(text))),
        float(len(numbers)),
        float(max(numbers, default=0)),
        float(numbers[-1] if numbers else 0),
        float(len(_TABLE_RE.findall(text))),
        head_items,
        float(_CONCLUSION_RE.search(tail) is not None),
        float(_COURTESY_RE.search(tail) is not None),
        float(_OFFER_RE.search(tail) is not None),
        float(last_char in ".!?"),
        float(last_char == ":"),
        float(last_char == "\n"),
        float(_NUMBERED_RE.match(last_line) is not None or _BULLET_RE.match(last_line) is not None),
    ]


def _plan_features(
    generated_tokens: int, prompt_row: npt.NDArray[np.float32], text_row: list[float]
) -> list[float]:
    """Counts left to write and the tokens they take at the pace so far (NaN: no count)."""
    announced = text_row[_TEXT_NAMES.index("announced_items")]
    planned = max(float(prompt_row[_ITEM_COLUMN]), announced)
    done_items = text_row[_TEXT_NAMES.index("last_item_number")]
    items_left = planned - done_items if planned > 0 else math.nan
    per_item = generated_tokens / done_items if done_items > 0 else math.nan
    words_done = math.expm1(text_row[_TEXT_NAMES.index("log_num_words")])
    requested_words = float(prompt_row[_WORD_COLUMN])
    words_left = requested_words - words_done if requested_words > 0 else math.nan
    per_word = generated_tokens / words_done if words_done > 0 else math.nan
    return [
        announced,
        planned if planned > 0 else math.nan,
        items_left,
        math.log1p(max(items_left, 0.0) * per_item),
        words_left,
        math.log1p(max(words_left, 0.0) * per_word),
    ]


class RefineFeaturizer:
    """Builds the input matrix of the columns ``names`` (a subset of ALL_FEATURE_NAMES).

    ``tail_model`` scores the tail text; required when ``names`` has ``tail_score``.
    """

    def __init__(self, names: Sequence[str], tail_model: TextScoreModel | None) -> None:
        unknown = [name for name in names if name not in ALL_FEATURE_NAMES]
        if unknown:
            raise ValueError(f"names: unknown features {unknown}")
        if "tail_score" in names and tail_model is None:
            raise ValueError("tail_model: required for the tail_score feature")
        self.names = tuple(names)
        self.tail_model = tail_model if "tail_score" in names else None
        self._columns = [ALL_FEATURE_NAMES.index(name) for name in self.names]

    def transform(
        self, inputs: Sequence[RefineInput], *, tail_scores: npt.ArrayLike | None = None
    ) -> npt.NDArray[np.float32]:
        """The ``(len(inputs), len(names))`` matrix; ``tail_scores`` (out-of-fold) override."""
        full = all_features(inputs)
        if tail_scores is None and self.tail_model is not None:
            tail_scores = self.tail_model.score([tail_text(one.partial_text) for one in inputs])
        if tail_scores is not None:
            full[:, ALL_FEATURE_NAMES.index("tail_score")] = np.asarray(tail_scores)
        return full[:, self._columns]


def all_features(inputs: Sequence[RefineInput]) -> npt.NDArray[np.float32]:
    """Every column of :data:`ALL_FEATURE_NAMES` (``tail_score`` left NaN).

    Prompt features are computed once per distinct prompt, and the answer opening's
    announced counts once per distinct opening: a request is refined many times.
    """
    matrix = np.full((len(inputs), len(ALL_FEATURE_NAMES)), np.nan, dtype=np.float32)
    prompt_rows = _unique_rows(
        [one.prompt for one in inputs], [one.prompt_tokens for one in inputs]
    )
    heads = [one.partial_text[:HEAD_CHARS].lower() for one in inputs]
    head_rows = _unique_rows(heads, [0] * len(inputs))
    for row, one in enumerate(inputs):
        text_row = _text_features(one.partial_text, float(head_rows[row][_ITEM_COLUMN]))
        values = [
            *_first_guess_features(one),
            math.log1p(one.generated_tokens),
            len(one.partial_text) / max(one.generated_tokens, 1),
            *prompt_rows[row][_PROMPT_COLUMNS],
            *text_row[: len(_STRUCTURE)],
            *_plan_features(one.generated_tokens, prompt_rows[row], text_row),
            *text_row[len(_STRUCTURE) + 1 :],
        ]
        matrix[row, : len(values)] = values
    return matrix


def _unique_rows(texts: list[str], tokens: list[int]) -> list[npt.NDArray[np.float32]]:
    """:func:`extract_features` rows per text, computed once per distinct text."""
    first_index: dict[str, int] = {}
    for index, text in enumerate(texts):
        first_index.setdefault(text, index)
    distinct = list(first_index)
    rows = extract_features(
        distinct, [tokens[first_index[t]] for t in distinct], [1] * len(distinct)
    )
    position = {text: index for index, text in enumerate(distinct)}
    return [rows[position[text]] for text in texts]
