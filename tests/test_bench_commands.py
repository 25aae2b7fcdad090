"""The benchmark commands run end to end on tiny inputs and print the documented keys."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_blockq

SUMMARY_KEYS = {"policy", "rate", "requests", "completed", "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms",
                "tpot_mean_ms", "e2e_mean_ms", "e2e_p99_ms", "throughput_tokens_per_s", "goodput",
                "lag_p99_ms", "valid"}


def test_bench_runs_two_policies_and_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_blockq("bench", "--trace", "synthetic", "--instances", "2", "--policies", "round_robin,block",
                      "--rates", "6", "--requests", "24", "--time-scale", "0.25", "--seed", "3",
                      "--out", str(out), "--json", env={"BLOCKQ_REDIS_URL": ""}, timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert [r["policy"] for r in results] == ["round_robin", "block"]
    for result in results:
        assert result.keys() >= SUMMARY_KEYS
        assert result["requests"] == result["completed"] == 24   # every request accounted for
        assert result["rate"] == 6
    report = json.loads((out / "results.json").read_text())
    assert {len(records) for records in report["per_request"].values()} == {24}
    assert "| round_robin |" in (out / "results.md").read_text()
    for name in ("ttft_cdf.png", "e2e_cdf.png", "latency_vs_rate.png", "kv_usage.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dispatch_bench_prints_decision_latency(tmp_path: Path) -> None:
    done = run_blockq("dispatch-bench", "--instances", "3", "--running", "6", "--waiting", "2", "--requests", "30",
                      "--policy", "round_robin,block", "--json", timeout_s=120)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert [r["policy"] for r in results] == ["round_robin", "block"]
    for result in results:
        assert {"p50_ms", "p99_ms", "max_ms", "decisions_per_s"} <= result.keys()
        assert 0 < result["p50_ms"] <= result["p99_ms"] <= result["max_ms"]
