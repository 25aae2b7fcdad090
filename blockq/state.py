"""The state directory of a ``blockq up`` cluster: where its Redis keeps data, where the
supervisor records its pid, the Redis URL and its children, and where logs go."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATE_FILE = "cluster.json"


@dataclass
class ClusterState:
    supervisor_pid: int
    redis_url: str
    redis_pid: int | None = None
    embedded_redis: bool = False
    gateway_url: str | None = None
    children: dict[str, int] = field(default_factory=dict)
    num_instances: int = 0
    ready: bool = False
    started_at_s: float = 0.0

    def write(self, state_dir: Path) -> None:
        """Atomically (re)write the state file."""
        state_dir.mkdir(parents=True, exist_ok=True)
        tmp = state_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, state_dir / STATE_FILE)

    @classmethod
    def read(cls, state_dir: Path) -> ClusterState | None:
        path = state_dir / STATE_FILE
        try:
            data: dict[str, Any] = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    @staticmethod
    def remove(state_dir: Path) -> None:
        (state_dir / STATE_FILE).unlink(missing_ok=True)


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
