"""What a ``blockq simulate`` command runs: the annotated samples by seed (and by
prediction error, for noise curves), each cluster's configuration, and the progress bar."""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from blockq.engine_model import get_preset
from blockq.forecast_check import forecast_check_options_from_args
from dispatcher.policies import policy_spec
from dispatcher.what_if import DEFAULT_OBJECTIVE
from loadgen.progress import ProgressBar
from loadgen.simulation.config import SimulationConfig
from loadgen.simulation.served import served_models_from_args
from loadgen.simulation.single_run import SimulatedRun, simulate_run
from loadgen.simulation.workload import (
    AnnotatedSample,
    annotate_sample,
    perturb_predictions,
    sample_trace,
)


class Progress:
    """A bar over every request of every run on stderr (periodic lines when stderr is not a
    terminal: :mod:`loadgen.progress`), and the events counted."""

    def __init__(self, total_requests: int, enabled: bool) -> None:
        self.bar = ProgressBar(total_requests, unit="req", enabled=enabled)
        self.num_events = 0
        self.num_runs = 0
        self.simulating_s = 0.0  # wall time inside the simulations (not loading, predicting, reports)
        self._done_in_run = 0

    def add_run(self, num_events: int, wall_s: float) -> None:
        self.num_events += num_events
        self.num_runs += 1
        self.simulating_s += wall_s

    def callback(self, label: str) -> Callable[[int, int], None]:
        self.bar.set_description(label)
        self._done_in_run = 0

        def advance(done: int, total: int) -> None:
            self.bar.update(done - self._done_in_run)
            self._done_in_run = done

        return advance

    def close(self) -> None:
        self.bar.close()


@dataclass
class Plan:
    """What to run: the samples by seed and how to configure each cluster. Samples with
    perturbed predictions (``mae_tokens``) are made from the seed's sample on first use."""

    args: argparse.Namespace
    samples: dict[int, AnnotatedSample]
    _perturbed: dict[tuple[int, float], AnnotatedSample] = field(default_factory=dict)

    @property
    def maes(self) -> list[float | None]:
        """The prediction errors to run at (None: the predictor's own predictions)."""
        return list(self.args.length_mae_tokens) if self.args.length_mae_tokens else [None]

    def config(self, policy: str, seed: int) -> SimulationConfig:
        args = self.args
        fleet = getattr(args, "fleet", None)
        return SimulationConfig(
            instances=fleet.num_instances if fleet is not None else args.instances, fleet=fleet,
            preset=args.preset, policy=policy, objective=args.objective or DEFAULT_OBJECTIVE,
            seed=seed, heartbeat_ms=args.heartbeat_ms, heartbeat_delay_ms=args.heartbeat_delay_ms,
            decision_delay_ms=args.decision_delay_ms, ingress_delay_ms=args.ingress_delay_ms,
            ingress_delay_sigma=args.ingress_delay_sigma,
            queue_delay_ms=args.queue_delay_ms, noise_sigma=args.noise, slo_ttft_ms=args.slo_ttft_ms,
            step_lag_ms=args.step_lag_ms, time_scale=args.time_scale, best_effort=args.best_effort,
            prefix_caching=args.prefix_caching, slow_instances=args.slow_instances[0],
            slow_factor=args.slow_instances[1], slow_published=args.slow_published,
            slow_hidden=args.slow_hidden,
            forecast_check=forecast_check_options_from_args(args), cells=args.cells,
            cell_load_interval_ms=args.cell_load_ms, cell_stale_after_ms=args.cell_stale_ms,
            cell_choices=args.cell_choices, num_simulated_candidates=args.simulated_candidates,
            served=served_models_from_args(args))

    def sample(self, seed: int, mae_tokens: float | None) -> AnnotatedSample:
        if mae_tokens is None:
            return self.samples[seed]
        key = (seed, mae_tokens)
        if key not in self._perturbed:
            self._perturbed[key] = perturb_predictions(self.samples[seed], mae_tokens)
        return self._perturbed[key]

    def run(self, policy: str, rate: float, seed: int, progress: Progress,
            mae_tokens: float | None = None) -> SimulatedRun:
        started = time.perf_counter()
        label = f"{policy}@{rate:.4g} seed {seed}" + (f" MAE {mae_tokens:g}" if mae_tokens is not None else "")
        run = simulate_run(self.config(policy, seed), self.sample(seed, mae_tokens), rate_per_s=rate,
                           burstiness=self.args.burstiness, use_trace_times=self.args.trace_times,
                           on_progress=progress.callback(label))
        progress.add_run(run.summary["events"], time.perf_counter() - started)
        run.summary.update(predictor=self.args.predictor, trace=self.args.trace, length_mae_tokens=mae_tokens,
                           refine_model=self.args.refine_model)
        return run


def reads_predictions(policy: str) -> bool:
    """Whether ``policy``'s decisions depend on the predicted lengths (it simulates with
    them); the others need one run per seed whatever the prediction error."""
    spec = policy_spec(policy)
    return spec.simulates and spec.lengths != "truth"


def build_plan(args: argparse.Namespace) -> Plan:
    seeds = args.seeds or (args.seed,)
    samples = {}
    # The trace's length policy is the engines': a long-context preset keeps long prompts.
    fleet = getattr(args, "fleet", None)
    max_model_len = fleet.min_max_model_len if fleet is not None else get_preset(args.preset).config.max_model_len
    for seed in seeds:
        trace_requests = sample_trace(args.trace, args.requests, seed, redraw=args.seeds is not None,
                                      multi_turn=args.multi_turn, max_model_len=max_model_len)
        sample = annotate_sample(trace_requests, seed, predictor=args.predictor,
                                 predictor_model=args.predictor_model)
        samples[seed] = dataclasses.replace(sample, think_time_s=args.think_time_s)
    if args.refine_model:
        samples = _refined(samples, args.refine_model, args.refine_every_tokens)
    return Plan(args, samples)


def _refined(samples: dict[int, AnnotatedSample], refine_model: str, every_tokens: int
             ) -> dict[int, AnnotatedSample]:
    from loadgen.simulation.precomputed_refinements import (
        TRUTH,
        refine_sample,
        refine_sample_with_truth,
    )
    from predictor_service.models.refine import RefineModel

    if refine_model == TRUTH:
        return {seed: refine_sample_with_truth(sample, every_tokens) for seed, sample in samples.items()}
    model = RefineModel.load(refine_model)
    return {seed: refine_sample(sample, model, every_tokens) for seed, sample in samples.items()}
