"""Property tests of the engine model on random small workloads."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from blockq.engine_model import (
    EngineConfig,
    EngineRequest,
    EngineScheduler,
    StepLatencyModel,
    StepResult,
)
from tests.factories import step_reference

MAX_STEPS = 20_000
LATENCY = StepLatencyModel(linear_knot_tokens=(1, 64), linear_knot_s=(0.01, 0.02),
                           kv_token_s=1e-6, prefill_pair_s=1e-8, step_overhead_s=0.001)


@dataclass(frozen=True)
class Arrival:
    """A request to add before step ``at_step``."""

    at_step: int
    request_id: str
    prompt_tokens: int
    output_tokens: int
    prefix_block_hashes: tuple[int, ...]


@st.composite
def configs(draw: st.DrawFn) -> EngineConfig:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(8, 64))
    watermark = draw(st.sampled_from([0.0, 0.05, 0.2]))
    max_request_blocks = -(-max_model_len // block_size)
    # smallest cache that still fits one maximal request beside the watermark
    min_blocks = int(max_request_blocks / (1.0 - watermark)) + 2
    num_gpu_blocks = draw(st.integers(min_blocks, min_blocks + 24))
    max_num_seqs = draw(st.integers(1, 6))
    return EngineConfig(
        num_gpu_blocks=num_gpu_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 48)), max_model_len=max_model_len,
        watermark=watermark, enable_prefix_caching=draw(st.booleans()))


@st.composite
def workloads(draw: st.DrawFn) -> tuple[EngineConfig, list[Arrival]]:
    config = draw(configs())
    arrivals = []
    for index in range(draw(st.integers(1, 12))):
        prompt_tokens = draw(st.integers(1, config.max_model_len - 1))
        # prefixes drawn from two "system prompts" so that requests share leading blocks
        family = draw(st.integers(0, 2))
        num_full_blocks = prompt_tokens // config.block_size
        hashes = tuple(family * 1000 + block for block in range(num_full_blocks)) if family else ()
        arrivals.append(Arrival(
            at_step=draw(st.integers(0, 30)), request_id=f"r{index}",
            prompt_tokens=prompt_tokens, output_tokens=draw(st.integers(1, config.max_model_len)),
            prefix_block_hashes=hashes))
    return config, sorted(arrivals, key=lambda a: a.at_step)


def check_invariants(scheduler: EngineScheduler, result: StepResult) -> None:
    config = scheduler.config
    assert 0 <= scheduler.num_used_blocks <= config.num_gpu_blocks
    assert result.num_used_blocks == scheduler.num_used_blocks
    assert len(scheduler.running) <= config.max_num_seqs
    assert result.num_prefill_tokens + result.num_decode_seqs <= config.max_num_batched_tokens
    held = 0
    for request in scheduler.running:
        assert request.num_blocks * config.block_size >= request.num_computed_tokens
        assert request.num_computed_tokens < request.num_tokens
        held += request.num_blocks - request.num_hashed_blocks
    hashed_in_use = {h for r in scheduler.running for h in r.prefix_block_hashes[:r.num_hashed_blocks]}
    assert held + len(hashed_in_use) == scheduler.num_used_blocks
    for request in scheduler.waiting:
        assert request.num_blocks == 0 and request.num_computed_tokens == 0


@dataclass
class RunRecord:
    results: list[StepResult]
    requests: dict[str, EngineRequest]
    num_recomputed_tokens: int


def simulate(config: EngineConfig, arrivals: list[Arrival], check: bool = True) -> RunRecord:
    scheduler = EngineScheduler(config, LATENCY)
    requests: dict[str, EngineRequest] = {}
    results: list[StepResult] = []
    computed_before_step: dict[str, int] = {}
    num_recomputed = 0
    pending = list(arrivals)
    for step_index in range(MAX_STEPS):
        while pending and pending[0].at_step <= step_index:
            arrival = pending.pop(0)
            request = EngineRequest(arrival.request_id, arrival.prompt_tokens, arrival.output_tokens,
                                    prefix_block_hashes=arrival.prefix_block_hashes)
            scheduler.add_request(request)
            requests[request.request_id] = request
        result = scheduler.step()
        if result is None:
            if not pending:
                break
            continue
        results.append(result)
        # a preempted request had computed what it held before this step; that is redone
        num_recomputed += sum(computed_before_step.get(i, 0) for i in result.preempted_ids)
        computed_before_step = {r.request_id: r.num_computed_tokens for r in scheduler.running}
        if check:
            check_invariants(scheduler, result)
    assert not scheduler.has_unfinished_requests and not pending
    return RunRecord(results, requests, num_recomputed)


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_every_request_finishes_with_exactly_its_target(workload: tuple[EngineConfig, list[Arrival]]) -> None:
    config, arrivals = workload
    record = simulate(config, arrivals)
    produced = Counter(i for r in record.results for i in r.produced_token_ids)
    first = Counter(i for r in record.results for i in r.first_token_ids)
    finished = Counter(req.request_id for r in record.results for req in r.finished)
    for request_id, request in record.requests.items():
        target = min(request.output_target_tokens, config.max_model_len - request.prompt_tokens)
        assert request.num_generated_tokens == target == produced[request_id]
        assert first[request_id] == 1 and finished[request_id] == 1
        assert request.first_scheduled_at_s is not None
        assert request.first_token_at_s is not None and request.finished_at_s is not None
        assert request.first_scheduled_at_s < request.first_token_at_s <= request.finished_at_s


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_total_work_is_conserved(workload: tuple[EngineConfig, list[Arrival]]) -> None:
    config, arrivals = workload
    record = simulate(config, arrivals, check=False)
    num_computed = sum(r.num_prefill_tokens + r.num_decode_seqs for r in record.results)
    # the last output token is sampled but never fed back, hence the -1
    num_required = sum(r.prompt_tokens + r.output_target_tokens - 1 for r in record.requests.values())
    if config.enable_prefix_caching:
        assert num_computed <= num_required + record.num_recomputed_tokens
    else:
        assert num_computed == num_required + record.num_recomputed_tokens
    assert sum(r.num_preemptions for r in record.requests.values()) == sum(
        len(r.preempted_ids) for r in record.results)


@settings(max_examples=60, deadline=None)
@given(workloads())
def test_runs_are_deterministic(workload: tuple[EngineConfig, list[Arrival]]) -> None:
    config, arrivals = workload
    first = simulate(config, arrivals, check=False)
    second = simulate(config, arrivals, check=False)
    assert first.results == second.results


@settings(max_examples=60, deadline=None)
@given(workloads(), st.integers(0, 40))
def test_a_clone_is_independent_and_replays_identically(
    workload: tuple[EngineConfig, list[Arrival]], clone_after_steps: int,
) -> None:
    config, arrivals = workload
    scheduler = EngineScheduler(config, LATENCY)
    for arrival in arrivals:
        scheduler.add_request(EngineRequest(arrival.request_id, arrival.prompt_tokens,
                                            arrival.output_tokens,
                                            prefix_block_hashes=arrival.prefix_block_hashes))
    for _ in range(clone_after_steps):
        scheduler.step()
    snapshot = (scheduler.now_s, scheduler.num_free_blocks,
                [repr(r) for r in scheduler.running], [repr(r) for r in scheduler.waiting])
    clone = scheduler.clone()
    clone_results = step_reference(clone)
    assert not clone.has_unfinished_requests
    # running the clone to the end left the original untouched ...
    assert snapshot == (scheduler.now_s, scheduler.num_free_blocks,
                        [repr(r) for r in scheduler.running], [repr(r) for r in scheduler.waiting])
    # ... and the original, run on, does exactly what the clone did
    assert step_reference(scheduler) == clone_results
