"""Arrival processes: rate and burstiness statistics, determinism, trace times."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen.arrivals import (
    build_schedule,
    gamma_arrivals,
    poisson_arrivals,
    session_arrivals,
    trace_arrivals,
)
from loadgen.traces import TraceRequest

NUM_SAMPLES = 4000


def _gap_stats(offsets_s: np.ndarray) -> tuple[float, float]:
    """(mean rate per s, squared coefficient of variation of the gaps)."""
    gaps_s = np.diff(offsets_s)
    return 1.0 / gaps_s.mean(), gaps_s.var() / gaps_s.mean() ** 2


def _requests(num: int, offsets_s: list[float] | None = None) -> list[TraceRequest]:
    return [
        TraceRequest(
            prompt=f"p{i}",
            prompt_tokens=1,
            true_output_tokens=1,
            arrival_offset_s=None if offsets_s is None else offsets_s[i],
            trace_id=str(i),
        )
        for i in range(num)
    ]


def test_poisson_rate_and_cv() -> None:
    offsets_s = poisson_arrivals(NUM_SAMPLES, 32.0, seed=1)
    assert offsets_s.shape == (NUM_SAMPLES,)
    assert offsets_s[0] == 0.0 and np.all(np.diff(offsets_s) >= 0)
    rate, cv2 = _gap_stats(offsets_s)
    assert rate == pytest.approx(32.0, rel=0.06)
    assert cv2 == pytest.approx(1.0, rel=0.15)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 2.0, 4.0])
def test_gamma_rate_and_burstiness(burstiness: float) -> None:
    offsets_s = gamma_arrivals(NUM_SAMPLES, 20.0, burstiness, seed=7)
    rate, cv2 = _gap_stats(offsets_s)
    # The sample mean of gamma gaps has relative sd 1/sqrt(n * shape).
    assert rate == pytest.approx(20.0, rel=max(0.06, 4.0 / np.sqrt(NUM_SAMPLES * burstiness)))
    assert cv2 == pytest.approx(1.0 / burstiness, rel=0.2)


def test_determinism_per_seed() -> None:
    assert np.array_equal(gamma_arrivals(100, 5.0, 0.5, 3), gamma_arrivals(100, 5.0, 0.5, 3))
    assert not np.array_equal(gamma_arrivals(100, 5.0, 0.5, 3), gamma_arrivals(100, 5.0, 0.5, 4))
    assert np.array_equal(poisson_arrivals(50, 2.0, 9), gamma_arrivals(50, 2.0, 1.0, 9))
    requests = _requests(50)
    assert build_schedule(requests, rate_per_s=4.0, seed=2) == build_schedule(
        requests, rate_per_s=4.0, seed=2
    )


def test_invalid_parameters() -> None:
    with pytest.raises(ValueError):
        poisson_arrivals(10, 0.0, 1)
    with pytest.raises(ValueError):
        gamma_arrivals(10, 1.0, -1.0, 1)
    assert gamma_arrivals(0, 1.0, 1.0, 1).size == 0
    assert gamma_arrivals(1, 1.0, 1.0, 1).tolist() == [0.0]


def test_trace_arrivals_rescaled() -> None:
    requests = _requests(5, [10.0, 10.5, 12.0, 11.0, 14.0])
    assert trace_arrivals(requests).tolist() == [0.0, 0.5, 1.0, 2.0, 4.0]
    rescaled = trace_arrivals(requests, target_rate_per_s=4.0)
    assert rescaled[-1] == pytest.approx(1.0)  # 4 gaps at 4 req/s
    assert rescaled.tolist() == pytest.approx([0.0, 0.125, 0.25, 0.5, 1.0])
    with pytest.raises(ValueError):
        trace_arrivals(_requests(3))
    with pytest.raises(ValueError):
        trace_arrivals(_requests(2, [1.0, 1.0]), target_rate_per_s=2.0)


def test_build_schedule_modes() -> None:
    requests = _requests(4, [3.0, 1.0, 2.0, 5.0])
    by_trace = build_schedule(requests, rate_per_s=None, use_trace_times=True)
    assert [(at_s, r.trace_id) for at_s, r in by_trace] == [
        (0.0, "1"), (1.0, "2"), (2.0, "0"), (4.0, "3")
    ]  # fmt: skip
    burst = build_schedule(requests, rate_per_s=None)
    assert [at_s for at_s, _ in burst] == [0.0] * 4
    paced = build_schedule(requests, rate_per_s=2.0, burstiness=0.5, seed=1)
    assert [r.trace_id for _, r in paced] == ["0", "1", "2", "3"]
    assert [at_s for at_s, _ in paced] == gamma_arrivals(4, 2.0, 0.5, 1).tolist()


def _session_requests(turns_per_session: list[int]) -> list[TraceRequest]:
    """Sessions listed turn-major (every first turn, then every second...), so the
    schedule must regroup them."""
    requests = []
    for turn_index in range(max(turns_per_session)):
        for session, num_turns in enumerate(turns_per_session):
            if turn_index < num_turns:
                requests.append(TraceRequest(
                    prompt=f"s{session}t{turn_index}", prompt_tokens=1, true_output_tokens=1,
                    trace_id=f"s{session}t{turn_index}", session_id=f"s{session}",
                    turn_index=turn_index))
    return requests


def test_session_schedule_rate_turn_order_and_think_time() -> None:
    num_sessions, rate_per_s, think_time_s = 3000, 10.0, 5.0
    requests = _session_requests([1 + i % 5 for i in range(num_sessions)])  # 3 turns on average
    schedule = build_schedule(requests, rate_per_s=rate_per_s, seed=4, think_time_s=think_time_s)
    assert sorted(id(r) for _, r in schedule) == sorted(id(r) for r in requests)
    offsets_s = np.array([at_s for at_s, _ in schedule])
    assert offsets_s[0] == 0.0 and np.all(np.diff(offsets_s) >= 0)
    session_to_turns: dict[str, list[tuple[float, int]]] = {}
    for at_s, request in schedule:
        session_to_turns.setdefault(request.session_id, []).append((at_s, request.turn_index))
    gaps_s = []
    for turns in session_to_turns.values():
        assert [turn for _, turn in turns] == list(range(len(turns)))  # in order
        gaps_s.extend(np.diff([at_s for at_s, _ in turns]))
    assert np.mean(gaps_s) == pytest.approx(think_time_s, rel=0.05)
    # Session starts: the asked process at rate / mean turns; requests at the asked rate.
    starts_s = np.sort([turns[0][0] for turns in session_to_turns.values()])
    assert _gap_stats(starts_s)[0] == pytest.approx(rate_per_s / 3.0, rel=0.06)
    assert len(schedule) / offsets_s[-1] == pytest.approx(rate_per_s, rel=0.06)
    assert schedule == build_schedule(requests, rate_per_s=rate_per_s, seed=4,
                                      think_time_s=think_time_s)
    assert schedule != build_schedule(requests, rate_per_s=rate_per_s, seed=5,
                                      think_time_s=think_time_s)


def test_session_schedule_edge_cases() -> None:
    requests = _session_requests([3, 1])
    unpaced = build_schedule(requests, rate_per_s=None, think_time_s=2.0, seed=1)
    assert [r.trace_id for at_s, r in unpaced if at_s == 0.0] == ["s0t0", "s1t0"]
    assert [r.trace_id for _, r in unpaced][2:] == ["s0t1", "s0t2"]
    no_think = build_schedule(requests, rate_per_s=1.0, think_time_s=0.0, seed=1)
    assert [r.trace_id for _, r in no_think] == ["s0t0", "s0t1", "s0t2", "s1t0"]
    # A request without a session id is a session of its own.
    loose = TraceRequest(prompt="p", prompt_tokens=1, true_output_tokens=1, trace_id="loose")
    mixed = build_schedule([*requests, loose], rate_per_s=1.0, think_time_s=0.0, seed=1)
    assert [r.trace_id for _, r in mixed][-1] == "loose"
    with pytest.raises(ValueError, match="think_time_s"):
        build_schedule(requests, rate_per_s=1.0, think_time_s=-1.0)
    assert session_arrivals([], 1.0, 1.0, 1.0, seed=0) == []
    # Without sessions: exactly the plain gamma schedule, whatever the think time.
    plain = _requests(6)
    assert build_schedule(plain, rate_per_s=2.0, seed=3, think_time_s=1.0) == build_schedule(
        plain, rate_per_s=2.0, seed=3)
