"""The fidelity tools' pure parts: the replay loop, the engine model as a replay engine, the
profile's sweep and fit, the workload, the scoring and measured profiles as presets. The
runs on a real vLLM engine are in tests/test_vllm_fidelity.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from blockq.engine_model.config import EngineConfig
from blockq.engine_model.latency import StepLatencyModel
from blockq.engine_model.measured_profile import MeasuredProfile, load_profile
from blockq.engine_model.presets import get_preset
from loadgen.fidelity.cli import find_capacity, score_load, simulate
from loadgen.fidelity.model_engine import ModelReplayEngine
from loadgen.fidelity.profile import design_sweep, fit_latency_model, step_kind
from loadgen.fidelity.replay_loop import (
    ReplayRequest,
    ReplayResult,
    RequestTimes,
    StepRecord,
    replay,
)
from loadgen.fidelity.trace_sample import (
    RequestLengths,
    build_requests,
    prompt_token_ids,
    sample_lengths,
)

CONFIG = EngineConfig(num_gpu_blocks=400, block_size=32, max_num_seqs=8, max_num_batched_tokens=256,
                      max_model_len=1024, watermark=0.0)
# A model the fit can represent exactly: its knots are among the fit's, its overhead a
# constant the table absorbs.
TRUE_MODEL = StepLatencyModel(linear_knot_tokens=(1, 8, 64, 256), linear_knot_s=(0.004, 0.006, 0.015, 0.05),
                              kv_token_s=2e-6, prefill_pair_s=3e-8, step_overhead_s=0.002)


def _request(request_id: str, prompt: int, output: int, **kwargs: object) -> ReplayRequest:
    return ReplayRequest(request_id, tuple(range(100, 100 + prompt)), output, **kwargs)  # type: ignore[arg-type]


def test_replay_runs_phases_in_turn_and_stamps_each_request() -> None:
    engine = ModelReplayEngine(CONFIG, TRUE_MODEL)
    requests = [_request("a", 40, 5, arrival_s=0.0), _request("b", 300, 3, arrival_s=0.5),
                _request("c", 20, 4, phase=1)]
    result = replay(engine, requests)
    times = {r.request_id: r for r in result.requests}
    assert [r.request_id for r in result.requests] == ["a", "b", "c"]
    assert all(t.num_output_tokens == n for t, n in zip(result.requests, (5, 3, 4), strict=True))
    # "b" arrives at 0.5 s on an engine idle since "a" finished: the clock jumps there.
    assert times["a"].finished_s < 0.5 and times["b"].arrival_s == pytest.approx(0.5)
    # "b"'s 300-token prompt takes two chunks of the 256-token budget before its first token.
    b_steps = [s for s in result.steps if s.started_s >= 0.5 and s.phase == 0]
    assert b_steps[0].num_prefill_tokens == 256 and b_steps[1].num_prefill_tokens == 44
    assert times["b"].ttft_s == pytest.approx(b_steps[0].duration_s + b_steps[1].duration_s)
    # Phase 1 starts only once phase 0 has drained.
    assert times["c"].arrival_s >= times["b"].finished_s
    assert all(s.phase == 1 for s in result.steps if s.started_s >= times["c"].arrival_s)


def test_arrival_step_holds_a_request_until_that_many_steps_ran() -> None:
    engine = ModelReplayEngine(CONFIG, TRUE_MODEL)
    result = replay(engine, [_request("decoder", 16, 10), _request("joiner", 64, 1, arrival_step=4)])
    kinds = [step_kind(s) for s in result.steps]
    assert kinds[:4] == ["prefill", "decode", "decode", "decode"]
    assert kinds[4] == "mixed" and result.steps[4].num_prefill_tokens == 64


def test_profile_fit_recovers_a_known_model_from_its_sweep() -> None:
    requests = design_sweep(CONFIG.max_num_seqs, CONFIG.max_num_batched_tokens, CONFIG.max_model_len)
    steps = replay(ModelReplayEngine(CONFIG, TRUE_MODEL), requests).steps
    assert {step_kind(s) for s in steps} == {"prefill", "decode", "mixed"}
    assert max(s.num_prefill_tokens for s in steps) == CONFIG.max_num_batched_tokens
    assert max(s.num_decode_seqs for s in steps) == CONFIG.max_num_seqs
    fitted, report = fit_latency_model(steps, CONFIG.max_num_batched_tokens)
    for kind in ("all", "prefill", "decode", "mixed"):
        assert report[kind]["rel_error_max"] < 1e-3, (kind, report[kind])
    assert fitted.kv_token_s == pytest.approx(TRUE_MODEL.kv_token_s, rel=1e-3)
    assert fitted.prefill_pair_s == pytest.approx(TRUE_MODEL.prefill_pair_s, rel=1e-3)


def test_profile_fit_reports_the_error_of_a_model_it_cannot_represent() -> None:
    steps = [StepRecord(0, 0.0, 0.01 * (1 + (k % 2)), 0, 4, 400, 0) for k in range(40)]  # 10 or 20 ms
    _, report = fit_latency_model(steps, 256)
    # Least squares on relative errors puts the step at 12 ms: 20 % and 40 % off.
    assert report["decode"]["rel_error_p50"] == pytest.approx(0.3, rel=0.01)
    assert report["decode"]["rel_error_max"] == pytest.approx(0.4, rel=0.01)
    with pytest.raises(ValueError, match="steps"):
        fit_latency_model(steps[:3], 256)


def test_workload_shares_prefixes_within_a_group_and_never_across_loads(tmp_path: Path) -> None:
    trace = tmp_path / "lengths.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(
        f"{100 + 37 * i},{20 + i}\n" for i in range(30)) + "5000,10\n")
    lengths = sample_lengths(str(trace), 12, seed=3, max_model_len=1024)
    assert len(lengths) == 12 and all(item.prompt_tokens < 1024 for item in lengths)
    assert lengths == sample_lengths(str(trace), 12, seed=3, max_model_len=1024)
    first, same_group, other_group = (prompt_token_ids(row, 400, 0, 1, 4) for row in (0, 4, 1))
    assert first[:192] == same_group[:192] and first[200:] != same_group[200:]
    assert first[:16] != other_group[:16]
    assert prompt_token_ids(0, 400, 1, 1, 4)[:16] != first[:16]  # another load
    requests = build_requests(lengths, [1.0, 2.0], seed=3)
    assert [r.phase for r in requests] == [0] * 12 + [1] * 12
    assert requests[12].request_id == "L1-0" and requests[12].max_tokens == lengths[0].output_tokens


def test_prefix_groups_make_the_engine_model_hit() -> None:
    config = EngineConfig(**{**CONFIG.to_dict(), "enable_prefix_caching": True})
    lengths = [RequestLengths(i, 300, 4) for i in range(8)]
    shared = simulate(config, TRUE_MODEL, lengths, [0.5], seed=1, prefix_groups=2)
    alone = simulate(config, TRUE_MODEL, lengths, [0.5], seed=1, prefix_groups=0)
    # Two groups: each group's first prompt misses; the 6 others hit 128 tokens (4 blocks of 32).
    assert sum(s.num_prefix_hit_tokens for s in shared.steps) == 6 * 128
    assert sum(s.num_prefix_hit_tokens for s in alone.steps) == 0


def test_capacity_is_the_highest_rate_within_the_slo() -> None:
    lengths = [RequestLengths(i, 50 + 13 * i, 20 + 3 * i) for i in range(40)]

    def p99_ttft_s(rate: float) -> float:
        result = simulate(CONFIG, TRUE_MODEL, lengths, [rate], seed=2, prefix_groups=0)
        return float(np.quantile([r.ttft_s for r in result.requests], 0.99))

    capacity = find_capacity(CONFIG, TRUE_MODEL, lengths, 2, 0, slo_ttft_s=0.5)
    assert p99_ttft_s(capacity) <= 0.5 < p99_ttft_s(capacity * 1.05)


def test_score_load_compares_request_by_request() -> None:
    def result(ttfts: list[float], preempted: int, hits: int) -> ReplayResult:
        requests = [RequestTimes(f"L0-{i}", 0.0, ttft, 2 * ttft, 3) for i, ttft in enumerate(ttfts)]
        return ReplayResult(requests, [StepRecord(0, 0.0, 0.01, 0, 1, 1, 0, preempted, hits)])

    real = result([0.1, 0.2, 0.4, 0.8], preempted=2, hits=64)
    sim = result([0.11, 0.2, 0.3, 0.8], preempted=3, hits=32)
    row = score_load(0.5, 1.25, 0, real, sim)
    assert row["num_requests"] == 4 and row["rate"] == 1.25
    assert row["ttft_ape_p50"] == pytest.approx(0.05)  # errors 10 %, 0, 25 %, 0
    assert row["ttft_mean_rel_err"] == pytest.approx(1.41 / 1.5 - 1, abs=1e-4)
    assert row["e2e_ape_p50"] == pytest.approx(0.05)
    assert (row["preemptions_real"], row["preemptions_sim"]) == (2, 3)
    assert (row["prefix_hit_tokens_real"], row["prefix_hit_tokens_sim"]) == (64, 32)


def test_a_measured_profile_is_a_preset(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    MeasuredProfile(TRUE_MODEL, CONFIG, "tiny", {"all": {"rel_error_p50": 0.02}}).save(path)
    assert load_profile(path).latency_model == TRUE_MODEL
    preset = get_preset(str(path), enable_prefix_caching=True)
    assert preset.latency_model == TRUE_MODEL and preset.config.max_num_seqs == 8
    assert preset.config.enable_prefix_caching
    path.write_text(json.dumps({"kind": "blockq-engine-profile", "format": 1, "engine_config": {}}))
    with pytest.raises(ValueError, match="latency_model"):
        load_profile(path)
    with pytest.raises(ValueError, match="PROFILE.json"):
        get_preset("no-such-preset")
