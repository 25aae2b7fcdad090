"""Small builders shared by tests: messages and heartbeats; engine-model states, and the
reference scheduler stepped by hand under a stop rule."""

from __future__ import annotations

import math
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

from blockq.engine_model import (
    EngineConfig,
    EngineRequest,
    EngineScheduler,
    StepLatencyModel,
    StepResult,
    get_preset,
)
from blockq.wire.beats import Heartbeat, RequestProgress
from blockq.wire.keys import Keys
from blockq.wire.protocol import Prediction, Request
from loadgen.benches.engine_model import sharegpt_like_request


def make_request(prompt: str = "hello", max_tokens: int = 16, *, keys: Keys | None = None,
                 predicted: int | None = None, **overrides: object) -> Request:
    request_id = str(overrides.pop("id", uuid.uuid4().hex))
    overrides.setdefault("submitted_at_s", time.time())
    request = Request(id=request_id, prompt=prompt, max_tokens=max_tokens,
                      reply_stream=(keys or Keys()).reply(request_id), **overrides)  # type: ignore[arg-type]
    if predicted is not None:
        request = request.with_prediction(Prediction(len(prompt.split()) if isinstance(prompt, str) else len(prompt),
                                                     predicted, max(1, predicted // 2), predicted * 2, "test"))
    return request


def make_heartbeat(instance_id: str, *, seq: int = 1, state: str = "live", sent_at_s: float | None = None,
                   running: tuple[RequestProgress, ...] = (), waiting: tuple[RequestProgress, ...] = (),
                   num_used_blocks: int = 0, num_gpu_blocks: int = 1052, finished_ids: tuple[str, ...] = (),
                   engine_time_s: float = 0.0) -> Heartbeat:
    return Heartbeat(
        instance_id=instance_id, state=state, seq=seq, sent_at_s=time.time() if sent_at_s is None else sent_at_s,
        engine_time_s=engine_time_s, model="emulated", preset="llama2-7b-a30",
        engine_config={"num_gpu_blocks": num_gpu_blocks, "block_size": 16, "max_num_seqs": 48,
                       "max_num_batched_tokens": 512, "max_model_len": 4096},
        latency_model=None, num_used_blocks=num_used_blocks, running=running, waiting=waiting,
        num_running_total=len(running), num_waiting_total=len(waiting), finished_ids=finished_ids)


# --- engine-model states ------------------------------------------------------------------

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


def random_small_config(rng: random.Random) -> EngineConfig:
    """A small engine (no prefix caching), from a cache that fits one maximal request
    (heavy preemption) upwards."""
    block_size = rng.choice([1, 2, 4, 8, 16])
    max_model_len = rng.randint(8, 160)
    watermark = rng.choice([0.0, 0.0, 0.05, 0.2])
    max_request_blocks = -(-max_model_len // block_size)
    min_blocks = int(max_request_blocks / (1.0 - watermark)) + 2
    max_num_seqs = rng.randint(1, 10)
    return EngineConfig(
        num_gpu_blocks=rng.randint(min_blocks, min_blocks * rng.choice([1, 2, 4, 8])),
        block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=rng.randint(max_num_seqs, max(max_num_seqs, 96)),
        max_model_len=max_model_len, watermark=watermark, enable_prefix_caching=False)


def random_request(rng: random.Random, config: EngineConfig, request_id: str) -> EngineRequest:
    """A new request that fits ``config`` (its output target may pass max_model_len: the
    scheduler clips it)."""
    return EngineRequest(request_id, rng.randint(1, config.max_model_len - 1),
                         rng.randint(1, config.max_model_len))


def random_progress(rng: random.Random, request: EngineRequest) -> EngineRequest:
    """Give a request some output so far and computed tokens (restore clips and checks them)."""
    target = request.output_target_tokens
    request.num_generated_tokens = rng.randint(0, max(0, target - 1))
    known = request.prompt_tokens + request.num_generated_tokens
    request.num_computed_tokens = known - 1 if rng.random() < 0.8 else rng.randint(0, known)
    return request


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


def build_random_state(rng: random.Random, case: int) -> EngineScheduler:
    """A small random state: every third one restored from a snapshot, the rest stepped."""
    build = build_by_stepping if case % 3 else build_by_restoring
    return build(rng, random_small_config(rng), rng.choice(LATENCY_MODELS))


def build_preset_state(rng: random.Random, num_gpu_blocks: int) -> EngineScheduler:
    """A loaded A30-sized instance: 48 running (restored mid-flight, some may not fit),
    20 waiting and a request ``"new"`` at the tail."""
    config = EngineConfig(num_gpu_blocks=num_gpu_blocks)
    scheduler = EngineScheduler(config, A30.latency_model, now_s=rng.uniform(0.0, 50.0))
    running = [random_progress(rng, sharegpt_like_request(rng, f"run{i}")) for i in range(48)]
    waiting = [sharegpt_like_request(rng, f"wait{i}") for i in range(20)]
    scheduler.restore(running, waiting)
    scheduler.add_request(sharegpt_like_request(rng, "new"))
    return scheduler


def all_requests(scheduler: EngineScheduler) -> dict[str, EngineRequest]:
    """The scheduler's running and waiting requests by id (the objects themselves, so they
    keep their final state after they finish)."""
    return {r.request_id: r for r in [*scheduler.running, *scheduler.waiting]}


# --- the reference, stepped by hand ---------------------------------------------------------

@dataclass(frozen=True)
class StopRule:
    """When a run stops (see :func:`step_reference`); the defaults run to the end."""

    until_s: float | None = None
    stop_when_finished: str | None = None
    max_steps: int = 1_000_000


def random_rule(rng: random.Random, scheduler: EngineScheduler) -> StopRule:
    """Half the time a time limit (from none of the run to all of it), 40 % a request to
    stop at, a third a step limit."""
    until_s = None
    if rng.random() < 0.5:
        until_s = scheduler.now_s + rng.uniform(0.0, 0.02) * rng.choice([1, 10, 100, 1000])
    stop_id = None
    ids = list(all_requests(scheduler))
    if ids and rng.random() < 0.4:
        stop_id = rng.choice(ids)
    max_steps = rng.choice([1_000_000, 1_000_000, rng.randint(0, 300)])
    return StopRule(until_s, stop_id, max_steps)


def step_reference(scheduler: EngineScheduler, rule: StopRule | None = None) -> list[StepResult]:
    """Call :meth:`EngineScheduler.step` until the first of: nothing left to run; the next
    step would start at or after ``rule.until_s``; the request ``rule.stop_when_finished``
    finished; ``rule.max_steps`` steps done. When it runs out of work before ``until_s``
    (and did not stop on its request), ``now_s`` moves forward to ``until_s``.

    Returns every step's result. This is the stop rule the fast simulator implements."""
    rule = rule or StopRule()
    stop = None if rule.stop_when_finished is None else scheduler.find_request(rule.stop_when_finished)
    until_s = math.inf if rule.until_s is None else rule.until_s
    results: list[StepResult] = []
    while scheduler.has_unfinished_requests and len(results) < rule.max_steps:
        if (stop is not None and stop.finished_at_s is not None) or scheduler.now_s >= until_s:
            return results
        result = scheduler.step()
        assert result is not None
        results.append(result)
    stopped_on_request = stop is not None and stop.finished_at_s is not None
    idle = not scheduler.has_unfinished_requests
    if idle and not stopped_on_request and scheduler.now_s < until_s < math.inf:
        scheduler.now_s = until_s
    return results


def num_preemptions(results: list[StepResult]) -> int:
    """Preemptions made in these steps."""
    return sum(len(result.preempted_ids) for result in results)


# --- text whose partial output tells its length --------------------------------------------

_TOPICS = ("chess", "coffee", "gardening", "the moon", "jazz", "volcanoes", "bread", "bees")
_WORDS = ("the", "water", "light", "simple", "change", "time", "world", "idea", "good", "small")


def list_conversations(num_conversations: int, seed: int = 0) -> list[dict[str, Any]]:
    """ShareGPT records whose prompts say nothing about the length and whose answers
    announce it ("Here are 12 tips") and number their items: a partial output shows
    how much is left, a prompt does not."""
    rng = random.Random(seed)
    records = []
    for index in range(num_conversations):
        topic = rng.choice(_TOPICS)
        num_items = rng.randint(3, 30)
        items = [
            f"{number}. " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(7, 10)))
            for number in range(1, num_items + 1)
        ]
        answer = f"Here are {num_items} tips about {topic}:\n" + "\n".join(items)
        answer += "\nI hope this helps!"
        prompt = f"Give me tips about {topic}. [ref {index}]"
        records.append({
            "id": f"list-{seed}-{index}",
            "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}],
        })  # fmt: skip
    return records
