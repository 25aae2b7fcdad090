"""Batch jobs from the submitting side: enqueue, inspect, cancel. Jobs are rq jobs on the
queue :attr:`BatchKeys.queue_name` of the cluster's Redis; their status names are rq's
(``queued``, ``started``, ``finished``, ``failed``, ``stopped``, ``canceled``, ...).

Jobs are stored with rq's JSON serializer, never pickle: a worker that unpickled job data
would run code for anyone able to write to the Redis. Job arguments, meta and results are
plain JSON maps.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import redis
import rq.defaults
from rq import Queue
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from blockq.config import ConfigError, Settings
from blockq.frontdoors.batch.files import BatchFilesConfig, check_job_files
from blockq.frontdoors.batch.keys import RQ_KEY_PREFIX_ENV, BatchKeys
from blockq.frontdoors.batch.lines import count_lines
from blockq.frontdoors.batch.runner import RESULTS_TTL_S, BatchOptions
from blockq.wire.keys import hash_tag
from blockq.wire.redis_url import parse_redis_url
from blockq.wire.streams import connect, connect_pinned

JOB_FUNCTION = "blockq.frontdoors.batch.runner.execute_batch_job"
DEFAULT_JOB_TIMEOUT_S = 7 * 24 * 3600
WAITING_STATUSES = (JobStatus.QUEUED, JobStatus.DEFERRED, JobStatus.SCHEDULED)
ENDED_STATUSES = (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED)
JOB_SERIALIZER = JSONSerializer


class BatchJobNotFound(LookupError):
    """No batch job with that id on this cluster's batch queue."""


def rq_connection(settings: Settings) -> redis.Redis:
    """The client rq runs on, for ``settings.redis_url``. rq needs a plain client (it reads
    the client's connection pool): on Redis Cluster that is one pinned to the slot of the
    key prefix's hash tag (:func:`blockq.wire.streams.connect_pinned`), which holds the batch
    keys and, when rq's namespace carries the same tag, rq's keys (see
    :func:`blockq.frontdoors.batch.keys.use_rq_key_prefix`; ConfigError when it does not);
    elsewhere :func:`blockq.wire.streams.connect`'s client."""
    url = settings.redis_url or ""
    if not parse_redis_url(url).is_cluster:
        return connect(url)
    rq_prefix = rq.defaults.RQ_KEY_PREFIX
    if hash_tag(rq_prefix) != settings.keys.hash_tag:
        raise ConfigError(f"batch jobs on Redis Cluster: rq's keys must share blockq's hash tag; set "
                          f"{RQ_KEY_PREFIX_ENV}={BatchKeys(settings.key_prefix).rq_key_prefix} before rq is "
                          f"imported (it is {rq_prefix!r})")
    return connect_pinned(url, rq_prefix)


def batch_queue(connection: redis.Redis, settings: Settings) -> Queue:
    return Queue(BatchKeys(settings.key_prefix).queue_name, connection=connection, serializer=JOB_SERIALIZER)


def default_errors_path(output_path: Path) -> Path:
    """``results.jsonl`` -> ``results.errors.jsonl``."""
    return output_path.with_name(f"{output_path.stem}.errors{output_path.suffix or '.jsonl'}")


def submit_batch(connection: redis.Redis, settings: Settings, options: BatchOptions,
                 files: BatchFilesConfig | None = None, job_timeout_s: int = DEFAULT_JOB_TIMEOUT_S) -> Job:
    """Enqueue a job for ``options`` (absolute paths, visible to the workers). Checks first
    what the worker will check, against ``files`` (default: :meth:`BatchFilesConfig.from_env`,
    as a worker started here would be configured): paths under the roots, the chat
    template, the line limit (ConfigError naming the field). ``job.meta`` starts as
    total = the input's non-blank lines, done = failed = 0."""
    files = files or BatchFilesConfig.from_env()
    input_path = check_job_files(options, files).input_path
    total = count_lines(input_path, files.limits)
    meta = {"total": total, "done": 0, "failed": 0, "canceled": False, "input": options.input_path,
            "output": options.output_path, "errors": options.errors_path}
    return batch_queue(connection, settings).enqueue_call(
        JOB_FUNCTION, kwargs={"options": options.to_map()}, timeout=job_timeout_s, result_ttl=RESULTS_TTL_S,
        failure_ttl=RESULTS_TTL_S, description=f"batch {input_path.name} ({total} lines)", meta=meta)


def fetch_batch_job(connection: redis.Redis, settings: Settings, job_id: str) -> Job:
    try:
        job = Job.fetch(job_id, connection=connection, serializer=JOB_SERIALIZER)
    except NoSuchJobError:
        raise BatchJobNotFound(f"no batch job {job_id!r}") from None
    if job.origin != BatchKeys(settings.key_prefix).queue_name:
        raise BatchJobNotFound(f"job {job_id!r} is not a batch job of this cluster")
    return job


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def batch_status(connection: redis.Redis, settings: Settings, job_id: str) -> dict[str, Any]:
    """``job_id``, ``status`` (rq's name), ``done``, ``failed``, ``total``, ``canceled``,
    file paths, timestamps and, for a failed job, the last line of its error."""
    job = fetch_batch_job(connection, settings, job_id)
    meta = job.get_meta(refresh=True)
    status = job.get_status(refresh=True)
    if status == JobStatus.FINISHED and meta.get("canceled"):
        # rq marks a job that returned `finished`; the batch worker moves a canceled one
        # to `canceled` just after (BatchWorker.handle_job_success): report where it ends.
        status = JobStatus.CANCELED
    error = None
    if status == JobStatus.FAILED:
        latest = job.latest_result()
        lines = ((latest.exc_string or "") if latest is not None else "").strip().splitlines()
        error = lines[-1] if lines else "failed"
    return {
        "job_id": job.id, "status": str(status.value if hasattr(status, "value") else status),
        "done": int(meta.get("done", 0)), "failed": int(meta.get("failed", 0)), "total": int(meta.get("total", 0)),
        "canceled": bool(meta.get("canceled")) or status == JobStatus.CANCELED,
        "input": meta.get("input"), "output": meta.get("output"), "errors": meta.get("errors"),
        "enqueued_at": _iso(job.enqueued_at), "started_at": _iso(job.started_at), "ended_at": _iso(job.ended_at),
        "error": error,
    }


def cancel_batch(connection: redis.Redis, settings: Settings, job_id: str, wait_s: float = 30.0) -> dict[str, Any]:
    """Cancel a job: a waiting one at once; a running one stops at its next check (about
    0.2 s), cancels its requests in flight, writes the lines finished so far and ends as
    ``canceled``. Waits up to ``wait_s`` for that; returns the job's status."""
    job = fetch_batch_job(connection, settings, job_id)
    status = job.get_status(refresh=True)
    if status in ENDED_STATUSES:
        return batch_status(connection, settings, job_id)
    connection.set(BatchKeys(settings.key_prefix).cancel_flag(job_id), 1, ex=RESULTS_TTL_S)
    if status in WAITING_STATUSES:
        with contextlib.suppress(InvalidJobOperation):
            job.cancel()
    deadline_s = time.monotonic() + wait_s
    while time.monotonic() < deadline_s and job.get_status(refresh=True) not in ENDED_STATUSES:
        time.sleep(0.1)
    return batch_status(connection, settings, job_id)
