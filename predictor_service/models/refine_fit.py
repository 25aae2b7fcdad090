"""Fitting the refinement model (:mod:`predictor_service.models.refine`). Pure functions.

Training rows are cuts of training answers: several rows share one answer, so every
out-of-fold step (tail score, conformal offsets) folds by answer (``groups``): a row's
held-out estimate never comes from a model that saw another cut of the same answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import lightgbm
import numpy as np
import numpy.typing as npt
import structlog
from sklearn.model_selection import GroupKFold

from predictor_service.models.refine import QUANTILES, RefineModel
from predictor_service.models.refine_features import ALL_FEATURE_NAMES, RefineFeaturizer
from predictor_service.text_score import TextScoreConfig, TextScoreModel, fit_tfidf_ridge

logger = structlog.get_logger(__name__)

@dataclass(frozen=True)
class RefineFitConfig:
    """LightGBM settings of the refinement model (p50: ``num_rounds``; p10/p90: spread).

    ``feature_names`` are the columns used (default: all). ``tail_score`` None drops the
    tail bag-of-words score. ``num_threads`` 0 lets LightGBM use every core.
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

    def lightgbm_params(self, quantile: float, seed: int) -> dict[str, Any]:
        """LightGBM parameters for the model of one ``quantile``."""
        is_median = quantile == 0.5
        return {
            "objective": "quantile",
            "alpha": quantile,
            "learning_rate": self.learning_rate if is_median else self.spread_learning_rate,
            "num_leaves": self.num_leaves,
            "min_data_in_leaf": self.min_data_in_leaf,
            "feature_fraction": self.feature_fraction,
            "bagging_fraction": self.bagging_fraction,
            "bagging_freq": 1 if self.bagging_fraction < 1.0 else 0,
            "num_threads": self.num_threads,
            "seed": seed,
            "deterministic": True,
            "verbose": -1,
        }


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


def _train_booster(
    matrix: npt.NDArray[np.float32],
    log_targets: npt.NDArray[np.float64],
    quantile: float,
    config: RefineFitConfig,
    seed: int,
) -> lightgbm.Booster:
    rounds = config.num_rounds if quantile == 0.5 else config.spread_num_rounds
    return lightgbm.train(
        config.lightgbm_params(quantile, seed),
        lightgbm.Dataset(matrix, log_targets),
        num_boost_round=rounds,
    )


def spread_log_offsets(
    matrix: npt.NDArray[np.float32],
    log_targets: npt.NDArray[np.float64],
    groups: npt.NDArray[np.int64],
    config: RefineFitConfig,
    seed: int,
) -> tuple[float, float]:
    """Conformal shifts (ln tokens) of p10/p90 from answer-grouped out-of-fold residuals.

    In-sample quantile trees are too narrow; as in ``fast``, the p10 shift is the 10th
    percentile of ln(true) - ln(p10) over held-out rows (p90: the 90th). (0, 0) when
    calibration is off or there are too few answers.
    """
    num_folds = config.num_calibration_folds
    if num_folds < 2 or len(np.unique(groups)) < 10 * num_folds:
        return (0.0, 0.0)
    residuals = {quantile: np.empty(len(log_targets)) for quantile in (0.1, 0.9)}
    for train_index, test_index in _group_folds(num_folds, groups):
        for quantile, fold_residuals in residuals.items():
            booster = _train_booster(
                matrix[train_index], log_targets[train_index], quantile, config, seed
            )
            predicted = booster.predict(matrix[test_index], num_threads=config.num_threads)
            fold_residuals[test_index] = log_targets[test_index] - predicted
    return (float(np.quantile(residuals[0.1], 0.1)), float(np.quantile(residuals[0.9], 0.9)))


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
        quantile: _train_booster(matrix, log_targets, quantile, settings, seed)
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
