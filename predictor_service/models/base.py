"""The predictor interface: inputs, outputs and the clipping every backend applies.

A :class:`LengthPredictor` maps a batch of :class:`PredictionInput` to one
:class:`LengthPrediction` each: a median output length and a 10th/90th percentile
spread, all in tokens of the project tokenizer (:mod:`blockq.text.tokenizer`). Every backend
passes its raw estimates through :func:`clip_predictions`, so all predictions satisfy

    1 <= p10_tokens <= predicted_output_tokens <= p90_tokens <= min(training max, max_tokens)

(the training max is the largest output length seen in training; a backend without
one, such as ``oracle``, uses only ``max_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class PredictionInput:
    """What a predictor may look at for one request.

    ``prompt`` is the prompt text ("" when the request carries token ids only);
    ``prompt_tokens`` its length in tokens; ``max_tokens`` the request's output cap
    (>= 1); ``num_turns`` the conversation turn count (1 for a single prompt).
    ``true_output_tokens`` is carried by trace replays and only the ``oracle`` backend
    may read it; ``trace_predicted_output_tokens`` is a prediction shipped with a trace,
    read only by the ``trace`` backend.
    """

    prompt: str
    prompt_tokens: int
    max_tokens: int
    num_turns: int = 1
    true_output_tokens: int | None = None
    trace_predicted_output_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0:
            raise ValueError(f"prompt_tokens: must be >= 0 (got {self.prompt_tokens})")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1 (got {self.max_tokens})")
        if self.num_turns < 1:
            raise ValueError(f"num_turns: must be >= 1 (got {self.num_turns})")


@dataclass(frozen=True)
class LengthPrediction:
    """Predicted output length in tokens: the median and the 10th/90th percentiles.

    ``predicted_output_tokens`` is the median (p50), clipped to [1, training max] and
    never above the request's ``max_tokens``; ``p10_tokens <= predicted_output_tokens
    <= p90_tokens`` under the same bounds.
    """

    predicted_output_tokens: int
    p10_tokens: int
    p90_tokens: int


@runtime_checkable
class LengthPredictor(Protocol):
    """A batched output-length predictor.

    ``backend`` is the registry name; ``version`` identifies the fitted model (e.g.
    ``"fast-1a2b3c4d"``) and is stamped on every annotated request. ``predict`` is pure
    and thread-safe for a loaded model, returns one prediction per input in order, and
    raises ``ValueError`` (naming the field) when an input lacks what the backend needs.
    """

    backend: str
    version: str

    def predict(self, inputs: Sequence[PredictionInput]) -> list[LengthPrediction]:
        """Predict the output length of each input (batched)."""
        ...


FloatArray = npt.NDArray[np.float64]


def clip_predictions(
    inputs: Sequence[PredictionInput],
    p10_tokens: npt.ArrayLike,
    p50_tokens: npt.ArrayLike,
    p90_tokens: npt.ArrayLike,
    *,
    training_max_tokens: int | None,
) -> list[LengthPrediction]:
    """Round and clip raw quantile estimates into valid :class:`LengthPrediction` s.

    Each value is rounded to the nearest integer and clipped to
    ``[1, min(training_max_tokens, input.max_tokens)]``; then the three are sorted so
    that p10 <= p50 <= p90 (quantile models fitted separately may cross). Non-finite
    values are treated as the upper bound. ``training_max_tokens`` None means no
    training bound.
    """
    num_inputs = len(inputs)
    raw = np.vstack(
        [
            np.asarray(p10_tokens, dtype=np.float64).reshape(num_inputs),
            np.asarray(p50_tokens, dtype=np.float64).reshape(num_inputs),
            np.asarray(p90_tokens, dtype=np.float64).reshape(num_inputs),
        ]
    )
    upper = np.array([one.max_tokens for one in inputs], dtype=np.float64)
    if training_max_tokens is not None:
        upper = np.minimum(upper, float(max(1, training_max_tokens)))
    raw = np.where(np.isfinite(raw), raw, upper)
    clipped = np.clip(np.rint(raw), 1.0, upper).astype(np.int64)
    clipped.sort(axis=0)
    return [
        LengthPrediction(
            predicted_output_tokens=int(clipped[1, index]),
            p10_tokens=int(clipped[0, index]),
            p90_tokens=int(clipped[2, index]),
        )
        for index in range(num_inputs)
    ]


@dataclass(frozen=True)
class FeedbackSample:
    """A served request's input and the output length it really had (tokens, >= 1)."""

    input: PredictionInput
    true_output_tokens: int

    def __post_init__(self) -> None:
        if self.true_output_tokens < 1:
            raise ValueError(f"true_output_tokens: must be >= 1 (got {self.true_output_tokens})")
