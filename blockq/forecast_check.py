"""The forecast check: how far each instance's finished requests were from the forecast
made when they were placed, and whether its replica is still to be trusted.

Pure (no I/O, no clock): the live dispatcher feeds it the ``done`` records it follows
(:class:`dispatcher.metrics.DoneFollower`), the simulation the final records of its
instances; both through :meth:`ForecastCheck.observe`. Per instance it keeps the absolute
percentage errors of the last ``window`` answered requests that carried a forecast,
``|measured - forecast| / measured``, for TTFT and for E2E, and their medians (the median:
one preempted or stalled request must not flip an instance). An instance whose error
passes ``bound`` becomes *untrusted*; it is trusted again once its error is back under
``bound × recover_fraction`` (hysteresis: an error hovering at the bound does not flip the
state at every record). Each change of state is returned once, to be logged by the caller.
What the dispatcher does with an untrusted instance (``fallback``) is its own choice:
see docs/dispatcher.md, "The forecast check".
"""

from __future__ import annotations

import argparse
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol

from blockq.engine_model.latency import StepLatencyModel

# TTFT's error decides trust; E2E's is reported only. E2E also holds the length
# prediction's error (the forecast simulates the predicted length), which is not the
# replica's: on the paper's trace, healthy instances showed E2E errors of 5-55 % and TTFT
# errors of 3-7 %, and E2E deciding marked every healthy instance untrusted at some point
# (docs/results/forecast-check.md).
# What the dispatcher does with an untrusted instance: nothing but report it, or scale its
# replica's latency model by the measured / forecast ratio while it is untrusted.
# (Excluding untrusted instances was measured and not kept: docs/decisions/placement.md.)
FALLBACKS = ("none", "correct")


@dataclass(frozen=True)
class ForecastCheckOptions:
    """``window``: answered requests per instance the medians are taken over;
    ``min_samples``: fewer than this and the instance keeps its state (no verdict yet);
    ``bound``: median absolute percentage error (a fraction: 0.25 = 25 %) past which an
    instance is untrusted; ``recover_fraction``: trusted again under ``bound`` times this;
    ``fallback``: what the dispatcher
    does with an untrusted instance (:data:`FALLBACKS`)."""

    window: int = 50
    min_samples: int = 20
    bound: float = 0.25
    recover_fraction: float = 0.8
    fallback: str = "correct"

    def __post_init__(self) -> None:
        if self.window < 1 or not 1 <= self.min_samples <= self.window:
            raise ValueError(f"window, min_samples: need 1 <= min_samples <= window (got {self.window}, "
                             f"{self.min_samples})")
        if not self.bound > 0:
            raise ValueError(f"bound: must be > 0 (got {self.bound})")
        if not 0 < self.recover_fraction <= 1:
            raise ValueError(f"recover_fraction: must be in (0, 1] (got {self.recover_fraction})")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback: must be one of {', '.join(FALLBACKS)} (got {self.fallback!r})")


class AnsweredRecord(Protocol):
    """What the check reads of a final record (:class:`blockq.wire.protocol.DoneRecord`
    and :class:`~blockq.wire.protocol.FinalRecord` both have it); milliseconds."""

    instance: str
    status: str
    ttft_ms: float | None
    e2e_ms: float | None
    predicted_ttft_ms: float | None
    predicted_e2e_ms: float | None


@dataclass(frozen=True)
class TrustChange:
    """``instance_id`` became untrusted (``trusted`` False) or trusted again, after
    ``num_observed`` answered requests of it, with these median errors (fractions)."""

    instance_id: str
    trusted: bool
    num_observed: int
    ttft_mape: float | None
    e2e_mape: float | None
    bound: float

    @property
    def reason(self) -> str:
        state = "back under" if self.trusted else "past"
        return (f"median forecast error {state} the bound {self.bound:.0%}: TTFT "
                f"{_percent(self.ttft_mape)}, E2E {_percent(self.e2e_mape)}")


@dataclass(frozen=True)
class InstanceError:
    """One instance's figures: median absolute percentage errors (fractions; None: no
    record yet), the median measured / forecast TTFT ratio
    (:meth:`ForecastCheck.ratio`), records in the window, records observed in all, and
    whether its replica is trusted."""

    ttft_mape: float | None
    e2e_mape: float | None
    ratio: float | None
    num_samples: int
    num_observed: int
    trusted: bool

    def to_dict(self) -> dict[str, object]:
        return {"ttft_mape": _rounded(self.ttft_mape), "e2e_mape": _rounded(self.e2e_mape),
                "ratio": _rounded(self.ratio), "num_samples": self.num_samples,
                "num_observed": self.num_observed, "trusted": self.trusted}


@dataclass
class _Window:
    ttft: deque[float]
    e2e: deque[float]
    ttft_ratio: deque[float]
    num_observed: int = 0
    trusted: bool = True


