"""The scaling policy (pure): rules, forecast, simulated futures, scalers; and the
autoscaled simulation (instances started and drained in virtual time, nothing lost)."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from blockq.engine_model import get_preset
from blockq.engine_model import packed_layout as layout
from blockq.engine_model.packed import PackedScheduler
from dispatcher.autoscale import (
    LIVE,
    STARTING,
    ActionHistory,
    ArrivalHistory,
    Autoscaler,
    FleetSnapshot,
    InstanceState,
    PredictiveScaler,
    ReactiveScaler,
    ScalingRules,
    ScheduledScaler,
    apply_rules,
    count_reversals,
    drain_order,
    forecast_fleet,
)
from dispatcher.autoscale.futures import p99 as fleet_p99
from dispatcher.autoscale.futures import realized_targets
from loadgen.arrivals import parse_rate_profile, parse_steps, profile_arrivals

PRESET = get_preset("llama2-7b-a30")


def _scheduler(now_s: float = 0.0, waiting: int = 0, prompt_tokens: int = 200,
               output_tokens: int = 200) -> PackedScheduler:
    scheduler = PackedScheduler(PRESET.config, PRESET.latency_model, now_s)
    for k in range(waiting):
        scheduler.add_request(f"w{k}", prompt_tokens, output_tokens)
    return scheduler


def _snapshot(*schedulers: PackedScheduler, now_s: float = 0.0, starting: dict[str, float] | None = None,
              num_unplaced: int = 0) -> FleetSnapshot:
    states = [InstanceState(f"gpu{k}", LIVE, s) for k, s in enumerate(schedulers)]
    states += [InstanceState(i, STARTING, ready_at_s=t) for i, t in (starting or {}).items()]
    return FleetSnapshot(now_s, tuple(states), PRESET.config, PRESET.latency_model, num_unplaced)


def _poisson(rate_per_s: float, until_s: float, seed: int = 0, start_s: float = 0.0) -> list[tuple[float, int, int]]:
    rng = random.Random(seed)
    at_s, out = start_s, []
    while (at_s := at_s + rng.expovariate(rate_per_s)) < until_s:
        out.append((at_s, rng.randint(20, 600), rng.randint(20, 500)))
    return out


# --- rules --------------------------------------------------------------------------------


def test_rules_limit_the_step_to_a_fifth_of_the_fleet_and_at_least_one() -> None:
    rules = ScalingRules(min_instances=1, max_instances=40)
    assert apply_rules(rules, ActionHistory(), 10, 20, 0.0)[0] == 12
    assert apply_rules(rules, ActionHistory(), 3, 9, 0.0)[0] == 4
    assert apply_rules(rules, ActionHistory(), 10, 1, 0.0)[0] == 8
    assert apply_rules(rules, ActionHistory(), 10, 10, 0.0) == (10, "holds")


def test_rules_keep_cooldowns_and_a_longer_hold_before_reversing() -> None:
    rules = ScalingRules(min_instances=1, max_instances=20, cooldown_s=300, reversal_hold_s=600)
    history = ActionHistory(last_up_s=0.0)
    target, reason = apply_rules(rules, history, 5, 8, 299.0)
    assert target == 5 and "cooldown" in reason
    assert apply_rules(rules, history, 5, 8, 300.0)[0] == 6
    target, reason = apply_rules(rules, history, 5, 2, 599.0)
    assert target == 5 and "reversal hold" in reason
    assert apply_rules(rules, history, 5, 2, 600.0)[0] == 4


def test_rules_bring_a_fleet_back_inside_its_bounds_at_once() -> None:
    rules = ScalingRules(min_instances=3, max_instances=6)
    history = ActionHistory(last_up_s=0.0, last_down_s=0.0)
    assert apply_rules(rules, history, 1, 1, 1.0)[0] == 3
    assert apply_rules(rules, history, 9, 9, 1.0)[0] == 6
    assert apply_rules(rules, ActionHistory(), 6, 50, 1.0) == (6, "at the max bound")


def test_rules_refuse_bad_values_naming_the_field() -> None:
    with pytest.raises(ValueError, match="max_instances"):
        ScalingRules(min_instances=5, max_instances=4)
    with pytest.raises(ValueError, match="reversal_hold_s"):
        ScalingRules(cooldown_s=300, reversal_hold_s=60)


def test_reversals_are_counted_within_the_window_only() -> None:
    actions = [(0.0, "up"), (300.0, "up"), (700.0, "down"), (1400.0, "up"), (1500.0, "down")]
    assert count_reversals(actions, 600.0) == 2


# --- forecast -----------------------------------------------------------------------------


def test_forecast_follows_level_and_trend_and_bounds_them_above() -> None:
    history = ArrivalHistory()
    rng = np.random.default_rng(0)
    # A ramp from 2 to 8 req/s over 10 minutes.
    times = np.sort(rng.uniform(0, 600, 4800))  # 8 req/s, thinned below
    keep = rng.uniform(0, 1, len(times)) < (2 + 6 * times / 600) / 8
    for at_s in times[keep]:
        history.observe(float(at_s), 100, 100)
    forecast = history.forecast(600.0, 120.0)
    assert 6.5 < forecast.level_per_s < 8.5
    assert 0.4 < forecast.trend_per_s2 * 60 < 0.8      # ~0.6 req/s per minute
    assert forecast.forecast_per_s > forecast.level_per_s
    assert forecast.upper_per_s > forecast.forecast_per_s
    assert forecast.recent_peak_per_s >= forecast.level_per_s


def test_rate_profile_arrivals_follow_the_steps() -> None:
    profile = parse_rate_profile("100:2,100:10")
    offsets = profile_arrivals(profile, seed=3)
    assert np.all(np.diff(offsets) >= 0)
    assert 150 < np.count_nonzero(offsets < 100) < 250
    assert 850 < np.count_nonzero(offsets >= 100) < 1150
    with pytest.raises(ValueError, match="rate_profile"):
        parse_rate_profile("100:2,oops")


# --- futures ------------------------------------------------------------------------------


def test_a_bigger_fleet_predicts_a_lower_p99_ttft() -> None:
    arrivals = _poisson(8.0, 120.0)
    p99 = [fleet_p99(forecast_fleet(_snapshot(*[_scheduler() for _ in range(n)]), n, arrivals,
                          startup_s=60.0, run_on_s=6.0).ttft_s) for n in (1, 2, 4, 6)]
    assert p99[0] > 3.0 > p99[-1]
    assert p99 == sorted(p99, reverse=True)


def test_new_instances_take_requests_only_once_started() -> None:
    arrivals = _poisson(6.0, 60.0)
    one = forecast_fleet(_snapshot(_scheduler()), 1, arrivals, startup_s=1000.0, run_on_s=6.0)
    grown_late = forecast_fleet(_snapshot(_scheduler()), 3, arrivals, startup_s=1000.0, run_on_s=6.0)
    grown_now = forecast_fleet(_snapshot(_scheduler()), 3, arrivals, startup_s=0.0, run_on_s=6.0)
    assert np.array_equal(one.ttft_s, grown_late.ttft_s)
    assert fleet_p99(grown_now.ttft_s) < fleet_p99(one.ttft_s)


def test_drain_order_cancels_starting_instances_first_then_the_emptiest_live_one() -> None:
    snapshot = _snapshot(_scheduler(waiting=30), _scheduler(waiting=2), starting={"new": 50.0})
    assert drain_order(snapshot) == ["new", "gpu1", "gpu0"]


def test_a_shrunk_fleet_carries_the_drained_instances_unstarted_requests() -> None:
    """Two instances, one with a deep queue; shrinking to one drains the emptier one, and
    what the leaving one had not started lands on the survivor."""
    arrivals = _poisson(1.0, 30.0)
    busy_kept = forecast_fleet(_snapshot(_scheduler(waiting=60), _scheduler()), 1, arrivals,
                               startup_s=60.0, run_on_s=30.0)
    busy_gone = forecast_fleet(_snapshot(_scheduler(), _scheduler(waiting=60)), 1, arrivals,
                               startup_s=60.0, run_on_s=30.0)
    assert fleet_p99(busy_kept.ttft_s) > 1.0
    assert abs(fleet_p99(busy_gone.ttft_s) - fleet_p99(busy_kept.ttft_s)) < 0.5 * fleet_p99(busy_kept.ttft_s)


def test_realized_targets_are_the_median_of_the_longer_realized_lengths() -> None:
    realized = np.array([10, 20, 30, 40, 50])
    assert realized_targets(np.array([0, 25, 40, 50, 70]), realized).tolist() == [30, 40, 50, 51, 71]


def test_requests_already_there_are_simulated_with_realized_lengths_when_given() -> None:
    """Two instances whose running requests are believed to produce 1,500 tokens each (the
    KV caches would fill and the new requests wait): with realized lengths of 40 tokens the
    same fleet is predicted to keep new requests' TTFT low."""
    def believed_long() -> PackedScheduler:
        scheduler = _scheduler(waiting=40, prompt_tokens=300, output_tokens=1500)
        scheduler.simulate(until_s=5.0)
        return scheduler.rebased(5.0)

    fleet = _snapshot(believed_long(), believed_long(), now_s=5.0)
    arrivals = _poisson(4.0, 65.0, start_s=5.0)
    believed = forecast_fleet(fleet, 2, arrivals, startup_s=60.0, run_on_s=30.0)
    realized = forecast_fleet(fleet, 2, arrivals, startup_s=60.0, run_on_s=30.0,
                              realized_output_tokens=np.full(1000, 40))
    assert fleet_p99(believed.ttft_s) > 3.0 > 1.0 > fleet_p99(realized.ttft_s)
    assert fleet.instances[0].scheduler.requests[0, layout.TARGET] == 1500  # the snapshot's replicas are not changed


