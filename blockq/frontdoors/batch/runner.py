"""Running one batch job: the rq job function :func:`execute_batch_job` and the
:class:`BatchRun` it drives.

Progress lives in Redis, per custom_id (:class:`blockq.frontdoors.batch.keys.BatchKeys`): a line whose
result or error is recorded is never submitted again, so a job that is re-run after its
worker died resumes where it stopped. Lines are submitted with deterministic request ids
(:func:`batch_request_id`); a line that was in flight when the worker died is re-attached
to its existing reply stream instead of being generated twice.

While it runs, the job holds a lease (:mod:`blockq.frontdoors.batch.job_lease`); a worker
that finds a started job without a lease re-enqueues it (:mod:`blockq.frontdoors.batch.worker`).

Before anything is read, written or leased, the job's files are checked against the
worker's roots (:mod:`blockq.frontdoors.batch.files`). The input is then streamed, never
held: one pass counts its lines (a file over the limit fails here), one records its invalid
lines and keeps the valid lines' custom ids, one feeds the pending lines to the submission
loop as it has room, and the output files are written from Redis in input order.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

import redis
import structlog

from blockq.client import AsyncClient, AsyncHandle, Overloaded, build_request
from blockq.config import ConfigError, Settings
from blockq.frontdoors.batch.bookkeeping import BatchProgress, RateLimiter, write_lines_atomically
from blockq.frontdoors.batch.files import BatchFilesConfig, check_job_files
from blockq.frontdoors.batch.job_lease import LeaseKeeper, lease_s_from_env
from blockq.frontdoors.batch.keys import BatchKeys, batch_request_id
from blockq.frontdoors.batch.lines import (
    BatchLine,
    LineError,
    count_lines,
    read_batch_input,
    result_line,
)
from blockq.frontdoors.gateway.openai_requests import RequestDefaults
from blockq.frontdoors.gateway.openai_responses import completion_body
from blockq.wire.protocol import PRIORITIES
from blockq.wire.streams import connect

log = structlog.get_logger(__name__)

CHECK_INTERVAL_S = 0.2
RESULTS_TTL_S = 7 * 24 * 3600
# Hash fields read or written per Redis round trip while streaming a job's lines.
REDIS_CHUNK = 1000


@dataclass(frozen=True)
class BatchOptions:
    """What ``blockq batch submit`` asks for; stored in the rq job as a plain map."""

    input_path: str
    output_path: str
    errors_path: str
    priority: str = "batch"
    tenant: str = "default"
    max_rate_per_s: float | None = None
    concurrency: int = 256
    request_timeout_s: float = 3600.0
    chat_template: str = "chatml"

    def __post_init__(self) -> None:
        if self.priority not in PRIORITIES:
            raise ConfigError(f"priority: must be one of {', '.join(PRIORITIES)} (got {self.priority!r})")
        if self.max_rate_per_s is not None and self.max_rate_per_s <= 0:
            raise ConfigError(f"max_rate: must be > 0 requests/s (got {self.max_rate_per_s})")
        if not 1 <= self.concurrency <= 4096:
            raise ConfigError(f"concurrency: must be between 1 and 4096 (got {self.concurrency})")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s: must be > 0 (got {self.request_timeout_s})")

    def to_map(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_map(cls, data: dict[str, Any]) -> BatchOptions:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class BatchRun:
    """Executes the pending lines of one job and writes its output files. The constructor
    checks the job's files against ``files`` (raises JobFileRefused, a ConfigError) and
    touches nothing else."""

    def __init__(self, job_id: str, options: BatchOptions, settings: Settings, client: redis.Redis,
                 save_progress: Callable[[dict[str, Any]], None], lease_lost: threading.Event | None = None, *,
                 files: BatchFilesConfig) -> None:
        self.job_id = job_id
        self.options = options
        self.settings = settings
        self.redis = client
        self.keys = BatchKeys(settings.key_prefix)
        self.progress = BatchProgress(save_progress)
        self.lease_lost = lease_lost or threading.Event()
        self.defaults = RequestDefaults(max_max_tokens=settings.limits.max_max_tokens)
        self.files = check_job_files(options, files)
        self.limits = files.limits
        self._custom_ids: list[str] = []  # the valid lines', in input order: the results file's order
        self._last_line_number = 0
        self._paused_until_s = 0.0
        self._next_cancel_check_at_s = 0.0

    def run(self) -> dict[str, Any]:
        """Run to completion (or cancellation); returns the summary stored as the job result.
        Raises InputTooLarge, before anything is recorded, for an input over the line limit."""
        total = count_lines(self.files.input_path, self.limits)
        self._record_invalid_lines()
        finished_ids = {k.decode() for k in self.redis.hkeys(self.keys.results(self.job_id))}
        failed_lines = {int(k) for k in self.redis.hkeys(self.keys.errors(self.job_id))}
        pending = (i for i in self._read_input() if isinstance(i, BatchLine)
                   and i.custom_id not in finished_ids and i.line_number not in failed_lines)
        self.progress.start(total=total, done=len(finished_ids), failed=len(failed_lines))
        log.info("batch_job_running", job_id=self.job_id, total=total,
                 pending=total - len(finished_ids) - len(failed_lines), resumed=bool(finished_ids or failed_lines))
        canceled = asyncio.run(self._execute(pending))
        if self.lease_lost.is_set():
            raise RuntimeError("batch job lease lost: another worker runs this job now")
        # The counts are what the files hold: a collector cancelled between storing its
        # result and counting it (a cancel, mid-job) would otherwise be one short.
        num_done, num_failed = self._write_outputs()
        self.progress.values.update(done=num_done, failed=num_failed)
        self.progress.finish(canceled=canceled)
        summary = {**self.progress.values, "output": self.options.output_path, "errors": self.options.errors_path}
        log.info("batch_job_done", job_id=self.job_id, **summary)
        return summary

    # --- reading the input -------------------------------------------------------------------

    def _read_input(self) -> Iterator[BatchLine | LineError]:
        return read_batch_input(self.files.input_path, self.files.render, self.defaults, self.settings, self.limits)

    def _record_invalid_lines(self) -> None:
        """One pass over the input: record its invalid lines (deterministic, so rewriting
        them on a resume is harmless) a chunk at a time, and keep the valid lines' custom ids."""
        invalid: dict[str, str] = {}
        for item in self._read_input():
            self._last_line_number = item.line_number
            if isinstance(item, BatchLine):
                self._custom_ids.append(item.custom_id)
                continue
            invalid[str(item.line_number)] = json.dumps(item.to_output())
            if len(invalid) >= REDIS_CHUNK:
                self.redis.hset(self.keys.errors(self.job_id), mapping=invalid)
                invalid.clear()
        if invalid:
            self.redis.hset(self.keys.errors(self.job_id), mapping=invalid)

    # --- the submission loop ---------------------------------------------------------------

    async def _execute(self, pending: Iterator[BatchLine]) -> bool:
        """Submit ``pending`` with bounded concurrency and rate; True when canceled. Lines
        are taken from ``pending`` as there is room, so at most ``concurrency`` lines wait
        in memory beside those in flight."""
        queue: deque[BatchLine] = deque()
        tasks: dict[asyncio.Task[None], BatchLine] = {}
        limiter = RateLimiter(self.options.max_rate_per_s)
        async with AsyncClient(settings=self.settings, max_connections=self.options.concurrency + 16) as client:
            while True:
                queue.extend(itertools.islice(pending, max(0, self.options.concurrency - len(queue))))
                if not queue and not tasks:
                    return False
                if await self._should_stop(client):
                    await self._abandon(client, tasks)
                    return not self.lease_lost.is_set()
                await self._fill(client, queue, tasks, limiter)
                timeout_s = CHECK_INTERVAL_S
                if queue and len(tasks) < self.options.concurrency:
                    timeout_s = min(timeout_s, max(limiter.delay_s(), self._paused_until_s - time.monotonic()))
                if tasks:
                    done, _ = await asyncio.wait(tasks, timeout=max(0.0, timeout_s),
                                                 return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        del tasks[task]
                        task.result()
                else:
                    await asyncio.sleep(max(0.0, timeout_s))
                self.progress.maybe_save()

    async def _should_stop(self, client: AsyncClient) -> bool:
        """Lease lost, or the cancel flag set (read at most every CHECK_INTERVAL_S)."""
        if self.lease_lost.is_set():
            return True
        now_s = time.monotonic()
        if now_s < self._next_cancel_check_at_s:
            return False
        self._next_cancel_check_at_s = now_s + CHECK_INTERVAL_S
        return bool(await client.redis.exists(self.keys.cancel_flag(self.job_id)))

    async def _fill(self, client: AsyncClient, queue: deque[BatchLine], tasks: dict[asyncio.Task[None], BatchLine],
                    limiter: RateLimiter) -> None:
        if not queue or time.monotonic() < self._paused_until_s:
            return
        num_lines = limiter.take(min(self.options.concurrency - len(tasks), len(queue)))
        if num_lines <= 0:
            return
        window = [queue.popleft() for _ in range(num_lines)]
        try:
            handles = await self._submit(client, window)
        except Overloaded as exc:  # nothing was enqueued: put the window back and wait
            queue.extendleft(reversed(window))
            limiter.refund(num_lines)
            self._paused_until_s = time.monotonic() + exc.retry_after_s
            log.info("batch_job_backing_off", job_id=self.job_id, retry_after_s=exc.retry_after_s)
            return
        for line, line_handles in zip(window, handles, strict=True):
            tasks[asyncio.create_task(self._collect(client, line, line_handles))] = line

    async def _submit(self, client: AsyncClient, window: list[BatchLine]) -> list[list[AsyncHandle]]:
        """Handles for every line's requests: existing reply streams are re-attached,
        the rest submitted in one round trip (all or none; raises Overloaded)."""
        specs_per_line = [line.plan.submit_specs(batch_request_id(self.job_id, line.custom_id), self.options.tenant,
                                                 self.options.priority) for line in window]
        specs = [spec for line_specs in specs_per_line for spec in line_specs]
        pipe = client.redis.pipeline(transaction=False)
        for spec in specs:
            pipe.exists(self.settings.keys.reply(spec.request_id or ""))
        exists = await pipe.execute()
        new_specs = [s for s, e in zip(specs, exists, strict=True) if not e]
        by_id = {h.id: h for h in await client.submit_many(new_specs)}
        for spec, was_there in zip(specs, exists, strict=True):
            if was_there:
                by_id[spec.request_id or ""] = AsyncHandle(client, build_request(spec, self.settings))
        return [[by_id[s.request_id or ""] for s in line_specs] for line_specs in specs_per_line]

    async def _collect(self, client: AsyncClient, line: BatchLine, handles: list[AsyncHandle]) -> None:
        base_id = batch_request_id(self.job_id, line.custom_id)
        timeout_s = self.options.request_timeout_s
        try:
            finals = await asyncio.wait_for(asyncio.gather(*(h.result(timeout_s) for h in handles)), timeout_s)
        except TimeoutError:
            await asyncio.gather(*(client.cancel(h.id) for h in handles))
            await self._record_error(client, LineError(line.line_number, line.custom_id, "timeout",
                                                       f"no result within {timeout_s:g} s"))
            return
        bad = next((f for f in finals if f.status != "ok"), None)
        if bad is not None:
            code = "cancelled" if bad.status == "cancelled" else "generation_failed"
            await self._record_error(client, LineError(line.line_number, line.custom_id, code,
                                                       f"request {bad.request_id}: {bad.error or bad.status}"))
            return
        body = completion_body(line.plan, base_id, int(time.time()), finals)
        await client.redis.hset(self.keys.results(self.job_id), line.custom_id,
                                json.dumps(result_line(line.custom_id, base_id, body), separators=(",", ":")))
        self.progress.add(done=1)

    async def _record_error(self, client: AsyncClient, error: LineError) -> None:
        await client.redis.hset(self.keys.errors(self.job_id), str(error.line_number), json.dumps(error.to_output()))
        self.progress.add(failed=1)

    async def _abandon(self, client: AsyncClient, tasks: dict[asyncio.Task[None], BatchLine]) -> None:
        """Stop: cancel the requests in flight in the pipeline (unless the job moved to
        another worker, which will re-attach them) and drop their collectors."""
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.lease_lost.is_set():
            return
        request_ids = [rid for line in tasks.values()
                       for rid in line.plan.request_ids(batch_request_id(self.job_id, line.custom_id))]
        await asyncio.gather(*(client.cancel(rid) for rid in request_ids))
        log.info("batch_job_canceled", job_id=self.job_id, num_cancelled_requests=len(request_ids))

    # --- output ----------------------------------------------------------------------------

    def _write_outputs(self) -> tuple[int, int]:
        """Results in input order, then errors in line order, streamed from Redis a chunk at
        a time; each file replaced atomically. Returns how many lines each holds."""
        num_done = write_lines_atomically(self.files.output_path,
                                          self._stored(self.keys.results(self.job_id), self._custom_ids))
        line_numbers = (str(n) for n in range(1, self._last_line_number + 1))
        num_failed = write_lines_atomically(self.files.errors_path,
                                            self._stored(self.keys.errors(self.job_id), line_numbers))
        pipe = self.redis.pipeline(transaction=False)
        pipe.expire(self.keys.results(self.job_id), RESULTS_TTL_S)
        pipe.expire(self.keys.errors(self.job_id), RESULTS_TTL_S)
        pipe.execute()
        return num_done, num_failed

    def _stored(self, key: str, names: Iterable[str]) -> Iterator[bytes]:
        """The values of hash ``key`` under ``names``, in order (missing ones skipped)."""
        names = iter(names)
        while chunk := list(itertools.islice(names, REDIS_CHUNK)):
            yield from (value for value in self.redis.hmget(key, chunk) if value is not None)


def execute_batch_job(options: dict[str, Any]) -> dict[str, Any]:
    """The rq job function. Runs with the worker's settings and file roots (``BLOCKQ_*``
    env, which ``blockq batch worker`` sets); progress goes to ``job.meta`` (done, failed,
    total). A job whose files are not allowed fails with the reason, before anything is
    read, written or leased."""
    from rq import get_current_job

    job = get_current_job()
    if job is None:
        raise RuntimeError("execute_batch_job runs inside an rq worker")
    settings = Settings.from_env()
    files = BatchFilesConfig.from_env()
    client = connect(settings.redis_url or "")

    def save_progress(values: dict[str, Any]) -> None:
        job.meta.update(values)
        job.save_meta()

    try:
        lease = LeaseKeeper(client, BatchKeys(settings.key_prefix).lease(job.id), lease_s_from_env())
        run = BatchRun(job.id, BatchOptions.from_map(options), settings, client, save_progress, lease.lost,
                       files=files)
        lease.start()
        try:
            return run.run()
        finally:
            lease.release()
    finally:
        client.close()
