"""The forecast check (:mod:`blockq.forecast_check`): the pure tracker (median error over a
window, hysteresis, recovery), the core's fallbacks, the simulation finding a slow instance,
and the live dispatcher following ``done`` and exporting the figure."""

from __future__ import annotations

import dataclasses

import pytest
import redis
from prometheus_client import generate_latest
from structlog.testing import capture_logs

from blockq.config import Settings
from blockq.engine_model import get_preset
from blockq.forecast_check import (
    ForecastCheck,
    ForecastCheckOptions,
    scaled_latency_model,
    score_records,
)
from blockq.local.status import collect_status
from blockq.wire.keys import PAYLOAD_FIELD
from blockq.wire.protocol import DoneRecord, encode
from blockq.wire.streams import connect_async
from dispatcher.core import DispatcherCore
from dispatcher.service import create_dispatcher
from loadgen.simulation.config import SimulationConfig
from loadgen.simulation.single_run import simulate_run
from loadgen.simulation.workload import annotate_sample, sample_trace
from tests.factories import make_heartbeat


def done(instance: str, *, ttft_ms: float, predicted_ttft_ms: float = 100.0, e2e_ms: float = 1000.0,
         predicted_e2e_ms: float = 1000.0, status: str = "ok", request_id: str = "r") -> DoneRecord:
    return DoneRecord(
        request_id=request_id, instance=instance, status=status, prompt_tokens=10, output_tokens=20,
        predicted_output_tokens=20, predictor_version="v", policy="block", submitted_at_s=0.0, finished_at_s=1.0,
        queue_wait_ms=0.0, ttft_ms=ttft_ms, tpot_ms=10.0, e2e_ms=e2e_ms, predicted_ttft_ms=predicted_ttft_ms,
        predicted_e2e_ms=predicted_e2e_ms, num_preemptions=0)


# --- the pure tracker ---------------------------------------------------------------------


def test_median_error_over_the_window_only() -> None:
    check = ForecastCheck(ForecastCheckOptions(window=4, min_samples=2, bound=10.0))
    # Errors 50 %, 50 %, then 0, 0, 0, 0: the window keeps the last four.
    for ttft_ms in (200.0, 200.0, 100.0, 100.0):
        check.observe(done("a", ttft_ms=ttft_ms))
    assert check.instance_error("a").ttft_mape == pytest.approx(0.25)  # median of 0.5, 0.5, 0, 0
    for _ in range(2):
        check.observe(done("a", ttft_ms=100.0))
    error = check.instance_error("a")
    assert error.ttft_mape == 0.0 and error.num_samples == 4 and error.num_observed == 6
    assert error.ratio == 1.0


def test_ignores_what_ran_nowhere_or_has_no_forecast() -> None:
    check = ForecastCheck()
    assert check.observe(done("a", ttft_ms=500.0, status="infeasible")) is None
    assert check.observe(done("a", ttft_ms=500.0, predicted_e2e_ms=None)) is None  # type: ignore[arg-type]
    assert check.instance_error("a").num_observed == 0 and check.is_trusted("a")


def test_untrusted_past_the_bound_and_trusted_again_only_well_under_it() -> None:
    """Hysteresis: past 25 % → untrusted (one change); at 22 % it stays untrusted (between
    0.8 × bound and the bound); under 20 % it is trusted again (one change)."""
    check = ForecastCheck(ForecastCheckOptions(window=10, min_samples=5, bound=0.25))
    changes = [check.observe(done("a", ttft_ms=100.0)) for _ in range(5)]
    assert changes == [None] * 5 and check.is_trusted("a")
    # 2× slow: |200 - 100| / 200 = 50 %; the median passes 25 % at the 6th slow record of 10.
    changes = [check.observe(done("a", ttft_ms=200.0)) for _ in range(10)]
    flips = [c for c in changes if c is not None]
    assert len(flips) == 1 and not flips[0].trusted and changes.index(flips[0]) == 5
    assert "past the bound 25%" in flips[0].reason and check.untrusted_ids == {"a"}
    assert check.ratio("a") == pytest.approx(2.0)
    # 22 % errors: under the bound but not under 0.8 × it: still untrusted.
    assert all(check.observe(done("a", ttft_ms=100 / 0.78)) is None for _ in range(10))
    assert not check.is_trusted("a")
    changes = [check.observe(done("a", ttft_ms=105.0)) for _ in range(10)]
    flips = [c for c in changes if c is not None]
    assert len(flips) == 1 and flips[0].trusted and check.is_trusted("a") and not check.untrusted_ids


def test_no_verdict_before_min_samples_and_only_ttft_decides() -> None:
    check = ForecastCheck(ForecastCheckOptions(window=10, min_samples=5))
    for _ in range(4):
        assert check.observe(done("a", ttft_ms=400.0)) is None
    change = check.observe(done("a", ttft_ms=400.0))
    assert change is not None and not change.trusted  # TTFT 75 % off
    e2e_off = score_records([done("a", ttft_ms=100.0, e2e_ms=3000.0)] * 30)
    assert e2e_off["a"].trusted and e2e_off["a"].e2e_mape == pytest.approx(2 / 3)  # reported, not decisive


