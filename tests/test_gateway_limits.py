"""The gateway's limits against hostile or stuck clients, in-process against the test Redis
with a scripted worker and raw sockets: the stream write deadline, the body read deadline,
per-key quotas and policies; and the cost of a hostile 4 MiB body, against a gateway process
(docs/gateway.md)."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient, TestServer

from blockq.config import ConfigError, Settings
from blockq.frontdoors.gateway.api_keys import KeyPolicy, key_fingerprint, parse_api_key_specs
from blockq.frontdoors.gateway.cli import main as gateway_main
from blockq.frontdoors.gateway.config import GatewayConfig, gateway_config_from_env
from blockq.frontdoors.gateway.in_flight import InFlightSlots, SlotLimit
from blockq.frontdoors.gateway.server import create_app
from blockq.local.embedded_redis import free_port
from blockq.wire.keys import PAYLOAD_FIELD
from blockq.wire.protocol import (
    Chunk,
    FinalRecord,
    Placement,
    Request,
    decode_request,
    encode,
)
from tests.conftest import REPO_ROOT

KEY_A = "sk-limits-a"
KEY_B = "sk-limits-b"
AUTH_A = {"Authorization": f"Bearer {KEY_A}"}
AUTH_B = {"Authorization": f"Bearer {KEY_B}"}
FLOOD_CHUNK_TEXT = "x" * 65_536
MAX_FLOOD_CHUNKS = 800  # 52 MB at most, far past what loopback socket buffers hold


# --- fixtures: a scripted worker and a gateway per config ---------------------------------------


async def _answer(client: aioredis.Redis, request: Request) -> None:
    messages = [Placement(request.id, "inst-1", "block", 1.0, 4.0, 8.0), Chunk(request.id, 0, " a", 1, 0),
                FinalRecord(request.id, 1, "ok", " a", 1, 3, "inst-1", "length", ttft_ms=5.0, e2e_ms=9.0)]
    for message in messages:
        await client.xadd(request.reply_stream, {PAYLOAD_FIELD: encode(message)})


async def _flood(client: aioredis.Redis, settings: Settings, request: Request) -> None:
    """64 KiB chunks, paced, until the request is cancelled: more than any socket buffers."""
    await client.xadd(request.reply_stream, {PAYLOAD_FIELD: encode(Placement(request.id, "inst-1", "block", 1.0))})
    for index in range(MAX_FLOOD_CHUNKS):
        if await client.exists(settings.keys.cancel_flag(request.id)):
            return
        chunk = Chunk(request.id, index, FLOOD_CHUNK_TEXT, 1, index)
        await client.xadd(request.reply_stream, {PAYLOAD_FIELD: encode(chunk)})
        await asyncio.sleep(0.002)


async def scripted_worker(settings: Settings, stop: asyncio.Event) -> None:
    """Answers the ingress stream by prompt: "hold" never (the call stays in flight until the
    client leaves), "flood" with 64 KiB chunks until cancelled, anything else at once."""
    client = aioredis.Redis.from_url(settings.redis_url or "")
    floods: set[asyncio.Task[None]] = set()
    last_id = "0-0"
    try:
        while not stop.is_set():
            reply = await client.xread({settings.keys.requests: last_id}, block=50, count=64)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last_id = entry_id
                    request = decode_request(fields[PAYLOAD_FIELD.encode()])
                    prompt = request.prompt if isinstance(request.prompt, str) else ""
                    if "flood" in prompt:
                        floods.add(asyncio.create_task(_flood(client, settings, request)))
                    elif "hold" not in prompt:
                        await _answer(client, request)
    finally:
        for task in floods:
            task.cancel()
        await asyncio.gather(*floods, return_exceptions=True)
        await client.aclose()


@contextlib.asynccontextmanager
async def serving(config: GatewayConfig, settings: Settings, worker: bool = True) -> AsyncIterator[TestClient]:
    """The gateway on a free port (with the scripted worker unless ``worker`` is False)."""
    stop = asyncio.Event()
    task = asyncio.create_task(scripted_worker(settings, stop)) if worker else None
    try:
        async with TestClient(TestServer(create_app(config, settings))) as client:
            yield client
    finally:
        stop.set()
        if task is not None:
            await task


async def wait_for(predicate: Any, timeout_s: float, interval_s: float = 0.02) -> float:
    """Poll the async ``predicate`` until true; the seconds it took. Fails after ``timeout_s``."""
    started_s = time.monotonic()
    while not await predicate():
        assert time.monotonic() - started_s < timeout_s, f"condition not met within {timeout_s} s"
        await asyncio.sleep(interval_s)
    return time.monotonic() - started_s


async def in_flight(gateway: TestClient) -> int:
    return int((await (await gateway.get("/healthz")).json())["in_flight"])


def in_flight_is(gateway: TestClient, expected: int) -> Any:
    async def check() -> bool:
        return await in_flight(gateway) == expected
    return check


async def raw_connect(gateway: TestClient, receive_buffer_bytes: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer_bytes is not None:  # before connect, so that the window is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (gateway.server.host, gateway.server.port))
    return sock


def request_head(path: str, content_length: int, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: gateway", "Content-Type: application/json",
             f"Content-Length: {content_length}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def read_response(sock: socket.socket, timeout_s: float) -> bytes:
    """Bytes of one JSON answer, until the peer closes or ``timeout_s`` passes."""
    loop = asyncio.get_running_loop()
    data = b""
    with contextlib.suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(timeout_s):
            while chunk := await loop.sock_recv(sock, 65_536):
                data += chunk
                if b"\r\n\r\n" in data and data.endswith(b"}"):
                    break
    return data


def completion(prompt: str = "x", **extra: Any) -> dict[str, Any]:
    return {"model": "blockq", "prompt": prompt, **extra}


def submitted(sync_redis: Any, settings: Settings) -> list[Request]:
    return [decode_request(f[PAYLOAD_FIELD.encode()]) for _, f in sync_redis.xrange(settings.keys.requests)]


# --- finding 1: a stream whose client stops reading --------------------------------------------


@pytest.mark.timeout(60)
async def test_stream_client_that_stops_reading_frees_its_slot(settings: Settings, sync_redis: Any) -> None:
    config = GatewayConfig(api_key_to_tenant={KEY_A: "a"}, max_in_flight=1, request_timeout_s=30.0,
                           write_timeout_s=0.5)
    async with serving(config, settings) as gateway:
        body = json.dumps(completion("flood", stream=True, max_tokens=10_000)).encode()
        sock = await raw_connect(gateway, receive_buffer_bytes=4096)
        try:
            await asyncio.get_running_loop().sock_sendall(sock, request_head("/v1/completions", len(body),
                                                                             AUTH_A) + body)
            await wait_for(in_flight_is(gateway, 1), timeout_s=5.0)
            # The stream fills the socket buffers, then a write waits for a reader that
            # never reads: the deadline plus the time to fill them (the worker's pace).
            took_s = await wait_for(in_flight_is(gateway, 0), timeout_s=config.write_timeout_s + 5.0)
            print(f"\nslot of a stalled stream came back {took_s:.2f} s after it was taken "
                  f"(write_timeout_s {config.write_timeout_s})")
            (request,) = submitted(sync_redis, settings)
            assert sync_redis.exists(settings.keys.cancel_flag(request.id))
            response = await gateway.post("/v1/completions", json=completion(), headers=AUTH_A)
            assert response.status == 200
            metrics = await (await gateway.get("/metrics")).text()
            assert 'blockq_gateway_slow_clients_total{phase="stream_write"} 1.0' in metrics
        finally:
            sock.close()


# --- finding 2: a body that never finishes -----------------------------------------------------


@pytest.mark.timeout(60)
async def test_stalled_body_is_408_and_holds_a_slot_only_until_then(settings: Settings) -> None:
    config = GatewayConfig(api_key_to_tenant={KEY_A: "a"}, max_in_flight=1, read_timeout_s=1.0)
    async with serving(config, settings) as gateway:
        sock = await raw_connect(gateway)
        try:
            loop = asyncio.get_running_loop()
            await loop.sock_sendall(sock, request_head("/v1/completions", 1000, AUTH_A) + b'{"model": "b')
            started_s = time.monotonic()
            await wait_for(in_flight_is(gateway, 1), timeout_s=5.0)
            # the slot is taken before the body is read: a second call is refused meanwhile
            response = await gateway.post("/v1/completions", json=completion(), headers=AUTH_A)
            assert response.status == 429
            answer = await read_response(sock, timeout_s=10.0)
            took_s = time.monotonic() - started_s
            print(f"\nstalled body answered after {took_s:.2f} s (read_timeout_s {config.read_timeout_s})")
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b"Connection: close" in answer and b"within 1 s (read_timeout_s)" in answer
            assert took_s < config.read_timeout_s + 2.0
            assert await in_flight(gateway) == 0
            response = await gateway.post("/v1/completions", json=completion(), headers=AUTH_A)
            assert response.status == 200
            metrics = await (await gateway.get("/metrics")).text()
            assert 'blockq_gateway_slow_clients_total{phase="body_read"} 1.0' in metrics
        finally:
            sock.close()


@pytest.mark.timeout(60)
async def test_trickled_body_is_408_at_the_whole_body_deadline(settings: Settings) -> None:
    config = GatewayConfig(api_key_to_tenant={KEY_A: "a"}, read_timeout_s=0.5)
    async with serving(config, settings, worker=False) as gateway:
        sock = await raw_connect(gateway)
        loop = asyncio.get_running_loop()

        async def trickle() -> None:  # a byte every 50 ms: never idle long, never done
            with contextlib.suppress(ConnectionError, OSError):
                for _ in range(400):
                    await loop.sock_sendall(sock, b" ")
                    await asyncio.sleep(0.05)

        try:
            await loop.sock_sendall(sock, request_head("/v1/completions", 100_000, AUTH_A))
            trickling = asyncio.create_task(trickle())
            started_s = time.monotonic()
            answer = await read_response(sock, timeout_s=10.0)
            took_s = time.monotonic() - started_s
            trickling.cancel()
            print(f"\ntrickled body answered after {took_s:.2f} s (read_timeout_s {config.read_timeout_s})")
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert took_s < config.read_timeout_s + 2.0
        finally:
            sock.close()


def test_timeouts_are_validated_and_read_from_env() -> None:
    config = gateway_config_from_env({"BLOCKQ_GATEWAY_READ_TIMEOUT_S": "7.5", "BLOCKQ_GATEWAY_WRITE_TIMEOUT_S": "2"})
    assert (config.read_timeout_s, config.write_timeout_s) == (7.5, 2.0)
    assert (GatewayConfig().read_timeout_s, GatewayConfig().write_timeout_s) == (30.0, 5.0)
    for name in ("read_timeout_s", "write_timeout_s"):
        with pytest.raises(ConfigError, match=name):
            GatewayConfig(**{name: 0})


# --- finding 3: per-key quotas and policies ------------------------------------------------------


def test_in_flight_slots_count_per_key() -> None:
    slots = InFlightSlots(max_in_flight=3)
    assert slots.take("a", 2) is None and slots.take("a", 2) is None
    assert slots.take("a", 2) is SlotLimit.KEY and slots.num_in_flight == 2
    assert slots.take("b", 2) is None
    assert slots.take("c", 2) is SlotLimit.GATEWAY
    slots.give_back("a")
    assert slots.take("a", 2) is None and slots.num_in_flight_of("a") == 2
    for key in ("a", "a", "b"):
        slots.give_back(key)
    assert slots.num_in_flight == 0
    with pytest.raises(RuntimeError):
        slots.give_back("b")


def test_key_specs_parse_and_defaults() -> None:
    tenants, policies = parse_api_key_specs(
        "k1=alice;max_in_flight=3;priority=batch, k2=bob ; may_set_priority=yes;may_set_best_effort=1,k3")
    assert tenants == {"k1": "alice", "k2": "bob", "k3": "default"}
    assert policies == {"k1": KeyPolicy(max_in_flight=3, priority="batch"),
                        "k2": KeyPolicy(may_set_priority=True, may_set_best_effort=True)}
    config = GatewayConfig(api_key_to_tenant=tenants, api_key_to_policy=policies, max_in_flight=10)
    assert config.policy_of("k1").max_in_flight == 3
    # keys without their own: half the gateway with two keys or more, so none locks out the rest
    assert config.policy_of("k2").max_in_flight == config.policy_of("k3").max_in_flight == 5
    assert config.policy_of("k3") == KeyPolicy(max_in_flight=5, max_requests_in_flight=25_000)
    assert GatewayConfig(api_key_to_tenant={"k": "t"}, max_in_flight=10).policy_of("k").max_in_flight == 10
    assert GatewayConfig(api_key_to_tenant=tenants, key_max_in_flight=2).policy_of("k3").max_in_flight == 2
    open_policy = GatewayConfig(max_in_flight=10).policy_of(None)
    assert open_policy.may_set_priority and open_policy.may_set_best_effort and open_policy.max_in_flight == 10


@pytest.mark.parametrize("spec", ["sk-CHANGE-ME=default", "change-me", "sk-change-me;max_in_flight=2"])
def test_the_placeholder_key_of_the_shipped_secret_is_refused(spec: str) -> None:
    with pytest.raises(ConfigError, match="placeholder 'CHANGE-ME'") as raised:
        parse_api_key_specs(spec)
    assert "sk-" not in str(raised.value).replace("sha256:", "")  # the key itself is never printed


def test_settings_repr_hides_the_redis_url() -> None:
    assert "s3cret" not in repr(Settings(redis_url="redis://:s3cret@localhost:6379/0"))


def test_key_specs_from_env_file_and_flags(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# team keys\nk1 alice;max_in_flight=2\nk2=bob;priority=batch\n")
    config = gateway_config_from_env({"BLOCKQ_GATEWAY_API_KEYS_FILE": str(keys_file),
                                      "BLOCKQ_GATEWAY_API_KEYS": "k2=bob2,k3=carol;may_set_priority=true",
                                      "BLOCKQ_GATEWAY_KEY_MAX_IN_FLIGHT": "7"})
    assert dict(config.api_key_to_tenant) == {"k1": "alice", "k2": "bob2", "k3": "carol"}
    # k2 named again without options: its file policy does not linger
    assert config.policy_of("k2") == KeyPolicy(max_in_flight=7, max_requests_in_flight=25_000)
    assert config.policy_of("k1").max_in_flight == 2 and config.policy_of("k3").may_set_priority


@pytest.mark.parametrize(("spec", "field"), [
    ("sk-secret-1=alice;max_in_flight=0", "max_in_flight"),
    ("sk-secret-1=alice;max_in_flight=many", "max_in_flight"),
    ("sk-secret-1=alice;max_in_flight=513", "max_in_flight"),
    ("sk-secret-1=alice;priority=urgent", "priority"),
    ("sk-secret-1=alice;may_set_priority=maybe", "may_set_priority"),
    ("sk-secret-1=alice;may_set_best_effort=2", "may_set_best_effort"),
    ("sk-secret-1=alice;max_inflight=3", "max_inflight"),
])
def test_bad_key_specs_are_config_errors_naming_the_field(spec: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        gateway_config_from_env({"BLOCKQ_GATEWAY_API_KEYS": spec})
    message = str(info.value)
    assert field in message and "sk-secret-1" not in message and key_fingerprint("sk-secret-1") in message


def test_bad_key_config_is_refused_at_start_up(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="key_max_in_flight"):
        GatewayConfig(api_key_to_tenant={"k": "t"}, key_max_in_flight=0)
    with pytest.raises(ConfigError, match="not configured") as info:
        GatewayConfig(api_key_to_tenant={"k": "t"}, api_key_to_policy={"sk-other": KeyPolicy()})
    assert "sk-other" not in str(info.value)
    with pytest.raises(SystemExit) as exit_info:
        gateway_main(["--redis", "redis://127.0.0.1:1/0", "--api-key", "sk-secret-2=t;priority=urgent"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "priority" in err and "sk-secret-2" not in err
    env = {"BLOCKQ_GATEWAY_API_KEYS": "sk-secret-3=t;max_in_flight=-1"}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        assert gateway_main(["--redis", "redis://127.0.0.1:1/0"]) == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and "max_in_flight" in err and "sk-secret-3" not in err


async def _post_in_background(gateway: TestClient, headers: dict[str, str]) -> asyncio.Task[Any]:
    """A call that stays in flight (the worker never answers "hold") until the task is cancelled."""
    return asyncio.create_task(gateway.post("/v1/completions", json=completion("hold"), headers=headers))


@pytest.mark.timeout(60)
async def test_a_key_over_its_in_flight_quota_is_429_naming_its_limit(settings: Settings) -> None:
    config = GatewayConfig(api_key_to_tenant={KEY_A: "alice", KEY_B: "bob"}, max_in_flight=4,
                           api_key_to_policy={KEY_A: KeyPolicy(max_in_flight=1)})
    async with serving(config, settings) as gateway:
        held = [await _post_in_background(gateway, AUTH_A)]
        await wait_for(in_flight_is(gateway, 1), timeout_s=5.0)
        response = await gateway.post("/v1/completions", json=completion(), headers=AUTH_A)
        assert response.status == 429 and response.headers["Retry-After"] == "1"
        text = await response.text()
        error = json.loads(text)["error"]
        assert error["param"] == "max_in_flight" and error["code"] == "key_too_many_requests"
        assert "alice" in error["message"] and "1 requests in flight" in error["message"]
        assert KEY_A not in text and KEY_A not in str(response.headers)
        # bob (default: half of 4) is not held back by alice ...
        assert (await gateway.post("/v1/completions", json=completion(), headers=AUTH_B)).status == 200
        held += [await _post_in_background(gateway, AUTH_B) for _ in range(2)]
        await wait_for(in_flight_is(gateway, 3), timeout_s=5.0)
        # ... up to his own share
        response = await gateway.post("/v1/completions", json=completion(), headers=AUTH_B)
        assert response.status == 429 and "bob" in (await response.json())["error"]["message"]
        for task in held:  # the clients leave: their slots come back
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await wait_for(in_flight_is(gateway, 0), timeout_s=5.0)
        assert (await gateway.post("/v1/completions", json=completion(), headers=AUTH_A)).status == 200


@pytest.mark.timeout(60)
async def test_key_priority_and_best_effort_policy(settings: Settings, sync_redis: Any) -> None:
    config = GatewayConfig(api_key_to_tenant={KEY_A: "alice", KEY_B: "bob"}, api_key_to_policy={
        KEY_A: KeyPolicy(priority="batch"),
        KEY_B: KeyPolicy(may_set_priority=True, may_set_best_effort=True)})
    async with serving(config, settings) as gateway:
        allowed = [(AUTH_A, completion()), (AUTH_A, completion(priority="batch", best_effort=False)),
                   (AUTH_B, completion()), (AUTH_B, completion(priority="batch", best_effort=True))]
        for headers, body in allowed:
            response = await gateway.post("/v1/completions", json=body, headers=headers)
            assert response.status == 200, await response.text()
        assert [(r.tenant, r.priority, r.best_effort) for r in submitted(sync_redis, settings)] == [
            ("alice", "batch", False), ("alice", "batch", False),
            ("bob", "interactive", False), ("bob", "batch", True)]
        for body, field in [(completion(priority="interactive"), "priority"),
                            (completion(best_effort=True), "best_effort")]:
            for route, route_body in [("/v1/completions", body), ("/v1/chat/completions", {
                    **{k: v for k, v in body.items() if k != "prompt"},
                    "messages": [{"role": "user", "content": "x"}]})]:
                response = await gateway.post(route, json=route_body, headers=AUTH_A)
                assert response.status == 403
                error = (await response.json())["error"]
                assert error["param"] == field and field in error["message"]
                assert error["type"] == "permission_error"
        assert len(submitted(sync_redis, settings)) == 4  # nothing refused was submitted


@pytest.mark.timeout(60)
async def test_without_keys_callers_still_choose_priority_and_best_effort(settings: Settings,
                                                                         sync_redis: Any) -> None:
    async with serving(GatewayConfig(), settings) as gateway:
        response = await gateway.post("/v1/completions", json=completion(priority="batch", best_effort=True))
        assert response.status == 200
        assert [(r.priority, r.best_effort) for r in submitted(sync_redis, settings)] == [("batch", True)]


# --- finding 4: a hostile 4 MiB body -------------------------------------------------------------


def hostile_body(size_bytes: int = 4 * 1024 * 1024) -> bytes:
    """An unterminated string of escaped quotes: ``{"messages": "\"\"\"...`` (no closing)."""
    head = b'{"model": "blockq", "messages": "'
    return head + b'\\"' * ((size_bytes - len(head)) // 2)


@pytest.fixture
def gateway_process(settings: Settings, tmp_path: Path) -> Iterator[str]:
    """``python -m blockq.frontdoors.gateway`` on a free port (one key, KEY_A); its base URL."""
    port = free_port()
    env = {**os.environ, "BLOCKQ_REDIS_URL": settings.redis_url or "", "BLOCKQ_GATEWAY_API_KEYS": f"{KEY_A}=a"}
    with (tmp_path / "gateway.log").open("wb") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "blockq.frontdoors.gateway", "--port", str(port)],
                                   cwd=REPO_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline_s = time.monotonic() + 30.0
        while True:
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
                connection.request("GET", "/healthz")
                if connection.getresponse().status == 200:
                    break
            except OSError:
                pass
            assert process.poll() is None, (tmp_path / "gateway.log").read_text()
            assert time.monotonic() < deadline_s, "gateway did not start"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def measure_hostile_body(host: str, port: int, headers: dict[str, str]) -> dict[str, Any]:
    """POST the hostile body on a raw socket while a second connection sends GET /healthz every
    millisecond. Returns the seconds to the whole answer, its status line, and every healthz latency."""
    body = hostile_body()
    result: dict[str, Any] = {}

    def post() -> None:
        with socket.create_connection((host, port)) as sock:
            started_s = time.perf_counter()
            sock.sendall(request_head("/v1/chat/completions", len(body), headers) + body)
            answer = b""
            while not (b"\r\n\r\n" in answer and answer.endswith(b"}")):
                chunk = sock.recv(65_536)
                if not chunk:
                    break
                answer += chunk
            result["answer_s"] = time.perf_counter() - started_s
            result["status"] = answer.split(b"\r\n", 1)[0].decode()

    connection = http.client.HTTPConnection(host, port, timeout=10.0)
    connection.request("GET", "/healthz")  # a warm keep-alive connection, as a prober keeps
    connection.getresponse().read()
    poster = threading.Thread(target=post)
    healthz_s: list[float] = []
    poster.start()
    while poster.is_alive():
        started_s = time.perf_counter()
        connection.request("GET", "/healthz")
        response = connection.getresponse()
        response.read()
        healthz_s.append(time.perf_counter() - started_s)
        assert response.status == 200
        time.sleep(0.001)
    poster.join()
    connection.close()
    return {**result, "healthz_s": healthz_s}


@pytest.mark.timeout(120)
def test_hostile_body_is_answered_quickly_and_healthz_stays_fast(gateway_process: str) -> None:
    host, port = gateway_process.removeprefix("http://").split(":")
    figures = measure_hostile_body(host, int(port), AUTH_A)
    healthz_s = sorted(figures["healthz_s"])
    print(f"\nhostile 4 MiB body: {figures['status']!r} in {figures['answer_s'] * 1000:.1f} ms; GET /healthz "
          f"meanwhile: max {healthz_s[-1] * 1000:.1f} ms, median {healthz_s[len(healthz_s) // 2] * 1000:.1f} ms "
          f"over {len(healthz_s)} calls")
    assert figures["status"] == "HTTP/1.1 400 Bad Request"
    # generous bounds for a shared machine; the figures on an idle one: docs/gateway.md
    assert figures["answer_s"] < 2.0 and healthz_s[-1] < 0.5
