"""What the engine model costs on the dispatcher's hot path (wall-clock timings, one core).

``python -m loadgen.benches.engine_model [--json]`` measures, on the A30 preset with a
loaded instance (48 running requests mid-decode and 20 waiting, ShareGPT-like lengths):

* ``step_us_p50`` / ``step_us_p99``: one plain :meth:`EngineScheduler.step`;
* ``clone_us_p50``: one :meth:`EngineScheduler.clone`;
* ``stepping_to_finish_ms_p50``: clone, add one new request, and :meth:`step` until
  every request finishes; ``stepped_steps_per_s``: the steps so run per second;
* ``packed_clone_us_p50``, ``packed_simulate_to_finish_us_p50`` / ``_p99``: the same
  clone and run to the end on the dispatcher's compiled twin
  (:class:`~blockq.engine_model.packed.PackedScheduler`), and
  ``packed_what_if_us_p50`` / ``_p99``: one :meth:`PackedScheduler.what_if` call (copy,
  append, run to the end, compare with a baseline) from the state's queue-drain snapshot.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from typing import Any

import numpy as np

from blockq.engine_model.packed import PackedScheduler, warm_up
from blockq.engine_model.packed_layout import FINISHED
from blockq.engine_model.presets import get_preset
from blockq.engine_model.request import EngineRequest
from blockq.engine_model.scheduler import EngineScheduler

NEW_REQUEST_ID = "new"


def sharegpt_like_request(rng: random.Random, request_id: str) -> EngineRequest:
    """Prompt lognormal around 35 tokens (cap 2,048), output around 250 (cap 1,024)."""
    prompt_tokens = min(2048, max(1, round(rng.lognormvariate(math.log(35.0), 1.0))))
    output_tokens = min(1024, max(1, round(rng.lognormvariate(math.log(250.0), 0.8))))
    return EngineRequest(request_id, prompt_tokens, output_tokens)


def build_loaded_scheduler(rng: random.Random, preset: str = "llama2-7b-a30",
                           num_running: int = 48, num_waiting: int = 20) -> EngineScheduler:
    """An instance as a heartbeat would show it: running requests part-way through their
    output (KV computed up to the last token), then a FCFS queue, via :meth:`restore`."""
    engine = get_preset(preset)
    scheduler = EngineScheduler(engine.config, engine.latency_model)
    running = []
    for index in range(num_running):
        request = sharegpt_like_request(rng, f"run{index}")
        request.num_generated_tokens = rng.randint(1, max(1, request.output_target_tokens - 1))
        if request.num_generated_tokens >= request.output_target_tokens:
            request.output_target_tokens += 1
        request.num_computed_tokens = request.num_tokens - 1
        running.append(request)
    waiting = [sharegpt_like_request(rng, f"wait{index}") for index in range(num_waiting)]
    scheduler.restore(running, waiting)
    return scheduler


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


def _time_steps(states: list[EngineScheduler], num_steps: int) -> list[float]:
    """Seconds of each of the first ``num_steps`` plain steps from each state (on clones)."""
    durations_s = []
    for state in states:
        scheduler = state.clone()
        for _ in range(num_steps):
            started = time.perf_counter()
            scheduler.step()
            durations_s.append(time.perf_counter() - started)
    return durations_s


def _time_stepping_to_end(states: list[EngineScheduler], rng: random.Random) -> tuple[list[float], int]:
    """Seconds to clone each state, add a new request and step until everything finishes;
    and the steps run in all."""
    durations_s = []
    num_steps = 0
    for state in states:
        new_request = sharegpt_like_request(rng, NEW_REQUEST_ID)
        started = time.perf_counter()
        scheduler = state.clone()
        scheduler.add_request(new_request)
        while scheduler.step() is not None:
            num_steps += 1
        durations_s.append(time.perf_counter() - started)
    return durations_s, num_steps


def _time_clones(states: list[EngineScheduler], num_repeats: int) -> list[float]:
    durations_s = []
    for _ in range(num_repeats):
        for state in states:
            started = time.perf_counter()
            state.clone()
            durations_s.append(time.perf_counter() - started)
    return durations_s


def bench_packed(num_states: int = 40, num_repeats: int = 5, seed: int = 0, preset: str = "llama2-7b-a30",
                 num_running: int = 48, num_waiting: int = 20) -> dict[str, float]:
    """The ``packed_*`` figures (see the module docstring), on the same kind of states."""
    rng = random.Random(seed)
    states = [build_loaded_scheduler(rng, preset, num_running, num_waiting) for _ in range(num_states)]
    return _time_packed(states, rng, num_repeats)


def _time_packed(states: list[EngineScheduler], rng: random.Random, num_repeats: int) -> dict[str, float]:
    """Clone / clone-add-simulate / what-if timings on the packed twin, in microseconds."""
    warm_up()
    packed_states = [PackedScheduler.from_scheduler(state) for state in states]
    clone_s: list[float] = []
    to_finish_s: list[float] = []
    what_if_s: list[float] = []
    for _ in range(num_repeats):
        for packed in packed_states:
            new_request = sharegpt_like_request(rng, NEW_REQUEST_ID)
            started = time.perf_counter()
            scheduler = packed.clone()
            clone_s.append(time.perf_counter() - started)
            scheduler.add_request(NEW_REQUEST_ID, new_request.prompt_tokens, new_request.output_target_tokens)
            scheduler.simulate()
            to_finish_s.append(time.perf_counter() - started)
    for packed in packed_states:
        snapshot = packed.queue_drain_snapshot()
        future = snapshot.clone()
        future.simulate()
        baseline_finished_at_s = future.times[:, FINISHED].copy()
        for _ in range(num_repeats):
            new_request = sharegpt_like_request(rng, NEW_REQUEST_ID)
            started = time.perf_counter()
            snapshot.what_if(new_request.prompt_tokens, new_request.output_target_tokens, packed.now_s,
                             baseline_finished_at_s)
            what_if_s.append(time.perf_counter() - started)
    return {"packed_clone_us_p50": _percentile(clone_s, 50) * 1e6,
            "packed_simulate_to_finish_us_p50": _percentile(to_finish_s, 50) * 1e6,
            "packed_simulate_to_finish_us_p99": _percentile(to_finish_s, 99) * 1e6,
            "packed_what_if_us_p50": _percentile(what_if_s, 50) * 1e6,
            "packed_what_if_us_p99": _percentile(what_if_s, 99) * 1e6}


def bench_engine_model(num_states: int = 40, num_repeats: int = 5, num_steps_per_state: int = 50,
                       seed: int = 0, preset: str = "llama2-7b-a30", num_running: int = 48,
                       num_waiting: int = 20) -> dict[str, Any]:
    """Time the engine model on ``num_states`` random loaded instances (see the module
    docstring for the keys); times in the units their names say."""
    rng = random.Random(seed)
    states = [build_loaded_scheduler(rng, preset, num_running, num_waiting)
              for _ in range(num_states)]
    _time_stepping_to_end(states, rng)  # warm-up, not reported
    step_s = _time_steps(states, num_steps_per_state)
    clone_s = _time_clones(states, num_repeats * 10)
    stepping_s, num_stepped = _time_stepping_to_end(states, rng)
    return {
        "preset": preset, "num_running": num_running, "num_waiting": num_waiting,
        "num_states": num_states,
        "step_us_p50": _percentile(step_s, 50) * 1e6,
        "step_us_p99": _percentile(step_s, 99) * 1e6,
        "clone_us_p50": _percentile(clone_s, 50) * 1e6,
        "stepping_to_finish_ms_p50": _percentile(stepping_s, 50) * 1e3,
        "stepped_steps_per_s": num_stepped / sum(stepping_s),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadgen.benches.engine_model",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--states", type=int, default=40, help="random loaded instances (count)")
    parser.add_argument("--repeats", type=int, default=5, help="timed simulations per instance")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the instances")
    parser.add_argument("--preset", default="llama2-7b-a30", help="engine preset name")
    args = parser.parse_args(argv)
    figures: dict[str, Any] = bench_engine_model(args.states, args.repeats, seed=args.seed, preset=args.preset)
    figures.update(bench_packed(args.states, args.repeats, seed=args.seed, preset=args.preset))
    if args.json:
        print(json.dumps(figures, indent=1))
        return
    for key, value in figures.items():
        print(f"{key:32} {value:.3f}" if isinstance(value, float) else f"{key:32} {value}")


if __name__ == "__main__":
    main()
