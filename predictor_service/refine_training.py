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

from blockq.tokenizer import MISTRAL_V1_NAME, AnswerTokenizer
from predictor_service.dataset import file_sha256, iter_distinct_pairs, split_examples
from predictor_service.manifest import read_manifest
from predictor_service.models.base import LengthPredictor, PredictionInput
from predictor_service.models.fast import FastConfig, FastLengthModel
from predictor_service.models.fast_fit import train_fast
from predictor_service.models.refine import RefineInput, RefineModel
from predictor_service.models.refine_features import all_features, tail_text
from predictor_service.models.refine_fit import RefineFitConfig, train_refine
from predictor_service.text_score import TextScoreConfig
from predictor_service.training import predict_in_batches

logger = structlog.get_logger(__name__)

NUM_RANDOM_CUTS = 2
_FIRST_GUESS_BATCH_SIZE = 256


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


# A small first-guess model for out-of-fold guesses: seconds per fold on one thread.
OUT_OF_FOLD_FAST_CONFIG = FastConfig(
    num_rounds=150,
    learning_rate=0.06,
    spread_num_rounds=80,
    num_calibration_folds=3,
    num_threads=1,
    text_score=TextScoreConfig(num_folds=3),
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


def training_cuts(
    output_tokens: int, rng: np.random.Generator, every_tokens: int = 64
) -> list[int]:
    """g = 0, every_tokens, 2·every_tokens, ... below ``output_tokens``, plus
    :data:`NUM_RANDOM_CUTS` uniform in [1, output_tokens) (sorted, distinct)."""
    cuts = set(range(0, output_tokens, every_tokens))
    if output_tokens > 1:
        cuts.update(int(cut) for cut in rng.integers(1, output_tokens, size=NUM_RANDOM_CUTS))
    return sorted(cuts)


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
    # Imported here: refine_eval imports this module's data helpers.
    from predictor_service.refine_eval import evaluate_stages, refinements_per_s, stage_constants

    constants = stage_constants([example.output_tokens for example in train])
    guess = first_guess_of(first_guess_model, val)
    stages, stage_inputs = evaluate_stages(model, val, guess, tokenizer, constants)
    return {
        "stage_constant_remaining_tokens": constants,
        "val_stages": stages,
        "refinements_per_s": refinements_per_s(model, stage_inputs),
    }
