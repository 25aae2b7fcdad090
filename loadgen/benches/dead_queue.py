"""``python -m loadgen.benches.dead_queue``: how long a leader takes to empty a dead
instance's queue onto the live ones, and whether any entry was lost or placed twice.

A real :class:`~dispatcher.service.Dispatcher` (``run``: lease, renewals, fenced writes)
against Redis (an embedded server unless ``--redis-url``). ``--live`` instances beat every
100 ms with an idle engine; the dead instance ``dead`` beat once and fell silent, its queue
holding ``--entries`` requests (owner ``dead``; the first ``--taken`` were read by its
worker, pending in ``work``: a dead queue moves whole). Nobody consumes the live queues.
The clock runs from the earliest moment the instance can be declared dead (its last beat
plus ``--dead-after-s``, the leader having started with it) until its queue is empty.

Reported: ``seconds`` (until empty, or ``--timeout-s`` when it never was), ``lost``
(requests found nowhere: not in a live queue, not back in ``ready``, not left in the dead
queue), ``duplicated`` (requests found more than once, anywhere), ``wrong_owner`` (an ``owner:{id}`` that is not where the request is
queued) and ``terms`` (leases this dispatcher took: more than 1 means a fenced write was
refused and the work started over).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from blockq.config import Settings
from blockq.engine_model import EngineScheduler, get_preset
from blockq.local.embedded_redis import start_embedded_redis
from blockq.wire.keys import GROUP_WORK, PAYLOAD_FIELD, Keys
from blockq.wire.protocol import Assignment, Prediction, Request, decode_request, encode
from blockq.wire.streams import connect_async, ensure_group
from dispatcher.replacement import DEFAULT_CHUNK_ENTRIES
from dispatcher.service import DispatcherOptions, create_dispatcher, prepare_for_decisions
from loadgen.benches.dispatch import heartbeat_of

PRESET = "llama2-7b-a30"
DEAD = "dead"
BEAT_INTERVAL_S = 0.1
FILL_CHUNK = 5_000


def queued_request(keys: Keys, index: int) -> Request:
    """A short annotated request, as the dispatcher had placed it on ``DEAD``."""
    request_id = f"r{index:06d}-{uuid.uuid4().hex[:8]}"
    prompt_tokens, output_tokens = 32 + index % 200, 16 + index % 100
    request = Request(id=request_id, prompt=tuple([1] * prompt_tokens), max_tokens=512,
                      reply_stream=keys.reply(request_id), submitted_at_s=time.time(), priority="interactive",
                      prediction=Prediction(prompt_tokens, output_tokens, max(1, output_tokens // 2),
                                            output_tokens * 2, "bench"))
    return request.with_assignment(Assignment(instance_id=DEAD, policy="bench", decided_at_s=time.time(),
                                              decision_ms=0.0))


async def fill_dead_queue(client: aioredis.Redis, keys: Keys, num_entries: int, num_taken: int,
                          reply_ttl_s: int) -> list[str]:
    """``num_entries`` requests in ``DEAD``'s queue, owned by it; ``num_taken`` read by its worker."""
    queue = keys.instance_queue(DEAD)
    ids: list[str] = []
    for start in range(0, num_entries, FILL_CHUNK):
        pipe = client.pipeline(transaction=False)
        for index in range(start, min(num_entries, start + FILL_CHUNK)):
            request = queued_request(keys, index)
            ids.append(request.id)
            pipe.set(keys.owner(request.id), DEAD, ex=reply_ttl_s)
            pipe.xadd(queue, {PAYLOAD_FIELD: encode(request)})
        await pipe.execute()
    await ensure_group(client, queue, GROUP_WORK)
    if num_taken:
        await client.xreadgroup(GROUP_WORK, DEAD, {queue: ">"}, count=num_taken)
    return ids


async def beat_forever(client: aioredis.Redis, keys: Keys, instance_ids: list[str], stop: asyncio.Event) -> None:
    """Every live instance beats every 100 ms with an idle engine (its queue is not read)."""
    preset = get_preset(PRESET)
    engines = {i: EngineScheduler(preset.config, preset.latency_model) for i in instance_ids}
    seq = 0
    while not stop.is_set():
        seq += 1
        pipe = client.pipeline(transaction=False)
        for instance_id, engine in engines.items():
            payload = encode(heartbeat_of(instance_id, engine, seq, time.time(), PRESET))
            pipe.xadd(keys.heartbeats, {PAYLOAD_FIELD: payload})  # as a worker beats: stream and registry
            pipe.hset(keys.instances, instance_id, payload)
        await pipe.execute()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), BEAT_INTERVAL_S)


