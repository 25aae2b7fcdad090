"""Length-prediction metrics on hand-computed examples, Kendall tau against brute force."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockq.prediction_accuracy import compute_metrics, compute_metrics_with_baseline, kendall_tau


def _brute_force_tau_b(x: list[float], y: list[float]) -> float:
    concordant = discordant = ties_x_only = ties_y_only = 0
    for i, j in itertools.combinations(range(len(x)), 2):
        dx, dy = x[i] - x[j], y[i] - y[j]
        if dx == 0 and dy == 0:
            continue
        if dx == 0:
            ties_x_only += 1
        elif dy == 0:
            ties_y_only += 1
        elif dx * dy > 0:
            concordant += 1
        else:
            discordant += 1
    denominator = math.sqrt(
        (concordant + discordant + ties_x_only) * (concordant + discordant + ties_y_only)
    )
    return 0.0 if denominator == 0 else (concordant - discordant) / denominator


def test_metrics_on_a_hand_computed_example() -> None:
    predicted = [100, 200, 300, 400]
    true = [100, 260, 150, 700]
    # errors 0, 60, 150, 300
    metrics = compute_metrics(predicted, true)
    assert metrics["count"] == 4
    assert metrics["mae"] == pytest.approx(127.5)
    assert metrics["mape"] == pytest.approx((0 + 60 / 260 + 150 / 150 + 300 / 700) / 4)
    assert metrics["acc50"] == pytest.approx(0.25)
    assert metrics["acc100"] == pytest.approx(0.5)
    assert metrics["median_ae"] == pytest.approx(105.0)
    # pairs: (1,2)+ (1,3)+ (1,4)+ (2,3)- (2,4)+ (3,4)+  -> (5 - 1) / 6
    assert metrics["kendall_tau"] == pytest.approx(4 / 6)


def test_kendall_tau_extremes_and_ties() -> None:
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert kendall_tau([5, 5, 5], [1, 2, 3]) == 0.0
    assert kendall_tau([1], [1]) == 0.0
    # x ties on one pair: tau_b = (2 - 0) / sqrt((3 - 1) * 3)
    assert kendall_tau([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / math.sqrt(6))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=2, max_size=30))
def test_kendall_tau_matches_brute_force(pairs: list[tuple[int, int]]) -> None:
    x = [float(a) for a, _ in pairs]
    y = [float(b) for _, b in pairs]
    assert kendall_tau(x, y) == pytest.approx(_brute_force_tau_b(x, y), abs=1e-12)


def test_baseline_is_the_constant_predictor() -> None:
    metrics = compute_metrics_with_baseline([10, 20, 30], [10, 20, 100], baseline_tokens=20)
    assert metrics["baseline"]["mae"] == pytest.approx((10 + 0 + 80) / 3)
    assert metrics["baseline"]["kendall_tau"] == 0.0
    assert metrics["baseline_tokens"] == 20.0


def test_empty_and_mismatched_inputs() -> None:
    assert compute_metrics([], [])["count"] == 0
    with pytest.raises(ValueError):
        compute_metrics([1, 2], [1])
