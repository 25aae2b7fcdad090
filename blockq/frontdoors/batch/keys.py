"""Batch job identities, and rq's key namespace. The key names batch jobs use live with
every other key name in :mod:`blockq.wire.keys` (:class:`BatchKeys`, re-exported here).

Nothing here imports rq: :func:`use_rq_key_prefix` must run before it is imported."""

from __future__ import annotations

import hashlib
import os
from collections.abc import MutableMapping

from blockq.config import Settings
from blockq.wire.keys import BatchKeys
from blockq.wire.redis_url import parse_redis_url

__all__ = ["BatchKeys", "RQ_KEY_PREFIX_ENV", "batch_request_id", "use_rq_key_prefix"]

RQ_KEY_PREFIX_ENV = "RQ_KEY_PREFIX"


def use_rq_key_prefix(settings: Settings, env: MutableMapping[str, str] | None = None) -> None:
    """On Redis Cluster, set ``RQ_KEY_PREFIX`` (rq's key namespace, read once when rq is
    imported) to :attr:`BatchKeys.rq_key_prefix` unless it is set already, so that rq's
    transactions stay in one slot; elsewhere, leave rq's default alone. Call it before
    anything imports rq (``blockq batch`` does)."""
    env = os.environ if env is None else env
    if settings.redis_url and parse_redis_url(settings.redis_url).is_cluster:
        env.setdefault(RQ_KEY_PREFIX_ENV, BatchKeys(settings.key_prefix).rq_key_prefix)


def batch_request_id(job_id: str, custom_id: str) -> str:
    """The deterministic blockq request id of one input line: a resumed job resubmits (or
    re-reads) the same request, so its reply stream is reused rather than duplicated."""
    digest = hashlib.sha256(f"{job_id}\0{custom_id}".encode()).hexdigest()[:32]
    return f"batch-{digest}"
