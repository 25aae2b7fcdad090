"""Nothing of a local cluster outlives ``blockq down``: real ``blockq up`` clusters (embedded
Redis, predictor, dispatcher, workers) stopped after a wall-clock step, while ``up`` is still
starting them, and after their supervisor was SIGKILLed; ``down`` says which processes it
could not stop and exits non-zero; a metrics port that is taken stops ``up`` naming it; the
test session's reaper and the leftover listing used after CI."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from blockq.local.state import ClusterState, ProcessIdentity
from tests.conftest import REPO_ROOT, run_blockq, wait_until

CLUSTER_FLAGS = ("--instances", "1", "--time-scale", "0.25", "--metrics-base-port", "0")


def _env(state_dir: Path) -> dict[str, str]:
    return {"BLOCKQ_STATE_DIR": str(state_dir), "BLOCKQ_REDIS_URL": ""}


def _processes_of(state: ClusterState) -> list[psutil.Process]:
    """The live processes ``state`` names (psutil guards a later pid reuse on kill)."""
    processes = []
    for pid in (state.supervisor_pid, state.redis_pid, *state.children.values()):
        try:
            processes.append(psutil.Process(pid))
        except (psutil.NoSuchProcess, TypeError):
            continue
    return processes


def _running(processes: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture
def started() -> Iterator[list[psutil.Process]]:
    """Processes a test started; what ``down`` left is SIGKILLed here, so that a test
    showing a leak does not leak."""
    processes: list[psutil.Process] = []
    yield processes
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def _up(state_dir: Path, started: list[psutil.Process]) -> ClusterState:
    up = run_blockq("up", *CLUSTER_FLAGS, "--detach", env=_env(state_dir))
    state = ClusterState.read(state_dir)
    if state is not None:
        started.extend(_processes_of(state))
    assert up.returncode == 0, up.stderr + up.stdout
    assert state is not None
    return state


def _down_in_process(state_dir: Path, *flags: str) -> int:
    from blockq.cli.main import main

    return main(["down", "--state-dir", str(state_dir), *flags])


def test_an_identity_survives_a_wall_clock_step_and_tells_a_reused_pid(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil._pslinux as pslinux

    identity = ProcessIdentity.try_of(os.getpid())
    assert identity is not None and identity.started_after_boot_s is not None
    assert ProcessIdentity.from_map(identity.to_map()) == identity
    real_boot_time = pslinux.boot_time
    monkeypatch.setattr(pslinux, "boot_time", lambda: real_boot_time() + 30.0)
    assert identity.is_alive()
    earlier = ProcessIdentity(identity.pid, identity.started_at_s, identity.cmdline, identity.started_after_boot_s - 1)
    assert not earlier.is_alive()  # the pid of a process that started a second earlier: a reused pid
    # A state file written before starts since boot were recorded: the wall clock, as before.
    legacy = {"pid": identity.pid, "started_at_s": real_boot_time() + identity.started_after_boot_s,
              "cmdline": list(identity.cmdline)}
    assert ProcessIdentity.from_map(legacy).started_after_boot_s is None


def test_down_stops_the_cluster_after_the_wall_clock_steps(
        tmp_path: Path, started: list[psutil.Process], monkeypatch: pytest.MonkeyPatch,
        stdlib_logging: None, capsys: pytest.CaptureFixture[str]) -> None:
    """The leaked cluster of the issue: an NTP (or VM resume) step of the wall clock moves
    psutil's create_time() (boot time read from /proc/stat each call), so every recorded
    process looked like a stranger: down signalled none, deleted cluster.json, said
    'blockq is down' and exited 0."""
    state_dir = tmp_path / "state"
    state = _up(state_dir, started)
    processes = _processes_of(state)
    assert len(processes) == 5  # supervisor, Redis, predictor, dispatcher, workers-0
    import psutil._pslinux as pslinux

    real_boot_time = pslinux.boot_time
    with monkeypatch.context() as patched:
        patched.setattr(pslinux, "boot_time", lambda: real_boot_time() + 1.0)
        assert _down_in_process(state_dir, "--timeout-s", "30") == 0
    assert "blockq is down" in capsys.readouterr().out
    assert _running(processes) == []
    assert '"cluster_stopped"' in (state_dir / "logs" / "supervisor.log").read_text()


def _supervisor_of(up: subprocess.Popen[str]) -> psutil.Process | None:
    """The supervisor ``blockq up --detach`` started, once it runs Python."""
    try:
        children = psutil.Process(up.pid).children()
    except psutil.NoSuchProcess:
        return None
    for child in children:
        try:
            if "blockq.cli" in child.cmdline():
                return child
        except psutil.Error:
            continue
    return None


def test_down_while_up_is_starting_stops_what_up_starts(
        tmp_path: Path, started: list[psutil.Process], stdlib_logging: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``down`` run before the supervisor wrote cluster.json found nothing ("no cluster
    running", exit 0) and the cluster came up behind it."""
    state_dir = tmp_path / "state"
    up = subprocess.Popen([sys.executable, "-m", "blockq.cli", "up", *CLUSTER_FLAGS, "--detach",
                           "--ready-timeout-s", "60"], env={**os.environ, **_env(state_dir)}, cwd=REPO_ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        supervisor = wait_until(lambda: _supervisor_of(up), timeout_s=30, interval_s=0.005)
        assert isinstance(supervisor, psutil.Process)
        started.append(supervisor)
        # up records its supervisor right after starting it: give that a moment, not the
        # seconds the supervisor takes to start Redis and the services.
        deadline_s = time.monotonic() + 0.3
        while not (state_dir / "supervisor.json").exists() and time.monotonic() < deadline_s:
            time.sleep(0.005)
        assert not (state_dir / "cluster.json").exists()
        assert _down_in_process(state_dir, "--timeout-s", "30") == 0
        _, stderr = up.communicate(timeout=90)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        state = ClusterState.read(state_dir)
        if state is not None:
            started.extend(_processes_of(state))
    assert state is None, "the cluster came up after down"
    assert "blockq is down" in capsys.readouterr().out
    assert up.returncode != 0 and "before the cluster was ready" in stderr, stderr
    wait_until(lambda: not _running([supervisor]), timeout_s=10)
    from blockq.local.processes import list_project_processes

    assert list_project_processes(cluster_dir=state_dir) == []


def test_down_after_the_supervisor_died_stops_its_processes_promptly(
        tmp_path: Path, started: list[psutil.Process]) -> None:
    """A SIGKILLed supervisor (OOM killer, kill -9) leaves its children running: down
    SIGTERMs them itself (workers drain) instead of waiting out --timeout-s for a dead
    supervisor and SIGKILLing them; a process the cluster started that cluster.json does
    not name (a worker's engine subprocess, say) goes too."""
    state_dir = tmp_path / "state"
    state = _up(state_dir, started)
    processes = _processes_of(state)
    # As if the worker had started it: it inherits the cluster's environment.
    worker_env = psutil.Process(state.children["workers-0"]).environ()
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=worker_env,
                              start_new_session=True)
    started.append(psutil.Process(helper.pid))
    os.kill(state.supervisor_pid, signal.SIGKILL)
    wait_until(lambda: not _running(processes[:1]), timeout_s=10)
    started_s = time.monotonic()
    down = run_blockq("down", "--timeout-s", "20", env=_env(state_dir))
    elapsed_s = time.monotonic() - started_s
    assert down.returncode == 0, down.stderr + down.stdout
    assert "killed" not in down.stdout, down.stdout  # SIGTERM sufficed
    assert elapsed_s < 12, elapsed_s
    assert _running(processes) == []
    assert helper.wait(timeout=5) == -signal.SIGTERM


