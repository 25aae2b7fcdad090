"""An engine that drives a vLLM server already running (``vllm serve``) over its OpenAI API.

Most fleets run vLLM's OpenAI server in pods; this engine lets a blockq worker sit beside
one instead of replacing it with an embedded engine (``blockq worker --engine vllm-http
--url URL``). What it can see, and from where:

- **model**: the name the server serves its base model under, ``/v1/models``' ``id``
  (``vllm serve --served-model-name NAME``; without it vLLM serves the model path as given):
  the name the server's own OpenAI clients send, so the beats publish it and requests name it;
- **engine config**: the server's ``/v1/models`` (``max_model_len``) and its ``/metrics`` ``vllm:cache_config_info`` (``num_gpu_blocks``,
  ``block_size``, ``enable_prefix_caching``); the scheduler's limits are not published,
  so ``max_num_seqs`` and ``max_num_batched_tokens`` are the worker's options, set to the
  server's own;
- **LoRA adapters** (``vllm serve --enable-lora --lora-modules name=path``): ``/v1/models``
  lists each as its own entry whose ``parent`` is the base model; they are the engine config's
  ``lora_adapters``, and a request naming one is sent with it as the completion's ``model``.
  ``max_loras`` comes from ``/metrics``' ``vllm:lora_requests_info`` gauge (label ``max_lora``;
  vLLM keeps one series per label set ever seen, the newest holding the time it was set), which
  vLLM sets only once it has stepped: until then it is the worker's option. The adapters in use:
  the gauge's ``running_lora_adapters`` / ``waiting_lora_adapters`` labels, with this worker's
  own requests, those streaming as running and those not started as waiting. (vLLM 0.32 names
  in both labels every adapter with a request it has scheduled and not finished, whatever its
  state, and a request only once it has been scheduled: the labels hold no counts, so the split
  is not theirs, and a request skipped by the ``max_loras`` rule shows only as this worker's.)
  Resident adapters (``loaded_loras``) are as the embedded engine tells them
  (:class:`workers.engines.streamed.AdapterActivity`): those seen running. Adapters loaded into
  the server after the worker started (``/v1/load_lora_adapter``) are not seen;
- **tokens**: each request is one streamed ``/v1/completions`` call (text or token ids,
  vLLM's ``ignore_eos`` / ``min_tokens`` extensions, ``continuous_usage_stats`` so every
  chunk says how many tokens have come);
- **what it cannot see**, read from ``/metrics`` every :data:`METRICS_PERIOD_S`: KV usage,
  preemptions, prefix-cache queries and hits (and the running and waiting counts, which
  vLLM's server updates only every few seconds). The replica's per-request state is built
  from what this worker sent and saw streamed back: a request with tokens runs, having
  computed its prompt and its tokens but the last; one without waits;
- **no step samples**: the server's steps are not visible, so the dispatcher's latency
  model is a profile's (``--profile``) or its prior, never refitted from this instance;
- **blocks cached and evicted**: when the server publishes its KV events
  (``vllm serve --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
  "endpoint": "tcp://*:5557"}'``) and the worker is given where (``--kv-events-url
  tcp://host:5557``), as the embedded engine reads them (:mod:`workers.engines.kv_events`);
  the served model's directory (``--model``) names its tokenizer for the dispatcher's
  prefix index. Without both, no hit is predicted on this instance;
- **prompt tokens found cached**, per request: the final usage's
  ``prompt_tokens_details.cached_tokens`` when the server reports it
  (``--enable-prompt-tokens-details``).

Nothing here imports vLLM: the worker needs only HTTP access to the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from blockq.engine_model.latency import StepLatencyModel
from blockq.text.model_tokenizer import served_tokenizer_id
from blockq.wire.beats import RequestProgress
from workers.engines.base import EngineRequestSpec, EngineStepOutput, TokenEvent, model_refusal
from workers.engines.kv_events import KvEventFeed
from workers.engines.streamed import (
    AdapterActivity,
    EngineCounters,
    drain_events,
    progress_item,
    prompt_refusal,
)

METRICS_PERIOD_S = 0.25
CONNECT_TIMEOUT_S = 10.0


class ServerUnavailable(RuntimeError):
    """The server did not answer its start-up reads (``/v1/models``, ``/metrics``)."""


@dataclass
class ServerMetrics(EngineCounters):
    """What the server's ``/metrics`` said last (sums over its engines); with LoRA, its
    newest ``vllm:lora_requests_info`` (``max_loras`` 0: the server has not set it)."""

    cache_config: dict[str, str] = field(default_factory=dict)
    max_loras: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> ServerMetrics:
        """vLLM's Prometheus text (``vllm:`` names; counters end ``_total``)."""
        values: dict[str, float] = {}
        cache_config: dict[str, str] = {}
        lora_info: dict[str, str] = {}
        lora_info_set_at = float("-inf")
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:cache_config_info":
                    cache_config = dict(sample.labels)
                elif sample.name == "vllm:lora_requests_info" and sample.value > lora_info_set_at:
                    lora_info, lora_info_set_at = dict(sample.labels), float(sample.value)  # its value: when set
                values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
        return cls(num_running=int(values.get("vllm:num_requests_running", 0)),
                   num_waiting=int(values.get("vllm:num_requests_waiting", 0)),
                   kv_cache_usage=values.get("vllm:kv_cache_usage_perc", 0.0),
                   num_preemptions_total=int(values.get("vllm:num_preemptions_total", 0)),
                   prefix_cache_queries_total=int(values.get("vllm:prefix_cache_queries_total", 0)),
                   prefix_cache_hits_total=int(values.get("vllm:prefix_cache_hits_total", 0)),
                   cache_config=cache_config, max_loras=int(lora_info.get("max_lora") or 0),
                   running_lora_adapters=_names(lora_info.get("running_lora_adapters")),
                   waiting_lora_adapters=_names(lora_info.get("waiting_lora_adapters")))


