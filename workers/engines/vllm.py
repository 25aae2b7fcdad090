"""The vLLM engine adapter: a worker feeding a local vLLM engine (V1's ``AsyncLLM``).

vLLM is optional (the ``.venv-vllm`` environment, ``make vllm``) and imported only when
this engine is built. What the beats carry, and where it comes from:

- **engine config**: vLLM's own after start-up (``cache_config.num_gpu_blocks`` and
  ``block_size``, the scheduler's limits, the model's ``max_model_len``, prefix caching);
- **running / waiting counts, KV usage, preemptions, prefix-cache queries and hits**: the
  stat logger vLLM calls after every iteration (:class:`VllmStats`);
- **step samples** for the dispatcher's latency refit: vLLM's per-iteration details
  (``enable_logging_iteration_details``): context tokens, generation requests, elapsed
  time. The KV tokens a step attends are taken as KV usage times capacity (each running
  request attends to its whole context);
- **running and waiting requests, each one's computed and generated tokens, preemptions
  as they happen, KV blocks held**: vLLM's own scheduler, which the engine core runs as
  :class:`workers.engines.vllm_state.StateReportingScheduler` and which sends a snapshot
  after every step (:mod:`workers.engines.vllm_state`). The beat's state then holds at
  that step's end (:meth:`VllmEngine.state_time_s`); requests the engine core has not
  taken in yet wait behind the rest with nothing computed. Until the first snapshot (and
  for a stand-in engine) the stat logger's counts are laid over arrival order, vLLM's
  FCFS order;
- **blocks cached and evicted**, named by the project's block hashes: vLLM's KV cache events,
  published on a private socket (:mod:`workers.engines.kv_events`); the engine config's
  ``prefix_tokenizer`` names the model's tokenizer, so that the dispatcher predicts hits only
  for requests hashed with it (``BLOCKQ_PREFIX_TOKENIZER``);
- **prompt tokens found cached**, per request: vLLM's ``num_cached_tokens``, in the final record.

A request vLLM refuses or fails (a prompt past ``max_model_len``, an out-of-vocabulary
token id, an engine error) ends with an ``error`` event carrying vLLM's message, which
the worker writes as the request's final record. The adapter publishes no preset, and a
latency model only when given a measured profile (``--profile``, ``blockq profile``);
without one the dispatcher starts from a prior and refits it from the samples.

The options it takes are :mod:`workers.engines.vllm_options`'s. When vLLM refuses to
start, :func:`build_vllm_engine` raises :class:`EngineWillNotStart` (the worker then exits
with status 78, not to be restarted).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from blockq.engine_model.latency import StepLatencyModel
from blockq.text.model_tokenizer import served_tokenizer_id
from blockq.wire.beats import RequestProgress
from workers.engines.base import EngineRequestSpec, EngineStepOutput, TokenEvent, model_refusal
from workers.engines.kv_events import KvEventFeed, kv_events_config
from workers.engines.streamed import (
    AdapterActivity,
    drain_events,
    laid_over_arrival_order,
    progress_item,
    prompt_refusal,
)
from workers.engines.vllm_options import VllmEngineOptions
from workers.engines.vllm_state import (
    SCHEDULER_CLS,
    STATE_ENDPOINT_ENV,
    EngineSnapshot,
    SnapshotReader,
    worker_request_id,
)
from workers.engines.vllm_stats import VllmStats


class EngineWillNotStart(RuntimeError):
    """vLLM refused to start with these options (a KV cache too small for max_model_len,
    a block size no kernel takes, memory vLLM will not find): restarting the worker with
    the same options fails the same way, so the worker exits with
    :data:`blockq.local.cluster_config.WILL_NOT_START_EXIT_CODE` instead."""


def build_vllm_engine(options: VllmEngineOptions, stats: VllmStats) -> tuple[Any, Any, KvEventFeed]:
    """vLLM's async engine for ``options``, its stat logger feeding ``stats``, the socket its
    scheduler sends snapshots to and the feed of its KV events; EngineWillNotStart when vLLM refuses to start (its own message says why: vLLM's
    engine-core process logs the cause before it)."""
    try:
        from vllm import AsyncEngineArgs
        from vllm.config import KVEventsConfig
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import StatLoggerBase
    except ImportError as exc:
        raise RuntimeError("engine vllm: the 'vllm' package is not installed (see `make vllm`)") from exc

    class _Logger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self._cache = vllm_config.cache_config  # its block count is known only after start-up

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            capacity = (self._cache.num_gpu_blocks or 0) * self._cache.block_size
            stats.record(scheduler_stats, iteration_stats, capacity)

        def log_engine_initialized(self) -> None:
            pass

    options.apply_to_environment()
    state_socket, endpoint = _bind_state_socket()
    os.environ[STATE_ENDPOINT_ENV] = endpoint  # the engine-core process inherits it
    kv_feed = KvEventFeed()
    try:
        events = KVEventsConfig(**kv_events_config(kv_feed.publish_endpoint))
        engine = AsyncLLM.from_engine_args(
            AsyncEngineArgs(**options.engine_args(), scheduler_cls=SCHEDULER_CLS, kv_events_config=events),
            stat_loggers=[_Logger])
    except Exception as exc:  # a configuration error in this process, or the engine core's death
        state_socket.close()
        kv_feed.close()
        raise EngineWillNotStart(f"{type(exc).__name__}: {exc}") from exc
    return engine, state_socket, kv_feed


def sampling_params(spec: EngineRequestSpec) -> Any:
    from vllm import SamplingParams

    max_tokens = spec.max_tokens
    if spec.true_output_tokens is not None:
        # A trace replay: the trace's length, run past any end-of-sequence token.
        max_tokens = min(max_tokens, spec.true_output_tokens)
    return SamplingParams(max_tokens=max_tokens, temperature=spec.temperature, top_p=spec.top_p,
                          stop=list(spec.stop) or None, ignore_eos=spec.ignore_eos,
                          min_tokens=min(spec.min_tokens, max_tokens))


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
                 params_factory: Callable[[EngineRequestSpec], Any] = sampling_params,
                 profile_latency_model: StepLatencyModel | None = None) -> None:
        self.options = options
        self.model = options.served_model_name or f"vllm:{options.model}"
        self.stats = VllmStats(adapters=AdapterActivity(options.max_loras) if options.lora_modules else None)
        # Adapter name -> (vLLM's int id, path); LoRARequest objects made when first asked for.
        self._adapters = {name: (index, path) for index, (name, path) in enumerate(options.lora_modules, start=1)}
        self._lora_requests: dict[str, Any] = {}
        self.state = SnapshotReader()
        self._state_socket: Any = None  # None: a stand-in engine, no snapshots
        self._kv_feed: KvEventFeed | None = None  # likewise, no KV events
        self._preempted_ids: list[str] = []
        if engine is None:
            engine, self._state_socket, self._kv_feed = build_vllm_engine(options, self.stats)
        self.engine = engine
        self.params_factory = params_factory
        self._tracked: dict[str, _Tracked] = {}  # in arrival order
        self._events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._origin_s = time.monotonic()
        self._config = _engine_config(self.engine, options)
        if self._kv_feed is not None:
            self._kv_feed.mirror.block_size = self._config["block_size"]  # known once vLLM started
        self._latency_model = profile_latency_model.to_dict() if profile_latency_model else None

    def engine_config(self) -> dict[str, Any]:
        """vLLM's engine config, with LoRA its adapters and those resident (a new dict only
        when they change, so that the dispatcher re-reads it only then)."""
        if self.stats.adapters is not None:
            self._config = self.stats.adapters.engine_config(self._config, list(self._adapters))
        return self._config

    def latency_model(self) -> dict[str, Any] | None:
        """A measured profile's (``--profile``), else None: the dispatcher starts from a
        prior and refits it from the step samples."""
        return self._latency_model

    def engine_stats(self) -> dict[str, Any]:
        return self.stats.engine_stats()

    def model_time_s(self) -> float:
        return time.monotonic() - self._origin_s

    def state_time_s(self) -> float:
        """The end of the step of the snapshot :meth:`progress` read last (not a newer one:
        the beat's lists hold there), while the engine core holds requests (it steps
        without pause then, so that is at most a step ago); else now."""
        snapshot = self.state.latest
        if snapshot is None or not (snapshot.running or snapshot.waiting):
            return self.model_time_s()
        return snapshot.at_s - self._origin_s

    def validate(self, spec: EngineRequestSpec) -> str | None:
        return model_refusal(spec, self.model, self._adapters) or prompt_refusal(spec, self._config["max_model_len"])

    def add_request(self, spec: EngineRequestSpec) -> None:
        tracked = _Tracked(spec)
        self._tracked[spec.request_id] = tracked
        prompt = spec.prompt if isinstance(spec.prompt, str) else {"prompt_token_ids": list(spec.prompt)}
        lora = self._lora_request(spec.model)
        extra = {"lora_request": lora} if lora is not None else {}
        stream = self.engine.generate(prompt, self.params_factory(spec), spec.request_id, **extra)
        tracked.task = asyncio.get_running_loop().create_task(self._consume(tracked, stream))

    def _lora_request(self, model: str | None) -> Any:
        """vLLM's LoRARequest for an adapter name (None: the base model)."""
        if model is None or model not in self._adapters:
            return None
        if model not in self._lora_requests:
            from vllm.lora.request import LoRARequest

            lora_id, path = self._adapters[model]
            self._lora_requests[model] = LoRARequest(model, lora_id, path)
        return self._lora_requests[model]

    def abort_request(self, request_id: str) -> bool:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return False
        self.state.forget(request_id)
        if tracked.task is not None:
            tracked.task.cancel()
        abort = self.engine.abort(request_id)
        if asyncio.iscoroutine(abort):
            asyncio.get_running_loop().create_task(abort)
        return True

    def num_admittable(self) -> int:
        return max(0, self._config["max_num_seqs"] - len(self._tracked))

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked) or not self._events.empty()

    async def step(self) -> EngineStepOutput:
        """Wait for the next output (up to 50 ms) and return everything produced so far,
        with the iterations vLLM ran meanwhile."""
        events = await drain_events(self._events)
        samples = tuple(self.stats.samples)
        self.stats.samples.clear()
        self._read_state()
        preempted_ids, self._preempted_ids = tuple(self._preempted_ids), []
        cached, evicted = self._kv_feed.drain() if self._kv_feed is not None else ((), ())
        return EngineStepOutput(tuple(events), preempted_ids, self.model_time_s(), samples=samples,
                                cached_block_hashes=tuple(cached), evicted_block_hashes=tuple(evicted))

    def _read_state(self) -> EngineSnapshot | None:
        """The latest snapshot, after taking every one that has arrived (noting the
        preemptions they reveal for the next step's output)."""
        if self._state_socket is None:
            return None
        import zmq

        payload = None
        with contextlib.suppress(zmq.Again):
            while True:
                payload = self._state_socket.recv(zmq.NOBLOCK)
        if payload is not None:
            self._preempted_ids += self.state.apply(EngineSnapshot.decode(payload), self._tracked)
        return self.state.latest

    def progress(self) -> tuple[list[RequestProgress], list[RequestProgress], int]:
        snapshot = self._read_state()
        if snapshot is not None:
            return self._progress_of(snapshot)
        running, waiting = laid_over_arrival_order(
            ((t.spec, t.num_tokens_sent) for t in self._tracked.values()), self.stats.num_running, self._adapters)
        return running, waiting, round(self.stats.kv_cache_usage * self._config["num_gpu_blocks"])

    def _progress_of(self, snapshot: EngineSnapshot) -> tuple[list[RequestProgress], list[RequestProgress], int]:
        """The engine core's running and waiting requests as the snapshot has them, then the
        requests it has not taken in yet; those it has finished are left out."""
        lists: tuple[list[RequestProgress], list[RequestProgress]] = ([], [])
        for entries, into in zip((snapshot.running, snapshot.waiting), lists, strict=True):
            for engine_id, num_computed, num_output, _ in entries:
                tracked = self._tracked.get(worker_request_id(engine_id, self._tracked))
                if tracked is not None:  # else answered or aborted here already
                    into.append(progress_item(tracked.spec, num_computed, num_output, self._adapters))
        for request_id, tracked in self._tracked.items():
            if not self.state.has_seen(request_id):
                lists[1].append(progress_item(tracked.spec, 0, 0, self._adapters))
        return lists[0], lists[1], snapshot.used_blocks

    async def _consume(self, tracked: _Tracked, stream: AsyncIterator[Any]) -> None:
        request_id = tracked.spec.request_id
        try:
            async for output in stream:
                self._on_output(tracked, output)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # vLLM's refusal or failure is this request's answer
            self._tracked.pop(request_id, None)
            self.state.forget(request_id)
            message = f"engine: {type(exc).__name__}: {exc}"
            await self._events.put(TokenEvent(request_id, "", 0, False, True, "error", message))

    def _on_output(self, tracked: _Tracked, output: Any) -> None:
        request_id = tracked.spec.request_id
        completion = output.outputs[0]
        new_text = completion.text[tracked.text_sent:]
        num_new_tokens = len(completion.token_ids) - tracked.num_tokens_sent
        finished = bool(output.finished)
        if num_new_tokens <= 0 and not finished:
            return
        is_first = tracked.num_tokens_sent == 0 and num_new_tokens > 0
        tracked.text_sent = len(completion.text)
        tracked.num_tokens_sent += max(0, num_new_tokens)
        reason = _finish_reason(completion.finish_reason) if finished else None
        if finished:
            self._tracked.pop(request_id, None)
            self.state.forget(request_id)
        cached_tokens = getattr(output, "num_cached_tokens", None) if finished else None
        self._events.put_nowait(TokenEvent(request_id, new_text, max(0, num_new_tokens), is_first, finished, reason,
                                           num_cached_tokens=cached_tokens))

    def shutdown(self) -> None:
        """Stop vLLM's engine-core and worker processes."""
        with contextlib.suppress(Exception):
            self.engine.shutdown()
        if self._state_socket is not None:
            self._state_socket.close()
        if self._kv_feed is not None:
            self._kv_feed.close()


