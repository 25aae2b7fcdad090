"""Arrival processes: when each request of a workload is submitted.

All functions return offsets in seconds from the start of the run (the first arrival at
0.0), as a float64 numpy array sorted ascending, and are deterministic in their
arguments: the same seed gives the same schedule.

* :func:`poisson_arrivals` — exponential gaps at a mean rate;
* :func:`gamma_arrivals` — gamma gaps with shape = burstiness and scale =
  1 / (rate × burstiness), as vLLM's benchmark and the Block artifact do: the mean rate
  is kept, the squared coefficient of variation of the gaps is 1 / burstiness
  (burstiness 1 is Poisson, below 1 burstier, above 1 smoother);
* :func:`trace_arrivals` — a trace's own timestamps, optionally rescaled to a target rate;
* :func:`session_arrivals` — multi-turn sessions: session starts from the gamma process,
  each later turn an exponential think time after the one before.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loadgen.traces import TraceRequest, group_sessions

DEFAULT_THINK_TIME_S = 30.0
# Think times draw from their own stream of the seed, so that adding sessions to a
# workload does not change when the sessions start.
_THINK_TIME_STREAM = 1


def _check_rate(rate_per_s: float) -> None:
    if not np.isfinite(rate_per_s) or rate_per_s <= 0:
        raise ValueError(f"rate_per_s must be a positive finite number, got {rate_per_s}")


def gamma_arrivals(
    num_requests: int, rate_per_s: float, burstiness: float, seed: int
) -> np.ndarray:
    """Offsets (s) of ``num_requests`` arrivals with gamma-distributed gaps.

    The first arrival is at 0.0; the ``num_requests - 1`` gaps after it have mean
    ``1 / rate_per_s`` and squared coefficient of variation ``1 / burstiness``. Raises
    ValueError for a non-positive rate or burstiness, or a negative count.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    _check_rate(rate_per_s)
    if not np.isfinite(burstiness) or burstiness <= 0:
        raise ValueError(f"burstiness must be a positive finite number, got {burstiness}")
    if num_requests == 0:
        return np.zeros(0, dtype=np.float64)
    rng = np.random.default_rng(seed)
    gaps_s = rng.gamma(
        shape=burstiness, scale=1.0 / (rate_per_s * burstiness), size=num_requests - 1
    )
    return np.concatenate(([0.0], np.cumsum(gaps_s))).astype(np.float64)


def poisson_arrivals(num_requests: int, rate_per_s: float, seed: int) -> np.ndarray:
    """Offsets (s) of a Poisson process at ``rate_per_s``; identical to gamma with burstiness 1."""
    return gamma_arrivals(num_requests, rate_per_s, 1.0, seed)


def trace_arrivals(
    requests: Sequence[TraceRequest], target_rate_per_s: float | None = None
) -> np.ndarray:
    """The requests' own ``arrival_offset_s``, rebased to start at 0 and sorted.

    With ``target_rate_per_s`` the times are scaled so the mean rate over the trace's span,
    (n - 1) / span, equals the target; the burst pattern is kept. Raises ValueError when a
    request has no offset, or when rescaling a trace whose span is 0.
    """
    if not requests:
        return np.zeros(0, dtype=np.float64)
    missing = sum(1 for request in requests if request.arrival_offset_s is None)
    if missing:
        raise ValueError(f"{missing} of {len(requests)} requests have no arrival_offset_s")
    offsets_s = np.sort(
        np.asarray([request.arrival_offset_s for request in requests], dtype=np.float64)
    )
    offsets_s -= offsets_s[0]
    if target_rate_per_s is None or len(offsets_s) < 2:
        return offsets_s
    _check_rate(target_rate_per_s)
    span_s = float(offsets_s[-1])
    if span_s <= 0:
        raise ValueError("cannot rescale a trace whose arrivals all share one timestamp")
    trace_rate_per_s = (len(offsets_s) - 1) / span_s
    return offsets_s * (trace_rate_per_s / target_rate_per_s)


def session_arrivals(
    turns_per_session: Sequence[int],
    rate_per_s: float | None,
    burstiness: float,
    think_time_s: float,
    seed: int,
) -> list[np.ndarray]:
    """Offsets (s) of every turn of every session: one ascending array per session.

    Session starts are gamma arrivals (:func:`gamma_arrivals`, ``burstiness``) at
    ``rate_per_s`` / (mean turns per session), so that the *request* rate is
    ``rate_per_s`` (all at 0.0 when it is None). Turn k+1 arrives an exponential think time
    of mean ``think_time_s`` after turn k's arrival: the process is open loop, a turn does
    not wait for the answer to the one before (with a short think time or a slow
    engine, turn k+1 can be submitted while turn k is still generating). Over a run
    shorter than a few think times the last sessions' turns stretch past the start
    process, so the realised rate is below ``rate_per_s``. Raises ValueError for a
    negative or non-finite think time or an empty session.
    """
    if not np.isfinite(think_time_s) or think_time_s < 0:
        raise ValueError(f"think_time_s must be a finite number >= 0, got {think_time_s}")
    if any(num_turns < 1 for num_turns in turns_per_session):
        raise ValueError("every session needs at least one turn")
    num_sessions, num_turns = len(turns_per_session), int(sum(turns_per_session))
    if num_sessions == 0:
        return []
    if rate_per_s is None:
        starts_s = np.zeros(num_sessions, dtype=np.float64)
    else:
        _check_rate(rate_per_s)
        session_rate_per_s = rate_per_s * num_sessions / num_turns
        starts_s = gamma_arrivals(num_sessions, session_rate_per_s, burstiness, seed)
    rng = np.random.default_rng((seed, _THINK_TIME_STREAM))
    think_s = rng.exponential(think_time_s, size=num_turns - num_sessions)
    offsets: list[np.ndarray] = []
    position = 0
    for start_s, num_turns_of_session in zip(starts_s, turns_per_session, strict=True):
        gaps_s = think_s[position : position + num_turns_of_session - 1]
        position += num_turns_of_session - 1
        offsets.append(float(start_s) + np.concatenate(([0.0], np.cumsum(gaps_s))))
    return offsets


