"""The load generator's own Redis failures: a request whose submit or wait meets a Redis
error is recorded failed, saying so, and the replay goes on (on a saturated 2-core machine
a load generator's read can time out while the run itself is sound)."""

from __future__ import annotations

from blockq.client import AsyncClient
from blockq.config import Settings
from blockq.local.embedded_redis import free_port
from loadgen.replay import ReplayOptions, replay
from loadgen.traces import TraceRequest


async def test_a_redis_error_fails_its_requests_not_the_replay() -> None:
    settings = Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    requests = [TraceRequest(prompt=(1, 2, 3), prompt_tokens=3, true_output_tokens=4) for _ in range(3)]
    async with AsyncClient(settings=settings) as client:
        result = await replay(client, [(0.0, r) for r in requests], ReplayOptions(max_duration_s=30))
    assert len(result.records) == 3
    assert all(not r.ok and r.error is not None and r.error.startswith("redis: ") for r in result.records)
