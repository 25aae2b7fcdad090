"""Fuzzing what comes from outside: heartbeats, requests, batch lines and gateway bodies.

In process, 10,000 random and mutated inputs (2,500 of each kind, derandomized so CI sees
the same cases every run): each is either accepted or refused with the project's own
error naming a field; nothing else may escape (no KeyError, TypeError, OverflowError...),
and a beat that decodes is applied to a dispatcher core without raising. Then a live
cluster (`blockq up`: Redis, predictor, dispatcher, a worker, the gateway) is fed mutated
beats, raw request entries and HTTP bodies: no process exits or restarts, every bad
request entry is dead-lettered with its reason, every bad body is answered 4xx naming a
field, and a well-formed request is still served."""

from __future__ import annotations

import json
import math
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from blockq.config import Settings
from blockq.frontdoors.batch.lines import BatchLine, LineError, parse_line
from blockq.frontdoors.gateway.chat_template import render_chatml
from blockq.frontdoors.gateway.openai_requests import (
    RequestDefaults,
    check_json_depth,
    parse_chat_request,
    parse_completion_request,
)
from blockq.local.state import ClusterState, pid_alive
from blockq.wire.beats import RequestProgress, decode_heartbeat
from blockq.wire.keys import PAYLOAD_FIELD, Keys
from blockq.wire.protocol import ValidationError, decode_request
from dispatcher.core import DispatcherCore
from tests.conftest import run_blockq, wait_until
from tests.factories import make_heartbeat, make_request

EXAMPLES_PER_KIND = 2500
FUZZ = settings(max_examples=EXAMPLES_PER_KIND, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

# Values that break decoders: wrong types, non-finite and huge numbers, deep and long things.
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40), st.binary(max_size=40),
    st.sampled_from([0, -1, 2**31, 2**63, 2**64, 1e308, -1e308, "", "live", "inf", "nan"]),
)
HOSTILE = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=8),
                                                        st.dictionaries(st.text(max_size=12), inner, max_size=6)),
                       max_leaves=20)


def _valid_beat_map() -> dict[str, Any]:
    progress = RequestProgress("r1", 120, 30, 100, 64, 200)
    beat = make_heartbeat("inst-f", running=(progress,), waiting=(RequestProgress("r2", 50, 0, 0, 0, 40),),
                          num_used_blocks=12)
    return beat.to_map()


def _valid_request_map() -> dict[str, Any]:
    return make_request("fuzz me", 16, id="fuzz-req").to_map()


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any] | list[Any] | Any:
    """``base`` with a few fields set to hostile values, deleted, or nested lists broken."""
    data = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        key = draw(st.one_of(st.sampled_from(sorted(data) or ["x"]), st.text(max_size=10)))
        action = draw(st.sampled_from(["set", "delete", "nest"]))
        if action == "delete":
            data.pop(key, None)
        elif action == "nest" and isinstance(data.get(key), list) and data[key]:
            index = draw(st.integers(min_value=0, max_value=len(data[key]) - 1))
            item = data[key][index]
            if isinstance(item, list) and item:
                item[draw(st.integers(min_value=0, max_value=len(item) - 1))] = draw(HOSTILE)
            else:
                data[key][index] = draw(HOSTILE)
        else:
            data[key] = draw(HOSTILE)
    return data


def _packed(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True, default=repr)


@st.composite
def raw_messages(draw: st.DrawFn, base: dict[str, Any]) -> bytes:
    """A mutated map packed with msgpack, raw random bytes, or a valid message with bytes flipped."""
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "random", "flipped"]))
    if kind == "random":
        return draw(st.binary(max_size=200))
    if kind == "flipped":
        raw = bytearray(_packed(base))
        for _ in range(draw(st.integers(min_value=1, max_value=6))):
            raw[draw(st.integers(min_value=0, max_value=len(raw) - 1))] = draw(st.integers(0, 255))
        return bytes(raw)
    return _packed(draw(mutated(base)))


def _assert_names_field(exc: ValidationError) -> None:
    assert exc.field and str(exc).startswith(f"{exc.field}:"), str(exc)


@FUZZ
@given(raw=raw_messages(_valid_beat_map()))
def test_heartbeats_decode_or_are_refused_naming_a_field_and_never_break_the_core(raw: bytes) -> None:
    try:
        beat = decode_heartbeat(raw)
    except ValidationError as exc:
        _assert_names_field(exc)
        return
    for policy in ("block", "llumnix"):
        core = DispatcherCore(policy, seed=0)
        core.apply_heartbeat(beat, now_s=beat.sent_at_s if math.isfinite(beat.sent_at_s) else 0.0)
        core.place([make_request("after a fuzzed beat", 8, predicted=8)], now_s=1.0)


@FUZZ
@given(raw=raw_messages(_valid_request_map()))
def test_requests_decode_or_are_refused_naming_a_field(raw: bytes) -> None:
    try:
        decode_request(raw)
    except ValidationError as exc:
        _assert_names_field(exc)


BATCH_LINE = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}}


@st.composite
def batch_texts(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["line", "body", "text"]))
    if kind == "text":
        return draw(st.text(max_size=300))
    line = json.loads(json.dumps(BATCH_LINE))
    if kind == "body":
        line["body"] = draw(mutated(line["body"]))
    else:
        line = draw(mutated(line))
    return json.dumps(line, default=repr)


