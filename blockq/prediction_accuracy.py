"""Accuracy metrics of output-length predictions (the Block paper's, plus rank and MAPE).

All lengths are in tokens. Keys of :func:`compute_metrics`:

- ``count``: number of examples;
- ``mae``: mean |predicted - true|;
- ``mape``: mean |predicted - true| / max(true, 1), a fraction (0.25 = 25 %);
- ``acc50`` / ``acc100``: share of examples with |predicted - true| <= 50 / <= 100,
  a fraction in [0, 1];
- ``median_ae``: median |predicted - true|;
- ``kendall_tau``: Kendall's tau-b rank correlation between predicted and true
  (ties handled as tau-b; 0.0 when either side is constant).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

METRIC_KEYS = ("count", "mae", "mape", "acc50", "acc100", "median_ae", "kendall_tau")
MAPE_DEFINITION = "mean(|predicted - true| / max(true, 1)), a fraction (0.25 = 25 %)"
ACCURACY_DEFINITION = "share of examples with |predicted - true| <= 50 (acc50) / 100 (acc100)"


def _num_tied_pairs(values: npt.NDArray[Any]) -> int:
    """Number of pairs with equal values: sum over groups of t * (t - 1) / 2."""
    _, counts = np.unique(values, return_counts=True)
    return int((counts * (counts - 1) // 2).sum())


def _count_inversions(ranks: npt.NDArray[np.int64]) -> int:
    """Pairs i < j with ranks[i] > ranks[j] (Fenwick tree, O(n log n))."""
    size = int(ranks.max()) + 1 if len(ranks) else 0
    tree = [0] * (size + 1)
    num_inversions = 0
    for num_seen, rank in enumerate(ranks.tolist()):
        # how many already-seen ranks are <= rank
        index = rank + 1
        num_not_greater = 0
        while index > 0:
            num_not_greater += tree[index]
            index -= index & -index
        num_inversions += num_seen - num_not_greater
        index = rank + 1
        while index <= size:
            tree[index] += 1
            index += index & -index
    return num_inversions


def kendall_tau(x: Sequence[float] | npt.ArrayLike, y: Sequence[float] | npt.ArrayLike) -> float:
    """Kendall's tau-b of two equal-length sequences, O(n log n).

    tau_b = (concordant - discordant) / sqrt((n0 - ties_x) * (n0 - ties_y)) with
    n0 = n (n - 1) / 2. Returns 0.0 for fewer than two items or a constant side.
    """
    x_values = np.asarray(x, dtype=np.float64)
    y_values = np.asarray(y, dtype=np.float64)
    if x_values.shape != y_values.shape:
        raise ValueError("kendall_tau: x and y must have the same length")
    num_items = len(x_values)
    if num_items < 2:
        return 0.0
    num_pairs = num_items * (num_items - 1) // 2
    ties_x = _num_tied_pairs(x_values)
    ties_y = _num_tied_pairs(y_values)
    pairs = np.stack([x_values, y_values], axis=1)
    _, joint_counts = np.unique(pairs, axis=0, return_counts=True)
    ties_xy = int((joint_counts * (joint_counts - 1) // 2).sum())
    # Sort by x then y; a discordant pair is then an inversion of y's ranks (pairs
    # tied in x are ordered by y and so never counted).
    order = np.lexsort((y_values, x_values))
    y_ranks = np.unique(y_values, return_inverse=True)[1][order].astype(np.int64)
    num_discordant = _count_inversions(y_ranks)
    denominator = math.sqrt((num_pairs - ties_x) * (num_pairs - ties_y))
    if denominator == 0.0:
        return 0.0
    concordant_minus_discordant = num_pairs - ties_x - ties_y + ties_xy - 2 * num_discordant
    return float(concordant_minus_discordant / denominator)


def compute_metrics(
    predicted_tokens: Sequence[float] | npt.ArrayLike, true_tokens: Sequence[float] | npt.ArrayLike
) -> dict[str, float | int]:
    """The metrics of the module docstring for paired predictions and truths.

    Empty input gives ``count`` 0 and NaN elsewhere. ``ValueError`` on unequal lengths.
    """
    predicted = np.asarray(predicted_tokens, dtype=np.float64)
    truth = np.asarray(true_tokens, dtype=np.float64)
    if predicted.shape != truth.shape:
        raise ValueError("compute_metrics: predicted and true must have the same length")
    if len(truth) == 0:
        return {key: (0 if key == "count" else float("nan")) for key in METRIC_KEYS}
    errors = np.abs(predicted - truth)
    return {
        "count": int(len(truth)),
        "mae": float(errors.mean()),
        "mape": float((errors / np.maximum(truth, 1.0)).mean()),
        "acc50": float((errors <= 50).mean()),
        "acc100": float((errors <= 100).mean()),
        "median_ae": float(np.median(errors)),
        "kendall_tau": kendall_tau(predicted, truth),
    }


def compute_metrics_with_baseline(
    predicted_tokens: Sequence[float] | npt.ArrayLike,
    true_tokens: Sequence[float] | npt.ArrayLike,
    baseline_tokens: float,
) -> dict[str, Any]:
    """:func:`compute_metrics` plus ``baseline``: the same keys for a constant predictor.

    ``baseline_tokens`` is the constant (the median of the training targets). A
    constant has no ranking, so the baseline's ``kendall_tau`` is 0.0.
    """
    truth = np.asarray(true_tokens, dtype=np.float64)
    metrics: dict[str, Any] = dict(compute_metrics(predicted_tokens, truth))
    metrics["baseline"] = compute_metrics(np.full(truth.shape, float(baseline_tokens)), truth)
    metrics["baseline_tokens"] = float(baseline_tokens)
    return metrics
