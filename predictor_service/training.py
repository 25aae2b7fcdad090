"""Train and evaluate output-length models on ShareGPT files (the I/O shell of the models).

``train`` reads a ShareGPT file, labels each distinct prompt with the token count of
its answer (project tokenizer), splits train/val by a hash of the conversation id,
fits the backend, and writes the model with a ``manifest.json`` holding validation
metrics and the constant-median baseline's. ``evaluate`` scores a model directory on a
file: on the model's own validation split when the file is the one it was trained on
(same sha256), on every example otherwise.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from blockq.prediction_accuracy import (
    ACCURACY_DEFINITION,
    MAPE_DEFINITION,
    compute_metrics_with_baseline,
)
from blockq.text.tokenizer import TokenCounter, get_token_counter
from predictor_service.dataset import (
    DEFAULT_VAL_FRACTION,
    DatasetSplit,
    LengthExample,
    file_sha256,
    load_examples,
    load_split,
    output_tokens_array,
    split_examples,
)
from predictor_service.manifest import Manifest, read_manifest, write_manifest
from predictor_service.models import LengthPrediction, LengthPredictor, load_predictor

logger = structlog.get_logger(__name__)

TRAINABLE_BACKENDS = ("fast", "transformer", "auto")
# What ``auto`` trains and blends (the recommended configuration: docs/results/predictor-models.md).
AUTO_MEMBERS = ("fast", "transformer")
NUM_PROMPT_TOKEN_BINS = 10
_PREDICT_BATCH_SIZE = 256


@dataclass(frozen=True)
class TrainOptions:
    """Backend-independent training options (``max_examples`` caps the file read)."""

    val_fraction: float = DEFAULT_VAL_FRACTION
    first_turn_only: bool = True
    max_examples: int | None = None


def prompt_token_bins(prompt_tokens: Sequence[int]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Inner edges of prompt-length quantile bins and the share of prompts per bin.

    Bins are ``(-inf, e0], (e0, e1], ..., (e_last, inf)`` with duplicate edges removed;
    used by :class:`predictor_service.quality.QualityMonitor` for drift (PSI).
    """
    values = np.asarray(prompt_tokens, dtype=np.float64)
    if len(values) == 0:
        return (), ()
    quantiles = np.linspace(0, 1, NUM_PROMPT_TOKEN_BINS + 1)[1:-1]
    edges = np.unique(np.quantile(values, quantiles))
    counts = np.bincount(np.searchsorted(edges, values, side="left"), minlength=len(edges) + 1)
    return tuple(float(edge) for edge in edges), tuple(float(c) for c in counts / len(values))


def predict_in_batches(
    predictor: LengthPredictor, examples: Sequence[LengthExample], batch_size: int
) -> tuple[list[LengthPrediction], float]:
    """Predictions for ``examples`` (no ``max_tokens`` cap) and the seconds spent."""
    inputs = [example.to_input() for example in examples]
    predictions: list[LengthPrediction] = []
    started_at_s = time.perf_counter()
    for start in range(0, len(inputs), batch_size):
        predictions.extend(predictor.predict(inputs[start : start + batch_size]))
    return predictions, time.perf_counter() - started_at_s


def _interval_coverage(predictions: Sequence[LengthPrediction], truth: np.ndarray) -> float:
    if not predictions:
        return float("nan")
    lower = np.array([p.p10_tokens for p in predictions])
    upper = np.array([p.p90_tokens for p in predictions])
    return float(((truth >= lower) & (truth <= upper)).mean())


def score_predictions(
    predictions: Sequence[LengthPrediction],
    examples: Sequence[LengthExample],
    baseline_tokens: float,
) -> dict[str, Any]:
    """Metrics of the p50 predictions with the constant baseline and definitions."""
    truth = output_tokens_array(examples)
    predicted = np.array([p.predicted_output_tokens for p in predictions], dtype=np.float64)
    metrics = compute_metrics_with_baseline(predicted, truth, baseline_tokens)
    metrics["p10_p90_coverage"] = _interval_coverage(predictions, truth)
    metrics["mape_definition"] = MAPE_DEFINITION
    metrics["accuracy_definition"] = ACCURACY_DEFINITION
    return metrics


