"""The fast path (decode spans collapsed into jumps) against plain step-by-step simulation."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

from blockq.engine_model import (
    EngineConfig,
    EngineRequest,
    EngineScheduler,
    SimulationResult,
    StepLatencyModel,
    StepResult,
    get_preset,
)

REL_TOL = 1e-9
ABS_TOL_S = 1e-12
NUM_SMALL_STATES = 1200
NUM_PRESET_STATES = 8

CONSTANT = StepLatencyModel(linear_knot_tokens=(1,), linear_knot_s=(0.0,), kv_token_s=0.0,
                            prefill_pair_s=0.0, step_overhead_s=0.01)
KV_BOUND = StepLatencyModel(linear_knot_tokens=(1, 64), linear_knot_s=(0.01, 0.02),
                            kv_token_s=1e-6, prefill_pair_s=1e-8, step_overhead_s=0.001)
HEAVY_KV = StepLatencyModel(linear_knot_tokens=(1, 4, 9), linear_knot_s=(0.003, 0.004, 0.0071),
                            kv_token_s=3.7e-4, prefill_pair_s=2e-6, step_overhead_s=0.0003,
                            linear_scale=1.3)
# zero-time steps: every finish ties in time, so only step order tells finishes apart
FREE = StepLatencyModel(linear_knot_tokens=(1,), linear_knot_s=(0.0,), kv_token_s=0.0,
                        prefill_pair_s=0.0, step_overhead_s=0.0)
A30 = get_preset("llama2-7b-a30")
LATENCY_MODELS = (CONSTANT, KV_BOUND, HEAVY_KV, A30.latency_model, FREE)


@dataclass(frozen=True)
class StopRule:
    until_s: float | None
    stop_when_finished: str | None
    max_steps: int


# --- the reference: plain step() under the same stop rule ------------------------------------

def simulate_by_steps(scheduler: EngineScheduler, rule: StopRule) -> SimulationResult:
    stop = None if rule.stop_when_finished is None else scheduler.find_request(rule.stop_when_finished)
    finished: dict[str, float] = {}
    first_tokens: dict[str, float] = {}
    num_steps = num_preemptions = 0
    while scheduler.has_unfinished_requests:
        if stop is not None and stop.finished_at_s is not None:
            break
        if rule.until_s is not None and scheduler.now_s >= rule.until_s:
            break
        if num_steps >= rule.max_steps:
            break
        result = scheduler.step()
        assert result is not None
        num_steps += 1
        for request in result.finished:
            finished[request.request_id] = result.finished_at_s
        for request_id in result.first_token_ids:
            first_tokens[request_id] = result.finished_at_s
        num_preemptions += len(result.preempted_ids)
    stopped_on_request = stop is not None and stop.finished_at_s is not None
    if (not scheduler.has_unfinished_requests and not stopped_on_request
            and rule.until_s is not None and scheduler.now_s < rule.until_s):
        scheduler.now_s = rule.until_s
    return SimulationResult(num_steps, scheduler.now_s, finished, first_tokens, num_preemptions)


# --- comparison -------------------------------------------------------------------------------

INT_FIELDS = ("prompt_tokens", "output_target_tokens", "num_computed_tokens",
              "num_generated_tokens", "num_preemptions", "num_blocks", "num_hashed_blocks")
TIME_FIELDS = ("arrival_s", "first_scheduled_at_s", "first_token_at_s", "finished_at_s")


def same_time(fast_s: float | None, slow_s: float | None) -> bool:
    if fast_s is None or slow_s is None:
        return fast_s is slow_s
    return math.isclose(fast_s, slow_s, rel_tol=REL_TOL, abs_tol=ABS_TOL_S)


def same_times(fast: dict[str, float], slow: dict[str, float]) -> bool:
    """Same requests, in the same (finishing) order, at the same times."""
    return list(fast) == list(slow) and all(same_time(fast[k], slow[k]) for k in fast)


def all_requests(scheduler: EngineScheduler) -> dict[str, EngineRequest]:
    return {r.request_id: r for r in [*scheduler.running, *scheduler.waiting]}


def assert_same_state(fast: EngineScheduler, slow: EngineScheduler,
                      fast_requests: dict[str, EngineRequest],
                      slow_requests: dict[str, EngineRequest]) -> None:
    assert [r.request_id for r in fast.running] == [r.request_id for r in slow.running]
    assert [r.request_id for r in fast.waiting] == [r.request_id for r in slow.waiting]
    assert fast.num_free_blocks == slow.num_free_blocks
    assert same_time(fast.now_s, slow.now_s)
    for request_id, slow_request in slow_requests.items():
        fast_request = fast_requests[request_id]
        for name in INT_FIELDS:
            assert getattr(fast_request, name) == getattr(slow_request, name), (request_id, name)
        for name in TIME_FIELDS:
            assert same_time(getattr(fast_request, name), getattr(slow_request, name)), (request_id, name)


def assert_same_result(fast: SimulationResult, slow: SimulationResult) -> None:
    assert fast.num_steps == slow.num_steps
    assert same_time(fast.end_time_s, slow.end_time_s)
    assert same_times(fast.finished_at_s, slow.finished_at_s)
    assert same_times(fast.first_token_at_s, slow.first_token_at_s)
    assert fast.num_preemptions == slow.num_preemptions


def check_against_steps(scheduler: EngineScheduler, rule: StopRule) -> SimulationResult:
    """Run ``simulate`` on the scheduler and stepping on a clone; assert they agree."""
    reference = scheduler.clone()
    fast_requests, slow_requests = all_requests(scheduler), all_requests(reference)
    slow = simulate_by_steps(reference, rule)
    fast = scheduler.simulate(until_s=rule.until_s, stop_when_finished=rule.stop_when_finished,
                              max_steps=rule.max_steps)
    assert_same_result(fast, slow)
    assert_same_state(scheduler, reference, fast_requests, slow_requests)
    return fast


# --- random states ----------------------------------------------------------------------------

def random_small_config(rng: random.Random) -> EngineConfig:
    block_size = rng.choice([1, 2, 4, 8, 16])
    max_model_len = rng.randint(8, 160)
    watermark = rng.choice([0.0, 0.0, 0.05, 0.2])
    max_request_blocks = -(-max_model_len // block_size)
    # from the smallest cache that fits one maximal request (heavy preemption) upwards
    min_blocks = int(max_request_blocks / (1.0 - watermark)) + 2
    max_num_seqs = rng.randint(1, 10)
    return EngineConfig(
        num_gpu_blocks=rng.randint(min_blocks, min_blocks * rng.choice([1, 2, 4, 8])),
        block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=rng.randint(max_num_seqs, max(max_num_seqs, 96)),
        max_model_len=max_model_len, watermark=watermark,
        enable_prefix_caching=rng.random() < 0.05)


def random_request(rng: random.Random, config: EngineConfig, request_id: str) -> EngineRequest:
    prompt_tokens = rng.randint(1, config.max_model_len - 1)
    num_blocks = prompt_tokens // config.block_size
    family = rng.randint(0, 2)  # shared leading blocks, used only with prefix caching
    hashes = tuple(family * 1000 + b for b in range(num_blocks)) if family else ()
    return EngineRequest(request_id, prompt_tokens, rng.randint(1, config.max_model_len),
                         prefix_block_hashes=hashes)


def build_by_stepping(rng: random.Random, config: EngineConfig,
                      latency_model: StepLatencyModel) -> EngineScheduler:
    """Requests arriving over a few steps, stepped to a random mid-flight state."""
    scheduler = EngineScheduler(config, latency_model, now_s=rng.choice([0.0, 12.5]))
    num_requests = rng.randint(1, 14)
    arrivals = sorted(rng.randint(0, 20) for _ in range(num_requests))
    num_warmup_steps = rng.randint(0, 60)
    index = 0
    for step_index in range(num_warmup_steps + 1):
        while index < num_requests and arrivals[index] <= step_index:
            scheduler.add_request(random_request(rng, config, f"r{index}"))
            index += 1
        if step_index < num_warmup_steps:
            scheduler.step()
    while index < num_requests:
        scheduler.add_request(random_request(rng, config, f"r{index}"))
        index += 1
    return scheduler


def random_progress(rng: random.Random, request: EngineRequest) -> EngineRequest:
    """Give a request some output so far and computed tokens (restore clips and checks them)."""
    target = request.output_target_tokens
    request.num_generated_tokens = rng.randint(0, max(0, target - 1))
    known = request.prompt_tokens + request.num_generated_tokens
    request.num_computed_tokens = known - 1 if rng.random() < 0.8 else rng.randint(0, known)
    return request


def build_by_restoring(rng: random.Random, config: EngineConfig,
                       latency_model: StepLatencyModel) -> EngineScheduler:
    """A heartbeat-like snapshot: running requests mid-decode (some mid-prefill), a queue."""
    scheduler = EngineScheduler(config, latency_model, now_s=rng.uniform(0.0, 100.0))
    num_running = rng.randint(0, config.max_num_seqs + 2)
    running = [random_progress(rng, random_request(rng, config, f"run{i}")) for i in range(num_running)]
    running = [r for r in running if r.prompt_tokens + r.num_generated_tokens < config.max_model_len]
    waiting = [random_request(rng, config, f"wait{i}") for i in range(rng.randint(0, 6))]
    scheduler.restore(running, waiting)
    return scheduler


def random_rule(rng: random.Random, scheduler: EngineScheduler) -> StopRule:
    until_s = None
    if rng.random() < 0.5:
        until_s = scheduler.now_s + rng.uniform(0.0, 0.02) * rng.choice([1, 10, 100, 1000])
    stop_id = None
    ids = [r.request_id for r in [*scheduler.running, *scheduler.waiting]]
    if ids and rng.random() < 0.4:
        stop_id = rng.choice(ids)
    max_steps = rng.choice([1_000_000, 1_000_000, rng.randint(0, 300)])
    return StopRule(until_s, stop_id, max_steps)


def test_simulate_equals_stepping_on_random_small_states() -> None:
    rng = random.Random(20240611)
    num_jump_cases = num_preemption_cases = num_cut_by_time = num_mixed = 0
    for case in range(NUM_SMALL_STATES):
        config = random_small_config(rng)
        latency_model = rng.choice(LATENCY_MODELS)
        build = build_by_stepping if case % 3 else build_by_restoring
        scheduler = build(rng, config, latency_model)
        rule = random_rule(rng, scheduler)
        result = check_against_steps(scheduler, rule)
        num_jump_cases += result.num_jumps > 0
        num_mixed += result.num_jumps > 0 and result.num_steps > result.num_jumped_steps
        num_preemption_cases += result.num_jumps > 0 and result.num_preemptions > 0
        num_cut_by_time += rule.until_s is not None and scheduler.has_unfinished_requests
    # the random states must exercise the interesting paths, not only the trivial ones
    assert num_jump_cases >= NUM_SMALL_STATES // 2
    assert num_mixed >= NUM_SMALL_STATES // 3
    assert num_preemption_cases >= NUM_SMALL_STATES // 20
    assert num_cut_by_time >= NUM_SMALL_STATES // 10


def test_simulate_equals_stepping_at_the_edge_of_the_cache() -> None:
    """Decoding batches with nobody waiting, in caches from a few blocks short of what
    they need to finish (finishes give blocks back on the way) to just enough."""
    rng = random.Random(4242)
    num_cases = 0
    for _ in range(120):
        block_size = rng.choice([1, 2, 4, 8])
        max_model_len = rng.randint(8, 48)
        running = []
        for index in range(rng.randint(1, 8)):
            request = random_progress(rng, random_request(rng, EngineConfig(
                num_gpu_blocks=10_000, block_size=block_size, max_model_len=max_model_len),
                f"r{index}"))
            request.num_generated_tokens = max(1, request.num_generated_tokens)
            if request.num_tokens >= max_model_len or request.num_generated_tokens >= request.output_target_tokens:
                continue
            request.num_computed_tokens = request.num_tokens - 1
            running.append(request)
        held = sum(-(-r.num_computed_tokens // block_size) for r in running)
        needed = sum(-(-(r.prompt_tokens + r.output_target_tokens - 1) // block_size)
                     for r in running) - held
        min_blocks = -(-max_model_len // block_size) + 1
        for num_gpu_blocks in range(max(min_blocks, held + needed - 6), held + needed + 2):
            config = EngineConfig(num_gpu_blocks=num_gpu_blocks, block_size=block_size,
                                  max_num_seqs=8, max_num_batched_tokens=64,
                                  max_model_len=max_model_len, watermark=0.0)
            scheduler = EngineScheduler(config, rng.choice(LATENCY_MODELS))
            scheduler.restore([r.copy() for r in running], [])
            check_against_steps(scheduler, StopRule(None, None, 1_000_000))
            num_cases += 1
    assert num_cases >= 500


def sharegpt_like_request(rng: random.Random, request_id: str) -> EngineRequest:
    prompt_tokens = min(2048, max(1, round(rng.lognormvariate(math.log(35), 1.0))))
    output_tokens = min(1024, max(1, round(rng.lognormvariate(math.log(250), 0.8))))
    return EngineRequest(request_id, prompt_tokens, output_tokens)


def build_preset_state(rng: random.Random, num_gpu_blocks: int) -> EngineScheduler:
    """A loaded A30-sized instance: up to 48 running (restored mid-flight) and 20 waiting."""
    config = EngineConfig(num_gpu_blocks=num_gpu_blocks)
    scheduler = EngineScheduler(config, A30.latency_model, now_s=rng.uniform(0.0, 50.0))
    running = [random_progress(rng, sharegpt_like_request(rng, f"run{i}")) for i in range(48)]
    waiting = [sharegpt_like_request(rng, f"wait{i}") for i in range(20)]
    scheduler.restore(running, waiting)
    scheduler.add_request(sharegpt_like_request(rng, "new"))
    return scheduler


@pytest.mark.parametrize("case", range(NUM_PRESET_STATES))
def test_simulate_equals_stepping_on_preset_sized_states(case: int) -> None:
    rng = random.Random(7_000 + case)
    # half of the cases with a cache small enough to preempt
    scheduler = build_preset_state(rng, 1052 if case % 2 else 400)
    rules = [StopRule(None, None, 1_000_000), StopRule(None, "new", 1_000_000),
             StopRule(scheduler.now_s + rng.uniform(0.5, 5.0), None, 1_000_000),
             StopRule(None, None, rng.randint(50, 500))]
    result = check_against_steps(scheduler, rules[case % len(rules)])
    assert result.num_jumps > 0


# --- run_until and run_until_finished ---------------------------------------------------------

def assert_same_step_results(fast: list[StepResult], slow: list[StepResult]) -> None:
    assert len(fast) == len(slow)
    for fast_step, slow_step in zip(fast, slow, strict=True):
        assert same_time(fast_step.started_at_s, slow_step.started_at_s)
        assert same_time(fast_step.duration_s, slow_step.duration_s)
        assert (fast_step.num_prefill_tokens, fast_step.num_decode_seqs,
                fast_step.num_kv_tokens_attended, fast_step.produced_token_ids,
                fast_step.first_token_ids, fast_step.preempted_ids,
                fast_step.num_prefill_attention_pairs, fast_step.num_used_blocks,
                fast_step.num_running, fast_step.num_waiting) == (
            slow_step.num_prefill_tokens, slow_step.num_decode_seqs,
            slow_step.num_kv_tokens_attended, slow_step.produced_token_ids,
            slow_step.first_token_ids, slow_step.preempted_ids,
            slow_step.num_prefill_attention_pairs, slow_step.num_used_blocks,
            slow_step.num_running, slow_step.num_waiting)
        assert [r.request_id for r in fast_step.finished] == [r.request_id for r in slow_step.finished]


def test_run_until_reports_every_step_as_stepping_does() -> None:
    rng = random.Random(99)
    for case in range(150):
        config = random_small_config(rng)
        scheduler = (build_by_stepping if case % 2 else build_by_restoring)(
            rng, config, rng.choice(LATENCY_MODELS))
        reference = scheduler.clone()
        until_s = scheduler.now_s + rng.uniform(0.0, 3.0)
        slow: list[StepResult] = []
        while reference.has_unfinished_requests and reference.now_s < until_s:
            result = reference.step()
            assert result is not None
            slow.append(result)
        if not reference.has_unfinished_requests:
            reference.now_s = max(reference.now_s, until_s)
        fast_requests, slow_requests = all_requests(scheduler), all_requests(reference)
        assert_same_step_results(scheduler.run_until(until_s), slow)
        assert_same_state(scheduler, reference, fast_requests, slow_requests)


def test_run_until_finished_matches_stepping() -> None:
    rng = random.Random(5)
    for _ in range(100):
        scheduler = build_by_restoring(rng, random_small_config(rng), rng.choice(LATENCY_MODELS))
        ids = [r.request_id for r in [*scheduler.running, *scheduler.waiting]]
        if not ids:
            continue
        target = rng.choice(ids)
        max_steps = rng.choice([5, 50, 1_000_000])
        reference = scheduler.clone()
        slow = simulate_by_steps(reference, StopRule(None, target, max_steps))
        finished = scheduler.run_until_finished(target, max_steps=max_steps)
        assert (finished is not None) == (target in slow.finished_at_s)
        assert same_time(scheduler.now_s, reference.now_s)


# --- contracts --------------------------------------------------------------------------------

def decoding_scheduler(latency_model: object = CONSTANT, **config_fields: object) -> EngineScheduler:
    config = EngineConfig(**{"num_gpu_blocks": 64, "block_size": 4, "max_model_len": 64,
                             "watermark": 0.0, **config_fields})
    scheduler = EngineScheduler(config, latency_model)  # type: ignore[arg-type]
    scheduler.add_request(EngineRequest("a", 5, 40))
    scheduler.add_request(EngineRequest("b", 3, 30))
    return scheduler


def test_a_decode_span_is_one_jump_up_to_the_first_finish() -> None:
    scheduler = decoding_scheduler()
    result = scheduler.simulate(stop_when_finished="b")
    # step 1 prefills both (and samples their first tokens); steps 2-30 decode: one jump
    assert (result.num_steps, result.num_jumps, result.num_jumped_steps) == (30, 1, 29)
    assert result.first_token_at_s == pytest.approx({"a": 0.01, "b": 0.01})
    assert result.finished_at_s == pytest.approx({"b": 0.30})
    assert result.end_time_s == pytest.approx(0.30)
    request = scheduler.find_request("a")
    assert request is not None and request.num_generated_tokens == 30
    assert request.num_blocks == -(-(5 + 29) // 4) and scheduler.num_used_blocks == request.num_blocks


def test_until_s_cuts_a_span_at_the_step_that_would_start_too_late() -> None:
    scheduler = decoding_scheduler()
    result = scheduler.simulate(until_s=0.105)  # steps start at 0, 0.01, ..., 0.10
    assert result.num_steps == 11 and result.end_time_s == pytest.approx(0.11)
    scheduler.simulate()
    assert scheduler.simulate(until_s=5.0).end_time_s == 5.0  # idle: time moves on


def test_until_s_on_a_step_boundary_does_not_start_that_step() -> None:
    # Dyadic step times add up exactly, so until_s can sit exactly on a step's start.
    dyadic = StepLatencyModel(linear_knot_tokens=(1,), linear_knot_s=(0.0,), kv_token_s=2.0**-20,
                              prefill_pair_s=0.0, step_overhead_s=2.0**-6)
    rng = random.Random(3)
    for case in range(80):
        # a third request waiting for a sequence slot makes these decode spans, not a drain
        scheduler = decoding_scheduler(dyadic, num_gpu_blocks=rng.randint(17, 40),
                                       max_num_seqs=2 + case % 2)
        scheduler.add_request(EngineRequest("c", 2, 3))
        reference = scheduler.clone()
        num_steps = rng.randint(1, 45)
        for _ in range(num_steps):
            reference.step()
        boundary_s = reference.now_s  # when step num_steps + 1 would start
        scheduler.simulate(until_s=boundary_s)
        check_against_steps(scheduler.clone(), StopRule(boundary_s + 0.1, None, 1_000_000))
        assert scheduler.now_s == boundary_s
        assert [r.num_generated_tokens for r in scheduler.running] == [
            r.num_generated_tokens for r in reference.running]


class NoisyLatency:
    """A latency model that is not a plain StepLatencyModel (e.g. drawing noise)."""

    def step_seconds(self, *batch: int | None) -> float:
        return 0.01


@pytest.mark.parametrize("latency_model, caching", [(NoisyLatency(), False), (CONSTANT, True)])
def test_no_jumps_for_other_latency_models_or_prefix_caching(latency_model: object,
                                                             caching: bool) -> None:
    scheduler = decoding_scheduler(latency_model, enable_prefix_caching=caching)
    result = scheduler.simulate()
    assert result.num_jumps == 0 and result.num_steps == 40 and len(result.finished_at_s) == 2


def test_stop_when_finished_must_name_a_request_here() -> None:
    with pytest.raises(ValueError, match="stop_when_finished"):
        decoding_scheduler().simulate(stop_when_finished="missing")
