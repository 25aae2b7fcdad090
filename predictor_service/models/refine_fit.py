"""Fitting the refinement model (:mod:`predictor_service.models.refine`). Pure functions.

Training rows are cuts of training answers: several rows share one answer, so every
out-of-fold step (tail score, conformal offsets) folds by answer (``groups``): a row's
held-out estimate never comes from a model that saw another cut of the same answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog
from sklearn.model_selection import GroupKFold

from predictor_service.models.quantile_boosting import (
    conformal_log_offsets,
    train_quantile_booster,
)
from predictor_service.models.refine import QUANTILES, RefineModel
from predictor_service.models.refine_features import ALL_FEATURE_NAMES, RefineFeaturizer
from predictor_service.text_score import TextScoreConfig, TextScoreModel, fit_tfidf_ridge

logger = structlog.get_logger(__name__)


@dataclass(frozen=True)
class RefineFitConfig:
    """LightGBM settings of the refinement model (p50: ``num_rounds``; p10/p90: spread).

    ``feature_names`` are the columns used (default: all). ``tail_score`` None drops the
    tail bag-of-words score. ``num_threads`` 0 lets LightGBM use every core. Training
    reads these through :mod:`predictor_service.models.quantile_boosting`.
    """

    num_rounds: int = 500
    learning_rate: float = 0.05
    num_leaves: int = 31
    min_data_in_leaf: int = 100
    spread_num_rounds: int = 200
    spread_learning_rate: float = 0.08
    num_calibration_folds: int = 3
    feature_fraction: float = 0.8
    bagging_fraction: float = 0.8
    num_threads: int = 1
    feature_names: tuple[str, ...] = ALL_FEATURE_NAMES
    tail_score: TextScoreConfig | None = field(
        default_factory=lambda: TextScoreConfig(max_terms=30_000, num_folds=3)
    )

    def min_data_in_leaf_for(self, quantile: float) -> int:
        """Minimum rows per leaf of the model of one ``quantile`` (the same for all three)."""
        return self.min_data_in_leaf


def _group_folds(num_folds: int, groups: npt.NDArray[np.int64]) -> list[tuple[Any, Any]]:
    return list(GroupKFold(num_folds).split(np.zeros(len(groups)), groups=groups))


def out_of_fold_tail_scores(
    tails: Sequence[str],
    log_targets: npt.NDArray[np.float64],
    groups: npt.NDArray[np.int64],
    config: TextScoreConfig,
) -> tuple[TextScoreModel, npt.NDArray[np.float64]]:
    """The tail score fitted on all rows and, per row, one from the other answers' folds."""
    full_model = fit_tfidf_ridge(tails, log_targets, config)
    if len(np.unique(groups)) < config.num_folds:
        return full_model, full_model.score(list(tails))
    scores = np.empty(len(tails), dtype=np.float64)
    for train_index, test_index in _group_folds(config.num_folds, groups):
        fold_model = fit_tfidf_ridge(
            [tails[i] for i in train_index], log_targets[train_index], config
        )
        scores[test_index] = fold_model.score([tails[i] for i in test_index])
    return full_model, scores


def spread_log_offsets(
    matrix: npt.NDArray[np.float32],
    log_targets: npt.NDArray[np.float64],
    groups: npt.NDArray[np.int64],
    config: RefineFitConfig,
    seed: int,
) -> tuple[float, float]:
    """Conformal p10/p90 shifts (ln tokens) over ``num_calibration_folds`` answer folds.

    See :func:`~predictor_service.models.quantile_boosting.conformal_log_offsets`.
    (0, 0) when calibration is off or there are fewer than 10 answers per fold.
    """
    num_folds = config.num_calibration_folds
    if num_folds < 2 or len(np.unique(groups)) < 10 * num_folds:
        return (0.0, 0.0)
    folds = _group_folds(num_folds, groups)
    return conformal_log_offsets(matrix, log_targets, folds, config, seed)


def train_refine(
    full_matrix: npt.NDArray[np.float32],
    tails: Sequence[str],
    remaining_tokens: npt.ArrayLike,
    groups: npt.ArrayLike,
    config: RefineFitConfig | None = None,
    *,
    seed: int = 0,
) -> RefineModel:
    """Fit a :class:`RefineModel` on training rows.

    ``full_matrix`` has every column of :data:`ALL_FEATURE_NAMES`
    (:func:`~predictor_service.models.refine_features.all_features`); ``tails`` the tail
    texts of the rows; ``remaining_tokens`` (>= 1) the targets; ``groups`` one id per
    answer. Deterministic for a given ``seed`` and thread count.
    """
    settings = config or RefineFitConfig()
    targets = np.asarray(remaining_tokens, dtype=np.float64)
    if len(targets) == 0 or np.any(targets < 1):
        raise ValueError("remaining_tokens: need at least one row, all >= 1")
    log_targets = np.log(targets)
    group_ids = np.asarray(groups, dtype=np.int64)
    names = tuple(n for n in settings.feature_names if settings.tail_score or n != "tail_score")
    matrix = np.array(full_matrix, dtype=np.float32)
    tail_model = None
    if "tail_score" in names and settings.tail_score is not None:
        tail_model, scores = out_of_fold_tail_scores(
            tails, log_targets, group_ids, settings.tail_score
        )
        matrix[:, ALL_FEATURE_NAMES.index("tail_score")] = scores
    featurizer = RefineFeaturizer(names, tail_model)
    matrix = matrix[:, [ALL_FEATURE_NAMES.index(name) for name in names]]
    boosters = {
        quantile: train_quantile_booster(matrix, log_targets, quantile, settings, seed)
        for quantile in QUANTILES
    }
    offsets = spread_log_offsets(matrix, log_targets, group_ids, settings, seed)
    logger.info("refine_model_fitted", num_rows=len(targets), num_features=len(names))
    return RefineModel(
        boosters,
        featurizer,
        int(targets.max()),
        spread_log_offsets=offsets,
        num_threads=settings.num_threads,
    )
