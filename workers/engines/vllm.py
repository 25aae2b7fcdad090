"""The vLLM engine adapter: a worker feeding a local vLLM async engine.

vLLM is an optional extra (``pip install blockq[vllm]``) and is imported only when this
engine is built. The adapter follows vLLM's documented ``generate()`` contract: an async
iterator of ``RequestOutput`` objects per request, each holding ``outputs[0]`` with the
*cumulative* ``text`` and ``token_ids`` so far, ``finished``, and ``finish_reason`` on the
last one; ``abort(request_id)`` stops a request.

What vLLM does not expose per request (which step computed which tokens) the adapter
infers from what it observes: a request is *running* once its first token arrived and
*waiting* before that; KV blocks in use are estimated from the tokens of the requests in
flight (``ceil(tokens / block_size)`` each). This path has not been run on a GPU yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from blockq.protocol import RequestProgress
from workers.engines.base import EngineRequestSpec, EngineStepOutput, TokenEvent


@dataclass(frozen=True)
class VllmEngineOptions:
    model: str | None
    max_num_seqs: int = 48
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    block_size: int = 16
    num_gpu_blocks: int | None = None    # for heartbeats; None: unknown until vLLM reports it
    gpu_memory_utilization: float = 0.9
    enable_chunked_prefill: bool = True
    extra_engine_args: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: --model PATH is required for --engine vllm")


def build_vllm_engine(options: VllmEngineOptions) -> Any:
    """vLLM's async engine for ``options`` (imports vLLM lazily)."""
    try:
        from vllm import AsyncEngineArgs, AsyncLLMEngine
    except ImportError as exc:
        raise RuntimeError("engine vllm: the 'vllm' package is not installed (pip install 'blockq[vllm]')") from exc
    args = AsyncEngineArgs(model=options.model, max_num_seqs=options.max_num_seqs,
                           max_num_batched_tokens=options.max_num_batched_tokens, max_model_len=options.max_model_len,
                           block_size=options.block_size, gpu_memory_utilization=options.gpu_memory_utilization,
                           enable_chunked_prefill=options.enable_chunked_prefill, **dict(options.extra_engine_args))
    return AsyncLLMEngine.from_engine_args(args)


def sampling_params(spec: EngineRequestSpec) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p,
                          stop=list(spec.stop) or None)


@dataclass
class _Tracked:
    spec: EngineRequestSpec
    text_sent: int = 0
    num_tokens_sent: int = 0
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class VllmEngine:
    """Implements :class:`workers.engines.base.Engine` over vLLM's async engine."""

    preset = "vllm"
    time_scale = 1.0

    def __init__(self, options: VllmEngineOptions, *, engine: Any = None,
                 params_factory: Callable[[EngineRequestSpec], Any] = sampling_params) -> None:
        self.options = options
        self.model = f"vllm:{options.model}"
        self.engine = engine if engine is not None else build_vllm_engine(options)
        self.params_factory = params_factory
        self._tracked: dict[str, _Tracked] = {}
        self._events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._origin_s = time.monotonic()

    def engine_config(self) -> dict[str, Any]:
        return {"num_gpu_blocks": self.options.num_gpu_blocks or 0, "block_size": self.options.block_size,
                "max_num_seqs": self.options.max_num_seqs,
                "max_num_batched_tokens": self.options.max_num_batched_tokens,
                "max_model_len": self.options.max_model_len}

    def latency_model(self) -> dict[str, Any] | None:
        return None  # the dispatcher uses its preset and refits from observed timings

    def model_time_s(self) -> float:
        return time.monotonic() - self._origin_s

    def validate(self, spec: EngineRequestSpec) -> str | None:
        if spec.prompt_tokens >= self.options.max_model_len:
            return f"prompt: {spec.prompt_tokens} tokens leave no room within max_model_len {self.options.max_model_len}"
        return None

    def add_request(self, spec: EngineRequestSpec) -> None:
        tracked = _Tracked(spec)
        self._tracked[spec.request_id] = tracked
        prompt = spec.prompt if isinstance(spec.prompt, str) else {"prompt_token_ids": list(spec.prompt)}
        stream = self.engine.generate(prompt, self.params_factory(spec), spec.request_id)
        tracked.task = asyncio.get_running_loop().create_task(self._consume(tracked, stream))

    def abort_request(self, request_id: str) -> bool:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return False
        if tracked.task is not None:
            tracked.task.cancel()
        abort = self.engine.abort(request_id)
        if asyncio.iscoroutine(abort):
            asyncio.get_running_loop().create_task(abort)
        return True

    def num_admittable(self) -> int:
        return max(0, self.options.max_num_seqs - len(self._tracked))

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked) or not self._events.empty()

    async def step(self) -> EngineStepOutput:
        """Wait for the next output (up to 50 ms) and return everything produced so far."""
        events: list[TokenEvent] = []
        with contextlib.suppress(TimeoutError):
            events.append(await asyncio.wait_for(self._events.get(), timeout=0.05))
        while not self._events.empty():
            events.append(self._events.get_nowait())
        return EngineStepOutput(tuple(events), (), self.model_time_s())

    def progress(self) -> tuple[list[RequestProgress], list[RequestProgress], int]:
        running, waiting = [], []
        num_blocks = 0
        for request_id, tracked in self._tracked.items():
            spec = tracked.spec
            num_tokens = spec.prompt_tokens + tracked.num_tokens_sent
            item = RequestProgress(request_id, spec.prompt_tokens, num_tokens if tracked.num_tokens_sent else 0,
                                   tracked.num_tokens_sent, spec.predicted_output_tokens, spec.p90_tokens)
            if tracked.num_tokens_sent:
                running.append(item)
                num_blocks += -(-num_tokens // self.options.block_size)
            else:
                waiting.append(item)
        return running, waiting, num_blocks

    async def _consume(self, tracked: _Tracked, stream: AsyncIterator[Any]) -> None:
        request_id = tracked.spec.request_id
        async for output in stream:
            completion = output.outputs[0]
            new_text = completion.text[tracked.text_sent:]
            num_new_tokens = len(completion.token_ids) - tracked.num_tokens_sent
            finished = bool(output.finished)
            if num_new_tokens <= 0 and not finished:
                continue
            is_first = tracked.num_tokens_sent == 0 and num_new_tokens > 0
            tracked.text_sent = len(completion.text)
            tracked.num_tokens_sent += max(0, num_new_tokens)
            reason = (completion.finish_reason or "stop") if finished else None
            if finished:
                self._tracked.pop(request_id, None)
            await self._events.put(TokenEvent(request_id, new_text, max(0, num_new_tokens), is_first, finished, reason))
