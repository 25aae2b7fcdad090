"""Names of the Redis keys and the rq queue that batch jobs use, in one place.

rq keeps its own keys (``rq:job:{id}``, ``rq:queue:{name}``, registries); blockq adds
per-job keys under the cluster prefix, with the job id as hash tag so that, on Redis
Cluster, a job's keys share one slot.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from blockq.keys import DEFAULT_PREFIX


@dataclass(frozen=True)
class BatchKeys:
    prefix: str = DEFAULT_PREFIX

    @property
    def queue_name(self) -> str:
        """The rq queue batch jobs are enqueued on (rq key ``rq:queue:{prefix}batch``)."""
        return f"{self.prefix}batch"

    def results(self, job_id: str) -> str:
        """Hash: custom_id -> the finished line of the output file (JSON)."""
        return f"{self.prefix}batch:{{{job_id}}}:results"

    def errors(self, job_id: str) -> str:
        """Hash: input line number -> the line of the errors file (JSON)."""
        return f"{self.prefix}batch:{{{job_id}}}:errors"

    def lease(self, job_id: str) -> str:
        """String with a TTL, held by the process running the job; gone = abandoned."""
        return f"{self.prefix}batch:{{{job_id}}}:lease"

    def cancel_flag(self, job_id: str) -> str:
        """Set by ``blockq batch cancel``; the running job stops when it sees it."""
        return f"{self.prefix}batch:{{{job_id}}}:cancel"

    def recovery_lock(self, job_id: str) -> str:
        """Short lock so that only one worker re-enqueues an abandoned job."""
        return f"{self.prefix}batch:{{{job_id}}}:recover"


def batch_request_id(job_id: str, custom_id: str) -> str:
    """The deterministic blockq request id of one input line: a resumed job resubmits (or
    re-reads) the same request, so its reply stream is reused rather than duplicated."""
    digest = hashlib.sha256(f"{job_id}\0{custom_id}".encode()).hexdigest()[:32]
    return f"batch-{digest}"