def test_options_are_validated() -> None:
    for bad in ({"window": 10, "min_samples": 11}, {"bound": 0.0}, {"recover_fraction": 1.5},
                {"fallback": "exclude"}, {"fallback": "ignore"}):
        with pytest.raises(ValueError):
            ForecastCheckOptions(**bad)  # type: ignore[arg-type]


def test_scaled_latency_model_scales_every_step() -> None:
    model = get_preset("llama2-7b-a30").latency_model
    slowed = scaled_latency_model(model, 2.0)
    for batch in ((512, 0, 0), (0, 32, 20_000), (100, 10, 5_000)):
        assert slowed.step_seconds(*batch) == pytest.approx(2 * model.step_seconds(*batch))
    assert scaled_latency_model(model, 1.0) is model


# --- the core's fallbacks -----------------------------------------------------------------


def test_correct_scales_the_untrusted_replica_and_scores_it_afresh() -> None:
    core = DispatcherCore("block", seed=1,
                          forecast_check=ForecastCheckOptions(window=5, min_samples=5, fallback="correct"))
    core.apply_heartbeat(make_heartbeat("a"), now_s=0.0)
    replica = core.view.instances["a"].replica
    assert replica is not None and replica.latency_factor == 1.0
    for _ in range(5):
        core.observe_answer(done("a", ttft_ms=300.0))
    assert replica.latency_factor == pytest.approx(3.0 ** 0.5)  # damped: see CORRECTION_DAMPING
    assert not core.forecast_check.is_trusted("a") and core.forecast_check.instance_error("a").num_samples == 0


# --- the simulation -----------------------------------------------------------------------


def test_simulation_finds_the_slow_instance() -> None:
    """Four instances, the last one 3× slower than the profile it publishes: the check
    marks it (and only it) untrusted within its first answers; when the slow instance
    publishes its true profile, nothing is marked."""
    sample = annotate_sample(sample_trace("synthetic", 300, 4, redraw=False), 4, predictor="heuristic")
    config = SimulationConfig(instances=4, policy="block", seed=4, slow_instances=1, slow_factor=3.0,
                              forecast_check=ForecastCheckOptions(window=10, min_samples=5, fallback="none"))
    check = simulate_run(config, sample, rate_per_s=8.0).summary["forecast_check"]
    assert [(c["instance"], c["trusted"]) for c in check["changes"]] == [("gpu3", False)]
    assert check["changes"][0]["num_observed"] == 5
    assert check["instances"]["gpu3"]["ttft_mape"] > 0.25 > check["instances"]["gpu0"]["ttft_mape"]
    truth = simulate_run(dataclasses.replace(config, slow_published=True), sample, rate_per_s=8.0)
    assert truth.summary["forecast_check"]["changes"] == []


# --- live: the dispatcher follows done ----------------------------------------------------


async def test_dispatcher_marks_an_instance_untrusted_from_done_records(settings: Settings,
                                                                         sync_redis: redis.Redis) -> None:
    """``done`` records 3× slower than forecast for one instance: the leader's done reader
    (plain XREAD: the predictor's feedback group keeps its own entries) marks it untrusted
    with one log line, the metrics show it, and ``blockq status`` shows the figure."""
    client = connect_async(settings.redis_url)
    dispatcher = create_dispatcher(client, settings, "round_robin", seed=1, dispatcher_id="d-check",
                                   forecast_check=ForecastCheckOptions(window=20, min_samples=10))
    follower = dispatcher.done_follower
    follower.poll_s = 0.0
    follower.start_term()
    await follower.poll()  # the cursor starts at the stream's end
    for index in range(25):  # past the default min_samples too, which blockq status uses
        for instance_id, ttft_ms in (("slow", 300.0), ("good", 104.0)):
            record = done(instance_id, ttft_ms=ttft_ms, request_id=f"{instance_id}-{index}")
            sync_redis.xadd(settings.keys.done, {PAYLOAD_FIELD: encode(record)})
    with capture_logs() as logs:
        assert await follower.poll() == 50
    assert dispatcher.core.forecast_check.untrusted_ids == {"slow"}
    untrusted_logs = [entry for entry in logs if entry["event"] == "instance_untrusted"]
    assert len(untrusted_logs) == 1 and untrusted_logs[0]["instance_id"] == "slow"
    assert "past the bound" in untrusted_logs[0]["reason"]
    text = generate_latest(dispatcher.metrics.registry).decode()
    assert 'blockq_dispatcher_instance_trusted{instance_id="slow"} 0.0' in text
    assert 'blockq_dispatcher_instance_trusted{instance_id="good"} 1.0' in text
    assert 'blockq_dispatcher_forecast_error_ratio{instance_id="slow",signal="ttft"} 0.6666' in text
    for instance_id in ("slow", "good"):
        sync_redis.hset(settings.keys.instances, instance_id, encode(make_heartbeat(instance_id)))
    status = {i["id"]: i["forecast_error"] for i in collect_status(sync_redis, settings)["instances"]}
    assert status["slow"]["trusted"] is False and status["slow"]["ttft_mape"] == pytest.approx(2 / 3, abs=1e-3)
    assert status["good"]["trusted"] is True
    await client.aclose()
