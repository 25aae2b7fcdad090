"""What the two vLLM engines share, the embedded one (:mod:`workers.engines.vllm`) and a
server driven over HTTP (:mod:`workers.engines.vllm_http`): the counters vLLM reports, what
its LoRA stats say of the adapters, the prompt check, a request's progress item and the queue
of token events a step drains; and the embedded engine's state before its first snapshot,
laid over arrival order."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from blockq.wire.beats import RequestProgress
from workers.engines.base import EngineRequestSpec, TokenEvent


@dataclass
class EngineCounters:
    """What vLLM last reported of its requests, KV cache and prefix cache."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0

    def engine_stats(self) -> dict[str, Any]:
        """As beats carry them (``Engine.engine_stats``)."""
        return {"num_running_reqs": self.num_running, "num_waiting_reqs": self.num_waiting,
                "kv_cache_usage": round(self.kv_cache_usage, 4),
                "num_preemptions_total": self.num_preemptions_total,
                "prefix_cache_queries_total": self.prefix_cache_queries_total,
                "prefix_cache_hits_total": self.prefix_cache_hits_total}


@dataclass
class AdapterActivity:
    """With LoRA, what vLLM's stats say of the adapters: those of the running and waiting
    requests (its scheduler stats' ``running_lora_adapters`` / ``waiting_lora_adapters``, which
    its ``/metrics`` gauge ``vllm:lora_requests_info`` carries too) and those resident as far as
    they tell: the adapters seen running, least recently first, at most ``max_loras`` (vLLM's
    LRU of GPU slots, ``max_cpu_loras`` = ``max_loras``)."""

    max_loras: int
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    loaded: list[str] = field(default_factory=list)

    def record(self, running: Iterable[str], waiting: Iterable[str]) -> None:
        """The adapters of the requests running and waiting now (names; repeats are one)."""
        self.running = tuple(sorted(set(running)))
        self.waiting = tuple(sorted(set(waiting)))
        self.mark_used(self.running)

    def mark_used(self, names: Iterable[str]) -> None:
        """``names`` ran just now: they are resident, the most recently used."""
        for name in names:
            if name in self.loaded:
                self.loaded.remove(name)
            self.loaded.append(name)
        del self.loaded[:-max(1, self.max_loras)]

    def engine_stats(self) -> dict[str, Any]:
        """The adapters running and waiting, as beats carry them in the engine stats."""
        return {"running_lora_adapters": list(self.running), "waiting_lora_adapters": list(self.waiting)}

    def engine_config(self, config: dict[str, Any], adapter_names: Sequence[str]) -> dict[str, Any]:
        """``config`` with the adapters served, ``max_loras`` and those resident
        (:mod:`blockq.wire.served_models`); ``config`` itself while it says so already, so that
        the dispatcher re-reads it only when they change."""
        lists = {"lora_adapters": list(adapter_names), "max_loras": self.max_loras, "loaded_loras": list(self.loaded)}
        if all(config.get(name) == value for name, value in lists.items()):
            return config
        return {**config, **lists}


def prompt_refusal(spec: EngineRequestSpec, max_model_len: int) -> str | None:
    """Why vLLM would refuse ``spec``'s prompt (``Engine.validate``), or None."""
    if spec.prompt_tokens >= max_model_len:
        return f"prompt: {spec.prompt_tokens} tokens leave no room within max_model_len {max_model_len}"
    return None


def progress_item(spec: EngineRequestSpec, num_computed: int, num_generated: int,
                  adapter_names: Container[str] = ()) -> RequestProgress:
    """``spec`` as a beat reports it; it names its LoRA adapter when ``spec.model`` is one of
    ``adapter_names`` (the worker sent the request, so it knows; the base model: None)."""
    adapter = spec.model if spec.model is not None and spec.model in adapter_names else None
    return RequestProgress(spec.request_id, spec.prompt_tokens, num_computed, num_generated,
                           spec.predicted_output_tokens, spec.p90_tokens, lora_adapter=adapter)


def laid_over_arrival_order(specs_and_generated: Iterable[tuple[EngineRequestSpec, int]], num_running: int,
                            adapter_names: Container[str] = ()) -> tuple[list[RequestProgress], list[RequestProgress]]:
    """(running, waiting) when vLLM says only how many run: its FCFS order is arrival
    order, so the earliest ``num_running`` run, having computed all but their last token;
    the rest (never started, or preempted: preemption takes the latest) wait with nothing
    computed."""
    running: list[RequestProgress] = []
    waiting: list[RequestProgress] = []
    for spec, num_generated in specs_and_generated:
        is_running = len(running) < num_running
        num_computed = spec.prompt_tokens + num_generated - 1 if is_running and num_generated else 0
        (running if is_running else waiting).append(progress_item(spec, num_computed, num_generated, adapter_names))
    return running, waiting


async def drain_events(events: asyncio.Queue[TokenEvent], wait_s: float = 0.05) -> list[TokenEvent]:
    """Every event queued, after waiting up to ``wait_s`` for the first."""
    drained: list[TokenEvent] = []
    with contextlib.suppress(TimeoutError):
        drained.append(await asyncio.wait_for(events.get(), timeout=wait_s))
    while not events.empty():
        drained.append(events.get_nowait())
    return drained
