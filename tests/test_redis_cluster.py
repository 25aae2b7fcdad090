"""blockq on a real 3-primary Redis Cluster (redis-server processes started here): the
whole path with real processes (``blockq up --redis redis+cluster://...`` with predictor,
dispatcher, workers, gateway and batch worker): submit, predict, place, generate,
cancel, batch jobs (rq) and the gateway, with no CROSSSLOT error anywhere.

The layout under test (:mod:`blockq.wire.keys`): the key prefix ``{bq}:`` carries a hash tag,
so every blockq key, and rq's under ``{bq}:rq``, sits in one slot: the fenced placement
transaction, the output scripts and admission stay atomic; one shard holds them all.

The end-to-end test is marked ``chaos`` (about 40 s: ``make test-chaos``); the others run
in the default suite (a cluster starts in about 2 s)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from blockq import AsyncClient, Client, SubmitSpec
from blockq.config import ConfigError, Settings
from blockq.local.embedded_redis import free_port
from blockq.local.state import ClusterState
from blockq.wire.keys import Keys
from blockq.wire.redis_url import RedisUrlError, parse_redis_url, redact_url
from blockq.wire.streams import connect, connect_pinned
from tests.conftest import run_blockq, wait_until
from tests.redis_topologies import RedisClusterTopology, start_redis_cluster

PREFIX = "{bq}:"
# What a cluster client says when one command, script or transaction spans slots.
CROSS_SLOT_ERRORS = ("CROSSSLOT", "must map to the same slot", "non local key", "Keys in request don't hash")


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterTopology]:
    topology = start_redis_cluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield topology
    finally:
        topology.stop()


@pytest.fixture(scope="module")
def blockq_on_cluster(redis_cluster: RedisClusterTopology,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """``blockq up`` on the cluster: 2 instances placed by the ``block`` policy, gateway,
    batch worker; always torn down."""
    state_dir = tmp_path_factory.mktemp("blockq-on-cluster") / "state"
    env = {"BLOCKQ_STATE_DIR": str(state_dir), "BLOCKQ_REDIS_URL": redis_cluster.url, "BLOCKQ_KEY_PREFIX": PREFIX,
           # the batch jobs' files live in pytest's temporary directory: the worker's and submit's root
           "BLOCKQ_BATCH_INPUT_ROOT": str(tmp_path_factory.getbasetemp())}
    try:
        up = run_blockq("up", "--instances", "2", "--policy", "block", "--time-scale", "0.1", "--gateway",
                        "--gateway-port", str(free_port()), "--batch-worker", "--metrics-base-port", "0",
                        "--detach", "--json", env=env)
        assert up.returncode == 0, up.stderr + up.stdout
        report = json.loads(up.stdout)
        state = ClusterState.read(state_dir)
        assert state is not None
        yield {"env": env, "report": report, "logs": state_dir / "logs",
               "settings": Settings(redis_url=redis_cluster.url, key_prefix=PREFIX)}
    finally:
        down = run_blockq("down", env=env)
        assert down.returncode == 0, down.stderr


def test_cluster_url_forms() -> None:
    target = parse_redis_url("rediss+cluster://u:p%40ss@10.0.0.1:7000,10.0.0.2,[::1]:7002?socket_timeout=2")
    assert (target.kind, target.tls, target.username, target.password) == ("cluster", True, "u", "p@ss")
    assert target.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002))
    assert target.node_url() == "rediss://u:p%40ss@10.0.0.1:7000/0?socket_timeout=2"
    assert "p@ss" not in repr(target) and redact_url(target.url).startswith("rediss+cluster://u:***@")
    for bad in ("redis+cluster://", "redis+cluster://h:port", "redis+cluster://h?sentinel_password=x"):
        with pytest.raises(RedisUrlError):
            parse_redis_url(bad)


def test_cluster_url_needs_a_tagged_prefix() -> None:
    url = "redis+cluster://:pw@127.0.0.1:7000,127.0.0.1:7001"
    with pytest.raises(ConfigError, match="key_prefix.*hash tag"):
        Settings(redis_url=url)
    assert Settings(redis_url=url, key_prefix="{prod}:").keys.hash_tag == "prod"
    with pytest.raises(ConfigError, match="redis_url"):
        Settings(redis_url="redis+cluster://127.0.0.1:7000/2", key_prefix=PREFIX)


def test_one_slot_holds_every_key_and_clients_route_there(redis_cluster: RedisClusterTopology) -> None:
    redis_cluster.flush()
    client = connect(redis_cluster.url)
    assert isinstance(client, redis.RedisCluster)
    keys = Keys(PREFIX)
    slot = client.keyslot(keys.requests)
    names = [keys.ready, keys.done, keys.dispatcher_lease, keys.instance_queue("a"), keys.reply("r"),
             keys.owner("r"), keys.final_flag("r")]
    assert {client.keyslot(name) for name in names} == {slot}
    # A transaction over several of them runs (no CROSSSLOT): the fenced placement's shape.
    pipe = client.pipeline(transaction=True)
    pipe.set(keys.owner("r"), "a")
    pipe.xadd(keys.instance_queue("a"), {"m": b"x"})
    pipe.xadd(keys.reply("r"), {"m": b"y"})
    assert len(pipe.execute()) == 3
    # rq's pinned client reaches the slot's primary, and only that node holds data.
    pinned = connect_pinned(redis_cluster.url, f"{PREFIX}rq")
    assert pinned.get(keys.owner("r")) == b"a"
    holder = client.nodes_manager.get_node_from_slot(slot)
    sizes = {node.port: redis_cluster.node_client(node).dbsize() for node in redis_cluster.nodes}
    assert sizes[holder.port] == 3 and sum(sizes.values()) == 3
    pinned.close()
    client.close()


async def _replay(settings: Settings, num_requests: int) -> list[tuple[list, Any]]:
    async with AsyncClient(settings=settings) as client:
        handles = await client.submit_many([SubmitSpec(prompt=f"cluster request {i} " * (1 + i % 5),
                                                       max_tokens=1 + (i * 7) % 30) for i in range(num_requests)])

        async def collect(handle):  # noqa: ANN001, ANN202
            chunks = [chunk async for chunk in handle.stream(timeout_s=60)]
            return chunks, await handle.result(timeout_s=1)

        return await asyncio.gather(*(collect(h) for h in handles))


def _write_batch_input(path: Path, num_lines: int) -> Path:
    with path.open("w") as file:
        for i in range(num_lines):
            body = {"model": "blockq", "prompt": f"batch line {i}", "max_tokens": 1 + i % 4}
            file.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                                   "body": body}) + "\n")
    return path


def _batch(env: dict[str, str], *args: str) -> dict[str, Any]:
    result = run_blockq("batch", *args, "--json", env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.chaos
def test_the_whole_path_runs_on_the_cluster(blockq_on_cluster: dict[str, Any], tmp_path: Path) -> None:
    settings, env = blockq_on_cluster["settings"], blockq_on_cluster["env"]
    assert blockq_on_cluster["report"]["num_live_instances"] == 2

    # submit, predict, place, generate: in order, no gaps, on both instances
    results = asyncio.run(_replay(settings, 80))
    for chunks, final in results:
        assert final.status == "ok", final
        assert "".join(c.text for c in chunks) == final.text
        assert final.output_tokens == sum(c.num_tokens for c in chunks)
        # predicted and placed: the predictor's length and block's TTFT forecast reached the record
        assert final.predicted_output_tokens is not None and final.predicted_ttft_ms is not None, final
    assert {final.instance for _, final in results} == {"inst-0", "inst-1"}
    with connect(settings.redis_url) as cluster_client:  # the services wrote to the cluster
        assert cluster_client.xlen(settings.keys.done) >= 80

    # cancel a long request once it streams
    with Client(settings=settings) as client:
        handle = client.submit("a long one", max_tokens=4000, true_output_tokens=4000)
        assert handle.placement(timeout_s=30) is not None
        next(iter(handle.stream(timeout_s=30)))
        handle.cancel()
        assert handle.result(timeout_s=30).status == "cancelled"

    # the gateway
    gateway_url = blockq_on_cluster["report"]["gateway_url"]
    body = json.dumps({"model": "blockq", "prompt": "hello cluster", "max_tokens": 5}).encode()
    request = urllib.request.Request(f"{gateway_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        completion = json.loads(response.read())
    assert completion["usage"]["completion_tokens"] == 5 and completion["choices"][0]["text"]

    # batch jobs (rq on the slot's primary): one runs to the end, one is cancelled mid-way
    job = _batch(env, "submit", str(_write_batch_input(tmp_path / "in.jsonl", 40)), "--out", str(tmp_path / "out.jsonl"))
    slow = _batch(env, "submit", str(_write_batch_input(tmp_path / "slow.jsonl", 400)), "--out",
                  str(tmp_path / "slow.jsonl.out"), "--max-rate", "20")
    wait_until(lambda: _batch(env, "status", job["job_id"])["status"] == "finished", timeout_s=60, interval_s=0.3)
    status = _batch(env, "status", job["job_id"])
    assert (status["done"], status["failed"], status["total"]) == (40, 0, 40)
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [f"req-{i}" for i in range(40)]
    wait_until(lambda: _batch(env, "status", slow["job_id"])["done"] >= 5, timeout_s=60, interval_s=0.3)
    cancelled = _batch(env, "cancel", slow["job_id"])
    assert cancelled["status"] == "canceled" and cancelled["done"] < 400

    status_report = json.loads(run_blockq("status", "--json", env=env).stdout)
    assert status_report["dead_letters"] == 0 and status_report["prefix"] == PREFIX

    time.sleep(0.5)  # let the services flush their last log lines
    log_text = "\n".join(path.read_text(errors="replace") for path in blockq_on_cluster["logs"].glob("*.log"))
    assert not [e for e in CROSS_SLOT_ERRORS if e in log_text], [e for e in CROSS_SLOT_ERRORS if e in log_text]
    assert "Traceback" not in log_text
