"""Online prediction quality: rolling accuracy, prompt-length drift and alerts (pure).

:class:`QualityMonitor` ingests one feedback record per finished request (predicted
and true output tokens, prompt tokens) and keeps, over the last ``window_size``
records: MAE, Acc-50 and Acc-100, and the population stability index (PSI) of the
prompt lengths against the training distribution stored in the model's manifest.

Alerts (returned by :meth:`QualityMonitor.ingest`, never raised):

- ``accuracy_drop``: rolling Acc-50 more than ``acc50_drop_points`` percentage points
  (default 15) below the manifest's validation Acc-50;
- ``prompt_drift``: PSI above ``psi_threshold`` (default 0.25, the usual "major shift").

Each alert fires once when its condition starts to hold (with at least
``min_samples`` records in the window) and re-arms once the figure is back past its
threshold by a margin (Acc-50 5 points above the floor; PSI below 80 % of its threshold),
so that neither a persistent problem nor a figure hovering at the threshold produces one
alert per request. No clock, no I/O.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from predictor_service.manifest import Manifest

ACCURACY_DROP = "accuracy_drop"
PROMPT_DRIFT = "prompt_drift"
_PSI_FLOOR = 1e-4
# Hysteresis: how far back past its threshold a figure must come before its alert re-arms.
ACC50_REARM_POINTS = 5.0
PSI_REARM_FRACTION = 0.8


@dataclass(frozen=True)
class QualitySnapshot:
    """Rolling figures over the last ``num_samples`` records (fractions, tokens)."""

    num_samples: int
    rolling_mae: float
    rolling_acc50: float
    rolling_acc100: float
    prompt_psi: float
    validation_acc50: float


@dataclass(frozen=True)
class QualityAlert:
    """A structured alert: ``kind`` is ``accuracy_drop`` or ``prompt_drift``.

    ``value`` is the observed figure (rolling Acc-50 as a fraction, or the PSI) and
    ``threshold`` the bound it crossed (in the same unit); ``message`` says it in words.
    """

    kind: str
    value: float
    threshold: float
    num_samples: int
    model_version: str
    message: str


def population_stability_index(expected: Sequence[float], observed: Sequence[float]) -> float:
    """PSI = sum((o - e) * ln(o / e)) over bins of two distributions (shares per bin).

    Shares are floored at 1e-4 so empty bins stay finite. 0 for identical inputs;
    < 0.1 is usually read as stable, > 0.25 as a major shift.
    """
    if len(expected) != len(observed):
        raise ValueError("expected and observed must have the same number of bins")
    total = 0.0
    for expected_share, observed_share in zip(expected, observed, strict=True):
        e = max(expected_share, _PSI_FLOOR)
        o = max(observed_share, _PSI_FLOOR)
        total += (o - e) * math.log(o / e)
    return total


class QualityMonitor:
    """Rolling quality of a deployed predictor (see the module docstring).

    ``validation_acc50`` is a fraction (0.70 = 70 %); ``prompt_token_bin_edges`` /
    ``prompt_token_bin_fractions`` describe the training prompt lengths (may be empty:
    no drift statistic then).
    """

    def __init__(
        self,
        *,
        validation_acc50: float,
        prompt_token_bin_edges: Sequence[float] = (),
        prompt_token_bin_fractions: Sequence[float] = (),
        model_version: str = "",
        window_size: int = 1000,
        min_samples: int = 100,
        acc50_drop_points: float = 15.0,
        psi_threshold: float = 0.25,
    ) -> None:
        if window_size < 1 or min_samples < 1:
            raise ValueError("window_size and min_samples: must be >= 1")
        if (
            prompt_token_bin_fractions
            and len(prompt_token_bin_fractions) != len(prompt_token_bin_edges) + 1
        ):
            raise ValueError("prompt_token_bin_fractions: need one more entry than the edges")
        self.validation_acc50 = float(validation_acc50)
        self.bin_edges = tuple(float(edge) for edge in prompt_token_bin_edges)
        self.bin_fractions = tuple(float(share) for share in prompt_token_bin_fractions)
        self.model_version = model_version
        self.window_size = window_size
        self.min_samples = min(min_samples, window_size)
        self.acc50_drop_points = float(acc50_drop_points)
        self.psi_threshold = float(psi_threshold)
        self._errors: deque[float] = deque()
        self._bins: deque[int] = deque()
        self._sum_errors = 0.0
        self._num_within_50 = 0
        self._num_within_100 = 0
        self._bin_counts = [0] * (len(self.bin_edges) + 1)
        self._active_alerts: set[str] = set()

    @classmethod
    def from_manifest(cls, manifest: Manifest, **settings: float | int) -> QualityMonitor:
        """A monitor for the model a manifest describes (validation Acc-50, bins)."""
        return cls(
            validation_acc50=float(manifest.metrics.get("acc50", 0.0)),
            prompt_token_bin_edges=manifest.prompt_token_bin_edges,
            prompt_token_bin_fractions=manifest.prompt_token_bin_fractions,
            model_version=manifest.version,
            **settings,  # type: ignore[arg-type]
        )

    def ingest(
        self, predicted_tokens: int, true_tokens: int, prompt_tokens: int
    ) -> list[QualityAlert]:
        """Add one finished request; return the alerts that start with it (often [])."""
        error = abs(float(predicted_tokens) - float(true_tokens))
        bin_index = bisect.bisect_left(self.bin_edges, float(prompt_tokens))
        self._errors.append(error)
        self._bins.append(bin_index)
        self._add(error, bin_index, +1)
        if len(self._errors) > self.window_size:
            self._add(self._errors.popleft(), self._bins.popleft(), -1)
        return self._check_alerts()

    def _add(self, error: float, bin_index: int, sign: int) -> None:
        self._sum_errors += sign * error
        self._num_within_50 += sign * (error <= 50)
        self._num_within_100 += sign * (error <= 100)
        self._bin_counts[bin_index] += sign

    def snapshot(self) -> QualitySnapshot:
        """Current rolling figures (NaN while the window is empty)."""
        num_samples = len(self._errors)
        if num_samples == 0:
            nan = float("nan")
            return QualitySnapshot(0, nan, nan, nan, nan, self.validation_acc50)
        return QualitySnapshot(
            num_samples=num_samples,
            rolling_mae=self._sum_errors / num_samples,
            rolling_acc50=self._num_within_50 / num_samples,
            rolling_acc100=self._num_within_100 / num_samples,
            prompt_psi=self._prompt_psi(num_samples),
            validation_acc50=self.validation_acc50,
        )

    def _prompt_psi(self, num_samples: int) -> float:
        if not self.bin_fractions:
            return float("nan")
        observed = [count / num_samples for count in self._bin_counts]
        return population_stability_index(self.bin_fractions, observed)

    def _check_alerts(self) -> list[QualityAlert]:
        snapshot = self.snapshot()
        if snapshot.num_samples < self.min_samples:
            return []
        acc50_floor = self.validation_acc50 - self.acc50_drop_points / 100.0
        conditions = {
            ACCURACY_DROP: (
                snapshot.rolling_acc50 < acc50_floor,
                snapshot.rolling_acc50 >= acc50_floor + ACC50_REARM_POINTS / 100.0,
                snapshot.rolling_acc50,
                acc50_floor,
                f"rolling Acc-50 {snapshot.rolling_acc50:.1%} is more than "
                f"{self.acc50_drop_points:g} points below validation "
                f"{self.validation_acc50:.1%}",
            ),
            PROMPT_DRIFT: (
                snapshot.prompt_psi > self.psi_threshold,
                snapshot.prompt_psi < self.psi_threshold * PSI_REARM_FRACTION,
                snapshot.prompt_psi,
                self.psi_threshold,
                f"prompt-length PSI {snapshot.prompt_psi:.3f} exceeds {self.psi_threshold:g}",
            ),
        }
        alerts = []
        for kind, (holds, clears, value, threshold, message) in conditions.items():
            if holds and kind not in self._active_alerts:
                self._active_alerts.add(kind)
                alerts.append(
                    QualityAlert(
                        kind=kind,
                        value=float(value),
                        threshold=float(threshold),
                        num_samples=snapshot.num_samples,
                        model_version=self.model_version,
                        message=message,
                    )
                )
            elif clears:
                self._active_alerts.discard(kind)
        return alerts
