"""The dispatcher's placement core: what the Redis service and the simulator both drive.

:class:`DispatcherCore` applies heartbeats, places batches of requests and re-places the
unstarted requests of an instance that left. It owns its cluster view and the replicas
in it, reads no clock (every call takes ``now_s``, the caller's clock in seconds) and
does no I/O: it returns what to write, and the caller writes it. The one thing it may
measure is how long a decision took, with the ``timer`` it is given (none: decisions are
reported as taking 0 ms), so that the live service can report it; nothing it decides
depends on that figure.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from blockq.engine_model.latency import StepLatencyModel
from blockq.forecast_check import AnsweredRecord, ForecastCheck, ForecastCheckOptions, TrustChange
from blockq.text.block_hashes import PROJECT_SCHEME, PrefixScheme
from blockq.wire.beats import Heartbeat
from blockq.wire.health import HealthPolicy
from blockq.wire.protocol import Assignment, Request
from dispatcher.admission import Infeasible, judge
from dispatcher.autoscale.futures import DRAINING, LIVE, STARTING, FleetSnapshot, InstanceState
from dispatcher.instance_view import InstanceView
from dispatcher.policies import Policy, make_policy, make_view
from dispatcher.priority import eligible_candidates
from dispatcher.what_if import DEFAULT_OBJECTIVE

NUM_ANSWERED_SIZES = 2000
# The reason a request naming a model no live instance serves is refused with.
MODEL_NOT_SERVED = "model_not_served"
# The ``correct`` fallback scales an untrusted replica's steps by (measured / forecast)
# to this power per verdict (see DispatcherCore.observe_answer).
CORRECTION_DAMPING = 0.5


@dataclass(frozen=True, slots=True)
class Placed:
    """``request`` (with its :class:`Assignment`) goes to ``request.assignment.instance_id``."""

    request: Request


@dataclass(frozen=True, slots=True)
class Held:
    """No instance may take ``request`` now (no live instance, or batch work waiting for
    idle capacity); the caller keeps it and offers it again later."""

    request: Request


@dataclass(frozen=True, slots=True)
class Rejected:
    """``request`` cannot be placed at all (e.g. ``oracle`` without a true length)."""

    request: Request
    reason: str


Outcome = Placed | Held | Rejected | Infeasible

# Why a beat was not applied, a label of the rejection counter (a fixed set: never the
# instance id, which a fleet has without bound).
BEAT_UNDECODABLE = "undecodable"  # its bytes did not decode (blockq.wire.beats refused it)
BEAT_UNUSABLE = "unusable"        # decoded, but the view refused it (ValueError, KeyError, TypeError)
BEAT_FAILED = "error"             # decoded, and applying it raised anything else
BEAT_REJECTION_REASONS = (BEAT_UNDECODABLE, BEAT_UNUSABLE, BEAT_FAILED)


@dataclass(frozen=True, slots=True)
class BeatRejection:
    """A beat that changed nothing: ``reason`` (one of :data:`BEAT_REJECTION_REASONS`) and
    the exception that said why."""

    reason: str
    error: Exception

    @property
    def detail(self) -> str:
        return f"{type(self.error).__name__}: {self.error}"


@dataclass
class CoreStats:
    """Counts since start; ``decision_ms`` holds the latest decision times (timer's clock)."""

    num_beats_applied: int = 0
    beats_rejected: Counter[str] = field(default_factory=Counter)  # by reason (BEAT_REJECTION_REASONS)
    num_placed: int = 0
    num_held: int = 0
    num_rejected: int = 0
    num_infeasible: int = 0
    # Prompt tokens of the requests placed, and those predicted cached where they went
    # (instances with prefix caching: dispatcher.prefix_index).
    num_placed_prompt_tokens: int = 0
    num_predicted_cached_tokens: int = 0
    decision_ms: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))

    @property
    def num_beats_rejected(self) -> int:
        return sum(self.beats_rejected.values())


