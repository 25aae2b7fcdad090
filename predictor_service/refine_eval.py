"""Evaluation of the remaining-length refinement model, stage by stage.

Validation answers are cut at 0 %, 25 %, 50 % and 75 % of their true length ``L``
(``g = floor(f·L)``; answers with ``g`` = 0 are skipped for ``f`` > 0). Per stage:
the refinement p50's MAE of the remaining tokens; that of the conditional median the
dispatcher simulates with today (``LengthBelief.remaining_target(g) - g`` from the
deployed first guess); that of a constant (the training answers' median remaining at
the same fraction); Kendall's tau and p10-p90 coverage of the refinement.

Caveat: at a fixed fraction ``f`` the truth is ``g·(1 - f)/f``, so a rule that knew
``f`` would be exact; read the stages together, not one alone.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from blockq.lengths import LengthBelief
from blockq.prediction_accuracy import kendall_tau
from blockq.text.tokenizer import AnswerTokenizer
from predictor_service.dataset import file_sha256, split_examples
from predictor_service.models.base import LengthPrediction
from predictor_service.models.refine import RefineInput, RefineModel
from predictor_service.refine_examples import (
    AnswerExample,
    FirstGuess,
    first_guess_of,
    load_answer_examples,
    load_first_guess_model,
    refine_inputs,
)

STAGE_FRACTIONS = (0.0, 0.25, 0.5, 0.75)
THROUGHPUT_BATCH_SIZE = 64


def stage_constants(train_output_tokens: Sequence[int]) -> dict[str, float]:
    """Per stage fraction: the median remaining tokens of the training answers there."""
    lengths = np.asarray(train_output_tokens, dtype=np.int64)
    constants = {}
    for fraction in STAGE_FRACTIONS:
        cuts = np.floor(fraction * lengths).astype(np.int64)
        kept = (cuts > 0) | (fraction == 0.0)
        remaining = (lengths - cuts)[kept]
        constants[str(fraction)] = float(np.median(remaining)) if len(remaining) else 1.0
    return constants


def _stage_inputs(
    examples: Sequence[AnswerExample],
    guess: FirstGuess,
    fraction: float,
    tokenizer: AnswerTokenizer,
) -> tuple[list[RefineInput], npt.NDArray[np.float64]]:
    """Each example cut at ``floor(fraction · L)`` and its true remaining tokens."""
    inputs: list[RefineInput] = []
    remaining: list[int] = []
    for index, example in enumerate(examples):
        cut = math.floor(fraction * example.output_tokens)
        if cut == 0 and fraction > 0:
            continue
        inputs.extend(refine_inputs(example, guess.row(index), [cut], tokenizer))
        remaining.append(example.output_tokens - cut)
    return inputs, np.array(remaining, dtype=np.float64)


def _mean_abs_error(predicted: npt.ArrayLike, truth: npt.NDArray[np.float64]) -> float:
    return float(np.abs(np.asarray(predicted) - truth).mean()) if len(truth) else math.nan


def _score_stage(
    fraction: float,
    predictions: Sequence[LengthPrediction],
    conditional: npt.NDArray[np.float64],
    truth: npt.NDArray[np.float64],
    constant_tokens: float,
) -> dict[str, Any]:
    """One row of the stage table (lengths are remaining tokens)."""
    p50 = np.array([p.predicted_output_tokens for p in predictions], dtype=np.float64)
    low = np.array([p.p10_tokens for p in predictions], dtype=np.float64)
    high = np.array([p.p90_tokens for p in predictions], dtype=np.float64)
    mae = _mean_abs_error(p50, truth)
    conditional_mae = _mean_abs_error(conditional, truth)
    covered = (truth >= low) & (truth <= high)
    return {
        "fraction": fraction,
        "count": len(truth),
        "mae": mae,
        "first_guess_conditional_mae": conditional_mae,
        "mae_ratio": mae / conditional_mae if conditional_mae > 0 else math.nan,
        "constant_mae": _mean_abs_error(np.full(len(truth), constant_tokens), truth),
        "kendall_tau": kendall_tau(p50, truth),
        "p10_p90_coverage": float(covered.mean()) if len(truth) else math.nan,
    }


def conditional_median_remaining(inputs: Sequence[RefineInput]) -> npt.NDArray[np.float64]:
    """What the dispatcher simulates with today: the first guess's lognormal conditional
    median given ``g`` (:meth:`blockq.lengths.LengthBelief.remaining_target`) - g."""
    return np.array(
        [
            LengthBelief(
                one.first_guess_p50_tokens, one.first_guess_p10_tokens, one.first_guess_p90_tokens
            ).remaining_target(one.generated_tokens, "median")
            - one.generated_tokens
            for one in inputs
        ],
        dtype=np.float64,
    )


def evaluate_stages(
    model: RefineModel,
    examples: Sequence[AnswerExample],
    guess: FirstGuess,
    tokenizer: AnswerTokenizer,
    constants: dict[str, float],
) -> tuple[list[dict[str, Any]], list[RefineInput]]:
    """The per-stage table of the module docstring, and the 50 % stage's inputs."""
    stages, kept_inputs = [], []
    for fraction in STAGE_FRACTIONS:
        inputs, truth = _stage_inputs(examples, guess, fraction, tokenizer)
        if fraction == 0.5:
            kept_inputs = inputs
        stages.append(
            _score_stage(
                fraction,
                model.predict(inputs),
                conditional_median_remaining(inputs),
                truth,
                constants[str(fraction)],
            )
        )
    return stages, kept_inputs


def refinements_per_s(model: RefineModel, inputs: Sequence[RefineInput]) -> float:
    """Refinements per second in batches of 64 (features + trees; the model's threads)."""
    if not inputs:
        return math.nan
    started_at_s = time.perf_counter()
    for start in range(0, len(inputs), THROUGHPUT_BATCH_SIZE):
        model.predict(inputs[start : start + THROUGHPUT_BATCH_SIZE])
    elapsed_s = time.perf_counter() - started_at_s
    return len(inputs) / elapsed_s if elapsed_s > 0 else math.nan


def evaluate_refine_file(
    model_dir: str | os.PathLike[str],
    data_path: str | os.PathLike[str],
    first_guess_dir: str | os.PathLike[str],
    *,
    max_examples: int | None = None,
) -> dict[str, Any]:
    """Score the refinement model in ``model_dir`` on ``data_path``: its validation split
    when the file is the one it trained on (same sha256), every example otherwise."""
    model = RefineModel.load(model_dir)
    data_sha256 = file_sha256(data_path)
    first_guess_model, val_fraction = load_first_guess_model(first_guess_dir, data_sha256)
    figures = model.training_figures
    tokenizer = AnswerTokenizer()
    examples = load_answer_examples(data_path, tokenizer, max_examples)
    train, val = split_examples(examples, figures.get("val_fraction", val_fraction))
    same_data = figures.get("data_sha256") == data_sha256
    scored = val if same_data else examples
    constants = figures.get("stage_constant_remaining_tokens") or stage_constants(
        [e.output_tokens for e in train]
    )
    guess = first_guess_of(first_guess_model, scored)
    stages, stage_inputs = evaluate_stages(model, scored, guess, tokenizer, constants)
    return {
        "stages": stages,
        "refinements_per_s": refinements_per_s(model, stage_inputs),
        "version": model.version,
        "split": "val" if same_data else "all",
        "first_guess_version": first_guess_model.version,
    }
