"""summarize() on hand-built records: percentiles, goodput, validity, None handling."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from loadgen.summaries import KvSample, RequestRecord, kv_usage_variance_series, summarize


def make_record(index: int, **overrides: object) -> RequestRecord:
    """A completed request whose latencies grow with ``index``."""
    fields: dict[str, object] = {
        "request_id": f"r{index}",
        "submitted_at_s": float(index),
        "instance": f"i{index % 2}",
        "prompt_tokens": 10,
        "true_output_tokens": 100,
        "predicted_output_tokens": 90,
        "output_tokens": 100,
        "queue_wait_ms": 5.0,
        "ttft_ms": 100.0 * (index + 1),
        "tpot_ms": 20.0,
        "e2e_ms": 100.0 * (index + 1) + 2000.0,
        "predicted_ttft_ms": 100.0 * (index + 1) + 10.0,
        "predicted_e2e_ms": None,
        "num_preemptions": 1 if index % 3 == 0 else 0,
        "ok": True,
    }
    fields.update(overrides)
    return RequestRecord(**fields)  # type: ignore[arg-type]


def test_percentiles_and_rates() -> None:
    records = [make_record(i) for i in range(10)]  # TTFT 100..1000 ms
    summary = summarize(records, duration_s=10.0)
    assert summary["requests"] == 10 and summary["completed"] == 10 and summary["failed"] == 0
    assert summary["ttft_mean_ms"] == pytest.approx(550.0)
    assert summary["ttft_p50_ms"] == pytest.approx(550.0)
    assert summary["ttft_p90_ms"] == pytest.approx(910.0)
    assert summary["ttft_p99_ms"] == pytest.approx(991.0)
    assert summary["e2e_p50_ms"] == pytest.approx(2550.0)
    assert summary["tpot_mean_ms"] == pytest.approx(20.0)
    assert summary["queue_wait_mean_ms"] == pytest.approx(5.0)
    assert summary["throughput_tokens_per_s"] == pytest.approx(100.0)
    assert summary["requests_per_s"] == pytest.approx(1.0)
    assert summary["length_mae_tokens"] == pytest.approx(10.0)
    assert summary["ttft_prediction_mae_ms"] == pytest.approx(10.0)
    assert summary["e2e_prediction_mae_ms"] is None
    assert summary["preemptions_total"] == 4
    assert summary["valid"] is True and summary["invalid_reason"] is None
    assert summary["lag_p99_ms"] is None and summary["kv_usage_variance_mean"] is None


def test_goodput_counts_failures_and_slo() -> None:
    records = [make_record(i) for i in range(4)]  # TTFT 100, 200, 300, 400
    records.append(make_record(4, ok=False, ttft_ms=None, e2e_ms=None, error="timeout"))
    records.append(make_record(5, ok=False, ttft_ms=50.0, error="worker died"))
    summary = summarize(records, duration_s=2.0, slo_ttft_ms=250.0)
    assert summary["completed"] == 4 and summary["failed"] == 2
    assert summary["goodput"] == pytest.approx(2 / 6)
    assert summary["goodput_requests_per_s"] == pytest.approx(1.0)
    assert summary["slo_ttft_ms"] == 250.0
    assert summary["ttft_mean_ms"] == pytest.approx(250.0)  # failed requests excluded


def test_validity_flag() -> None:
    records = [make_record(i) for i in range(3)]
    lag_ms = [1.0] * 98 + [200.0, 300.0]
    invalid = summarize(records, duration_s=1.0, lag_samples_ms=lag_ms, lag_bound_ms=50.0)
    assert invalid["lag_p99_ms"] > 50.0
    assert invalid["valid"] is False and "lag" in invalid["invalid_reason"]
    ok = summarize(records, duration_s=1.0, lag_samples_ms=[1.0, 2.0, 3.0], lag_mean_samples_ms=[0.5, 1.0, 0.0],
                   lag_bound_ms=50.0)
    assert ok["valid"] is True and ok["lag_p99_ms"] == pytest.approx(2.98)
    assert ok["lag_mean_ms"] == pytest.approx(0.5) and invalid["lag_mean_ms"] is None
    nothing_done = summarize([make_record(0, ok=False)], duration_s=1.0)
    assert (
        nothing_done["valid"] is False and "no request completed" in nothing_done["invalid_reason"]
    )


def test_empty_run_is_json_safe() -> None:
    summary = summarize([], duration_s=0.0, lag_samples_ms=[float("nan")])
    assert summary["requests"] == 0 and summary["goodput"] is None
    for key in ("ttft_mean_ms", "ttft_p99_ms", "tpot_p50_ms", "e2e_p90_ms", "throughput_tokens_per_s",
                "length_mae_tokens", "lag_p99_ms", "queue_wait_mean_ms"):  # fmt: skip
        assert summary[key] is None, key
    text = json.dumps(summary, allow_nan=False)
    assert "NaN" not in text
    assert summary["valid"] is True


def test_missing_fields_are_ignored_not_nan() -> None:
    records = [make_record(0, tpot_ms=None, queue_wait_ms=None, predicted_output_tokens=None)]
    records.append(replace(records[0], request_id="x", tpot_ms=float("nan")))
    summary = summarize(records, duration_s=1.0)
    assert summary["tpot_mean_ms"] is None and summary["queue_wait_mean_ms"] is None
    assert summary["length_mae_tokens"] is None
    assert not any(isinstance(v, float) and math.isnan(v) for v in summary.values())


def test_kv_usage_variance_over_time() -> None:
    samples = [
        KvSample(0.0, "a", 0.2), KvSample(0.1, "b", 0.6),  # bucket 0: var 0.04
        KvSample(1.2, "a", 0.5), KvSample(1.5, "b", 0.5),  # bucket 1: var 0
        KvSample(2.3, "a", 0.1),                           # bucket 2: b carried: var 0.04
    ]  # fmt: skip
    series = kv_usage_variance_series(samples, bucket_s=1.0)
    assert [start for start, _ in series] == [0.0, 1.0, 2.0]
    assert [v for _, v in series] == pytest.approx([0.04, 0.0, 0.04])
    summary = summarize([make_record(0)], duration_s=1.0, kv_samples=samples)
    assert summary["kv_usage_variance_mean"] == pytest.approx(0.08 / 3)
    assert kv_usage_variance_series([KvSample(0.0, "a", 0.3)]) == []
