"""Remaining-length refinement: a running request's remaining output tokens.

At admission a request's length is known only from its prompt (the *first guess*,
p10/p50/p90 from a :class:`~predictor_service.models.base.LengthPredictor`). Once it
runs, its partial output says much more: an open code fence, a numbered list at item 3
of "10 tips", a closing phrase such as "I hope this helps". :class:`RefineModel` maps a
:class:`RefineInput` (prompt, first guess, tokens generated so far ``g`` and the text of
those tokens) to p10/p50/p90 of the *remaining* tokens.

Target: ln(remaining tokens). Three LightGBM quantile (pinball) models at alpha 0.1,
0.5 and 0.9, as in :mod:`predictor_service.models.fast` (quantiles commute with ln, so
exp() of them are quantiles in tokens), with p10/p90 shifted by conformal offsets
measured out of fold. Features: :mod:`predictor_service.models.refine_features`.

Model directory: ``refine_manifest.json`` (version, feature names, offsets, training
figures), ``booster_p10.txt``/``booster_p50.txt``/``booster_p90.txt`` and, when the tail
score is used, ``text_score.json``/``text_score.npz``. The version is ``"refine-"`` +
8 hex digits of a sha256 over the boosters, offsets, feature names and tail score.
Fitting lives in :mod:`predictor_service.refine_training`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightgbm
import numpy as np
import numpy.typing as npt
import structlog

from predictor_service.models.base import LengthPrediction, PredictionInput, clip_predictions
from predictor_service.models.fast import load_boosters, save_boosters
from predictor_service.models.refine_features import (
    RefineFeaturizer,
    RefineInput,
)
from predictor_service.text_score import TextScoreModel

logger = structlog.get_logger(__name__)

__all__ = ["RefineInput", "RefineModel", "MANIFEST_FILE_NAME", "QUANTILES"]

QUANTILES: tuple[float, float, float] = (0.1, 0.5, 0.9)
MANIFEST_FILE_NAME = "refine_manifest.json"
MANIFEST_FORMAT = 1
# No cap when neither the request nor training bounds the remaining length.
_UNBOUNDED_TOKENS = 1_000_000_000


def _version_of(
    boosters: dict[float, lightgbm.Booster],
    featurizer: RefineFeaturizer,
    spread_log_offsets: tuple[float, float],
) -> str:
    digest = hashlib.sha256(json.dumps([spread_log_offsets, featurizer.names]).encode("utf-8"))
    for quantile in QUANTILES:
        digest.update(boosters[quantile].model_to_string().encode("utf-8"))
    if featurizer.tail_model is not None:
        digest.update(featurizer.tail_model.coef.tobytes())
        digest.update(featurizer.tail_model.idf.tobytes())
    return "refine-" + digest.hexdigest()[:8]


class RefineModel:
    """A fitted refinement model. Immutable once built; ``predict`` is thread-safe.

    ``training_max_remaining_tokens`` bounds every prediction (as the ``fast`` model's
    training max does); ``num_threads`` is LightGBM's prediction thread count (0: all
    cores). ``training_figures`` is free-form JSON stored in the manifest.
    """

    backend = "refine"

    def __init__(
        self,
        boosters: dict[float, lightgbm.Booster],
        featurizer: RefineFeaturizer,
        training_max_remaining_tokens: int,
        *,
        spread_log_offsets: tuple[float, float] = (0.0, 0.0),
        num_threads: int = 1,
        training_figures: dict[str, Any] | None = None,
    ) -> None:
        missing = [q for q in QUANTILES if q not in boosters]
        if missing:
            raise ValueError(f"boosters: missing quantiles {missing}")
        self.boosters = dict(boosters)
        self.featurizer = featurizer
        self.training_max_remaining_tokens = int(training_max_remaining_tokens)
        self.spread_log_offsets = (float(spread_log_offsets[0]), float(spread_log_offsets[1]))
        self.num_threads = int(num_threads)
        self.training_figures = dict(training_figures or {})
        self.version = _version_of(self.boosters, featurizer, self.spread_log_offsets)

    def with_training_figures(self, figures: dict[str, Any]) -> RefineModel:
        """The same model (same version) with ``figures`` as its training figures."""
        return RefineModel(
            self.boosters,
            self.featurizer,
            self.training_max_remaining_tokens,
            spread_log_offsets=self.spread_log_offsets,
            num_threads=self.num_threads,
            training_figures=figures,
        )

    def predict_log_quantiles(self, matrix: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
        """ln-token quantiles of the remaining length, shape ``(3, rows)``, offsets applied."""
        log_quantiles = np.vstack(
            [
                self.boosters[quantile].predict(matrix, num_threads=self.num_threads)
                for quantile in QUANTILES
            ]
        )
        log_quantiles[0] += self.spread_log_offsets[0]
        log_quantiles[2] += self.spread_log_offsets[1]
        return log_quantiles

    def predict(self, inputs: Sequence[RefineInput]) -> list[LengthPrediction]:
        """Remaining-token p10/p50/p90 per input (``predicted_output_tokens`` is the p50).

        Each is clipped to [1, min(training max remaining, max_tokens - generated)].
        """
        if not inputs:
            return []
        log_quantiles = self.predict_log_quantiles(self.featurizer.transform(inputs))
        p10, p50, p90 = np.exp(log_quantiles)
        # clip_predictions reads only max_tokens: the cap on the remaining tokens.
        caps = [
            PredictionInput(prompt="", prompt_tokens=0, max_tokens=_remaining_cap(one))
            for one in inputs
        ]
        return clip_predictions(
            caps, p10, p50, p90, training_max_tokens=self.training_max_remaining_tokens
        )

    def manifest(self) -> dict[str, Any]:
        """The JSON manifest written by :meth:`save`."""
        return {
            "format": MANIFEST_FORMAT,
            "backend": self.backend,
            "version": self.version,
            "quantiles": list(QUANTILES),
            "feature_names": list(self.featurizer.names),
            "spread_log_offsets": list(self.spread_log_offsets),
            "training_max_remaining_tokens": self.training_max_remaining_tokens,
            "num_threads": self.num_threads,
            "tail_score": self.featurizer.tail_model is not None,
            "training": self.training_figures,
        }

    def save(self, model_dir: str | os.PathLike[str]) -> list[Path]:
        """Write the model files and ``refine_manifest.json`` into ``model_dir`` (created)."""
        directory = Path(model_dir)
        directory.mkdir(parents=True, exist_ok=True)
        paths = save_boosters(self.boosters, directory)
        if self.featurizer.tail_model is not None:
            paths.extend(self.featurizer.tail_model.save(directory))
        manifest_path = directory / MANIFEST_FILE_NAME
        temp_path = manifest_path.with_suffix(".json.tmp")
        temp_path.write_text(json.dumps(self.manifest(), indent=2, sort_keys=True))
        os.replace(temp_path, manifest_path)
        paths.append(manifest_path)
        return paths

    @classmethod
    def load(cls, model_dir: str | os.PathLike[str]) -> RefineModel:
        """Load a directory written by :meth:`save`; ``FileNotFoundError`` names a missing file."""
        directory = Path(model_dir)
        manifest_path = directory / MANIFEST_FILE_NAME
        if not manifest_path.is_file():
            raise FileNotFoundError(f"refine model manifest not found: {manifest_path}")
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"{manifest_path}: unknown format {manifest.get('format')!r}")
        boosters = load_boosters(directory, "refine")
        tail_model = TextScoreModel.load(directory) if manifest["tail_score"] else None
        featurizer = RefineFeaturizer(tuple(manifest["feature_names"]), tail_model)
        low_offset, high_offset = manifest["spread_log_offsets"]
        model = cls(
            boosters,
            featurizer,
            manifest["training_max_remaining_tokens"],
            spread_log_offsets=(low_offset, high_offset),
            num_threads=manifest.get("num_threads", 1),
            training_figures=manifest.get("training"),
        )
        if model.version != manifest["version"]:
            logger.warning(
                "refine_model_version_mismatch", manifest=manifest["version"], files=model.version
            )
        return model


def _remaining_cap(one: RefineInput) -> int:
    if one.max_tokens is None:
        return _UNBOUNDED_TOKENS
    return max(1, one.max_tokens - one.generated_tokens)
