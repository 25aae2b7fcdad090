"""``blockq bench``: the same requests at the same times against a fresh cluster per
(policy, rate, seed), then one table.

Each run starts its own cluster (`blockq up --detach` in a private state directory, with
its own embedded Redis), replays, and tears it down, so no run inherits another's queues
or warm state. The engines are emulated, or real vLLM engines (``engine="vllm"``: the
``engine_flags`` go to ``blockq up`` as they are, e.g. ``--model DIR --pin-cores``, and a
``preset`` that is a PROFILE.json is the latency model the instances publish). With
several ``seeds`` each seed draws its own sample and arrivals, as in ``blockq simulate``.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog

from blockq.cells import CellSpec, numbered_cell_prefix
from blockq.client import AsyncClient
from blockq.config import DEFAULT_REFINE_EVERY_TOKENS, Settings
from blockq.engine_model import get_preset
from blockq.engine_model.fleet_spec import FleetSpec
from blockq.local.state import ClusterState
from loadgen.arrivals import DEFAULT_THINK_TIME_S, build_schedule
from loadgen.plots import run_key
from loadgen.replay import ReplayOptions, ReplayResult, replay
from loadgen.simulation.workload import sample_trace
from loadgen.summaries import KvSample, RequestRecord, summarize
from loadgen.traces import TraceRequest

log = structlog.get_logger(__name__)

UP_MARGIN_S = 180.0  # beyond `up`'s own ready wait: its start, and a teardown on failure


@dataclass(frozen=True)
class BenchConfig:
    trace: str = "synthetic"
    instances: int = 12
    instances_per_process: int = 6
    cells: int = 1  # the instances split into this many cells behind one front (blockq.cells)
    preset: str = "llama2-7b-a30"
    fleet: FleetSpec | None = None  # a mixed fleet (emulated engines): replaces instances and preset
    policies: tuple[str, ...] = ("round_robin", "llumnix", "block", "oracle")
    rates: tuple[float, ...] = (20.0, 24.0, 28.0, 32.0)
    requests: int = 2000
    seed: int = 1
    seeds: tuple[int, ...] = ()  # empty: (seed,)
    engine: str = "emulated"
    engine_flags: tuple[str, ...] = ()  # more `blockq up` flags for the engine (vLLM's options)
    max_model_len: int | None = None  # the engines' (None: the preset's); longer prompts are not sampled
    burstiness: float = 1.0
    use_trace_times: bool = False
    multi_turn: bool = False
    prefix_caching: bool = False
    think_time_s: float = DEFAULT_THINK_TIME_S
    time_scale: float = 1.0
    predictor: str = "heuristic"
    predictor_model: str | None = None
    refine_model: str | None = None
    refine_every_tokens: int = DEFAULT_REFINE_EVERY_TOKENS
    objective: str | None = None
    slo_ttft_ms: float = 3000.0
    lag_bound_ms: float = 50.0
    out_dir: Path = field(default_factory=lambda: Path("out/bench"))

    def __post_init__(self) -> None:
        if not self.policies:
            raise ValueError("policies: give at least one")
        if any(rate <= 0 for rate in self.rates):
            raise ValueError("rates: must be > 0 requests/s")
        if self.requests < 1:
            raise ValueError("requests: must be >= 1")
        if not self.think_time_s >= 0:
            raise ValueError("think_time_s: must be >= 0 seconds")
        if self.engine not in ("emulated", "vllm", "vllm-http"):
            raise ValueError(f"engine: must be emulated, vllm or vllm-http (got {self.engine!r})")
        if self.fleet is not None and (self.engine != "emulated" or self.fleet.num_instances != self.instances):
            raise ValueError("fleet: emulated engines, instances the fleet's size")
        if self.fleet is not None:
            self.fleet.split(self.cells)  # ValueError naming cells when a cell would be empty

    @property
    def all_seeds(self) -> tuple[int, ...]:
        return self.seeds or (self.seed,)

    @property
    def ready_timeout_s(self) -> float:
        """How long `up` may take: its own ready wait (vLLM engines load and compile their
        model first), and a margin for starting and stopping."""
        from blockq.local.up import READY_TIMEOUT_S, VLLM_READY_TIMEOUT_S

        return (VLLM_READY_TIMEOUT_S if self.engine == "vllm" else READY_TIMEOUT_S) + UP_MARGIN_S


@dataclass
class RunOutput:
    summary: dict[str, Any]
    records: list[RequestRecord]
    kv_samples: list[KvSample]


def up_detached(state_dir: Path, flags: list[str], env: dict[str, str] | None = None,
                timeout_s: float = 300) -> dict[str, Any]:
    """``blockq up --detach`` of a private cluster in ``state_dir`` (embedded Redis, quiet
    logs, ``env`` added); returns its ready report."""
    argv = [sys.executable, "-m", "blockq.cli", "up", "--detach", "--json", "--state-dir", str(state_dir), *flags]
    env = {**os.environ, "BLOCKQ_REDIS_URL": "", "BLOCKQ_LOG_LEVEL": "warning", **(env or {})}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"cluster did not start: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


def start_cluster(config: BenchConfig, policy: str, state_dir: Path) -> dict[str, Any]:
    flags = ["--instances", str(config.instances), "--cells", str(config.cells), "--policy", policy,
             "--predictor", config.predictor,
             "--seed", str(config.seed), "--engine", config.engine, *config.engine_flags]
    if config.engine == "emulated":
        flags += ["--instances-per-process", str(config.instances_per_process), "--preset", config.preset,
                  "--time-scale", str(config.time_scale)]
        flags += ["--fleet", str(config.fleet)] if config.fleet is not None else []
    elif config.preset.endswith(".json"):  # a measured profile: the latency model the instances publish
        flags += ["--preset", config.preset]
    if config.predictor_model:
        flags += ["--predictor-model", config.predictor_model]
    if config.objective:
        flags += ["--objective", config.objective]
    if config.refine_model:
        flags += ["--refine-model", config.refine_model, "--refine-every-tokens", str(config.refine_every_tokens)]
    if config.prefix_caching:
        flags.append("--prefix-caching")
    return up_detached(state_dir, flags, timeout_s=config.ready_timeout_s)


def stop_cluster(state_dir: Path) -> None:
    subprocess.run([sys.executable, "-m", "blockq.cli", "down", "--state-dir", str(state_dir)],
                   capture_output=True, text=True, timeout=120)


def run_one(config: BenchConfig, policy: str, rate: float, requests: list[TraceRequest],
            on_progress: Callable[[int, int], None] | None = None) -> RunOutput:
    """One fresh cluster, one replay at ``rate`` (model-time requests/s), one summary."""
    schedule = build_schedule(requests, rate_per_s=rate, burstiness=config.burstiness, seed=config.seed,
                              use_trace_times=config.use_trace_times, think_time_s=config.think_time_s)
    with tempfile.TemporaryDirectory(prefix="blockq-bench-") as tmp:
        state_dir = Path(tmp)
        start_cluster(config, policy, state_dir)
        try:
            state = ClusterState.read(state_dir)
            if state is None:
                raise RuntimeError(f"cluster for {policy} left no state in {state_dir}")
            result = asyncio.run(_replay(state.redis_url, schedule, config, on_progress))
        finally:
            stop_cluster(state_dir)
    summary = summarize(result.records, duration_s=result.duration_s, kv_samples=result.kv_samples,
                        lag_samples_ms=result.lag_samples_ms,
                        lag_mean_samples_ms=result.lag_mean_samples_ms,
                        delivery_samples_ms=result.delivery_samples_ms, slo_ttft_ms=config.slo_ttft_ms,
                        lag_bound_ms=config.lag_bound_ms)
    preset = str(config.fleet) if config.fleet is not None else config.preset
    summary.update(policy=policy, rate=rate, instances=config.instances, preset=preset, engine=config.engine,
                   predictor=config.predictor, time_scale=config.time_scale,
                   trace=config.trace, seed=config.seed)
    if config.cells > 1:
        summary.update(cells=config.cells, cells_served=_served_per_cell(result.records, config))
    return RunOutput(summary, result.records, result.kv_samples)


def _served_per_cell(records: list[RequestRecord], config: BenchConfig) -> dict[str, int]:
    """Requests each cell's instances served (``blockq up --cells`` numbers instances
    ``inst-K`` cell by cell: an even split, or a fleet's by
    :meth:`~blockq.engine_model.fleet_spec.FleetSpec.split`); unserved requests under ``none``."""
    if config.fleet is not None:
        sizes = [fleet.num_instances for fleet in config.fleet.split(config.cells)]
    else:
        sizes = [config.instances // config.cells] * config.cells
    ends = list(itertools.accumulate(sizes))  # one past each cell's last instance index
    counts = {f"cell{cell}": 0 for cell in range(config.cells)} | {"none": 0}
    for record in records:
        index = record.instance.rpartition("-")[2] if record.instance else ""
        cell = bisect.bisect_right(ends, int(index)) if index.isdigit() else len(ends)
        counts[f"cell{cell}" if cell < len(ends) else "none"] += 1
    return counts


async def _replay(redis_url: str, schedule: list[tuple[float, TraceRequest]], config: BenchConfig,
                  on_progress: Callable[[int, int], None] | None) -> ReplayResult:
    cells = tuple(CellSpec(numbered_cell_prefix(cell)) for cell in range(config.cells)) if config.cells > 1 else ()
    async with AsyncClient(settings=Settings(redis_url=redis_url, cells=cells)) as client:
        return await replay(client, schedule, ReplayOptions(time_scale=config.time_scale), on_progress)


def load_requests(config: BenchConfig) -> list[TraceRequest]:
    """The run's requests: the trace's first ``requests``, or with ``seeds`` a sample drawn
    with each seed, the very sample ``blockq simulate --seeds`` draws (a long-context
    preset keeps long prompts: the trace's length policy is the engines')."""
    max_model_len = config.max_model_len or (config.fleet.min_max_model_len if config.fleet is not None
                                             else get_preset(config.preset).config.max_model_len)
    requests = sample_trace(config.trace, config.requests, config.seed, redraw=bool(config.seeds),
                            multi_turn=config.multi_turn, max_model_len=max_model_len)
    if len(requests) < config.requests:
        log.warning("trace_shorter_than_requested", trace=config.trace, available=len(requests),
                    requested=config.requests)
    return requests


def run_bench(config: BenchConfig, on_progress: Callable[[str, int, int], None] | None = None
              ) -> tuple[list[dict[str, Any]], dict[str, list[RequestRecord]], dict[str, list[KvSample]]]:
    """Every (policy, rate, seed) run; returns summaries and, per run key, the first
    seed's records and KV samples (what the plots show)."""
    seed_to_requests = {seed: load_requests(replace(config, seed=seed)) for seed in config.all_seeds}
    results: list[dict[str, Any]] = []
    per_request: dict[str, list[RequestRecord]] = {}
    kv_samples: dict[str, list[KvSample]] = {}
    for rate in config.rates:
        for policy in config.policies:
            key = run_key(policy, rate)
            for seed, requests in seed_to_requests.items():
                def progress(done: int, total: int, label: str = f"{key}/seed{seed}") -> None:
                    if on_progress:
                        on_progress(label, done, total)

                output = run_one(replace(config, seed=seed), policy, rate, requests, progress)
                results.append(output.summary)
                if seed == config.all_seeds[0]:
                    per_request[key] = output.records
                    kv_samples[key] = output.kv_samples
    return results, per_request, kv_samples