@FUZZ
@given(text=batch_texts())
def test_batch_lines_parse_or_are_errors_with_a_code(text: str) -> None:
    item = parse_line(7, text, render_chatml, RequestDefaults(), Settings())
    assert isinstance(item, BatchLine | LineError)
    if isinstance(item, LineError):
        assert item.line_number == 7 and item.code and item.message
        if item.code == "invalid_request":
            assert item.param and item.message.startswith(f"{item.param}:"), item


CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
COMPLETION_BODY = {"model": "m", "prompt": "hi", "max_tokens": 8, "n": 2}


@st.composite
def gateway_bodies(draw: st.DrawFn) -> tuple[str, str]:
    """(endpoint, body text): mutated bodies, JSON-looking garbage, deep or unterminated text."""
    endpoint = draw(st.sampled_from(["chat", "completion"]))
    kind = draw(st.sampled_from(["mutated", "mutated", "garbage", "deep"]))
    if kind == "garbage":
        return endpoint, draw(st.text(alphabet='{}[]",:\\ 0a', max_size=300))
    if kind == "deep":
        depth = draw(st.integers(min_value=1, max_value=300))
        return endpoint, '{"messages": ' + "[" * depth + "]" * draw(st.integers(0, depth)) + "}"
    body = draw(mutated(CHAT_BODY if endpoint == "chat" else COMPLETION_BODY))
    return endpoint, json.dumps(body, default=repr)


def parse_gateway_body(endpoint: str, text: str) -> None:
    """What the gateway does with a body before it submits: depth check, JSON, the endpoint's parser."""
    check_json_depth(text, 32)
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        raise ValidationError("body", "invalid JSON") from None
    if endpoint == "chat":
        parse_chat_request(body, render_chatml)
    else:
        parse_completion_request(body)


@FUZZ
@given(case=gateway_bodies())
def test_gateway_bodies_parse_or_are_refused_naming_a_field(case: tuple[str, str]) -> None:
    try:
        parse_gateway_body(*case)
    except ValidationError as exc:
        _assert_names_field(exc)


# --- a live cluster -----------------------------------------------------------------------

LIVE_BEATS = 600
LIVE_REQUESTS = 300
LIVE_BODIES = 300


def draw_examples(strategy: st.SearchStrategy[Any], count: int) -> list[Any]:
    """``count`` inputs drawn from ``strategy``, the same ones every run."""
    drawn: list[Any] = []

    @settings(max_examples=count, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    @given(strategy)
    def collect(value: Any) -> None:
        drawn.append(value)

    collect()
    return drawn[:count]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def live_cluster(tmp_path: Path):
    state_dir = tmp_path / "state"
    port = _free_port()
    env = {"BLOCKQ_STATE_DIR": str(state_dir), "BLOCKQ_REDIS_URL": ""}
    up = run_blockq("up", "--instances", "1", "--time-scale", "0.1", "--gateway", "--gateway-port", str(port),
                    "--metrics-base-port", "0", "--detach", "--json", env=env)
    try:
        assert up.returncode == 0, up.stderr + up.stdout
        state = ClusterState.read(state_dir)
        assert state is not None
        yield state_dir, state, port
    finally:
        down = run_blockq("down", env=env)
        assert down.returncode == 0, down.stderr


def _post(port: int, path: str, body: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body.encode("utf-8", "surrogatepass"),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
            return response.status, {}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _feed_requests(client: redis.Redis, keys: Keys) -> int:
    """Write mutated request entries to the request and ready streams; how many were invalid."""
    num_invalid = 0
    for i, raw in enumerate(draw_examples(raw_messages(_valid_request_map()), LIVE_REQUESTS)):
        try:
            decode_request(raw, keys=keys)
            continue  # a mutation that stayed valid would simply run: only bad ones are sent
        except ValidationError:
            num_invalid += 1
        client.xadd(keys.requests if i % 2 else keys.ready, {PAYLOAD_FIELD: raw})
    return num_invalid


@pytest.mark.timeout(300)
def test_a_live_cluster_survives_hostile_beats_requests_and_bodies(live_cluster) -> None:  # noqa: ANN001
    state_dir, state, port = live_cluster
    client = redis.Redis.from_url(state.redis_url)
    keys = Keys()
    children_before = dict(state.children)
    for raw in draw_examples(raw_messages(_valid_beat_map()), LIVE_BEATS):
        client.xadd(keys.heartbeats, {PAYLOAD_FIELD: raw})
    num_invalid = _feed_requests(client, keys)
    num_refused = 0
    for endpoint, text in draw_examples(gateway_bodies(), LIVE_BODIES):
        status, body = _post(port, "/v1/chat/completions" if endpoint == "chat" else "/v1/completions", text)
        assert status < 500, (status, body, text[:200])
        if status >= 400:
            num_refused += 1
            error = body["error"]
            assert error.get("param") or ":" in error["message"], error
    assert num_refused > LIVE_BODIES // 2
    wait_until(lambda: client.xlen(keys.dead_letters) >= num_invalid, timeout_s=60)
    reasons = [fields.get(b"reason") for _, fields in client.xrange(keys.dead_letters)]
    assert len(reasons) == num_invalid and all(reasons), reasons[:5]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as response:
        model = json.loads(response.read())["data"][0]["id"]
    status, body = _post(port, "/v1/chat/completions", json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 4}))
    assert status == 200, body
    assert num_invalid > LIVE_REQUESTS // 2
    after = ClusterState.read(state_dir)
    assert after is not None and after.children == children_before  # nothing exited and was restarted
    assert all(pid_alive(pid) for pid in after.children.values())