def _names(joined: str | None) -> tuple[str, ...]:
    """The adapter names of a ``vllm:lora_requests_info`` label (comma-joined)."""
    return tuple(name for name in (joined or "").split(",") if name)


def served_models(cards: list[dict[str, Any]]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The base model's entry of a server's ``/v1/models`` (its first without a ``parent``)
    and the names of its LoRA adapters: the other entries whose ``parent`` (or, where an entry
    has no such field, ``root``) names the base model, in the server's order. Another entry
    whose ``parent`` is null is another name of the base model (``vllm serve
    --served-model-name A B``), not an adapter."""
    base = next((card for card in cards if not card.get("parent")), cards[0])
    base_names = {base["id"], base.get("root")} - {None}
    adapters = tuple(str(card["id"]) for card in cards if card is not base
                     and card.get("parent", card.get("root")) in base_names)
    return base, adapters


@dataclass(frozen=True)
class VllmHttpOptions:
    """The server's URL (``http://host:port``, no ``/v1``); its scheduler's limits, which it
    does not publish; an API key when the server wants one (``vllm serve --api-key``); where
    it publishes KV events and the served model's directory (its tokenizer); with LoRA, its
    ``max_loras`` until the server's ``/metrics`` says (vLLM's default is 1)."""

    url: str
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    api_key: str | None = None
    kv_events_url: str | None = None
    model_dir: str | None = None
    max_loras: int = 1

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url: must be http(s)://host:port (got {self.url!r})")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_loras"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1 (got {getattr(self, name)})")


def _get(url: str, api_key: str | None) -> str:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=CONNECT_TIMEOUT_S) as response:
            return response.read().decode()
    except OSError as exc:
        raise ServerUnavailable(f"vllm-http: {url}: {exc}") from exc


@dataclass
class _Tracked:
    spec: EngineRequestSpec
    num_tokens_seen: int = 0
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class VllmHttpEngine:
    """Implements :class:`workers.engines.base.Engine` over a vLLM server's HTTP API."""

    preset = "vllm"
    time_scale = 1.0

    def __init__(self, options: VllmHttpOptions, profile_latency_model: StepLatencyModel | None = None) -> None:
        self.options = options
        base = options.url.rstrip("/")
        models = json.loads(_get(f"{base}/v1/models", options.api_key))["data"]
        if not models:
            raise ServerUnavailable(f"vllm-http: {base}/v1/models lists no model")
        base_model, self.lora_adapters = served_models(models)
        self.model = str(base_model["id"])  # the server's name for it, not its path (docs/engines.md)
        self.adapters = AdapterActivity(options.max_loras) if self.lora_adapters else None
        self.metrics = ServerMetrics.parse(_get(f"{base}/metrics", options.api_key))
        cache = self.metrics.cache_config
        self._config = {
            "num_gpu_blocks": int(float(cache.get("num_gpu_blocks") or 0)),
            "block_size": int(float(cache.get("block_size") or 16)),
            "max_num_seqs": options.max_num_seqs, "max_num_batched_tokens": options.max_num_batched_tokens,
            "max_model_len": int(base_model.get("max_model_len") or 4096), "watermark": 0.0,
            "enable_prefix_caching": cache.get("enable_prefix_caching") == "True",
            # Without the server's KV events this worker cannot say what the server caches.
            "prefix_tokenizer": served_tokenizer_id(options.model_dir if options.kv_events_url else None)}
        self._kv_feed = None
        if options.kv_events_url:
            self._kv_feed = KvEventFeed(endpoint=options.kv_events_url)
            self._kv_feed.mirror.block_size = self._config["block_size"]
        self._latency_model = profile_latency_model.to_dict() if profile_latency_model else None
        self._base = base
        self._tracked: dict[str, _Tracked] = {}  # in arrival order
        self._events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._origin_s = time.monotonic()
        self._session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task[None] | None = None
        self._record_adapters()

    # --- what the beats carry -------------------------------------------------------------

    def engine_config(self) -> dict[str, Any]:
        """The server's config, with LoRA its adapters and those resident (a new dict only when
        they change, so that the dispatcher re-reads it only then)."""
        if self.adapters is not None:
            self._config = self.adapters.engine_config(self._config, self.lora_adapters)
        return self._config

    def latency_model(self) -> dict[str, Any] | None:
        return self._latency_model

    def engine_stats(self) -> dict[str, Any]:
        stats = self.metrics.engine_stats()
        if self.adapters is not None:
            stats.update(self.adapters.engine_stats())
        return stats

    def model_time_s(self) -> float:
        return time.monotonic() - self._origin_s

    def state_time_s(self) -> float:
        return self.model_time_s()

    def progress(self) -> tuple[list[RequestProgress], list[RequestProgress], int]:
        """From what this worker saw streamed back: a request with tokens runs, having
        computed all but its last; one without waits (or is in its prefill) with nothing
        computed. (vLLM's /metrics counts are no better: they move every few seconds.)"""
        running: list[RequestProgress] = []
        waiting: list[RequestProgress] = []
        for tracked in self._tracked.values():
            spec, num_generated = tracked.spec, tracked.num_tokens_seen
            if num_generated:
                running.append(progress_item(spec, spec.prompt_tokens + num_generated - 1, num_generated,
                                             self.lora_adapters))
            else:
                waiting.append(progress_item(spec, 0, 0, self.lora_adapters))
        return running, waiting, round(self.metrics.kv_cache_usage * self._config["num_gpu_blocks"])

    # --- requests ---------------------------------------------------------------------------

    def validate(self, spec: EngineRequestSpec) -> str | None:
        refusal = model_refusal(spec, self.model, self.lora_adapters)
        return refusal or prompt_refusal(spec, self._config["max_model_len"])

    def add_request(self, spec: EngineRequestSpec) -> None:
        tracked = _Tracked(spec)
        self._tracked[spec.request_id] = tracked
        tracked.task = asyncio.get_running_loop().create_task(self._consume(tracked))

    def abort_request(self, request_id: str) -> bool:
        """Closing the stream is vLLM's abort: the server stops the request when its client goes."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return False
        if tracked.task is not None:
            tracked.task.cancel()
        return True

    def num_admittable(self) -> int:
        return max(0, self._config["max_num_seqs"] - len(self._tracked))

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked) or not self._events.empty()

    async def step(self) -> EngineStepOutput:
        """Wait for the next tokens (up to 50 ms) and return everything streamed so far."""
        self._start()
        events = await drain_events(self._events)
        cached, evicted = self._kv_feed.drain() if self._kv_feed is not None else ((), ())
        return EngineStepOutput(tuple(events), (), self.model_time_s(), cached_block_hashes=tuple(cached),
                                evicted_block_hashes=tuple(evicted))

    def shutdown(self) -> None:
        for tracked in self._tracked.values():
            if tracked.task is not None:
                tracked.task.cancel()
        if self._poller is not None:
            self._poller.cancel()
        if self._kv_feed is not None:
            self._kv_feed.close()
        if self._session is not None and not self._session.closed:
            with contextlib.suppress(RuntimeError):  # no loop left: the process is ending
                asyncio.get_running_loop().create_task(self._session.close())

    # --- I/O --------------------------------------------------------------------------------

    def _start(self) -> None:
        if self._session is None:
            headers = {"Authorization": f"Bearer {self.options.api_key}"} if self.options.api_key else {}
            self._session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=CONNECT_TIMEOUT_S))
            self._poller = asyncio.get_running_loop().create_task(self._poll_metrics())

    async def _poll_metrics(self) -> None:
        assert self._session is not None
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with self._session.get(f"{self._base}/metrics") as response:
                    self.metrics = ServerMetrics.parse(await response.text())
                    self._record_adapters()
            await asyncio.sleep(METRICS_PERIOD_S)

    def _record_adapters(self) -> None:
        """The server's ``max_loras`` once it says, and the adapters running and waiting: the
        server's, with those of this worker's own requests, streaming or not yet (the server's
        gauge is as of its last step and names no request it has not scheduled)."""
        if self.adapters is None:
            return
        if self.metrics.max_loras:
            self.adapters.max_loras = self.metrics.max_loras
        own_running, own_waiting = [], []
        for tracked in self._tracked.values():
            if tracked.spec.model in self.lora_adapters:
                (own_running if tracked.num_tokens_seen else own_waiting).append(tracked.spec.model)
        self.adapters.record((*self.metrics.running_lora_adapters, *own_running),
                             (*self.metrics.waiting_lora_adapters, *own_waiting))

    def _body(self, spec: EngineRequestSpec) -> dict[str, Any]:
        max_tokens = spec.max_tokens
        if spec.true_output_tokens is not None:  # a trace replay: the trace's length
            max_tokens = min(max_tokens, spec.true_output_tokens)
        prompt: Any = spec.prompt if isinstance(spec.prompt, str) else list(spec.prompt)
        # The base model by the server's name, or an adapter by its own (validate refused others).
        model = spec.model if spec.model in self.lora_adapters else self.model
        return {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": spec.temperature, "top_p": spec.top_p, "stop": list(spec.stop) or None,
                "ignore_eos": spec.ignore_eos, "min_tokens": min(spec.min_tokens, max_tokens), "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}

    async def _consume(self, tracked: _Tracked) -> None:
        self._start()
        assert self._session is not None
        request_id = tracked.spec.request_id
        try:
            async with self._session.post(f"{self._base}/v1/completions", json=self._body(tracked.spec)) as response:
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:500]}")
                async for chunk in _sse_chunks(response.content):
                    self._on_chunk(tracked, chunk)
            if request_id in self._tracked:  # the stream ended without a finish reason
                raise RuntimeError("the stream ended before the request finished")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the server's refusal or failure is this request's answer
            if self._tracked.pop(request_id, None) is not None:
                message = f"engine: {type(exc).__name__}: {exc}"
                await self._events.put(TokenEvent(request_id, "", 0, False, True, "error", message))

    def _on_chunk(self, tracked: _Tracked, chunk: dict[str, Any]) -> None:
        choices = chunk.get("choices") or []
        usage = chunk.get("usage") or {}
        if not choices:
            return  # the last, usage-only chunk
        choice = choices[0]
        num_tokens = int(usage.get("completion_tokens", tracked.num_tokens_seen + 1))
        num_new = max(0, num_tokens - tracked.num_tokens_seen)
        finish_reason = choice.get("finish_reason")
        finished = finish_reason is not None
        if num_new == 0 and not finished:
            return
        is_first = tracked.num_tokens_seen == 0 and num_new > 0
        if is_first and self.adapters is not None and tracked.spec.model in self.lora_adapters:
            self.adapters.mark_used((tracked.spec.model,))  # it runs: its adapter is resident
        tracked.num_tokens_seen = num_tokens
        if finished:
            self._tracked.pop(tracked.spec.request_id, None)
        reason = finish_reason if finish_reason in ("stop", "length") else ("stop" if finished else None)
        details = usage.get("prompt_tokens_details") or {}
        cached_tokens = details.get("cached_tokens") if finished and isinstance(details, dict) else None
        self._events.put_nowait(TokenEvent(
            tracked.spec.request_id, choice.get("text") or "", num_new, is_first, finished, reason,
            num_cached_tokens=cached_tokens if isinstance(cached_tokens, int) else None))


async def _sse_chunks(content: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream, until ``data: [DONE]``."""
    async for raw in content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)
