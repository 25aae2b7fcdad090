"""What vLLM's stat logger reports, as a worker keeps it for its beats
(:mod:`workers.engines.vllm`): counts, KV usage, prefix-cache counters, step samples and,
with LoRA, the adapters running, waiting and resident."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from workers.engines.streamed import AdapterActivity, EngineCounters

MAX_PENDING_SAMPLES = 256


@dataclass
class VllmStats(EngineCounters):
    """What vLLM's stat logger reported, as of its last call, and its step samples."""

    samples: deque[tuple[int, int, int, float, int]] = field(
        default_factory=lambda: deque(maxlen=MAX_PENDING_SAMPLES))
    # With LoRA: the adapters running, waiting and resident (None: no LoRA).
    adapters: AdapterActivity | None = None

    def record(self, scheduler_stats: Any, iteration_stats: Any, kv_capacity_tokens: int) -> None:
        if iteration_stats is not None:
            self.num_preemptions_total += int(iteration_stats.num_preempted_reqs)
        if scheduler_stats is None:
            return
        if self.adapters is not None:
            self.adapters.record(_with_requests(getattr(scheduler_stats, "running_lora_adapters", None)),
                                 _with_requests(getattr(scheduler_stats, "waiting_lora_adapters", None)))
        self.num_running = int(scheduler_stats.num_running_reqs)
        self.num_waiting = int(scheduler_stats.num_waiting_reqs) + int(scheduler_stats.num_skipped_waiting_reqs)
        self.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
        prefix = scheduler_stats.prefix_cache_stats
        if prefix is not None:
            # Re-admissions after a preemption too, which vLLM counts apart: the emulated
            # engine counts every admission, and a beat means the same from either.
            self.prefix_cache_queries_total += int(prefix.queries) + int(getattr(prefix, "preempted_queries", 0))
            self.prefix_cache_hits_total += int(prefix.hits) + int(getattr(prefix, "preempted_hits", 0))
        details = scheduler_stats.iteration_details
        if details is not None and not details.is_dummy and details.elapsed_ms > 0:
            num_prefill_tokens = int(details.num_ctx_tokens)
            # Chunks of one prompt each: the attention pairs of a chunk are not reported.
            self.samples.append((num_prefill_tokens, int(details.num_generation_requests),
                                 round(self.kv_cache_usage * kv_capacity_tokens), details.elapsed_ms / 1000,
                                 num_prefill_tokens * (num_prefill_tokens + 1) // 2))

    def engine_stats(self) -> dict[str, Any]:
        stats = super().engine_stats()
        if self.adapters is not None:
            stats.update(self.adapters.engine_stats())
        return stats


def _with_requests(adapter_to_num_requests: dict[str, int] | None) -> list[str]:
    """The adapters with requests in one of vLLM's LoRA stats (its dicts name every adapter
    with a request it has scheduled and not finished, in both, with a count of 0 where none
    is in that state: ``vllm/v1/metrics/stats.py``, ``LoRARequestStates``)."""
    return [name for name, num_requests in (adapter_to_num_requests or {}).items() if num_requests]
