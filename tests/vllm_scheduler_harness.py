"""Differential harness: vLLM's own V1 scheduler and blockq's engine model, step for step.

Both schedulers are built from one :class:`~blockq.engine_model.config.EngineConfig`, get
the same requests (arrival step, prompt token ids, output token ids) and are stepped
together. vLLM's :class:`vllm.v1.core.sched.scheduler.Scheduler` runs without a model, as
vLLM's own tests drive it (``tests/v1/core/utils.py``: ``create_scheduler``): ``schedule()``,
then ``update_from_output()`` with a hand-built ``ModelRunnerOutput`` that samples the
request's next known output token when its prefill (or decode) completes, and nothing for
a partial prefill chunk. Requests ignore EOS and stop at ``max_tokens`` (or at
``max_model_len``), so both sides know every output length in advance.

Each step is reduced to a :class:`StepRecord`; :func:`run_both` returns both sides'
records and the first :class:`Difference`, with the steps before it as context. Needs the
vLLM environment; the model is the tiny one ``blockq tiny-model`` writes (never loaded).
"""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

from blockq.engine_model.config import EngineConfig
from blockq.engine_model.latency import StepLatencyModel
from blockq.engine_model.packed import PackedScheduler
from blockq.engine_model.request import EngineRequest
from blockq.engine_model.scheduler import EngineScheduler

# Token ids stay inside the tiny model's vocabulary; EOS is ignored anyway.
VOCAB_TOKENS = (100, 30_000)
CONTEXT_STEPS = 3
DUPLICATE_CACHED_BLOCKS = "duplicate-cached-blocks"
# Any latency model will do; a non-trivial one makes the packed twin's times count too.
_LATENCY = StepLatencyModel(linear_knot_tokens=(1, 512), linear_knot_s=(0.01, 0.05),
                            kv_token_s=1e-6, prefill_pair_s=1e-9, step_overhead_s=0.002)


@dataclass(frozen=True)
class RequestSpec:
    """One request of a sequence: it arrives before step ``arrival_step`` is scheduled and
    produces exactly ``output_token_ids`` (clipped at ``max_model_len``)."""

    request_id: str
    arrival_step: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    lora_id: int = 0  # the LoRA adapter it runs with (0: none; vLLM's lora_int_id)


@dataclass(frozen=True)
class StepRecord:
    """What one step did, on either side. ``scheduled``: (request id, tokens) sorted by id;
    ``preempted``: ids sorted; blocks and queue lengths after the step; prefix-cache
    tokens looked up and found by the admissions of this step."""

    step: int
    scheduled: tuple[tuple[str, int], ...]
    preempted: tuple[str, ...]
    num_used_blocks: int
    num_prefix_queried_tokens: int
    num_prefix_hit_tokens: int
    num_running: int
    num_waiting: int


@dataclass(frozen=True)
class Difference:
    """The first field of the first step where the two sides disagree, with the records
    of both sides up to that step (``CONTEXT_STEPS`` before it). For field ``"packed"``
    the values are the packed twin's state and the engine model's, without context."""

    step: int
    field: str
    vllm_value: Any
    engine_value: Any
    vllm_context: tuple[StepRecord, ...]
    engine_context: tuple[StepRecord, ...]

    def describe(self) -> str:
        """A multi-line report for a failing test."""
        lines = [f"step {self.step}: {self.field}: vllm={self.vllm_value!r} "
                 f"engine={self.engine_value!r}"]
        for name, context in (("vllm", self.vllm_context), ("engine", self.engine_context)):
            lines += [f"  {name} {record}" for record in context]
        return "\n".join(lines)


@dataclass(frozen=True)
class RunResult:
    """Both sides' records up to the end (or up to and including the first difference)."""

    vllm_records: tuple[StepRecord, ...]
    engine_records: tuple[StepRecord, ...]
    difference: Difference | None
    first_duplicate_step: int | None = None

    @property
    def known_cause(self) -> str | None:
        """The name of the documented difference that explains :attr:`difference`, or None.

        ``"duplicate-cached-blocks"``: vLLM cached two copies of one block (two requests
        computed it at once) at or before the differing step; the engine model keeps the
        first copy only (docs/engine-model-vs-vllm.md).
        """
        if self.difference is None or self.first_duplicate_step is None:
            return None
        if self.first_duplicate_step <= self.difference.step:
            return DUPLICATE_CACHED_BLOCKS
        return None


# --- vLLM's side -------------------------------------------------------------------------

def write_tiny_model(path: Path) -> str:
    """Write the tiny model (``blockq tiny-model``, from the running environment) at
    ``path``; returns it as a string."""
    blockq = Path(sys.executable).with_name("blockq")
    subprocess.run([str(blockq), "tiny-model", str(path)], check=True, capture_output=True,
                   timeout=300)
    return str(path)


