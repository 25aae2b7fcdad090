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
from operator import attrgetter
from statistics import NormalDist

import numpy as np

_Z90 = 1.2815515655446004  # Φ⁻¹(0.9)
LENGTH_MODES = ("median", "upper", "truth")
_STANDARD_NORMAL = NormalDist()
_INV_CDF = _STANDARD_NORMAL.inv_cdf
_SQRT2 = math.sqrt(2.0)

# When a request carries no prediction at all: a ShareGPT-like spread around 250 tokens.
DEFAULT_SPREAD_RATIO = 10.0


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


# Fewer rows than this are computed one by one: numpy's and the compiled call's fixed cost
# (~20 µs) is more than a few rows' Python (small fleets and the simulation's instances
# list a few requests a beat; the dispatch-bench's ~70).
MIN_VECTOR_ROWS = 24


def remaining_targets(beliefs: Sequence[LengthBelief], num_generated_tokens: np.ndarray,
                      lengths: str = "median") -> np.ndarray:
    """:meth:`LengthBelief.remaining_target` of each belief and count (int64), equal to it
    value for value (a test compares them): under ``median`` in numpy, the conditioned rows
    compiled (:mod:`blockq.lengths_kernel`), since a replica rebuild asks for ~70 at a
    time and a Python call per row was most of the rebuild."""
    if lengths != "median" or len(beliefs) < MIN_VECTOR_ROWS:
        return np.array([belief.remaining_target(int(generated), lengths)
                         for belief, generated in zip(beliefs, num_generated_tokens.tolist(), strict=True)],
                        np.int64).reshape(len(beliefs))
    from blockq.lengths_kernel import (
        quantiles_above,  # compiled: loaded only where rebuilds need it
    )

    p50 = np.array(list(map(_P50, beliefs)), np.int64).reshape(len(beliefs))
    p10 = np.array(list(map(_P10, beliefs)), np.int64).reshape(len(beliefs))
    targets = np.maximum(p50, num_generated_tokens + 1)
    conditioned = np.flatnonzero(num_generated_tokens >= np.maximum(1, p10) // 2)
    if conditioned.size:
        chosen = [beliefs[row] for row in conditioned.tolist()]
        generated = num_generated_tokens[conditioned]
        medians = np.empty(len(chosen))
        quantiles_above(np.array(list(map(_MU, chosen))), np.array(list(map(_SIGMA, chosen))), generated, 0.5,
                        medians)
        # np.round rounds half to even, as round() does.
        targets[conditioned] = np.maximum(np.round(medians).astype(np.int64), generated + 1)
    return targets


_P50 = attrgetter("p50_tokens")
_P10 = attrgetter("p10_tokens")
_MU = attrgetter("mu")
_SIGMA = attrgetter("sigma")


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
                           true_tokens: int | None = None, *, default_p50_tokens: int = 250) -> LengthBelief:
    """A belief from whatever the request carries; missing quantiles get a default spread."""
    p50 = max(1, p50_tokens if p50_tokens is not None else default_p50_tokens)
    spread = math.sqrt(DEFAULT_SPREAD_RATIO)
    p10 = p10_tokens if p10_tokens is not None else max(1, int(p50 / spread))
    p90 = p90_tokens if p90_tokens is not None else int(p50 * spread)
    return LengthBelief(p50, p10, p90, true_tokens)
