"""``blockq profile``: measure one real engine's step latency and fit the engine model's
:class:`~blockq.engine_model.latency.StepLatencyModel` to it.

The sweep (:func:`design_sweep`) is a list of phases, each a small designed batch run on an
otherwise idle engine, so that every kind of step the engine model prices is measured:

* prefill: one prompt of 16 tokens up to ``max_num_batched_tokens``, computed in one step;
* long prefills: prompts of half and all of ``max_model_len``, chunked, so that chunks
  attend to a growing context (the prefill attention term);
* decode: 1 to ``max_num_seqs`` sequences at three context lengths (the KV term);
* mixed: decode batches that a prefill chunk joins part-way.

Every step vLLM runs is recorded with the batch the engine model would price
(:mod:`loadgen.fidelity.vllm_engine`) and its wall time. The fit is one non-negative least
squares over the linear-layer table (a value per knot, interpolated), seconds per KV token
and per prefill attention pair; rows are weighted by 1 / duration, so a 10 ms decode step
counts as much as a 170 ms prefill. Every step counts, slow ones included: the engine model
must price the engine's time on average, pauses and all.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.optimize import nnls

from blockq.engine_model.config import EngineConfig
from blockq.engine_model.latency import StepLatencyModel
from blockq.engine_model.measured_profile import MeasuredProfile
from loadgen.fidelity.replay_loop import ReplayRequest, StepRecord
from loadgen.traces.base import row_token_ids

MIN_KNOT_WEIGHT = 3.0
DECODE_STEPS = 24
_KNOT_CANDIDATES = (*range(1, 17), 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
                    1536, 2048, 3072, 4096, 6144, 8192)
_STEP_KINDS = ("prefill", "decode", "mixed")


class _Sweep:
    """Builds the phases; every prompt has token ids of its own (no prefix-cache hits)."""

    def __init__(self) -> None:
        self.requests: list[ReplayRequest] = []
        self.phase = 0

    def add_phase(self, batch: Sequence[tuple[int, int, int]]) -> None:
        """One phase of (prompt tokens, output tokens, arrival step) requests."""
        for prompt_tokens, max_tokens, arrival_step in batch:
            index = len(self.requests)
            self.requests.append(ReplayRequest(
                f"profile-{index}", row_token_ids(index, prompt_tokens, seed=7919), max_tokens,
                arrival_step=arrival_step, phase=self.phase))
        self.phase += 1


def design_sweep(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 repeats: int = 2) -> list[ReplayRequest]:
    """The profile's phases for an engine with these limits (see the module docstring)."""
    budget, sweep = max_num_batched_tokens, _Sweep()
    prefill_sizes = sorted({n for n in (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
                            if n < budget} | {budget})
    for _ in range(repeats):
        for num_tokens in prefill_sizes:
            sweep.add_phase([(min(num_tokens, max_model_len - 1), 1, 0)])
    for prompt_tokens in (max_model_len // 2, max_model_len - 1):
        sweep.add_phase([(prompt_tokens, 1, 0)])
    # Every batch size up to 16 (a CPU's matmul kernels are not monotone in the rows: 4
    # sequences can decode faster than 2), then powers of two; the longest context only at
    # the powers of two, as its prefills dominate the sweep's time.
    batch_sizes = sorted({b for b in (*range(1, 17), 32, 64, 128, 256) if b < max_num_seqs}
                         | {max_num_seqs})
    for context in (32, max_model_len // 4):
        for batch_size in batch_sizes:
            sweep.add_phase([(context, DECODE_STEPS, 0)] * batch_size)
    for batch_size in (b for b in batch_sizes if b & (b - 1) == 0 or b == max_num_seqs):
        sweep.add_phase([(max_model_len // 2 - DECODE_STEPS, DECODE_STEPS, 0)] * batch_size)
    for batch_size in sorted({1, max(1, max_num_seqs // 2), max_num_seqs}):
        joiners = [n for n in (32, budget // 4, budget // 2, budget - batch_size) if n >= 1]
        decoders = [(context, 8 * (len(joiners) + 1), 0) for context in (32, max_model_len // 4)
                    for _ in range(max(1, batch_size // 2))][:batch_size]
        sweep.add_phase(decoders + [(n, 1, 4 + 6 * k) for k, n in enumerate(joiners)])
    return sweep.requests


def step_kind(step: StepRecord) -> str:
    if step.num_prefill_tokens and step.num_decode_seqs:
        return "mixed"
    return "prefill" if step.num_prefill_tokens else "decode"


def choose_knots(max_num_batched_tokens: int) -> tuple[int, ...]:
    return tuple(sorted({k for k in _KNOT_CANDIDATES if k < max_num_batched_tokens}
                        | {max_num_batched_tokens}))


def _design_matrix(steps: Sequence[StepRecord], knots: Sequence[int]) -> np.ndarray:
    """Rows [hat weights of the step's tokens over the knots..., KV tokens, pairs]: a step's
    modelled seconds are this row times [knot values..., kv_token_s, prefill_pair_s]."""
    knot_array = np.asarray(knots, dtype=float)
    rows = np.zeros((len(steps), len(knots) + 2))
    for row, step in enumerate(steps):
        tokens = float(step.num_prefill_tokens + step.num_decode_seqs)
        position = int(np.clip(np.searchsorted(knot_array, tokens) - 1, 0, max(len(knots) - 2, 0)))
        if len(knots) == 1 or tokens <= knot_array[0]:
            rows[row, 0] = 1.0
        else:
            low, high = knot_array[position], knot_array[position + 1]
            upper = (tokens - low) / (high - low)
            rows[row, position], rows[row, position + 1] = 1.0 - upper, upper
        rows[row, -2] = step.num_kv_tokens_attended
        rows[row, -1] = step.num_prefill_attention_pairs
    return rows


def _supported_knots(steps: Sequence[StepRecord], knots: tuple[int, ...]) -> tuple[int, ...]:
    """The knots the steps pin down: a knot that less than ``MIN_KNOT_WEIGHT`` steps' worth
    of interpolation weight falls on would be fitted to nothing (zero); it goes."""
    while len(knots) > 2:
        support = _design_matrix(steps, knots)[:, :-2].sum(axis=0)
        weakest = int(np.argmin(support[:-1]))  # the last knot (the budget) always stays
        if support[weakest] >= MIN_KNOT_WEIGHT:
            break
        knots = knots[:weakest] + knots[weakest + 1:]
    return knots


def fit_latency_model(steps: Sequence[StepRecord], max_num_batched_tokens: int
                      ) -> tuple[StepLatencyModel, dict[str, Any]]:
    """The fitted model and its error per step kind (see the module docstring).

    Raises:
        ValueError: with fewer steps than coefficients.
    """
    usable = [s for s in steps if s.duration_s > 0]
    knots = _supported_knots(usable, choose_knots(max_num_batched_tokens))
    if len(usable) < len(knots) + 2:
        raise ValueError(f"steps: {len(usable)} measured, the fit needs at least {len(knots) + 2}")
    design = _design_matrix(usable, knots)
    durations_s = np.array([s.duration_s for s in usable])
    weights = 1.0 / durations_s
    # Columns scaled to unit RMS, so that seconds per pair and seconds per knot coexist.
    scale = np.sqrt(np.mean(design**2, axis=0))
    scale[scale == 0.0] = 1.0
    scaled, _ = nnls(design / scale * weights[:, None], durations_s * weights,
                     maxiter=50 * design.shape[1])
    coefficients = scaled / scale
    model = StepLatencyModel(linear_knot_tokens=knots,
                             linear_knot_s=tuple(float(v) for v in coefficients[:-2]),
                             kv_token_s=float(coefficients[-2]),
                             prefill_pair_s=float(coefficients[-1]), step_overhead_s=0.0)
    return model, fit_report(model, usable)


def step_errors(model: StepLatencyModel, steps: Sequence[StepRecord]) -> np.ndarray:
    """|modelled / measured - 1| of each step with a positive duration."""
    return np.abs([model.step_seconds(s.num_prefill_tokens, s.num_decode_seqs, s.num_kv_tokens_attended,
                                      s.num_prefill_attention_pairs) / s.duration_s - 1.0
                   for s in steps if s.duration_s > 0])


def fit_report(model: StepLatencyModel, steps: Sequence[StepRecord]) -> dict[str, Any]:
    """|modelled / measured - 1| per step kind: median, P90 and max, and the step count."""
    report: dict[str, Any] = {"num_steps": len(steps)}
    for kind in ("all", *_STEP_KINDS):
        chosen = [s for s in steps if kind == "all" or step_kind(s) == kind]
        if not chosen:
            continue
        errors = step_errors(model, chosen)
        report[kind] = {"num_steps": len(chosen), "rel_error_p50": round(float(np.median(errors)), 4),
                        "rel_error_p90": round(float(np.quantile(errors, 0.9)), 4),
                        "rel_error_max": round(float(errors.max()), 4)}
    return report


def open_engine(args: argparse.Namespace, enable_prefix_caching: bool | None = None) -> Any:
    """A :class:`~loadgen.fidelity.engine_process.VllmEngineProcess` for the command's
    engine options, on ``--engine-core``."""
    from loadgen.fidelity.engine_process import VllmEngineProcess, default_engine_core
    from workers.engines.vllm_options import VllmEngineOptions

    options = VllmEngineOptions.from_args(args, enable_prefix_caching=enable_prefix_caching)
    core = args.engine_core if args.engine_core is not None else default_engine_core()
    return VllmEngineProcess(options.engine_args(), core=core, vllm_python=args.vllm_python)


def run_sweep(engine: Any) -> list[StepRecord]:
    """The sweep's steps on ``engine`` (a VllmEngineProcess)."""
    config = EngineConfig.from_dict(engine.engine_config)
    return engine.replay(design_sweep(config.max_num_seqs, config.max_num_batched_tokens,
                                      config.max_model_len)).steps


def fit_profile(engine: Any, model: str, steps: Sequence[StepRecord]) -> MeasuredProfile:
    config = EngineConfig.from_dict(engine.engine_config)
    model_fit, report = fit_latency_model(steps, config.max_num_batched_tokens)
    return MeasuredProfile(model_fit, config, model, report)


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    from workers.engines.vllm_options import add_vllm_engine_arguments

    parser.add_argument("--engine", choices=["vllm"], default="vllm", help="the engine to profile")
    parser.add_argument("--model", required=True, help="the model directory vLLM serves")
    parser.add_argument("--out", default=None, help="write the profile here (PROFILE.json)")
    parser.add_argument("--json", action="store_true", help="print the fit report as JSON")
    add_engine_process_arguments(parser)
    add_vllm_engine_arguments(parser, for_one_engine=True)


def add_engine_process_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-core", type=int, default=None,
                        help="the core the engine runs on (default: the last one)")
    parser.add_argument("--vllm-python", default=None,
                        help="a Python that imports vLLM (default: this one, else .venv-vllm/bin/python)")


def run_profile_command(args: argparse.Namespace) -> int:
    with open_engine(args) as engine:
        profile = fit_profile(engine, str(args.model), run_sweep(engine))
    if args.out:
        profile.save(args.out)
    if args.json:
        json.dump(profile.to_dict(), sys.stdout)
        sys.stdout.write("\n")
    else:
        print(format_fit_report(profile.fit))
    return 0


def format_fit_report(report: dict[str, Any]) -> str:
    lines = [f"{report['num_steps']} steps measured; |modelled / measured - 1|:"]
    for kind in ("all", *_STEP_KINDS):
        if kind in report:
            row = report[kind]
            lines.append(f"  {kind:8s} {row['num_steps']:5d} steps  p50 {row['rel_error_p50']:.1%}  "
                         f"p90 {row['rel_error_p90']:.1%}  max {row['rel_error_max']:.1%}")
    return "\n".join(lines)
