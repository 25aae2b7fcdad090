"""The ``fast`` backend: prompt features + gradient-boosted quantile trees (LightGBM).

Inputs per request (:class:`FastFeaturizer`): the hand-made features of
:mod:`predictor_service.features`, the bag-of-words score of
:mod:`predictor_service.text_score` (stacked: out-of-fold on training rows) and,
optionally, 384 frozen MiniLM-L6 embedding dimensions (:mod:`..embeddings`).

Target: ln(output tokens). Three LightGBM models with the quantile (pinball) objective
at alpha 0.1, 0.5 and 0.9 give p10, p50 and p90 in log space; since quantiles commute
with the monotone ln, exp() of them are the quantiles in tokens, and the p50 is the
estimate that minimises the absolute error in tokens. p10/p90 are then shifted by
conformal offsets (see :mod:`predictor_service.models.quantile_boosting`).

Model directory: ``manifest.json``, ``booster_p10.txt``/``booster_p50.txt``/
``booster_p90.txt`` (LightGBM text format), ``spread_offsets.json`` and the text score
files. The version is ``"fast-"`` + the first 8 hex digits of a sha256 over the
boosters, the text score weights and the offsets. Training and online refit live in
:mod:`predictor_service.models.fast_fit`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightgbm
import numpy as np
import numpy.typing as npt
import structlog

from predictor_service.conversation import (
    CONVERSATION_FEATURE_NAMES,
    conversation_features,
    message_tokens,
    split_conversation,
)
from predictor_service.features import FEATURE_NAMES, extract_features
from predictor_service.manifest import read_manifest
from predictor_service.models.base import (
    LengthPrediction,
    PredictionInput,
    clip_predictions,
)
from predictor_service.text_score import TextScoreConfig, TextScoreModel

logger = structlog.get_logger(__name__)

QUANTILES: tuple[float, float, float] = (0.1, 0.5, 0.9)
_BOOSTER_FILE_NAMES = {0.1: "booster_p10.txt", 0.5: "booster_p50.txt", 0.9: "booster_p90.txt"}
SPREAD_OFFSETS_FILE = "spread_offsets.json"


def save_boosters(boosters: dict[float, lightgbm.Booster], directory: Path) -> list[Path]:
    """The p10/p50/p90 boosters as ``booster_p*.txt`` in ``directory``."""
    paths = []
    for quantile, file_name in _BOOSTER_FILE_NAMES.items():
        path = directory / file_name
        boosters[quantile].save_model(str(path))
        paths.append(path)
    return paths


def load_boosters(directory: Path, model_kind: str) -> dict[float, lightgbm.Booster]:
    """What :func:`save_boosters` wrote; ``FileNotFoundError`` names a missing file."""
    boosters = {}
    for quantile, file_name in _BOOSTER_FILE_NAMES.items():
        path = directory / file_name
        if not path.is_file():
            raise FileNotFoundError(f"{model_kind} model file not found: {path}")
        boosters[quantile] = lightgbm.Booster(model_file=str(path))
    return boosters


@dataclass(frozen=True)
class FastConfig:
    """Training settings of the ``fast`` model.

    The p50 model gets ``num_rounds`` rounds; the p10/p90 (spread) models are smaller
    (``spread_*``) and then shifted in log space by conformal offsets measured with
    ``num_calibration_folds``-fold cross-validation (0 or 1 disables the calibration).

    ``num_threads`` 0 lets LightGBM use every core (training and prediction);
    ``use_embeddings`` adds MiniLM embeddings (about 40-100 prompts/s per core instead of
    thousands). ``text_score`` None disables the bag-of-words score.
    ``conversation_features`` (``train --multi-turn`` sets it): a prompt rendered as a
    conversation is read as its new message, which the prompt features and the text score
    describe, plus its history's lengths (:mod:`predictor_service.conversation`).
    Training reads these through :mod:`predictor_service.models.quantile_boosting`.
    """

    num_rounds: int = 400
    learning_rate: float = 0.03
    num_leaves: int = 31
    min_data_in_leaf: int = 20
    spread_num_rounds: int = 150
    spread_learning_rate: float = 0.08
    spread_min_data_in_leaf: int = 40
    num_calibration_folds: int = 5
    feature_fraction: float = 0.8
    bagging_fraction: float = 0.8
    num_threads: int = 0
    use_embeddings: bool = False
    embedding_max_length: int = 128
    text_score: TextScoreConfig | None = field(default_factory=TextScoreConfig)
    conversation_features: bool = False

    def __post_init__(self) -> None:
        if self.num_rounds < 1 or self.spread_num_rounds < 1:
            raise ValueError("num_rounds and spread_num_rounds: must be >= 1")
        if self.num_leaves < 2:
            raise ValueError(f"num_leaves: must be >= 2 (got {self.num_leaves})")

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> FastConfig:
        """Inverse of ``dataclasses.asdict`` for a stored config."""
        values = dict(data)
        text_score = values.pop("text_score", None)
        return cls(
            **values, text_score=TextScoreConfig(**text_score) if text_score is not None else None
        )

    def min_data_in_leaf_for(self, quantile: float) -> int:
        """Minimum rows per leaf of the model of one ``quantile`` (p10/p90: ``spread_*``)."""
        return self.min_data_in_leaf if quantile == 0.5 else self.spread_min_data_in_leaf


def _version_of(
    boosters: dict[float, lightgbm.Booster],
    text_model: TextScoreModel | None,
    spread_log_offsets: tuple[float, float],
) -> str:
    digest = hashlib.sha256(json.dumps(spread_log_offsets).encode("utf-8"))
    for quantile in QUANTILES:
        digest.update(boosters[quantile].model_to_string().encode("utf-8"))
    if text_model is not None:
        digest.update(text_model.coef.tobytes())
        digest.update(text_model.idf.tobytes())
    return "fast-" + digest.hexdigest()[:8]


def model_texts(config: FastConfig, prompts: Sequence[str]) -> list[str]:
    """The texts the text score reads: the prompts, or their new messages."""
    if config.conversation_features:
        return [split_conversation(prompt).message for prompt in prompts]
    return list(prompts)


class FastFeaturizer:
    """Builds the ``fast`` model's input matrix; shared by a model and its refits."""

    def __init__(self, config: FastConfig, text_model: TextScoreModel | None) -> None:
        if config.text_score is not None and text_model is None:
            raise ValueError("text_model: required when config.text_score is set")
        self.config = config
        self.text_model = text_model if config.text_score is not None else None
        self._embedder: Any = None

    def transform(
        self,
        prompts: Sequence[str],
        prompt_tokens: Sequence[int],
        num_turns: Sequence[int],
        *,
        text_scores: npt.NDArray[np.float64] | None = None,
    ) -> npt.NDArray[np.float32]:
        """The input matrix; ``text_scores`` (e.g. out-of-fold) replaces the text score."""
        if self.config.conversation_features:
            conversations = [split_conversation(prompt) for prompt in prompts]
            texts = [conversation.message for conversation in conversations]
            blocks: list[npt.NDArray[Any]] = [
                extract_features(
                    texts,
                    [message_tokens(c, p, n) for c, p, n in zip(conversations, prompts, prompt_tokens, strict=True)],
                    [max(c.num_turns, n) for c, n in zip(conversations, num_turns, strict=True)],
                ),
                conversation_features(conversations, prompt_tokens),
            ]
        else:
            texts = list(prompts)
            blocks = [extract_features(prompts, prompt_tokens, num_turns)]
        if self.text_model is not None:
            scores = self.text_model.score(texts) if text_scores is None else text_scores
            blocks.append(np.asarray(scores, dtype=np.float32).reshape(-1, 1))
        if self.config.use_embeddings:
            blocks.append(self._get_embedder().embed(prompts))
        return np.hstack(blocks).astype(np.float32, copy=False)

    def _get_embedder(self) -> Any:
        if self._embedder is None:
            from predictor_service.embeddings import get_embedder

            self._embedder = get_embedder(self.config.embedding_max_length)
        return self._embedder


