"""The step-latency model: shipped profiles, evaluation, refit, serialisation, fitting script.

Stated fit error of the shipped linear-layer tables against the profiled timings (sum of
per-layer operator medians x 32 layers): median relative error <= 3 %, 90th percentile
<= 7 %, no single profiled token count off by more than 20 % (the worst points sit at
the GPU kernels' tile-size steps, which a monotone piecewise-linear table smooths over).
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

import numpy as np
import pytest

from blockq.engine_model import PRESETS, StepLatencyModel, StepSample, fit_profiles, get_preset
from blockq.engine_model.presets import load_profiles

MEDIAN_REL_ERROR = 0.03
P90_REL_ERROR = 0.07
MAX_REL_ERROR = 0.20
DATA_DIR = Path(os.environ.get(
    "BLOCKQ_PROFILE_DATA_DIR",
    Path(__file__).resolve().parents[2] / "shared" / "data" / "profiles"))
needs_profile_data = pytest.mark.skipif(
    not (DATA_DIR / fit_profiles.MLP_PROFILE_PATHS["a30"]).exists(),
    reason=f"GPU profiles not found under {DATA_DIR} (set BLOCKQ_PROFILE_DATA_DIR)")


def make_model(**overrides: float) -> StepLatencyModel:
    fields: dict = {"linear_knot_tokens": (1, 128, 512, 4096),
                    "linear_knot_s": (0.020, 0.030, 0.076, 0.520),
                    "kv_token_s": 7e-7, "prefill_pair_s": 1.2e-8, "step_overhead_s": 0.001}
    fields.update(overrides)
    return StepLatencyModel(**fields)


def relative_errors(model: StepLatencyModel, tokens: list[int], ms: list[float]) -> np.ndarray:
    modelled = np.array([model.linear_seconds(n) * 1e3 for n in tokens])
    return np.abs(modelled / np.array(ms) - 1.0)


# --- shipped profiles -----------------------------------------------------------------------


@pytest.mark.parametrize("gpu", ["a30", "a100", "h100"])
def test_shipped_profile_reproduces_its_check_points(gpu: str) -> None:
    entry = load_profiles()["gpus"][gpu]
    model = PRESETS[f"llama2-7b-{gpu}"].latency_model
    errors = relative_errors(model, entry["check_points"]["tokens"], entry["check_points"]["linear_ms"])
    assert np.median(errors) <= MEDIAN_REL_ERROR and errors.max() <= MAX_REL_ERROR
    fit = entry["fit"]
    assert fit["linear_median_rel_error"] <= MEDIAN_REL_ERROR
    assert fit["linear_p90_rel_error"] <= P90_REL_ERROR
    assert fit["linear_max_rel_error"] <= MAX_REL_ERROR


def test_a30_modelled_steps_are_physically_plausible() -> None:
    model = get_preset("llama2-7b-a30").latency_model
    single_decode_s = model.step_seconds(0, 1, 500)
    full_decode_s = model.step_seconds(0, 48, 24_000)
    prefill_chunk_s = model.step_seconds(512, 0, 512)
    # a decode step cannot beat reading the 13.5 GB of weights at 0.93 TB/s (14.5 ms)
    assert 0.0145 < single_decode_s < 0.025
    assert 0.030 < full_decode_s < 0.050
    assert 0.070 < prefill_chunk_s < 0.090
    faster = [get_preset(f"llama2-7b-{g}").latency_model.step_seconds(0, 48, 24_000)
              for g in ("a100", "h100")]
    assert full_decode_s > faster[0] > faster[1]


# --- evaluation -----------------------------------------------------------------------------


def test_step_seconds_adds_the_four_parts() -> None:
    model = make_model()
    expected = 0.030 + 7e-7 * 1000 + 1.2e-8 * 5000 + 0.001
    assert model.step_seconds(100, 28, 1000, 5000) == pytest.approx(expected)
    # without an exact pair count, one fresh chunk of the prefill tokens stands in
    assert model.step_seconds(100, 0, 0) == pytest.approx(
        model.linear_seconds(100) + 1.2e-8 * 5050 + 0.001)
    assert model.linear_seconds(0) == 0.0
    assert model.linear_seconds(8192) == pytest.approx(0.520 + 4096 * (0.444 / 3584))


def test_step_seconds_never_decreases_with_more_work() -> None:
    model = PRESETS["llama2-7b-a30"].latency_model
    previous = 0.0
    for tokens in range(0, 5000, 7):
        current = model.step_seconds(tokens, 0, tokens)
        assert current >= previous
        previous = current


def test_dict_round_trip_is_plain_and_exact() -> None:
    model = PRESETS["llama2-7b-h100"].latency_model
    data = json.loads(json.dumps(model.to_dict()))
    assert StepLatencyModel.from_dict({**data, "unknown": 1}) == model
    with pytest.raises(ValueError, match="kv_token_s"):
        StepLatencyModel.from_dict({k: v for k, v in data.items() if k != "kv_token_s"})


def test_invalid_tables_and_coefficients_are_rejected() -> None:
    with pytest.raises(ValueError, match="linear_knot_tokens"):
        make_model(linear_knot_tokens=(1, 1, 2, 3))
    with pytest.raises(ValueError, match="kv_token_s"):
        make_model(kv_token_s=-1.0)
    with pytest.raises(ValueError, match="linear_knot_s"):
        make_model(linear_knot_s=(0.1, math.nan, 0.2, 0.3))


# --- refit ----------------------------------------------------------------------------------


def synthetic_samples(model: StepLatencyModel, count: int, noise: float, seed: int) -> list[StepSample]:
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        num_decode = rng.randint(0, 48)
        num_prefill = rng.choice([0, 0, rng.randint(1, 512)])
        if num_decode + num_prefill == 0:
            num_decode = 1
        num_kv = num_decode * rng.randint(10, 1500) + num_prefill
        pairs = num_prefill * (2 * rng.randint(0, 2000) + num_prefill + 1) // 2
        seconds = model.step_seconds(num_prefill, num_decode, num_kv, pairs)
        samples.append(StepSample(num_prefill, num_decode, num_kv,
                                  seconds * (1.0 + rng.gauss(0.0, noise)), pairs))
    return samples


def prediction_errors(fitted: StepLatencyModel, truth: StepLatencyModel,
                      samples: list[StepSample]) -> np.ndarray:
    return np.array([abs(fitted.step_seconds(s.num_prefill_tokens, s.num_decode_seqs,
                                             s.num_kv_tokens_attended, s.num_prefill_attention_pairs)
                         / truth.step_seconds(s.num_prefill_tokens, s.num_decode_seqs,
                                              s.num_kv_tokens_attended, s.num_prefill_attention_pairs)
                         - 1.0) for s in samples])


TRUTH = {"linear_scale": 1.3, "kv_token_s": 5e-7, "prefill_pair_s": 2e-8, "step_overhead_s": 0.003}


def test_refit_recovers_a_known_model_from_exact_samples() -> None:
    prior = make_model()
    truth = make_model(**TRUTH)
    samples = synthetic_samples(truth, 400, noise=0.0, seed=1)
    unregularised = prior.refit(samples, prior_weight_samples=0.0)
    for name, value in TRUTH.items():
        assert getattr(unregularised, name) == pytest.approx(value, rel=1e-6)
    # the default prior (one pseudo-sample) only nudges the weakly determined split
    fitted = prior.refit(samples)
    assert fitted.linear_scale == pytest.approx(1.3, rel=0.02)
    assert fitted.kv_token_s == pytest.approx(5e-7, rel=0.02)
    assert fitted.prefill_pair_s == pytest.approx(2e-8, rel=0.05)
    assert fitted.step_overhead_s == pytest.approx(0.003, rel=0.10)
    assert fitted.linear_knot_s == prior.linear_knot_s
    assert np.median(prediction_errors(fitted, truth, samples)) < 0.005


def test_refit_on_noisy_samples_predicts_the_true_step_times() -> None:
    prior = make_model()
    truth = make_model(**TRUTH)
    fitted = prior.refit(synthetic_samples(truth, 400, noise=0.03, seed=2))
    errors = prediction_errors(fitted, truth, synthetic_samples(truth, 400, noise=0.0, seed=3))
    assert np.median(errors) < 0.01 and errors.max() < 0.05
    assert fitted.linear_scale == pytest.approx(1.3, rel=0.05)
    assert fitted.kv_token_s == pytest.approx(5e-7, rel=0.05)


def test_refit_with_too_few_samples_returns_the_model_itself() -> None:
    model = make_model()
    samples = synthetic_samples(model, 3, noise=0.0, seed=3)
    assert model.refit(samples) is model
    assert model.refit([StepSample(1, 1, 1, math.nan)] * 10) is model


def test_refit_keeps_what_the_samples_cannot_tell() -> None:
    model = make_model()
    truth = make_model(linear_scale=1.5, prefill_pair_s=9e-8)
    decode_only = [s for s in synthetic_samples(truth, 300, noise=0.0, seed=4)
                   if s.num_prefill_tokens == 0]
    # no prefill in the samples: the prefill coefficient stays; decode steps are learnt
    fitted = model.refit(decode_only)
    assert fitted.prefill_pair_s == pytest.approx(model.prefill_pair_s)
    assert np.median(prediction_errors(fitted, truth, decode_only)) < 0.01
    # a dozen samples give a blend: much closer to the truth than the prior, not exact
    blended = model.refit(decode_only[:12])
    assert blended.prefill_pair_s == pytest.approx(model.prefill_pair_s)
    assert np.median(prediction_errors(blended, truth, decode_only)) < 0.03
    assert np.median(prediction_errors(model, truth, decode_only)) > 0.15


def test_refit_coefficients_stay_non_negative() -> None:
    model = make_model()
    # steps that got *faster* with more KV would need a negative coefficient
    samples = [StepSample(0, 8, kv, 0.05 - kv * 1e-6) for kv in range(100, 20_000, 500)]
    fitted = model.refit(samples)
    assert min(fitted.linear_scale, fitted.kv_token_s, fitted.prefill_pair_s,
               fitted.step_overhead_s) >= 0.0


# --- fitting script -------------------------------------------------------------------------


def test_bad_cells_are_those_far_below_an_earlier_time() -> None:
    values = np.array([0.1, 0.12, 0.002, np.nan, 0.2, 0.01, 0.21])
    assert fit_profiles.find_bad_cells(values).tolist() == [False, False, True, True, False, True, False]


def test_piecewise_linear_fit_recovers_a_piecewise_linear_curve() -> None:
    tokens = np.r_[1, np.arange(8, 4097, 8)]
    step_ms = np.interp(tokens, [1, 256, 4096], [20.0, 60.0, 520.0])
    knots, values = fit_profiles.fit_piecewise_linear(tokens, step_ms, target_rel_error=1e-6)
    assert np.allclose(np.interp(tokens, knots, values), step_ms, rtol=1e-6)
    assert len(knots) <= 6


@needs_profile_data
def test_cleaned_a30_sums_match_the_reference_figures() -> None:
    linear = fit_profiles.load_linear_layer_profile(DATA_DIR / fit_profiles.MLP_PROFILE_PATHS["a30"])
    reference_ms = {1: 19.5, 32: 20.3, 64: 21.5, 128: 30.7, 256: 58.7, 512: 76.3,
                    1024: 141.6, 2048: 263.2}
    by_tokens = dict(zip(linear.tokens.tolist(), linear.step_ms.tolist(), strict=True))
    for tokens, expected_ms in reference_ms.items():
        assert by_tokens[tokens] == pytest.approx(expected_ms, rel=0.005)
    assert linear.num_bad_cells > 0 and by_tokens[224] > by_tokens[192] * 0.95


@needs_profile_data
def test_fitting_script_reproduces_the_shipped_profiles(tmp_path: Path) -> None:
    out = tmp_path / "profiles.json"
    assert fit_profiles.main(["--data-dir", str(DATA_DIR), "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == load_profiles()