class VllmSide:
    """vLLM's scheduler built from ``config`` without a model, stepped as vLLM's tests do."""

    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        self.scheduler = _build_vllm_scheduler(config, model_dir)
        self.num_blocks = config.num_gpu_blocks
        self.specs: dict[str, RequestSpec] = {}
        self.first_duplicate_step: int | None = None

    def add(self, spec: RequestSpec) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self.specs[spec.request_id] = spec
        params = SamplingParams(max_tokens=len(spec.output_token_ids), ignore_eos=True)
        lora = {}
        if spec.lora_id:
            from vllm.lora.request import LoRARequest

            lora["lora_request"] = LoRARequest(f"lora-{spec.lora_id}", spec.lora_id, "/unused")
        self.scheduler.add_request(Request(
            request_id=spec.request_id, prompt_token_ids=list(spec.prompt_token_ids),
            sampling_params=params, pooling_params=None, block_hasher=_block_hasher(
                self.scheduler.block_size), **lora))

    @property
    def has_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self, step: int) -> StepRecord:
        from vllm.v1.outputs import ModelRunnerOutput

        scheduler = self.scheduler
        output = scheduler.schedule()
        request_ids = list(output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for request_id in request_ids:
            request = scheduler.requests[request_id]
            # num_computed_tokens already counts this step's tokens: a request that has
            # caught up with its known tokens samples the next one; a partial chunk none.
            if request.num_computed_tokens >= request.num_tokens:
                outputs = self.specs[request_id].output_token_ids
                sampled.append([outputs[request.num_output_tokens]])
            else:
                sampled.append([])
        queried = hits = 0
        stats = scheduler.kv_cache_manager.make_prefix_cache_stats()
        if stats is not None:
            queried = stats.queries + stats.preempted_queries
            hits = stats.hits + stats.preempted_hits
        scheduler.update_from_output(output, ModelRunnerOutput(
            req_ids=request_ids, req_id_to_index={r: i for i, r in enumerate(request_ids)},
            sampled_token_ids=sampled))
        if self.first_duplicate_step is None and _has_duplicate_cached_blocks(scheduler):
            self.first_duplicate_step = step
        num_running, num_waiting = scheduler.get_request_counts()
        return StepRecord(
            step, tuple(sorted(output.num_scheduled_tokens.items())),
            tuple(sorted(output.preempted_req_ids or ())),
            self.num_blocks - scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
            queried, hits, num_running, num_waiting)


def _has_duplicate_cached_blocks(scheduler: Any) -> bool:
    """Whether vLLM's prefix cache holds two blocks under one hash: two requests computed
    the same block at once and vLLM cached both (its block_pool.py, BlockHashToBlockMap:
    "we don't de-duplicate the blocks in the cache")."""
    cache = scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block._cache
    return any(isinstance(blocks, dict) for blocks in cache.values())


def _build_vllm_scheduler(config: EngineConfig, model_dir: str) -> Any:
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config = _vllm_config(config, model_dir)
    # vLLM reserves block 0 as its null block: one more block gives the same usable count.
    num_blocks = config.num_gpu_blocks + 1
    spec = FullAttentionSpec(block_size=config.block_size, num_kv_heads=1, head_size=1,
                             dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=config.block_size, log_stats=True)


def _vllm_config(config: EngineConfig, model_dir: str) -> Any:
    """A VllmConfig as ``create_scheduler`` in vLLM's tests builds it (synchronous
    scheduling, chunked prefill on), with ``config``'s limits."""
    from vllm.config import CacheConfig, LoRAConfig, SchedulerConfig, VllmConfig

    scheduler_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        enable_chunked_prefill=True, async_scheduling=False, is_encoder_decoder=False,
        watermark=config.watermark)
    model_config = _model_config(model_dir, config.max_model_len)
    cache_config = CacheConfig(block_size=config.block_size,
                               enable_prefix_caching=config.enable_prefix_caching)
    lora_config = LoRAConfig(max_loras=config.max_loras) if config.max_loras else None
    return VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                      cache_config=cache_config, lora_config=lora_config)


@lru_cache(maxsize=64)
def _model_config(model_dir: str, max_model_len: int) -> Any:
    # Building a ModelConfig reads the model's files: once per length is enough.
    from vllm.config import ModelConfig

    return ModelConfig(model=model_dir, max_model_len=max_model_len, skip_tokenizer_init=True)


@lru_cache(maxsize=8)
def _block_hasher(block_size: int) -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(block_size, sha256)


# --- the engine model's side -------------------------------------------------------------