def build_schedule(
    requests: Sequence[TraceRequest],
    *,
    rate_per_s: float | None,
    burstiness: float = 1.0,
    seed: int = 0,
    use_trace_times: bool = False,
    think_time_s: float = DEFAULT_THINK_TIME_S,
) -> list[tuple[float, TraceRequest]]:
    """Pair every request with its submit offset (s), in submit order.

    * ``use_trace_times``: the trace's own times (:func:`trace_arrivals`), rescaled to
      ``rate_per_s`` when it is given; requests are reordered by their timestamps.
    * otherwise, when some request has a ``session_id``: :func:`session_arrivals`, the
      sessions (:func:`loadgen.traces.group_sessions`; a request without a session id is a
      one-turn session) starting in list order at a session rate that makes the request
      rate ``rate_per_s``, each session's turns in ``turn_index`` order, ``think_time_s``
      apart on average (open loop: a turn does not wait for the previous answer); the
      result is sorted by offset.
    * otherwise, with ``rate_per_s``: gamma arrivals (:func:`gamma_arrivals`) at that
      rate with ``burstiness`` (1 = Poisson), assigned to requests in list order.
    * otherwise (``rate_per_s`` None): every request at 0.0 (an unpaced burst, like
      vLLM's ``--request-rate inf``).

    The same arguments give the same schedule.
    """
    if use_trace_times:
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_offset_s or 0.0)
        ordered = [requests[i] for i in order]
        offsets_s = trace_arrivals(ordered, rate_per_s)
        return [(float(at_s), request) for at_s, request in zip(offsets_s, ordered, strict=True)]
    if any(request.session_id for request in requests):
        return _session_schedule(requests, rate_per_s, burstiness, seed, think_time_s)
    if rate_per_s is None:
        return [(0.0, request) for request in requests]
    offsets_s = gamma_arrivals(len(requests), rate_per_s, burstiness, seed)
    return [(float(at_s), request) for at_s, request in zip(offsets_s, requests, strict=True)]


def _session_schedule(
    requests: Sequence[TraceRequest],
    rate_per_s: float | None,
    burstiness: float,
    seed: int,
    think_time_s: float,
) -> list[tuple[float, TraceRequest]]:
    sessions = group_sessions(requests)
    offsets = session_arrivals([len(turns) for turns in sessions], rate_per_s, burstiness,
                               think_time_s, seed)
    pairs = [(float(at_s), request) for turns, offsets_s in zip(sessions, offsets, strict=True)
             for at_s, request in zip(offsets_s, turns, strict=True)]
    # A stable sort keeps a session's turns in order even when think times are 0.
    pairs.sort(key=lambda pair: pair[0])
    return pairs


def parse_rate_profile(text: str) -> list[tuple[float, float]]:
    """``"300:4,300:5,..."`` → [(300.0, 4.0), (300.0, 5.0), ...]: (seconds, requests/s)
    steps. Raises ValueError naming the bad step."""
    return parse_steps(text, "rate_profile", "RATE")


def parse_steps(text: str, field: str, value_name: str) -> list[tuple[float, float]]:
    """``"SECONDS:VALUE,..."`` → [(seconds, value), ...], seconds > 0 and values >= 0;
    ValueError naming ``field`` and the bad step."""
    steps = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            seconds, value = (float(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"{field}: {item!r} is not SECONDS:{value_name}") from None
        if not (np.isfinite(seconds) and seconds > 0 and np.isfinite(value) and value >= 0):
            raise ValueError(f"{field}: {item!r} needs seconds > 0 and a {value_name.lower()} >= 0")
        steps.append((seconds, value))
    if not steps:
        raise ValueError(f"{field}: no steps")
    return steps


def profile_arrivals(profile: Sequence[tuple[float, float]], seed: int) -> np.ndarray:
    """Offsets (s) of a Poisson process whose rate follows ``profile`` ((seconds, req/s)
    steps, back to back from 0), as one sorted array."""
    rng = np.random.default_rng(seed)
    offsets: list[np.ndarray] = []
    start_s = 0.0
    for seconds, rate in profile:
        count = rng.poisson(rate * seconds)
        offsets.append(start_s + np.sort(rng.uniform(0.0, seconds, count)))
        start_s += seconds
    return np.concatenate(offsets).astype(np.float64) if offsets else np.zeros(0, np.float64)
