"""The ``ensemble`` backend: a weighted blend, in ln tokens, of trained models.

A model directory holds one subdirectory per member (each a model directory of its own
backend, with its manifest) and the weights in its manifest's ``extra["members"]``
(``{"fast": 0.4, "transformer": 0.6}``): each quantile is exp(sum of weight × ln of the
member's quantile). ``blockq predictor train --backend auto`` writes one, with the
weight chosen on the validation split (:func:`choose_weight`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from predictor_service.manifest import read_manifest
from predictor_service.models.base import (
    LengthPrediction,
    LengthPredictor,
    PredictionInput,
    clip_predictions,
)

WEIGHT_GRID = tuple(round(0.1 * k, 1) for k in range(11))


def _log_quantiles(predictions: Sequence[LengthPrediction]) -> np.ndarray:
    return np.log(np.array([[p.p10_tokens, p.predicted_output_tokens, p.p90_tokens] for p in predictions],
                           dtype=np.float64))


class EnsembleLengthModel:
    """Members and their weights (summing to 1); implements ``LengthPredictor``."""

    backend = "ensemble"

    def __init__(self, members: Mapping[str, LengthPredictor], weights: Mapping[str, float],
                 training_max_tokens: int) -> None:
        if set(members) != set(weights) or not members:
            raise ValueError("ensemble: every member needs a weight")
        if abs(sum(weights.values()) - 1) > 1e-6 or min(weights.values()) < 0:
            raise ValueError(f"ensemble weights: must be >= 0 and sum to 1 (got {dict(weights)})")
        self.members = dict(members)
        self.weights = dict(weights)
        self.training_max_tokens = training_max_tokens
        tag = ",".join(f"{name}={members[name].version}:{weights[name]}" for name in sorted(members))
        self.version = "ensemble-" + hashlib.sha256(tag.encode()).hexdigest()[:8]

    def predict(self, inputs: Sequence[PredictionInput]) -> list[LengthPrediction]:
        if not inputs:
            return []
        # A member with weight 0 is not asked (no cost).
        blended = sum(weight * _log_quantiles(self.members[name].predict(inputs))
                      for name, weight in self.weights.items() if weight > 0)
        quantiles = np.exp(np.sort(np.asarray(blended), axis=1))
        return clip_predictions(inputs, quantiles[:, 0], quantiles[:, 1], quantiles[:, 2],
                                training_max_tokens=self.training_max_tokens)

    def manifest_extra(self) -> dict[str, Any]:
        return {"members": self.weights,
                "member_versions": {name: model.version for name, model in self.members.items()}}

    @classmethod
    def load(cls, model_dir: str | os.PathLike[str],
             load_member: Callable[[str, str], LengthPredictor]) -> EnsembleLengthModel:
        """Each member from ``model_dir/<member>`` with ``load_member(backend, path)``."""
        directory = Path(model_dir)
        manifest = read_manifest(directory)
        weights = {name: float(w) for name, w in manifest.extra.get("members", {}).items()}
        members = {}
        for name in weights:
            member_dir = directory / name
            members[name] = load_member(read_manifest(member_dir).backend, str(member_dir))
        return cls(members, weights, manifest.training_max_tokens)


def choose_weight(first: Sequence[LengthPrediction], second: Sequence[LengthPrediction],
                  truth: np.ndarray) -> tuple[float, dict[float, float]]:
    """The weight of ``second`` (on :data:`WEIGHT_GRID`) whose blended p50 has the least
    mean absolute error against ``truth``, and the MAE at every weight."""
    log_first, log_second = _log_quantiles(first)[:, 1], _log_quantiles(second)[:, 1]
    errors = {w: float(np.abs(np.exp((1 - w) * log_first + w * log_second) - truth).mean())
              for w in WEIGHT_GRID}
    return min(errors, key=lambda w: (errors[w], w)), errors
