"""Output lengths to simulate with, from a predicted distribution.

A request's prediction is three quantiles (p10, p50, p90). We read them as a lognormal
distribution: median p50, and sigma from the p10–p90 spread (``ln(p90/p10) / (2·1.2816)``).

For a request that has already generated ``g`` tokens, the stale point estimate is the
wrong number to simulate with: if ``g`` is past p50, it says "finishes now" for a request
that has shown it is long. We use a quantile of the distribution *conditioned on L > g*:
``exp(mu + sigma · Φ⁻¹(Φ(z) + q · (1 − Φ(z))))`` with ``z = (ln g − mu) / sigma`` (q = 0.5:
the conditional median).

Which length a replica simulates with is one value, a :data:`LENGTH_MODES` name, handed to
the dispatcher core once: ``median`` (the conditional median), ``upper`` (the conditional
p90) or ``truth`` (the recorded length of a trace replay; benchmarks only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

_Z90 = 1.2815515655446004  # Φ⁻¹(0.9)
LENGTH_MODES = ("median", "upper", "truth")
_STANDARD_NORMAL = NormalDist()
_INV_CDF = _STANDARD_NORMAL.inv_cdf
_SQRT2 = math.sqrt(2.0)

# When a request carries no prediction at all: a ShareGPT-like spread around 250 tokens.
DEFAULT_SPREAD_RATIO = 10.0
DEFAULT_P50_TOKENS = 250
# A quantile not given, in an int column (counts are >= 0).
MISSING = -1


@dataclass(frozen=True, slots=True)
class LengthBelief:
    """What the dispatcher believes about one request's total output length (tokens)."""

    p50_tokens: int
    p10_tokens: int
    p90_tokens: int
    true_tokens: int | None = None   # known only in trace replays; used by the oracle policy
    sigma: float = field(init=False, compare=False)  # of ln(length), from the p10-p90 spread
    mu: float = field(init=False, compare=False, repr=False)  # ln(p50)

    def __post_init__(self) -> None:
        # Computed once: every replica rebuild reads them for each request it restores.
        p10 = max(1, min(self.p10_tokens, self.p50_tokens))
        p90 = max(self.p50_tokens, self.p90_tokens, p10 + 1)
        object.__setattr__(self, "sigma", max(0.05, math.log(p90 / p10) / (2 * _Z90)))
        object.__setattr__(self, "mu", math.log(max(1, self.p50_tokens)))

    def remaining_target(self, num_generated_tokens: int, lengths: str = "median") -> int:
        """Total output tokens to simulate, under the ``lengths`` mode, for a request that
        produced ``num_generated_tokens``; always > ``num_generated_tokens``. ``truth``
        without a recorded length falls back to the median."""
        if lengths == "truth" and self.true_tokens is not None:
            return max(self.true_tokens, num_generated_tokens + 1)
        if lengths == "upper":
            return max(int(round(_quantile_above(self.mu, self.sigma, num_generated_tokens, 0.9))),
                       self.p90_tokens, num_generated_tokens + 1)
        if num_generated_tokens < max(1, self.p10_tokens) // 2:
            # Early on, conditioning barely moves the median: skip the normal-cdf math.
            return max(self.p50_tokens, num_generated_tokens + 1)
        return max(int(round(_quantile_above(self.mu, self.sigma, num_generated_tokens, 0.5))),
                   num_generated_tokens + 1)


def remaining_targets(beliefs: Sequence[LengthBelief], num_generated_tokens: np.ndarray,
                      lengths: str = "median") -> np.ndarray:
    """:meth:`LengthBelief.remaining_target` of each belief and count (int64); a rebuild
    under ``median`` uses :func:`median_targets` instead."""
    return np.array([belief.remaining_target(int(generated), lengths)
                     for belief, generated in zip(beliefs, num_generated_tokens.tolist(), strict=True)],
                    np.int64).reshape(len(beliefs))


def median_targets(p50_tokens: np.ndarray, p10_tokens: np.ndarray, p90_tokens: np.ndarray,
                   num_generated_tokens: np.ndarray) -> np.ndarray:
    """``belief_from_prediction(p50, p10, p90).remaining_target(generated)`` row by row
    (int64 arrays of one length; a quantile < 0 stands for None, as :data:`MISSING`), in
    one compiled call without making the beliefs (a replica rebuild has the quantiles as
    columns)."""
    from blockq.lengths_kernel import (
        median_targets as kernel,  # compiled: loaded where rebuilds need it
    )

    out = np.empty(len(p50_tokens), np.int64)
    kernel(p50_tokens, p10_tokens, p90_tokens, num_generated_tokens, _Z90, DEFAULT_P50_TOKENS,
           math.sqrt(DEFAULT_SPREAD_RATIO), out)
    return out


def quantile_column(values: tuple[int | None, ...]) -> Sequence[int]:
    """A column of quantiles as :func:`median_targets` reads it (None as :data:`MISSING`)."""
    if None not in values:
        return values  # type: ignore[return-value]  # no None: ints
    if values.count(None) == len(values):  # a column older workers leave out
        return [MISSING] * len(values)
    return [MISSING if value is None else value for value in values]


def check_length_mode(lengths: str) -> str:
    """``lengths`` if it names a mode; ValueError naming the field otherwise."""
    if lengths not in LENGTH_MODES:
        raise ValueError(f"lengths: must be one of {', '.join(LENGTH_MODES)} (got {lengths!r})")
    return lengths


def conditional_quantile(p50_tokens: int, sigma: float, num_generated_tokens: int, quantile: float) -> int:
    """The ``quantile`` of a lognormal(ln p50, sigma) length given that it exceeds
    ``num_generated_tokens``, in whole tokens."""
    return int(round(conditional_quantile_tokens(p50_tokens, sigma, num_generated_tokens, quantile)))


def conditional_quantile_tokens(p50_tokens: int, sigma: float, num_generated_tokens: int,
                                quantile: float) -> float:
    """:func:`conditional_quantile` unrounded (a model feature reads it as a real number)."""
    return _quantile_above(math.log(max(1, p50_tokens)), sigma, num_generated_tokens, quantile)


def _quantile_above(mu: float, sigma: float, num_generated_tokens: int, quantile: float) -> float:
    """:func:`conditional_quantile_tokens` with ``mu = ln p50`` given. A replica rebuild
    computes ~40 of these, so the standard normal's cdf is written out (bit for bit
    ``NormalDist().cdf``: mu 0 and sigma 1 change no rounding) rather than called."""
    if num_generated_tokens <= 0:
        return math.exp(mu + sigma * _INV_CDF(quantile))
    z = (math.log(num_generated_tokens) - mu) / sigma
    tail_start = 0.5 * (1.0 + math.erf(z / _SQRT2))
    # The point that far through the remaining mass.
    level = min(1 - 1e-12, tail_start + quantile * (1 - tail_start))
    return math.exp(mu + sigma * _INV_CDF(level))


def belief_from_prediction(p50_tokens: int | None, p10_tokens: int | None = None, p90_tokens: int | None = None,
                           true_tokens: int | None = None) -> LengthBelief:
    """A belief from whatever the request carries; missing quantiles get a default spread."""
    p50 = max(1, p50_tokens if p50_tokens is not None else DEFAULT_P50_TOKENS)
    spread = math.sqrt(DEFAULT_SPREAD_RATIO)
    p10 = p10_tokens if p10_tokens is not None else max(1, int(p50 / spread))
    p90 = p90_tokens if p90_tokens is not None else int(p50 * spread)
    return LengthBelief(p50, p10, p90, true_tokens)
