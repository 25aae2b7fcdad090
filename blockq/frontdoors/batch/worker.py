"""``blockq batch worker``: rq's forking worker on the batch queue, with three additions
that make batch jobs survive their workers:

- the work horse dies with its worker (``PR_SET_PDEATHSIG`` on Linux), so a worker killed
  with SIGKILL leaves no orphan still running the job;
- SIGTERM/SIGINT hand a running job back to the queue at once (its horse is stopped and
  the job re-enqueued at the front) instead of waiting for it to finish; the next worker
  resumes it from its recorded progress;
- a thread re-enqueues started jobs whose lease has lapsed (their worker died without a
  word), after at most ``BLOCKQ_BATCH_LEASE_S`` (+ half of it for the scan).

A job that ended with ``job.meta["canceled"]`` is moved to rq's ``canceled`` status.
Jobs are read with rq's JSON serializer (:data:`blockq.frontdoors.batch.jobs.JOB_SERIALIZER`), so job
data written by anyone cannot make this worker unpickle, and so run, arbitrary code.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

import redis
import structlog
from rq import Queue, Worker
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry
from rq.worker import WorkerStatus

from blockq.config import Settings
from blockq.frontdoors.batch.files import BatchFilesConfig
from blockq.frontdoors.batch.job_lease import lease_s_from_env
from blockq.frontdoors.batch.jobs import JOB_FUNCTION, JOB_SERIALIZER, rq_connection
from blockq.frontdoors.batch.keys import BatchKeys

log = structlog.get_logger(__name__)

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux only)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


COMMAND_POLL_S = 1.0


class BatchWorker(Worker):
    """rq's ``Worker`` with hand-back on shutdown and horses that die with it."""

    def __init__(self, *args: Any, batch_keys: BatchKeys | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batch_keys = batch_keys or BatchKeys()
        self._parent_pid = os.getpid()
        self._hand_back_job_id: str | None = None

    def subscribe(self) -> None:
        """rq's, with the command thread polling every second instead of every 60 s.

        redis-py 8's ``PubSubWorkerThread.stop()`` joins the thread, and once unsubscribed
        the thread sleeps out its whole poll interval: a worker took up to a minute to exit
        (a burst worker on an empty queue had not exited after 60 s, blocked in that join;
        now it exits in 1.5 s).
        """
        log.debug("batch_worker_subscribing", channel=self.pubsub_channel_name)
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(
            sleep_time=COMMAND_POLL_S, daemon=True, exception_handler=self._pubsub_exception_handler)

    def execute_job(self, job: Job, queue: Queue) -> None:
        self._parent_pid = os.getpid()
        # rq imports and calls whatever function a job names: anyone who can write to
        # Redis could run code here. Only the batch runner runs; the name is read as
        # stored, nothing is imported for a job that names anything else.
        if job.func_name != JOB_FUNCTION:
            reason = f"refused: a batch worker runs only {JOB_FUNCTION} (the job names {job.func_name[:200]!r})"
            log.warning("batch_job_refused", job_id=job.id, func_name=job.func_name[:200])
            job.set_status(JobStatus.FAILED)
            self.handle_job_failure(job, queue, exc_string=reason)
            return
        super().execute_job(job, queue)

    def main_work_horse(self, job: Job, queue: Queue) -> None:
        die_with_parent(self._parent_pid)
        super().main_work_horse(job, queue)

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        if self.get_state() == WorkerStatus.BUSY and self.horse_pid:
            self._hand_back_job_id = self.get_current_job_id()
            log.info("batch_job_handing_back", job_id=self._hand_back_job_id)
            self.kill_horse()
        super().request_stop(signum, frame)

    def handle_job_failure(self, job: Job, queue: Queue, started_job_registry: Any = None, exc_string: str = "",
                           execution: Execution | None = None) -> None:
        super().handle_job_failure(job, queue, started_job_registry=started_job_registry, exc_string=exc_string,
                                   execution=execution)
        if self._hand_back_job_id == job.id:
            self._hand_back_job_id = None
            # Its horse is dead: release the lease so that the next worker starts at once.
            self.connection.delete(self.batch_keys.lease(job.id))
            try:
                job.requeue(at_front=True)
                log.info("batch_job_handed_back", job_id=job.id)
            except InvalidJobOperation:
                log.warning("batch_job_hand_back_failed", job_id=job.id)

    def handle_job_success(self, job: Job, queue: Queue, started_job_registry: StartedJobRegistry,
                           execution: Execution) -> None:
        super().handle_job_success(job, queue, started_job_registry, execution)
        if job.get_meta(refresh=True).get("canceled") and job.get_status(refresh=True) != JobStatus.CANCELED:
            with contextlib.suppress(InvalidJobOperation):
                job.cancel()


class AbandonedJobRecovery:
    """Re-enqueues started batch jobs whose lease lapsed: their worker died."""

    def __init__(self, connection: redis.Redis, settings: Settings, lease_s: float) -> None:
        self.connection = connection
        self.keys = BatchKeys(settings.key_prefix)
        self.queue = Queue(self.keys.queue_name, connection=connection, serializer=JOB_SERIALIZER)
        self.registry = StartedJobRegistry(queue=self.queue)
        self.lease_s = lease_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batch-recovery", daemon=True)

    def scan_once(self) -> list[str]:
        """One pass; returns the ids of the jobs re-enqueued."""
        recovered = []
        for job_id, execution_id in self.registry.get_job_and_execution_ids(cleanup=False):
            if self.connection.exists(self.keys.lease(job_id)):
                continue
            try:
                job = Job.fetch(job_id, connection=self.connection, serializer=JOB_SERIALIZER)
            except NoSuchJobError:
                continue
            if job.get_status(refresh=False) != JobStatus.STARTED or not self._is_past_grace(job, execution_id):
                continue
            if not self.connection.set(self.keys.recovery_lock(job_id), 1, nx=True, px=int(self.lease_s * 1000)):
                continue
            self.registry.remove_execution(Execution(execution_id, job_id, self.connection))
            self.queue.enqueue_job(job, at_front=True)
            recovered.append(job_id)
            log.warning("batch_job_recovered", job_id=job_id, reason="lease lapsed: its worker died")
        return recovered

    def _is_past_grace(self, job: Job, execution_id: str) -> bool:
        # A horse takes its lease moments after the execution starts: leave it that long.
        try:
            started_at = Execution.fetch(execution_id, job.id, self.connection).created_at
        except Exception:
            started_at = job.started_at
        return started_at is None or time.time() - started_at.timestamp() > self.lease_s

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.lease_s / 2):
            try:
                self.scan_once()
            except redis.RedisError:
                log.warning("batch_recovery_scan_failed", exc_info=True)


