"""The state directory of a ``blockq up`` cluster: where its Redis keeps data, where the
supervisor records its pid, the Redis URL and its children, and where logs go.

The state file holds the Redis URL with its password, so it is written 0600. Each pid it
names comes with the process's start time and command line (:class:`ProcessIdentity`):
``blockq down`` signals a pid only while it is still that process, never a stranger that
was given the pid after ours exited."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

STATE_FILE = "cluster.json"
# Start times are compared with a tolerance: psutil derives them from clock ticks since boot.
START_TIME_TOLERANCE_S = 0.05


def write_private_text(path: Path, text: str) -> None:
    """Atomically write ``text`` to ``path`` with mode 0600 (readable by this user only)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(text)
    os.replace(tmp, path)


@dataclass(frozen=True)
class ProcessIdentity:
    """What tells a process apart from a later one with the same pid."""

    pid: int
    started_at_s: float
    cmdline: tuple[str, ...]

    @classmethod
    def try_of(cls, pid: int | None) -> ProcessIdentity | None:
        """The identity of the live process ``pid``; None if there is none (or no access)."""
        if not pid:
            return None
        try:
            process = psutil.Process(pid)
            return cls(pid, process.create_time(), tuple(process.cmdline()))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return None

    def to_map(self) -> dict[str, Any]:
        return {"pid": self.pid, "started_at_s": self.started_at_s, "cmdline": list(self.cmdline)}

    @classmethod
    def from_map(cls, data: dict[str, Any]) -> ProcessIdentity:
        return cls(int(data["pid"]), float(data["started_at_s"]), tuple(data.get("cmdline", ())))

    def try_signal(self, signum: int) -> bool:
        """Send ``signum`` if ``pid`` is still this process; False if it is not (or gone)."""
        if not self.is_alive():
            return False
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            return False
        return True

    def is_alive(self) -> bool:
        """True while ``pid`` is still this process: same start time, same command line."""
        now = ProcessIdentity.try_of(self.pid)
        return (now is not None and abs(now.started_at_s - self.started_at_s) <= START_TIME_TOLERANCE_S
                and now.cmdline == self.cmdline)


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
    # str(pid) -> ProcessIdentity.to_map() of the supervisor, Redis and every child
    identities: dict[str, dict[str, Any]] = field(default_factory=dict)
    # child name -> the URL of its Prometheus /metrics (children that serve them)
    metrics_urls: dict[str, str] = field(default_factory=dict)

    def write(self, state_dir: Path) -> None:
        """Atomically (re)write the state file, mode 0600 (it holds the Redis password)."""
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private_text(state_dir / STATE_FILE, json.dumps(asdict(self), indent=2))

    def record_identities(self) -> None:
        """Record who every pid named here is now (keeps those already recorded)."""
        pids = [self.supervisor_pid, self.redis_pid, *self.children.values()]
        known = {key: value for key, value in self.identities.items() if int(key) in pids}
        for pid in pids:
            if pid and str(pid) not in known:
                identity = ProcessIdentity.try_of(pid)
                if identity is not None:
                    known[str(pid)] = identity.to_map()
        self.identities = known

    def supervisor_is_alive(self) -> bool:
        """Is the recorded supervisor still running (by identity when one was recorded)?"""
        recorded = self.identities.get(str(self.supervisor_pid))
        if recorded is None:
            return pid_alive(self.supervisor_pid)
        return ProcessIdentity.from_map(recorded).is_alive()

    def owned_processes(self) -> list[ProcessIdentity]:
        """The processes named here that are still the ones recorded (safe to signal)."""
        identities = [ProcessIdentity.from_map(value) for value in self.identities.values()]
        return [identity for identity in identities if identity.is_alive()]

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