class EngineSide:
    """blockq's :class:`EngineScheduler` fed the same requests. With prefix caching, a
    request's block hashes cover its prompt and its (known) output, as vLLM hashes every
    full block of a request's tokens."""

    def __init__(self, config: EngineConfig) -> None:
        self.scheduler = EngineScheduler(config, _LATENCY)
        self.block_size = config.block_size
        self.use_prefix_cache = config.enable_prefix_caching
        self.finished: dict[str, EngineRequest] = {}

    def add(self, spec: RequestSpec) -> None:
        hashes = (block_hashes(spec.prompt_token_ids + spec.output_token_ids, self.block_size)
                  if self.use_prefix_cache else ())
        self.scheduler.add_request(EngineRequest(
            spec.request_id, len(spec.prompt_token_ids), len(spec.output_token_ids),
            prefix_block_hashes=hashes, lora_id=spec.lora_id))

    @property
    def has_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    def step(self, step: int) -> StepRecord:
        queried_before, hits_before = self.scheduler.prefix_cache_tokens
        result = self.scheduler.step()
        if result is None:
            raise RuntimeError("engine model: step with no requests")
        queried, hits = self.scheduler.prefix_cache_tokens
        self.finished.update((request.request_id, request) for request in result.finished)
        return StepRecord(
            step, tuple(sorted(result.num_scheduled_tokens)), tuple(sorted(result.preempted_ids)),
            result.num_used_blocks, queried - queried_before, hits - hits_before,
            result.num_running, result.num_waiting)


class PackedSide:
    """The packed (compiled) twin fed the same requests and run one step at a time; its
    whole state must equal the engine model's after every step. No prefix caching."""

    def __init__(self, config: EngineConfig) -> None:
        self.packed = PackedScheduler(config, _LATENCY)

    def add(self, spec: RequestSpec) -> None:
        self.packed.add_request(spec.request_id, len(spec.prompt_token_ids),
                                len(spec.output_token_ids))

    def step(self) -> None:
        if self.packed.simulate(max_steps=1) != 1:
            raise RuntimeError("packed: no step taken")

    def state(self) -> tuple[Any, ...]:
        packed = self.packed
        ids = packed.request_ids
        rows = sorted((ids[row], *_request_state(packed.request(row)))
                      for row in range(packed.num_rows))
        return ([ids[row] for row in packed.running_rows()],
                [ids[row] for row in packed.waiting_rows()], packed.num_free_blocks, rows)


def engine_state(side: EngineSide, finished: dict[str, EngineRequest]) -> tuple[Any, ...]:
    """The engine model's state in :meth:`PackedSide.state`'s form."""
    scheduler = side.scheduler
    requests = {**finished, **{r.request_id: r for r in [*scheduler.running, *scheduler.waiting]}}
    rows = sorted((request_id, *_request_state(request)) for request_id, request in requests.items())
    return ([r.request_id for r in scheduler.running], [r.request_id for r in scheduler.waiting],
            scheduler.num_free_blocks, rows)


def _request_state(request: EngineRequest) -> tuple[Any, ...]:
    return (request.num_computed_tokens, request.num_generated_tokens, request.num_blocks,
            request.num_preemptions, request.first_scheduled_at_s, request.first_token_at_s,
            request.finished_at_s)