class FastLengthModel:
    """A fitted ``fast`` model (implements ``LengthPredictor``). Immutable once built."""

    backend = "fast"

    def __init__(
        self,
        boosters: dict[float, lightgbm.Booster],
        featurizer: FastFeaturizer,
        training_max_tokens: int,
        *,
        spread_log_offsets: tuple[float, float] = (0.0, 0.0),
        parent_version: str | None = None,
    ) -> None:
        missing = [q for q in QUANTILES if q not in boosters]
        if missing:
            raise ValueError(f"boosters: missing quantiles {missing}")
        self.boosters = dict(boosters)
        self.featurizer = featurizer
        self.config = featurizer.config
        self.training_max_tokens = int(training_max_tokens)
        self.spread_log_offsets = (float(spread_log_offsets[0]), float(spread_log_offsets[1]))
        self.parent_version = parent_version
        self.version = _version_of(self.boosters, featurizer.text_model, self.spread_log_offsets)

    def predict_log_quantiles(self, matrix: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
        """ln-token quantiles (spread offsets applied), shape ``(3, rows)``, p10/p50/p90."""
        log_quantiles = np.vstack(
            [
                self.boosters[quantile].predict(matrix, num_threads=self.config.num_threads)
                for quantile in QUANTILES
            ]
        )
        log_quantiles[0] += self.spread_log_offsets[0]
        log_quantiles[2] += self.spread_log_offsets[1]
        return log_quantiles

    def predict(self, inputs: Sequence[PredictionInput]) -> list[LengthPrediction]:
        """Batched prediction; clipped to [1, min(training max, max_tokens)]."""
        if not inputs:
            return []
        matrix = self.featurizer.transform(
            [one.prompt for one in inputs],
            [one.prompt_tokens for one in inputs],
            [one.num_turns for one in inputs],
        )
        log_quantiles = self.predict_log_quantiles(matrix)
        p10, p50, p90 = np.exp(log_quantiles)
        return clip_predictions(inputs, p10, p50, p90, training_max_tokens=self.training_max_tokens)

    def manifest_extra(self) -> dict[str, Any]:
        """Backend settings stored in the manifest's ``extra``."""
        return {
            "fast_config": asdict(self.config),
            "feature_names": list(FEATURE_NAMES)
            + (list(CONVERSATION_FEATURE_NAMES) if self.config.conversation_features else []),
            "quantiles": list(QUANTILES),
            "parent_version": self.parent_version,
        }

    def save(self, model_dir: str | os.PathLike[str]) -> list[Path]:
        """Write the model files (not the manifest) into ``model_dir`` (created)."""
        directory = Path(model_dir)
        directory.mkdir(parents=True, exist_ok=True)
        paths = save_boosters(self.boosters, directory)
        if self.featurizer.text_model is not None:
            paths.extend(self.featurizer.text_model.save(directory))
        offsets_path = directory / SPREAD_OFFSETS_FILE
        offsets_path.write_text(json.dumps(list(self.spread_log_offsets)))
        paths.append(offsets_path)
        return paths

    @classmethod
    def load(cls, model_dir: str | os.PathLike[str]) -> FastLengthModel:
        """Load a model directory; ``FileNotFoundError`` names any missing file."""
        directory = Path(model_dir)
        if not directory.is_dir():
            raise FileNotFoundError(f"fast model directory not found: {directory}")
        manifest = read_manifest(directory)
        if manifest.backend != "fast":
            raise ValueError(f"{directory}: manifest backend is {manifest.backend!r}, not 'fast'")
        config = FastConfig.from_json_dict(manifest.extra.get("fast_config", {}))
        boosters = load_boosters(directory, "fast")
        text_model = TextScoreModel.load(directory) if config.text_score is not None else None
        offsets_path = directory / SPREAD_OFFSETS_FILE
        if not offsets_path.is_file():
            raise FileNotFoundError(f"fast model file not found: {offsets_path}")
        low_offset, high_offset = json.loads(offsets_path.read_text())
        model = cls(
            boosters,
            FastFeaturizer(config, text_model),
            manifest.training_max_tokens,
            spread_log_offsets=(low_offset, high_offset),
            parent_version=manifest.extra.get("parent_version"),
        )
        if model.version != manifest.version:
            logger.warning(
                "fast_model_version_mismatch", manifest=manifest.version, files=model.version
            )
        return model
