"""The state directory of a ``blockq up`` cluster: where its Redis keeps data, where the
supervisor records its pid, the Redis URL and its children, and where logs go.

Two records, both 0600: ``supervisor.json``, the supervisor's identity, written by ``up``
the moment it starts the supervisor (and by the supervisor itself, first thing), so that
``blockq down`` finds a cluster that is still starting; and ``cluster.json`` (it holds the
Redis URL with its password), rewritten as each process starts. Each pid comes with the
process's start time and command line (:class:`ProcessIdentity`): ``blockq down`` signals
a pid only while it is still that process, never a stranger given the pid after ours
exited. Every process of a cluster also carries ``BLOCKQ_CLUSTER=<state dir>`` in its
environment (:data:`CLUSTER_ENV`), which its own children inherit: that is how ``down``
finds the processes no record names (docs/commands.md, "Stopping a cluster")."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

STATE_FILE = "cluster.json"
SUPERVISOR_FILE = "supervisor.json"
# In the environment of every process of a cluster: its state directory, resolved.
CLUSTER_ENV = "BLOCKQ_CLUSTER"
# Put in the environment by a caller (a test session, a CI job): every process started
# under it inherits it, so that what is left of the run can be listed afterwards.
RUN_ID_ENV = "BLOCKQ_RUN_ID"
# Start times are compared with a tolerance: both come from clock ticks since boot.
START_TIME_TOLERANCE_S = 0.05
# How long a process just started may take to show its command line (it is inside exec).
EXEC_GRACE_S = 0.5
_CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cluster_marker(state_dir: Path) -> str:
    """The value of :data:`CLUSTER_ENV` for the cluster of ``state_dir``."""
    return str(state_dir.resolve())


def _started_after_boot_s(pid: int) -> float | None:
    """Seconds from boot to the start of ``pid`` (/proc/PID/stat field 22), None where
    there is no /proc. Unlike psutil's create_time(), which adds the boot time derived
    from the wall clock at each call, it does not move when the clock is stepped."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # the name may hold spaces and parentheses
    try:
        return int(fields[19]) / _CLOCK_TICKS_PER_S
    except (IndexError, ValueError):
        return None


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
    """What tells a process apart from a later one with the same pid: its start (seconds
    since boot, and on the wall clock, for people and for systems without /proc) and its
    command line."""

    pid: int
    started_at_s: float
    cmdline: tuple[str, ...]
    started_after_boot_s: float | None = None

    @classmethod
    def try_of(cls, pid: int | None, *, exec_grace_s: float = 0.0) -> ProcessIdentity | None:
        """The identity of the live process ``pid``; None if there is none, it is a zombie
        (it has exited), this user may not look at it, or its command line is empty.

        The command line reads empty while the process is inside exec (a child that
        Popen has just returned: the old memory is gone, the new arguments not yet set
        up) and once it is exiting; ``exec_grace_s`` waits that long for it to appear,
        so that a child recorded the moment it starts is recorded by its real one."""
        if not pid:
            return None
        deadline_s = time.monotonic() + exec_grace_s
        while True:
            try:
                process = psutil.Process(pid)
                cmdline = tuple(process.cmdline())
                if process.status() == psutil.STATUS_ZOMBIE:
                    return None
                identity = cls(pid, process.create_time(), cmdline, _started_after_boot_s(pid))
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                return None
            if cmdline:
                return identity
            if time.monotonic() >= deadline_s:
                return None
            time.sleep(0.002)

    def to_map(self) -> dict[str, Any]:
        return {"pid": self.pid, "started_at_s": self.started_at_s, "cmdline": list(self.cmdline),
                "started_after_boot_s": self.started_after_boot_s}

    @classmethod
    def from_map(cls, data: dict[str, Any]) -> ProcessIdentity:
        after_boot = data.get("started_after_boot_s")
        return cls(int(data["pid"]), float(data["started_at_s"]), tuple(data.get("cmdline", ())),
                   float(after_boot) if after_boot is not None else None)

    def describe(self) -> str:
        """``pid N (command line)``, for messages."""
        command = " ".join(" ".join(self.cmdline).split())  # Redis pads its process title
        return f"pid {self.pid} ({command[:160]})"

    def try_signal(self, signum: int) -> bool:
        """Send ``signum`` if ``pid`` is still this process; False if it is not (or gone)."""
        if not self.is_alive():
            return False
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            return False
        return True

    def is_running(self) -> bool:
        """True until the process has exited (a zombie has): :meth:`is_alive`, or, while it
        exits, the same start since boot with its command line already gone."""
        if self.is_alive():
            return True
        if self.started_after_boot_s is None:
            return False
        try:
            process = psutil.Process(self.pid)
            exiting = process.status() != psutil.STATUS_ZOMBIE and not process.cmdline()
        except psutil.Error:
            return False
        started_s = _started_after_boot_s(self.pid)
        return (exiting and started_s is not None
                and abs(started_s - self.started_after_boot_s) <= START_TIME_TOLERANCE_S)

    def is_alive(self) -> bool:
        """True while ``pid`` is still this process: same start, same command line. The
        start is compared in seconds since boot where both sides have it: the wall-clock
        start moves with every step of the clock (NTP, a resumed VM), and a moved start
        made every process of a running cluster look like a stranger to ``down``."""
        now = ProcessIdentity.try_of(self.pid)
        if now is None or now.cmdline != self.cmdline:
            return False
        if now.started_after_boot_s is not None and self.started_after_boot_s is not None:
            return abs(now.started_after_boot_s - self.started_after_boot_s) <= START_TIME_TOLERANCE_S
        return abs(now.started_at_s - self.started_at_s) <= START_TIME_TOLERANCE_S


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
    # child name -> {"num_restarts": deaths in a row, "returncode": the last exit's} of the
    # children that died; `up` gives up on a cluster whose child keeps dying as it starts
    child_failures: dict[str, dict[str, int]] = field(default_factory=dict)

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
                identity = ProcessIdentity.try_of(pid, exec_grace_s=EXEC_GRACE_S)
                if identity is not None:
                    known[str(pid)] = identity.to_map()
        self.identities = known

    def supervisor_is_alive(self) -> bool:
        """Is the recorded supervisor still running (by identity when one was recorded)?"""
        recorded = self.identities.get(str(self.supervisor_pid))
        if recorded is None:
            return pid_alive(self.supervisor_pid)
        return ProcessIdentity.from_map(recorded).is_alive()

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
        """Remove both records (the cluster is stopped)."""
        (state_dir / STATE_FILE).unlink(missing_ok=True)
        (state_dir / SUPERVISOR_FILE).unlink(missing_ok=True)


def record_supervisor(state_dir: Path, identity: ProcessIdentity) -> None:
    """Write ``supervisor.json``: who the supervisor of ``state_dir`` is, before it starts
    anything (``down`` finds a cluster still starting by it)."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_private_text(state_dir / SUPERVISOR_FILE, json.dumps(identity.to_map(), indent=2))


def read_supervisor(state_dir: Path) -> ProcessIdentity | None:
    """The identity ``supervisor.json`` records; None without one."""
    try:
        return ProcessIdentity.from_map(json.loads((state_dir / SUPERVISOR_FILE).read_text()))
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


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