async def audit(client: aioredis.Redis, keys: Keys, ids: list[str], live: list[str]) -> dict[str, int]:
    """Where every request ended up: lost, duplicated, owned by another instance."""
    where: Counter[str] = Counter()
    wrong_owner = 0
    for instance_id in live:
        for _, fields in await client.xrange(keys.instance_queue(instance_id)):
            request_id = decode_request(fields[PAYLOAD_FIELD.encode()]).id
            where[request_id] += 1
            if await client.get(keys.owner(request_id)) != instance_id.encode():
                wrong_owner += 1
    for stream in (keys.ready, keys.instance_queue(DEAD)):  # held work goes back to ready; the rest may wait
        for _, fields in await client.xrange(stream):
            where[decode_request(fields[PAYLOAD_FIELD.encode()]).id] += 1
    return {"lost": sum(1 for request_id in ids if where[request_id] == 0),
            "duplicated": sum(1 for count in where.values() if count > 1),
            "wrong_owner": wrong_owner,
            "left_in_dead_queue": await client.xlen(keys.instance_queue(DEAD))}


async def bench_dead_queue(redis_url: str, *, entries: int = 20_000, live: int = 3, taken: int = 10,
                            policy: str = "block", dead_after_s: float = 1.0, lease_ms: int = 3000,
                            chunk: int = DEFAULT_CHUNK_ENTRIES, timeout_s: float = 60.0) -> dict[str, Any]:
    settings = Settings(redis_url=redis_url, key_prefix=f"bqrepl{uuid.uuid4().hex[:6]}:", log_level="warning",
                        slo_ttft_ms=0)
    keys = settings.keys
    client = connect_async(redis_url)
    live_ids = [f"live-{k}" for k in range(live)]
    ids = await fill_dead_queue(client, keys, entries, taken, settings.reply_ttl_s)
    dispatcher = create_dispatcher(client, settings, policy, dispatcher_id="bench-replacement", seed=0,
                                   options=DispatcherOptions(dead_after_s=dead_after_s, lease_ms=lease_ms,
                                                             replace_chunk_entries=chunk))
    prepare_for_decisions(dispatcher.core)
    terms = 0
    acquire = dispatcher.acquire_lease

    async def counted_acquire(stop: asyncio.Event) -> bool:
        nonlocal terms
        taken_now = await acquire(stop)
        terms += taken_now
        return taken_now

    dispatcher.acquire_lease = counted_acquire  # type: ignore[method-assign]
    stop = asyncio.Event()
    dead = get_preset(PRESET)
    last_beat = encode(heartbeat_of(DEAD, EngineScheduler(dead.config, dead.latency_model), 1, time.time(), PRESET))
    await client.xadd(keys.heartbeats, {PAYLOAD_FIELD: last_beat})
    await client.hset(keys.instances, DEAD, last_beat)
    dead_from_s = time.monotonic() + dead_after_s
    tasks = [asyncio.create_task(beat_forever(client, keys, live_ids, stop)),
             asyncio.create_task(dispatcher.run(stop))]
    queue = keys.instance_queue(DEAD)
    try:
        while await client.xlen(queue) and time.monotonic() < dead_from_s + timeout_s:
            if any(task.done() for task in tasks):
                break
            await asyncio.sleep(0.05)
        seconds = time.monotonic() - dead_from_s
    finally:
        stop.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [repr(r) for r in results if isinstance(r, BaseException)]
    counts = await audit(client, keys, ids, live_ids)
    keys_to_delete = [key async for key in client.scan_iter(match=f"{keys.prefix}*")]
    for start in range(0, len(keys_to_delete), 10_000):
        await client.delete(*keys_to_delete[start:start + 10_000])
    await client.aclose()
    return {"policy": policy, "entries": entries, "live_instances": live, "lease_ms": lease_ms, "chunk": chunk,
            "seconds": round(seconds, 2), "emptied": counts["left_in_dead_queue"] == 0, **counts,
            "terms": terms, "errors": errors}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadgen.benches.dead_queue", description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=20_000, help="requests in the dead instance's queue")
    parser.add_argument("--live", type=int, default=3, help="live instances they move to")
    parser.add_argument("--taken", type=int, default=10, help="of them, read by the dead worker (pending)")
    parser.add_argument("--policy", default="block", help="placement policy (default: block)")
    parser.add_argument("--dead-after-s", type=float, default=1.0, help="seconds of silence before dead")
    parser.add_argument("--lease-ms", type=int, default=3000, help="the leader lease, ms")
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK_ENTRIES, help="entries re-placed per step at most")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="give up after this many seconds")
    parser.add_argument("--redis-url", default=None, help="an existing Redis (default: start an embedded one)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    options = {"entries": args.entries, "live": args.live, "taken": args.taken, "policy": args.policy,
               "dead_after_s": args.dead_after_s, "lease_ms": args.lease_ms, "chunk": args.chunk,
               "timeout_s": args.timeout_s}
    if args.redis_url:
        result = asyncio.run(bench_dead_queue(args.redis_url, **options))
    else:
        with tempfile.TemporaryDirectory(prefix="blockq-replacement-") as tmp:
            server = start_embedded_redis(Path(tmp))
            try:
                result = asyncio.run(bench_dead_queue(server.url, **options))
            finally:
                server.stop()
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        sys.stdout.write(" ".join(f"{name}={value}" for name, value in result.items()) + "\n")
    return 0 if result["emptied"] and not result["lost"] and not result["duplicated"] else 1


if __name__ == "__main__":
    sys.exit(main())
