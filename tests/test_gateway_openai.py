"""The official ``openai`` client against a real ``blockq up --gateway`` cluster:
completions and chat completions, streaming and not, API keys, models, status."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from blockq.local.embedded_redis import free_port
from tests.conftest import run_blockq

API_KEY = "sk-test-alice"


@pytest.fixture(scope="module")
def gateway_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A 2-instance cluster with the gateway (keys required) on a free port; always torn down."""
    state_dir = tmp_path_factory.mktemp("gateway") / "state"
    port = free_port()
    env = {"BLOCKQ_STATE_DIR": str(state_dir), "BLOCKQ_REDIS_URL": "",
           "BLOCKQ_GATEWAY_API_KEYS": f"{API_KEY}=alice,sk-test-bob=bob"}
    try:
        up = run_blockq("up", "--instances", "2", "--time-scale", "0.1", "--gateway", "--gateway-port", str(port),
                        "--metrics-base-port", "0", "--detach", "--json", env=env)
        assert up.returncode == 0, up.stderr + up.stdout
        base_url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)
        wait_for_gateway(client)
        yield {"env": env, "base_url": base_url, "client": client, "report": json.loads(up.stdout)}
    finally:
        down = run_blockq("down", env=env)
        assert down.returncode == 0, down.stderr


def wait_for_gateway(client: openai.OpenAI, timeout_s: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.models.list()
            return
        except openai.APIConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def extras(obj: Any) -> dict[str, Any]:
    return (obj.model_extra or {})["blockq"]


def test_completions(gateway_cluster: dict[str, Any]) -> None:
    client: openai.OpenAI = gateway_cluster["client"]
    completion = client.completions.create(model="blockq", prompt="Explain paged attention", max_tokens=5)
    assert completion.object == "text_completion" and len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.text and choice.finish_reason in ("length", "stop")
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    assert completion.usage.prompt_tokens > 0
    assert extras(completion)["instance"] in ("inst-0", "inst-1")
    assert extras(completion)["predicted_output_tokens"] is not None

    stream = client.completions.create(model="blockq", prompt="Explain paged attention", max_tokens=6, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.strip() and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_completions(gateway_cluster: dict[str, Any]) -> None:
    client: openai.OpenAI = gateway_cluster["client"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    raw = client.chat.completions.with_raw_response.create(model="blockq", messages=messages, max_tokens=4)
    assert raw.headers["x-blockq-instance"] in ("inst-0", "inst-1")
    assert int(raw.headers["x-blockq-predicted-output-tokens"]) >= 1
    chat = raw.parse()
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 4
    assert extras(chat)["request_id"] == raw.headers["x-request-id"]

    pieces = []
    finish_reasons = []
    for chunk in client.chat.completions.create(model="blockq", messages=messages, max_tokens=5, stream=True):
        assert chunk.object == "chat.completion.chunk"
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish_reasons.append(choice.finish_reason)
    assert "".join(pieces).strip() and finish_reasons[-1] == "length"


def test_vllm_sampling_extensions_end_to_end(gateway_cluster: dict[str, Any]) -> None:
    """``ignore_eos`` / ``min_tokens`` from the openai client's ``extra_body`` to the
    emulated engines: the output runs to max_tokens, or at least to min_tokens."""
    client: openai.OpenAI = gateway_cluster["client"]
    completion = client.completions.create(model="blockq", prompt="Explain paged attention", max_tokens=40,
                                           extra_body={"ignore_eos": True})
    assert completion.usage is not None and completion.usage.completion_tokens == 40
    assert completion.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="blockq", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=48, extra_body={"min_tokens": 30})
    assert chat.usage is not None and 30 <= chat.usage.completion_tokens <= 48
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="blockq", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, extra_body={"min_tokens": 5})
    assert info.value.body["param"] == "min_tokens"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="blockq", prompt="x", max_tokens=4, extra_body={"ignore_eos": "yes"})
    assert info.value.body["param"] == "ignore_eos"  # type: ignore[index]


def test_keys_models_and_status(gateway_cluster: dict[str, Any]) -> None:
    wrong = openai.OpenAI(base_url=gateway_cluster["base_url"] + "/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="blockq", prompt="x", max_tokens=1)
    client: openai.OpenAI = gateway_cluster["client"]
    assert "blockq" in [m.id for m in client.models.list()]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="blockq", prompt="x", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"  # type: ignore[index]
    status = run_blockq("status", "--json", env=gateway_cluster["env"])
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["gateway_url"] == gateway_cluster["base_url"]


def test_gateway_command_line() -> None:
    result = run_blockq("gateway", "--help")
    assert result.returncode == 0 and "--api-keys-file" in result.stdout


def test_key_policy_refuses_priority_and_best_effort(gateway_cluster: dict[str, Any]) -> None:
    """A key with the default policy (no options) gets priority interactive and may not ask
    for another, nor for best_effort: 403 naming the field (docs/gateway.md)."""
    client: openai.OpenAI = gateway_cluster["client"]
    for extra, field in [({"priority": "batch"}, "priority"), ({"best_effort": True}, "best_effort")]:
        with pytest.raises(openai.PermissionDeniedError) as info:
            client.completions.create(model="blockq", prompt="x", max_tokens=1, extra_body=extra)
        assert info.value.body["param"] == field  # type: ignore[index]
    completion = client.completions.create(model="blockq", prompt="x", max_tokens=1,
                                           extra_body={"priority": "interactive", "best_effort": False})
    assert completion.usage is not None and completion.usage.completion_tokens == 1
