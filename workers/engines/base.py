"""What a worker needs from an engine: add and abort requests, step, and report state.

Two engines implement it: the emulated engine (the engine model in real time, on CPU)
and the vLLM adapter (a real engine on a GPU).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from blockq.wire.beats import RequestProgress


class TokenEvent(NamedTuple):
    """New output of one request in one engine step (a named tuple: an engine makes one
    per running request per step, so it must be cheap to build)."""

    request_id: str
    text: str
    num_new_tokens: int
    is_first: bool
    finished: bool
    finish_reason: str | None = None      # "stop" | "length" when finished; "error" with error
    error: str | None = None              # why the engine failed the request (it is finished)
    # When finished: prompt tokens the engine found in its prefix cache (None: it does not say).
    num_cached_tokens: int | None = None


@dataclass(frozen=True)
class EngineStepOutput:
    """What one step produced. ``model_time_s`` is the engine clock at the step's end."""

    events: tuple[TokenEvent, ...]
    preempted_ids: tuple[str, ...]
    model_time_s: float
    # The engine iterations run since the last step() as (prefill tokens, decode seqs,
    # KV tokens attended, seconds, prefill attention pairs): one for the emulated engine,
    # however many vLLM ran for the vLLM adapter.
    samples: tuple[tuple[int, int, int, float, int], ...] = ()
    lag_ms: float = 0.0
    # With prefix caching: block hashes (blockq.text.block_hashes) of blocks the engine cached
    # since the last step (the emulated engine: the output blocks of the requests it
    # finished; vLLM: every block its KV events name), and of those it evicted.
    cached_block_hashes: tuple[int, ...] = ()
    evicted_block_hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class EngineRequestSpec:
    """A request as handed to an engine.

    ``ignore_eos`` and ``min_tokens`` are vLLM's sampling parameters of the same names:
    generate past EOS (to ``max_tokens``), and not stop before ``min_tokens`` output tokens.
    """

    request_id: str
    prompt: str | tuple[int, ...]
    prompt_tokens: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    true_output_tokens: int | None = None
    predicted_output_tokens: int | None = None
    p90_tokens: int | None = None
    prefix_block_hashes: tuple[int, ...] = ()
    output_text: str | None = None  # a trace's recorded answer: what the emulated engine streams
    model: str | None = None  # the base model or LoRA adapter asked for (None: the base model)


def model_refusal(spec: EngineRequestSpec, base_model: str, adapter_names: Container[str]) -> str | None:
    """Why an engine serving ``base_model`` and the LoRA adapters ``adapter_names`` cannot
    serve the model ``spec`` names (``Engine.validate``), or None."""
    if spec.model is not None and spec.model != base_model and spec.model not in adapter_names:
        return f"model: {spec.model!r} is not served here (base model {base_model!r})"
    return None


class Engine(Protocol):
    model: str
    preset: str
    time_scale: float

    def engine_config(self) -> dict[str, Any]: ...

    def latency_model(self) -> dict[str, Any] | None: ...

    def validate(self, spec: EngineRequestSpec) -> str | None:
        """Why the engine cannot serve ``spec`` (e.g. prompt past max_model_len), or None."""
        ...

    def add_request(self, spec: EngineRequestSpec) -> None: ...

    def abort_request(self, request_id: str) -> bool: ...

    def num_admittable(self) -> int:
        """How many more requests the engine could start soon (free sequence slots and KV)."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    async def step(self) -> EngineStepOutput:
        """Run one engine iteration (in real time) and return what it produced."""
        ...

    def progress(self) -> tuple[list[RequestProgress], list[RequestProgress], int]:
        """(running, waiting, used KV blocks) right now."""
        ...

    def model_time_s(self) -> float: ...

    def state_time_s(self) -> float:
        """The model time at which :meth:`progress`'s state holds, at a step boundary:
        a dispatcher's replica restores the state there (a state that already includes a
        step under way holds at that step's end, later than :meth:`model_time_s`)."""
        ...

    def engine_stats(self) -> dict[str, Any]:
        """Counters the engine itself reports (preemptions, KV usage, prefix-cache hits),
        carried in beats as they are."""
        ...

    def shutdown(self) -> None:
        """Release what the engine holds (processes, memory); the worker calls it last."""
        ...
