"""LoRA adapters in the engine model: vLLM V1's ``max_loras`` rule and the adapter loads.

Admission (``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``): the adapters of
the running requests scheduled this step are recorded first; a waiting request whose
adapter is not among them is *skipped* (``continue``, it keeps its place at the front of
the queue) while they already number ``max_loras``; one admitted adds its adapter. So a
running batch never holds more than ``max_loras`` distinct adapters, and a request whose
adapter is rare may wait long behind popular ones on an instance that serves many.

Loads: the adapters resident on the GPU are an LRU of ``max_loras`` slots (vLLM's
``LRUCacheWorkerLoRAManager`` with ``max_cpu_loras`` = ``max_loras``, its default); a step
whose batch uses an adapter that is not resident loads it, evicting the least recently
used one the batch does not use, and takes ``lora_load_ms`` longer per adapter loaded
(:class:`~blockq.engine_model.config.EngineConfig`; the figure: docs/dispatcher.md,
"Models and adapters").

Pure: lists and ints passed in, nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable


def skips_for_lora(lora_id: int, scheduled_loras: set[int], max_loras: int) -> bool:
    """Whether a waiting request of adapter ``lora_id`` (0: none) is skipped this step,
    the batch already holding ``scheduled_loras``."""
    return lora_id != 0 and len(scheduled_loras) >= max_loras and lora_id not in scheduled_loras


def load_adapters(loaded: list[int], batch_loras: Iterable[int], max_loras: int) -> int:
    """Make every adapter of ``batch_loras`` (0s ignored) resident in ``loaded`` (least
    recently used first; updated in place); returns how many had to be loaded."""
    used = [lora_id for lora_id in dict.fromkeys(batch_loras) if lora_id]
    in_batch = set(used)
    num_loads = 0
    for lora_id in used:
        if lora_id in loaded:
            loaded.remove(lora_id)
        else:
            num_loads += 1
            if len(loaded) >= max_loras:
                victim = next((other for other in loaded if other not in in_batch), None)
                if victim is not None:  # else the batch holds more than max_loras (a restored state)
                    loaded.remove(victim)
        loaded.append(lora_id)  # most recently used last
    return num_loads
