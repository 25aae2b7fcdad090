"""The dispatcher's own actuators of autoscaling decisions: a shell command hook and
Prometheus metrics (for KEDA or an HPA to act on, served on the dispatcher's
``--metrics-port``). The local supervisor, the third
actuator, reads the decision keys in Redis instead (:mod:`blockq.local.supervisor`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from dispatcher.autoscale import ScalingDecision

log = structlog.get_logger(__name__)

MAX_OUTPUT_CHARS = 2000


class ScaleCommand:
    """Runs ``template`` in a shell with ``{n}`` replaced by the target size, in the
    background: the placement loop never waits for it. One run at a time; a target asked
    for while one runs is run after it (only the latest: a scale to 3 then 4 while the
    first call is out runs the call for 4 next, not 3 again). Each run is killed after
    ``timeout_s``; its exit code and the tail of its output are logged.

    Only the target is substituted, an integer this process formed, so the command needs
    no quoting; ``str.replace`` rather than ``str.format`` leaves shell braces alone."""

    def __init__(self, template: str, timeout_s: float = 60.0) -> None:
        self.template = template
        self.timeout_s = timeout_s
        self._pending: int | None = None
        self._task: asyncio.Task[None] | None = None
        self.num_runs = 0
        self.last_exit_code: int | None = None

    def request(self, target: int) -> None:
        """Ask for a run with ``target``; returns at once."""
        self._pending = target
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run_pending(), name="scale-command")
            self._task.add_done_callback(self._report_crash)

    async def wait_idle(self) -> None:
        """Until every requested run finished (for tests and shutdown)."""
        while self._task is not None and not self._task.done():
            await asyncio.wait({self._task})

    async def close(self) -> None:
        """Cancel a run in progress (its process is killed)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run_pending(self) -> None:
        while self._pending is not None:
            target, self._pending = self._pending, None
            self.last_exit_code = await self.run_once(target)

    async def run_once(self, target: int) -> int | None:
        """Run the command for ``target``; its exit code, None when it could not start or
        timed out (it is killed then)."""
        command = self.template.replace("{n}", str(target))
        started_s = time.monotonic()
        self.num_runs += 1
        try:
            process = await asyncio.create_subprocess_shell(
                command, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT)
        except OSError as exc:
            log.error("scale_command_failed", target=target, command=command, error=repr(exc))
            return None
        try:
            async with asyncio.timeout(self.timeout_s):
                output, _ = await process.communicate()
        except TimeoutError:
            log.error("scale_command_timed_out", target=target, command=command, timeout_s=self.timeout_s)
            return None
        finally:
            if process.returncode is None:  # timed out or cancelled: it must not outlive the call
                process.kill()
                await process.wait()
        text = output.decode(errors="replace")[-MAX_OUTPUT_CHARS:]
        event = log.info if process.returncode == 0 else log.warning
        event("scale_command_done", target=target, command=command, exit_code=process.returncode,
              duration_s=round(time.monotonic() - started_s, 3), output=text)
        return process.returncode

    @staticmethod
    def _report_crash(task: asyncio.Task[None]) -> None:
        # Every failure of a run is caught and logged in run_once; this is for a bug, so
        # that a dead task is never silent (the next request starts a new one).
        if not task.cancelled() and task.exception() is not None:
            log.error("scale_command_task_died", error=repr(task.exception()))


class AutoscaleMetrics:
    """Prometheus metrics of the autoscaler, on the dispatcher's registry (served with the
    dispatcher's own metrics, :mod:`dispatcher.metrics`).

    * ``blockq_autoscaler_desired_instances`` (gauge): the latest target;
    * ``blockq_autoscaler_current_instances`` (gauge): the fleet it was decided for
      (live and starting, draining ones not counted);
    * ``blockq_autoscaler_actions_total{direction}`` (counter): scale-ups and downs;
    * ``blockq_autoscaler_leader`` (gauge): 1 while this dispatcher leads. A standby keeps
      the figures of its last term: ``max(desired * leader)`` over the dispatchers is the
      leader's figure."""

    def __init__(self, registry: CollectorRegistry, is_leading: Callable[[], bool]) -> None:
        self.desired = Gauge("blockq_autoscaler_desired_instances", "Fleet size the autoscaler wants",
                             registry=registry)
        self.current = Gauge("blockq_autoscaler_current_instances",
                             "Fleet size (live and starting) the latest decision was made for", registry=registry)
        self.actions = Counter("blockq_autoscaler_actions", "Scaling actions taken", ["direction"],
                               registry=registry)
        for direction in ("up", "down"):
            self.actions.labels(direction=direction)
        leader = Gauge("blockq_autoscaler_leader", "1 while this dispatcher leads", registry=registry)
        leader.set_function(lambda: 1.0 if is_leading() else 0.0)

    def record(self, decision: ScalingDecision) -> None:
        self.desired.set(decision.target)
        self.current.set(decision.current)
        if decision.direction is not None:
            self.actions.labels(direction=decision.direction).inc()
