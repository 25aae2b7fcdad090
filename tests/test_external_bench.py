"""loadgen.benches.external: the tool's figures beside blockq's records, and the pairing."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from blockq.wire.protocol import DoneRecord
from loadgen.benches.external import build_parser, compare, markdown, vllm_bench_argv


def _done(index: int, ttft_ms: float) -> DoneRecord:
    return DoneRecord(
        request_id=f"r{index}", instance="inst-0", status="ok", prompt_tokens=200 + index, output_tokens=11,
        predicted_output_tokens=11, predictor_version="heuristic-1", policy="block", submitted_at_s=100.0 + index,
        finished_at_s=101.0 + index, queue_wait_ms=5.0, ttft_ms=ttft_ms, tpot_ms=20.0, e2e_ms=ttft_ms + 200.0,
        predicted_ttft_ms=None, predicted_e2e_ms=None, num_preemptions=0)


def test_requests_pair_in_submission_order_and_the_differences_are_the_hop() -> None:
    records = [_done(i, 50.0 + 10 * i) for i in range(4)]
    # The tool lists its requests in another order; each one saw 5 ms more TTFT and 8 ms more E2E.
    order = [2, 0, 3, 1]
    tool = {"start_times": [float(i) for i in order], "input_lens": [200 + i for i in order],
            "ttfts": [(55.0 + 10 * i) / 1000 for i in order], "latencies": [(258.0 + 10 * i) / 1000 for i in order],
            "duration": 4.0, "completed": 4, "mean_ttft_ms": 70.0, "mean_tpot_ms": 20.1}
    comparison = compare(tool, records)
    paired = comparison["paired"]
    assert paired["pairs"] == 4 and paired["prompt_tokens_mismatched"] == 0
    assert paired["ttft_added_mean_ms"] == pytest.approx(5.0) and paired["e2e_added_p99_ms"] == pytest.approx(8.0)
    row = {r["figure"]: r for r in comparison["rows"]}
    assert row["TTFT mean ms"] == {"figure": "TTFT mean ms", "tool": 70.0, "blockq": pytest.approx(65.0)}
    assert row["requests completed"]["blockq"] == 4
    assert row["output tokens/s"]["blockq"] == pytest.approx(44 / 4.0)
    assert "| TTFT mean ms | 70.0 | 65.0 |" in markdown(comparison)


def test_unequal_counts_are_not_paired() -> None:
    tool = {"start_times": [0.0], "input_lens": [200], "ttfts": [0.05], "latencies": [0.25], "duration": 1.0}
    assert compare(tool, [])["paired"] == {"pairs": 0}


def test_the_tool_is_told_to_skip_its_probe_and_warmups(tmp_path: Path) -> None:
    args: argparse.Namespace = build_parser().parse_args(["--tokenizer", "/tok", "--endpoint", "chat"])
    argv = vllm_bench_argv(args, "http://127.0.0.1:8000", tmp_path)
    assert argv[argv.index("--backend") + 1] == "openai-chat"
    assert argv[argv.index("--endpoint") + 1] == "/v1/chat/completions"
    assert argv[argv.index("--ready-check-timeout-sec") + 1] == "0" and "--ignore-eos" in argv
