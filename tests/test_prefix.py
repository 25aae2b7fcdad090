"""Prefix blocks end to end on the engine side: the hashes, their trip in the request, the
emulated engine's prefix-cache hits and counters, and the simulation's hit rate."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from blockq.engine_model import EngineRequest, EngineScheduler, get_preset
from blockq.text.block_hashes import (
    PREFIX_BLOCK_TOKENS,
    block_hashes,
    prompt_block_hashes,
    prompt_token_ids,
)
from blockq.text.tokenizer import get_token_counter
from blockq.wire.protocol import ValidationError, decode_request, encode
from loadgen.simulation.config import SimulationConfig
from loadgen.simulation.single_run import simulate_run
from loadgen.simulation.workload import annotate_sample
from loadgen.traces import TraceRequest
from predictor_service.models import load_predictor
from predictor_service.stage import annotate, prediction_inputs
from tests.factories import make_request
from workers.engines.base import EngineRequestSpec
from workers.engines.emulated import EmulatedEngine, EmulatedEngineOptions
from workers.intake import engine_spec

# --- the hashes ---------------------------------------------------------------------------


def test_hashes_are_chained_and_cover_full_blocks_only() -> None:
    tokens = list(range(100, 164))  # four blocks of 16
    hashes = block_hashes(tokens)
    assert len(hashes) == 4 and len(set(hashes)) == 4
    assert all(0 <= h < 2**63 for h in hashes)
    # The partial last block has no hash; the full ones are the same as without it.
    assert block_hashes(tokens + [7] * 15) == hashes
    assert block_hashes(tokens[:15]) == ()
    # A shared prefix shares its hashes, and only those.
    other = tokens[:32] + list(range(900, 932))
    assert block_hashes(other)[:2] == hashes[:2] and block_hashes(other)[2:] != hashes[2:]
    # Chained: the same block after a different first block hashes differently.
    changed_first = [1] + tokens[1:]
    assert all(a != b for a, b in zip(block_hashes(changed_first), hashes, strict=True))
    # Another block size, another chain.
    assert len(block_hashes(tokens, block_size=32)) == 2 and block_hashes(tokens, 32)[0] not in hashes
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(tokens, block_size=0)


def test_hashes_are_the_same_in_another_process() -> None:
    tokens = [random.Random(1).randrange(32_000) for _ in range(80)]
    code = f"from blockq.text.block_hashes import block_hashes; print(list(block_hashes({tokens})))"
    # A different hash seed: Python's own hash() would differ, these must not.
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONHASHSEED": "12345"}, cwd=Path(__file__).parents[1], check=True)
    assert tuple(eval(child.stdout)) == block_hashes(tokens)  # noqa: S307 - our own child's list of ints


def test_prompt_token_ids_and_hashes_of_text_and_token_prompts() -> None:
    assert prompt_token_ids((5, 6, 7)) == [5, 6, 7]
    text = "You are a helpful assistant. " * 20
    ids = prompt_token_ids(text)
    assert len(ids) > 2 * PREFIX_BLOCK_TOKENS and all(isinstance(i, int) for i in ids)
    token_prompt = tuple(range(40))
    assert prompt_block_hashes([text, token_prompt]) == [block_hashes(ids), block_hashes(token_prompt)]


# --- the request --------------------------------------------------------------------------


def test_request_round_trip_carries_the_hashes() -> None:
    hashes = block_hashes(list(range(64)))
    request = make_request(prompt=tuple(range(64)), prompt_block_hashes=hashes)
    decoded = decode_request(encode(request))
    assert decoded == request and decoded.prompt_block_hashes == hashes
    assert decode_request(encode(make_request())).prompt_block_hashes == ()


@pytest.mark.parametrize("value", [["x"], [True], [-1], [2**63], "abc", [1] * (131_072 // 16 + 2)])
def test_a_bad_hash_list_is_refused_naming_the_field(value: object) -> None:
    data = make_request().to_map() | {"prompt_block_hashes": value}
    with pytest.raises(ValidationError) as caught:
        decode_request(msgpack.packb(data))
    assert caught.value.field == "prompt_block_hashes"


def test_annotate_adds_the_hashes_and_the_worker_hands_them_to_the_engine() -> None:
    text = "Summarize the following report in three sentences please. " * 10
    requests = [make_request(prompt=text), make_request(prompt=tuple(range(50))),
                make_request(prompt=(1, 2, 3), prompt_block_hashes=(42,))]
    predictor = load_predictor("heuristic", None)
    annotated = annotate(predictor, requests, prediction_inputs(requests, get_token_counter()))
    assert [r.prompt_block_hashes for r in annotated] == [  # type: ignore[union-attr]
        block_hashes(prompt_token_ids(text)), block_hashes(range(50)), (42,)]  # type: ignore[arg-type]
    assert engine_spec(annotated[1]).prefix_block_hashes == block_hashes(range(50))  # type: ignore[arg-type]


# --- the emulated engine ------------------------------------------------------------------

SHARED_PREFIX = tuple(random.Random(7).randrange(100, 30_000) for _ in range(512))


def _engine(**overrides: object) -> tuple[EmulatedEngine, list[float]]:
    now = [0.0]
    engine = EmulatedEngine(EmulatedEngineOptions(noise_sigma=0.0, config_overrides=tuple(overrides.items())),
                            clock=lambda: now[0])
    return engine, now


def _serve_alone(engine: EmulatedEngine, now: list[float], request_id: str, prompt: tuple[int, ...]
                 ) -> tuple[int, float]:
    """Run one request to its end on an idle engine: (prefill tokens scheduled, TTFT s)."""
    engine.add_request(EngineRequestSpec(request_id, prompt, len(prompt), max_tokens=4, ignore_eos=True,
                                         prefix_block_hashes=block_hashes(prompt)))
    started_s = engine.scheduler.now_s
    num_prefill_tokens = 0
    first_token_s = None
    while engine.has_unfinished_requests():
        result = engine.start_step()
        assert result is not None
        now[0] = engine.step_end_wall_s(result)
        output = engine.finish_step(result)
        num_prefill_tokens += result.num_prefill_tokens
        if first_token_s is None and any(event.is_first for event in output.events):
            first_token_s = engine.scheduler.now_s - started_s
    assert first_token_s is not None
    return num_prefill_tokens, first_token_s


def test_a_second_request_with_the_same_prefix_prefills_only_its_suffix() -> None:
    engine, now = _engine(enable_prefix_caching=True)
    first = _serve_alone(engine, now, "a", SHARED_PREFIX + tuple(range(1, 41)))
    second = _serve_alone(engine, now, "b", SHARED_PREFIX + tuple(range(41, 81)))
    assert first[0] == 552 and second[0] == 40  # 32 cached blocks of 16
    assert second[1] < first[1] / 2
    stats = engine.engine_stats()
    assert stats["prefix_cache_queries_total"] == 2 * 552 and stats["prefix_cache_hits_total"] == 512
    # Off (the default): the same pair prefills in full and counts nothing.
    engine, now = _engine()
    _serve_alone(engine, now, "a", SHARED_PREFIX + tuple(range(1, 41)))
    assert _serve_alone(engine, now, "b", SHARED_PREFIX + tuple(range(41, 81)))[0] == 552
    assert engine.engine_stats()["prefix_cache_hits_total"] == 0


def test_an_engine_of_another_block_size_does_not_use_the_hashes() -> None:
    engine, now = _engine(enable_prefix_caching=True, block_size=32, num_gpu_blocks=526)
    _serve_alone(engine, now, "a", SHARED_PREFIX + tuple(range(1, 41)))
    assert _serve_alone(engine, now, "b", SHARED_PREFIX + tuple(range(41, 81)))[0] == 552
    stats = engine.engine_stats()
    assert stats["prefix_cache_queries_total"] == 2 * 552 and stats["prefix_cache_hits_total"] == 0


def test_counted_hits_balance_the_computed_tokens_under_load_and_preemption() -> None:
    """Every computed token was either scheduled or a hit: over a busy run (batched
    admissions, chunked prefills, preemptions), scheduled + hits == computed at the end
    + computed tokens lost to preemption."""
    preset = get_preset("llama2-7b-a30", num_gpu_blocks=300, max_model_len=2048, enable_prefix_caching=True)
    scheduler = EngineScheduler(preset.config, preset.latency_model)
    rng = random.Random(11)
    prefixes = [tuple(rng.randrange(100, 30_000) for _ in range(rng.choice((64, 256, 400)))) for _ in range(4)]
    requests = []
    for index in range(60):
        prompt = rng.choice(prefixes) + tuple(rng.randrange(100, 30_000) for _ in range(rng.randint(1, 120)))
        requests.append(EngineRequest(f"r{index}", len(prompt), rng.randint(1, 300),
                                      prefix_block_hashes=block_hashes(prompt)))
    num_scheduled = num_lost = num_preemptions = 0
    pending = list(requests)
    while pending or scheduler.has_unfinished_requests:
        for _ in range(rng.randint(0, 3)):
            if pending:
                scheduler.add_request(pending.pop(0))
        computed_before = {r.request_id: r.num_computed_tokens for r in scheduler.running}
        result = scheduler.step()
        if result is None:
            continue
        num_scheduled += result.num_prefill_tokens + result.num_decode_seqs
        num_lost += sum(computed_before[request_id] for request_id in result.preempted_ids)
        num_preemptions += len(result.preempted_ids)
    num_computed = sum(r.num_computed_tokens for r in requests)
    num_queried_tokens, num_hit_tokens = scheduler.prefix_cache_tokens
    assert num_scheduled + num_hit_tokens == num_computed + num_lost
    # Not trivial: it preempted, and hit often.
    assert num_preemptions > 0 and num_hit_tokens > 0.2 * num_queried_tokens


# --- the simulation -----------------------------------------------------------------------


def _shared_prefix_sample(num_requests: int, seed: int):  # noqa: ANN202 - AnnotatedSample
    rng = random.Random(seed)
    system_prompts = [tuple(rng.randrange(100, 30_000) for _ in range(320)) for _ in range(3)]
    trace = []
    for _ in range(num_requests):
        prompt = rng.choice(system_prompts) + tuple(rng.randrange(100, 30_000) for _ in range(rng.randint(8, 64)))
        trace.append(TraceRequest(prompt=prompt, prompt_tokens=len(prompt), true_output_tokens=rng.randint(8, 64)))
    return annotate_sample(trace, seed)


def test_simulate_with_prefix_caching_reports_the_engines_hit_rate() -> None:
    sample = _shared_prefix_sample(60, seed=3)
    config = SimulationConfig(instances=2, policy="round_robin", noise_sigma=0.0, seed=3)
    off = simulate_run(config, sample, rate_per_s=8.0)
    on = simulate_run(SimulationConfig(instances=2, policy="round_robin", noise_sigma=0.0, seed=3,
                                       prefix_caching=True), sample, rate_per_s=8.0)
    assert off.summary["prefix_hit_rate"] is None
    # Three system prompts of 320 tokens (20 blocks) before 8-64 own tokens: most of each
    # prompt is cached once both instances have seen the three.
    assert 0.5 < on.summary["prefix_hit_rate"] < 0.95
    assert on.summary["ttft_mean_ms"] < off.summary["ttft_mean_ms"]
    # No placement beats one infinite cache; round robin's index, which saw each request
    # placed, predicts what the engines then found (both instances hold all three).
    assert on.summary["prefix_hit_rate"] <= on.summary["prefix_hit_rate_ideal"] + 1e-9
    assert abs(on.summary["prefix_hit_rate_predicted"] - on.summary["prefix_hit_rate"]) < 0.05
    assert off.summary["prefix_hit_rate_ideal"] is None


def test_prefix_aware_placement_finds_more_hits_than_round_robin() -> None:
    sample = _shared_prefix_sample(120, seed=4)
    rates = {}
    for policy in ("round_robin", "prefix_affinity", "block"):
        config = SimulationConfig(instances=4, policy=policy, noise_sigma=0.0, seed=4, prefix_caching=True)
        rates[policy] = simulate_run(config, sample, rate_per_s=8.0).summary["prefix_hit_rate"]
    assert rates["prefix_affinity"] > rates["round_robin"] and rates["block"] > rates["round_robin"]


# --- the flags ------------------------------------------------------------------------------


def test_prefix_caching_flags_reach_the_workers_and_their_engines(tmp_path: Path) -> None:
    import argparse

    from blockq.config import ConfigError
    from blockq.local.cluster_config import ClusterConfig
    from workers.cli import add_arguments, build_engine
    from workers.engines.vllm_options import VllmEngineOptions

    (_, worker_argv), = [child for child in ClusterConfig(prefix_caching=True).child_argvs() if child[0] == "workers-0"]
    assert "--prefix-caching" in worker_argv
    vllm = ClusterConfig(engine="vllm", model="m", prefix_caching=True).worker_child(0, 0, 1)[1]
    assert "--prefix-caching" in vllm and "--prefix-caching" not in ClusterConfig().worker_child(0, 0, 1)[1]
    (tmp_path / "cluster.toml").write_text('[cluster]\nprefix_caching = "yes"\n')
    with pytest.raises(ConfigError, match="prefix_caching"):
        ClusterConfig.from_toml(tmp_path / "cluster.toml")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert build_engine(parser.parse_args(["--prefix-caching"]), 0).config.enable_prefix_caching
    assert not build_engine(parser.parse_args([]), 0).config.enable_prefix_caching
    assert VllmEngineOptions(model="m", enable_prefix_caching=True).engine_args()["enable_prefix_caching"] is True
    assert "enable_prefix_caching" not in VllmEngineOptions(model="m").engine_args()  # vLLM's default


def test_vllm_counters_add_re_admissions_after_preemption() -> None:
    from types import SimpleNamespace

    from workers.engines.vllm import VllmStats

    stats = VllmStats()
    prefix = SimpleNamespace(queries=100, hits=64, preempted_queries=50, preempted_hits=32)
    scheduler_stats = SimpleNamespace(num_running_reqs=1, num_waiting_reqs=0, num_skipped_waiting_reqs=0,
                                      kv_cache_usage=0.1, prefix_cache_stats=prefix, iteration_details=None)
    stats.record(scheduler_stats, None, 1024)
    stats.record(scheduler_stats, None, 1024)
    assert (stats.prefix_cache_queries_total, stats.prefix_cache_hits_total) == (300, 192)