class DispatcherCore:
    """One policy over one cluster view (see the module docstring).

    ``lengths`` overrides the output lengths the replicas simulate with (default: the
    policy's, :data:`dispatcher.policies.POLICIES`). ``slo_ttft_ms``: the TTFT objective
    of interactive requests that carry none (None: none); every decision is judged
    against the request's objective and deadline (:mod:`dispatcher.admission`), and one
    predicted to miss them is answered :class:`Infeasible` instead of placed.
    ``num_simulated_candidates``: how many candidates a simulating policy simulates per
    decision at most (0: every one; None: by the fleet's size; :mod:`dispatcher.policies.shortlist`)."""

    def __init__(self, policy_name: str, *, seed: int | None = None, objective: str = DEFAULT_OBJECTIVE,
                 lengths: str | None = None, health_policy: HealthPolicy | None = None,
                 timer: Callable[[], float] | None = None,
                 slo_ttft_ms: float | None = None,
                 prior_latency_model: StepLatencyModel | None = None,
                 forecast_check: ForecastCheckOptions | None = None,
                 prefix_scheme: PrefixScheme = PROJECT_SCHEME,
                 num_simulated_candidates: int | None = 0) -> None:
        self.view = make_view(policy_name, lengths=lengths, health_policy=health_policy,
                              prior_latency_model=prior_latency_model, prefix_scheme=prefix_scheme)
        self.policy: Policy = make_policy(policy_name, self.view, seed=seed, objective=objective,
                                          slo_ttft_ms=slo_ttft_ms, num_simulated_candidates=num_simulated_candidates)
        self.timer = timer
        self.slo_ttft_ms = slo_ttft_ms
        self.stats = CoreStats()
        # (prompt, output tokens) of the latest requests answered ok, from the beats: the
        # realized mix a scaler sizes future arrivals with.
        self.answered_sizes: deque[tuple[int, int]] = deque(maxlen=NUM_ANSWERED_SIZES)
        # Every instance's forecasts scored against its answers (docs/dispatcher.md, "The
        # forecast check"); its fallback decides what an untrusted replica is used for.
        self.forecast_check = ForecastCheck(forecast_check or ForecastCheckOptions())

    @property
    def lengths(self) -> str:
        """The output lengths the replicas simulate with."""
        return self.view.lengths

    @property
    def simulates(self) -> bool:
        """Whether the policy simulates replicas (and so needs the compiled kernel)."""
        return self.view.keep_replicas

    # --- heartbeats and health ----------------------------------------------------------

    def apply_heartbeat(self, beat: Heartbeat, now_s: float, heard_at_s: float | None = None) -> BeatRejection | None:
        """Apply one beat received at ``now_s`` (that reached the bus at ``heard_at_s``,
        default ``now_s``: see :meth:`ClusterView.apply_heartbeat`); returns None, or why
        the beat was rejected. This is the per-beat boundary: whatever applying it raises
        (a value decoding let through that breaks the replica, a bug), the view keeps the
        instance as it was, the rejection is counted by reason, and the core carries on."""
        try:
            self.view.apply_heartbeat(beat, now_s, heard_at_s)
        except (ValueError, KeyError, TypeError) as exc:  # ValidationError is a ValueError
            return self.reject_beat(BEAT_UNUSABLE, exc)
        except Exception as exc:  # e.g. OverflowError, MemoryError from sizes no engine has
            return self.reject_beat(BEAT_FAILED, exc)
        self.stats.num_beats_applied += 1
        self.answered_sizes.extend(beat.finished_sizes)
        return None

    def reject_beat(self, reason: str, error: Exception) -> BeatRejection:
        """Count a beat rejected for ``reason`` (also one the caller could not decode)."""
        self.stats.beats_rejected[reason] += 1
        return BeatRejection(reason, error)

    def seed_instance(self, beat: Heartbeat) -> None:
        """Know an instance from its latest beat in the registry, before any beat of this
        term is read (:meth:`ClusterView.seed`): not placed on until heard, dead
        ``dead_after_s`` into the term if never heard (its queue then moves)."""
        self.view.seed(beat)

    def hear_again(self, now_s: float) -> None:
        """Silence before ``now_s`` makes no instance dead (:meth:`ClusterView.hear_again`)."""
        self.view.hear_again(now_s)

    def read_beats_until(self, heard_at_s: float | None) -> None:
        """Every beat that reached the bus before ``heard_at_s`` was read (None: every beat,
        the read caught up); silence is counted up to there
        (:meth:`ClusterView.read_beats_until`)."""
        self.view.read_beats_until(heard_at_s)

    def refresh_health(self, now_s: float) -> list[str]:
        """Update health from beat ages; the ids of instances that just left (became
        ``dead``, or were first seen ``stopped``) or started draining: their queues (a
        draining one's unread entries) are to be re-placed."""
        return [view.instance_id for view in self.view.refresh_health(now_s)]

    def live_instances(self) -> list[InstanceView]:
        return self.view.live_instances()

    def fleet_snapshot(self, now_s: float, starting: Mapping[str, float], num_unplaced: int = 0) -> FleetSnapshot:
        """The fleet as a scaler sees it at ``now_s``: every live or draining instance with
        its replica advanced to now (on the caller's clock: one instance's model time
        starts when its engine did), plus ``starting`` (instance id → when it is expected
        to take requests) for those not live yet; new instances are modelled on a live
        one's engine config and (refitted) latency model."""
        states: list[InstanceState] = []
        config, latency_model = None, None
        for view in sorted(self.view.instances.values(), key=lambda v: v.instance_id):
            if view.health not in (LIVE, DRAINING):
                continue
            replica = self.view.replica(view, now_s)
            config, latency_model = replica.config, replica.latency_model
            states.append(InstanceState(
                view.instance_id, view.health, replica.scheduler.rebased(now_s),
                kv_usage=view.heartbeat.num_used_blocks / max(1, replica.config.num_gpu_blocks),
                num_waiting=view.num_waiting + len(view.assigned_not_seen)))
        seen = {state.instance_id for state in states}
        states.extend(InstanceState(instance_id, STARTING, ready_at_s=ready_at_s)
                      for instance_id, ready_at_s in sorted(starting.items()) if instance_id not in seen)
        return FleetSnapshot(now_s, tuple(states), config, latency_model, num_unplaced, tuple(self.answered_sizes))

    # --- the forecast check --------------------------------------------------------------

    def observe_answer(self, record: AnsweredRecord) -> TrustChange | None:
        """Score one final record (a ``done`` record live, a simulated engine's answer)
        against the forecast made at its placement; returns the instance's change of trust
        if this record made one (the caller logs it). With the ``correct`` fallback, each
        verdict that finds an instance untrusted scales its replica's steps by the square
        root of the measured / forecast ratio and scores it afresh, until it is trusted
        again (the correction is kept then: it is what made it so)."""
        check = self.forecast_check
        change = check.observe(record)
        instance_id = record.instance
        if check.options.fallback == "correct" and not check.is_trusted(instance_id) \
                and check.has_verdict(instance_id):
            view = self.view.instances.get(instance_id)
            if view is not None and view.replica is not None:
                # Half the measured ratio, in log terms: a queue amplifies a step-time error
                # in TTFT (2x steps measured 2.4-2.6x TTFT), and a full step overshot to
                # forecasts twice too slow (docs/results/forecast-check.md).
                view.replica.scale_latency(check.ratio(instance_id) ** CORRECTION_DAMPING)
                check.restart(instance_id)
        return change

    # --- placement ----------------------------------------------------------------------

    def place(self, requests: Sequence[Request], now_s: float, *, bus_now_s: float | None = None) -> list[Outcome]:
        """Place ``requests`` in order, each decision seeing the ones before it; one
        outcome per request, in the order given. ``bus_now_s``: the caller's estimate of
        Redis' now, what the time a request waited since its admission is measured
        against (:func:`dispatcher.admission.time_waited_s`; None: from ``submitted_at_s``
        on ``now_s``'s clock, as in the simulation)."""
        live = self.view.live_instances()
        return [self._place_one(request, live, now_s, bus_now_s) for request in requests]

    def replace_unstarted(self, instance_id: str, requests: Sequence[Request], now_s: float, *,
                          bus_now_s: float | None = None) -> list[Outcome]:
        """Place again the requests an instance received but never started (it died or is
        draining), on the other live instances; the instance forgets what it was given.
        They were accepted once: they are placed however late (never :class:`Infeasible`).
        May be called for one chunk of its queue at a time."""
        live = [view for view in self.view.live_instances() if view.instance_id != instance_id]
        outcomes = [self._place_one(request, live, now_s, bus_now_s, admit=False) for request in requests]
        left = self.view.instances.get(instance_id)
        if left is not None:
            left.assigned_not_seen.clear()
        return outcomes

    def _place_one(self, request: Request, live: list[InstanceView], now_s: float, bus_now_s: float | None, *,
                   admit: bool = True) -> Outcome:
        if live and request.model is not None:
            live = self.view.serving(request.model, live)
            if not live:  # answered at once: waiting would not make the model appear
                self.stats.num_rejected += 1
                return Rejected(request, f"{MODEL_NOT_SERVED}: no live instance serves the model {request.model!r}")
        candidates = eligible_candidates(request, live, any_batch_work=bool(self.view.batch_instance_ids)) \
            if live else []
        if not candidates:  # batch work waits for idle capacity; so does everything with no instance
            self.stats.num_held += 1
            return Held(request)
        started = self.timer() if self.timer is not None else 0.0
        try:
            decision = self.policy.choose(request, candidates, now_s, bus_now_s)
            decision_ms = (self.timer() - started) * 1000 if self.timer is not None else 0.0
            infeasible = judge(request, decision, now_s, self.slo_ttft_ms, bus_now_s) if admit else None
            if infeasible is not None:
                self.stats.num_infeasible += 1
                return infeasible
            placed = request.with_assignment(Assignment(
                instance_id=decision.instance_id, policy=self.policy.name, decided_at_s=now_s,
                decision_ms=decision_ms, predicted_ttft_ms=decision.predicted_ttft_ms,
                predicted_e2e_ms=decision.predicted_e2e_ms,
                predicted_cached_tokens=self._count_prompt(request, self.view.instances[decision.instance_id])))
            self.view.record_assignment(decision.instance_id, placed)
        except ValueError as exc:
            self.stats.num_rejected += 1
            return Rejected(request, f"placement failed: {exc}")
        self.stats.decision_ms.append(decision_ms)
        self.stats.num_placed += 1
        return Placed(placed)

    def _count_prompt(self, request: Request, view: InstanceView) -> int | None:
        """Before the placement is recorded: the prompt tokens the request finds cached
        there (None: the instance has no prefix index), counted in the stats."""
        prompt_tokens = request.num_prompt_tokens
        self.stats.num_placed_prompt_tokens += prompt_tokens
        if view.prefix_index is None:
            return None
        cached = view.prefix_index.cached_prompt_tokens(request.prompt_block_hashes, prompt_tokens)
        self.stats.num_predicted_cached_tokens += cached
        return cached
