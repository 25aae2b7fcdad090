"""The cluster simulation: the engine model's own timeline, determinism, the same
decisions as the Redis service, and ``blockq simulate`` end to end."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import redis

from blockq.config import Settings
from blockq.engine_model import EngineRequest, EngineScheduler, get_preset
from blockq.wire.beats import Heartbeat
from blockq.wire.keys import PAYLOAD_FIELD
from blockq.wire.protocol import Request, decode_request, encode
from blockq.wire.streams import connect_async
from dispatcher.core import DispatcherCore
from dispatcher.replica import DELIVERY_S
from dispatcher.service import Dispatcher
from loadgen.simulation.cluster import ClusterSimulation
from loadgen.simulation.config import SimulationConfig
from loadgen.simulation.single_run import simulate_run
from loadgen.simulation.workload import (
    annotate_sample,
    arrivals_for,
    perturb_predictions,
    sample_trace,
    submitted,
)
from tests.conftest import run_blockq


def _sample(num_requests: int, seed: int, *, redraw: bool = False, predictor: str = "heuristic"):  # noqa: ANN202
    return annotate_sample(sample_trace("synthetic", num_requests, seed, redraw=redraw), seed, predictor=predictor)


def test_one_instance_timeline_equals_stepping_the_engine_model_by_hand() -> None:
    """With one instance, no delays and no noise, every request's first token and finish
    are where stepping the reference scheduler puts them (a request that arrives during a
    step is first seen by the next one; an idle engine starts at the arrival)."""
    config = SimulationConfig(instances=1, policy="round_robin", noise_sigma=0.0, ingress_delay_ms=0.0,
                              queue_delay_ms=0.0, decision_delay_ms=0.0, heartbeat_delay_ms=0.0)
    sample = _sample(40, seed=5)
    run = simulate_run(config, sample, rate_per_s=3.0)
    preset = get_preset(config.preset)
    scheduler = EngineScheduler(preset.config, preset.latency_model)
    arrivals = sorted((config.warmup_s + offset_s, index) for offset_s, index in arrivals_for(sample, rate_per_s=3.0))
    expected: dict[str, tuple[float, float]] = {}
    first_token_at: dict[str, float] = {}
    submitted_at = {sample.requests[i].id: t for t, i in arrivals}
    pending = list(arrivals)
    while pending or scheduler.has_unfinished_requests:
        if not scheduler.has_unfinished_requests:
            scheduler.now_s = max(scheduler.now_s, pending[0][0])
        while pending and pending[0][0] <= scheduler.now_s:
            _, index = pending.pop(0)
            request, trace_request = sample.requests[index], sample.trace_requests[index]
            scheduler.add_request(EngineRequest(request.id, request.prediction.prompt_tokens,
                                                trace_request.true_output_tokens, arrival_s=scheduler.now_s))
        result = scheduler.step()
        end_s = result.started_at_s + result.duration_s
        for request_id in result.first_token_ids:
            first_token_at[request_id] = end_s
        for finished in result.finished:
            expected[finished.request_id] = (first_token_at[finished.request_id], end_s)
    assert len(expected) == 40 and len(run.records) == 40
    # Not trivial: requests ran side by side, and some first tokens waited on others' steps.
    ttfts = sorted(r.ttft_ms for r in run.records)
    assert ttfts[-1] > 3 * ttfts[0]
    assert sum(1 for r in run.records if r.e2e_ms / 1000 > 1 / 3.0) > 30
    for record in run.records:
        first_s, finish_s = expected[record.request_id]
        assert record.ttft_ms == max(0.0, (first_s - submitted_at[record.request_id]) * 1000)
        assert record.e2e_ms == max(0.0, (finish_s - submitted_at[record.request_id]) * 1000)
        assert record.ok and record.output_tokens == record.true_output_tokens


def test_runs_are_deterministic_and_seeds_draw_new_samples() -> None:
    config = SimulationConfig(instances=3, policy="block", seed=2)
    sample = _sample(120, seed=2)

    def dump() -> str:
        run = simulate_run(config, sample, rate_per_s=6.0)
        return json.dumps({"summary": run.summary, "records": [r.__dict__ for r in run.records]}, sort_keys=True)

    first = dump()
    assert first == dump()
    assert json.loads(first)["summary"]["completed"] == 120
    lengths_1 = [r.true_output_tokens for r in _sample(50, seed=1, redraw=True).trace_requests]
    lengths_2 = [r.true_output_tokens for r in _sample(50, seed=2, redraw=True).trace_requests]
    assert lengths_1 != lengths_2


async def test_the_core_decides_alike_through_redis_and_in_the_simulation(settings: Settings,
                                                                        sync_redis: redis.Redis) -> None:
    """Record what the simulated core saw (beats, batches, each with its time), feed the
    same beats and requests through Redis to the service at the same clock readings: the
    same instances and the same forecasts."""
    config = SimulationConfig(instances=3, policy="block", seed=4)
    sample = _sample(60, seed=4)
    simulation = ClusterSimulation(config)
    log: list[tuple[str, float, object]] = []
    apply_beat, place = simulation.core.apply_heartbeat, simulation.core.place

    def recording_apply(beat: Heartbeat, now_s: float) -> str | None:
        log.append(("beat", now_s, beat))
        return apply_beat(beat, now_s)

    def recording_place(requests: list[Request], now_s: float) -> list:
        outcomes = place(requests, now_s)
        log.append(("batch", now_s, (list(requests), outcomes)))
        return outcomes

    simulation.core.apply_heartbeat, simulation.core.place = recording_apply, recording_place  # type: ignore[method-assign]
    simulation.run([(t, submitted(sample.requests[i], config.warmup_s + t))
                    for t, i in arrivals_for(sample, rate_per_s=8.0)])
    clock = {"now_s": 0.0}
    client = connect_async(settings.redis_url)
    dispatcher = Dispatcher(client, settings, DispatcherCore("block", seed=4), dispatcher_id="d",
                            clock=lambda: clock["now_s"])
    await dispatcher.consumer.ensure_group()
    expected: dict[str, tuple[str, float | None]] = {}
    for kind, now_s, payload in log:
        clock["now_s"] = now_s
        if kind == "beat":
            sync_redis.xadd(settings.keys.heartbeats, {PAYLOAD_FIELD: encode(payload)})
            await dispatcher.follow_heartbeats()
            continue
        requests, outcomes = payload  # type: ignore[misc]
        for request, outcome in zip(requests, outcomes, strict=True):
            sync_redis.xadd(settings.keys.ready, {PAYLOAD_FIELD: encode(request)})
            expected[request.id] = (outcome.request.assignment.instance_id, outcome.request.assignment.predicted_ttft_ms)
        await dispatcher.place_batch(await dispatcher.consumer.read(len(requests), 10))
    got: dict[str, tuple[str, float | None]] = {}
    for instance_id in simulation.instances:
        for _, fields in sync_redis.xrange(settings.keys.instance_queue(instance_id)):
            placed = decode_request(fields[PAYLOAD_FIELD.encode()])
            got[placed.id] = (placed.assignment.instance_id, placed.assignment.predicted_ttft_ms)
    assert len(expected) == 60 and got == expected
    assert len({instance for instance, _ in got.values()}) == 3
    await client.aclose()


def test_simulate_and_simulate_capacity_print_the_documented_json(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    done = run_blockq("simulate", "--trace", "synthetic", "--instances", "2", "--policies", "round_robin,llumnix",
                      "--rates", "4", "--requests", "60", "--seeds", "1,2", "--out", str(out), "--json",
                      "--no-progress", timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert [(r["policy"], r["seed"]) for r in results] == [("round_robin", 1), ("round_robin", 2),
                                                          ("llumnix", 1), ("llumnix", 2)]
    assert all(r["completed"] == 60 and r["ttft_mean_ms"] > 0 and r["rate"] == 4 for r in results)
    assert "events/s" in done.stderr
    assert "± " in (out / "summary.md").read_text()
    assert (out / "ttft_cdf.png").read_bytes()[:4] == b"\x89PNG"
    # A noise curve: one capacity per prediction error for the policy that reads predictions,
    # one for the rule that does not, and every entry's goodput at 1.5 x round robin's capacity.
    done = run_blockq("simulate", "capacity", "--trace", "synthetic", "--instances", "1", "--policies",
                      "round_robin,block", "--rates", "0.5,8", "--requests", "80", "--seeds", "1,2",
                      "--length-mae-tokens", "0,150", "--overload-factor", "1.5", "--capacity-tolerance", "1",
                      "--out", str(tmp_path / "cap"), "--json", "--no-progress", timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    capacities = json.loads(done.stdout)
    assert [(c["policy"], c["length_mae_tokens"]) for c in capacities] == [
        ("round_robin", None), ("block", 0.0), ("block", 150.0)]
    assert all(c.keys() == {"policy", "length_mae_tokens", "capacity_rps", "capacity_rps_sd", "per_seed", "overload"}
               for c in capacities)
    assert all(0.5 <= c["capacity_rps"] < 8 and len(c["per_seed"]) == 2 for c in capacities)
    overload_rate = 1.5 * capacities[0]["capacity_rps"]
    assert all(c["overload"]["rate"] == pytest.approx(overload_rate) and 0 <= c["overload"]["goodput"] <= 1
               for c in capacities)
    assert (tmp_path / "cap" / "noise.png").read_bytes()[:4] == b"\x89PNG"
    assert "MAE tokens" in (tmp_path / "cap" / "capacity.md").read_text()


def test_simulate_calibrate_replays_each_live_run_with_its_measured_step_lag(tmp_path: Path) -> None:
    """A simulated report stands in for a live one: replayed as it is, every figure comes
    back exactly; a run whose beats said its steps ended 5 model ms late is replayed with
    that lag, and its simulated tokens come slower than the lag-free run it stands for."""
    flags = ("--trace", "synthetic", "--instances", "2", "--requests", "60", "--seed", "1", "--no-progress")
    done = run_blockq("simulate", *flags, "--policies", "round_robin,llumnix", "--rates", "4",
                      "--out", str(tmp_path / "live"), timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "live" / "results.json").read_text())
    report["results"][1]["lag_mean_ms"] = 5.0
    (tmp_path / "live.json").write_text(json.dumps(report))
    done = run_blockq("simulate", "calibrate", *flags, "--live", str(tmp_path / "live.json"), "--json", timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    exact, lagged = json.loads(done.stdout)
    assert (exact["policy"], exact["step_lag_ms"], lagged["policy"], lagged["step_lag_ms"]) == \
        ("round_robin", 0.0, "llumnix", 5.0)
    assert all(exact[f"{figure}_error"] == 0.0 for figure in ("ttft_mean_ms", "ttft_p90_ms", "tpot_mean_ms"))
    assert lagged["simulated_tpot_mean_ms"] > lagged["live_tpot_mean_ms"] + 2.0
    # Another schedule than the live run's is refused, naming the flag.
    other = [*flags[:-2], "2", "--no-progress"]
    done = run_blockq("simulate", "calibrate", *other, "--live", str(tmp_path / "live.json"), timeout_s=300)
    assert done.returncode != 0 and "--seed is 2" in done.stderr


def test_step_lag_and_ingress_delay_are_what_the_run_measures() -> None:
    """A step that ends late slows every token by the lag; the ingress delay shows up in
    the queue wait, as a spread when it has one."""
    sample = _sample(60, seed=3)
    base = SimulationConfig(instances=2, policy="least_requests", noise_sigma=0.0, seed=3)
    plain = simulate_run(base, sample, rate_per_s=2.0)
    lagged = simulate_run(SimulationConfig(instances=2, policy="least_requests", noise_sigma=0.0, seed=3,
                                           step_lag_ms=4.0), sample, rate_per_s=2.0)
    tpot_gain_ms = lagged.summary["tpot_mean_ms"] - plain.summary["tpot_mean_ms"]
    assert 3.5 < tpot_gain_ms < 4.5
    spread = simulate_run(SimulationConfig(instances=2, policy="least_requests", seed=3, ingress_delay_ms=20.0,
                                           ingress_delay_sigma=0.5), sample, rate_per_s=2.0)
    waits = sorted(r.queue_wait_ms for r in spread.records)
    fixed_waits = sorted(r.queue_wait_ms for r in plain.records)
    assert fixed_waits[-1] - fixed_waits[0] < 1.0   # constant ingress: every wait alike at this load
    assert 15 < waits[len(waits) // 2] < 30 and waits[-1] > 2 * waits[0]


def test_the_beats_measure_the_queue_hop_as_the_delivery() -> None:
    """The beats' delivery (decision to engine) is the decision plus the queue hop: under
    the replicas' 3 ms floor with the defaults, and what ``queue_delay_ms`` adds."""
    sample = _sample(60, seed=3)
    plain = simulate_run(SimulationConfig(instances=2, policy="block", seed=3), sample, rate_per_s=2.0)
    slow = simulate_run(SimulationConfig(instances=2, policy="block", seed=3, queue_delay_ms=20.0), sample,
                        rate_per_s=2.0)
    assert 0 < plain.summary["delivery_p90_mean_ms"] < 1000 * DELIVERY_S
    assert 20 < slow.summary["delivery_p90_mean_ms"] < 20 + 1000 * DELIVERY_S


