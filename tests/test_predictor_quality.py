"""Online quality monitor: rolling figures, accuracy-drop and drift alerts."""

from __future__ import annotations

import math

import pytest

from predictor_service.quality import (
    ACCURACY_DROP,
    PROMPT_DRIFT,
    QualityMonitor,
    population_stability_index,
)


def _monitor(**settings: float | int) -> QualityMonitor:
    return QualityMonitor(
        validation_acc50=0.60,
        prompt_token_bin_edges=(10.0, 100.0),
        prompt_token_bin_fractions=(0.3, 0.4, 0.3),
        model_version="fast-test",
        window_size=50,
        min_samples=20,
        **settings,
    )


def test_rolling_figures() -> None:
    monitor = _monitor()
    assert math.isnan(monitor.snapshot().rolling_mae)
    for predicted, true in [(100, 100), (100, 160), (100, 300)]:
        monitor.ingest(predicted, true, prompt_tokens=50)
    snapshot = monitor.snapshot()
    assert snapshot.num_samples == 3
    assert snapshot.rolling_mae == pytest.approx((0 + 60 + 200) / 3)
    assert snapshot.rolling_acc50 == pytest.approx(1 / 3)
    assert snapshot.rolling_acc100 == pytest.approx(2 / 3)


def test_accuracy_drop_alert_fires_once_and_rearms() -> None:
    monitor = _monitor()
    alerts = []
    for index in range(50):  # 70 % within 50 tokens: healthy
        alerts += monitor.ingest(100, 100 if index % 10 < 7 else 400, prompt_tokens=50)
    assert [a for a in alerts if a.kind == ACCURACY_DROP] == []
    fired = []
    for _ in range(50):  # all wrong now: Acc-50 falls to 0 (< 60 - 15 points)
        fired += [a for a in monitor.ingest(100, 400, prompt_tokens=50) if a.kind == ACCURACY_DROP]
    assert len(fired) == 1
    alert = fired[0]
    assert alert.value < 0.45 and alert.threshold == pytest.approx(0.45)
    assert alert.model_version == "fast-test" and "Acc-50" in alert.message
    for _ in range(50):  # recovers, then drops again: fires again
        monitor.ingest(100, 100, prompt_tokens=50)
    again = []
    for _ in range(50):
        again += [a for a in monitor.ingest(100, 400, prompt_tokens=50) if a.kind == ACCURACY_DROP]
    assert len(again) == 1


def test_no_alert_before_min_samples() -> None:
    monitor = _monitor()
    for _ in range(19):
        assert monitor.ingest(100, 900, prompt_tokens=50) == []


def test_prompt_drift_alert_when_lengths_shift() -> None:
    monitor = _monitor()
    kinds = []
    for _ in range(50):  # every prompt in the top bin (training share 0.3)
        kinds += [alert.kind for alert in monitor.ingest(100, 100, prompt_tokens=5000)]
    assert kinds == [PROMPT_DRIFT]
    assert monitor.snapshot().prompt_psi > 0.25


def test_prompt_drift_hovering_at_the_threshold_alerts_once() -> None:
    monitor = _monitor()
    matching = [5, 5, 5, 50, 50, 50, 50, 500, 500, 500]  # the training shares 0.3 / 0.4 / 0.3
    for index in range(50):
        monitor.ingest(100, 100, prompt_tokens=matching[index % 10])
    kinds: list[str] = []
    psi_values = []
    for prompt_tokens in [500] * 16 + [50, 500, 50, 500, 50, 500]:  # up past 0.25, then around it
        kinds += [alert.kind for alert in monitor.ingest(100, 100, prompt_tokens=prompt_tokens)]
        psi_values.append(monitor.snapshot().prompt_psi)
    assert min(psi_values[16:]) < 0.25 < max(psi_values[16:])  # it did cross back and forth
    assert min(psi_values[16:]) > 0.2
    assert kinds == [PROMPT_DRIFT]
    for index in range(50):  # back to the training mix: PSI near 0, re-armed
        monitor.ingest(100, 100, prompt_tokens=matching[index % 10])
    for _ in range(30):
        kinds += [alert.kind for alert in monitor.ingest(100, 100, prompt_tokens=5000)]
    assert kinds == [PROMPT_DRIFT, PROMPT_DRIFT]


def test_psi_is_zero_for_identical_distributions() -> None:
    assert population_stability_index([0.2, 0.8], [0.2, 0.8]) == 0.0
    assert population_stability_index([0.5, 0.5], [0.9, 0.1]) > 0.25
