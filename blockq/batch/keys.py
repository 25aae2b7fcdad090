"""Batch job identities. The key names batch jobs use live with every other key name in
:mod:`blockq.keys` (:class:`BatchKeys`, re-exported here)."""

from __future__ import annotations

import hashlib

from blockq.keys import BatchKeys

__all__ = ["BatchKeys", "batch_request_id"]


def batch_request_id(job_id: str, custom_id: str) -> str:
    """The deterministic blockq request id of one input line: a resumed job resubmits (or
    re-reads) the same request, so its reply stream is reused rather than duplicated."""
    digest = hashlib.sha256(f"{job_id}\0{custom_id}".encode()).hexdigest()[:32]
    return f"batch-{digest}"
