"""The conditional medians of :mod:`blockq.lengths`, compiled, for many requests at once.

A replica rebuild gives ~70 requests an output target from their beliefs and what they
generated; one Python call each, and the belief objects themselves, were most of the
rebuild. :func:`median_targets` is :meth:`blockq.lengths.LengthBelief.remaining_target`
(``median``) value for value: the same operations in the same order, the standard normal's
inverse cdf written out as CPython's ``statistics`` computes it (Wichura's AS241), no
fast-math (so no reordering); ``tests/test_lengths.py`` compares them.
"""

from __future__ import annotations

import math

import numba
import numpy as np


@numba.njit(cache=True)
def _inv_cdf(p: float) -> float:
    """Φ⁻¹(p) as statistics.NormalDist().inv_cdf computes it (0 < p < 1)."""
    q = p - 0.5
    if math.fabs(q) <= 0.425:
        r = 0.180625 - q * q
        num = (((((((2.5090809287301226727e+3 * r +
                     3.3430575583588128105e+4) * r +
                     6.7265770927008700853e+4) * r +
                     4.5921953931549871457e+4) * r +
                     1.3731693765509461125e+4) * r +
                     1.9715909503065514427e+3) * r +
                     1.3314166789178437745e+2) * r +
                     3.3871328727963666080e+0) * q
        den = (((((((5.2264952788528545610e+3 * r +
                     2.8729085735721942674e+4) * r +
                     3.9307895800092710610e+4) * r +
                     2.1213794301586595867e+4) * r +
                     5.3941960214247511077e+3) * r +
                     6.8718700749205790830e+2) * r +
                     4.2313330701600911252e+1) * r +
                     1.0)
        return num / den
    r = p if q <= 0.0 else 1.0 - p
    r = math.sqrt(-math.log(r))
    if r <= 5.0:
        r = r - 1.6
        num = (((((((7.74545014278341407640e-4 * r +
                     2.27238449892691845833e-2) * r +
                     2.41780725177450611770e-1) * r +
                     1.27045825245236838258e+0) * r +
                     3.64784832476320460504e+0) * r +
                     5.76949722146069140550e+0) * r +
                     4.63033784615654529590e+0) * r +
                     1.42343711074968357734e+0)
        den = (((((((1.05075007164441684324e-9 * r +
                     5.47593808499534494600e-4) * r +
                     1.51986665636164571966e-2) * r +
                     1.48103976427480074590e-1) * r +
                     6.89767334985100004550e-1) * r +
                     1.67638483018380384940e+0) * r +
                     2.05319162663775882187e+0) * r +
                     1.0)
    else:
        r = r - 5.0
        num = (((((((2.01033439929228813265e-7 * r +
                     2.71155556874348757815e-5) * r +
                     1.24266094738807843860e-3) * r +
                     2.65321895265761230930e-2) * r +
                     2.96560571828504891230e-1) * r +
                     1.78482653991729133580e+0) * r +
                     5.46378491116411436990e+0) * r +
                     6.65790464350110377720e+0)
        den = (((((((2.04426310338993978564e-15 * r +
                     1.42151175831644588870e-7) * r +
                     1.84631831751005468180e-5) * r +
                     7.86869131145613259100e-4) * r +
                     1.48753612908506148525e-2) * r +
                     1.36929880922735805310e-1) * r +
                     5.99832206555887937690e-1) * r +
                     1.0)
    x = num / den
    if q < 0.0:
        x = -x
    return x

@numba.njit(cache=True)
def _quantile_above(mu: float, sigma: float, generated: int, quantile: float, sqrt2: float) -> float:
    """:func:`blockq.lengths._quantile_above`, the same operations in the same order."""
    if generated <= 0:
        return math.exp(mu + sigma * _inv_cdf(quantile))
    z = (math.log(generated) - mu) / sigma
    tail_start = 0.5 * (1.0 + math.erf(z / sqrt2))
    level = min(1 - 1e-12, tail_start + quantile * (1 - tail_start))
    return math.exp(mu + sigma * _inv_cdf(level))


@numba.njit(cache=True)
def median_targets(p50: np.ndarray, p10: np.ndarray, p90: np.ndarray, generated: np.ndarray, z90: float,
                   default_p50: int, spread: float, out: np.ndarray) -> None:
    """out[i]: ``belief_from_prediction(p50[i], p10[i], p90[i]).remaining_target(generated[i])``,
    the conditional median in whole tokens, a quantile < 0 standing for None: the defaults,
    the belief's sigma and mu and the rule's early shortcut as :mod:`blockq.lengths`
    computes them, operation for operation (round half to even, as ``round``); ``z90``
    is its Φ⁻¹(0.9), ``default_p50`` and ``spread`` its defaults."""
    sqrt2 = math.sqrt(2.0)
    for i in range(len(p50)):
        g = generated[i]
        p50_i = max(1, p50[i] if p50[i] >= 0 else default_p50)
        p10_i = p10[i] if p10[i] >= 0 else max(1, np.int64(p50_i / spread))
        p90_i = p90[i] if p90[i] >= 0 else np.int64(p50_i * spread)
        if g < max(1, p10_i) // 2:
            out[i] = max(p50_i, g + 1)
            continue
        low = max(1, min(p10_i, p50_i))
        high = max(p50_i, p90_i, low + 1)
        sigma = max(0.05, math.log(high / low) / (2 * z90))
        # Past 2**40 tokens (no engine's length) the clamp keeps the conversion defined.
        median = min(_quantile_above(math.log(p50_i), sigma, g, 0.5, sqrt2), 2.0**40)
        out[i] = max(np.int64(np.rint(median)), g + 1)