def _fit_backend(
    backend: str,
    train_examples: Sequence[LengthExample],
    out_dir: Path,
    seed: int,
    backend_options: dict[str, Any],
) -> tuple[LengthPredictor, dict[str, Any]]:
    """Fit and save the backend's model files; return the model and manifest extras."""
    prompts = [example.prompt for example in train_examples]
    outputs = [example.output_tokens for example in train_examples]
    if backend == "fast":
        from predictor_service.models.fast import FastConfig
        from predictor_service.models.fast_fit import train_fast

        config = backend_options.get("fast_config") or FastConfig()
        fast_model = train_fast(
            prompts,
            [example.prompt_tokens for example in train_examples],
            [example.num_turns for example in train_examples],
            outputs,
            config,
            seed=seed,
        )
        fast_model.save(out_dir)
        return fast_model, fast_model.manifest_extra()
    from predictor_service.models.transformer import MINILM, train_transformer

    base_model = backend_options.get("base_model") or MINILM
    model, losses = train_transformer(
        prompts, outputs, base_model, backend_options.get("transformer_config"), seed=seed
    )
    model.save(out_dir)
    extra = model.manifest_extra()
    extra.update(
        base_model=str(base_model),
        num_steps=len(losses),
        first_loss=losses[0] if losses else None,
        last_loss=losses[-1] if losses else None,
    )
    return model, extra


def train(
    data_path: str | os.PathLike[str],
    backend: str,
    out_dir: str | os.PathLike[str],
    seed: int = 0,
    *,
    options: TrainOptions | None = None,
    token_counter: TokenCounter | None = None,
    **backend_options: Any,
) -> Manifest:
    """Train ``backend`` on ``data_path`` and write the model into ``out_dir``.

    ``backend_options``: ``fast_config`` (:class:`FastConfig`) for ``fast``;
    ``base_model`` (default :data:`~predictor_service.models.transformer.MINILM`) and
    ``transformer_config`` (:class:`TransformerTrainConfig`) for ``transformer``; both
    for ``auto`` (:data:`AUTO_MEMBERS` into subdirectories, blended as an ``ensemble``
    with the weight that minimises the validation MAE). Returns the written manifest.
    ``out_dir`` is created; files of an earlier model there are overwritten.
    """
    if backend not in TRAINABLE_BACKENDS:
        raise ValueError(f"train: backend must be one of {TRAINABLE_BACKENDS} (got {backend!r})")
    settings = options or TrainOptions()
    counter = token_counter or get_token_counter()
    split = load_split(
        data_path,
        counter,
        val_fraction=settings.val_fraction,
        first_turn_only=settings.first_turn_only,
        max_examples=settings.max_examples,
    )
    if not split.train:
        raise ValueError(f"{data_path}: no training examples (need human->gpt conversations)")
    run = _TrainingRun(split, seed, counter, settings)
    directory = Path(out_dir)
    if backend != "auto":
        return _train_one(run, backend, directory, backend_options)[1]
    members: dict[str, LengthPredictor] = {}
    member_predictions: dict[str, list[LengthPrediction]] = {}
    seconds = 0.0
    for name in AUTO_MEMBERS:
        members[name], manifest, member_predictions[name] = _train_one(
            run, name, directory / name, backend_options
        )
        seconds += manifest.training_seconds
    return _write_ensemble(run, members, member_predictions, directory, seconds)


@dataclass(frozen=True)
class _TrainingRun:
    """What every model of one ``train`` call shares."""

    split: DatasetSplit
    seed: int
    counter: TokenCounter
    settings: TrainOptions


def _train_one(
    run: _TrainingRun, backend: str, directory: Path, backend_options: dict[str, Any]
) -> tuple[LengthPredictor, Manifest, list[LengthPrediction]]:
    """Fit, save and score one backend; its validation predictions come back too."""
    directory.mkdir(parents=True, exist_ok=True)
    started_at_s = time.perf_counter()
    model, extra = _fit_backend(backend, run.split.train, directory, run.seed, backend_options)
    training_seconds = time.perf_counter() - started_at_s
    predictions, _ = predict_in_batches(model, run.split.val, _PREDICT_BATCH_SIZE)
    manifest = _write_trained(run, backend, model, predictions, extra, directory, training_seconds)
    return model, manifest, predictions


