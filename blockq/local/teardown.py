"""``blockq down``: stop every process of a local cluster, and say which could not be.

Which processes are the cluster's: those the records name (``supervisor.json``,
``cluster.json``) while they are still the processes recorded (start time and command
line, :class:`~blockq.local.state.ProcessIdentity`), their descendants, and every process
whose environment carries the cluster's ``BLOCKQ_CLUSTER`` (children of a supervisor that
died, and what they started). A recorded pid that is another process now is left alone.

How: SIGTERM the supervisor, which stops the rest in order (workers drain, Redis last);
what is left after it (or all of it, when the supervisor is gone) is sent SIGTERM directly,
the services before Redis; what is still running after ``timeout_s`` gets SIGKILL. The
records are removed only when nothing is left; otherwise they stay, so that a later
``down`` finds the cluster again, and the report names each survivor."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

from blockq.local.processes import ancestors_and_self, list_project_processes
from blockq.local.state import ClusterState, ProcessIdentity, read_supervisor
from blockq.runtime.service_runner import add_common_arguments, settings_from_args

# The longest wait for SIGKILLed processes to vanish (shorter when timeout_s is).
KILL_GRACE_S = 5.0
POLL_S = 0.05


@dataclass(frozen=True)
class StopReport:
    """What :func:`stop_cluster` did. ``found``: something was recorded or running for the
    state directory; ``num_killed``: processes that needed SIGKILL; ``num_unidentified``:
    recorded pids left alone because they belong to other processes now; ``survivors``:
    processes of the cluster still running, each with why."""

    found: bool
    num_killed: int = 0
    num_unidentified: int = 0
    survivors: tuple[tuple[ProcessIdentity, str], ...] = ()


@dataclass(frozen=True)
class _Records:
    supervisor: ProcessIdentity | None
    redis_pid: int | None
    identities: tuple[ProcessIdentity, ...]


def _read_records(state_dir: Path) -> _Records | None:
    state = ClusterState.read(state_dir)
    supervisor = read_supervisor(state_dir)
    if state is None:
        return _Records(supervisor, None, (supervisor,)) if supervisor is not None else None
    identities = {int(pid): ProcessIdentity.from_map(data) for pid, data in state.identities.items()}
    if supervisor is None and state.supervisor_pid in identities:
        supervisor = identities[state.supervisor_pid]
    if supervisor is not None:
        identities.setdefault(supervisor.pid, supervisor)
    return _Records(supervisor, state.redis_pid, tuple(identities.values()))


def _descendants(identity: ProcessIdentity) -> list[ProcessIdentity]:
    try:
        children = psutil.Process(identity.pid).children(recursive=True)
    except psutil.Error:
        return []
    found = (ProcessIdentity.try_of(child.pid) for child in children)
    return [child for child in found if child is not None]


def _cluster_processes(state_dir: Path, records: _Records | None) -> tuple[list[ProcessIdentity], int]:
    """(the cluster's live processes, recorded pids that are other processes now)."""
    recorded = list(records.identities) if records is not None else []
    verified = [identity for identity in recorded if identity.is_alive()]
    verified_pids = {identity.pid for identity in verified}
    # A zombie (a child its parent has not reaped yet) has exited: neither ours nor a stranger.
    num_unidentified = sum(1 for i in recorded
                           if i.pid not in verified_pids and ProcessIdentity.try_of(i.pid) is not None)
    # Never this process or an ancestor (a state file a test wrote in its own name), nor
    # their descendants: what a down is run from is not the cluster it stops.
    skipped = ancestors_and_self()
    verified = [identity for identity in verified if identity.pid not in skipped]
    marked = [p.identity for p in list_project_processes(cluster_dir=state_dir)]
    by_pid: dict[int, ProcessIdentity] = {}
    for identity in [*verified, *(d for v in verified for d in _descendants(v)), *marked]:
        if identity.pid not in skipped:
            by_pid.setdefault(identity.pid, identity)
    return list(by_pid.values()), num_unidentified


def _send(identities: Iterable[ProcessIdentity], signum: int, errors: dict[int, str]) -> int:
    """Signal each that is still the process recorded; how many were signalled."""
    num_sent = 0
    for identity in identities:
        try:
            num_sent += identity.try_signal(signum)
        except PermissionError:
            errors[identity.pid] = f"not signalled: permission denied ({signal.Signals(signum).name})"
    return num_sent


def _wait(done: Callable[[], bool], deadline_s: float) -> None:
    while not done() and time.monotonic() < deadline_s:
        time.sleep(POLL_S)


def _running(identities: Iterable[ProcessIdentity]) -> list[ProcessIdentity]:
    """Those not exited yet: one that is exiting still holds its ports and files."""
    return [identity for identity in identities if identity.is_running()]


def _terminate(processes: list[ProcessIdentity], records: _Records | None, timeout_s: float,
               errors: dict[int, str]) -> None:
    """SIGTERM in order and wait, all within ``timeout_s``."""
    deadline_s = time.monotonic() + timeout_s
    supervisor_pid = records.supervisor.pid if records is not None and records.supervisor else None
    supervisor = [p for p in processes if p.pid == supervisor_pid]
    if supervisor and _send(supervisor, signal.SIGTERM, errors):
        # It stops its children before it exits; what is left then, it did not know of.
        _wait(lambda: not _running(supervisor), deadline_s)
    # Without a (working) supervisor: the services first, so that they finish with Redis up.
    redis_pid = records.redis_pid if records is not None else None
    services = [p for p in _running(processes) if p.pid != redis_pid]
    if services:
        _send(services, signal.SIGTERM, errors)
        _wait(lambda: not _running(services), deadline_s)
    rest = _running(processes)
    if rest:
        _send(rest, signal.SIGTERM, errors)
        _wait(lambda: not _running(rest), deadline_s)


def _kill(processes: list[ProcessIdentity], grace_s: float, errors: dict[int, str]) -> int:
    """SIGKILL what is still running; wait up to ``grace_s`` for it to vanish."""
    left = _running(processes)
    num_killed = _send(left, signal.SIGKILL, errors)
    _wait(lambda: not _running(left), time.monotonic() + grace_s)
    return num_killed


def stop_cluster(state_dir: Path, timeout_s: float) -> StopReport:
    """Stop the cluster of ``state_dir`` (see the module's docstring); idempotent."""
    records = _read_records(state_dir)
    processes, num_unidentified = _cluster_processes(state_dir, records)
    if records is None and not processes:
        return StopReport(found=False)
    errors: dict[int, str] = {}
    grace_s = min(KILL_GRACE_S, max(timeout_s, POLL_S))
    _terminate(processes, records, timeout_s, errors)
    num_killed = _kill(processes, grace_s, errors)
    # A last look: a process started while the others stopped (a child the supervisor
    # restarted just before its SIGTERM) is stopped too.
    known_pids = {p.pid for p in processes}
    late = [p for p in _cluster_processes(state_dir, _read_records(state_dir))[0] if p.pid not in known_pids]
    if late:
        _send(late, signal.SIGTERM, errors)
        _wait(lambda: not _running(late), time.monotonic() + grace_s)
        num_killed += _kill(late, grace_s, errors)
    survivors = tuple((p, errors.get(p.pid, "still running after SIGKILL")) for p in _running([*processes, *late]))
    if not survivors:
        ClusterState.remove(state_dir)
    return StopReport(True, num_killed, num_unidentified, survivors)


# --- `blockq down` ----------------------------------------------------------------------


def add_down(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("down", help="stop the local cluster started by `blockq up`")
    add_common_arguments(p)
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.set_defaults(handler=cmd_down)


def cmd_down(args: argparse.Namespace) -> int:
    """0 once no process of the cluster is left (or none was there); 1, naming each
    process still running and why, otherwise (its records are kept for the next try)."""
    settings = settings_from_args(args, require_redis=False)
    state_dir = settings.state_dir
    report = stop_cluster(state_dir, args.timeout_s)
    if not report.found:
        sys.stdout.write(f"no cluster running from {state_dir}\n")
        return 0
    if report.survivors:
        lines = "".join(f"  {identity.describe()}: {why}\n" for identity, why in report.survivors)
        sys.stderr.write(f"blockq down: {len(report.survivors)} processes of the cluster in {state_dir} are still "
                         f"running:\n{lines}its records stay in {state_dir}: `blockq down` again stops what it can\n")
        return 1
    notes = []
    if report.num_killed:
        notes.append(f"killed {report.num_killed} stuck processes")
    if report.num_unidentified:
        notes.append(f"left {report.num_unidentified} recorded pids alone: they are other processes now")
    sys.stdout.write("blockq is down" + (f" ({'; '.join(notes)})" if notes else "") + "\n")
    return 0
