"""Train and evaluate the remaining-length refinement model on ShareGPT files.

Examples are the first human->gpt turns of a ShareGPT file with the same reading,
prompt deduplication and hash split as :func:`predictor_service.dataset.load_examples`
/ :func:`~predictor_service.dataset.split_examples`, but keep the answer's token ids
(project tokenizer, ``mistral-v1``) so that an answer can be cut after its first ``g``
tokens and decoded: the partial text a worker would report.

Training rows: every training answer at ``g`` = 0, 64, 128, ... (< its length; live
workers report every 64 tokens) plus :data:`NUM_RANDOM_CUTS` cuts at uniformly random
``g`` in [1, L) (without them no row has 0 < g < 64, where every short answer is cut);
target ``remaining = L - g``, every row weighted the same. Each row's first guess
comes from a small ``fast`` model that did not train on that answer (out-of-fold), so
the refinement never learns to trust an overfit first guess.

Evaluation: :mod:`predictor_service.refine_eval`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from blockq.text.tokenizer import AnswerTokenizer
from predictor_service.dataset import file_sha256, split_examples
from predictor_service.models.base import LengthPredictor
from predictor_service.models.refine import RefineModel
from predictor_service.models.refine_features import all_features, tail_text
from predictor_service.models.refine_fit import RefineFitConfig, train_refine
from predictor_service.refine_eval import evaluate_stages, refinements_per_s, stage_constants
from predictor_service.refine_examples import (
    AnswerExample,
    FirstGuess,
    first_guess_of,
    load_answer_examples,
    load_first_guess_model,
    out_of_fold_first_guess,
    refine_inputs,
)

logger = structlog.get_logger(__name__)

NUM_RANDOM_CUTS = 2














def training_cuts(
    output_tokens: int, rng: np.random.Generator, every_tokens: int = 64
) -> list[int]:
    """g = 0, every_tokens, 2·every_tokens, ... below ``output_tokens``, plus
    :data:`NUM_RANDOM_CUTS` uniform in [1, output_tokens) (sorted, distinct)."""
    cuts = set(range(0, output_tokens, every_tokens))
    if output_tokens > 1:
        cuts.update(int(cut) for cut in rng.integers(1, output_tokens, size=NUM_RANDOM_CUTS))
    return sorted(cuts)




@dataclass
class TrainingRows:
    """Featurised training rows (every column) and what fitting needs besides."""

    full_matrix: npt.NDArray[np.float32]
    tails: list[str]
    remaining_tokens: npt.NDArray[np.float64]
    groups: npt.NDArray[np.int64]


def build_training_rows(
    examples: Sequence[AnswerExample],
    first_guess: FirstGuess,
    tokenizer: AnswerTokenizer,
    *,
    every_tokens: int = 64,
    seed: int = 0,
) -> TrainingRows:
    """Cut every answer (:func:`training_cuts`) and featurise the cuts.

    Rows are not reweighted: rows of one ``g`` are then the answers longer than ``g``,
    the distribution of a live request at ``g`` (weighting answers equally instead
    fits the evaluation's fixed fractions better and live requests worse).
    """
    rng = np.random.default_rng(seed)
    blocks, tails, remaining, groups = [], [], [], []
    for index, example in enumerate(examples):
        cuts = training_cuts(example.output_tokens, rng, every_tokens)
        inputs = refine_inputs(example, first_guess.row(index), cuts, tokenizer)
        blocks.append(all_features(inputs))
        tails.extend(tail_text(one.partial_text) for one in inputs)
        remaining.extend(example.output_tokens - cut for cut in cuts)
        groups.extend([index] * len(cuts))
    return TrainingRows(
        np.vstack(blocks), tails, np.array(remaining, np.float64), np.array(groups, np.int64)
    )


@dataclass(frozen=True)
class RefineTrainOptions:
    """Training settings; ``max_examples`` caps the file read."""

    num_first_guess_folds: int = 3
    every_tokens: int = 64
    max_examples: int | None = None
    fit: RefineFitConfig = field(default_factory=RefineFitConfig)




def train_refine_file(
    data_path: str | os.PathLike[str],
    first_guess_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    options: RefineTrainOptions | None = None,
) -> dict[str, Any]:
    """Train on the training split of ``data_path`` (the first-guess model's split), score
    the validation split with the deployed first guess in ``first_guess_dir``, write the
    model into ``out_dir``; return its manifest."""
    settings = options or RefineTrainOptions()
    data_sha256 = file_sha256(data_path)
    first_guess_model, val_fraction = load_first_guess_model(first_guess_dir, data_sha256)
    tokenizer = AnswerTokenizer()
    train, val = split_examples(
        load_answer_examples(data_path, tokenizer, settings.max_examples), val_fraction
    )
    if len(train) < 2 * settings.num_first_guess_folds:
        raise ValueError(f"{data_path}: too few training examples ({len(train)})")
    started_at_s = time.perf_counter()
    guess = out_of_fold_first_guess(train, settings.num_first_guess_folds, seed)
    rows = build_training_rows(
        train, guess, tokenizer, every_tokens=settings.every_tokens, seed=seed
    )
    model = train_refine(
        rows.full_matrix, rows.tails, rows.remaining_tokens, rows.groups, settings.fit, seed=seed
    )
    figures = {
        "data_sha256": data_sha256,
        "val_fraction": val_fraction,
        "tokenizer": tokenizer.name,
        "first_guess": "out_of_fold",
        "first_guess_version": first_guess_model.version,
        "seed": seed,
        "num_train_examples": len(train),
        "num_train_rows": len(rows.remaining_tokens),
        "num_val_examples": len(val),
        "training_seconds": round(time.perf_counter() - started_at_s, 1),
        "every_tokens": settings.every_tokens,
        "num_random_cuts": NUM_RANDOM_CUTS,
        "fit_config": {k: v for k, v in asdict(settings.fit).items() if k != "feature_names"},
        **_validation_figures(model, train, val, first_guess_model, tokenizer),
    }
    model = model.with_training_figures(figures)
    model.save(out_dir)
    logger.info(
        "refine_model_trained",
        version=model.version,
        out_dir=str(out_dir),
        training_seconds=figures["training_seconds"],
    )
    return model.manifest()


def _validation_figures(
    model: RefineModel,
    train: Sequence[AnswerExample],
    val: Sequence[AnswerExample],
    first_guess_model: LengthPredictor,
    tokenizer: AnswerTokenizer,
) -> dict[str, Any]:
    """The validation stage table and throughput stored in the manifest."""

    constants = stage_constants([example.output_tokens for example in train])
    guess = first_guess_of(first_guess_model, val)
    stages, stage_inputs = evaluate_stages(model, val, guess, tokenizer, constants)
    return {
        "stage_constant_remaining_tokens": constants,
        "val_stages": stages,
        "refinements_per_s": refinements_per_s(model, stage_inputs),
    }
