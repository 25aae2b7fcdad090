"""A pure model of one vLLM engine instance: its scheduler and its step latency.

No I/O, no clock, no randomness: time is passed in. :class:`EngineScheduler` is the
reference: the emulated engine in the workers runs it, and the dispatcher rebuilds its
replicas with it. The dispatcher's what-if simulations run on
:class:`~blockq.engine_model.packed.PackedScheduler`, the same scheduler packed into arrays
and compiled, whose steps the tests check equal to the reference's, integers and times.
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
from blockq.engine_model.simulation import SimulationResult

__all__ = [
    "PRESETS",
    "EngineConfig",
    "EnginePreset",
    "EngineRequest",
    "EngineScheduler",
    "SimulationResult",
    "StepLatencyModel",
    "StepResult",
    "StepSample",
    "estimate_prefill_attention_pairs",
    "get_preset",
    "kv_blocks_for_gpu_memory",
]