def test_a_spread_ingress_delay_keeps_submit_order() -> None:
    """Requests reach the dispatcher in the order they were submitted, however their
    ingress delays are drawn: round robin then deals them out in that order."""
    sample = _sample(120, seed=4)
    run = simulate_run(SimulationConfig(instances=3, policy="round_robin", seed=4, ingress_delay_ms=20.0,
                                        ingress_delay_sigma=1.5), sample, rate_per_s=40.0)
    records = sorted(run.records, key=lambda r: r.submitted_at_s)
    order = sorted({r.instance for r in records})
    assert [r.instance for r in records] == [order[i % 3] for i in range(len(records))]


def test_perturbed_predictions_hit_the_asked_error_and_keep_the_spread_honest() -> None:
    sample = _sample(400, seed=5, predictor="oracle")
    truth = [min(r.true_output_tokens or 1, r.max_tokens) for r in sample.requests if r is not None]
    exact = [r.prediction.predicted_output_tokens for r in perturb_predictions(sample, 0).requests if r and r.prediction]
    assert exact == truth
    for mae in (50.0, 150.0):
        noisy = perturb_predictions(sample, mae)
        assert noisy == perturb_predictions(sample, mae)  # seeded by the sample
        predictions = [r.prediction for r in noisy.requests if r is not None and r.prediction is not None]
        errors = [abs(p.predicted_output_tokens - t) for p, t in zip(predictions, truth, strict=True)]
        assert sum(errors) / len(errors) == pytest.approx(mae, rel=0.03)
        assert all(p.p10_tokens <= p.predicted_output_tokens <= p.p90_tokens for p in predictions)
        assert all(p.predictor_version == f"perturbed-mae-{mae:g}" for p in predictions)
    with pytest.raises(ValueError, match="length_mae_tokens"):
        perturb_predictions(sample, -1)


