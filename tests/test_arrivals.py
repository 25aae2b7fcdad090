"""Arrival processes: rate and burstiness statistics, determinism, trace times."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen.arrivals import build_schedule, gamma_arrivals, poisson_arrivals, trace_arrivals
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
