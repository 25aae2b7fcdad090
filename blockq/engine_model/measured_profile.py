"""A measured engine profile: the step-latency model ``blockq profile`` fitted on one real
engine, with the engine configuration it was measured under and the fit's error.

The file is JSON (``--out PROFILE.json``); ``--profile PROFILE.json`` loads it wherever a
latency model is needed: ``blockq simulate`` and ``blockq fidelity`` (the engine model's
steps), the dispatcher (the prior for instances that publish no latency model) and a
worker (the latency model its beats publish, and an emulated engine's step times).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blockq.engine_model.config import EngineConfig
from blockq.engine_model.latency import StepLatencyModel

PROFILE_FORMAT = 1
PROFILE_KIND = "blockq-engine-profile"


@dataclass(frozen=True)
class MeasuredProfile:
    """``fit`` holds the fit's error per step kind and where the samples came from."""

    latency_model: StepLatencyModel
    engine_config: EngineConfig
    model: str = ""
    fit: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"format": PROFILE_FORMAT, "kind": PROFILE_KIND, "model": self.model,
                "engine_config": self.engine_config.to_dict(),
                "latency_model": self.latency_model.to_dict(), "fit": self.fit}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MeasuredProfile:
        """Raises ValueError naming the field when the document is not a profile."""
        if not isinstance(data, dict) or data.get("kind") != PROFILE_KIND:
            raise ValueError(f"kind: not a {PROFILE_KIND} document")
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"format: expected {PROFILE_FORMAT} (got {data.get('format')!r})")
        for name in ("latency_model", "engine_config"):
            if not isinstance(data.get(name), dict):
                raise ValueError(f"{name}: is required (an object)")
        return cls(StepLatencyModel.from_dict(data["latency_model"]),
                   EngineConfig.from_dict(data["engine_config"]), str(data.get("model", "")),
                   dict(data.get("fit") or {}))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def load_profile(path: str | Path) -> MeasuredProfile:
    """Read a profile file.

    Raises:
        ValueError: naming the file and the field, for a file that is not a valid profile
            (a missing file raises FileNotFoundError).
    """
    try:
        return MeasuredProfile.from_dict(json.loads(Path(path).read_text()))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--profile {path}: {exc}") from exc
