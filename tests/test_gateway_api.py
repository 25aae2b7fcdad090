"""The HTTP gateway in-process against the test Redis, with no pipeline behind it (or a
tiny fake worker that answers every request): request parsing, every error path, SSE
format, cancellation on timeout and on client disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient, TestServer

from blockq.config import Settings
from blockq.frontdoors.gateway.chat_template import load_chat_template, render_chatml, render_plain
from blockq.frontdoors.gateway.config import GatewayConfig, gateway_config_from_env, parse_api_keys
from blockq.frontdoors.gateway.openai_requests import (
    ChatMessage,
    check_json_depth,
    parse_chat_request,
    parse_completion_request,
)
from blockq.frontdoors.gateway.server import create_app
from blockq.wire.keys import PAYLOAD_FIELD
from blockq.wire.protocol import (
    Chunk,
    FinalRecord,
    Placement,
    ValidationError,
    decode_request,
    encode,
)

AUTH = {"Authorization": "Bearer sk-a"}


# --- pure parsing -------------------------------------------------------------------------


def test_completion_request_defaults_and_prompt_shapes() -> None:
    plan = parse_completion_request({"model": "m", "prompt": "hi"})
    assert (plan.prompts, plan.n, plan.max_tokens, plan.stream, plan.priority) == (("hi",), 1, 16, False, "interactive")
    plan = parse_completion_request({"model": "m", "prompt": ["a", "b"], "n": 2, "max_tokens": 3, "stop": "x"})
    assert plan.num_choices == 4 and plan.prompt_of(3) == "b" and plan.stop == ("x",)
    assert plan.request_ids("r") == ["r-0", "r-1", "r-2", "r-3"]
    assert parse_completion_request({"model": "m", "prompt": [1, 2, 3]}).prompts == ((1, 2, 3),)
    assert parse_completion_request({"model": "m", "prompt": [[1], [2, 3]]}).prompts == ((1,), (2, 3))
    specs = parse_completion_request({"model": "m", "prompt": "x", "priority": "batch"}).submit_specs("id", "t")
    assert [(s.request_id, s.priority, s.tenant) for s in specs] == [("id", "batch", "t")]


@pytest.mark.parametrize(("body", "field"), [
    ([], "body"),
    ({"prompt": "x"}, "model"),
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m", "prompt": [1, "a"]}, "prompt"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": 10**6}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "m", "prompt": "x", "n": 99}, "n"),
    ({"model": "m", "prompt": "x", "stop": [""]}, "stop"),
    ({"model": "m", "prompt": "x", "logprobs": 2}, "logprobs"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "m", "prompt": "x", "priority": "urgent"}, "priority"),
    ({"model": "m", "prompt": [1, 2], "echo": True}, "echo"),
])
def test_completion_request_errors_name_the_field(body: Any, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        parse_completion_request(body)
    assert info.value.field == field


@pytest.mark.parametrize(("body", "field"), [
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json"}},
     "response_format"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
     "max_completion_tokens"),
])
def test_chat_request_errors_name_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        parse_chat_request(body, render_chatml)
    assert info.value.field == field


def test_vllm_sampling_extensions_are_parsed_on_both_routes() -> None:
    plan = parse_completion_request({"model": "m", "prompt": "x", "max_tokens": 20, "n": 2,
                                     "ignore_eos": True, "min_tokens": 5})
    assert [(s.ignore_eos, s.min_tokens) for s in plan.submit_specs("id", "t")] == [(True, 5), (True, 5)]
    plain = parse_completion_request({"model": "m", "prompt": "x"}).submit_specs("id", "t")[0]
    assert (plain.ignore_eos, plain.min_tokens) == (False, 0)
    messages = [{"role": "user", "content": "x"}]
    chat = parse_chat_request({"model": "m", "messages": messages, "max_completion_tokens": 9,
                               "ignore_eos": True, "min_tokens": 9}, render_chatml)
    assert (chat.ignore_eos, chat.min_tokens, chat.max_tokens) == (True, 9, 9)


@pytest.mark.parametrize(("extra", "field", "fragment"), [
    ({"ignore_eos": "yes"}, "ignore_eos", "a boolean"),
    ({"ignore_eos": 1}, "ignore_eos", "a boolean"),
    ({"min_tokens": -1}, "min_tokens", "between 0 and"),
    ({"min_tokens": 2.5}, "min_tokens", "an integer"),
    ({"min_tokens": True}, "min_tokens", "an integer"),
    ({"min_tokens": 11}, "min_tokens", "at most max_tokens (10)"),
    # a chat body's max_completion_tokens is the bound when it is given
    ({"max_tokens": 50, "max_completion_tokens": 4, "min_tokens": 5}, "min_tokens", "at most max_tokens (4)"),
])
def test_vllm_sampling_extension_errors_name_the_field(extra: dict[str, Any], field: str, fragment: str) -> None:
    completion = {"model": "m", "prompt": "x", "max_tokens": 10, **extra}
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10, **extra}
    checks = [lambda: parse_chat_request(chat, render_chatml)]
    if "max_completion_tokens" not in extra:
        checks.append(lambda: parse_completion_request(completion))
    for parse in checks:
        with pytest.raises(ValidationError) as info:
            parse()
        assert info.value.field == field and fragment in str(info.value)


def test_chat_templates() -> None:
    messages = [ChatMessage("system", "be brief"), ChatMessage("user", "hi")]
    assert render_chatml(messages) == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                                       "<|im_start|>assistant\n")
    assert render_plain(messages) == "system: be brief\nuser: hi\nassistant:"
    plan = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "max_completion_tokens": 7}, render_plain)
    assert plan.prompts == ("user: ab\nassistant:",) and plan.max_tokens == 7


def test_jinja_chat_template_file(tmp_path: Any) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant]{% endif %}")
    render = load_chat_template(str(path))
    assert render([ChatMessage("user", "hi")]) == "[user] hi\n[assistant]"


def test_json_depth_limit_ignores_brackets_in_strings() -> None:
    check_json_depth('{"a": "[[[[[[[[[[[[[[[[[[[["}', 2)
    check_json_depth('{"a": [1, {"b": "\\"["}]}', 3)
    with pytest.raises(ValidationError):
        check_json_depth('{"a": [[[1]]]}', 3)


@pytest.mark.timeout(30)
def test_json_depth_check_is_linear_on_unterminated_strings() -> None:
    # Quadratic before: 64 KiB of escaped quotes took 13 s; 4 MiB (the body limit) hours.
    for hostile in ('"' + '\\"' * (2 << 20), '"' + '\\"' * (2 << 20) + '\\', '{"a": "' + "[" * (4 << 20)):
        check_json_depth(hostile, 8)
    with pytest.raises(ValidationError):
        check_json_depth("[" * 9 + '"' + '\\"' * (1 << 20), 8)


def test_gateway_config_from_env_and_keys() -> None:
    assert parse_api_keys("k1=alice, k2 ,# note\nk3 bob") == {"k1": "alice", "k2": "default", "k3": "bob"}
    config = gateway_config_from_env({"BLOCKQ_GATEWAY_API_KEYS": "k1=alice", "BLOCKQ_GATEWAY_PORT": "9001",
                                      "BLOCKQ_GATEWAY_MODEL_NAMES": "a,b"}, api_key_to_tenant={"k2": "bob"})
    assert config.port == 9001 and config.model_names == ("a", "b") and config.auth_required
    assert dict(config.api_key_to_tenant) == {"k1": "alice", "k2": "bob"}


# --- in-process HTTP ----------------------------------------------------------------------


async def fake_worker(settings: Settings, stop: asyncio.Event) -> None:
    """Answers every request on the ingress stream: two chunks, then a final record
    (status error when the prompt mentions "fail")."""
    client = aioredis.Redis.from_url(settings.redis_url or "")
    last_id = "0-0"
    try:
        while not stop.is_set():
            reply = await client.xread({settings.keys.requests: last_id}, block=50, count=64)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last_id = entry_id
                    request = decode_request(fields[PAYLOAD_FIELD.encode()])
                    failed = isinstance(request.prompt, str) and "fail" in request.prompt
                    if isinstance(request.prompt, str) and "late" in request.prompt:  # as the dispatcher refuses
                        refusal = FinalRecord(request.id, 0, "infeasible", "", 0, 3, "", "infeasible",
                                              predicted_ttft_ms=4200.0, error="infeasible: predicted TTFT 4200 ms")
                        await client.xadd(request.reply_stream, {PAYLOAD_FIELD: encode(refusal)})
                        continue
                    messages = [Placement(request.id, "inst-7", "block", 1.0, 4.0, 8.0),
                                Chunk(request.id, 0, " a", 1), Chunk(request.id, 1, " b", 1),
                                FinalRecord(request.id, 2, "error" if failed else "ok", " a b", 2, 3, "inst-7",
                                            "length", ttft_ms=5.0, e2e_ms=9.0, predicted_output_tokens=2,
                                            predicted_ttft_ms=4.0, predicted_e2e_ms=8.0, error="boom" if failed else None)]
                    for message in messages:
                        await client.xadd(request.reply_stream, {PAYLOAD_FIELD: encode(message)})
    finally:
        await client.aclose()


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """The session settings with a small backlog limit, so that 429 is quick to provoke."""
    return dataclasses.replace(settings, max_ingress_backlog=20)


@pytest.fixture
async def gateway(settings: Settings) -> AsyncIterator[TestClient]:
    config = GatewayConfig(api_key_to_tenant={"sk-a": "tenant-a"}, max_body_bytes=4096, max_json_depth=8,
                           request_timeout_s=5.0, model_names=("blockq",))
    async with TestClient(TestServer(create_app(config, settings))) as client:
        yield client


@pytest.fixture
async def answered(gateway: TestClient, settings: Settings) -> AsyncIterator[TestClient]:
    stop = asyncio.Event()
    task = asyncio.create_task(fake_worker(settings, stop))
    yield gateway
    stop.set()
    await task


async def error_of(response: aiohttp.ClientResponse) -> dict[str, Any]:
    body = await response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    assert "Traceback" not in json.dumps(body)
    return body["error"]


async def test_auth_is_required_when_keys_are_configured(gateway: TestClient) -> None:
    body = {"model": "blockq", "prompt": "x"}
    response = await gateway.post("/v1/completions", json=body)
    assert response.status == 401 and response.headers["WWW-Authenticate"] == "Bearer"
    assert (await error_of(response))["code"] == "invalid_api_key"
    response = await gateway.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-wrong"})
    assert response.status == 401
    assert (await gateway.get("/v1/models")).status == 401
    models = await (await gateway.get("/v1/models", headers=AUTH)).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "blockq"
    health = await gateway.get("/healthz")
    assert health.status == 200 and (await health.json())["status"] == "ok"


@pytest.mark.parametrize(("payload", "param"), [
    (b"{not json", "body"),
    (b"[1, 2]", "body"),
    (json.dumps({"model": "blockq", "prompt": "x", "max_tokens": "many"}).encode(), "max_tokens"),
    (json.dumps({"model": "blockq", "prompt": "x" * 10, "a": [[[[[[[[[[1]]]]]]]]]]}).encode(), "body"),
    (b"\xff\xfe", "body"),
])
async def test_bad_bodies_are_400_naming_the_field(gateway: TestClient, payload: bytes, param: str) -> None:
    response = await gateway.post("/v1/completions", data=payload, headers=AUTH)
    assert response.status == 400
    error = await error_of(response)
    assert error["param"] == param and error["type"] == "invalid_request_error"


async def test_chat_field_errors_and_timeout_header(gateway: TestClient) -> None:
    body = {"model": "blockq", "messages": [{"role": "user", "content": "x"}, {"role": "nobody", "content": "y"}]}
    response = await gateway.post("/v1/chat/completions", json=body, headers=AUTH)
    assert response.status == 400 and (await error_of(response))["param"] == "messages[1].role"
    body = {"model": "blockq", "prompt": "x"}
    response = await gateway.post("/v1/completions", json=body, headers={**AUTH, "x-blockq-timeout-s": "soon"})
    assert response.status == 400 and (await error_of(response))["param"] == "x-blockq-timeout-s"


async def test_unknown_model_route_method_and_large_body(gateway: TestClient) -> None:
    response = await gateway.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}, headers=AUTH)
    assert response.status == 404 and (await error_of(response))["code"] == "model_not_found"
    assert (await gateway.get("/v1/nothing")).status == 404
    response = await gateway.get("/v1/completions")
    assert response.status == 405
    await error_of(response)
    response = await gateway.post("/v1/completions", data=b'{"model": "blockq", "prompt": "' + b"x" * 5000 + b'"}',
                                  headers=AUTH)
    assert response.status == 413 and (await error_of(response))["param"] == "body"


async def test_overloaded_is_429_with_retry_after(gateway: TestClient, settings: Settings,
                                                  sync_redis: Any) -> None:
    for _ in range(settings.max_ingress_backlog):
        sync_redis.xadd(settings.keys.requests, {PAYLOAD_FIELD: b"x"})
    response = await gateway.post("/v1/completions", json={"model": "blockq", "prompt": "x"}, headers=AUTH)
    assert response.status == 429 and int(response.headers["Retry-After"]) >= 1
    assert (await error_of(response))["type"] == "rate_limit_error"


async def test_timeout_is_504_and_cancels_the_request(gateway: TestClient, settings: Settings,
                                                      sync_redis: Any) -> None:
    response = await gateway.post("/v1/completions", json={"model": "blockq", "prompt": "x"},
                                  headers={**AUTH, "x-blockq-timeout-s": "0.3"})
    assert response.status == 504 and (await error_of(response))["code"] == "timeout"
    request_id = response.headers["x-request-id"]
    await wait_for(lambda: sync_redis.exists(settings.keys.cancel_flag(request_id)))


async def wait_for(predicate: Any, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def submitted_ids(sync_redis: Any, settings: Settings) -> list[str]:
    return [decode_request(f[PAYLOAD_FIELD.encode()]).id for _, f in sync_redis.xrange(settings.keys.requests)]


@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_cancels_the_request(gateway: TestClient, settings: Settings, sync_redis: Any,
                                                     stream: bool) -> None:
    url = str(gateway.make_url("/v1/completions"))
    body = {"model": "blockq", "prompt": "x", "stream": stream}
    async with aiohttp.ClientSession() as session:
        if stream:
            response = await session.post(url, json=body, headers=AUTH)
            assert response.status == 200 and response.headers["content-type"].startswith("text/event-stream")
            await wait_for(lambda: submitted_ids(sync_redis, settings))
            response.close()  # drop the connection mid-stream
        else:
            with pytest.raises(asyncio.TimeoutError):
                await session.post(url, json=body, headers=AUTH, timeout=aiohttp.ClientTimeout(total=0.5))
    await wait_for(lambda: submitted_ids(sync_redis, settings))
    (request_id,) = submitted_ids(sync_redis, settings)
    # well before the server's own 5 s timeout would cancel it
    await wait_for(lambda: sync_redis.exists(settings.keys.cancel_flag(request_id)), timeout_s=2.0)


async def test_internal_errors_hide_details(settings: Settings) -> None:
    class Broken:
        async def submit_many(self, specs: Any) -> Any:
            raise RuntimeError("secret detail")

        async def close(self) -> None:
            pass

    app = create_app(GatewayConfig(), settings, client=Broken())  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        response = await client.post("/v1/completions", json={"model": "blockq", "prompt": "x"})
        assert response.status == 500
        error = await error_of(response)
        assert error["type"] == "server_error" and "secret" not in error["message"]


async def test_completions_with_choices_usage_and_extras(answered: TestClient) -> None:
    response = await answered.post("/v1/completions", headers=AUTH, json={
        "model": "blockq", "prompt": ["p1", "p2"], "n": 2, "max_tokens": 2, "echo": True})
    assert response.status == 200
    assert response.headers["x-blockq-instance"] == "inst-7"
    assert response.headers["x-blockq-predicted-output-tokens"] == "2"
    body = await response.json()
    assert body["object"] == "text_completion" and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["p1 a b", "p1 a b", "p2 a b", "p2 a b"]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14}
    assert body["blockq"]["instance"] == "inst-7" and body["blockq"]["predicted_e2e_ms"] == 8.0


async def test_chat_streaming_format(answered: TestClient) -> None:
    response = await answered.post("/v1/chat/completions", headers=AUTH, json={
        "model": "blockq", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True}})
    assert response.status == 200
    events = [line for line in (await response.text()).split("\n\n") if line]
    # Where the request went and the forecast, as an SSE comment written with the first event.
    comments = [e for e in events if e.startswith(":")]
    assert comments == [': x-blockq-placement {"index":0,"instance":"inst-7","predicted_ttft_ms":4.0,'
                        '"predicted_e2e_ms":8.0}']
    assert events.index(comments[0]) == 0  # ahead of the role opening, in the same write
    events = [e for e in events if not e.startswith(":")]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == " a b"
    finish = chunks[-2]["choices"][0]
    assert finish["finish_reason"] == "length" and finish["blockq"]["instance"] == "inst-7"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}


async def test_vllm_sampling_extensions_reach_the_request(answered: TestClient, settings: Settings,
                                                         sync_redis: Any) -> None:
    response = await answered.post("/v1/completions", headers=AUTH, json={
        "model": "blockq", "prompt": "p", "max_tokens": 8, "ignore_eos": True, "min_tokens": 3})
    assert response.status == 200
    response = await answered.post("/v1/chat/completions", headers=AUTH, json={
        "model": "blockq", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "min_tokens": 6})
    assert response.status == 200
    submitted = [decode_request(f[PAYLOAD_FIELD.encode()]) for _, f in sync_redis.xrange(settings.keys.requests)]
    assert [(r.max_tokens, r.ignore_eos, r.min_tokens) for r in submitted] == [(8, True, 3), (6, False, 6)]


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": "true"}, "ignore_eos"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "min_tokens": -2}, "min_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "ignore_eos": 0}, "ignore_eos"),
])
async def test_bad_sampling_extensions_are_400_naming_the_field(gateway: TestClient, settings: Settings,
                                                                sync_redis: Any, route: str,
                                                                body: dict[str, Any], param: str) -> None:
    response = await gateway.post(route, json={"model": "blockq", **body}, headers=AUTH)
    assert response.status == 400
    error = await error_of(response)
    assert error["param"] == param and error["type"] == "invalid_request_error" and param in error["message"]
    assert sync_redis.xlen(settings.keys.requests) == 0  # nothing was submitted


async def test_generation_error_is_500_without_details(answered: TestClient) -> None:
    response = await answered.post("/v1/completions", headers=AUTH, json={"model": "blockq", "prompt": "fail"})
    assert response.status == 500
    error = await error_of(response)
    assert error["code"] == "generation_failed" and "boom" not in error["message"]
    metrics = await (await answered.get("/metrics")).text()
    assert 'blockq_gateway_requests_total{code="500",endpoint="/v1/completions"} 1' in metrics
    assert "blockq_gateway_request_duration_seconds_bucket" in metrics


async def test_infeasible_is_503_with_the_forecast(answered: TestClient) -> None:
    response = await answered.post("/v1/completions", headers=AUTH, json={"model": "blockq", "prompt": "late"})
    assert response.status == 503
    assert response.headers["x-blockq-predicted-ttft-ms"] == "4200.0"
    error = await error_of(response)
    assert error["code"] == "slo_infeasible" and "4200 ms" in error["message"] and "best_effort" in error["message"]
    response = await answered.post("/v1/completions", headers=AUTH,
                                   json={"model": "blockq", "prompt": "late", "stream": True})
    events = [e for e in (await response.text()).split("\n\n") if e]
    assert any('"code":"slo_infeasible"' in e.replace(" ", "") for e in events) and events[-1] == "data: [DONE]"


# --- the JSON depth check: the fast path against a character-by-character reference ----------


def reference_json_depth(text: str) -> int:
    """The deepest nesting of brackets outside strings, character by character: the
    specification the fast check_json_depth is held to."""
    depth = max_depth = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            max_depth = max(max_depth, depth)
        elif char in "]}":
            depth -= 1
    return max_depth


def random_json(rng: random.Random, depth: int) -> Any:
    if depth == 0 or rng.random() < 0.2:
        return rng.choice(["", "a", "[[{", "}]", '\\"[', "\\", '"', "x\\\\\"]", 1, None, True])
    children = [random_json(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    if rng.random() < 0.5:
        return children
    return {f"k{i}[": child for i, child in enumerate(children)}


def test_fast_json_depth_check_matches_the_reference() -> None:
    rng = random.Random(7)
    num_refused = 0
    for _ in range(3000):
        text = json.dumps(random_json(rng, rng.randint(0, 12)))
        max_depth = rng.randint(1, 10)
        too_deep = reference_json_depth(text) > max_depth
        num_refused += too_deep
        try:
            check_json_depth(text, max_depth)
            assert not too_deep, (text, max_depth)
        except ValidationError as exc:
            assert too_deep and exc.field == "body", (text, max_depth)
    assert 300 < num_refused < 2700  # both outcomes were exercised
    # invalid JSON: whatever passes nests no deeper in the parser than allowed
    for _ in range(3000):
        text = "".join(rng.choice('{}[]",:\\ 0a') for _ in range(rng.randint(0, 60)))
        try:
            check_json_depth(text, 3)
        except ValidationError:
            continue
        with contextlib.suppress(json.JSONDecodeError):
            assert reference_json_depth(json.dumps(json.loads(text))) <= 3, text


@pytest.mark.timeout(60)
def test_json_depth_check_of_hostile_4_mib_bodies_takes_milliseconds() -> None:
    # The regex scan took 0.2 s on the escaped quotes, 0.36 s on the brackets.
    size = 4 * 1024 * 1024
    escaped_quotes = '{"model": "blockq", "messages": "' + '\\"' * (size // 2 - 20)  # never closed
    for text in (escaped_quotes, "[" + ",".join(["[]"] * (size // 3)) + "]",
                 '{"a":' + "[" * 33 + '"' + '\\"' * (size // 2), "[" * (size // 2) + "]" * (size // 2)):
        started_s = time.perf_counter()
        with contextlib.suppress(ValidationError):
            check_json_depth(text, 32)
        assert time.perf_counter() - started_s < 0.15, text[:40]


async def test_models_list_what_the_fleet_serves_and_requests_carry_the_name(
        answered: TestClient, settings: Settings, sync_redis: Any) -> None:
    """``/v1/models`` lists the gateway's names, then every base model and LoRA adapter live
    instances publish; a request naming one of those carries it to the dispatcher, one
    naming the gateway's own name carries none (any instance)."""
    from tests.factories import make_heartbeat

    beat = make_heartbeat("inst-7")
    beat = dataclasses.replace(beat, model="mistral-7b", engine_config={
        **beat.engine_config, "lora_adapters": ["sql", "poems"], "loaded_loras": ["sql"], "max_loras": 2})
    gone = dataclasses.replace(make_heartbeat("inst-8", state="stopped"), model="retired-model")
    sync_redis.hset(settings.keys.instances, mapping={"inst-7": encode(beat), "inst-8": encode(gone)})
    models = await (await answered.get("/v1/models", headers=AUTH)).json()
    assert [m["id"] for m in models["data"]] == ["blockq", "mistral-7b", "poems", "sql"]
    for model in ("sql", "blockq", "mistral-7b"):
        response = await answered.post("/v1/completions", headers=AUTH, json={"model": model, "prompt": "p"})
        assert response.status == 200 and (await response.json())["model"] == model
    response = await answered.post("/v1/completions", headers=AUTH, json={"model": "retired-model", "prompt": "p"})
    assert response.status == 404
    submitted = [decode_request(f[PAYLOAD_FIELD.encode()]) for _, f in sync_redis.xrange(settings.keys.requests)]
    assert [r.model for r in submitted] == ["sql", None, "mistral-7b"]