def block_hashes(token_ids: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the full blocks of ``token_ids`` (equal prefixes, equal hashes)."""
    hashes: list[int] = []
    digest = hashlib.sha256()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest.update(repr(token_ids[start:start + block_size]).encode())
        hashes.append(int.from_bytes(digest.copy().digest()[:8], "big"))
    return tuple(hashes)


# --- running both ------------------------------------------------------------------------

def run_both(config: EngineConfig, specs: list[RequestSpec], model_dir: str,
             max_steps: int = 20_000, check_packed: bool = False) -> RunResult:
    """Step both schedulers until every request has finished (or the first difference).
    With ``check_packed`` (and no prefix caching), the packed twin is stepped too and any
    state of it unequal to the engine model's is a difference (field ``"packed"``).

    Raises:
        RuntimeError: if the run passes ``max_steps`` steps (a livelock on either side).
    """
    vllm_side = VllmSide(config, model_dir)
    engine_side = EngineSide(config)
    # The packed twin models neither prefix caching nor LoRA.
    packed_side = (PackedSide(config) if check_packed and not config.enable_prefix_caching and not config.max_loras
                   else None)
    pending = sorted(specs, key=lambda spec: spec.arrival_step)
    vllm_records: list[StepRecord] = []
    engine_records: list[StepRecord] = []
    step = 0
    while pending or vllm_side.has_requests or engine_side.has_requests:
        if step > max_steps:
            raise RuntimeError(f"run_both: still running after {max_steps} steps")
        while pending and pending[0].arrival_step <= step:
            spec = pending.pop(0)
            for side in (vllm_side, engine_side, packed_side):
                if side is not None:
                    side.add(spec)
        if not vllm_side.has_requests and not engine_side.has_requests:
            step = pending[0].arrival_step  # both idle until the next arrival
            continue
        vllm_records.append(vllm_side.step(step))
        engine_records.append(engine_side.step(step))
        difference = first_difference(vllm_records, engine_records)
        if difference is None and packed_side is not None:
            packed_side.step()
            difference = _packed_difference(step, packed_side, engine_side)
        if difference is not None:
            return RunResult(tuple(vllm_records), tuple(engine_records), difference,
                             vllm_side.first_duplicate_step)
        step += 1
    return RunResult(tuple(vllm_records), tuple(engine_records), None,
                     vllm_side.first_duplicate_step)


def _packed_difference(step: int, packed_side: PackedSide,
                       engine_side: EngineSide) -> Difference | None:
    packed_state = packed_side.state()
    reference_state = engine_state(engine_side, engine_side.finished)
    if packed_state == reference_state:
        return None
    return Difference(step, "packed", packed_state, reference_state, (), ())


def first_difference(vllm_records: list[StepRecord],
                     engine_records: list[StepRecord]) -> Difference | None:
    """The first differing field of the last pair of records, or None."""
    vllm_record, engine_record = vllm_records[-1], engine_records[-1]
    for field in fields(StepRecord):
        vllm_value = getattr(vllm_record, field.name)
        engine_value = getattr(engine_record, field.name)
        if vllm_value != engine_value:
            start = max(0, len(vllm_records) - 1 - CONTEXT_STEPS)
            return Difference(vllm_record.step, field.name, vllm_value, engine_value,
                              tuple(vllm_records[start:]), tuple(engine_records[start:]))
    return None


# --- random sequences --------------------------------------------------------------------

def random_config(rng: random.Random) -> EngineConfig:
    """A small engine: block size 4-16, a cache from one maximal request (heavy
    preemption) upwards, prefix caching on or off, chunked prefill with or without a
    long-prefill threshold. Watermark 0 (vLLM's default) in most."""
    block_size = rng.choice([4, 8, 16])
    max_model_len = rng.choice([64, 128, 256, 512])
    max_num_seqs = rng.randint(1, 8)
    max_num_batched_tokens = rng.randint(max(max_num_seqs, 16), 160)
    max_request_blocks = -(-max_model_len // block_size)
    num_gpu_blocks = max_request_blocks + rng.choice([0, 1, 2, 4, max_request_blocks,
                                                     4 * max_request_blocks])
    watermark = 0.0 if rng.random() < 0.8 else _matching_watermark(rng, num_gpu_blocks)
    while int(watermark * num_gpu_blocks) + max_request_blocks > num_gpu_blocks:
        num_gpu_blocks += 1
        watermark = _matching_watermark(rng, num_gpu_blocks) if watermark else 0.0
    threshold = 0 if rng.random() < 0.5 else rng.randint(1, min(max_num_batched_tokens,
                                                                max_model_len))
    return EngineConfig(
        num_gpu_blocks=num_gpu_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        watermark=watermark, enable_prefix_caching=rng.random() < 0.5,
        long_prefill_token_threshold=threshold)


def _matching_watermark(rng: random.Random, num_gpu_blocks: int) -> float:
    """A watermark that gives the same block count over ``num_gpu_blocks`` (blockq) and over
    ``num_gpu_blocks + 1`` (vLLM counts its null block in ``num_blocks``)."""
    for _ in range(100):
        watermark = rng.choice([0.01, 0.05, 0.1])
        if int(watermark * num_gpu_blocks) == int(watermark * (num_gpu_blocks + 1)):
            return watermark
    return 0.0


def random_specs(rng: random.Random, config: EngineConfig) -> list[RequestSpec]:
    """1-16 requests arriving over 0-30 steps: short and long prompts, some sharing a
    prefix (or the whole prompt), output lengths 1-64 (a few past max_model_len)."""
    max_model_len = config.max_model_len
    num_prefixes = rng.choice([0, 0, 1, 2, 3])
    prefixes = [_tokens(rng, rng.randint(1, max_model_len // 2)) for _ in range(num_prefixes)]
    specs: list[RequestSpec] = []
    for index in range(rng.randint(1, 16)):
        short = rng.random() < 0.5
        prompt = _tokens(rng, rng.randint(1, 32 if short else max_model_len - 1))
        if prefixes and rng.random() < 0.7:
            prompt = (rng.choice(prefixes) + prompt)[:max_model_len - 1]
        if specs and rng.random() < 0.1:
            prompt = rng.choice(specs).prompt_token_ids
        output_len = rng.randint(1, 64) if rng.random() < 0.9 else rng.randint(1, max_model_len)
        specs.append(RequestSpec(f"r{index}", rng.randint(0, 30), prompt,
                                 _tokens(rng, output_len)))
    return specs


def _tokens(rng: random.Random, num_tokens: int) -> tuple[int, ...]:
    return tuple(rng.randint(*VOCAB_TOKENS) for _ in range(num_tokens))
