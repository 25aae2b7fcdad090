"""Report writing (JSON, Markdown, PNG) and the capacity search."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen.plots import run_key
from loadgen.report import capacity_search, markdown_table, with_improvement_ratios, write_report
from loadgen.summaries import KvSample, RequestRecord, summarize

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _records(policy_scale: float, num: int = 20) -> list[RequestRecord]:
    return [
        RequestRecord(
            request_id=f"r{i}",
            submitted_at_s=0.1 * i,
            instance=f"i{i % 2}",
            prompt_tokens=10,
            true_output_tokens=50,
            predicted_output_tokens=45,
            output_tokens=50,
            queue_wait_ms=1.0,
            ttft_ms=policy_scale * (i + 1),
            tpot_ms=15.0,
            e2e_ms=policy_scale * (i + 1) + 750.0,
            predicted_ttft_ms=None,
            predicted_e2e_ms=None,
            num_preemptions=0,
            ok=True,
        )
        for i in range(num)
    ]


def _kv(scale: float) -> list[KvSample]:
    return [
        KvSample(0.5 * t, f"i{k}", min(1.0, scale * (t + k) / 20))
        for t in range(8)
        for k in range(2)
    ]


def _runs() -> tuple[list[dict], dict[str, list[RequestRecord]], dict[str, list[KvSample]]]:
    results, per_request, kv_samples = [], {}, {}
    for policy, scale in (("round_robin", 100.0), ("block", 25.0)):
        for rate in (2.0, 4.0):
            records = _records(scale * rate)
            key = run_key(policy, rate)
            per_request[key] = records
            kv_samples[key] = _kv(scale / 50)
            summary = summarize(records, duration_s=5.0, kv_samples=kv_samples[key])
            results.append({"policy": policy, "rate": rate, **summary})
    return results, per_request, kv_samples


def test_ratios_against_round_robin() -> None:
    results, _, _ = _runs()
    enriched = {(r["policy"], r["rate"]): r for r in with_improvement_ratios(results)}
    assert enriched[("block", 2.0)]["ttft_mean_speedup_vs_round_robin"] == pytest.approx(4.0)
    assert enriched[("round_robin", 4.0)]["ttft_p99_speedup_vs_round_robin"] == pytest.approx(1.0)
    invalid = dict(results[2], valid=False, invalid_reason="lag")
    assert (
        with_improvement_ratios([results[0], invalid])[1]["ttft_mean_speedup_vs_round_robin"]
        is None
    )


def test_markdown_table_rows_and_notes() -> None:
    results, _, _ = _runs()
    results[3] = dict(results[3], valid=False, invalid_reason="emulator lag p99 90 ms > 50 ms")
    table = markdown_table(results)
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(lines) == 1 + 4  # header + policy x rate
    assert lines[1].startswith("| round_robin | 2 |") and lines[3].startswith("| block | 2 |")
    assert "4.00×" in lines[3]
    assert "no (1)" in lines[4] and "emulator lag p99 90 ms" in table
    assert "TTFT mean ×rr" in lines[0]
    assert (
        "×rr" not in markdown_table([r for r in results if r["policy"] == "block"]).splitlines()[0]
    )


def test_write_report_files(tmp_path: Path) -> None:
    results, per_request, kv_samples = _runs()
    written = write_report(
        tmp_path / "out", results, per_request=per_request, kv_samples=kv_samples
    )
    expected = {
        "results.json",
        "results.md",
        "ttft_cdf.png",
        "e2e_cdf.png",
        "latency_vs_rate.png",
        "kv_usage.png",
    }
    assert set(written) == expected
    for name, path in written.items():
        assert path == tmp_path / "out" / name and path.stat().st_size > 0
        if name.endswith(".png"):
            assert path.read_bytes()[:8] == PNG_SIGNATURE
    document = json.loads(written["results.json"].read_text())
    assert len(document["results"]) == 4
    assert len(document["per_request"]["block@4"]) == 20
    assert document["per_request"]["block@4"][0]["request_id"] == "r0"
    assert document["kv_samples"]["round_robin@2"][0]["instance"] == "i0"
    assert "| block | 4 |" in written["results.md"].read_text()


def test_write_report_without_runs(tmp_path: Path) -> None:
    summary = summarize([], duration_s=0.0)
    written = write_report(tmp_path, [{"policy": "block", "rate": None, **summary}])
    assert written["ttft_cdf.png"].read_bytes()[:8] == PNG_SIGNATURE
    assert json.loads(written["results.json"].read_text())["results"][0]["ttft_mean_ms"] is None


def _threshold_runner(threshold: float, calls: list[float]):
    def run_at_rate(rate: float) -> dict:
        calls.append(rate)
        # P99 TTFT grows with the rate and crosses 3,000 ms exactly at the threshold.
        return {"ttft_p99_ms": 3000.0 * rate / threshold, "valid": True}

    return run_at_rate


def test_capacity_search_finds_threshold() -> None:
    calls: list[float] = []
    capacity, runs = capacity_search(
        _threshold_runner(27.3, calls), low=10.0, high=40.0, tolerance=0.5
    )
    assert 27.3 - 0.5 <= capacity <= 27.3
    assert [run["rate"] for run in runs] == calls and calls[:2] == [10.0, 40.0]
    assert len(calls) <= 2 + 8


def test_capacity_search_edges() -> None:
    capacity, runs = capacity_search(_threshold_runner(5.0, []), low=10.0, high=40.0)
    assert capacity == 0.0 and len(runs) == 1
    capacity, runs = capacity_search(_threshold_runner(50.0, []), low=10.0, high=40.0)
    assert capacity == 40.0 and len(runs) == 2
    capacity, _ = capacity_search(
        lambda rate: {"ttft_p99_ms": 1.0, "valid": rate < 20.0},
        low=10.0,
        high=40.0,
        tolerance=0.1,
        max_iterations=20,
    )
    assert 19.9 <= capacity < 20.0
    with pytest.raises(ValueError):
        capacity_search(lambda rate: {}, low=5.0, high=5.0)
