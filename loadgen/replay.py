"""Open-loop replay of a schedule through :class:`blockq.AsyncClient`.

Each request is submitted at its scheduled offset whether or not earlier ones have
finished (open loop), bounded by ``max_in_flight`` and ``max_duration_s``. Offsets and
every reported time are model time: with ``time_scale`` 2 the emulated engines run at half
speed and the replay submits at half the rate in wall time, so results are unchanged. While the
replay runs, a follower reads the heartbeat stream for per-instance KV usage and
emulator lag. Output: one :class:`RequestRecord` per request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from redis.exceptions import RedisError

from blockq.client import AsyncClient, AsyncHandle, Overloaded
from blockq.wire.beats import decode_heartbeat
from blockq.wire.health import InstanceState
from blockq.wire.keys import PAYLOAD_FIELD
from blockq.wire.protocol import FinalRecord, ValidationError
from loadgen.summaries import KvSample, RequestRecord
from loadgen.traces import TraceRequest


@dataclass(frozen=True)
class ReplayOptions:
    max_in_flight: int = 4096
    max_duration_s: float = 3600.0
    request_timeout_s: float = 600.0
    max_model_len: int = 4096
    priority: str = "interactive"
    time_scale: float = 1.0   # wall seconds per model second of the emulated engines


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    duration_s: float
    kv_samples: list[KvSample] = field(default_factory=list)
    lag_samples_ms: list[float] = field(default_factory=list)
    lag_mean_samples_ms: list[float] = field(default_factory=list)
    delivery_samples_ms: list[float] = field(default_factory=list)


def max_tokens_for(request: TraceRequest, options: ReplayOptions) -> int:
    """Room the engine allows; the request ends at its true length, not here, so that the
    limit tells the predictor nothing about the true length."""
    return max(request.true_output_tokens, options.max_model_len - request.prompt_tokens)


async def replay(client: AsyncClient, schedule: Sequence[tuple[float, TraceRequest]],
                 options: ReplayOptions | None = None,
                 on_progress: Callable[[int, int], None] | None = None) -> ReplayResult:
    """Replay ``schedule`` (offset seconds, request) and wait for every request."""
    options = options or ReplayOptions()
    started_s = time.monotonic()
    in_flight = asyncio.Semaphore(options.max_in_flight)
    records: list[RequestRecord | None] = [None] * len(schedule)
    num_done = 0
    stop_following = asyncio.Event()
    result = ReplayResult([], 0.0)
    follower = asyncio.create_task(_follow_heartbeats(client, started_s, options.time_scale, result,
                                                      stop_following))

    async def run_one(index: int, offset_s: float, request: TraceRequest) -> None:
        nonlocal num_done
        await asyncio.sleep(max(0.0, started_s + offset_s * options.time_scale - time.monotonic()))
        async with in_flight:
            records[index] = await _submit_and_wait(client, request, offset_s, options)
        num_done += 1
        if on_progress:
            on_progress(num_done, len(schedule))

    tasks = [asyncio.create_task(run_one(i, offset_s, request)) for i, (offset_s, request) in enumerate(schedule)]
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=options.max_duration_s * options.time_scale)
    except TimeoutError:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        stop_following.set()
        await follower
    result.duration_s = (time.monotonic() - started_s) / options.time_scale
    result.records = [record if record is not None else failed_record(request, offset_s, "not finished within max_duration_s")
                      for record, (offset_s, request) in zip(records, schedule, strict=True)]
    return result


async def _submit_and_wait(client: AsyncClient, request: TraceRequest, offset_s: float,
                           options: ReplayOptions) -> RequestRecord:
    try:
        handle: AsyncHandle = await client.submit(
            request.prompt, max_tokens=max_tokens_for(request, options), priority=options.priority,
            true_output_tokens=request.true_output_tokens,
            trace_predicted_output_tokens=request.predicted_output_tokens,
            trace_output_text=request.output_text)
        final = await handle.result(timeout_s=options.request_timeout_s)
        placement = await handle.placement(timeout_s=0)
    except Overloaded:
        return failed_record(request, offset_s, "overloaded")
    except TimeoutError:
        return failed_record(request, offset_s, "timeout")
    except ValidationError as exc:
        return failed_record(request, offset_s, f"invalid: {exc}")
    except RedisError as exc:  # one request lost to the load generator's own connection, not the run
        return failed_record(request, offset_s, f"redis: {type(exc).__name__}: {exc}")
    decided_after_ms = None
    if placement is not None:
        decided_after_ms = max(0.0, (placement.decided_at_s - handle.request.submitted_at_s) * 1000
                               / options.time_scale)
    return replace(record_of(handle.id, request, offset_s, final), decided_after_ms=decided_after_ms)


def record_of(request_id: str, request: TraceRequest, offset_s: float, final: FinalRecord) -> RequestRecord:
    """The replay record of ``request``, submitted at ``offset_s``, from its final record."""
    return RequestRecord(
        request_id=request_id, submitted_at_s=offset_s, instance=final.instance,
        prompt_tokens=final.prompt_tokens, true_output_tokens=request.true_output_tokens,
        predicted_output_tokens=final.predicted_output_tokens, output_tokens=final.output_tokens,
        queue_wait_ms=final.queue_wait_ms, ttft_ms=final.ttft_ms, tpot_ms=final.tpot_ms, e2e_ms=final.e2e_ms,
        predicted_ttft_ms=final.predicted_ttft_ms, predicted_e2e_ms=final.predicted_e2e_ms,
        num_preemptions=final.num_preemptions, ok=final.status == "ok", error=final.error, status=final.status,
        cached_tokens=final.cached_tokens, predicted_cached_tokens=final.predicted_cached_tokens)


def failed_record(request: TraceRequest, offset_s: float, error: str) -> RequestRecord:
    return RequestRecord(
        request_id="", submitted_at_s=offset_s, instance=None, prompt_tokens=request.prompt_tokens,
        true_output_tokens=request.true_output_tokens, predicted_output_tokens=None, output_tokens=0,
        queue_wait_ms=None, ttft_ms=None, tpot_ms=None, e2e_ms=None, predicted_ttft_ms=None,
        predicted_e2e_ms=None, num_preemptions=0, ok=False, error=error, status="failed")


async def _follow_heartbeats(client: AsyncClient, started_s: float, time_scale: float, result: ReplayResult,
                             stop: asyncio.Event) -> None:
    """KV usage and emulator lag of every instance, from the beats during the replay."""
    last_id = "$"
    stream = client.settings.keys.heartbeats
    while not stop.is_set():
        try:
            reply = await client.redis.xread({stream: last_id}, count=1000, block=200)
        except RedisError:  # the samples of a moment are lost; the replay goes on
            await asyncio.sleep(0.2)
            continue
        if not reply:
            continue
        now_s = (time.monotonic() - started_s) / time_scale
        for entry_id, fields in reply[0][1]:
            last_id = entry_id
            try:
                beat = decode_heartbeat(fields[PAYLOAD_FIELD.encode()])
            except (ValidationError, KeyError):
                continue
            num_blocks = beat.engine_config.get("num_gpu_blocks") or 0
            if beat.state == InstanceState.LIVE and num_blocks:
                result.kv_samples.append(KvSample(now_s, beat.instance_id, beat.num_used_blocks / num_blocks))
                result.lag_samples_ms.append(beat.lag_p99_ms)
                result.lag_mean_samples_ms.append(beat.lag_mean_ms)
                if beat.delivery_p90_ms is not None:
                    result.delivery_samples_ms.append(beat.delivery_p90_ms)