def run_worker(settings: Settings, files: BatchFilesConfig, *, burst: bool = False, name: str | None = None) -> int:
    """Run a batch worker until SIGTERM/SIGINT (or, with ``burst``, until the queue is empty).
    The jobs it runs see its settings through ``BLOCKQ_REDIS_URL`` / ``BLOCKQ_KEY_PREFIX``
    and its roots and limits through ``BLOCKQ_BATCH_*`` (:meth:`BatchFilesConfig.to_env`)."""
    os.environ["BLOCKQ_REDIS_URL"] = settings.redis_url or ""
    os.environ["BLOCKQ_KEY_PREFIX"] = settings.key_prefix
    os.environ.update(files.to_env())
    connection = rq_connection(settings)
    recovery = AbandonedJobRecovery(rq_connection(settings), settings, lease_s_from_env())
    recovery.scan_once()
    recovery.start()
    keys = BatchKeys(settings.key_prefix)
    queue = Queue(keys.queue_name, connection=connection, serializer=JOB_SERIALIZER)
    worker = BatchWorker([queue], connection=connection, name=name, batch_keys=keys, serializer=JOB_SERIALIZER)
    log.info("batch_worker_started", queue=queue.name, worker=worker.name, pid=os.getpid(),
             input_root=str(files.input_root), output_root=str(files.output_root),
             max_line_bytes=files.limits.max_line_bytes, max_lines=files.limits.max_lines)
    try:
        worker.work(burst=burst, logging_level=settings.log_level.upper())
    finally:
        recovery.stop()
    return 0
