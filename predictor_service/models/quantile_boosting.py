"""LightGBM quantile (pinball) boosters in ln tokens and their conformal p10/p90 offsets.

The one implementation behind the ``fast`` model (:mod:`predictor_service.models.fast_fit`)
and the refinement model (:mod:`predictor_service.models.refine_fit`). Each passes its
own config (:class:`QuantileBoostingConfig`) and its own cross-validation folds (``fast``
shuffles rows, ``refine`` folds by answer). Pure: no files, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import lightgbm
import numpy as np
import numpy.typing as npt

MEDIAN_QUANTILE = 0.5
SPREAD_QUANTILES: tuple[float, float] = (0.1, 0.9)


class QuantileBoostingConfig(Protocol):
    """The training settings read here (``FastConfig`` and ``RefineFitConfig`` have them).

    The p50 model uses ``num_rounds`` and ``learning_rate``, the p10/p90 (spread) models
    ``spread_num_rounds`` and ``spread_learning_rate``; ``min_data_in_leaf_for`` is each
    model's own rule. ``num_threads`` 0 lets LightGBM use every core.
    """

    # Read-only properties rather than attributes: the configs are frozen dataclasses.
    @property
    def num_rounds(self) -> int: ...
    @property
    def spread_num_rounds(self) -> int: ...
    @property
    def learning_rate(self) -> float: ...
    @property
    def spread_learning_rate(self) -> float: ...
    @property
    def num_leaves(self) -> int: ...
    @property
    def feature_fraction(self) -> float: ...
    @property
    def bagging_fraction(self) -> float: ...
    @property
    def num_threads(self) -> int: ...

    def min_data_in_leaf_for(self, quantile: float) -> int:
        """Minimum training rows per leaf of the model of one ``quantile``."""
        ...


def quantile_lightgbm_params(
    config: QuantileBoostingConfig, quantile: float, seed: int
) -> dict[str, Any]:
    """LightGBM parameters of the model of one ``quantile`` (a new dict; callers may extend it).

    Deterministic for a given ``seed`` and thread count. The keys and their order are part
    of what makes a retrained model identical: keep them.
    """
    is_median = quantile == MEDIAN_QUANTILE
    return {
        "objective": "quantile",
        "alpha": quantile,
        "learning_rate": config.learning_rate if is_median else config.spread_learning_rate,
        "num_leaves": config.num_leaves,
        "min_data_in_leaf": config.min_data_in_leaf_for(quantile),
        "feature_fraction": config.feature_fraction,
        "bagging_fraction": config.bagging_fraction,
        "bagging_freq": 1 if config.bagging_fraction < 1.0 else 0,
        "num_threads": config.num_threads,
        "seed": seed,
        "deterministic": True,
        "verbose": -1,
    }


def train_quantile_booster(
    matrix: npt.NDArray[np.float32],
    log_targets: npt.NDArray[np.float64],
    quantile: float,
    config: QuantileBoostingConfig,
    seed: int,
) -> lightgbm.Booster:
    """A booster predicting the ``quantile`` of ``log_targets`` (ln tokens) from ``matrix``."""
    num_rounds = config.num_rounds if quantile == MEDIAN_QUANTILE else config.spread_num_rounds
    return lightgbm.train(
        quantile_lightgbm_params(config, quantile, seed),
        lightgbm.Dataset(matrix, log_targets),
        num_boost_round=num_rounds,
    )


def conformal_log_offsets(
    matrix: npt.NDArray[np.float32],
    log_targets: npt.NDArray[np.float64],
    folds: Iterable[tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]],
    config: QuantileBoostingConfig,
    seed: int,
) -> tuple[float, float]:
    """Shifts (ln tokens) that make p10/p90 cover 10 % / 90 % of rows out of sample.

    Quantile trees scored on the rows they were fitted on are too narrow. For each
    ``(train_index, test_index)`` of ``folds`` (which must cover every row once as a test
    row), p10/p90 models are fitted on the train rows and scored on the test rows; the p10
    shift is the 10th percentile of ln(true) - ln(p10) over all held-out rows (p90: the
    90th), so that, shifted, the out-of-fold p10 is undercut by 10 % of the rows.
    """
    residuals = {quantile: np.empty(len(log_targets)) for quantile in SPREAD_QUANTILES}
    for train_index, test_index in folds:
        for quantile, fold_residuals in residuals.items():
            booster = train_quantile_booster(
                matrix[train_index], log_targets[train_index], quantile, config, seed
            )
            predicted = booster.predict(matrix[test_index], num_threads=config.num_threads)
            fold_residuals[test_index] = log_targets[test_index] - predicted
    low, high = SPREAD_QUANTILES
    return (
        float(np.quantile(residuals[low], low)),
        float(np.quantile(residuals[high], high)),
    )
