"""Per-request records of a replay and the summary figures computed from them.

Pure functions over frozen records: no clock, no Redis. Percentiles are numpy's linear
interpolation between order statistics. Every figure that has no data (no completed
request, no prediction, no heartbeat sample) is None, never NaN, so the summary can be
written as JSON as is.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from blockq.forecast_check import forecast_ape

DEFAULT_SLO_TTFT_MS = 3000.0
DEFAULT_LAG_BOUND_MS = 50.0
DEFAULT_KV_BUCKET_S = 1.0
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestRecord:
    """What happened to one replayed request (filled from the worker's final record).

    Times are milliseconds; None means not observed (e.g. ``ttft_ms`` of a request that
    failed before its first token, ``queue_wait_ms`` when the worker did not report it).
    ``submitted_at_s`` is seconds since the start of the run. ``output_tokens`` is what
    the engine actually generated; ``true_output_tokens`` the trace's recorded length.
    ``predicted_ttft_ms`` / ``predicted_e2e_ms`` are the dispatcher's predictions for the
    chosen instance. ``ok`` is False for failed, timed-out or rejected requests, with
    ``error`` saying why.
    """

    request_id: str
    submitted_at_s: float
    instance: str | None
    prompt_tokens: int
    true_output_tokens: int
    predicted_output_tokens: int | None
    output_tokens: int
    queue_wait_ms: float | None
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None
    predicted_ttft_ms: float | None
    predicted_e2e_ms: float | None
    num_preemptions: int
    ok: bool
    error: str | None = None
    status: str = "ok"
    # When the placement was decided, model ms after submission (None: not known): the
    # forecasts count from there, the measured times from submission.
    decided_after_ms: float | None = None
    # Prompt tokens the engine found in its prefix cache, and those the dispatcher predicted
    # it would (None: not reported).
    cached_tokens: int | None = None
    predicted_cached_tokens: int | None = None


@dataclass(frozen=True)
class KvSample:
    """One instance's KV-cache usage (fraction of blocks in use, 0..1) at ``at_s`` (run seconds)."""

    at_s: float
    instance: str
    kv_used_fraction: float


def _finite(values: Iterable[float | None]) -> np.ndarray:
    """The values that are present and finite, as a float64 array."""
    kept = [float(v) for v in values if v is not None and math.isfinite(v)]
    return np.asarray(kept, dtype=np.float64)


def _mean(values: np.ndarray) -> float | None:
    return float(values.mean()) if values.size else None


def _percentile(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None


def _distribution(prefix: str, values: np.ndarray) -> dict[str, float | None]:
    """``{prefix}_mean_ms`` and ``{prefix}_p{50,90,99}_ms`` of the values."""
    figures: dict[str, float | None] = {f"{prefix}_mean_ms": _mean(values)}
    for q in PERCENTILES:
        figures[f"{prefix}_p{q}_ms"] = _percentile(values, q)
    return figures


def _mean_absolute_error(pairs: Iterable[tuple[float | None, float | None]]) -> float | None:
    errors = _finite(
        abs(predicted - actual)
        for predicted, actual in pairs
        if predicted is not None and actual is not None
    )
    return _mean(errors)


def _prefix_hits(completed: Sequence[RequestRecord]) -> dict[str, float | int | None]:
    pairs = [(r.predicted_cached_tokens, r.cached_tokens) for r in completed
             if r.predicted_cached_tokens is not None and r.cached_tokens is not None]
    predicted = sum(p for p, _ in pairs)
    measured = sum(m for _, m in pairs)
    return {"prefix_hit_tokens_measured": measured if pairs else None,
            "prefix_hit_tokens_predicted": predicted if pairs else None,
            "prefix_hit_prediction_error": predicted / measured - 1 if measured else None}


def _forecast_ape_p50(pairs: Iterable[tuple[float | None, float | None]]) -> float | None:
    """Median over requests of |measured - forecast| / measured (a fraction; requests
    without a forecast or a positive measurement left out)."""
    errors = _finite(forecast_ape(forecast, measured) for forecast, measured in pairs)
    return _percentile(errors, 50)


def _since_decision(measured_ms: float | None, record: RequestRecord) -> float | None:
    """A time measured from submission, counted from the placement decision instead
    (what a forecast made there predicts) when the record says when that was."""
    if measured_ms is None or record.decided_after_ms is None:
        return measured_ms
    return measured_ms - record.decided_after_ms


def kv_usage_variance_series(
    kv_samples: Sequence[KvSample], *, bucket_s: float = DEFAULT_KV_BUCKET_S
) -> list[tuple[float, float]]:
    """Across-instance variance of KV usage per time bucket: [(bucket start s, variance)].

    Time is cut into ``bucket_s`` buckets from the first sample. In each bucket an
    instance's usage is the mean of its samples there, or its last known usage when it
    has none (heartbeats need not line up with buckets). Variance is the population
    variance over the instances known so far; buckets with fewer than two known
    instances are left out.
    """
    if bucket_s <= 0:
        raise ValueError(f"bucket_s must be > 0, got {bucket_s}")
    samples = sorted(
        (s for s in kv_samples if math.isfinite(s.at_s) and math.isfinite(s.kv_used_fraction)),
        key=lambda s: s.at_s,
    )
    if not samples:
        return []
    start_s = samples[0].at_s
    bucket_to_samples: dict[int, list[KvSample]] = defaultdict(list)
    for sample in samples:
        bucket_to_samples[int((sample.at_s - start_s) // bucket_s)].append(sample)
    instance_to_usage: dict[str, float] = {}
    series: list[tuple[float, float]] = []
    for bucket in range(max(bucket_to_samples) + 1):
        instance_to_values: dict[str, list[float]] = defaultdict(list)
        for sample in bucket_to_samples.get(bucket, []):
            instance_to_values[sample.instance].append(sample.kv_used_fraction)
        for instance, values in instance_to_values.items():
            instance_to_usage[instance] = sum(values) / len(values)
        if len(instance_to_usage) >= 2:
            usage = np.fromiter(instance_to_usage.values(), dtype=np.float64)
            series.append((start_s + bucket * bucket_s, float(usage.var())))
    return series


def summarize(
    records: Sequence[RequestRecord],
    *,
    duration_s: float,
    kv_samples: Sequence[KvSample] = (),
    lag_samples_ms: Sequence[float] = (),
    lag_mean_samples_ms: Sequence[float] = (),
    delivery_samples_ms: Sequence[float] = (),
    slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS,
    lag_bound_ms: float = DEFAULT_LAG_BOUND_MS,
    kv_bucket_s: float = DEFAULT_KV_BUCKET_S,
) -> dict[str, Any]:
    """The summary figures of one run, as a flat JSON-able dict (None where no data).

    * counts: ``requests``, ``completed`` (``ok``), ``failed``, ``preemptions_total``,
      ``output_tokens_total`` (completed requests);
    * latency distributions over completed requests: ``ttft_*``, ``tpot_*``, ``e2e_*``
      (``_mean_ms``, ``_p50_ms``, ``_p90_ms``, ``_p99_ms``), ``queue_wait_mean_ms`` and
      ``queue_wait_p99_ms``;
    * rates over ``duration_s`` (the run's wall time; None when it is not > 0):
      ``throughput_tokens_per_s`` (output tokens), ``requests_per_s`` (completed),
      ``goodput_requests_per_s``;
    * ``goodput``: the share of all requests that completed with ``ttft_ms <=
      slo_ttft_ms`` (``slo_ttft_ms`` is echoed); ``infeasible``: the share answered
      ``infeasible`` (``infeasible_answer_p99_ms``: how long those answers took);
      ``answered_within_slo``: the share that either completed within the SLO or was
      answered infeasible within it;
    * ``kv_usage_variance_mean``: mean over time of the across-instance variance of
      ``kv_used_fraction`` (:func:`kv_usage_variance_series`, ``kv_bucket_s`` buckets);
    * prediction errors (mean absolute): ``length_mae_tokens`` — predicted vs actually
      generated output tokens of completed requests; ``ttft_prediction_mae_ms`` and
      ``e2e_prediction_mae_ms`` — the dispatcher's predictions vs measured;
      ``ttft_forecast_ape_p50`` / ``e2e_forecast_ape_p50``: the median over completed
      requests of the placement forecast's absolute error as a fraction of the measurement
      (both counted from the decision where the record has it);
    * prefix-cache hits: ``prefix_hit_tokens_measured`` / ``prefix_hit_tokens_predicted``,
      the prompt tokens the engines found cached and those the dispatcher predicted they
      would, summed over the completed requests that report both, and
      ``prefix_hit_prediction_error`` = predicted / measured - 1 (None without hits);
    * the host: ``lag_mean_ms``, the mean of the beats' mean step lag (model ms: how late
      an emulated engine's steps ended on this host; what ``blockq simulate --step-lag-ms``
      takes, times the time scale, to replay the run as this host ran it), and
      ``delivery_p90_mean_ms``, the mean of the beats' delivery p90 (wall ms from a
      placement's decision to the engine's intake);
    * validity: ``lag_p99_ms`` (p99 of the emulator's lag samples), ``valid`` and
      ``invalid_reason``. A run is invalid when its lag p99 exceeds ``lag_bound_ms``
      (the emulator fell behind real time, so its latencies are not trustworthy) or when
      no request completed. Without lag samples the lag check passes.
    """
    completed = [record for record in records if record.ok]
    num_requests = len(records)
    ttft_ms = _finite(record.ttft_ms for record in completed)
    summary: dict[str, Any] = {
        "requests": num_requests,
        "completed": len(completed),
        "failed": num_requests - len(completed),
        "duration_s": float(duration_s),
    }
    summary.update(_distribution("ttft", ttft_ms))
    summary.update(_distribution("tpot", _finite(r.tpot_ms for r in completed)))
    summary.update(_distribution("e2e", _finite(r.e2e_ms for r in completed)))
    queue_wait_ms = _finite(record.queue_wait_ms for record in completed)
    summary["queue_wait_mean_ms"] = _mean(queue_wait_ms)
    summary["queue_wait_p99_ms"] = _percentile(queue_wait_ms, 99)

    output_tokens_total = sum(record.output_tokens for record in completed)
    num_good = sum(
        1
        for record in completed
        if record.ttft_ms is not None
        and math.isfinite(record.ttft_ms)
        and record.ttft_ms <= slo_ttft_ms
    )
    has_duration = math.isfinite(duration_s) and duration_s > 0
    summary["output_tokens_total"] = output_tokens_total
    summary["throughput_tokens_per_s"] = output_tokens_total / duration_s if has_duration else None
    summary["requests_per_s"] = len(completed) / duration_s if has_duration else None
    summary["goodput"] = num_good / num_requests if num_requests else None
    summary["goodput_requests_per_s"] = num_good / duration_s if has_duration else None
    summary["slo_ttft_ms"] = float(slo_ttft_ms)
    refused_ms = _finite(r.e2e_ms for r in records if r.status == "infeasible")
    num_refused_in_time = int((refused_ms <= slo_ttft_ms).sum())
    summary["infeasible"] = refused_ms.size / num_requests if num_requests else None
    summary["infeasible_answer_p99_ms"] = _percentile(refused_ms, 99)
    summary["answered_within_slo"] = (num_good + num_refused_in_time) / num_requests if num_requests else None

    variance_series = kv_usage_variance_series(kv_samples, bucket_s=kv_bucket_s)
    summary["kv_usage_variance_mean"] = (
        _mean(np.asarray([variance for _, variance in variance_series]))
        if variance_series
        else None
    )
    summary["length_mae_tokens"] = _mean_absolute_error(
        (record.predicted_output_tokens, record.output_tokens) for record in completed
    )
    summary["ttft_prediction_mae_ms"] = _mean_absolute_error(
        (record.predicted_ttft_ms, record.ttft_ms) for record in completed
    )
    summary["e2e_prediction_mae_ms"] = _mean_absolute_error(
        (record.predicted_e2e_ms, record.e2e_ms) for record in completed
    )
    summary["ttft_forecast_ape_p50"] = _forecast_ape_p50(
        (r.predicted_ttft_ms, _since_decision(r.ttft_ms, r)) for r in completed)
    summary["e2e_forecast_ape_p50"] = _forecast_ape_p50(
        (r.predicted_e2e_ms, _since_decision(r.e2e_ms, r)) for r in completed)
    summary.update(_prefix_hits(completed))
    summary["preemptions_total"] = sum(record.num_preemptions for record in records)
    lag_means_ms = _finite(lag_mean_samples_ms)
    summary["lag_mean_ms"] = float(lag_means_ms.mean()) if len(lag_means_ms) else None
    summary["delivery_p90_mean_ms"] = _mean(_finite(delivery_samples_ms))
    summary.update(_validity(len(completed), num_requests, lag_samples_ms, lag_bound_ms))
    return summary


def _validity(
    num_completed: int, num_requests: int, lag_samples_ms: Sequence[float], lag_bound_ms: float
) -> dict[str, Any]:
    """``lag_p99_ms``, ``lag_bound_ms``, ``valid`` and ``invalid_reason`` of a run."""
    lag_p99_ms = _percentile(_finite(lag_samples_ms), 99)
    reasons: list[str] = []
    if lag_p99_ms is not None and lag_p99_ms > lag_bound_ms:
        reasons.append(f"emulator lag p99 {lag_p99_ms:.1f} ms > bound {lag_bound_ms:g} ms")
    if num_requests and not num_completed:
        reasons.append("no request completed")
    return {
        "lag_p99_ms": lag_p99_ms,
        "lag_bound_ms": float(lag_bound_ms),
        "valid": not reasons,
        "invalid_reason": "; ".join(reasons) if reasons else None,
    }