# --- scalers ------------------------------------------------------------------------------


def _history(rate_per_s: float, until_s: float) -> ArrivalHistory:
    history = ArrivalHistory()
    for at_s, prompt, output in _poisson(rate_per_s, until_s, seed=1):
        history.observe(at_s, prompt, output)
    return history


def test_the_predictive_scaler_grows_an_overloaded_fleet_and_shrinks_an_idle_one() -> None:
    rules = ScalingRules(min_instances=1, max_instances=12)
    busy = PredictiveScaler(_history(9.0, 900.0), startup_s=60.0)
    want = busy.want(_snapshot(_scheduler(now_s=900.0), now_s=900.0), frozenset({"up", "down"}), rules)
    assert want.size >= 2 and "p99_s@1" in want.forecast
    quiet = PredictiveScaler(_history(0.5, 900.0), startup_s=60.0)
    fleet = _snapshot(*[_scheduler(now_s=900.0) for _ in range(6)], now_s=900.0)
    want = quiet.want(fleet, frozenset({"up", "down"}), rules)
    assert want.size == 5  # the step limit: one of six
    assert quiet.want(fleet, frozenset({"up"}), rules).size == 6  # no scale-down allowed: none considered


def test_the_predictive_scaler_sizes_the_future_with_answered_requests_once_it_has_enough() -> None:
    """Arrivals predicted at 1,500 output tokens: a fleet of 2 looks overloaded at 6 req/s;
    once 1,000 requests were answered with 40 tokens each, the same fleet holds."""
    history = ArrivalHistory()
    for at_s, prompt, _ in _poisson(6.0, 900.0, seed=3):
        history.observe(at_s, prompt, 1500)
    rules = ScalingRules(min_instances=1, max_instances=12)
    scaler = PredictiveScaler(history, startup_s=60.0)
    fleet = _snapshot(_scheduler(now_s=900.0), _scheduler(now_s=900.0), now_s=900.0)
    assert scaler.want(fleet, frozenset({"up"}), rules).size > 2
    few = replace(fleet, answered_sizes=((200, 40),) * 999)
    assert scaler.want(few, frozenset({"up"}), rules).size > 2  # too few answers: the predictions
    enough = replace(fleet, answered_sizes=((200, 40),) * 1000)
    assert scaler.want(enough, frozenset({"up"}), rules).size == 2


