"""The dispatcher's replica of one instance's scheduler, kept current between beats.

A heartbeat is a snapshot from the past. The first time a decision needs the replica after
a new beat, it is rebuilt from that beat (:meth:`PackedScheduler.restored`;
:meth:`dispatcher.cluster_view.ClusterView.replica`) at the time its state holds (``state_at_s``: the end of
the step under way when the engine reports the state that step leaves), with output
targets from what is known about each request (:mod:`blockq.lengths`: tokens
generated so far and the conditional length distribution, of the first guess or, once the
worker reports one, of the latest remaining-length refinement: :mod:`workers.refinement`),
advanced by the model time elapsed since the beat, and given back the requests this
dispatcher assigned that the beat does not show yet. Between beats, the replica advances
along its own deterministic trajectory, and each assignment is added to it at once, so
that the next decision sees it. Every beat, rebuilt from or not, gives it its step timings
and finished requests (:meth:`InstanceReplica.observe_beat`).

The latency model starts from the one the instance publishes and is refitted online from
the step timings in its beats, so the replica follows the real hardware.

The replica's state is a :class:`PackedScheduler` (the engine model's compiled twin):
advancing it, cloning it and simulating its future are what every decision pays for.
Its :class:`Baseline` (the future without a new request) is kept per version.

With LoRA, each row runs with its adapter (numbered per instance:
:func:`dispatcher.adapters.adapter_ids`), and the resident adapters are restored from the
beat's ``loaded_loras``: the replica runs vLLM's ``max_loras`` rule and charges each load
where the engine would (docs/dispatcher.md, "Models and adapters").
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from blockq.engine_model import EngineConfig, StepLatencyModel, StepSample
from blockq.engine_model.packed import PackedScheduler
from blockq.engine_model.packed_layout import FINISHED
from blockq.forecast_check import scaled_latency_model
from blockq.lengths import (
    LengthBelief,
    belief_from_prediction,
    check_length_mode,
    median_targets,
    quantile_column,
    remaining_targets,
)
from blockq.wire.beats import Heartbeat, progress_values
from blockq.wire.protocol import Request
from dispatcher.adapters import adapter_ids, resident_adapter_ids
from dispatcher.prefix_index import PrefixIndex

REFIT_EVERY_BEATS = 50
MAX_REFIT_SAMPLES = 2000
MAX_BELIEFS = 20_000
SPARE_ROWS = 32  # room for the assignments expected before the next rebuild
# Wall seconds from a placement until the instance's engine can take the request (the rest
# of the decision batch, the queue write, the worker's read: about 1.5 ms in the
# simulation), plus a margin for steps that end earlier than the replica expects: a
# step that starts within this much of a decision is taken to start without the request.
# Chosen by measurement: docs/decisions/placement.md. Where an instance's beats
# report a longer delivery (their p90: a loaded host, a remote Redis), that is used, up to
# MAX_DELIVERY_S: the measurement compares the dispatcher's clock with the worker's, and
# past that a skewed clock is likelier than a queue hop (a worker clock seconds ahead
# would otherwise make every forecast there seconds late, and its requests refused).
DELIVERY_S = 0.003
MAX_DELIVERY_S = 0.1


class Baseline:
    """One replica's future without a new request: the snapshot where a request appended
    now would first be looked at (:meth:`PackedScheduler.queue_drain_snapshot`; every
    what-if run equals the baseline up to there), and when each row finishes from there
    (simulated on first use: ranking candidates by TTFT never needs it, only the chosen
    one's full forecast does)."""

    __slots__ = ("snapshot", "_finished_at_s")

    def __init__(self, snapshot: PackedScheduler, finished_at_s: np.ndarray | None = None) -> None:
        self.snapshot = snapshot
        self._finished_at_s = finished_at_s

    @property
    def finished_at_s(self) -> np.ndarray:
        """By row; NaN for rows that never finish in the run."""
        if self._finished_at_s is None:
            future = self.snapshot.clone()
            future.simulate()
            self._finished_at_s = future.times[:, FINISHED].copy()
        return self._finished_at_s


@dataclass(frozen=True)
class WhatIf:
    """A what-if run made on a replica at ``version``: a request of ``size`` (prompt,
    output tokens) appended to the baseline's snapshot or the replica's state; the run's
    queue-drain snapshot (:meth:`PackedScheduler.what_if`), and when every row finished."""

    version: int
    request_id: str
    size: tuple[int, int]
    drain_snapshot: PackedScheduler
    finished_at_s: np.ndarray


# A beat's quantiles as a belief: the same few numbers beat after beat for each request a
# rebuild restores, and making the belief anew was a third of a rebuild.
_belief_in_beat = functools.lru_cache(maxsize=1 << 16)(belief_from_prediction)


def belief_of(request: Request) -> LengthBelief:
    """The length belief carried by a request (its prediction, and truth when replayed)."""
    prediction = request.prediction
    if prediction is None:
        return _belief_in_beat(None, None, None, request.true_output_tokens)
    # Cached as a beat's are: a decision asks twice (its size, then the replica keeps it).
    return _belief_in_beat(prediction.predicted_output_tokens, prediction.p10_tokens, prediction.p90_tokens,
                           request.true_output_tokens)


class InstanceReplica:
    """A scheduler replica of one instance (model time), plus what it needs to rebuild."""

    def __init__(self, config: EngineConfig, latency_model: StepLatencyModel, *, lengths: str = "median",
                 prefix_index: PrefixIndex | None = None, delivery_s: float = DELIVERY_S) -> None:
        self.config = config
        # A new request reaches the engine this long after now: at least min_delivery_s,
        # more where the instance's beats measure more.
        self.min_delivery_s = self.delivery_s = delivery_s
        self.latency_model = latency_model
        # Steps simulated this many times as long as the latency model says: set by the
        # forecast check's ``correct`` fallback when answers are slower than forecast.
        self.latency_factor = 1.0
        # (published model, factor, the model simulated)
        self._scaled: tuple[StepLatencyModel, float, StepLatencyModel] | None = None
        # The instance's believed prefix cache: a new request is simulated without the
        # prompt tokens it would find cached there (None: no prefix caching).
        self.prefix_index = prefix_index
        self.lengths = check_length_mode(lengths)  # which output lengths this replica simulates with
        self.scheduler = PackedScheduler(config, latency_model)
        self.beliefs: dict[str, LengthBelief] = {}
        # Requests placed here as new packed rows (id, prompt, output tokens under this
        # replica's mode): a rebuild re-adds every placed request its beat does not show
        # yet, and the size of one never changes.
        self._new_rows: dict[str, tuple[str, int, int]] = {}
        self._samples: deque[StepSample] = deque(maxlen=MAX_REFIT_SAMPLES)
        self._num_beats = 0
        self._beat: Heartbeat | None = None
        self._adapter_ids: dict[str, int] = {}  # the instance's adapters by name (LoRA only)
        # The instance's model time at the last sync or advance: a new request arrives
        # then, while the replica's clock may be ahead of it, at the end of the step
        # under way (the request waits for that end: part of its forecast TTFT).
        self.now_s = 0.0
        self.version = 0          # bumped on every change that invalidates cached forecasts
        self._baseline: tuple[int, Baseline] | None = None
        self._what_if: WhatIf | None = None

    # --- updates ------------------------------------------------------------------------

    def observe_beat(self, beat: Heartbeat) -> None:
        """What the replica keeps from every beat, whether or not it is rebuilt from it:
        the step timings (the latency refit), the requests finished (beliefs dropped) and,
        with LoRA, the instance's adapters (placements between rebuilds need their ids)."""
        self._follow_adapters(beat)
        self._observe_samples(beat)
        self._forget_finished(beat.finished_ids)

    def sync(self, beat: Heartbeat, assigned_not_seen: Iterable[Request], now_wall_s: float) -> None:
        """Rebuild from ``beat`` (already observed: :meth:`observe_beat`), advance to now,
        add the assignments the beat lacks."""
        self._beat = beat
        self._follow_adapters(beat)  # a replica made after its beat was applied has not observed it
        measured_s = min(MAX_DELIVERY_S, (beat.delivery_p90_ms or 0.0) / 1000)
        self.delivery_s = max(self.min_delivery_s, measured_s)
        # The state holds at a step boundary (the end of the step under way when the
        # engine reports the state that step leaves), not at the beat's own time.
        state_at_s = beat.engine_time_s if beat.state_at_s is None else beat.state_at_s
        # With prefix caching, running requests of one conversation hold its earlier turns'
        # blocks once: the engine's count tells the replica how many its rows share.
        shares_blocks = self.prefix_index is not None and not beat.truncated
        ids, values, num_running, lora_ids = self._restored_columns(beat)
        loaded_loras = resident_adapter_ids(beat.engine_config, self._adapter_ids, self.config.max_loras) \
            if self._adapter_ids else ()
        scheduler = PackedScheduler.restored_columns(
            self.config, self._simulated_latency_model(), state_at_s, ids, values, num_running,
            spare_rows=SPARE_ROWS, engine_used_blocks=beat.num_used_blocks if shares_blocks else None,
            lora_ids=lora_ids, loaded_loras=loaded_loras)
        self.scheduler = scheduler
        self.advance(now_wall_s)
        rows = self._new_rows
        assigned = list(assigned_not_seen)
        scheduler.add_requests([rows.get(request.id) or (request.id, *self.request_size(request))
                                for request in assigned],
                               [self.adapter_id(request.model) for request in assigned] if self.config.max_loras else None)
        self.version += 1

    def advance(self, now_wall_s: float) -> None:
        """Advance to ``now_wall_s`` along the replica's own trajectory (no forecast
        changes), and through every step that starts before a request placed now reaches
        the engine (:attr:`delivery_s`)."""
        beat = self._beat
        if beat is None:
            self.now_s = until_s = self.scheduler.now_s
        else:  # the instance's model time now and at the delivery, extrapolated from its beat
            scale = beat.time_scale or 1.0
            self.now_s = beat.engine_time_s + max(0.0, now_wall_s - beat.sent_at_s) / scale
            until_s = beat.engine_time_s + max(0.0, now_wall_s + self.delivery_s - beat.sent_at_s) / scale
        # The scheduler's clock is where its next step starts (or where it went idle): at
        # or past ``until_s`` there is nothing to run, and a decision asks every candidate
        # it simulates between two of its steps, so most calls skip the compiled one.
        if until_s > self.scheduler.clock[0]:
            self.scheduler.simulate(until_s=until_s)

    @property
    def time_scale(self) -> float:
        """Wall seconds per model second on this instance (its latest beat says)."""
        return self._beat.time_scale if self._beat is not None and self._beat.time_scale else 1.0

    def prefill_alone_s(self, prompt_tokens: int) -> float:
        """Model seconds to prefill ``prompt_tokens`` on this instance if nothing else ran:
        what a TTFT here is beyond the wait for the others (a ranking's estimate)."""
        return self.scheduler.prefill_alone_s(prompt_tokens)

    def scale_latency(self, ratio: float) -> None:
        """Simulate steps ``ratio`` times as long as now, from the next rebuild on."""
        self.latency_factor *= ratio

    def _simulated_latency_model(self) -> StepLatencyModel:
        # Scaled once per (model, factor), not at every beat: a model builds a dense table.
        cached = self._scaled
        if cached is None or cached[0] is not self.latency_model or cached[1] != self.latency_factor:
            cached = self._scaled = (self.latency_model, self.latency_factor,
                                     scaled_latency_model(self.latency_model, self.latency_factor))
        return cached[2]

    def remember(self, request: Request) -> None:
        """Keep the length belief of a request placed here (beats carry less than requests)."""
        self.beliefs[request.id] = belief_of(request)
        if len(self.beliefs) > MAX_BELIEFS:
            oldest = next(iter(self.beliefs))
            self.beliefs.pop(oldest)
            self._new_rows.pop(oldest, None)

    def add_assignment(self, request: Request) -> None:
        """Record a request just placed here, so the next decision sees it.

        When the last what-if run here was for this very request, that run is the new
        baseline: the same steps from the same state, and its queue-drain point the new
        snapshot (the request is looked at only after everything queued ahead of it)."""
        self.remember(request)
        size = self.request_size(request)
        what_if, self._what_if = self._what_if, None
        self.scheduler.add_request(request.id, *size, lora_id=self.adapter_id(request.model))
        self.version += 1
        if what_if is None or what_if.version != self.version - 1 or what_if.request_id != request.id \
                or what_if.size != size:
            return
        self._baseline = (self.version, Baseline(what_if.drain_snapshot, what_if.finished_at_s))

    def keep_what_if(self, what_if: WhatIf) -> None:
        """Remember the latest what-if run (see :meth:`add_assignment`)."""
        self._what_if = what_if

    def adapter_id(self, model: str | None) -> int:
        """The packed adapter id of a request naming ``model`` here: 0 (none) for no model,
        the base model, a name this instance does not serve, or an instance without LoRA."""
        return self._adapter_ids.get(model, 0) if model is not None and self._adapter_ids else 0

    def request_size(self, request: Request, *, lengths: str | None = None) -> tuple[int, int]:
        """(prompt tokens, output tokens to simulate) for a new request on this instance,
        under this replica's length mode, or under ``lengths`` when a caller asks for
        another one for this request alone (e.g. its upper quantile)."""
        if lengths is None and (row := self._new_rows.get(request.id)) is not None:
            return row[1], row[2]
        belief = self.beliefs.get(request.id) or belief_of(request)
        prompt_tokens = min(request.num_prompt_tokens, self.config.max_model_len - 1)
        if self.prefix_index is not None and request.prompt_block_hashes:
            prompt_tokens -= self.prefix_index.cached_prompt_tokens(request.prompt_block_hashes, prompt_tokens)
        output_tokens = belief.remaining_target(0, lengths or self.lengths)
        if lengths is None and request.id in self.beliefs:
            self._new_rows[request.id] = (request.id, prompt_tokens, output_tokens)
        return prompt_tokens, output_tokens

    def baseline(self) -> Baseline:
        """The replica's future without a new request, simulated once per version (a
        replica advancing along its own deterministic trajectory keeps its future)."""
        cached = self._baseline
        if cached is not None and cached[0] == self.version:
            return cached[1]
        baseline = Baseline(self.scheduler.queue_drain_snapshot())
        self._baseline = (self.version, baseline)
        return baseline

    # --- helpers ------------------------------------------------------------------------

    def _follow_adapters(self, beat: Heartbeat) -> None:
        """Take the instance's adapters, ``max_loras`` and load time from ``beat`` (a
        ``vllm-http`` worker learns its server's ``max_loras`` after its first beats; the
        beat's engine config was checked when it changed: ClusterView._check)."""
        engine_config = beat.engine_config
        if not self.config.max_loras and not engine_config.get("max_loras"):
            return  # no LoRA (most fleets: one look per beat)
        max_loras = int(engine_config.get("max_loras") or 0)
        lora_load_ms = float(engine_config.get("lora_load_ms") or 0.0)
        if (max_loras, lora_load_ms) != (self.config.max_loras, self.config.lora_load_ms):
            self.config = replace(self.config, max_loras=max_loras, lora_load_ms=lora_load_ms)
        self._adapter_ids = adapter_ids(engine_config) if max_loras else {}

    def _restored_columns(self, beat: Heartbeat) -> tuple[list[str], np.ndarray, int, list[int] | None]:
        """The beat's requests as :meth:`PackedScheduler.restored_columns` restores them
        (ids; prompt, output target, computed, generated; how many run; adapter ids, None
        where no entry names one or without LoRA), with output targets from this replica's
        beliefs. Column by column: a rebuild restores ~70 requests, and a pass of Python per
        request was most of its cost."""
        entries = [*progress_values(beat.running), *progress_values(beat.waiting)]
        if not entries:
            return [], np.zeros((0, 4), np.int64), 0, None
        lengths = set(map(len, entries))
        width = 9 if 9 in lengths else 8  # 9: some entry names its adapter
        if lengths != {width}:  # entries of older workers (no p10, no refinement) or without adapters
            entries = [entry if len(entry) == width else (*entry, *(None,) * (width - len(entry)))
                       for entry in entries]
        ids, prompts, computed, generated, p50s, p90s, p10s, refined_at, *adapters = zip(*entries, strict=True)
        # A name the instance does not serve runs as the base model (id 0): a beat is also the
        # instance's proof of life, and refusing all of it for one name would silence it.
        lora_ids = [self._adapter_ids.get(name, 0) for name in adapters[0]] \
            if adapters and self._adapter_ids else None
        max_model_len = self.config.max_model_len
        values = np.array([prompts, [0] * len(ids), computed, generated], np.int64).T
        prompt, computed_tokens, generated_tokens = values[:, 0], values[:, 2], values[:, 3]
        np.minimum(prompt, max_model_len - 1, out=prompt)
        for row in np.flatnonzero(computed_tokens == 0).tolist():
            if (placed := self._new_rows.get(ids[row])) is not None:
                # Not started yet: it will find cached what it was predicted to when placed
                # here (a beat does not say), as its row did before the beat showed it.
                prompt[row] = min(prompt[row], placed[1])
        targets = self._targets(ids, (p50s, p10s, p90s), refined_at, generated_tokens)
        values[:, 1] = np.minimum(targets, max_model_len - prompt)
        # At its length limit, a request finishes on its next token: nothing to model.
        keep = generated_tokens < values[:, 1]
        num_running = int(np.count_nonzero(keep[:len(beat.running)]))
        if keep.all():
            return list(ids), values, num_running, lora_ids
        kept = keep.tolist()
        if lora_ids is not None:
            lora_ids = [lora_id for lora_id, is_kept in zip(lora_ids, kept, strict=True) if is_kept]
        return [request_id for request_id, is_kept in zip(ids, kept, strict=True) if is_kept], values[keep], \
            num_running, lora_ids

    def _targets(self, ids: Sequence[str], quantiles: tuple[Sequence[int | None], ...],
                 refined_at: Sequence[int | None], generated_tokens: np.ndarray) -> np.ndarray:
        """Output targets for a beat's requests (``quantiles``: the beat's p50, p10 and p90
        columns) under this replica's length mode. A request placed here keeps the belief it
        was placed with, unless the worker refined it from its partial output since (that
        knows more than the first guess); a request the beat gives no quantiles for gets
        the default spread (:func:`belief_from_prediction`)."""
        own = self.beliefs
        owned = [row for row, request_id in enumerate(ids) if request_id in own] if own else []
        if self.lengths != "median":
            beliefs = list(map(_belief_in_beat, *quantiles))
            for row in owned:
                if refined_at[row] is None or self.lengths == "truth":
                    beliefs[row] = own[ids[row]]
            return remaining_targets(beliefs, generated_tokens, self.lengths)
        columns = [quantile_column(column) for column in quantiles]
        rows = [row for row in owned if refined_at[row] is None]
        if rows:
            p50s, p10s, p90s = columns = [list(column) for column in columns]
            for row in rows:
                belief = own[ids[row]]
                p50s[row], p10s[row], p90s[row] = belief.p50_tokens, belief.p10_tokens, belief.p90_tokens
        p50, p10, p90 = np.array(columns, np.int64)
        return median_targets(p50, p10, p90, generated_tokens)

    def _observe_samples(self, beat: Heartbeat) -> None:
        for sample in beat.step_samples:
            prefill, decode, kv, seconds = (int(sample[0]), int(sample[1]), int(sample[2]), float(sample[3]))
            pairs = int(sample[4]) if len(sample) > 4 else None
            self._samples.append(StepSample(prefill, decode, kv, seconds, pairs))
        self._num_beats += 1
        if self._num_beats % REFIT_EVERY_BEATS == 0 and len(self._samples) >= 32:
            self.latency_model = self.latency_model.refit(list(self._samples))

    def _forget_finished(self, finished_ids: Iterable[str]) -> None:
        for request_id in finished_ids:
            self.beliefs.pop(request_id, None)
            self._new_rows.pop(request_id, None)
