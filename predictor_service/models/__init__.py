"""Output-length predictor backends, registered by name in one place.

``load_predictor(backend, model_dir)`` is the only way services obtain a predictor.
Backends:

===============  ========================================================  ============
name             what                                                       model_dir
===============  ========================================================  ============
``heuristic``    prompt-length power law with fixed spread (cold start)      not used
``oracle``       the request's ``true_output_tokens`` (benchmarks only)      not used
``trace``        the prediction shipped with a trace replay                  not used
``fast``         hand features + bag-of-words score + LightGBM quantiles    required
``transformer``  a fine-tuned encoder with p10/p50/p90 pinball heads        required
``ensemble``     a weighted ln-space blend of trained members (``auto``)    required
===============  ========================================================  ============

Heavy dependencies (lightgbm, torch) are imported only when their backend loads.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from predictor_service.models.base import (
    FeedbackSample,
    LengthPrediction,
    LengthPredictor,
    PredictionInput,
    clip_predictions,
)

__all__ = [
    "BACKENDS",
    "MODEL_BACKENDS",
    "FeedbackSample",
    "LengthPrediction",
    "LengthPredictor",
    "PredictionInput",
    "clip_predictions",
    "load_predictor",
]

# Backends that read a trained model directory.
MODEL_BACKENDS = ("fast", "transformer", "ensemble")


def _required(model_dir: Path | None, backend: str) -> Path:
    if model_dir is None:
        raise ValueError(f"predictor backend {backend!r} needs a model directory (model_dir)")
    return model_dir


def _load_heuristic(model_dir: Path | None) -> LengthPredictor:
    from predictor_service.models.simple import HeuristicPredictor

    return HeuristicPredictor()


def _load_oracle(model_dir: Path | None) -> LengthPredictor:
    from predictor_service.models.simple import OraclePredictor

    return OraclePredictor()


def _load_trace(model_dir: Path | None) -> LengthPredictor:
    from predictor_service.models.simple import TracePredictor

    return TracePredictor()


def _load_fast(model_dir: Path | None) -> LengthPredictor:
    from predictor_service.models.fast import FastLengthModel

    return FastLengthModel.load(_required(model_dir, "fast"))


def _load_transformer(model_dir: Path | None) -> LengthPredictor:
    from predictor_service.models.transformer import TransformerLengthModel

    return TransformerLengthModel.load(_required(model_dir, "transformer"))


def _load_ensemble(model_dir: Path | None) -> LengthPredictor:
    from predictor_service.models.ensemble import EnsembleLengthModel

    return EnsembleLengthModel.load(_required(model_dir, "ensemble"), load_predictor)


BACKENDS: dict[str, Callable[[Path | None], LengthPredictor]] = {
    "heuristic": _load_heuristic,
    "oracle": _load_oracle,
    "trace": _load_trace,
    "fast": _load_fast,
    "transformer": _load_transformer,
    "ensemble": _load_ensemble,
}


def load_predictor(backend: str, model_dir: str | None = None) -> LengthPredictor:
    """Return a ready predictor of ``backend``.

    ``model_dir`` is required by :data:`MODEL_BACKENDS` (a directory written by
    ``train``) and ignored by the others. Raises ``ValueError`` for an unknown backend
    or a missing ``model_dir`` and ``FileNotFoundError`` naming a missing path.
    """
    loader = BACKENDS.get(backend)
    if loader is None:
        raise ValueError(
            f"unknown predictor backend {backend!r}: expected one of {sorted(BACKENDS)}"
        )
    path: Path | None = None
    if backend in MODEL_BACKENDS:
        if not model_dir:
            raise ValueError(f"predictor backend {backend!r} needs a model directory (model_dir)")
        path = Path(model_dir).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"predictor model directory not found: {path}")
    return loader(path)