def test_the_reactive_scaler_follows_kv_usage_and_waits_its_stabilisation_window() -> None:
    rules = ScalingRules(min_instances=1, max_instances=12)
    scaler = ReactiveScaler(target_kv_usage=0.5, stabilization_s=300.0)
    hot = FleetSnapshot(0.0, tuple(InstanceState(f"gpu{k}", LIVE, kv_usage=0.9) for k in range(4)),
                        PRESET.config, PRESET.latency_model)
    assert scaler.want(hot, frozenset({"up", "down"}), rules).size == 8
    cold = FleetSnapshot(200.0, tuple(InstanceState(f"gpu{k}", LIVE, kv_usage=0.1) for k in range(4)),
                         PRESET.config, PRESET.latency_model)
    assert scaler.want(cold, frozenset({"up", "down"}), rules).size == 4  # the window still holds the peak
    later = FleetSnapshot(600.0, cold.instances, PRESET.config, PRESET.latency_model)
    assert scaler.want(later, frozenset({"up", "down"}), rules).size == 1


def test_the_autoscaler_records_its_actions_and_honours_the_cooldown() -> None:
    rules = ScalingRules(min_instances=1, max_instances=12, cooldown_s=300, reversal_hold_s=600)
    autoscaler = Autoscaler(ReactiveScaler(target_kv_usage=0.5), rules, cycle_s=60.0)
    hot = FleetSnapshot(0.0, tuple(InstanceState(f"gpu{k}", LIVE, kv_usage=0.9) for k in range(5)),
                        PRESET.config, PRESET.latency_model)
    first = autoscaler.decide(hot)
    assert (first.current, first.target, first.direction) == (5, 6, "up")
    again = autoscaler.decide(FleetSnapshot(60.0, hot.instances, hot.config, hot.latency_model))
    assert again.target == 5 and "cooldown" in again.reason
    assert not autoscaler.due(100.0) and autoscaler.due(120.0)