def test_down_names_what_it_could_not_stop_and_exits_non_zero(
        tmp_path: Path, started: list[psutil.Process], monkeypatch: pytest.MonkeyPatch,
        stdlib_logging: None, capsys: pytest.CaptureFixture[str]) -> None:
    """A process that outlives SIGKILL (uninterruptible sleep on a hung mount, say) is not
    'down': the state is kept so that a later down can find it again."""
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started.append(psutil.Process(stuck.pid))
    identity = wait_until(lambda: ProcessIdentity.try_of(stuck.pid))
    assert isinstance(identity, ProcessIdentity)
    state_dir = tmp_path / "state"
    ClusterState(supervisor_pid=stuck.pid, redis_url="redis://127.0.0.1:1/0",
                 identities={str(stuck.pid): identity.to_map()}).write(state_dir)
    real_try_signal = ProcessIdentity.try_signal

    def deaf(self: ProcessIdentity, signum: int) -> bool:  # delivered, and without effect
        return self.is_alive() if self.pid == stuck.pid else real_try_signal(self, signum)

    monkeypatch.setattr(ProcessIdentity, "try_signal", deaf)
    rc = _down_in_process(state_dir, "--timeout-s", "0.3")
    out = capsys.readouterr()
    assert rc != 0, out
    assert str(stuck.pid) in out.err and "still running after SIGKILL" in out.err, out
    assert ClusterState.read(state_dir) is not None
    assert stuck.poll() is None


