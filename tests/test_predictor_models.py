"""Predictor interface: clipping, simple backends, registry errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from predictor_service.models import (
    LengthPrediction,
    LengthPredictor,
    PredictionInput,
    clip_predictions,
    load_predictor,
)


def _input(max_tokens: int = 4096, **fields: object) -> PredictionInput:
    return PredictionInput(prompt="hello", prompt_tokens=5, max_tokens=max_tokens, **fields)


def test_clip_respects_max_tokens_training_max_and_order() -> None:
    inputs = [_input(100), _input(4096), _input(4096), _input(4096)]
    predictions = clip_predictions(
        inputs,
        [50, 0.2, 900, math.nan],
        [500, 0.4, 700, 10],
        [900, -3, 800, 20],
        training_max_tokens=1000,
    )
    assert predictions[0] == LengthPrediction(100, 50, 100)  # capped by max_tokens
    assert predictions[1] == LengthPrediction(1, 1, 1)  # floor of 1
    assert predictions[2] == LengthPrediction(800, 700, 900)  # crossed quantiles sorted
    assert predictions[3] == LengthPrediction(20, 10, 1000)  # NaN -> upper bound


def test_prediction_input_validates_fields() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        _input(0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        PredictionInput(prompt="", prompt_tokens=-1, max_tokens=10)


def test_heuristic_is_close_to_the_training_median_and_clipped() -> None:
    predictor = load_predictor("heuristic")
    assert isinstance(predictor, LengthPredictor)
    short, capped = predictor.predict([_input(), _input(64)])
    assert 200 <= short.predicted_output_tokens <= 300
    assert short.p10_tokens < short.predicted_output_tokens < short.p90_tokens
    assert capped.p90_tokens <= 64 and capped.predicted_output_tokens <= 64


def test_oracle_passes_true_length_and_names_missing_field() -> None:
    oracle = load_predictor("oracle")
    (prediction,) = oracle.predict([_input(true_output_tokens=321)])
    assert prediction == LengthPrediction(321, 321, 321)
    (capped,) = oracle.predict([_input(100, true_output_tokens=321)])
    assert capped.predicted_output_tokens == 100
    with pytest.raises(ValueError, match="true_output_tokens"):
        oracle.predict([_input()])


def test_trace_passes_shipped_prediction_and_names_missing_field() -> None:
    trace = load_predictor("trace")
    (prediction,) = trace.predict([_input(trace_predicted_output_tokens=250)])
    assert prediction.predicted_output_tokens == 250
    assert prediction.p10_tokens < 250 < prediction.p90_tokens
    with pytest.raises(ValueError, match="trace_predicted_output_tokens"):
        trace.predict([_input(true_output_tokens=5)])


def test_registry_errors_name_backend_and_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown predictor backend 'nope'"):
        load_predictor("nope")
    with pytest.raises(ValueError, match="needs a model directory"):
        load_predictor("fast")
    missing = tmp_path / "absent"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_predictor("fast", str(missing))
    with pytest.raises(FileNotFoundError, match="manifest"):
        load_predictor("fast", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="transformer checkpoint not found"):
        load_predictor("transformer", str(tmp_path))
