"""Policies that place by simulation: ``block`` (every live instance), ``block_kv_guard``
(``block`` guarding KV with the upper quantile), ``power_of_two`` (two sampled
instances) and ``oracle`` (``block`` with true output lengths)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from blockq.wire.protocol import Request
from dispatcher.adapters import adapter_charge
from dispatcher.admission import ttft_budget_s
from dispatcher.cluster_view import ClusterView
from dispatcher.instance_view import InstanceView
from dispatcher.policies.base import Decision, PolicyOptions
from dispatcher.policies.shortlist import LARGE_FLEET_ABOVE_INSTANCES, Shortlist
from dispatcher.replica import InstanceReplica
from dispatcher.what_if import OBJECTIVES, Forecast, forecast, forecast_ttft

# Long-prompt lanes (measured on the paper's trace at 0.9 x Llumnix's capacity, 6 seeds:
# P99 TTFT 570 -> 545 ms, mean 80.3 -> 80.4 ms; see docs/decisions/placement.md, "The tail and the lanes kept for it").
# A prompt of a few thousand tokens prefills in several chunks, and every decode running
# beside it slows each chunk (a 3,800-token prompt: 711 ms alone, 783 ms beside 18
# decodes): on a fleet balanced by load no instance is light when one arrives, and these
# prompts are the TTFT tail. So one instance in LANE_EVERY keeps light for them: ordinary
# requests go elsewhere while another instance is predicted within LANE_SLACK_S of their
# best TTFT and within their objective.
LANE_EVERY = 6
# Long: a prefill of at least this many step budgets (2,560 tokens at a 512-token budget).
LANE_PROMPT_CHUNKS = 5
# Brief: answers predicted this short leave a lane within a second, and may use one.
LANE_BRIEF_OUTPUT_TOKENS = 32
# An ordinary request gives up at most this much of its predicted TTFT to spare a lane
# (about what a long prompt gains there); past it, near capacity, the lanes serve all.
# Measured: 20 ms kept a third of the tail's gain, 100 ms cost 0.6 ms of mean TTFT.
LANE_SLACK_S = 0.05


@dataclass(slots=True)
class _Ranked:
    """A candidate as :meth:`Block._best` ranks it; ``forecast`` is None when only its
    TTFT was simulated."""

    key: tuple[float, float]
    ttft_s: float
    wait_s: float  # the TTFT less the request's prefill alone: when a prefill could start there
    candidate: InstanceView
    replica: InstanceReplica
    size: tuple[int, int]
    forecast: Forecast | None
    stale: bool = False  # simulated on a replica not rebuilt from its latest beat (ranked as it is)


class Block:
    """For every candidate: clone its replica, add the request with its predicted length
    (the median), simulate until everything there finishes, score by the objective;
    lowest wins, ties at random. ``e2e`` = the request's completion time plus the delay
    it adds to the requests already there; ``ttft`` (the default) its first token.

    Candidates that keep the request's TTFT objective rank first (see
    :meth:`_meeting_the_slo_first`), and among them, for a request that is neither long
    nor brief, the instances outside the long-prompt lanes (:func:`lane_ids`) predicted
    within ``LANE_SLACK_S`` of the best TTFT (not on fleets with a prefix cache).

    With ``kv_guard_candidates`` > 0 (:class:`BlockKvGuard`), the request's upper
    quantile guards against KV exhaustion: before a candidate is taken, its run is
    repeated with the p90 length, and a candidate where that run preempts more than the
    median run is passed over for the next best, among the best ``kv_guard_candidates``;
    if all of them would, the best one is taken.

    On a fleet larger than the shortlist (``num_simulated_candidates`` > 0, or None: by the
    fleet's size), only the candidates of a :class:`~dispatcher.policies.shortlist.Shortlist`
    are simulated."""

    name = "block"
    kv_guard_candidates = 0

    def __init__(self, view: ClusterView, rng: random.Random, options: PolicyOptions | None = None) -> None:
        options = options or PolicyOptions()
        if options.objective not in OBJECTIVES:
            raise ValueError(f"objective: must be one of {', '.join(OBJECTIVES)} (got {options.objective!r})")
        self.view = view
        self.rng = rng
        self.objective = options.objective
        self.slo_ttft_ms = options.slo_ttft_ms
        self.shortlist = Shortlist(options.num_simulated_candidates, rng)
        # Ranking by TTFT needs only each candidate's run up to the first token; the chosen
        # one's run on to its request's finish (the predicted E2E, the replica's next
        # baseline) follows.
        self._ranks_by_first_token = self.objective == "ttft" and not self.kv_guard_candidates
        self._lanes: tuple[Sequence[InstanceView] | None, frozenset[str]] = (None, frozenset())

    def forecast(self, request: Request, candidate: InstanceView, now_s: float) -> Forecast:
        replica = self.view.replica(candidate, now_s)
        return forecast(replica, request.id, *replica.request_size(request), model=request.model)

    def choose(self, request: Request, candidates: Sequence[InstanceView], now_s: float,
               bus_now_s: float | None = None) -> Decision:
        return self._best(request, candidates, now_s, bus_now_s)

    def _best(self, request: Request, candidates: Sequence[InstanceView], now_s: float,
              bus_now_s: float | None = None) -> Decision:
        lanes = self._lane_ids(candidates)
        sizes: dict[int, tuple[int, int]] = {}
        # On a fleet the shortlist cuts, larger than LARGE_FLEET_ABOVE_INSTANCES, the candidates
        # are ranked on their replicas as they are (ClusterView.replica's ``as_is``), and none
        # is kept current beat by beat.
        cut = self.shortlist.cuts(len(candidates))
        as_is = cut and len(candidates) > LARGE_FLEET_ABOVE_INSTANCES
        off_lanes = cut and bool(lanes) and self._kept_off_lanes(request, candidates[0], now_s, sizes)
        ranked = [self._simulated(request, candidate, now_s, sizes, as_is=as_is, keep_current=not as_is)
                  for candidate in self.shortlist.select(candidates, lanes, now_s, off_lanes=off_lanes)]
        ranked = self._ordered(request, ranked, lanes, now_s, bus_now_s)
        # What a decision places by is simulated on replicas rebuilt from their latest beat:
        # one ranked on an older one that would be taken is simulated again, rebuilt, and
        # the candidates ranked again.
        num_taken = max(1, self.kv_guard_candidates)
        while (stale := next((i for i, item in enumerate(ranked[:num_taken]) if item.stale), None)) is not None:
            ranked[stale] = self._simulated(request, ranked[stale].candidate, now_s, sizes, as_is=False,
                                            keep_current=not as_is)
            ranked = self._ordered(request, ranked, lanes, now_s, bus_now_s)
        chosen = ranked[0]
        for item in ranked[:self.kv_guard_candidates]:
            upper_size = item.replica.request_size(request, lengths="upper")
            if upper_size == item.size:
                break  # no spread above the median: nothing to guard
            upper = forecast(item.replica, request.id, *upper_size, keep=False, model=request.model)
            if upper.num_preemptions <= item.forecast.num_preemptions:
                chosen = item
                break
        chosen_forecast = chosen.forecast or forecast(chosen.replica, request.id, *chosen.size,
                                                      whole_run=self.objective != "ttft", model=request.model)
        if cut:  # it learns from what was simulated
            self._learn(ranked, now_s)
        return Decision(chosen.candidate.instance_id, predicted_ttft_ms=chosen_forecast.ttft_s * 1000,
                        predicted_e2e_ms=chosen_forecast.e2e_s * 1000)

    def _ordered(self, request: Request, ranked: list[_Ranked], lanes: frozenset[str], now_s: float,
                 bus_now_s: float | None) -> list[_Ranked]:
        """``ranked`` best first: by score (ties at random), those keeping the TTFT
        objective first, the long-prompt lanes behind the others within reach."""
        ranked = sorted(ranked, key=lambda item: item.key)
        ranked = self._meeting_the_slo_first(request, ranked, now_s, bus_now_s)
        if lanes and _off_lanes(ranked[0].replica, ranked[0].size):
            ranked = self._lanes_last(request, ranked, lanes, now_s, bus_now_s)
        return ranked

    def _simulated(self, request: Request, candidate: InstanceView, now_s: float,
                   sizes: dict[int, tuple[int, int]], *, as_is: bool, keep_current: bool) -> _Ranked:
        """``candidate`` simulated with the request (``as_is``: on its replica as it is,
        when that was rebuilt recently enough; ``keep_current``: its next beats rebuild it:
        :meth:`ClusterView.replica`). ``sizes``: as :func:`_size` shares them."""
        replica = self.view.replica(candidate, now_s, keep_current=keep_current, as_is=as_is)
        size = _size(request, replica, sizes)
        if self._ranks_by_first_token:
            candidate_forecast = None
            ttft_s, prefill_s = forecast_ttft(replica, *size, model=request.model)
            score = ttft_s
        else:
            candidate_forecast = forecast(replica, request.id, *size, model=request.model)
            ttft_s, score = candidate_forecast.ttft_s, candidate_forecast.score(self.objective)
            prefill_s = replica.prefill_alone_s(size[0])
        if request.model is not None:  # a LoRA load's cost to later requests (dispatcher.adapters)
            charge_s = adapter_charge(candidate, request.model)
            ttft_s, score = ttft_s + charge_s, score + charge_s
        # Scores equal to 1e-9 s are ties, broken at random.
        key = (round(score, 9), self.rng.random())
        return _Ranked(key, ttft_s, max(0.0, ttft_s - prefill_s), candidate, replica, size, candidate_forecast,
                       stale=not self.view.is_current(candidate))

    def _learn(self, ranked: list[_Ranked], now_s: float) -> None:
        """Tell the shortlist when each simulated instance could start a new request's
        prefill: after the wait this request was simulated to have there (its TTFT less its
        own prefill). The one it goes to is no exception: the next decision simulates it
        again, with this request, if it still ranks among the best."""
        self.shortlist.learn({item.candidate.instance_id: now_s + item.wait_s * item.replica.time_scale
                              for item in ranked}, now_s)

    def _kept_off_lanes(self, request: Request, candidate: InstanceView, now_s: float,
                        sizes: dict[int, tuple[int, int]]) -> bool:
        """Before simulating: whether the lane rule will keep ``request`` off the lanes
        (:func:`_off_lanes`), judged on ``candidate``'s replica as it is (the shortlist
        then takes few lanes)."""
        # A request's size needs a replica's config and beliefs, not its state: not advanced.
        replica = candidate.replica or self.view.replica(candidate, now_s, keep_current=False, as_is=True)
        return _off_lanes(replica, _size(request, replica, sizes))

    def _lane_ids(self, candidates: Sequence[InstanceView]) -> frozenset[str]:
        """:func:`lane_ids` of ``candidates``, kept while the same list is given (the live list)."""
        cached, lanes = self._lanes
        if cached is not candidates:
            lanes = lane_ids([candidate.instance_id for candidate in candidates])
            self._lanes = (candidates, lanes)
        return lanes

    def _meeting_the_slo_first(self, request: Request, ranked: list[_Ranked], now_s: float,
                               bus_now_s: float | None = None) -> list[_Ranked]:
        """The candidates predicted to meet the request's TTFT objective, best score
        first, then the others by predicted TTFT: the objective decides only among
        placements that keep the SLO (it may prefer a full instance where the request
        would wait), and when none does, the best predicted TTFT is the figure the
        request is judged by (:mod:`dispatcher.admission`). A ``best_effort`` request is
        never refused, but it too goes where it is predicted to meet its objective."""
        budget_s = ttft_budget_s(request, self.slo_ttft_ms, now_s, bus_now_s)
        if budget_s is None:
            return ranked
        meeting = [item for item in ranked if item.ttft_s <= budget_s]
        if len(meeting) == len(ranked):
            return ranked
        missing = sorted((item for item in ranked if item.ttft_s > budget_s), key=lambda item: item.ttft_s)
        return meeting + missing if meeting else missing

    def _lanes_last(self, request: Request, ranked: list[_Ranked], lanes: frozenset[str], now_s: float,
                    bus_now_s: float | None = None) -> list[_Ranked]:
        """``ranked`` with the lane instances (``lanes``) moved behind every other instance
        predicted within ``LANE_SLACK_S`` of the best TTFT and within the request's TTFT
        objective."""
        budget_s = ttft_budget_s(request, self.slo_ttft_ms, now_s, bus_now_s)
        limit_s = min(item.ttft_s for item in ranked) + LANE_SLACK_S
        if budget_s is not None:
            limit_s = min(limit_s, budget_s)
        preferred: list[_Ranked] = []
        others: list[_Ranked] = []
        for item in ranked:
            (preferred if item.ttft_s <= limit_s and item.candidate.instance_id not in lanes else others).append(item)
        return preferred + others if preferred else ranked


def lane_ids(instance_ids: Sequence[str]) -> frozenset[str]:
    """The long-prompt lanes among ``instance_ids``: one in every ``LANE_EVERY``, the
    first by id (a fixed choice: a lane chosen as the lightest instance of the moment
    moved with every placement and kept none light; measured, P99 567 -> 569 ms)."""
    return frozenset(sorted(instance_ids)[:len(instance_ids) // LANE_EVERY])


def _off_lanes(replica: InstanceReplica, size: tuple[int, int]) -> bool:
    """Whether a request of ``size`` (prompt, output tokens) on ``replica`` is kept off
    the lanes, on a fleet with lanes (``LANE_EVERY`` instances or more: the caller checks):
    no prefix cache is modelled and the request is neither a long prompt (the lanes'
    purpose) nor a brief answer. No lanes where the replicas model a prefix cache: there a
    prompt's prefill depends on where its prefix is cached, and conversations' long
    histories filled the lanes (ShareGPT multi-turn, 12 A30s: capacity 16.71 -> 15.56 req/s
    with lanes)."""
    if replica.prefix_index is not None:
        return False
    prompt_tokens, output_tokens = size
    long_prompt_tokens = LANE_PROMPT_CHUNKS * replica.config.max_num_batched_tokens
    return prompt_tokens < long_prompt_tokens and output_tokens > LANE_BRIEF_OUTPUT_TOKENS


def _size(request: Request, replica: InstanceReplica, sizes: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """``request``'s size on ``replica`` (:meth:`InstanceReplica.request_size`); ``sizes``,
    by ``max_model_len``, shares it between the candidates of a decision (the same on most
    fleets), unless a prefix cache makes each candidate's prefill its own."""
    if replica.prefix_index is not None:
        return replica.request_size(request)
    max_model_len = replica.config.max_model_len
    if max_model_len not in sizes:
        sizes[max_model_len] = replica.request_size(request)
    return sizes[max_model_len]


class BlockKvGuard(Block):
    """``block`` with the KV guard over the best 4 candidates (see :class:`Block`)."""

    name = "block_kv_guard"
    kv_guard_candidates = 4


class PowerOfTwo(Block):
    """Two instances sampled at random, the better by the ``block`` metric."""

    name = "power_of_two"

    def choose(self, request: Request, candidates: Sequence[InstanceView], now_s: float,
               bus_now_s: float | None = None) -> Decision:
        sample = self.rng.sample(list(candidates), min(2, len(candidates)))
        return self._best(request, sample, now_s, bus_now_s)


class Oracle(Block):
    """``block`` with every request's true output length: benchmarks only (its view's
    replicas simulate with ``truth``, :data:`dispatcher.policies.POLICIES`)."""

    name = "oracle"

    def choose(self, request: Request, candidates: Sequence[InstanceView], now_s: float,
               bus_now_s: float | None = None) -> Decision:
        if request.true_output_tokens is None:
            raise ValueError("true_output_tokens: the oracle policy needs it on every request (trace replay only)")
        return self._best(request, candidates, now_s, bus_now_s)