def _write_ensemble(
    run: _TrainingRun,
    members: dict[str, LengthPredictor],
    member_predictions: dict[str, list[LengthPrediction]],
    directory: Path,
    training_seconds: float,
) -> Manifest:
    """The blend of ``fast`` and ``transformer`` with the validation's best weight
    (chosen on the members' validation predictions; the blend is then scored as it
    predicts)."""
    from predictor_service.models.ensemble import EnsembleLengthModel, choose_weight

    split = run.split
    weight, errors = choose_weight(
        member_predictions["fast"], member_predictions["transformer"], output_tokens_array(split.val)
    )
    model = EnsembleLengthModel(
        members,
        {"fast": round(1 - weight, 1), "transformer": weight},
        int(output_tokens_array(split.train).max()),
    )
    extra = model.manifest_extra()
    extra["val_mae_by_transformer_weight"] = {str(w): round(e, 3) for w, e in errors.items()}
    predictions, _ = predict_in_batches(model, split.val, _PREDICT_BATCH_SIZE)
    return _write_trained(run, "ensemble", model, predictions, extra, directory, training_seconds)


def _write_trained(
    run: _TrainingRun,
    backend: str,
    model: LengthPredictor,
    predictions: Sequence[LengthPrediction],
    extra: dict[str, Any],
    directory: Path,
    training_seconds: float,
) -> Manifest:
    """Score ``predictions`` (``model``'s on the validation split) and write the manifest
    into ``directory``."""
    split, settings, counter = run.split, run.settings, run.counter
    train_targets = output_tokens_array(split.train)
    baseline_tokens = float(np.median(train_targets))
    metrics = score_predictions(predictions, split.val, baseline_tokens)
    edges, fractions = prompt_token_bins([example.prompt_tokens for example in split.train])
    manifest = Manifest(
        backend=backend,
        version=model.version,
        tokenizer_name=counter.name,
        data_sha256=split.data_sha256,
        training_max_tokens=int(train_targets.max()),
        baseline_median_tokens=baseline_tokens,
        num_train_examples=len(split.train),
        num_val_examples=len(split.val),
        seed=run.seed,
        created_at_s=time.time(),
        training_seconds=round(training_seconds, 3),
        val_fraction=settings.val_fraction,
        first_turn_only=settings.first_turn_only,
        metrics=metrics,
        prompt_token_bin_edges=edges,
        prompt_token_bin_fractions=fractions,
        extra=extra,
    )
    write_manifest(directory, manifest)
    logger.info(
        "predictor_trained",
        backend=backend,
        version=model.version,
        out_dir=str(directory),
        training_seconds=round(training_seconds, 1),
        val_mae=metrics.get("mae"),
        baseline_mae=metrics["baseline"].get("mae"),
    )
    return manifest


def evaluate(
    model_dir: str | os.PathLike[str],
    data_path: str | os.PathLike[str],
    *,
    split: str = "auto",
    batch_size: int = _PREDICT_BATCH_SIZE,
    max_examples: int | None = None,
) -> dict[str, Any]:
    """Score the model in ``model_dir`` on ``data_path``.

    ``split``: ``"val"`` (the model's validation split of the file), ``"all"`` (every
    example) or ``"auto"`` (``"val"`` when the file's sha256 matches the manifest's
    training data, else ``"all"``). Token counts use the manifest's tokenizer. Returns
    the metrics of :func:`score_predictions` (baseline: the manifest's training median)
    plus ``predictions_per_s`` (batched, ``batch_size`` inputs per call, wall time of
    the predict calls only), ``split``, ``backend``, ``version`` and ``tokenizer``.
    """
    if split not in ("auto", "val", "all"):
        raise ValueError(f"split: must be 'auto', 'val' or 'all' (got {split!r})")
    manifest = read_manifest(model_dir)
    predictor = load_predictor(manifest.backend, str(model_dir))
    counter = get_token_counter(manifest.tokenizer_name)
    examples = load_examples(
        data_path, counter, first_turn_only=manifest.first_turn_only, max_examples=max_examples
    )
    if split == "auto":
        split = "val" if file_sha256(data_path) == manifest.data_sha256 else "all"
    if split == "val":
        examples = list(split_examples(examples, manifest.val_fraction)[1])
    predictions, elapsed_s = predict_in_batches(predictor, examples, batch_size)
    result = score_predictions(predictions, examples, manifest.baseline_median_tokens)
    result["predictions_per_s"] = len(examples) / elapsed_s if elapsed_s > 0 else float("nan")
    result.update(
        split=split, backend=manifest.backend, version=predictor.version, tokenizer=counter.name
    )
    return result