def _bind_state_socket() -> tuple[Any, str]:
    """A socket for the engine core's snapshots (the latest one kept) and its endpoint:
    an abstract Unix socket, private to this process's network namespace and gone with it."""
    import zmq

    endpoint = f"ipc://@blockq-vllm-state-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    socket = zmq.Context.instance().socket(zmq.PULL)
    socket.setsockopt(zmq.CONFLATE, 1)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(endpoint)
    return socket, endpoint


def _finish_reason(reason: str | None) -> str:
    """vLLM's reasons are OpenAI's (``stop``, ``length``, ``abort``); others read as stop."""
    return reason if reason in ("stop", "length") else "stop"


def _engine_config(engine: Any, options: VllmEngineOptions) -> dict[str, Any]:
    """The engine config as beats carry it, from what vLLM chose at start-up where it
    says (a stand-in engine without ``vllm_config`` gives the options)."""
    config = getattr(engine, "vllm_config", None)
    if config is None:
        return {"num_gpu_blocks": 0, "block_size": options.block_size or 16, "max_num_seqs": options.max_num_seqs,
                "max_num_batched_tokens": options.max_num_batched_tokens,
                "max_model_len": options.max_model_len or 4096, "watermark": 0.0,
                "enable_prefix_caching": False}
    cache, scheduler = config.cache_config, config.scheduler_config
    return {"num_gpu_blocks": int(cache.num_gpu_blocks or 0), "block_size": int(cache.block_size),
            "max_num_seqs": int(scheduler.max_num_seqs),
            "max_num_batched_tokens": int(scheduler.max_num_batched_tokens),
            "max_model_len": int(config.model_config.max_model_len),
            # vLLM V1 admits without a free-block watermark
            "watermark": 0.0, "enable_prefix_caching": bool(cache.enable_prefix_caching),
            "prefix_tokenizer": served_tokenizer_id(options.model),
            "tensor_parallel_size": int(getattr(getattr(config, "parallel_config", None), "tensor_parallel_size", 1) or 1)}