@dataclass
class ForecastCheck:
    """Rolling per-instance forecast errors and trust (see the module docstring)."""

    options: ForecastCheckOptions = field(default_factory=ForecastCheckOptions)
    _windows: dict[str, _Window] = field(default_factory=dict)

    def observe(self, record: AnsweredRecord) -> TrustChange | None:
        """Take one final record; returns the instance's change of trust, if this record
        made one. Records not answered ``ok``, or without both a forecast and a
        measurement of E2E, are ignored (an ``infeasible`` answer ran nowhere)."""
        if record.status != "ok" or not record.instance:
            return None
        e2e_ape = forecast_ape(record.predicted_e2e_ms, record.e2e_ms)
        if e2e_ape is None:
            return None
        window = self._window(record.instance)
        window.e2e.append(e2e_ape)
        ttft_ape = forecast_ape(record.predicted_ttft_ms, record.ttft_ms)
        if ttft_ape is not None:
            window.ttft.append(ttft_ape)
            window.ttft_ratio.append(record.ttft_ms / record.predicted_ttft_ms)  # type: ignore[operator]
        window.num_observed += 1
        return self._judge(record.instance, window)

    def _window(self, instance_id: str) -> _Window:
        window = self._windows.get(instance_id)
        if window is None:
            size = self.options.window
            window = self._windows[instance_id] = _Window(*(deque(maxlen=size) for _ in range(3)))
        return window

    def _judge(self, instance_id: str, window: _Window) -> TrustChange | None:
        options = self.options
        if len(window.e2e) < options.min_samples:
            return None
        ttft, e2e = _median(window.ttft), _median(window.e2e)
        error = ttft
        if error is None:
            return None
        if window.trusted and error > options.bound:
            window.trusted = False
        elif not window.trusted and error < options.bound * options.recover_fraction:
            window.trusted = True
        else:
            return None
        return TrustChange(instance_id, window.trusted, window.num_observed, ttft, e2e, options.bound)

    def is_trusted(self, instance_id: str) -> bool:
        window = self._windows.get(instance_id)
        return window is None or window.trusted

    @property
    def untrusted_ids(self) -> frozenset[str]:
        return frozenset(i for i, window in self._windows.items() if not window.trusted)

    def ratio(self, instance_id: str) -> float:
        """Median measured / forecast TTFT over the window (the error that decides
        trust); 1.0 with no record."""
        window = self._windows.get(instance_id)
        if window is None:
            return 1.0
        ratio = _median(window.ttft_ratio)
        return 1.0 if ratio is None else ratio

    def instance_error(self, instance_id: str) -> InstanceError:
        window = self._windows.get(instance_id)
        if window is None:
            return InstanceError(None, None, None, 0, 0, True)
        return InstanceError(_median(window.ttft), _median(window.e2e), self.ratio(instance_id),
                             len(window.e2e), window.num_observed, window.trusted)

    def instance_errors(self) -> dict[str, InstanceError]:
        return {instance_id: self.instance_error(instance_id) for instance_id in sorted(self._windows)}

    def has_verdict(self, instance_id: str) -> bool:
        """Whether the window holds enough answers (``min_samples``) to judge by."""
        window = self._windows.get(instance_id)
        return window is not None and len(window.e2e) >= self.options.min_samples

    def restart(self, instance_id: str) -> None:
        """Score the instance afresh (its replica was just corrected: the answers in the
        window were forecast by the replica before), keeping its trust and its count."""
        window = self._windows.get(instance_id)
        if window is not None:
            for values in (window.ttft, window.e2e, window.ttft_ratio):
                values.clear()

    def forget(self, instance_id: str) -> None:
        """Drop an instance's record (it left the fleet)."""
        self._windows.pop(instance_id, None)


def score_records(records: Iterable[AnsweredRecord], options: ForecastCheckOptions | None = None
                  ) -> dict[str, InstanceError]:
    """Every instance's figures over ``records`` (oldest first), as a dispatcher that had
    read exactly these would hold them: what ``blockq status`` and ``blockq top`` show from
    the newest ``done`` records (the dispatcher's own state also remembers older ones)."""
    check = ForecastCheck(options or ForecastCheckOptions())
    for record in records:
        check.observe(record)
    return check.instance_errors()


def scaled_latency_model(model: StepLatencyModel, factor: float) -> StepLatencyModel:
    """``model`` with every step ``factor`` times as long (all four terms scale)."""
    if factor == 1.0:
        return model
    return replace(model, linear_scale=model.linear_scale * factor, kv_token_s=model.kv_token_s * factor,
                   prefill_pair_s=model.prefill_pair_s * factor, step_overhead_s=model.step_overhead_s * factor)


def forecast_ape(forecast_ms: float | None, measured_ms: float | None) -> float | None:
    """Absolute percentage error against the measurement; None when either is missing
    or the measurement is not positive (nothing to divide by)."""
    if not isinstance(forecast_ms, int | float) or not isinstance(measured_ms, int | float):
        return None
    if measured_ms <= 0 or forecast_ms <= 0:
        return None
    return abs(measured_ms - forecast_ms) / measured_ms


def _median(values: deque[float]) -> float | None:
    return statistics.median(values) if values else None


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def add_forecast_check_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The forecast check's options, the same for ``blockq dispatcher`` and ``blockq
    simulate`` (read back by :func:`forecast_check_options_from_args`)."""
    defaults = ForecastCheckOptions()
    parser.add_argument("--forecast-fallback", choices=FALLBACKS, default=defaults.fallback,
                        help="what to do with an instance whose TTFT forecasts are off: none (report only), "
                             "correct (scale its replica's steps by the square root of measured / forecast)")
    parser.add_argument("--forecast-window", type=int, default=defaults.window,
                        help="answered requests per instance the median error is taken over")
    parser.add_argument("--forecast-min-samples", type=int, default=defaults.min_samples,
                        help="answers of an instance before its first verdict (at most --forecast-window)")
    parser.add_argument("--forecast-bound", type=float, default=defaults.bound,
                        help="median absolute percentage error (fraction, 0.25 = 25 %%) past which an instance "
                             "is untrusted; trusted again under the bound times 0.8")


def forecast_check_options_from_args(args: argparse.Namespace) -> ForecastCheckOptions:
    return ForecastCheckOptions(window=args.forecast_window,
                                min_samples=min(args.forecast_min_samples, args.forecast_window),
                                bound=args.forecast_bound, fallback=args.forecast_fallback)
