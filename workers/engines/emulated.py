"""The emulated engine: the engine model driven in real wall-clock time.

Each step's duration comes from the preset's step-latency model, times lognormal noise;
the engine sleeps that long (times ``time_scale``) and then reports the step's tokens.
Requests end at ``true_output_tokens`` when they carry one (trace replay), else at
``max_tokens`` with ``ignore_eos``, else at an EOS drawn from a lognormal length
distribution; never before ``min_tokens``, never beyond ``max_tokens`` nor past
``max_model_len``. All times it reports are model time (wall time / ``time_scale``).
A request that carries its trace's recorded answer (``output_text``) streams that answer's
tokens (the project tokenizer's), so that what a worker sees of a partial output is real;
others stream filler words.

``lag_ms`` per step is how late the event loop woke up against the step's scheduled
end: an overloaded host shows up there instead of silently stretching the results.

With prefix caching on (``config_overrides`` with ``enable_prefix_caching``), requests
are looked up in the engine model's prefix cache by the block hashes they carry
(:mod:`blockq.text.block_hashes`), and ``engine_stats`` reports the scheduler's counts of tokens
looked up and found cached under vLLM's names. A request that carries its recorded answer
has its hashes continued over the answer's tokens, so that the blocks its output fills are
cached as vLLM caches them; each step reports the output blocks that finished requests left
cached (``cached_block_hashes``), which the beats pass on to the dispatcher. The hashes are of
:data:`~blockq.text.block_hashes.PREFIX_BLOCK_TOKENS`-token blocks: an engine with another block size
cannot use them (it logs so once and caches nothing).
"""

from __future__ import annotations

import asyncio
import functools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from blockq.engine_model import EngineRequest, EngineScheduler, StepResult, get_preset
from blockq.text.block_hashes import PREFIX_BLOCK_TOKENS, continued_block_hashes, num_filled_blocks
from blockq.text.tokenizer import AnswerTokenizer
from blockq.wire.beats import RequestProgress
from workers.engines.base import EngineRequestSpec, EngineStepOutput, TokenEvent, model_refusal

log = structlog.get_logger(__name__)

_WORDS = ("the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "with", "on",
          "be", "by", "this", "are", "or", "an", "from")


_TOKEN_TEXTS = tuple(" " + word for word in _WORDS)


def synthetic_token_text(index: int) -> str:
    """The text of output token ``index`` (deterministic filler)."""
    return _TOKEN_TEXTS[index % len(_TOKEN_TEXTS)]


@dataclass(frozen=True)
class EmulatedEngineOptions:
    preset: str = "llama2-7b-a30"
    time_scale: float = 1.0           # wall seconds per model second
    noise_sigma: float = 0.05         # lognormal sigma of step-time noise (0 disables)
    eos_median_tokens: float = 250.0  # output length when a request carries no true length
    eos_sigma: float = 1.0
    seed: int = 0
    config_overrides: tuple[tuple[str, Any], ...] = ()
    # False: a step reports only first tokens and finishes, each with the number of tokens
    # since the request's last event and no text (a simulation that reads no text).
    stream_tokens: bool = True
    # The base model it says it serves (None: "emulated:<preset>") and the LoRA adapters it
    # serves by name (they need the config's max_loras >= 1: config_overrides).
    model_name: str | None = None
    lora_adapters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(set(self.lora_adapters)) != len(self.lora_adapters) or not all(self.lora_adapters):
            raise ValueError("lora_adapters: must be distinct non-empty names")
        if not 0 < self.time_scale <= 1000:
            raise ValueError(f"time_scale: must be in (0, 1000] (got {self.time_scale})")
        if not 0 <= self.noise_sigma <= 1:
            raise ValueError(f"noise_sigma: must be in [0, 1] (got {self.noise_sigma})")


