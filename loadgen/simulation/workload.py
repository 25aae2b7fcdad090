"""The requests of a simulated run: a sample of a trace, annotated up front by the real
predictor backends, then paired with arrival times.

Predictions do not depend on when a request arrives or where it goes, so a sample is
annotated once (in the predictor stage's batches, through its own
:func:`~predictor_service.stage.annotate`) and reused for every policy and rate.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import structlog

from blockq.text.tokenizer import TokenCounter, get_token_counter
from blockq.wire.keys import Keys
from blockq.wire.protocol import Request
from loadgen.arrivals import DEFAULT_THINK_TIME_S, build_schedule
from loadgen.replay import ReplayOptions, max_tokens_for
from loadgen.traces import DEFAULT_MAX_MODEL_LEN, TraceRequest, group_sessions, load_trace
from predictor_service.models import LengthPredictor, load_predictor
from predictor_service.stage import StageOptions, annotate, prediction_inputs
from workers.refinement import RefinementTable

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class AnnotatedSample:
    """Trace requests and their annotated :class:`Request` (same order); ``rejected``:
    indexes the predictor could not annotate, with the reason (dead-lettered live);
    ``refinements``: what the instances' beats report once requests run, when refined;
    ``think_time_s``: the mean pause between a session's turns (multi-turn samples)."""

    trace_requests: tuple[TraceRequest, ...]
    requests: tuple[Request | None, ...]
    rejected: dict[int, str]
    seed: int
    # Remaining-length refinements at each checkpoint (loadgen.simulation.precomputed_refinements), or None.
    refinements: RefinementTable | None = None
    think_time_s: float = DEFAULT_THINK_TIME_S


def sample_trace(trace: str, num_requests: int, seed: int, *, redraw: bool, multi_turn: bool = False,
                 max_model_len: int | None = DEFAULT_MAX_MODEL_LEN) -> list[TraceRequest]:
    """``num_requests`` requests of ``trace``: the first ones, as ``blockq bench`` replays
    them, or with ``redraw`` a random sample (in random order) drawn with ``seed`` — with
    replacement when the trace holds fewer requests than asked (logged), so that a small
    trace (a held-out split) still makes runs of the asked size. ``multi_turn``: the
    trace's conversations as sessions (:func:`loadgen.traces.load_trace`); a redraw then
    draws whole sessions, turns in order, the last one cut to make ``num_requests``.
    ``max_model_len``: the engines' (tokens), for the trace's length policy."""
    if not redraw:
        return load_trace(trace, limit=num_requests, seed=seed, multi_turn=multi_turn,
                          max_model_len=max_model_len)
    pool = load_trace(trace, limit=None if trace != "synthetic" else num_requests, seed=seed,
                      multi_turn=multi_turn, max_model_len=max_model_len)
    if multi_turn:
        return _sample_sessions(pool, num_requests, seed, trace)
    if len(pool) < num_requests:
        log.warning("trace_resampled_with_replacement", trace=trace, num_in_trace=len(pool),
                    num_requests=num_requests)
        # Copies: each drawn request is its own object (arrivals are matched by identity).
        return [dataclasses.replace(request) for request in random.Random(seed).choices(pool, k=num_requests)]
    return random.Random(seed).sample(pool, num_requests)


def _sample_sessions(pool: list[TraceRequest], num_requests: int, seed: int, trace: str) -> list[TraceRequest]:
    """Whole sessions of ``pool`` in a random order until ``num_requests`` turns; past the
    pool's end another pass in a new order, its copies renamed (a session id is one session)."""
    sessions = group_sessions(pool)
    rng = random.Random(seed)
    drawn: list[TraceRequest] = []
    num_passes = 0
    while sessions and len(drawn) < num_requests:
        for index in rng.sample(range(len(sessions)), len(sessions)):
            turns = sessions[index][:num_requests - len(drawn)]
            if num_passes:
                # Copies: each drawn request is its own object (arrivals are matched by identity).
                turns = [dataclasses.replace(turn, session_id=f"{turn.session_id}~{num_passes}") for turn in turns]
            drawn.extend(turns)
            if len(drawn) >= num_requests:
                break
        num_passes += 1
    if num_passes > 1:
        log.warning("trace_resampled_with_replacement", trace=trace, num_in_trace=len(pool),
                    num_requests=num_requests, num_sessions=len(sessions))
    return drawn


