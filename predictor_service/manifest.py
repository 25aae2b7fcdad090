"""The manifest written next to every trained model (``manifest.json``).

It records what the model is (backend, version), what it was trained on (data sha256,
tokenizer, seed, example counts), its bounds (``training_max_tokens``), its validation
metrics and those of the constant-median baseline, the training prompt-length
distribution (for drift monitoring) and backend-specific settings (``extra``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

MANIFEST_FILE_NAME = "manifest.json"
MANIFEST_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Manifest:
    """Description of one trained model directory.

    ``metrics`` holds the validation metrics (:func:`blockq.prediction_accuracy.
    compute_metrics` keys) with a nested ``baseline`` of the same keys for the constant
    predictor ``baseline_median_tokens`` (median of the training targets).
    ``prompt_token_bin_edges`` are the inner edges of quantile bins of training prompt
    lengths (tokens) and ``prompt_token_bin_fractions`` the training share per bin (one
    more entry than edges). ``created_at_s`` is wall-clock epoch seconds.
    """

    backend: str
    version: str
    tokenizer_name: str
    data_sha256: str
    training_max_tokens: int
    baseline_median_tokens: float
    num_train_examples: int
    num_val_examples: int
    seed: int
    created_at_s: float
    training_seconds: float = 0.0
    val_fraction: float = 0.1
    first_turn_only: bool = True
    metrics: dict[str, Any] = field(default_factory=dict)
    prompt_token_bin_edges: tuple[float, ...] = ()
    prompt_token_bin_fractions: tuple[float, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    schema_version: int = MANIFEST_SCHEMA_VERSION

    def with_updates(self, **changes: Any) -> Manifest:
        """Return a copy with ``changes`` applied (manifests are never mutated)."""
        return replace(self, **changes)

    def to_json_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict of all fields."""
        data = asdict(self)
        data["prompt_token_bin_edges"] = list(self.prompt_token_bin_edges)
        data["prompt_token_bin_fractions"] = list(self.prompt_token_bin_fractions)
        return data

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> Manifest:
        """Build a manifest from :meth:`to_json_dict` output; unknown keys are ignored."""
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        known["prompt_token_bin_edges"] = tuple(known.get("prompt_token_bin_edges", ()))
        known["prompt_token_bin_fractions"] = tuple(known.get("prompt_token_bin_fractions", ()))
        return cls(**known)


def write_manifest(model_dir: str | os.PathLike[str], manifest: Manifest) -> Path:
    """Write ``manifest.json`` into ``model_dir`` atomically (temp file + rename)."""
    path = Path(model_dir) / MANIFEST_FILE_NAME
    temp_path = path.with_suffix(".json.tmp")
    temp_path.write_text(json.dumps(manifest.to_json_dict(), indent=2, sort_keys=True))
    os.replace(temp_path, path)
    return path


def read_manifest(model_dir: str | os.PathLike[str]) -> Manifest:
    """Read ``model_dir/manifest.json``; ``FileNotFoundError`` names the missing path."""
    path = Path(model_dir) / MANIFEST_FILE_NAME
    if not path.is_file():
        raise FileNotFoundError(f"model manifest not found: {path}")
    return Manifest.from_json_dict(json.loads(path.read_text()))
