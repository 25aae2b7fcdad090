"""Which processes of this project are running: those of ``blockq up`` clusters (found by
the ``BLOCKQ_CLUSTER`` their environment carries, so a child whose parent died is found
too), those of a run that tagged itself with ``BLOCKQ_RUN_ID`` (a test session), any
``python -m`` of one of the project's packages, and the embedded Redis servers (this
environment's redis-server; one whose data directory is ``<state dir>/redis`` belongs to
that cluster: Redis rewrites its process title over its environment, so it shows none).

``python -m blockq.local.processes [--run-id ID] [--json]`` lists them and exits 1 when
any is left: the check run after CI ("0 processes left"), and what ``blockq down`` and the
test session's finalizer use to find what the state files do not name."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from blockq.local.state import CLUSTER_ENV, RUN_ID_ENV, ProcessIdentity

# Top-level packages whose `python -m` entry points are this project's services and tools.
PROJECT_PACKAGES = frozenset({"blockq", "dispatcher", "workers", "predictor_service", "loadgen"})


@dataclass(frozen=True)
class ProjectProcess:
    """A running process of the project: who it is, the state directory of the cluster
    it belongs to (None: none) and the run that started it (None: untagged)."""

    identity: ProcessIdentity
    cluster_dir: Path | None
    run_id: str | None

    def describe(self) -> str:
        where = f" of the cluster in {self.cluster_dir}" if self.cluster_dir else ""
        return f"{self.identity.describe()}{where}"


def ancestors_and_self() -> set[int]:
    """This process and its ancestors: never listed (nor signalled by ``down``)."""
    pids = {os.getpid()}
    with contextlib.suppress(psutil.Error):
        pids.update(parent.pid for parent in psutil.Process().parents())
    return pids


def _project_module(cmdline: list[str]) -> str | None:
    """The module of a ``python -m MODULE`` command line of this project, else None."""
    if "-m" not in cmdline[1:-1]:
        return None
    module = cmdline[cmdline.index("-m", 1) + 1]
    return module if module.split(".")[0] in PROJECT_PACKAGES else None


def _markers(process: psutil.Process) -> tuple[str | None, str | None]:
    """(``BLOCKQ_CLUSTER``, ``BLOCKQ_RUN_ID``) of ``process``'s environment (None: unset or
    unreadable, e.g. another user's process)."""
    try:
        environment = process.environ()
    except psutil.Error:
        return None, None
    return environment.get(CLUSTER_ENV) or None, environment.get(RUN_ID_ENV) or None


@functools.cache
def _redis_executable() -> str | None:
    from blockq.local.embedded_redis import RedisServerNotFound, find_redis_server

    try:
        return os.path.realpath(find_redis_server())
    except RedisServerNotFound:
        return None


def _redis_data_dir(process: psutil.Process) -> Path | None:
    """The data directory (its working directory, redis.conf's ``dir``) of an embedded
    Redis of this environment; None for any other process."""
    if process.info["name"] != "redis-server":
        return None
    try:
        executable, cwd = process.exe(), process.cwd()
    except psutil.Error:
        return None
    return Path(cwd) if executable and executable == _redis_executable() else None


def _candidates() -> Iterator[ProjectProcess]:
    skipped = ancestors_and_self()
    for process in psutil.process_iter(["pid", "name", "cmdline"]):
        if process.pid in skipped:
            continue
        cluster, run_id = _markers(process)
        redis_dir = _redis_data_dir(process) if cluster is None else None
        if redis_dir is not None and redis_dir.name == "redis":  # a cluster's: <state dir>/redis
            cluster = str(redis_dir.parent)
        if (cluster is None and run_id is None and redis_dir is None
                and _project_module(process.info["cmdline"] or []) is None):
            continue
        identity = ProcessIdentity.try_of(process.pid)
        if identity is not None:  # gone meanwhile, or a zombie: it has exited
            yield ProjectProcess(identity, Path(cluster) if cluster else None, run_id)


def list_project_processes(*, run_id: str | None = None, cluster_dir: Path | None = None) -> list[ProjectProcess]:
    """The project's running processes (not this one nor its ancestors), by pid; only
    those tagged ``run_id`` and only those of the cluster in ``cluster_dir`` when given."""
    wanted_cluster = cluster_dir.resolve() if cluster_dir is not None else None
    return sorted((p for p in _candidates()
                   if (run_id is None or p.run_id == run_id)
                   and (wanted_cluster is None or p.cluster_dir == wanted_cluster)),
                  key=lambda p: p.identity.pid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m blockq.local.processes",
                                     description="list this project's processes still running; exit 1 if any")
    parser.add_argument("--run-id", default=None, help=f"only those started under {RUN_ID_ENV}=ID")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    processes = list_project_processes(run_id=args.run_id)
    if args.json:
        sys.stdout.write(json.dumps([{**p.identity.to_map(), "cluster_dir": str(p.cluster_dir) if p.cluster_dir else None,
                                      "run_id": p.run_id} for p in processes], indent=2) + "\n")
    else:
        for process in processes:
            sys.stdout.write(process.describe() + (f" [run {process.run_id}]" if process.run_id else "") + "\n")
        sys.stdout.write(f"{len(processes)} processes of blockq running\n")
    return 1 if processes else 0


if __name__ == "__main__":
    sys.exit(main())