def test_the_scheduled_scaler_follows_its_steps_from_its_origin_and_holds_the_last() -> None:
    rules = ScalingRules(min_instances=1, max_instances=12)
    scaler = ScheduledScaler([(100.0, 3), (50.0, 5), (10.0, 2)], origin_s=20.0)
    fleet = _snapshot(_scheduler())
    wanted = [scaler.want(replace(fleet, now_s=t), frozenset(), rules).size for t in (0.0, 119.9, 120.0, 169.9, 180.0, 1e6)]
    assert wanted == [3, 3, 5, 5, 2, 2]
    with pytest.raises(ValueError, match="schedule"):
        ScheduledScaler([])
    assert parse_steps("60:3, 30:4", "schedule", "SIZE") == [(60.0, 3.0), (30.0, 4.0)]
    with pytest.raises(ValueError, match=r"schedule: '60' is not SECONDS:SIZE"):
        parse_steps("60", "schedule", "SIZE")


# --- the autoscaled simulation ------------------------------------------------------------


def test_a_schedule_runs_behind_the_rules_in_the_simulation() -> None:
    """The schedule asks 1 → 4 at once and back to 1 after 60 s; the rules let it grow one
    instance per cooldown and shrink only after the reversal hold."""
    from loadgen.simulation.autoscale import AutoscaleSettings, run_scaler
    from loadgen.simulation.config import SimulationConfig
    from loadgen.simulation.workload import annotate_sample, sample_trace

    offsets = profile_arrivals([(200.0, 2.0)], seed=3)
    sample = annotate_sample(sample_trace("synthetic", len(offsets), 3, redraw=True), 3)
    schedule = [(float(at_s), index) for index, at_s in enumerate(offsets)]
    rules = ScalingRules(min_instances=1, max_instances=6, cooldown_s=20.0, reversal_hold_s=40.0)
    settings = AutoscaleSettings(rules, initial_instances=3, startup_s=5.0, cycle_s=10.0,
                                 schedule=((60.0, 1), (60.0, 4), (1e6, 1)))
    run = run_scaler(SimulationConfig(policy="llumnix", seed=3), sample, schedule, "scheduled", settings)
    actions = [(round(d.at_s - SimulationConfig().warmup_s), d.current, d.target)
               for d in run.timeline.decisions if d.direction is not None]
    assert actions[0] == (60, 1, 2) and actions[1] == (80, 2, 3) and actions[2] == (100, 3, 4)
    assert all(at_s >= 140 for at_s, current, target in actions[3:]) and actions[-1][2] == 1
    assert run.summary["num_requests"] + run.summary["num_refused"] == len(schedule)
    assert all(np.isfinite(ttft) for _, ttft in run.ttft_by_arrival)


def test_a_load_step_grows_the_simulated_fleet_then_it_drains_back_losing_nothing() -> None:
    """Virtual time: 1 → 8 → 0.5 req/s. The predictive fleet grows within the step rule,
    shrinks after the hold, and every request gets exactly one answer (drained instances'
    unread queues are placed again; what they run finishes)."""
    from loadgen.simulation.autoscale import AutoscaleSettings, run_scaler
    from loadgen.simulation.config import SimulationConfig
    from loadgen.simulation.workload import annotate_sample, sample_trace

    offsets = profile_arrivals([(60.0, 1.0), (150.0, 8.0), (240.0, 0.5)], seed=2)
    sample = annotate_sample(sample_trace("synthetic", len(offsets), 2, redraw=True), 2)
    schedule = [(float(at_s), index) for index, at_s in enumerate(offsets)]
    rules = ScalingRules(min_instances=1, max_instances=6, cooldown_s=20.0, reversal_hold_s=40.0)
    settings = AutoscaleSettings(rules, initial_instances=1, startup_s=5.0, cycle_s=10.0)
    config = SimulationConfig(policy="llumnix", seed=2)
    run = run_scaler(config, sample, schedule, "predictive", settings)
    decisions = run.timeline.decisions
    ups = [d for d in decisions if d.direction == "up"]
    downs = [d for d in decisions if d.direction == "down"]
    assert ups and downs and max(d.target for d in decisions) >= 3
    for decision in ups + downs:
        assert abs(decision.target - decision.current) <= max(1, int(0.2 * decision.current))
    assert min(d.at_s for d in downs) > max(d.at_s for d in ups if d.at_s < 200)
    assert run.timeline.stopped_at_s  # drained instances stopped
    assert run.summary["num_requests"] + run.summary["num_refused"] == len(schedule)
    assert run.summary["num_refused"] == 0
    assert all(np.isfinite(ttft) for _, ttft in run.ttft_by_arrival)  # every request answered