def _listening_below_free_ports(num_free: int = 2) -> socket.socket:
    """A socket listening on 127.0.0.1:P where P+1..P+num_free are free (the predictor's
    and the worker's ports of a cluster with metrics base port P), below the ephemeral
    range, where outgoing connections would take them at random."""
    for port in range(21_000 + os.getpid() % 997 * 7, 32_000, 7):
        taken = socket.socket()
        try:
            for free in range(port + 1, port + 1 + num_free):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", free))
            taken.bind(("127.0.0.1", port))
        except OSError:
            taken.close()
            continue
        taken.listen()
        return taken
    raise AssertionError("no free ports")


def test_a_taken_metrics_port_fails_up_naming_it(tmp_path: Path, started: list[psutil.Process]) -> None:
    """The next cluster of the issue: its dispatcher ran without metrics on a port another
    (leaked) dispatcher held, and `blockq status` listed the stranger's URL as its own."""
    state_dir = tmp_path / "state"
    with _listening_below_free_ports() as taken:
        port = int(taken.getsockname()[1])
        up = run_blockq("up", "--instances", "1", "--time-scale", "0.25", "--metrics-base-port", str(port),
                        "--detach", "--ready-timeout-s", "60", env=_env(state_dir))
        state = ClusterState.read(state_dir)
        if state is not None:
            started.extend(_processes_of(state))
    assert up.returncode != 0, up.stdout
    assert "dispatcher" in up.stderr and f"metrics port {port}" in up.stderr, up.stderr
    assert state is None  # up stopped what it started
    from blockq.local.processes import list_project_processes

    assert list_project_processes(cluster_dir=state_dir) == []


def test_leftovers_are_listed_and_the_session_reaper_stops_them(tmp_path: Path,
                                                                 started: list[psutil.Process]) -> None:
    """What CI runs after the suite (``python -m blockq.local.processes``: exit 1 while a
    process of a cluster or of a test run is left) and what the session's finalizer does."""
    from blockq.local.processes import list_project_processes
    from blockq.local.state import CLUSTER_ENV, RUN_ID_ENV
    from tests.conftest import reap_session_clusters

    state_dir = tmp_path / "state"
    state_dir.mkdir()
    env = {**os.environ, CLUSTER_ENV: str(state_dir.resolve()), RUN_ID_ENV: "cleanup-test"}
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env,
                                start_new_session=True)
    started.append(psutil.Process(leftover.pid))
    listed = wait_until(lambda: list_project_processes(run_id="cleanup-test"))
    assert [p.identity.pid for p in listed] == [leftover.pid]  # type: ignore[union-attr]
    assert listed[0].cluster_dir == state_dir.resolve()  # type: ignore[index]
    check = subprocess.run([sys.executable, "-m", "blockq.local.processes", "--run-id", "cleanup-test"],
                           capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert check.returncode == 1 and str(leftover.pid) in check.stdout, check
    assert reap_session_clusters("cleanup-test", tmp_path) == []
    assert leftover.wait(timeout=5) == -signal.SIGTERM
    check = subprocess.run([sys.executable, "-m", "blockq.local.processes", "--run-id", "cleanup-test"],
                           capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert check.returncode == 0 and "0 processes" in check.stdout, check