def test_a_trace_smaller_than_the_run_is_drawn_with_replacement(tmp_path: Path) -> None:
    trace = tmp_path / "small.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(f"{10 + i},{20 + i}\n" for i in range(5)))
    drawn = sample_trace(str(trace), 12, 1, redraw=True)
    assert len(drawn) == 12 and len({id(r) for r in drawn}) == 12
    assert {r.prompt_tokens for r in drawn} <= {10, 11, 12, 13, 14}
    sample = annotate_sample(drawn, 1)
    assert sorted(index for _, index in arrivals_for(sample, rate_per_s=4.0)) == list(range(12))


def test_slow_instances_take_factor_times_as_long_seen_or_hidden_from_their_step_timings() -> None:
    """``slow_instances``: one instance, no noise and no delays, steps 2× as long in the
    steps (the beats' step timings show it) or after them (``slow_hidden``: they do not);
    either way every request's E2E is about 2× the nominal one's."""
    base = SimulationConfig(instances=1, policy="round_robin", noise_sigma=0.0, ingress_delay_ms=0.0,
                            queue_delay_ms=0.0, decision_delay_ms=0.0, heartbeat_delay_ms=0.0)
    sample = _sample(5, seed=2)
    runs = {name: simulate_run(config, sample, rate_per_s=0.2) for name, config in (
        ("nominal", base), ("slow", dataclasses.replace(base, slow_instances=1)),
        ("hidden", dataclasses.replace(base, slow_instances=1, slow_hidden=True)))}
    e2e = {name: [r.e2e_ms for r in run.records] for name, run in runs.items()}
    for name in ("slow", "hidden"):
        for slow_ms, nominal_ms in zip(e2e[name], e2e["nominal"], strict=True):
            assert slow_ms == pytest.approx(2 * nominal_ms, rel=0.05)
    assert runs["slow"].summary["forecast_check"]["slow_instances"] == 1
