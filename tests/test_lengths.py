"""Output-length beliefs: the vectorized targets a replica rebuild uses equal the scalar rule."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from blockq.lengths import LENGTH_MODES, belief_from_prediction, remaining_targets


@pytest.mark.parametrize("lengths", LENGTH_MODES)
def test_remaining_targets_equal_the_scalar_rule(lengths: str) -> None:
    rng = random.Random(7)
    beliefs, generated = [], []
    for _ in range(5000):
        p50 = rng.randrange(1, 3000)
        p10 = rng.choice([None, rng.randrange(1, p50 + 1)])
        p90 = rng.choice([None, rng.randrange(p50, 6 * p50 + 2)])
        beliefs.append(belief_from_prediction(p50, p10, p90, rng.choice([None, rng.randrange(1, 4000)])))
        generated.append(rng.choice([0, rng.randrange(0, 20), rng.randrange(0, 8000)]))
    targets = remaining_targets(beliefs, np.array(generated, np.int64), lengths)
    expected = [belief.remaining_target(count, lengths) for belief, count in zip(beliefs, generated, strict=True)]
    assert targets.tolist() == expected
    # Both branches of the median rule were taken: early rows and conditioned ones.
    early = sum(count < max(1, b.p10_tokens) // 2 for b, count in zip(beliefs, generated, strict=True))
    assert 500 < early < 4500


def test_remaining_targets_of_nothing() -> None:
    assert remaining_targets([], np.zeros(0, np.int64)).tolist() == []


def test_the_compiled_quantiles_equal_the_scalar_ones_bit_for_bit() -> None:
    from blockq.lengths import _quantile_above
    from blockq.lengths_kernel import quantiles_above

    rng = random.Random(11)
    mu = np.array([math.log(rng.randrange(1, 5000)) for _ in range(20_000)])
    sigma = np.array([rng.uniform(0.05, 3.0) for _ in range(20_000)])
    generated = np.array([rng.choice([0, rng.randrange(1, 20_000)]) for _ in range(20_000)], np.int64)
    for quantile in (0.5, 0.9, 0.37):
        out = np.empty(len(mu))
        quantiles_above(mu, sigma, generated, quantile, out)
        expected = [_quantile_above(m, s, g, quantile)
                    for m, s, g in zip(mu.tolist(), sigma.tolist(), generated.tolist(), strict=True)]
        assert out.tolist() == expected
