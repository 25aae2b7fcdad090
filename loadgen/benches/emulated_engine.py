"""``blockq bench-engine``: what the emulated engine costs.

1. the engine model's step cost (µs) for a batch of 48 running + 20 waiting requests,
   and reference steps/s when stepping to the end (from :mod:`loadgen.benches.engine_model`);
2. how many emulated instances one worker process pinned to one core sustains in real
   time, each fed Poisson arrivals (default 2.7 requests/s: the Block paper's 32 QPS over
   12 instances) of ShareGPT-like lengths, with emulator lag p99 under a bound (5 ms).
   The worker runs for real against an embedded Redis; arrivals are written straight into
   the instances' queues (no predictor, no dispatcher), so the figure is the worker's own.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockq.config import Settings
from blockq.local.embedded_redis import start_embedded_redis
from blockq.wire.beats import decode_heartbeat
from blockq.wire.keys import PAYLOAD_FIELD
from blockq.wire.protocol import Prediction, Request, encode
from blockq.wire.streams import connect


@dataclass(frozen=True)
class SustainOptions:
    instance_counts: tuple[int, ...] = (4, 8, 12, 16)
    rate_per_instance: float = 2.7
    duration_s: float = 30.0
    lag_bound_ms: float = 5.0
    preset: str = "llama2-7b-a30"
    cpu: int | None = 0              # pin the worker process to this core (None: no pinning)
    seed: int = 0


def sharegpt_like_lengths(rng: random.Random) -> tuple[int, int]:
    """(prompt, output) tokens: lognormal, medians 35 and 250 like the paper's trace, capped."""
    prompt = min(2000, max(1, int(rng.lognormvariate(math.log(35), 1.6))))
    output = min(1000, max(1, int(rng.lognormvariate(math.log(250), 0.8))))
    return prompt, output


def _request(settings: Settings, rng: random.Random) -> Request:
    prompt_tokens, output_tokens = sharegpt_like_lengths(rng)
    request_id = uuid.uuid4().hex
    return Request(id=request_id, prompt=tuple([7] * prompt_tokens), max_tokens=4096 - prompt_tokens,
                   reply_stream=settings.keys.reply(request_id), submitted_at_s=time.time(),
                   true_output_tokens=output_tokens,
                   prediction=Prediction(prompt_tokens, output_tokens, output_tokens, output_tokens, "bench"))


def measure_instances(redis_url: str, num_instances: int, options: SustainOptions) -> dict[str, Any]:
    """Run one worker process with ``num_instances`` instances under load; lag figures."""
    settings = Settings(redis_url=redis_url)
    client = connect(redis_url)
    client.flushall()
    command = [sys.executable, "-m", "workers", "--instance-id", "bench", "--instances", str(num_instances),
               "--preset", options.preset]
    pin = (lambda: os.sched_setaffinity(0, {options.cpu})) if options.cpu is not None else None
    worker = subprocess.Popen(command, env={**os.environ, "BLOCKQ_REDIS_URL": redis_url, "BLOCKQ_LOG_LEVEL": "warning"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=pin)
    rng = random.Random(options.seed)
    try:
        _wait_for_instances(client, settings, num_instances)
        started_s = time.monotonic()
        next_at = [started_s + rng.expovariate(options.rate_per_instance) for _ in range(num_instances)]
        lags: list[float] = []
        last_beat_id = "$"
        num_sent = 0
        while time.monotonic() - started_s < options.duration_s:
            now_s = time.monotonic()
            pipe = client.pipeline(transaction=False)
            for index in range(num_instances):
                while next_at[index] <= now_s:
                    pipe.xadd(settings.keys.instance_queue(f"bench-{index}"),
                              {PAYLOAD_FIELD: encode(_request(settings, rng))})
                    next_at[index] += rng.expovariate(options.rate_per_instance)
                    num_sent += 1
            pipe.execute()
            reply = client.xread({settings.keys.heartbeats: last_beat_id}, count=1000, block=20)
            for entry_id, fields in (reply[0][1] if reply else []):
                last_beat_id = entry_id
                beat = decode_heartbeat(fields[PAYLOAD_FIELD.encode()])
                if time.monotonic() - started_s > 2.0:  # skip the warm-up beats
                    lags.append(beat.lag_p99_ms)
        lags.sort()
        return {"instances": num_instances, "requests_sent": num_sent,
                "lag_p99_ms": round(lags[int(0.99 * (len(lags) - 1))], 2) if lags else None,
                "lag_max_ms": round(lags[-1], 2) if lags else None,
                "sustained": bool(lags) and lags[int(0.99 * (len(lags) - 1))] <= options.lag_bound_ms}
    finally:
        worker.kill()
        worker.wait()
        client.close()


def _wait_for_instances(client: Any, settings: Settings, num_instances: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.hlen(settings.keys.instances) < num_instances:
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker did not start {num_instances} instances within {timeout_s} s")
        time.sleep(0.05)


def sustained_instances(options: SustainOptions) -> dict[str, Any]:
    """Largest instance count whose lag p99 stays within the bound, with every measurement."""
    with tempfile.TemporaryDirectory(prefix="blockq-bench-engine-") as tmp:
        server = start_embedded_redis(Path(tmp) / "redis")
        try:
            runs = [measure_instances(server.url, n, options) for n in options.instance_counts]
        finally:
            server.stop()
    sustained = [r["instances"] for r in runs if r["sustained"]]
    return {"instances_sustained": max(sustained) if sustained else 0, "runs": runs,
            "rate_per_instance": options.rate_per_instance, "duration_s": options.duration_s,
            "lag_bound_ms": options.lag_bound_ms, "pinned_cpu": options.cpu}
