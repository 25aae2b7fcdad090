"""Remaining-length refinements of running requests, as heartbeats carry them.

A request's first guess (p10/p50/p90 of its output length) comes from its prompt alone.
Once it runs, its partial output says much more about how much is left
(:mod:`predictor_service.models.refine`). A worker asks for a refinement each time a
request crosses a checkpoint (every ``every_tokens`` generated tokens: 64, 128, ...), and
its beats report the latest one in the request's :class:`~blockq.wire.beats.RequestProgress`
(``refined_at_tokens`` set, quantiles as *total* output tokens); the dispatcher's replicas
then simulate the request with the refined distribution instead of the first guess.

Two sources answer "what is the latest refinement of this request at ``g`` tokens": a
:class:`RefinementBook`, filled as the predictor's answers come back (the live worker),
and a :class:`RefinementTable`, computed up front from the recorded answers of a trace
(the simulation, which thereby assumes a refinement arrives before the next beat: it
takes about a millisecond of model time per batch). :class:`~workers.heartbeat.HeartbeatBuilder`
applies either the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from blockq.config import DEFAULT_REFINE_EVERY_TOKENS
from blockq.wire.beats import RequestProgress

MAX_BOOK_REQUESTS = 20_000


@dataclass(frozen=True, slots=True)
class RefinedLength:
    """A refinement made after ``at_tokens`` generated tokens; quantiles are total output
    tokens (generated + remaining), each > ``at_tokens``."""

    at_tokens: int
    p10_tokens: int
    p50_tokens: int
    p90_tokens: int

    @classmethod
    def from_remaining(cls, at_tokens: int, p10_tokens: int, p50_tokens: int, p90_tokens: int) -> RefinedLength:
        """From remaining-token quantiles (what the refinement model predicts)."""
        return cls(at_tokens, at_tokens + max(1, p10_tokens), at_tokens + max(1, p50_tokens),
                   at_tokens + max(1, p90_tokens))


def checkpoint_of(num_generated_tokens: int, every_tokens: int) -> int:
    """The latest checkpoint at or below ``num_generated_tokens`` (0: none reached yet)."""
    return (num_generated_tokens // every_tokens) * every_tokens


def checkpoints_below(num_output_tokens: int, every_tokens: int) -> range:
    """Every checkpoint a request of ``num_output_tokens`` passes while it still runs."""
    return range(every_tokens, num_output_tokens, every_tokens)


def with_refinement(item: RequestProgress, refined: RefinedLength | None) -> RequestProgress:
    """``item`` reporting ``refined`` instead of its first guess (unchanged when None)."""
    if refined is None:
        return item
    return item._replace(predicted_output_tokens=refined.p50_tokens, p90_tokens=refined.p90_tokens,
                         p10_tokens=refined.p10_tokens, refined_at_tokens=refined.at_tokens)


class RefinementSource(Protocol):
    every_tokens: int

    def refined(self, request_id: str, num_generated_tokens: int) -> RefinedLength | None:
        """The latest refinement of ``request_id`` made at or below that many tokens."""
        ...


@dataclass
class RefinementBook:
    """The live worker's refinements: which checkpoint each request was last sent for,
    and the answers received. Bounded: the oldest requests are forgotten first."""

    every_tokens: int = DEFAULT_REFINE_EVERY_TOKENS
    _latest: dict[str, RefinedLength] = field(default_factory=dict)
    _requested_at: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.every_tokens < 1:
            raise ValueError(f"refine_every_tokens: must be >= 1 (got {self.every_tokens})")

    def due(self, request_id: str, num_generated_tokens: int) -> int | None:
        """The checkpoint to ask a refinement for now, or None (none reached, or asked)."""
        checkpoint = checkpoint_of(num_generated_tokens, self.every_tokens)
        if checkpoint == 0 or self._requested_at.get(request_id, 0) >= checkpoint:
            return None
        return checkpoint

    def mark_requested(self, request_id: str, at_tokens: int) -> None:
        self._requested_at[request_id] = at_tokens
        if len(self._requested_at) > MAX_BOOK_REQUESTS:
            self.forget(next(iter(self._requested_at)))

    def record(self, request_id: str, refined: RefinedLength) -> None:
        """An answer came back; an older one than what is held is ignored."""
        held = self._latest.get(request_id)
        if request_id in self._requested_at and (held is None or held.at_tokens < refined.at_tokens):
            self._latest[request_id] = refined

    def forget(self, request_id: str) -> None:
        """The request finished (or left this worker)."""
        self._latest.pop(request_id, None)
        self._requested_at.pop(request_id, None)

    def refined(self, request_id: str, num_generated_tokens: int) -> RefinedLength | None:
        held = self._latest.get(request_id)
        # A preempted request that restarts below its refinement point is not helped by it.
        return held if held is not None and held.at_tokens <= num_generated_tokens else None


@dataclass(frozen=True)
class RefinementTable:
    """Refinements computed up front: per request, one at each checkpoint it passes."""

    every_tokens: int
    # Per request, the refinements at every_tokens, 2·every_tokens, ... (as many as it passes).
    by_request: Mapping[str, Sequence[RefinedLength]]

    def refined(self, request_id: str, num_generated_tokens: int) -> RefinedLength | None:
        refinements = self.by_request.get(request_id)
        index = num_generated_tokens // self.every_tokens - 1
        if not refinements or index < 0:
            return None
        return refinements[min(index, len(refinements) - 1)]
