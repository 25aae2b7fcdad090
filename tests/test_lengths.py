"""Output-length beliefs: the compiled targets a replica rebuild uses equal the scalar rule."""

from __future__ import annotations

import random

import numpy as np

from blockq.lengths import (
    LengthBelief,
    belief_from_prediction,
    median_targets,
    quantile_column,
    remaining_targets,
)


def test_the_compiled_medians_equal_the_scalar_rule() -> None:
    """A rebuild's targets from the beat's quantile columns (None as MISSING) equal the
    belief's own rule, on the early rows and the conditioned ones alike."""
    rng = random.Random(7)
    rows = []
    for _ in range(5000):
        p50 = rng.choice([None, rng.randrange(0, 3000)])
        p10 = rng.choice([None, rng.randrange(0, (p50 or 250) + 2)])
        p90 = rng.choice([None, rng.randrange((p50 or 250), 6 * (p50 or 250) + 2)])
        rows.append((p50, p10, p90, rng.choice([0, rng.randrange(0, 20), rng.randrange(0, 8000)])))
    columns = [np.array(quantile_column(column), np.int64) for column in zip(*rows, strict=True)]
    expected = [belief_from_prediction(*row[:3]).remaining_target(row[3]) for row in rows]
    assert median_targets(*columns).tolist() == expected
    # Both branches of the median rule were taken: early rows and conditioned ones.
    beliefs = [belief_from_prediction(*row[:3]) for row in rows]
    early = sum(row[3] < max(1, belief.p10_tokens) // 2 for belief, row in zip(beliefs, rows, strict=True))
    assert 500 < early < 4500


def test_remaining_targets_of_nothing() -> None:
    assert remaining_targets([], np.zeros(0, np.int64)).tolist() == []
    assert median_targets(*np.zeros((4, 0), np.int64)).tolist() == []


def test_the_compiled_medians_equal_the_scalar_rule_on_wide_quantiles() -> None:
    """Quantiles far apart and counts far past them: the conditioned branch's arithmetic
    (log, erf, the inverse cdf, round half to even) on many more inputs than a beat has."""
    rng = random.Random(11)
    rows = []
    for _ in range(50_000):
        p50 = rng.randrange(0, 5000)
        p10 = rng.randrange(0, p50 + 2)
        p90 = rng.randrange(0, 40 * p50 + 3)
        rows.append((p50, p10, p90, rng.choice([0, rng.randrange(0, 20), rng.randrange(0, 200_000)])))
    p50, p10, p90, generated = (np.array(column, np.int64) for column in zip(*rows, strict=True))
    expected = [LengthBelief(*row[:3]).remaining_target(row[3]) for row in rows]
    assert median_targets(p50, p10, p90, generated).tolist() == expected
    early = sum(g < max(1, q10) // 2 for _, q10, _, g in rows)
    assert 5_000 < early < 45_000