class EmulatedEngine:
    """Implements :class:`workers.engines.base.Engine` on the pure engine model."""

    model = "emulated"

    def __init__(self, options: EmulatedEngineOptions | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options or EmulatedEngineOptions()
        preset = get_preset(self.options.preset, **dict(self.options.config_overrides))
        self.preset = preset.name
        self.model = self.options.model_name or f"emulated:{preset.name}"
        if self.options.lora_adapters and preset.config.max_loras < 1:
            raise ValueError("lora_adapters: need max_loras >= 1 in the engine config")
        # Adapter names as the engine model numbers them (0: the base model).
        self._lora_ids = {name: index for index, name in enumerate(self.options.lora_adapters, start=1)}
        self._loaded_loras: tuple[int, ...] = ()  # as the engine config last published them
        self.time_scale = self.options.time_scale
        self.config = preset.config
        self.rng = random.Random(self.options.seed)
        self.base_latency_model = preset.latency_model
        self._config_dict = preset.config.to_dict()
        self._latency_dict = preset.latency_model.to_dict()
        self.scheduler = EngineScheduler(preset.config, _NoisyLatency(preset.latency_model, self.rng,
                                                                      self.options.noise_sigma), now_s=0.0)
        self.clock = clock
        self._wall_origin_s = clock()
        self._specs: dict[str, EngineRequestSpec] = {}
        self._num_preemptions_total = 0
        self._num_emitted: dict[str, int] = {}
        # A trace's recorded answer, token by token (streamed instead of filler text).
        self._token_texts: dict[str, list[str]] = {}
        self._tokenizer: AnswerTokenizer | None = None
        self._use_block_hashes = (preset.config.enable_prefix_caching
                                  and _can_use_block_hashes(preset.config.block_size))
        self._step_under_way: StepResult | None = None

    # --- Engine protocol ----------------------------------------------------------------

    def engine_stats(self) -> dict[str, Any]:
        scheduler = self.scheduler
        num_queried_tokens, num_hit_tokens = scheduler.prefix_cache_tokens
        return {"num_running_reqs": len(scheduler.running), "num_waiting_reqs": len(scheduler.waiting),
                "kv_cache_usage": round(scheduler.num_used_blocks / max(1, self.config.num_gpu_blocks), 4),
                "num_preemptions_total": self._num_preemptions_total,
                "prefix_cache_queries_total": num_queried_tokens,
                "prefix_cache_hits_total": num_hit_tokens, **self._lora_stats()}

    def _lora_stats(self) -> dict[str, Any]:
        """The adapters of the running and waiting requests, as vLLM's LoRA stats name them
        (what the dispatcher charges an adapter's slot by: dispatcher.adapters), and the
        adapters loaded since start."""
        if not self._lora_ids:
            return {}
        names = self.options.lora_adapters
        scheduler = self.scheduler
        return {"running_lora_adapters": sorted({names[r.lora_id - 1] for r in scheduler.running if r.lora_id}),
                "waiting_lora_adapters": sorted({names[r.lora_id - 1] for r in scheduler.waiting if r.lora_id}),
                "num_lora_loads_total": scheduler.num_lora_loads}

    def shutdown(self) -> None:
        pass  # holds nothing outside this process

    def engine_config(self) -> dict[str, Any]:
        """The engine config as beats carry it (read only; a new dict only when the resident
        adapters change, so that the dispatcher re-reads it only then)."""
        if self._lora_ids and (self._loaded_loras != tuple(self.scheduler.loaded_loras)
                               or "lora_adapters" not in self._config_dict):
            self._loaded_loras = tuple(self.scheduler.loaded_loras)
            names = self.options.lora_adapters
            self._config_dict = {**self._config_dict, "lora_adapters": list(names),
                                 "loaded_loras": [names[lora_id - 1] for lora_id in self._loaded_loras]}
        return self._config_dict

    def latency_model(self) -> dict[str, Any] | None:
        """The latency model as beats carry it (one dict for the engine's life: read only)."""
        return self._latency_dict

    def model_time_s(self) -> float:
        return (self.clock() - self._wall_origin_s) / self.time_scale

    def validate(self, spec: EngineRequestSpec) -> str | None:
        refusal = model_refusal(spec, self.model, self._lora_ids)
        if refusal is not None:
            return refusal
        if spec.prompt_tokens >= self.config.max_model_len:
            return (f"prompt: {spec.prompt_tokens} tokens leave no room for output within "
                    f"max_model_len {self.config.max_model_len}")
        return None

    def add_request(self, spec: EngineRequestSpec) -> None:
        output_tokens = max(1, min(self._output_target(spec), spec.max_tokens,
                                   self.config.max_model_len - spec.prompt_tokens))
        if not self.scheduler.has_unfinished_requests:
            # An idle engine's clock catches up with wall time before new work starts.
            self.scheduler.now_s = max(self.scheduler.now_s, self.model_time_s())
        self.scheduler.add_request(EngineRequest(
            request_id=spec.request_id, prompt_tokens=spec.prompt_tokens,
            output_target_tokens=output_tokens, arrival_s=self.scheduler.now_s,
            prefix_block_hashes=self._block_hashes(spec), lora_id=self._lora_ids.get(spec.model or "", 0)))
        self._specs[spec.request_id] = spec
        self._num_emitted[spec.request_id] = 0
        if spec.output_text and self.options.stream_tokens:
            self._token_texts[spec.request_id] = self._answer_tokens(spec.output_text)

    def abort_request(self, request_id: str) -> bool:
        self._specs.pop(request_id, None)
        self._num_emitted.pop(request_id, None)
        self._token_texts.pop(request_id, None)
        return self.scheduler.abort_request(request_id)

    def num_admittable(self) -> int:
        scheduler = self.scheduler
        free_slots = self.config.max_num_seqs - len(scheduler.running) - len(scheduler.waiting)
        if free_slots <= 0:
            return 0
        return free_slots if scheduler.can_admit(1) else 0

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.has_unfinished_requests)

    async def step(self) -> EngineStepOutput:
        result = self.start_step()
        if result is None:
            return EngineStepOutput((), (), self.scheduler.now_s)
        end_wall_s = self.step_end_wall_s(result)
        await asyncio.sleep(max(0.0, end_wall_s - self.clock()))
        return self.finish_step(result)

    # The two halves of :meth:`step`, for a driver that keeps time itself (the cluster
    # simulation runs them at the step's start and end in virtual time).

    def start_step(self) -> StepResult | None:
        """Run the next step on the engine model (it takes no time here); None when idle."""
        self._step_under_way = self.scheduler.step()
        return self._step_under_way

    def step_end_wall_s(self, result: StepResult) -> float:
        """When, on this engine's clock, the step ``result`` ends."""
        return self._wall_origin_s + (result.started_at_s + result.duration_s) * self.time_scale

    def finish_step(self, result: StepResult) -> EngineStepOutput:
        """What the step ``result`` produced, reported at its end (or later: the lag)."""
        lag_ms = max(0.0, (self.clock() - self.step_end_wall_s(result)) * 1000 / self.time_scale)
        self._step_under_way = None
        scheduler = self.scheduler
        # A late wake-up moves the engine clock on: model time never runs ahead of wall time.
        scheduler.now_s = max(scheduler.now_s, self.model_time_s())
        self._num_preemptions_total += len(result.preempted_ids)
        cached = tuple(block_hash for request in result.finished
                       for block_hash in self._cached_output_blocks(request)) if self._use_block_hashes else ()
        return EngineStepOutput(
            events=self._events(result), preempted_ids=result.preempted_ids, cached_block_hashes=cached,
            model_time_s=scheduler.now_s,
            samples=((result.num_prefill_tokens, result.num_decode_seqs, result.num_kv_tokens_attended,
                      result.duration_s, result.num_prefill_attention_pairs),),
            lag_ms=lag_ms)

    def state_time_s(self) -> float:
        """When the state :meth:`progress` reports holds. The engine model applies a step
        when it starts, so during a step the state is the one at its end; that end is
        given as a real engine could know it (the step's start plus the published latency
        model's duration for its batch), not with this step's drawn noise."""
        step = self._step_under_way
        if step is None:
            return self.model_time_s()
        modelled_s = self.base_latency_model.step_seconds(
            step.num_prefill_tokens, step.num_decode_seqs, step.num_kv_tokens_attended,
            step.num_prefill_attention_pairs)
        return max(self.model_time_s(), step.started_at_s + modelled_s)

    def progress(self) -> tuple[list[RequestProgress], list[RequestProgress], int]:
        return ([self._progress(r) for r in self.scheduler.running],
                [self._progress(r) for r in self.scheduler.waiting],
                self.scheduler.num_used_blocks)

    # --- helpers ------------------------------------------------------------------------

    def _events(self, result: StepResult) -> tuple[TokenEvent, ...]:
        finished = {r.request_id: r for r in result.finished}
        if not self.options.stream_tokens:
            return self._milestone_events(result, finished)
        first = set(result.first_token_ids)
        events = []
        for request_id in result.produced_token_ids:
            spec = self._specs.get(request_id)
            if spec is None:
                continue
            num_emitted = self._num_emitted[request_id]
            self._num_emitted[request_id] = num_emitted + 1
            reason = self._finish_reason(request_id, spec, num_emitted + 1) if request_id in finished else None
            events.append(TokenEvent(request_id, self._token_text(request_id, num_emitted), 1,
                                     request_id in first, reason is not None, reason))
        return tuple(events)

    def _milestone_events(self, result: StepResult, finished: dict[str, EngineRequest]) -> tuple[TokenEvent, ...]:
        """First tokens and finishes only, with the tokens produced since the last event."""
        events = []
        for request_id in result.first_token_ids:
            if request_id not in finished and request_id in self._specs:
                self._num_emitted[request_id] = 1
                events.append(TokenEvent(request_id, "", 1, True, False, None))
        first = set(result.first_token_ids)
        for request_id, request in finished.items():
            spec = self._specs.get(request_id)
            if spec is None:
                continue
            num_new_tokens = request.num_generated_tokens - self._num_emitted[request_id]
            reason = self._finish_reason(request_id, spec, request.num_generated_tokens)
            events.append(TokenEvent(request_id, "", num_new_tokens, request_id in first, True, reason))
        return tuple(events)

    def _finish_reason(self, request_id: str, spec: EngineRequestSpec, num_output_tokens: int) -> str:
        """Why a finished request stopped; forgets it."""
        del self._specs[request_id], self._num_emitted[request_id]
        self._token_texts.pop(request_id, None)
        return "length" if num_output_tokens >= spec.max_tokens else "stop"

    def _block_hashes(self, spec: EngineRequestSpec) -> tuple[int, ...]:
        """The request's block hashes for the prefix cache: its prompt's, continued over its
        recorded answer when it carries one (the blocks its output fills are then cached as
        vLLM caches them; without the answer's tokens they cannot be named)."""
        if not self._use_block_hashes:
            return ()
        return continued_block_hashes(spec.prompt, spec.prefix_block_hashes, spec.output_text)

    def _cached_output_blocks(self, request: EngineRequest) -> tuple[int, ...]:
        """The output blocks a finished request left cached: its blocks past the prompt's
        that its computed tokens filled (the last sampled token's KV is never computed)."""
        spec = self._specs.get(request.request_id)
        if spec is None:
            return ()
        num_full = num_filled_blocks(request.prompt_tokens, request.num_generated_tokens, self.config.block_size)
        return request.prefix_block_hashes[len(spec.prefix_block_hashes):num_full]

    def _answer_tokens(self, text: str) -> list[str]:
        if self._tokenizer is None:
            self._tokenizer = AnswerTokenizer()  # loaded on the first replayed answer only
        return self._tokenizer.token_texts(text)

    def _token_text(self, request_id: str, index: int) -> str:
        """Output token ``index``: the recorded answer's, or filler past it / without one."""
        texts = self._token_texts.get(request_id)
        if texts is not None and index < len(texts):
            return texts[index]
        return synthetic_token_text(index)

    def _progress(self, request: EngineRequest) -> RequestProgress:
        spec = self._specs.get(request.request_id)
        # The adapter by name, for the dispatcher's replica (None: the base model).
        adapter = self.options.lora_adapters[request.lora_id - 1] if request.lora_id else None
        return RequestProgress(request.request_id, request.prompt_tokens, request.num_computed_tokens,
                               request.num_generated_tokens,
                               spec.predicted_output_tokens if spec else None,
                               spec.p90_tokens if spec else None, lora_adapter=adapter)

    def _output_target(self, spec: EngineRequestSpec) -> int:
        """Where ``spec`` would end without the engine's limits (``max_tokens`` and
        ``max_model_len`` cap it). A trace's length wins over ``ignore_eos``: the trace
        says where the answer ended. An EOS is drawn (from the engine's one random stream)
        only when neither decides the length."""
        if spec.true_output_tokens:
            target = spec.true_output_tokens
        elif spec.ignore_eos:
            target = spec.max_tokens
        else:
            target = self._sample_eos()
        return max(target, spec.min_tokens)

    def _sample_eos(self) -> int:
        return max(1, int(self.rng.lognormvariate(math.log(self.options.eos_median_tokens),
                                                  self.options.eos_sigma)))


@functools.cache
def _can_use_block_hashes(block_size: int) -> bool:
    """Whether an engine of ``block_size``-token blocks can use requests' block hashes
    (logged once per block size that cannot)."""
    if block_size == PREFIX_BLOCK_TOKENS:
        return True
    log.warning("emulated_prefix_caching_without_hashes", block_size=block_size,
                hash_block_tokens=PREFIX_BLOCK_TOKENS,
                reason="requests' block hashes cover another block size: nothing is found cached")
    return False


class _NoisyLatency:
    """The preset's latency model times lognormal noise, drawn once per step."""

    def __init__(self, base: Any, rng: random.Random, sigma: float) -> None:
        self.base = base
        self.rng = rng
        self.sigma = sigma

    def step_seconds(self, *batch: int | None) -> float:
        seconds = self.base.step_seconds(*batch)
        return seconds * math.exp(self.rng.gauss(0.0, self.sigma)) if self.sigma else seconds
