"""Arrival history and a short-horizon forecast of the request rate and mix (pure).

The history keeps, for the last ``window_s``, when each request arrived and its size as
the dispatcher's replicas simulate it (prompt tokens, predicted output tokens). The rate
forecast is deliberately simple and one-sided: what matters is not to be short of
capacity when the new instances are up, and not to give capacity back that will be
missed before the fleet may grow again:

* ``level``: the rate over the last ``level_window_s``;
* ``trend``: the least-squares slope of the rate over the last ``trend_window_s``
  (per-``bin_s`` counts), extrapolated to the horizon, never below the level;
* ``upper``: the forecast plus ``z`` Poisson standard errors of the level estimate;
* ``recent_peak``: the highest rate in any ``level_window_s`` slice of the last
  ``peak_window_s``, which a scale-down must be able to carry (the fleet may not grow
  again for the reversal hold).
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RateForecast:
    """Request rates (per second) at ``now_s`` looking ``horizon_s`` ahead."""

    now_s: float
    horizon_s: float
    level_per_s: float
    trend_per_s2: float
    forecast_per_s: float
    upper_per_s: float
    recent_peak_per_s: float
    num_observed: int

    def as_dict(self) -> dict[str, float]:
        return {"level_per_s": round(self.level_per_s, 3), "trend_per_s_per_min": round(self.trend_per_s2 * 60, 4),
                "forecast_per_s": round(self.forecast_per_s, 3), "upper_per_s": round(self.upper_per_s, 3),
                "recent_peak_per_s": round(self.recent_peak_per_s, 3)}


class ArrivalHistory:
    """Arrivals of the last ``window_s`` (seconds, on the caller's clock)."""

    def __init__(self, window_s: float = 900.0, *, level_window_s: float = 120.0, trend_window_s: float = 600.0,
                 peak_window_s: float = 300.0, bin_s: float = 30.0, z: float = 1.5, mix_size: int = 2000) -> None:
        if not all(0 < w <= window_s for w in (level_window_s, trend_window_s, peak_window_s)) or bin_s <= 0:
            raise ValueError("arrival history: need 0 < level_window_s, trend_window_s, peak_window_s <= window_s "
                             "and bin_s > 0")
        self.peak_window_s = peak_window_s
        self.window_s = window_s
        self.level_window_s = level_window_s
        self.trend_window_s = trend_window_s
        self.bin_s = bin_s
        self.z = z
        self._times_s: deque[float] = deque()
        self._sizes: deque[tuple[int, int]] = deque(maxlen=mix_size)
        self.started_at_s: float | None = None

    @classmethod
    def for_cycle(cls, cycle_s: float) -> ArrivalHistory:
        """Windows counted in decision cycles: at a 60 s cycle, the defaults (15 min kept,
        a 2 min level, a 10 min trend in 30 s bins, the peak a scale-down must carry over
        5 min); a shorter cycle (a test cluster) shortens them alike, so that a 2 s cycle
        does not hold a scale-down for minutes of past peak."""
        return cls(15 * cycle_s, level_window_s=2 * cycle_s, trend_window_s=10 * cycle_s,
                   peak_window_s=5 * cycle_s, bin_s=cycle_s / 2)

    def observe(self, at_s: float, prompt_tokens: int, output_tokens: int) -> None:
        if self.started_at_s is None:
            self.started_at_s = at_s
        self._times_s.append(at_s)
        self._sizes.append((prompt_tokens, output_tokens))

    def _trim(self, now_s: float) -> None:
        while self._times_s and self._times_s[0] < now_s - self.window_s:
            self._times_s.popleft()

    def forecast(self, now_s: float, horizon_s: float) -> RateForecast:
        self._trim(now_s)
        times = np.fromiter(self._times_s, np.float64, len(self._times_s))
        observed_s = self._observed_s(now_s)
        level_s = min(self.level_window_s, observed_s)
        level = float(np.count_nonzero(times >= now_s - level_s)) / level_s if level_s > 0 else 0.0
        trend = self._trend(times, now_s, min(self.trend_window_s, observed_s))
        forecast = max(level, level + trend * horizon_s)
        upper = forecast + self.z * math.sqrt(max(level, 1.0 / max(level_s, 1.0)) / max(level_s, 1.0))
        peak = self._peak(times, now_s, min(self.peak_window_s, observed_s))
        return RateForecast(now_s, horizon_s, level, trend, forecast, upper, max(peak, level), len(times))

    def sample_sizes(self, count: int, rng: random.Random) -> list[tuple[int, int]]:
        """``count`` (prompt, output tokens) drawn from the recent mix (empty: none seen)."""
        if not self._sizes:
            return []
        return rng.choices(list(self._sizes), k=count)

    def _observed_s(self, now_s: float) -> float:
        if self.started_at_s is None:
            return 0.0
        return min(self.window_s, max(0.0, now_s - self.started_at_s))

    def _trend(self, times: np.ndarray, now_s: float, span_s: float) -> float:
        num_bins = int(span_s // self.bin_s)
        # A slope fitted to the first minutes of a run is mostly noise (one burst): none
        # until half the trend window was seen.
        if num_bins < 4 or span_s < self.trend_window_s / 2:
            return 0.0
        edges = now_s - self.bin_s * np.arange(num_bins, -1, -1)
        counts = np.histogram(times, bins=edges)[0] / self.bin_s
        centers = (edges[:-1] + edges[1:]) / 2
        return float(np.polyfit(centers - now_s, counts, 1)[0])

    def _peak(self, times: np.ndarray, now_s: float, span_s: float) -> float:
        num_slices = int(span_s // self.level_window_s)
        if num_slices < 1:
            return 0.0
        edges = now_s - self.level_window_s * np.arange(num_slices, -1, -1)
        return float(np.histogram(times, bins=edges)[0].max()) / self.level_window_s
