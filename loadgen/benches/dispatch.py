"""``blockq dispatch-bench``: what a placement decision costs.

Pure mode (default, no Redis): ``--instances`` instances, each starting with ``--running``
running and ``--waiting`` waiting requests of ShareGPT-like lengths; ``--requests``
decisions on a virtual clock at ``--rate`` requests/s. Every decision's request is
recorded on the chosen instance (as the dispatcher does) and given to that instance's
engine (a reference scheduler advanced in virtual time); every 100 ms of virtual time
each engine sends a fresh heartbeat, so the replicas are rebuilt at the real rate.
Reports per-decision wall time (choosing plus recording the assignment) and, apart, the
time spent applying heartbeats (which is where replicas are rebuilt). Start-up work is
done before the clock starts, as the dispatcher does it (:func:`prepare_for_decisions`).

Redis mode (``--redis``): placements/s of a real dispatcher, in
:mod:`loadgen.benches.dispatch_redis`; it builds its requests and beats with the helpers here.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

import numpy as np

from blockq.engine_model import EngineRequest, EngineScheduler, get_preset
from blockq.wire.beats import Heartbeat, RequestProgress
from blockq.wire.health import InstanceState
from blockq.wire.keys import Keys
from blockq.wire.protocol import Prediction, Request
from dispatcher.core import DispatcherCore, Placed
from dispatcher.policies.shortlist import DEFAULT_SIMULATED_CANDIDATES, Shortlist
from dispatcher.service import prepare_for_decisions
from dispatcher.what_if import DEFAULT_OBJECTIVE
from loadgen.benches.emulated_engine import sharegpt_like_lengths

HEARTBEAT_INTERVAL_S = 0.1


def make_request(rng: random.Random, keys: Keys, submitted_at_s: float = 0.0) -> Request:
    """A request of ShareGPT-like lengths with a prediction around its true output length.
    ``submitted_at_s``: on the clock its dispatcher measures waits with (the virtual clock
    of the pure bench, which starts at 0; the wall clock through Redis)."""
    prompt_tokens, output_tokens = sharegpt_like_lengths(rng)
    request_id = uuid.uuid4().hex
    spread = rng.uniform(1.5, 3.0)
    return Request(id=request_id, prompt=tuple([1] * prompt_tokens), max_tokens=4096 - prompt_tokens,
                   reply_stream=keys.reply(request_id), submitted_at_s=submitted_at_s, true_output_tokens=output_tokens,
                   prediction=Prediction(prompt_tokens, output_tokens, max(1, int(output_tokens / spread)),
                                         int(output_tokens * spread), "bench"))


def loaded_scheduler(rng: random.Random, preset: str, num_running: int, num_waiting: int) -> EngineScheduler:
    """A scheduler with ``num_running`` requests mid-decode and ``num_waiting`` queued."""
    chosen = get_preset(preset)
    scheduler = EngineScheduler(chosen.config, chosen.latency_model)
    running = []
    for i in range(num_running):
        prompt_tokens, output_tokens = sharegpt_like_lengths(rng)
        generated = rng.randrange(0, output_tokens)
        running.append(EngineRequest(f"r{i}", prompt_tokens, output_tokens,
                                     num_computed_tokens=prompt_tokens + generated - 1 if generated else 0,
                                     num_generated_tokens=generated))
    waiting = [EngineRequest(f"w{i}", *sharegpt_like_lengths(rng)) for i in range(num_waiting)]
    scheduler.restore(running, waiting)
    return scheduler


def advance_engine(engine: EngineScheduler, until_s: float) -> None:
    """Step ``engine`` while it has work and its clock is before ``until_s`` (the last step
    may end after it); when it runs out of work first, move its clock forward to ``until_s``."""
    while engine.now_s < until_s and engine.step() is not None:
        pass
    engine.now_s = max(engine.now_s, until_s)


def heartbeat_of(instance_id: str, scheduler: EngineScheduler, seq: int, sent_at_s: float,
                 preset: str, finished_ids: tuple[str, ...] = (),
                 engine_model: tuple[dict[str, Any], dict[str, Any]] | None = None) -> Heartbeat:
    """``scheduler``'s beat; ``engine_model``: its engine config and latency model as
    dicts, when the caller keeps them (the previous beat's, as a fleet's beat decoder
    gives a reader while they do not change: blockq.wire.beats.HeartbeatDecoder)."""
    engine_config, latency_model = engine_model or (scheduler.config.to_dict(), scheduler.latency_model.to_dict())

    def progress(request: EngineRequest) -> RequestProgress:
        return RequestProgress(request.request_id, request.prompt_tokens, request.num_computed_tokens,
                               request.num_generated_tokens, request.output_target_tokens,
                               request.output_target_tokens * 2)

    return Heartbeat(instance_id=instance_id, state=InstanceState.LIVE, seq=seq, sent_at_s=sent_at_s,
                     engine_time_s=scheduler.now_s, model="emulated", preset=preset,
                     engine_config=engine_config, latency_model=latency_model,
                     num_used_blocks=scheduler.num_used_blocks,
                     running=tuple(progress(r) for r in scheduler.running),
                     waiting=tuple(progress(r) for r in scheduler.waiting),
                     num_running_total=len(scheduler.running), num_waiting_total=len(scheduler.waiting),
                     finished_ids=finished_ids)


def simulated_size(core: DispatcherCore, num_instances: int) -> int | None:
    """How many candidates ``core``'s policy simulates a decision on ``num_instances``
    (0: every one; None: a policy that simulates none, or no shortlist)."""
    shortlist: Shortlist | None = getattr(core.policy, "shortlist", None)
    return None if shortlist is None else shortlist.size_for(num_instances)


def bench_decisions(*, policy: str = "block", instances: int = 16, running: int = 48, waiting: int = 20,
                    requests: int = 10_000, rate_per_s: float = 32.0, preset: str = "llama2-7b-a30",
                    seed: int = 0, objective: str | None = None,
                    simulated_candidates: int | None = DEFAULT_SIMULATED_CANDIDATES) -> dict[str, Any]:
    """Per-decision wall time of ``policy`` on one core, no Redis; ``simulated_candidates``:
    the shortlist's size (0: every instance is simulated; None: by the fleet's size)."""
    rng = random.Random(seed)
    keys = Keys()
    core = DispatcherCore(policy, seed=seed, objective=objective or DEFAULT_OBJECTIVE,
                          num_simulated_candidates=simulated_candidates)
    # The "real" instances the beats come from: advanced in virtual time with what they get.
    engines = {f"i{k}": loaded_scheduler(rng, preset, running, waiting) for k in range(instances)}
    # Each instance's engine model as the dispatcher's beat decoder passes it on, beat after beat.
    engine_models = {instance_id: (engine.config.to_dict(), engine.latency_model.to_dict())
                     for instance_id, engine in engines.items()}
    seq = 1
    for instance_id, engine in engines.items():
        core.apply_heartbeat(heartbeat_of(instance_id, engine, seq, 0.0, preset,
                                          engine_model=engine_models[instance_id]), 0.0)
    prepare_for_decisions(core)
    next_beat_s = HEARTBEAT_INTERVAL_S
    decision_s: list[float] = []
    beat_s: list[float] = []
    for index in range(requests):
        now_s = index / rate_per_s
        if now_s >= next_beat_s:
            seq += 1
            for instance_id, engine in engines.items():
                advance_engine(engine, now_s)
                beat = heartbeat_of(instance_id, engine, seq, now_s, preset, engine_model=engine_models[instance_id])
                started = time.perf_counter()
                core.apply_heartbeat(beat, now_s)
                beat_s.append(time.perf_counter() - started)
            next_beat_s += HEARTBEAT_INTERVAL_S
        request = make_request(rng, keys)
        started = time.perf_counter()
        (outcome,) = core.place([request], now_s)
        decision_s.append(time.perf_counter() - started)
        if not isinstance(outcome, Placed) or outcome.request.assignment is None:
            raise RuntimeError(f"dispatch-bench: {policy} did not place a request ({outcome})")
        engine = engines[outcome.request.assignment.instance_id]
        engine.add_request(EngineRequest(request.id, request.prediction.prompt_tokens,  # type: ignore[union-attr]
                                         request.true_output_tokens or 1, arrival_s=engine.now_s))
    times_ms = np.array(decision_s) * 1000
    beat_ms = np.array(beat_s or [0.0]) * 1000
    return {"policy": policy, "instances": instances, "running": running, "waiting": waiting,
            "requests": requests, "rate_per_s": rate_per_s, "simulated_candidates": simulated_size(core, instances),
            "replica_rebuilds": core.view.num_replica_rebuilds,
            "p50_ms": float(np.percentile(times_ms, 50)), "p99_ms": float(np.percentile(times_ms, 99)),
            "max_ms": float(times_ms.max()), "mean_ms": float(times_ms.mean()),
            "decisions_per_s": float(len(times_ms) / (times_ms.sum() / 1000)),
            # Applying one instance's beat (with its replica's rebuild):
            # work on the heartbeat path, between decisions.
            "heartbeat_p50_ms": float(np.percentile(beat_ms, 50)),
            "heartbeat_p99_ms": float(np.percentile(beat_ms, 99)),
            "heartbeat_ms_per_s": float(beat_ms.sum() / max(requests / rate_per_s, 1e-9))}
