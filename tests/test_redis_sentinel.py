"""blockq through Redis Sentinel, with a failover mid-replay: one primary, one replica and
three Sentinels (redis-server processes started here), ``blockq up --redis
redis+sentinel://...`` (predictor, dispatcher, workers). Requests are replayed through
:class:`blockq.AsyncClient`; the primary is SIGKILLed mid-replay; the Sentinels promote
the replica; clients and services follow it through the same URL.

What may be lost is the replication window (deploy/README.md, "Redis"): the writes the
primary acknowledged but had not sent to the replica when it died. On loopback that is
well under the second before the kill, so at most the requests accepted in that second may
go unanswered; no reader may see any output twice. The test prints the failover time
(Sentinels' view and clients' view) and the requests lost and duplicated.

The failover test is marked ``chaos`` (about 20 s: ``make test-chaos``); the others run in
the default suite."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis

from blockq import AsyncClient, SubmitSpec
from blockq.client import AsyncHandle
from blockq.config import ConfigError, Settings
from blockq.wire.redis_url import RedisUrlError, parse_redis_url
from blockq.wire.streams import connect, connect_async
from tests.conftest import run_blockq
from tests.redis_topologies import SentinelTopology, start_sentinel_group

NUM_REQUESTS = 240
RATE_PER_S = 24.0
KILL_AT_S = 4.0
ANSWER_TIMEOUT_S = 40.0
# The replication window the assertion allows: requests accepted this long before the kill.
REPLICATION_WINDOW_S = 1.0
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, OSError)


@pytest.fixture(scope="module")
def sentinel_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelTopology]:
    topology = start_sentinel_group(tmp_path_factory.mktemp("redis-sentinel"))
    try:
        yield topology
    finally:
        topology.stop()


@pytest.fixture(scope="module")
def blockq_on_sentinel(sentinel_group: SentinelTopology,
                       tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    state_dir = tmp_path_factory.mktemp("blockq-on-sentinel") / "state"
    env = {"BLOCKQ_STATE_DIR": str(state_dir), "BLOCKQ_REDIS_URL": sentinel_group.url}
    try:
        up = run_blockq("up", "--instances", "2", "--time-scale", "0.1", "--metrics-base-port", "0", "--detach",
                        "--json", env=env)
        assert up.returncode == 0, up.stderr + up.stdout
        yield {"env": env, "report": json.loads(up.stdout), "logs": state_dir / "logs",
               "settings": Settings(redis_url=sentinel_group.url)}
    finally:
        down = run_blockq("down", env=env)
        assert down.returncode == 0, down.stderr


def test_sentinel_url_forms() -> None:
    target = parse_redis_url("redis+sentinel://:s3cret@s1:26380,s2/blockq/2?socket_timeout=1&sentinel_password=sp")
    assert (target.kind, target.service_name, target.db, target.password) == ("sentinel", "blockq", 2, "s3cret")
    assert target.nodes == (("s1", 26380), ("s2", 26379))
    assert target.options == (("socket_timeout", "1"),) and target.sentinel_options == (("sentinel_password", "sp"),)
    assert parse_redis_url("rediss+sentinel://s1/blockq").tls
    for bad in ("redis+sentinel://s1:26379", "redis+sentinel://s1/blockq/x", "redis+sentinel://s1/a/1/2"):
        with pytest.raises(RedisUrlError):
            parse_redis_url(bad)
    with pytest.raises(ConfigError, match="redis_url"):
        Settings(redis_url="redis+sentinel://s1:26379")


def test_clients_follow_the_sentinels_primary(sentinel_group: SentinelTopology) -> None:
    """Sync and asyncio clients built from the Sentinel URL write to the primary."""
    client = connect(sentinel_group.url)
    client.set("probe", "1")
    with redis.Redis(host="127.0.0.1", port=sentinel_group.primary.port, password=sentinel_group.password) as direct:
        assert direct.get("probe") == b"1"

    async def read_async() -> bytes | None:
        async_client = connect_async(sentinel_group.url, max_connections=4, wait_for_connection=True)
        try:
            return await async_client.get("probe")
        finally:
            await async_client.aclose()

    assert asyncio.run(read_async()) == b"1"
    client.delete("probe")
    client.close()


@dataclass
class Replayed:
    """What one request's submitter and reader saw (times from the replay's start)."""

    request_id: str
    accepted_at_s: float | None = None
    status: str | None = None
    streamed_text: str = ""
    final_text: str | None = None


@dataclass
class FailoverClock:
    killed_at_s: float = 0.0
    promoted_at_s: float | None = None      # the Sentinels name a new primary
    first_write_at_s: float | None = None   # a client write through the URL succeeds again
    events: list[str] = field(default_factory=list)


async def _submit(client: AsyncClient, spec: SubmitSpec, deadline_s: float) -> AsyncHandle | None:
    """Submit, again on connection errors (same request id: admission is idempotent)."""
    while time.monotonic() < deadline_s:
        try:
            return (await client.submit_many([spec]))[0]
        except REDIS_DOWN:
            await asyncio.sleep(0.1)
    return None


async def _one(client: AsyncClient, index: int, started_s: float) -> Replayed:
    outcome = Replayed(f"sentinel-{index}")
    await asyncio.sleep(max(0.0, started_s + index / RATE_PER_S - time.monotonic()))
    spec = SubmitSpec(prompt=f"request {index} " * (1 + index % 6), max_tokens=40,
                      true_output_tokens=5 + index % 30, request_id=outcome.request_id)
    handle = await _submit(client, spec, time.monotonic() + ANSWER_TIMEOUT_S)
    if handle is None:
        return outcome
    outcome.accepted_at_s = time.monotonic() - started_s
    try:
        async for chunk in handle.stream(timeout_s=ANSWER_TIMEOUT_S):
            outcome.streamed_text += chunk.text
    except TimeoutError:
        return outcome
    final = await handle.result(timeout_s=1.0)
    outcome.status, outcome.final_text = final.status, final.text
    return outcome


async def _watch_failover(topology: SentinelTopology, url: str, clock: FailoverClock, started_s: float,
                          old_port: int) -> None:
    """Kill the primary at KILL_AT_S; time the promotion and the first write after it."""
    await asyncio.sleep(max(0.0, started_s + KILL_AT_S - time.monotonic()))
    topology.primary.process.kill()
    clock.killed_at_s = time.monotonic() - started_s
    probe = connect_async(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        while clock.promoted_at_s is None or clock.first_write_at_s is None:
            now_s = time.monotonic() - started_s
            if now_s > clock.killed_at_s + 60:
                return
            port = await asyncio.to_thread(topology.primary_port)
            if clock.promoted_at_s is None and port is not None and port != old_port:
                clock.promoted_at_s = now_s
            if clock.first_write_at_s is None:
                try:
                    await probe.set("failover-probe", now_s)
                    if port != old_port:
                        clock.first_write_at_s = time.monotonic() - started_s
                except REDIS_DOWN as exc:
                    clock.events.append(type(exc).__name__)
            await asyncio.sleep(0.05)
    finally:
        await probe.aclose()


async def _replay_through_failover(topology: SentinelTopology, settings: Settings) -> tuple[list[Replayed], FailoverClock]:
    clock = FailoverClock()
    old_port = topology.primary.port
    async with AsyncClient(settings=settings) as client:
        started_s = time.monotonic()
        watcher = asyncio.create_task(_watch_failover(topology, settings.redis_url or "", clock, started_s, old_port))
        outcomes = await asyncio.gather(*(_one(client, i, started_s) for i in range(NUM_REQUESTS)))
        await watcher
    return outcomes, clock


@pytest.mark.chaos
def test_failover_mid_replay(sentinel_group: SentinelTopology, blockq_on_sentinel: dict[str, Any]) -> None:
    assert blockq_on_sentinel["report"]["num_live_instances"] == 2
    old_port = sentinel_group.primary.port
    outcomes, clock = asyncio.run(_replay_through_failover(sentinel_group, blockq_on_sentinel["settings"]))

    accepted = [o for o in outcomes if o.accepted_at_s is not None]
    answered = [o for o in accepted if o.status is not None]
    lost = [o for o in accepted if o.status is None]
    duplicated = [o for o in answered if o.streamed_text != o.final_text]
    in_window = [o for o in accepted
                 if clock.killed_at_s - REPLICATION_WINDOW_S <= (o.accepted_at_s or 0) <= clock.killed_at_s]
    after = [o for o in accepted if (o.accepted_at_s or 0) > clock.killed_at_s]
    promotion_s = None if clock.promoted_at_s is None else clock.promoted_at_s - clock.killed_at_s
    first_write_s = None if clock.first_write_at_s is None else clock.first_write_at_s - clock.killed_at_s
    print(f"\nsentinel failover: primary :{old_port} killed at {clock.killed_at_s:.2f} s; promoted after "
          f"{promotion_s if promotion_s is None else round(promotion_s, 2)} s (Sentinels), writes accepted again "
          f"after {first_write_s if first_write_s is None else round(first_write_s, 2)} s (clients); "
          f"requests: {len(outcomes)} replayed, {len(accepted)} accepted, {len(answered)} answered, "
          f"{len(lost)} lost {[o.request_id for o in lost]}, {len(duplicated)} duplicated; "
          f"{len(in_window)} accepted in the {REPLICATION_WINDOW_S:.0f} s before the kill; "
          f"{len(after)} accepted after it")

    assert promotion_s is not None and first_write_s is not None
    assert sentinel_group.primary_port() != old_port
    assert len(accepted) == NUM_REQUESTS  # submits ride out the failover (idempotent retries)
    assert not duplicated
    assert len(lost) <= len(in_window)  # only what the replication window allows
    assert all(o.status == "ok" for o in answered)
    assert after and all(o.status == "ok" for o in after)  # the services followed the new primary
