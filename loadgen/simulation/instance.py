"""One engine instance of the cluster simulation: the emulated engine and the worker's
intake, output and heartbeat logic, driven in virtual time.

Everything that decides here is the live worker's own code: the engine is
:class:`~workers.engines.emulated.EmulatedEngine` (the engine model with step noise) on a
virtual clock, the intake reads :func:`~workers.intake.bundle_room` entries from the
queue, requests become :func:`~workers.intake.engine_spec` and
:class:`~workers.replies.InFlight`, answers are :func:`~workers.replies.final_record`
and beats come from :class:`~workers.heartbeat.HeartbeatBuilder`. What this module adds
is *when* things happen, as the live worker's loops would:

* the step loop runs steps back to back while there is work; a request handed to the
  engine during a step is first seen by the next one;
* the intake loop, when there is room, is blocked in ``XREAD`` and takes new queue
  entries the moment they arrive; when there is none, it re-checks every quarter of
  ``idle_poll_ms`` (room changes only when a step ends, so the first re-check after a
  step end is the one that matters);
* beats go out every heartbeat interval.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from blockq.engine_model import StepResult
from blockq.forecast_check import scaled_latency_model
from blockq.wire.beats import Heartbeat
from blockq.wire.health import InstanceState
from blockq.wire.protocol import FinalRecord, Request
from workers.engines.emulated import EmulatedEngine, EmulatedEngineOptions
from workers.heartbeat import HeartbeatBuilder
from workers.intake import WorkerOptions, bundle_room, engine_spec
from workers.refinement import RefinementSource
from workers.replies import InFlight, final_record, record_step_output


@dataclass
class InstanceCounters:
    num_steps: int = 0
    num_admitted: int = 0
    num_beats: int = 0


@dataclass
class SimulatedInstance:
    """A worker and its engine; the cluster calls its methods at the right virtual times.

    ``clock`` returns the simulation's current time (seconds); the engine and the beats
    read it, as the live ones read the wall clock."""

    instance_id: str
    engine: EmulatedEngine
    worker_options: WorkerOptions
    clock: Callable[[], float]
    queue: deque[Request] = field(default_factory=deque)
    in_flight: dict[str, InFlight] = field(default_factory=dict)
    stepping: bool = False                 # a step is under way (its end is scheduled)
    intake_blocked_since_s: float | None = None  # the intake sleeps (no room) since then
    state: InstanceState = InstanceState.LIVE          # what its beats say: live, draining (no intake), stopped
    sent_last_beat: bool = False           # its ``stopped`` beat went out: it beats no more
    counters: InstanceCounters = field(default_factory=InstanceCounters)
    beats: HeartbeatBuilder = field(init=False)
    max_in_flight: int = field(init=False)
    refinements: RefinementSource | None = None  # what its beats report of running requests' lengths
    hidden_slow_factor: float = 1.0        # each step ends this many times its time late (create's slow_hidden)
    _step: StepResult | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.beats = HeartbeatBuilder(self.instance_id, self.engine, clock=self.clock, refinements=self.refinements)
        self.max_in_flight = int(self.engine.engine_config().get("max_num_seqs") or 1)

    @classmethod
    def create(cls, instance_id: str, engine_options: EmulatedEngineOptions, worker_options: WorkerOptions,
               clock: Callable[[], float], refinements: RefinementSource | None = None, *,
               slow_factor: float = 1.0, slow_published: bool = False,
               slow_hidden: bool = False) -> SimulatedInstance:
        """``slow_factor``: every step takes that many times the preset's time (noise
        included); ``slow_published``: the engine publishes the slowed profile too (else the
        preset's, as a degraded GPU whose profile was measured when it was healthy);
        ``slow_hidden``: the time is lost after each step instead (a starved host): the
        steps' timings, which the dispatcher refits its replica from, stay the profile's."""
        engine = EmulatedEngine(engine_options, clock=clock)
        if slow_factor != 1.0 and not slow_hidden:
            _slow_down(engine, slow_factor, slow_published)
        instance = cls(instance_id, engine, worker_options, clock, refinements=refinements)
        instance.hidden_slow_factor = slow_factor if slow_hidden else 1.0
        return instance

    # --- intake -------------------------------------------------------------------------

    def room(self) -> int:
        return bundle_room(self.worker_options, self.engine, self.max_in_flight, len(self.in_flight))

    def take_from_queue(self, now_s: float) -> list[FinalRecord]:
        """The intake's reads until the queue is empty or there is no room: each hands up
        to ``room()`` queued requests to the engine. Returns the final records of requests
        the engine refused (answered at once, as live)."""
        refused: list[FinalRecord] = []
        if self.state != InstanceState.LIVE:  # a draining worker reads nothing new
            return refused
        num_queued = len(self.queue)
        while (room := self.room()) > 0 and self.queue:
            for _ in range(min(room, len(self.queue))):
                final = self._admit(self.queue.popleft(), now_s)
                if final is not None:
                    refused.append(final)
        # No room: the live intake sleeps and re-checks; room: it waits in XREAD.
        if room <= 0:
            if self.intake_blocked_since_s is None or len(self.queue) < num_queued:
                self.intake_blocked_since_s = now_s  # its sleep starts after its last read
        else:
            self.intake_blocked_since_s = None
        return refused

    def _admit(self, request: Request, now_s: float) -> FinalRecord | None:
        spec = engine_spec(request)
        flight = InFlight(request=request, entry_id=request.id, received_at_s=now_s,
                          prompt_tokens=spec.prompt_tokens)
        problem = self.engine.validate(spec)
        if problem is not None:
            return final_record(flight, self.instance_id, self.engine.time_scale, status="error",
                                finish_reason="abort", error=problem)
        self.engine.add_request(spec)
        self.in_flight[request.id] = flight
        self.counters.num_admitted += 1
        self.beats.record_delivery(request, now_s)
        return None

    def next_intake_check_s(self, now_s: float) -> float | None:
        """When the sleeping intake next looks and finds room, or None: it is not
        sleeping, or it would find no room yet."""
        if self.intake_blocked_since_s is None or self.state != InstanceState.LIVE or self.room() <= 0:
            return None
        period_s = self.worker_options.idle_poll_ms / 1000 / 4
        elapsed_s = now_s - self.intake_blocked_since_s
        return self.intake_blocked_since_s + period_s * (int(elapsed_s / period_s) + 1)

    # --- steps --------------------------------------------------------------------------

    def start_step(self) -> float | None:
        """Start the next step; returns when it ends (None: the engine is idle)."""
        result = self.engine.start_step()
        if result is None:
            self.stepping = False
            return None
        self.stepping = True
        self._step = result
        self.counters.num_steps += 1
        end_s = self.engine.step_end_wall_s(result)
        if self.hidden_slow_factor != 1.0:
            # The engine wakes that late: its clock moves on at the end (finish_step).
            now_s = self.clock()
            end_s = now_s + (end_s - now_s) * self.hidden_slow_factor
        return end_s

    def finish_step(self, now_s: float) -> list[FinalRecord]:
        """End the step under way: tokens to their requests; the final records of the
        requests that finished."""
        if self._step is None:
            raise RuntimeError(f"{self.instance_id}: no step under way")
        output = self.engine.finish_step(self._step)
        self._step = None
        self.beats.record_step(output)
        finals = []
        for event, flight in record_step_output(self.in_flight, output, now_s):
            if event.finished:
                del self.in_flight[event.request_id]
                self.beats.record_finished(event.request_id)
                self.beats.record_answered(flight.prompt_tokens, flight.num_answered_tokens)
                finals.append(final_record(flight, self.instance_id, self.engine.time_scale, status="ok",
                                           finish_reason=event.finish_reason or "stop"))
        return finals

    # --- heartbeats ---------------------------------------------------------------------

    def heartbeat(self) -> Heartbeat:
        self.counters.num_beats += 1
        return self.beats.build(self.state, ())

    @property
    def is_idle(self) -> bool:
        """Nothing in the engine and no step under way (queued requests aside)."""
        return not self.stepping and not self.in_flight and not self.engine.has_unfinished_requests()


class _Slowed:
    """A step-latency source whose every step takes ``factor`` times ``base``'s."""

    def __init__(self, base: Any, factor: float) -> None:
        self.base = base
        self.factor = factor

    def step_seconds(self, *batch: int | None) -> float:
        return self.base.step_seconds(*batch) * self.factor


def _slow_down(engine: EmulatedEngine, factor: float, published: bool) -> None:
    """Make ``engine``'s steps ``factor`` times as long; with ``published``, its beats
    carry the slowed profile (and its step-end estimates use it). The emulated engine has
    no option for this (a live worker has no reason to lie about its profile), so the
    simulation sets it on the engine it built."""
    engine.scheduler.latency_model = _Slowed(engine.scheduler.latency_model, factor)
    if published:
        true_model = scaled_latency_model(engine.base_latency_model, factor)
        engine.base_latency_model = true_model
        engine._latency_dict = true_model.to_dict()  # what latency_model() hands the beats
