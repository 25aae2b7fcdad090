"""Builds a worker's heartbeats from its engine's state (bounded in size)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from blockq.wire.beats import (
    MAX_HEARTBEAT_CACHED_BLOCKS,
    MAX_HEARTBEAT_REQUESTS,
    Heartbeat,
    RequestProgress,
)
from blockq.wire.protocol import Request
from workers.engines.base import Engine, EngineStepOutput
from workers.engines.kv_events import note_block_events
from workers.refinement import RefinementSource, with_refinement

MAX_STEP_SAMPLES = 64
MAX_FINISHED_IDS = 512
# Deliveries (decision to engine intake) a beat's p90 is taken over: the latest, kept
# across beats, so that an instance that received nothing lately still reports one.
MAX_DELIVERY_SAMPLES = 64


class HeartbeatBuilder:
    """Collects step samples and finished requests between beats; ``build`` empties them.
    ``clock`` gives a beat's ``sent_at_s`` (wall seconds; a simulation passes its own).
    With ``refinements``, each request reports its latest remaining-length refinement
    instead of its first guess (:mod:`workers.refinement`)."""

    def __init__(self, instance_id: str, engine: Engine, *, clock: Callable[[], float] = time.time,
                 refinements: RefinementSource | None = None) -> None:
        self.instance_id = instance_id
        self.engine = engine
        self.clock = clock
        self.refinements = refinements
        self.seq = 0
        self._samples: deque[tuple[int, int, int, float, int]] = deque(maxlen=MAX_STEP_SAMPLES)
        self._finished: deque[str] = deque(maxlen=MAX_FINISHED_IDS)
        self._finished_sizes: deque[tuple[int, int]] = deque(maxlen=MAX_FINISHED_IDS)
        # Blocks cached (True) and evicted (False) since the last beat: each block's latest event.
        self._block_events: dict[int, bool] = {}
        self._deliveries_s: deque[float] = deque(maxlen=MAX_DELIVERY_SAMPLES)

    def record_step(self, output: EngineStepOutput) -> None:
        self._samples.extend(output.samples)
        note_block_events(self._block_events, output.cached_block_hashes, True, MAX_HEARTBEAT_CACHED_BLOCKS)
        note_block_events(self._block_events, output.evicted_block_hashes, False, MAX_HEARTBEAT_CACHED_BLOCKS)

    def record_finished(self, request_id: str) -> None:
        self._finished.append(request_id)

    def record_answered(self, prompt_tokens: int, output_tokens: int) -> None:
        """A request answered ``ok`` with these sizes (beside :meth:`record_finished`)."""
        self._finished_sizes.append((prompt_tokens, output_tokens))

    def record_delivery(self, request: Request, handed_over_at_s: float) -> None:
        """``request`` reached the engine at ``handed_over_at_s`` (wall seconds, the
        clock its dispatcher stamped ``decided_at_s`` with)."""
        if request.assignment is not None:
            self._deliveries_s.append(max(0.0, handed_over_at_s - request.assignment.decided_at_s))

    def build(self, state: str, recent_lag_ms: Iterable[float]) -> Heartbeat:
        running, waiting, num_used_blocks = self.engine.progress()
        if self.refinements is not None:
            running, waiting = _refined(running, self.refinements), _refined(waiting, self.refinements)
        lags = sorted(recent_lag_ms)
        lag_p99_ms = lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else 0.0
        lag_mean_ms = sum(lags) / len(lags) if lags else 0.0
        deliveries = sorted(self._deliveries_s)
        delivery_p90_ms = deliveries[int(0.9 * (len(deliveries) - 1))] * 1000 if deliveries else None
        self.seq += 1
        beat = Heartbeat(
            instance_id=self.instance_id, state=state, seq=self.seq, sent_at_s=self.clock(),
            engine_time_s=self.engine.model_time_s(), state_at_s=self.engine.state_time_s(),
            model=self.engine.model, preset=self.engine.preset,
            engine_config=self.engine.engine_config(), latency_model=self.engine.latency_model(),
            num_used_blocks=num_used_blocks,
            running=tuple(running[:MAX_HEARTBEAT_REQUESTS]), waiting=tuple(waiting[:MAX_HEARTBEAT_REQUESTS]),
            num_running_total=len(running), num_waiting_total=len(waiting),
            finished_ids=tuple(self._finished), finished_sizes=tuple(self._finished_sizes), step_samples=tuple(self._samples),
            lag_p99_ms=lag_p99_ms, lag_mean_ms=lag_mean_ms, time_scale=self.engine.time_scale, engine_stats=self.engine.engine_stats(),
            truncated=len(running) > MAX_HEARTBEAT_REQUESTS or len(waiting) > MAX_HEARTBEAT_REQUESTS,
            cached_block_hashes=tuple(h for h, cached in self._block_events.items() if cached),
            evicted_block_hashes=tuple(h for h, cached in self._block_events.items() if not cached),
            delivery_p90_ms=delivery_p90_ms)
        self._samples.clear()
        self._finished.clear()
        self._finished_sizes.clear()
        self._block_events.clear()
        return beat



def _refined(progress: list[RequestProgress], source: RefinementSource) -> list[RequestProgress]:
    every_tokens = source.every_tokens
    return [with_refinement(item, source.refined(item.request_id, item.num_generated_tokens))
            if item.num_generated_tokens >= every_tokens else item for item in progress]