def annotate_sample(trace_requests: Sequence[TraceRequest], seed: int, *, predictor: str = "heuristic",
                    predictor_model: str | None = None, token_counter: TokenCounter | None = None,
                    batch_size: int = StageOptions.batch_size) -> AnnotatedSample:
    """Each request as the client would submit it, annotated by the named backend."""
    model: LengthPredictor = load_predictor(predictor, predictor_model)
    counter = token_counter or get_token_counter()
    keys = Keys()
    options = ReplayOptions()
    raw = [Request(id=f"s{seed}-{index:06d}", prompt=request.prompt, max_tokens=max_tokens_for(request, options),
                   reply_stream=keys.reply(f"s{seed}-{index:06d}"), submitted_at_s=0.0,
                   true_output_tokens=request.true_output_tokens,
                   trace_predicted_output_tokens=request.predicted_output_tokens,
                   trace_output_text=request.output_text)
           for index, request in enumerate(trace_requests)]
    annotated: list[Request | None] = []
    rejected: dict[int, str] = {}
    for start in range(0, len(raw), batch_size):
        batch = raw[start:start + batch_size]
        for offset, result in enumerate(annotate(model, batch, prediction_inputs(batch, counter))):
            if isinstance(result, str):
                rejected[start + offset] = result
                annotated.append(None)
            else:
                annotated.append(result)
    return AnnotatedSample(tuple(trace_requests), tuple(annotated), rejected, seed)


def arrivals_for(sample: AnnotatedSample, *, rate_per_s: float | None, burstiness: float = 1.0,
                 use_trace_times: bool = False) -> list[tuple[float, int]]:
    """(arrival offset s, index into the sample) in submit order, as ``blockq bench``
    schedules them (:func:`loadgen.arrivals.build_schedule`, seeded with the sample's seed;
    sessions with the sample's think time)."""
    position = {id(request): index for index, request in enumerate(sample.trace_requests)}
    schedule = build_schedule(sample.trace_requests, rate_per_s=rate_per_s, burstiness=burstiness,
                              seed=sample.seed, use_trace_times=use_trace_times, think_time_s=sample.think_time_s)
    return [(offset_s, position[id(request)]) for offset_s, request in schedule]


def submitted(request: Request, submitted_at_s: float, *, best_effort: bool = False) -> Request:
    """``request`` as submitted at ``submitted_at_s`` (the simulation's clock), asking
    ``best_effort`` (never answered ``infeasible``) when told."""
    return dataclasses.replace(request, submitted_at_s=submitted_at_s, best_effort=best_effort)


# z of the 10th / 90th percentile of a standard normal: the spread reported with a
# perturbed prediction is the noise's own.
_Z90 = 1.2815515655446004


def perturb_predictions(sample: AnnotatedSample, mae_tokens: float) -> AnnotatedSample:
    """``sample`` with every prediction replaced by the request's true output length
    times ``exp(sigma * z)`` (z standard normal, drawn with the sample's seed), sigma set
    by bisection so that the mean absolute error over the sample is ``mae_tokens``
    (0: the true lengths). Errors grow with the length, as a real predictor's do; p10 /
    p90 are the noise's own quantiles around the perturbed median. Benchmarks only: it
    reads ``true_output_tokens``."""
    if mae_tokens < 0:
        raise ValueError(f"length_mae_tokens: must be >= 0 (got {mae_tokens})")
    indexes = [i for i, request in enumerate(sample.requests) if request is not None and request.prediction]
    truth = np.array([min(sample.requests[i].true_output_tokens or 1, sample.requests[i].max_tokens)  # type: ignore[union-attr]
                      for i in indexes], dtype=np.float64)
    z = np.random.default_rng(sample.seed).standard_normal(len(indexes))

    def predicted(sigma: float) -> np.ndarray:
        return np.maximum(1.0, np.round(truth * np.exp(sigma * z)))

    low, high = 0.0, 8.0
    for _ in range(60):  # MAE grows with sigma: bisect
        middle = (low + high) / 2
        if np.abs(predicted(middle) - truth).mean() < mae_tokens:
            low = middle
        else:
            high = middle
    sigma = (low + high) / 2 if mae_tokens > 0 else 0.0
    medians = predicted(sigma)
    requests = list(sample.requests)
    spread = math.exp(_Z90 * sigma)
    for i, median in zip(indexes, medians, strict=True):
        request = requests[i]
        assert request is not None and request.prediction is not None
        p50 = int(min(median, request.max_tokens))
        requests[i] = request.with_prediction(dataclasses.replace(
            request.prediction, predicted_output_tokens=p50, p10_tokens=max(1, int(p50 / spread)),
            p90_tokens=min(request.max_tokens, max(p50, math.ceil(p50 * spread))),
            predictor_version=f"perturbed-mae-{mae_tokens:g}"))
    return dataclasses.replace(sample, requests=tuple(requests))
