"""A pure model of one vLLM engine instance: its scheduler and its step latency.

No I/O, no clock, no randomness: time is passed in. :class:`EngineScheduler` is the
reference, stepped one iteration at a time: the emulated engine in the workers runs it, and
the dispatcher rebuilds its replicas with it. The one fast simulator is
:class:`~blockq.engine_model.packed.PackedScheduler`, the same scheduler packed into arrays
and compiled: the dispatcher's replicas and what-if runs use it, and the tests check its
runs equal to stepping the reference, integers and times.
"""

from blockq.engine_model.config import EngineConfig
from blockq.engine_model.latency import (
    StepLatencyModel,
    StepSample,
    estimate_prefill_attention_pairs,
)
from blockq.engine_model.presets import (
    PRESETS,
    EnginePreset,
    get_preset,
    kv_blocks_for_gpu_memory,
)
from blockq.engine_model.request import EngineRequest, StepResult
from blockq.engine_model.scheduler import EngineScheduler

__all__ = [
    "PRESETS",
    "EngineConfig",
    "EnginePreset",
    "EngineRequest",
    "EngineScheduler",
    "StepLatencyModel",
    "StepResult",
    "StepSample",
    "estimate_prefill_attention_pairs",
    "get_preset",
    "kv_blocks_for_gpu_memory",
]
