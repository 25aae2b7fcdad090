"""A cluster's state as ``blockq status`` reports it (stable JSON shape, documented in
docs/commands.md, "JSON output"): instances with their last heartbeat, stream lengths, pending entries per
consumer group and the dead-letter count; for a ``blockq up`` cluster also the gateway's
URL and every process's Prometheus endpoint (``metrics_urls``). Each instance's
``forecast_error`` is the dispatcher's forecast check over the newest ``done`` records
(:func:`blockq.forecast_check.score_records`; None: no record of it there)."""

from __future__ import annotations

import time
from typing import Any

import redis

from blockq.config import Settings
from blockq.forecast_check import score_records
from blockq.local.state import ClusterState
from blockq.wire.beats import decode_heartbeat
from blockq.wire.health import HealthPolicy, InstanceState
from blockq.wire.keys import GROUP_DISPATCH, GROUP_PREDICT, GROUP_WORK, PAYLOAD_FIELD, Keys
from blockq.wire.protocol import DoneRecord, ValidationError, decode_done_record

# Newest ``done`` records the per-instance forecast error is computed over.
FORECAST_CHECK_RECORDS = 1000


def collect_status(client: redis.Redis, settings: Settings, *, dead_after_s: float = 5.0) -> dict[str, Any]:
    keys = settings.keys
    health = HealthPolicy(settings.heartbeat_interval_ms / 1000, dead_after_s)
    now_s = time.time()
    instances = []
    forecast_errors = score_records(_newest_done(client, keys))
    for _instance_id, payload in sorted(client.hgetall(keys.instances).items()):
        try:
            beat = decode_heartbeat(payload)
        except ValidationError:
            continue
        age_s = max(0.0, now_s - beat.sent_at_s)
        config = beat.engine_config
        instances.append({
            "id": beat.instance_id, "state": health.classify(beat.state, age_s),
            "reported_state": beat.state, "last_heartbeat_age_ms": round(age_s * 1000, 1),
            "seq": beat.seq, "model": beat.model, "preset": beat.preset,
            "running": beat.num_running_total, "waiting": beat.num_waiting_total,
            "kv_used_blocks": beat.num_used_blocks, "kv_total_blocks": config.get("num_gpu_blocks"),
            "lag_p99_ms": round(beat.lag_p99_ms, 2), "queue": client.xlen(keys.instance_queue(beat.instance_id)),
            "forecast_error": forecast_errors[beat.instance_id].to_dict() if beat.instance_id in forecast_errors
            else None,
        })
    streams = {"req": keys.requests, "ready": keys.ready, "done": keys.done, "hb": keys.heartbeats,
               "dead": keys.dead_letters}
    lengths = {name: client.xlen(key) for name, key in streams.items()}
    pending = {
        "req/predict": _pending(client, keys.requests, GROUP_PREDICT),
        "ready/dispatch": _pending(client, keys.ready, GROUP_DISPATCH),
    }
    for instance in instances:
        pending[f"inst:{instance['id']}/work"] = _pending(client, keys.instance_queue(instance["id"]), GROUP_WORK)
    leader = client.get(keys.dispatcher_lease)
    return {
        "redis_url": _redacted(settings.redis_url),
        "prefix": keys.prefix,
        "instances": instances,
        "num_live_instances": sum(1 for i in instances if i["state"] == InstanceState.LIVE),
        "streams": lengths,
        "pending": pending,
        "dead_letters": lengths["dead"],
        "dispatcher_leader": leader.decode() if leader else None,
    }


def add_cluster_urls(status: dict[str, Any], state: ClusterState | None) -> dict[str, Any]:
    """Add what the state file of a ``blockq up`` cluster records: ``gateway_url`` (None
    without a gateway) and ``metrics_urls``, process name (``dispatcher``, ``predictor``,
    ``gateway``, ``workers-0``, ...) -> its ``/metrics`` URL (empty when not known)."""
    status["gateway_url"] = state.gateway_url if state else None
    status["metrics_urls"] = dict(sorted(state.metrics_urls.items())) if state else {}
    return status


def _newest_done(client: redis.Redis, keys: Keys) -> list[DoneRecord]:
    """The newest ``done`` records that decode, oldest first (docs/dispatcher.md, "The
    forecast check": the figure the dispatcher computes, over these records)."""
    records = []
    for _, fields in client.xrevrange(keys.done, count=FORECAST_CHECK_RECORDS):
        try:
            records.append(decode_done_record(fields[PAYLOAD_FIELD.encode()]))
        except (KeyError, ValidationError, TypeError):
            continue  # the predictor's feedback consumer dead-letters these
    records.reverse()
    return records


def _pending(client: redis.Redis, stream: str, group: str) -> int:
    try:
        return int(client.xpending(stream, group)["pending"])
    except redis.ResponseError:  # no such stream or group yet
        return 0


def _redacted(url: str | None) -> str | None:
    """The URL without its secrets (userinfo and option passwords, the Sentinels' too)."""
    from blockq.wire.redis_url import redact_url  # the one redaction of Redis URLs

    return redact_url(url) if url else url
