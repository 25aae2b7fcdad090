"""The examples the remaining-length refinement trains and evaluates on: ShareGPT answers
with their token ids (so that an answer can be cut after its first ``g`` tokens), and the
first guess (p10/p50/p90 from the prompt alone) each row starts from. Shared by
:mod:`predictor_service.refine_training` and :mod:`predictor_service.refine_eval`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import structlog

from blockq.text.tokenizer import MISTRAL_V1_NAME, AnswerTokenizer
from predictor_service.dataset import iter_distinct_pairs
from predictor_service.manifest import read_manifest
from predictor_service.models.base import LengthPredictor, PredictionInput
from predictor_service.models.fast import FastConfig, FastLengthModel
from predictor_service.models.fast_fit import train_fast
from predictor_service.models.refine import RefineInput
from predictor_service.text_score import TextScoreConfig
from predictor_service.training import predict_in_batches

logger = structlog.get_logger(__name__)

_FIRST_GUESS_BATCH_SIZE = 256
# A small first-guess model for out-of-fold guesses: seconds per fold on one thread.
OUT_OF_FOLD_FAST_CONFIG = FastConfig(
    num_rounds=150,
    learning_rate=0.06,
    spread_num_rounds=80,
    num_calibration_folds=3,
    num_threads=1,
    text_score=TextScoreConfig(num_folds=3),
)


@dataclass(frozen=True)
class AnswerExample:
    """A first-turn prompt and its answer's token ids (``output_tokens`` >= 1)."""

    conversation_id: str
    prompt: str
    prompt_tokens: int
    answer_ids: tuple[int, ...]

    @property
    def output_tokens(self) -> int:
        """The answer's length as :func:`~predictor_service.dataset.load_examples` counts it."""
        return max(1, len(self.answer_ids))

    def to_input(self) -> PredictionInput:
        """The first guess's input (unbounded ``max_tokens``, as ``predictor eval``)."""
        return PredictionInput(self.prompt, self.prompt_tokens, max_tokens=1_000_000_000)


def load_answer_examples(
    data_path: str | os.PathLike[str], tokenizer: AnswerTokenizer, max_examples: int | None = None
) -> list[AnswerExample]:
    """First-turn examples of a ShareGPT file, read and deduplicated as ``load_examples``."""
    pairs = [(conversation_id, prompt, answer) for conversation_id, prompt, answer, _ in
             iter_distinct_pairs(data_path, first_turn_only=True, max_examples=max_examples)]
    prompt_ids = tokenizer.encode([prompt for _, prompt, _ in pairs])
    answer_ids = tokenizer.encode([answer for _, _, answer in pairs])
    examples = [
        AnswerExample(conversation_id, prompt, len(prompt_row), tuple(answer_row))
        for (conversation_id, prompt, _), prompt_row, answer_row in zip(
            pairs, prompt_ids, answer_ids, strict=True
        )
    ]
    logger.info("refine_examples_loaded", path=str(data_path), num_examples=len(examples))
    return examples


@dataclass(frozen=True)
class FirstGuess:
    """First-guess quantiles (total output tokens), one row per example."""

    p10_tokens: npt.NDArray[np.int64]
    p50_tokens: npt.NDArray[np.int64]
    p90_tokens: npt.NDArray[np.int64]

    def row(self, index: int) -> tuple[int, int, int]:
        """(p10, p50, p90) of one example."""
        return (
            int(self.p10_tokens[index]),
            int(self.p50_tokens[index]),
            int(self.p90_tokens[index]),
        )


def first_guess_of(predictor: LengthPredictor, examples: Sequence[AnswerExample]) -> FirstGuess:
    """The predictor's quantiles for ``examples``."""
    predictions, _ = predict_in_batches(predictor, examples, _FIRST_GUESS_BATCH_SIZE)
    return FirstGuess(
        np.array([p.p10_tokens for p in predictions], dtype=np.int64),
        np.array([p.predicted_output_tokens for p in predictions], dtype=np.int64),
        np.array([p.p90_tokens for p in predictions], dtype=np.int64),
    )


def out_of_fold_first_guess(
    examples: Sequence[AnswerExample], num_folds: int = 3, seed: int = 0
) -> FirstGuess:
    """Each example's first guess from a ``fast`` model fitted on the other folds."""
    from sklearn.model_selection import KFold

    rows = np.zeros((3, len(examples)), dtype=np.int64)
    for train_index, test_index in KFold(num_folds, shuffle=True, random_state=seed).split(
        np.zeros(len(examples))
    ):
        fold = [examples[i] for i in train_index]
        model = train_fast(
            [e.prompt for e in fold], [e.prompt_tokens for e in fold], [1] * len(fold),
            [e.output_tokens for e in fold], OUT_OF_FOLD_FAST_CONFIG, seed=seed,
        )  # fmt: skip
        guess = first_guess_of(model, [examples[i] for i in test_index])
        rows[:, test_index] = [guess.p10_tokens, guess.p50_tokens, guess.p90_tokens]
    return FirstGuess(rows[0], rows[1], rows[2])


def refine_inputs(
    example: AnswerExample,
    first_guess: tuple[int, int, int],
    cuts: Sequence[int],
    tokenizer: AnswerTokenizer,
) -> list[RefineInput]:
    """The example's answer cut after each of ``cuts`` tokens."""
    p10, p50, p90 = first_guess
    return [
        RefineInput(
            prompt=example.prompt,
            prompt_tokens=example.prompt_tokens,
            first_guess_p10_tokens=p10,
            first_guess_p50_tokens=p50,
            first_guess_p90_tokens=p90,
            generated_tokens=cut,
            partial_text=tokenizer.prefix_text(example.answer_ids, cut),
        )
        for cut in cuts
    ]


def load_first_guess_model(
    model_dir: str | os.PathLike[str], data_sha256: str
) -> tuple[FastLengthModel, float]:
    """The deployed ``fast`` model and its validation fraction.

    Warns when it was trained on another file: its guesses for this file's validation
    split may then be in-sample, which flatters the first-guess baseline.
    """
    manifest = read_manifest(model_dir)
    if manifest.data_sha256 != data_sha256:
        logger.warning(
            "first_guess_trained_on_other_data",
            model_dir=str(model_dir), model_data_sha256=manifest.data_sha256,
        )  # fmt: skip
    if manifest.tokenizer_name != MISTRAL_V1_NAME:
        logger.warning("first_guess_tokenizer_differs", tokenizer=manifest.tokenizer_name)
    return FastLengthModel.load(model_dir), manifest.val_fraction
