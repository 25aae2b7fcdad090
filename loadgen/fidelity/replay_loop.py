"""One replay loop for the real engine and the engine model.

A replay feeds requests to an engine in *phases*: each phase starts when the previous one
has drained, and a request of a phase is added once its arrival time (seconds after the
phase started) has passed and the phase has run ``arrival_step`` steps. The fidelity run is
one phase of Poisson arrivals; the profile's sweep is many small phases, each a designed
batch. The loop is the same whatever the clock: the real engine's is the wall clock (a wait
sleeps), the engine model's is virtual (a wait jumps). Requests join between steps, as in
vLLM's engine loop, so a request arriving mid-step waits for the step to end on both sides.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ReplayRequest:
    """One request: its prompt's token ids, the output tokens it must produce (EOS is
    ignored, so every engine produces exactly ``max_tokens``), and when it joins."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float = 0.0
    arrival_step: int = 0
    phase: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"prompt_token_ids: request {self.request_id!r} has none")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1 (got {self.max_tokens})")
        if self.arrival_s < 0 or self.arrival_step < 0 or self.phase < 0:
            raise ValueError("arrival_s, arrival_step, phase: must be >= 0")


@dataclass
class RequestTimes:
    """What one request saw, in the engine's clock (seconds)."""

    request_id: str
    arrival_s: float
    first_token_s: float | None = None
    finished_s: float | None = None
    num_output_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.arrival_s


@dataclass(frozen=True)
class StepRecord:
    """One engine step: its batch (the latency model's features), how long it took, and
    what the scheduler did (requests preempted, prefix-cache tokens hit by admissions)."""

    phase: int
    started_s: float
    duration_s: float
    num_prefill_tokens: int
    num_decode_seqs: int
    num_kv_tokens_attended: int
    num_prefill_attention_pairs: int
    num_preempted: int = 0
    num_prefix_hit_tokens: int = 0


class ReplayEngine(Protocol):
    """What the loop needs of an engine. ``add`` stamps the request with ``arrival_s``
    (when it was due, not when the loop got to it); ``step`` runs one iteration and
    records it."""

    times: dict[str, RequestTimes]
    steps: list[StepRecord]

    def now_s(self) -> float: ...

    def wait_until(self, when_s: float) -> None: ...

    def add(self, request: ReplayRequest, arrival_s: float) -> None: ...

    def has_work(self) -> bool: ...

    def step(self, phase: int) -> None: ...


@dataclass
class ReplayResult:
    """Every request's times and every step, as the engine saw them."""

    requests: list[RequestTimes] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"requests": [asdict(r) for r in self.requests],
                "steps": [asdict(s) for s in self.steps]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplayResult:
        return cls([RequestTimes(**r) for r in data["requests"]],
                   [StepRecord(**s) for s in data["steps"]])


def replay(engine: ReplayEngine, requests: list[ReplayRequest]) -> ReplayResult:
    """Run every phase to the end on ``engine``; the result lists requests in input order."""
    for phase in sorted({request.phase for request in requests}):
        _run_phase(engine, phase, [r for r in requests if r.phase == phase])
    return ReplayResult([engine.times[r.request_id] for r in requests], list(engine.steps))


def _run_phase(engine: ReplayEngine, phase: int, requests: list[ReplayRequest]) -> None:
    pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.arrival_step)))
    origin_s = engine.now_s()
    num_steps = 0
    while pending or engine.has_work():
        now_s = engine.now_s()
        # A request waiting for steps of an idle engine would wait for ever: it goes in.
        while pending and origin_s + pending[0].arrival_s <= now_s \
                and (pending[0].arrival_step <= num_steps or not engine.has_work()):
            request = pending.popleft()
            engine.add(request, origin_s + request.arrival_s)
        if engine.has_work():
            engine.step(phase)
            num_steps += 1
        elif pending:
            engine.wait_until(origin_s + pending[0].arrival_s)
