"""The dispatcher's view of the fleet, built from heartbeats (pure: time is passed in).

Health follows each instance's beats: ``joining`` until its first ``live`` beat, ``live``
while beats arrive, ``suspect`` after two missed intervals, ``dead`` after
``dead_after_s`` without a beat; ``draining`` / ``stopped`` when the worker says so.
Only ``live`` instances receive new requests. Silence is counted up to the newest beat
the dispatcher has read (:meth:`ClusterView.read_beats_until`; up to now once its reads
caught up): behind on the beat stream, it has heard nobody since then.

Silence counts only while the dispatcher could have heard a beat: after it starts leading,
reconnects, or its own reads failed, it calls :meth:`ClusterView.hear_again`, and no
instance is ``dead`` until ``dead_after_s`` has passed since then (it is ``suspect``
meanwhile: no new requests, queue left alone). Otherwise an outage of Redis itself would
make every instance look dead at once and hand every queue to the first one to beat again.

A dispatcher that starts leading first learns the fleet from the registry of instances
(:meth:`ClusterView.seed`: each instance's latest beat, whatever the capped beat stream
still holds): those instances are ``suspect`` until a beat of theirs is heard, and dead
``dead_after_s`` into the term if none is (so an instance that died before the term, beats
trimmed away, still has its queue moved).

A heartbeat is a snapshot from the past, so the view also remembers what the
dispatcher itself assigned since: ``assigned_not_seen`` holds requests placed on an
instance that its latest beat does not show yet; they are dropped once a beat shows them
(running, waiting or finished).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from blockq.engine_model import EngineConfig, StepLatencyModel, get_preset
from blockq.engine_model.presets import PRESETS
from blockq.lengths import check_length_mode
from blockq.text.block_hashes import PROJECT_SCHEME, PrefixScheme
from blockq.text.model_tokenizer import PROJECT_TOKENIZER
from blockq.wire.beats import Heartbeat, progress_column
from blockq.wire.health import HealthPolicy, InstanceState, silence_s
from blockq.wire.protocol import Request
from blockq.wire.served_models import adapter_names, serves
from dispatcher.instance_view import InstanceView
from dispatcher.prefix_index import PrefixIndex
from dispatcher.replica import InstanceReplica


class ClusterView:
    """Instances by id, updated by :meth:`apply_heartbeat` and :meth:`refresh_health`."""

    def __init__(self, health_policy: HealthPolicy | None = None, *, keep_replicas: bool = False,
                 lengths: str = "median", prior_latency_model: StepLatencyModel | None = None,
                 prefix_scheme: PrefixScheme = PROJECT_SCHEME) -> None:
        """``keep_replicas``: every live instance gets a scheduler replica from its first
        beat on, rebuilt on the heartbeat path (for policies that simulate); otherwise a
        replica is made only when :meth:`replica` is first asked for one. ``lengths``: the
        output lengths the replicas simulate with (:data:`blockq.lengths.LENGTH_MODES`).
        ``prior_latency_model``: for instances that publish none and name no known preset
        (default: :data:`PRIOR_PRESET`'s; ``blockq dispatcher --profile``). ``prefix_scheme``:
        how requests' prompt block hashes were made (``Settings.prefix_scheme``): prefix hits
        are predicted on instances that cache blocks of the same size and tokenizer."""
        self.health_policy = health_policy or HealthPolicy()
        self.instances: dict[str, InstanceView] = {}
        self.keep_replicas = keep_replicas
        self.lengths = check_length_mode(lengths)
        self.audible_since_s = float("-inf")
        # Every beat that reached the bus before this was read (inf: all of them, up to now).
        self.read_until_s = float("inf")
        self.prior_latency_model = prior_latency_model or get_preset(PRIOR_PRESET).latency_model
        self.prefix_scheme = prefix_scheme
        self.num_replica_rebuilds = 0  # replicas built or rebuilt from a beat, since start
        # Instances that may hold batch work not finished (a superset of those whose
        # batch_request_ids is not empty): while it is empty, no candidate list needs
        # filtering for batch work (dispatcher.priority), which at 1,024 instances was a
        # pass over the fleet per decision.
        self.batch_instance_ids: set[str] = set()
        self._live: list[InstanceView] | None = None  # live_instances(), until health changes
        # serving(): model -> (the live list it filtered, the instances serving the model);
        # cleared when an instance's served names change.
        self._serving: dict[str, tuple[list[InstanceView], list[InstanceView]]] = {}

    def hear_again(self, now_s: float) -> None:
        """The dispatcher can hear beats from ``now_s`` on (it starts leading, reconnected,
        or its reads failed until now): silence before ``now_s`` no longer makes an
        instance dead (see the module docstring)."""
        self.audible_since_s = max(self.audible_since_s, now_s)

    def read_beats_until(self, heard_at_s: float | None) -> None:
        """The dispatcher has read every beat that reached the bus before ``heard_at_s``
        (None: all of them, its read caught up): instances' silence is counted up to there
        (:func:`blockq.wire.health.silence_s`)."""
        self.read_until_s = float("inf") if heard_at_s is None else heard_at_s

    def latency_model_of(self, beat: Heartbeat) -> StepLatencyModel:
        """The latency model an instance publishes, else its preset's, else the prior."""
        if beat.latency_model:
            return StepLatencyModel.from_dict(beat.latency_model)
        if beat.preset in PRESETS:
            return get_preset(beat.preset).latency_model
        return self.prior_latency_model

    def replica(self, view: InstanceView, now_wall_s: float, *, keep_current: bool = True,
                as_is: bool = False) -> InstanceReplica:
        """``view``'s scheduler replica at ``now_wall_s``: rebuilt from the latest beat when
        it was built from an older one (or never), else advanced along its own trajectory
        (which already includes every assignment made since its last rebuild).
        ``keep_current``: the caller will likely need it again soon, so its next beats
        rebuild it at once (:data:`HOT_REPLICA_S`); false for a one-off look.
        ``as_is``: a look to rank by, not to place by: a replica last rebuilt (from an
        older beat) no more than :data:`AS_IS_S` ago is advanced instead of rebuilt (a
        rebuild costs several times more); the caller asks again without ``as_is``
        before placing by it (:meth:`is_current` tells)."""
        if keep_current:
            view.replica_used_at_s = now_wall_s
        if view.replica is None:
            self._create_replica(view)
            assert view.replica is not None
        if view.replica_beat is not view.heartbeat and not (
                as_is and view.replica_beat is not None and now_wall_s - view.replica_built_at_s <= AS_IS_S):
            self._rebuild(view, now_wall_s)
        else:
            view.replica.advance(now_wall_s)
        return view.replica

    @staticmethod
    def is_current(view: InstanceView) -> bool:
        """Whether ``view``'s replica was rebuilt from its latest beat."""
        return view.replica is not None and view.replica_beat is view.heartbeat

    def apply_heartbeat(self, beat: Heartbeat, now_s: float, heard_at_s: float | None = None) -> InstanceView:
        """Record ``beat``; stale or repeated beats (seq not newer) change nothing.

        ``heard_at_s``: when the beat reached the bus, on the caller's clock (default
        ``now_s``); an instance's silence is measured from it, so that a beat replayed
        long after it was sent does not make its instance look fresh. The replica is
        synced at ``now_s`` either way (the beat's own times say how old its state is).

        A newer beat makes the instance's replica stale; it is rebuilt from the latest beat
        when a decision next needs it (:meth:`replica`), so a beat costs little and a
        replica no decision looks at is never rebuilt, except that a replica a decision
        used within :data:`HOT_REPLICA_S` is rebuilt here, at once: the next decision most
        likely needs it too, and should not wait for its rebuild (docs/dispatcher.md,
        "Decisions and heartbeats at fleet scale").
        Between beats a replica drifts from its engine's step phase by the steps' noise,
        and a short prompt predicted to make a step that starts a few ms after it is placed
        misses it by a whole step when the phase is off: a decision therefore never uses a
        replica older than the latest beat (rebuilding on every 100 ms beat instead of
        every 300 ms took ``block``'s mean TTFT at 0.9 x Llumnix's capacity from 80.4 to
        78.0 ms: docs/decisions/placement.md). What a replica must see of every beat, not
        only of the latest (its step timings, the requests finished), it is given here.

        Raises:
            ValueError: when the beat's engine config, or (replicas kept) its latency
                model, cannot be used. Whatever it raises, nothing is changed then.
        """
        view = self.instances.get(beat.instance_id)
        heard_at_s = now_s if heard_at_s is None else min(heard_at_s, now_s)
        if view is not None and view.heard and beat.seq <= view.heartbeat.seq \
                and beat.sent_at_s <= view.heartbeat.sent_at_s:
            return view
        listed_ids = self._check(view, beat)
        saved = _saved(view)
        try:
            return self._take(view, beat, now_s, heard_at_s, listed_ids)
        except Exception:
            # All or nothing: the instance stays as it was (a new one stays unknown), and
            # its replica, which may be half rebuilt, is made again from its previous beat.
            if saved is None:
                self.instances.pop(beat.instance_id, None)
            else:
                self.instances[beat.instance_id] = saved
                if saved.batch_request_ids:
                    self.batch_instance_ids.add(saved.instance_id)
            self._live = None
            raise

    def _take(self, view: InstanceView | None, beat: Heartbeat, now_s: float, heard_at_s: float,
              listed_ids: list[str] | None) -> InstanceView:
        if view is None:
            view = InstanceView(beat.instance_id, beat, heard_at_s)
            self.instances[beat.instance_id] = view
            self._live = None
        if view.heartbeat is not beat and (view.heartbeat.model != beat.model or not _same(
                view.heartbeat.engine_config, beat.engine_config) and adapter_names(
                view.heartbeat.engine_config) != adapter_names(beat.engine_config)):
            self._serving.clear()
        view.heartbeat = beat
        view.last_beat_at_s = heard_at_s
        view.heard = True
        if view.health != beat.state:
            view.health = beat.state
            self._live = None
        if view.prefix_index is None and _indexes_prefixes(beat, self.prefix_scheme):
            view.prefix_index = PrefixIndex(max(1, int(beat.engine_config.get("num_gpu_blocks") or 1)),
                                            self.prefix_scheme.block_tokens)
        if view.prefix_index is not None:
            # What the engine says it cached (outputs: placements cannot show them) and evicted.
            view.prefix_index.forget(beat.evicted_block_hashes)
            view.prefix_index.record(beat.cached_block_hashes)
        if beat.state != InstanceState.STOPPED:
            view.left_reported = False
        if beat.state not in (InstanceState.DRAINING, InstanceState.STOPPED):
            view.drain_reported = False  # back to work: a later drain is reported again
        self._reconcile(view, beat, listed_ids)
        if view.replica is None and self.keep_replicas and beat.state == InstanceState.LIVE:
            self._create_replica(view)
        if view.replica is not None:
            view.replica.observe_beat(beat)
            if now_s - view.replica_used_at_s <= HOT_REPLICA_S:
                self._rebuild(view, now_s)
                view.replica.baseline()  # the next decision reads it
        return view

    def seed(self, beat: Heartbeat) -> None:
        """Know ``beat``'s instance from the registry of instances (its latest beat), before
        a beat of it is heard: ``suspect`` (``stopped`` if it said so), never placed on,
        silent since before the dispatcher could hear (:meth:`hear_again` decides when it
        is dead); the first beat heard replaces this one, whatever its seq. An instance
        already known is left as it is."""
        if beat.instance_id in self.instances:
            return
        health = InstanceState.STOPPED if beat.state == InstanceState.STOPPED else InstanceState.SUSPECT
        self._live = None
        self.instances[beat.instance_id] = InstanceView(beat.instance_id, beat, float("-inf"), health=health,
                                                        heard=False)

    def _check(self, view: InstanceView | None, beat: Heartbeat) -> list[str] | None:
        """Refuse (ValueError) what is new in ``beat`` and unusable (the same dicts as the
        last heard beat's were checked then): an engine config the engine model refuses,
        whatever the policy (every policy computes with it: one with ``block_size`` 0 was
        applied where no replica is kept, and each placement then divided by it), and,
        where a replica will be built from it, a latency model that does not build or
        request lists it could not be rebuilt from. Returns the listed request ids when
        it read them (None otherwise)."""
        # The same objects as the last beat's when a fleet decoder decoded them unchanged
        # (HeartbeatDecoder): told apart by identity first.
        new_config = view is None or not view.heard or not _same(beat.engine_config, view.heartbeat.engine_config)
        if new_config:
            EngineConfig.from_dict(beat.engine_config)
        if not self.keep_replicas and (view is None or view.replica is None):
            return None
        if new_config or view is None or view.replica is None or not _same(beat.latency_model,
                                                                          view.heartbeat.latency_model):
            self.latency_model_of(beat)
        return _check_restorable(beat)

    def _create_replica(self, view: InstanceView) -> None:
        """A replica for ``view``, not built yet (stale: the next :meth:`replica` builds it)."""
        # The packed replica has no block cache of its own: a new request's predicted hit
        # (the view's prefix index) shortens the prefill it is simulated with instead.
        config = replace(view.config, enable_prefix_caching=False)
        view.replica = InstanceReplica(config, self.latency_model_of(view.heartbeat), lengths=self.lengths,
                                       prefix_index=view.prefix_index)
        view.replica_beat = None

    def _rebuild(self, view: InstanceView, now_wall_s: float) -> None:
        assert view.replica is not None
        view.replica.sync(view.heartbeat, view.assigned_not_seen.values(), now_wall_s)
        view.replica_beat = view.heartbeat
        view.replica_built_at_s = now_wall_s
        self.num_replica_rebuilds += 1

    def _reconcile(self, view: InstanceView, beat: Heartbeat, listed_ids: list[str] | None) -> None:
        if not view.assigned_not_seen and not view.batch_request_ids:
            return
        seen = set(listed_request_ids(beat) if listed_ids is None else listed_ids)
        seen.update(beat.finished_ids)
        for request_id in seen & view.assigned_not_seen.keys():
            del view.assigned_not_seen[request_id]
        view.batch_request_ids.difference_update(beat.finished_ids)
        if not view.batch_request_ids:
            self.batch_instance_ids.discard(view.instance_id)

    def refresh_health(self, now_s: float) -> list[InstanceView]:
        """Update health from beat ages; returns the instances whose queues are to be
        placed elsewhere: those that just left (became ``dead``, or were first seen
        ``stopped``) and those first seen ``draining`` (each once per departure)."""
        newly_gone = []
        for view in self.instances.values():
            if view.health not in (InstanceState.DEAD, InstanceState.STOPPED):
                health = self._classify(view, now_s)
                if health != view.health:
                    view.health = health
                    self._live = None
            if view.health in (InstanceState.DEAD, InstanceState.STOPPED) and not view.left_reported:
                view.left_reported = True
                newly_gone.append(view)
            elif view.health == InstanceState.DRAINING and not view.drain_reported:
                view.drain_reported = True
                newly_gone.append(view)
        return newly_gone

    def _classify(self, view: InstanceView, now_s: float) -> str:
        health = self.health_policy.classify(view.heartbeat.state,
                                             silence_s(view.last_beat_at_s, now_s, self.read_until_s))
        audible_for_s = silence_s(max(view.last_beat_at_s, self.audible_since_s), now_s, self.read_until_s)
        if health == InstanceState.DEAD and audible_for_s <= self.health_policy.dead_after_s:
            return InstanceState.SUSPECT  # silent, but not for long enough that the dispatcher could tell
        return health

    def record_assignment(self, instance_id: str, request: Request) -> None:
        """Record a request placed on ``instance_id``. Its replica (if any) takes it first:
        when the replica refuses it (ValueError), nothing is recorded."""
        view = self.instances[instance_id]
        if view.replica is not None:
            if view.replica_beat is view.heartbeat:
                # A current replica holds what was assigned since its rebuild.
                view.replica.add_assignment(request)
            else:
                # A stale one is rebuilt before it is used, with whatever its beat does not
                # show yet; it keeps the request's belief (beats carry less) meanwhile.
                view.replica.remember(request)
        view.assigned_not_seen[request.id] = request
        view.num_assigned_total += 1
        if view.prefix_index is not None and request.prompt_block_hashes:
            view.prefix_index.record(request.prompt_block_hashes)
        if request.priority == "batch":
            view.batch_request_ids.add(request.id)
            self.batch_instance_ids.add(instance_id)

    def live_instances(self) -> list[InstanceView]:
        """Instances that may receive new requests, in a stable (id) order (the same list
        until an instance's health changes or one is added or forgotten: do not change it)."""
        if self._live is None:
            self._live = sorted((v for v in self.instances.values() if v.health == InstanceState.LIVE),
                                key=lambda v: v.instance_id)
        return self._live

    def serving(self, model: str | None, live: list[InstanceView]) -> list[InstanceView]:
        """The instances of ``live`` that serve ``model`` (its base model or one of its
        adapters: :func:`blockq.wire.served_models.serves`); ``live`` itself when every one
        does (policies keep what they derive from a candidate list while it is the same
        list), and the same list for the same ``live`` list until served names change.
        This is the one place requests are kept to their model: before any policy chooses,
        live and simulated alike."""
        if model is None:
            return live
        cached = self._serving.get(model)
        if cached is not None and cached[0] is live:
            return cached[1]
        serving = [view for view in live if serves(view.heartbeat, model)]
        if len(serving) == len(live):
            serving = live
        self._serving[model] = (live, serving)
        return serving

    def forget(self, instance_ids: Iterable[str]) -> None:
        for instance_id in instance_ids:
            self.instances.pop(instance_id, None)
            self.batch_instance_ids.discard(instance_id)
        self._live = None


def listed_request_ids(beat: Heartbeat) -> list[str]:
    """The ids of the requests ``beat`` lists, running then waiting."""
    return progress_column(beat.running, 0) + progress_column(beat.waiting, 0)


def _check_restorable(beat: Heartbeat) -> list[str]:
    """Refuse (ValueError) a beat a replica could not be rebuilt from: a request listed
    twice, or with no prompt; returns the listed ids (reconciling reads them too). The
    rebuild happens later, inside a decision (:meth:`ClusterView.replica`), so what it
    would refuse is refused here, with the beat."""
    ids = listed_request_ids(beat)
    if len(set(ids)) != len(ids):
        raise ValueError("running, waiting: a request is listed twice")
    prompt_tokens = progress_column(beat.running, 1) + progress_column(beat.waiting, 1)
    if prompt_tokens and min(prompt_tokens) < 1:
        raise ValueError("running, waiting: prompt_tokens must be >= 1")
    return ids


def _same(new: object, old: object) -> bool:
    """Whether a beat's dict ``new`` equals the last beat's ``old``: the same object, or equal."""
    return new is old or new == old


def _saved(view: InstanceView | None) -> InstanceView | None:
    """What :meth:`ClusterView.apply_heartbeat` restores if applying a beat fails: the
    view's fields, its own copies of what a beat changes in place, and no replica (the
    next decision rebuilds it from the restored beat)."""
    if view is None:
        return None
    # A field-for-field copy, not dataclasses.replace (which runs __init__): every beat
    # applied pays for it.
    saved = object.__new__(InstanceView)
    saved.__dict__.update(view.__dict__, assigned_not_seen=dict(view.assigned_not_seen),
                          batch_request_ids=set(view.batch_request_ids), replica=None, replica_beat=None)
    return saved


def _indexes_prefixes(beat: Heartbeat, scheme: PrefixScheme) -> bool:
    """Whether the dispatcher can tell what ``beat``'s instance caches: prefix caching is on,
    its KV blocks are the size requests' block hashes cover and it caches the token ids of
    the tokenizer they were made with (``prefix_tokenizer``; an engine that names none is
    the emulated one, of the project tokenizer). Elsewhere no hit is predicted: another
    block size or tokenizer caches other blocks."""
    config = beat.engine_config
    return (bool(config.get("enable_prefix_caching")) and config.get("block_size") == scheme.block_tokens
            and config.get("prefix_tokenizer", PROJECT_TOKENIZER) == scheme.tokenizer_id)


# A replica a decision used this recently (s) is rebuilt when its beat arrives rather than
# inside the next decision: a few beat intervals, so that the instances decisions keep
# simulating (all of a small fleet; the shortlist's best of a large one) stay current.
HOT_REPLICA_S = 0.2

# How long ago, wall seconds, a replica may have been rebuilt for a decision to rank by it
# as it is (advanced along its own trajectory, not rebuilt from a newer beat: ClusterView.
# replica's ``as_is``): on a fleet the shortlist cuts, only the instance taken is rebuilt
# (docs/decisions/placement.md, "Ranking on replicas as they are"). Past it the advance costs
# about as much as a rebuild and has drifted further from the engine. 0.3 s: more rebuilds
# (8,721 against 5,811 in dispatch-bench at 1,024 instances), fewer decisions/s.
AS_IS_S = 1.0

# The prior for an instance that publishes no latency model and no known preset (a vLLM
# engine): a 7B model's step profile, which the replica refits from the instance's own
# step samples within its first beats (InstanceReplica._observe_samples).
PRIOR_PRESET = "llama2-7b-a30"
