"""End to end with real processes: `blockq up --detach`, requests through the client
library, `blockq status --json`, `blockq down`."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest

from blockq import AsyncClient, SubmitSpec
from blockq.config import Settings
from blockq.local.state import ClusterState, pid_alive
from tests.conftest import run_blockq, wait_until


@pytest.fixture
def cluster(tmp_path: Path):
    """A 2-instance cluster with its own embedded Redis; always torn down."""
    state_dir = tmp_path / "state"
    env = {"BLOCKQ_STATE_DIR": str(state_dir), "BLOCKQ_REDIS_URL": ""}
    up = run_blockq("up", "--instances", "2", "--time-scale", "0.25", "--metrics-base-port", "0", "--detach", "--json",
                    env=env)
    try:
        assert up.returncode == 0, up.stderr + up.stdout
        report = json.loads(up.stdout)
        state = ClusterState.read(state_dir)
        assert state is not None
        yield env, report, state
    finally:
        down = run_blockq("down", env=env)
        assert down.returncode == 0, down.stderr


async def replay(redis_url: str, num_requests: int) -> list[tuple[list, object]]:
    async with AsyncClient(settings=Settings(redis_url=redis_url)) as client:
        handles = await client.submit_many(
            [SubmitSpec(prompt=f"request number {i} " * (1 + i % 7), max_tokens=1 + (i * 7) % 40)
             for i in range(num_requests)])

        async def collect(handle):  # noqa: ANN001, ANN202
            chunks = [chunk async for chunk in handle.stream(timeout_s=120)]
            return chunks, await handle.result(timeout_s=1)

        return await asyncio.gather(*(collect(h) for h in handles))


def test_up_replay_status_down(cluster) -> None:  # noqa: ANN001
    env, report, state = cluster
    assert report["num_live_instances"] == 2
    results = asyncio.run(replay(state.redis_url, 200))
    for i, (chunks, final) in enumerate(results):
        assert final.status == "ok"
        assert [c.index for c in chunks] == list(range(len(chunks)))  # in order, no gaps or duplicates
        assert "".join(c.text for c in chunks) == final.text
        assert final.output_tokens == sum(c.num_tokens for c in chunks)
        assert 1 <= final.output_tokens <= 1 + (i * 7) % 40
        assert final.instance in ("inst-0", "inst-1")
    assert {final.instance for _, final in results} == {"inst-0", "inst-1"}

    status = run_blockq("status", "--json", env=env)
    assert status.returncode == 0, status.stderr
    data = json.loads(status.stdout)
    assert [(i["id"], i["state"]) for i in data["instances"]] == [("inst-0", "live"), ("inst-1", "live")]
    assert all(i["last_heartbeat_age_ms"] < 2000 for i in data["instances"])
    assert data["dead_letters"] == 0

    submit = run_blockq("submit", "hello", "--max-tokens", "8", "--json", env=env)
    assert submit.returncode == 0, submit.stderr
    record = json.loads(submit.stdout)
    assert record["output_tokens"] == 8 and record["instance"].startswith("inst-")
    assert {"id", "text", "ttft_ms", "e2e_ms"} <= record.keys()

    down = run_blockq("down", env=env)
    assert down.returncode == 0
    pids = [state.supervisor_pid, state.redis_pid, *state.children.values()]
    wait_until(lambda: not any(pid_alive(p) for p in pids), timeout_s=10)
    port = int(state.redis_url.rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as sock, pytest.raises(OSError):
        sock.connect(("127.0.0.1", port))


def test_block_policy_end_to_end(tmp_path: Path) -> None:
    """`blockq up --policy block`: requests complete and carry the dispatcher's forecast."""
    env = {"BLOCKQ_STATE_DIR": str(tmp_path / "state"), "BLOCKQ_REDIS_URL": ""}
    up = run_blockq("up", "--instances", "3", "--policy", "block", "--time-scale", "0.25", "--metrics-base-port", "0",
                    "--detach", env=env)
    try:
        assert up.returncode == 0, up.stderr + up.stdout
        state = ClusterState.read(tmp_path / "state")
        assert state is not None
        results = asyncio.run(replay(state.redis_url, 60))
    finally:
        assert run_blockq("down", env=env).returncode == 0
    finals = [final for _, final in results]
    assert all(f.status == "ok" for f in finals)
    assert all(f.predicted_ttft_ms is not None and f.predicted_e2e_ms is not None for f in finals)
    assert all(0 <= f.predicted_ttft_ms <= f.predicted_e2e_ms for f in finals)
    assert len({f.instance for f in finals}) == 3
