"""Backends that need no trained model: ``heuristic``, ``oracle`` and ``trace``."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from predictor_service.models.base import LengthPrediction, PredictionInput, clip_predictions

# Median regression of ln(output tokens) on ln(1 + prompt tokens) over the first
# human->gpt pairs of the ShareGPT training split (7,513 distinct prompts, project
# tokenizer): ln p50 = 5.474 + 0.0436 * ln(1 + prompt_tokens). Output length hardly
# depends on prompt length (medians 190-320 tokens across prompt-length deciles), so
# a fixed output/prompt ratio would be far worse than this near-constant power law.
HEURISTIC_LOG_INTERCEPT = 5.474
HEURISTIC_LOG_SLOPE = 0.0436
# 10th / 90th percentiles of true/p50 on the same data (residual quantiles).
HEURISTIC_P10_RATIO = 0.159
HEURISTIC_P90_RATIO = 2.355
# Largest first-answer length in that data (tokens); the clip bound of this backend.
HEURISTIC_MAX_TOKENS = 37_636


class HeuristicPredictor:
    """Cold-start predictor from the prompt length alone (constants above).

    p50 = exp(5.474) * (1 + prompt_tokens) ** 0.0436, i.e. about 240 tokens for a
    10-token prompt and 330 for a 10,000-token one; p10/p90 are fixed ratios of it.
    """

    backend = "heuristic"
    version = "heuristic-1"

    def predict(self, inputs: Sequence[PredictionInput]) -> list[LengthPrediction]:
        """Predict from ``prompt_tokens`` only; clipped as every backend."""
        prompt_tokens = np.array([one.prompt_tokens for one in inputs], dtype=np.float64)
        p50 = np.exp(HEURISTIC_LOG_INTERCEPT + HEURISTIC_LOG_SLOPE * np.log1p(prompt_tokens))
        return clip_predictions(
            inputs,
            p50 * HEURISTIC_P10_RATIO,
            p50,
            p50 * HEURISTIC_P90_RATIO,
            training_max_tokens=HEURISTIC_MAX_TOKENS,
        )


class OraclePredictor:
    """Passes each input's ``true_output_tokens`` through (benchmarks only).

    p10 = p50 = p90 = the true length, clipped to [1, max_tokens]. Raises
    ``ValueError`` naming ``true_output_tokens`` when an input lacks it.
    """

    backend = "oracle"
    version = "oracle-1"

    def predict(self, inputs: Sequence[PredictionInput]) -> list[LengthPrediction]:
        """Return the true lengths; ``ValueError`` if any is missing."""
        values = []
        for index, one in enumerate(inputs):
            if one.true_output_tokens is None:
                raise ValueError(f"true_output_tokens: missing on input {index} (oracle backend)")
            values.append(float(one.true_output_tokens))
        return clip_predictions(inputs, values, values, values, training_max_tokens=None)


# Spread for trace predictions: the same ratios as the heuristic, narrowed by half in
# log space because a trace's shipped prediction is far closer to the truth.
_TRACE_P10_RATIO = math.sqrt(HEURISTIC_P10_RATIO)
_TRACE_P90_RATIO = math.sqrt(HEURISTIC_P90_RATIO)


class TracePredictor:
    """Passes each input's ``trace_predicted_output_tokens`` through.

    The median is the shipped prediction; p10/p90 are fixed ratios of it
    (sqrt of the heuristic's ratios). Raises ``ValueError`` naming
    ``trace_predicted_output_tokens`` when an input lacks it.
    """

    backend = "trace"
    version = "trace-1"

    def predict(self, inputs: Sequence[PredictionInput]) -> list[LengthPrediction]:
        """Return the shipped predictions; ``ValueError`` if any is missing."""
        values = []
        for index, one in enumerate(inputs):
            if one.trace_predicted_output_tokens is None:
                raise ValueError(
                    f"trace_predicted_output_tokens: missing on input {index} (trace backend)"
                )
            values.append(float(one.trace_predicted_output_tokens))
        p50 = np.array(values, dtype=np.float64)
        return clip_predictions(
            inputs, p50 * _TRACE_P10_RATIO, p50, p50 * _TRACE_P90_RATIO, training_max_tokens=None
        )
