"""Fitting the ``fast`` model: initial training, conformal spread, online refit, saving.

See :mod:`predictor_service.models.fast` for the model itself. All functions are pure
apart from :func:`save_fast_model` (which writes files).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import lightgbm
import numpy as np
import numpy.typing as npt
import structlog
from sklearn.model_selection import KFold

from predictor_service.manifest import Manifest, write_manifest
from predictor_service.models.base import FeedbackSample
from predictor_service.models.fast import (
    QUANTILES,
    FastConfig,
    FastFeaturizer,
    FastLengthModel,
    model_texts,
)
from predictor_service.models.quantile_boosting import (
    conformal_log_offsets,
    quantile_lightgbm_params,
    train_quantile_booster,
)
from predictor_service.text_score import TextScoreModel, fit_text_score

logger = structlog.get_logger(__name__)


def train_fast(
    prompts: Sequence[str],
    prompt_tokens: Sequence[int],
    num_turns: Sequence[int],
    output_tokens: Sequence[int],
    config: FastConfig | None = None,
    *,
    seed: int = 0,
) -> FastLengthModel:
    """Fit a ``fast`` model on parallel sequences of training examples.

    ``output_tokens`` are the true lengths (>= 1); the target is their ln. Deterministic
    for a given ``seed`` and thread count.
    """
    settings = config or FastConfig()
    targets = np.asarray(output_tokens, dtype=np.float64)
    if len(targets) == 0 or np.any(targets < 1):
        raise ValueError("output_tokens: need at least one example, all >= 1")
    log_targets = np.log(targets)
    text_model: TextScoreModel | None = None
    out_of_fold: npt.NDArray[np.float64] | None = None
    if settings.text_score is not None:
        text_model, out_of_fold = fit_text_score(
            model_texts(settings, prompts), log_targets, settings.text_score, seed=seed
        )
    featurizer = FastFeaturizer(settings, text_model)
    matrix = featurizer.transform(prompts, prompt_tokens, num_turns, text_scores=out_of_fold)
    boosters = {
        quantile: train_quantile_booster(matrix, log_targets, quantile, settings, seed)
        for quantile in QUANTILES
    }
    return FastLengthModel(
        boosters,
        featurizer,
        int(targets.max()),
        spread_log_offsets=_spread_log_offsets(matrix, log_targets, settings, seed),
    )


def _spread_log_offsets(
    matrix: npt.NDArray[np.float32],
    log_targets: npt.NDArray[np.float64],
    settings: FastConfig,
    seed: int,
) -> tuple[float, float]:
    """Conformal p10/p90 shifts (ln tokens) over ``num_calibration_folds`` shuffled folds.

    See :func:`~predictor_service.models.quantile_boosting.conformal_log_offsets`.
    (0, 0) when calibration is off or there are fewer than 50 rows.
    """
    num_folds = settings.num_calibration_folds
    if num_folds < 2 or len(log_targets) < 50:
        return (0.0, 0.0)
    folds = KFold(num_folds, shuffle=True, random_state=seed).split(matrix)
    return conformal_log_offsets(matrix, log_targets, folds, settings, seed)


def refit_fast(
    previous: FastLengthModel,
    feedback_samples: Sequence[FeedbackSample],
    *,
    num_rounds: int = 30,
    seed: int = 0,
) -> FastLengthModel:
    """Return a new model boosted further on served requests' true lengths.

    Pure: ``previous`` is unchanged (keep it for rollback). Each quantile model keeps
    its trees and gets ``num_rounds`` more, fitted with the same quantile objective to
    the feedback's residuals (LightGBM training from ``init_model``), so feedback
    corrects the model where it is wrong and leaves it alone elsewhere. Leaves need at
    least max(5, 5 % of the samples) samples, which keeps small batches from
    overfitting. The text score is kept. The new model has a new ``version``, its
    ``parent_version`` is ``previous.version``, and its training max grows to cover the
    feedback. ``ValueError`` for empty feedback or ``num_rounds`` < 1.
    """
    if not feedback_samples:
        raise ValueError("feedback_samples: need at least one sample to refit")
    if num_rounds < 1:
        raise ValueError(f"num_rounds: must be >= 1 (got {num_rounds})")
    inputs = [sample.input for sample in feedback_samples]
    truths = np.array([sample.true_output_tokens for sample in feedback_samples], np.float64)
    matrix = previous.featurizer.transform(
        [one.prompt for one in inputs],
        [one.prompt_tokens for one in inputs],
        [one.num_turns for one in inputs],
    )
    min_data_in_leaf = max(5, len(truths) // 20)
    boosters = {}
    for quantile in QUANTILES:
        params = quantile_lightgbm_params(previous.config, quantile, seed)
        params.update(min_data_in_leaf=min_data_in_leaf, min_data_in_bin=1)
        boosters[quantile] = lightgbm.train(
            params,
            lightgbm.Dataset(matrix, np.log(truths)),
            num_boost_round=num_rounds,
            init_model=previous.boosters[quantile],
        )
    model = FastLengthModel(
        boosters,
        previous.featurizer,
        max(previous.training_max_tokens, int(truths.max())),
        spread_log_offsets=previous.spread_log_offsets,
        parent_version=previous.version,
    )
    logger.info(
        "fast_model_refitted",
        parent_version=previous.version,
        version=model.version,
        num_samples=len(feedback_samples),
    )
    return model


def save_fast_model(
    model: FastLengthModel, model_dir: str | os.PathLike[str], base_manifest: Manifest
) -> Manifest:
    """Write ``model`` and a manifest derived from ``base_manifest`` (version, bounds)."""
    model.save(model_dir)
    manifest = base_manifest.with_updates(
        backend="fast",
        version=model.version,
        training_max_tokens=model.training_max_tokens,
        extra={**base_manifest.extra, **model.manifest_extra()},
    )
    write_manifest(model_dir, manifest)
    return manifest
