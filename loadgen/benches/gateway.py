"""The gateway's added latency over the client library: sequential requests of
``--max-tokens`` (default 1) output tokens, alternating between ``AsyncClient`` and
``POST /v1/completions`` on a keep-alive HTTP connection, so both see the same cluster
state. Reports p50/p99 end-to-end milliseconds each way and their difference.

    python -m loadgen.benches.gateway --gateway-url http://127.0.0.1:8000 --requests 200 [--json]

The Redis URL comes from ``--redis``, ``BLOCKQ_REDIS_URL`` or the ``blockq up`` state directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from typing import Any

import aiohttp

from blockq.client import AsyncClient
from blockq.config import Settings
from blockq.runtime.service_runner import add_common_arguments, settings_from_args


def percentile_ms(samples_s: list[float], q: float) -> float:
    ordered = sorted(samples_s)
    return round(1000 * ordered[max(0, math.ceil(q * len(ordered)) - 1)], 3)


async def measure(settings: Settings, gateway_url: str, num_requests: int, max_tokens: int, model: str,
                  api_key: str | None, num_warmup: int = 10) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "prompt": "hello", "max_tokens": max_tokens}
    library_s: list[float] = []
    gateway_s: list[float] = []
    async with AsyncClient(settings=settings) as client, aiohttp.ClientSession(headers=headers) as session:
        for i in range(num_warmup + num_requests):
            started_s = time.perf_counter()
            final = await (await client.submit("hello", max_tokens=max_tokens)).result(60)
            library_elapsed_s = time.perf_counter() - started_s
            started_s = time.perf_counter()
            async with session.post(f"{gateway_url}/v1/completions", json=body) as response:
                payload = await response.json()
                if response.status != 200:
                    raise RuntimeError(f"gateway answered {response.status}: {payload}")
            gateway_elapsed_s = time.perf_counter() - started_s
            if final.status != "ok":
                raise RuntimeError(f"request {final.request_id} ended {final.status}")
            if i >= num_warmup:
                library_s.append(library_elapsed_s)
                gateway_s.append(gateway_elapsed_s)
    report: dict[str, Any] = {"requests": num_requests, "max_tokens": max_tokens}
    for name, samples in (("library", library_s), ("gateway", gateway_s)):
        report[name] = {"p50_ms": percentile_ms(samples, 0.5), "p99_ms": percentile_ms(samples, 0.99),
                        "mean_ms": round(1000 * sum(samples) / len(samples), 3)}
    report["added"] = {k: round(report["gateway"][k] - report["library"][k], 3) for k in ("p50_ms", "p99_ms", "mean_ms")}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadgen.benches.gateway", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    parser.add_argument("--gateway-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default="blockq")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    settings = settings_from_args(args)
    report = asyncio.run(measure(settings, args.gateway_url.rstrip("/"), args.requests, args.max_tokens, args.model,
                                 args.api_key))
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        for name in ("library", "gateway", "added"):
            r = report[name]
            sys.stdout.write(f"{name:<8} p50 {r['p50_ms']:8.2f} ms   p99 {r['p99_ms']:8.2f} ms   "
                             f"mean {r['mean_ms']:8.2f} ms\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
