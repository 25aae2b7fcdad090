"""Each API key's share of the backlog: the requests (prompts x ``n``) its open calls carry are
capped, not only its calls, since one call may carry 128 requests (docs/gateway.md)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import pytest

from blockq.config import Settings
from blockq.frontdoors.gateway.api_keys import KeyPolicy, parse_api_key_specs
from blockq.frontdoors.gateway.config import GatewayConfig
from blockq.frontdoors.gateway.in_flight import InFlightSlots, SlotLimit
from tests.test_gateway_limits import (
    AUTH_A,
    AUTH_B,
    KEY_A,
    KEY_B,
    completion,
    in_flight_is,
    serving,
    wait_for,
)

BIG_CALL = completion(["hold"] * 64, n=2)  # 128 requests, the most one call may carry


def test_requests_are_counted_per_key_and_given_back() -> None:
    slots = InFlightSlots(max_in_flight=8)
    assert slots.take_requests("a", 128, 300) is None and slots.take_requests("a", 128, 300) is None
    assert slots.take_requests("a", 128, 300) is SlotLimit.KEY_REQUESTS and slots.num_requests_of("a") == 256
    assert slots.take_requests("a", 44, 300) is None
    assert slots.take_requests("b", 128, 300) is None  # another key's share is its own
    slots.give_back_requests("a", 128)
    assert slots.num_requests_of("a") == 172
    for num in (128, 44):
        slots.give_back_requests("a", num)
    assert slots.num_requests_of("a") == 0
    with pytest.raises(RuntimeError):
        slots.give_back_requests("a", 1)


def test_backlog_share_defaults_and_options() -> None:
    tenants, policies = parse_api_key_specs("k1=alice;max_requests_in_flight=300,k2=bob")
    assert policies == {"k1": KeyPolicy(max_requests_in_flight=300)}
    config = GatewayConfig(api_key_to_tenant=tenants, api_key_to_policy=policies)
    assert config.policy_of("k1", max_backlog=1000).max_requests_in_flight == 300
    # half the backlog with two keys or more, all of it with one key or none
    assert config.policy_of("k2", max_backlog=1000).max_requests_in_flight == 500
    assert GatewayConfig(api_key_to_tenant={"k": "t"}).policy_of("k", 1000).max_requests_in_flight == 1000
    assert GatewayConfig().policy_of(None, 1000).max_requests_in_flight == 1000
    assert GatewayConfig(api_key_to_tenant=tenants,
                         key_max_requests_in_flight=64).policy_of("k2", 1000).max_requests_in_flight == 64


def submitted_is(sync_redis: Any, settings: Settings, expected: int) -> Any:
    async def check() -> bool:
        return int(sync_redis.xlen(settings.keys.requests)) == expected
    return check


@pytest.mark.timeout(60)
async def test_a_key_cannot_fill_the_backlog_with_many_choices(settings: Settings, sync_redis: Any) -> None:
    """Under its call cap (half of 512), a key sending 128-request calls used to reach 32,768
    requests in flight; now it stops at its share of the backlog (half of 1,000 here)."""
    settings = replace(settings, max_ingress_backlog=1000)
    config = GatewayConfig(api_key_to_tenant={KEY_A: "alice", KEY_B: "bob"})
    async with serving(config, settings) as gateway:
        held = [asyncio.create_task(gateway.post("/v1/completions", json=BIG_CALL, headers=AUTH_A))
                for _ in range(3)]
        await wait_for(submitted_is(sync_redis, settings, 384), timeout_s=10.0)
        # a "hold" call accepted would never answer: the wait is bounded so that fails plainly
        response = await asyncio.wait_for(gateway.post("/v1/completions", json=BIG_CALL, headers=AUTH_A), 10.0)
        assert response.status == 429 and response.headers["Retry-After"] == "1"
        text = await response.text()
        error = json.loads(text)["error"]
        assert error["param"] == "max_requests_in_flight" and error["code"] == "key_too_many_requests"
        assert "alice" in error["message"] and "384 requests in flight" in error["message"]
        assert "(500)" in error["message"] and KEY_A not in text
        assert sync_redis.xlen(settings.keys.requests) == 384  # nothing of the refused call was submitted
        # a smaller call still fits alice's share; bob's share is untouched by hers
        assert (await gateway.post("/v1/completions", json=completion(n=4), headers=AUTH_A)).status == 200
        assert (await gateway.post("/v1/completions", json=completion(["x"] * 64, n=2),
                                   headers=AUTH_B)).status == 200
        for task in held:  # the calls end: their requests come back to alice's share
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await wait_for(in_flight_is(gateway, 0), timeout_s=5.0)
        assert (await gateway.post("/v1/completions", json=completion(["x"] * 64, n=2),
                                   headers=AUTH_A)).status == 200


@pytest.mark.timeout(60)
async def test_a_call_larger_than_its_key_share_is_400_naming_n(settings: Settings, sync_redis: Any) -> None:
    config = GatewayConfig(api_key_to_tenant={KEY_A: "alice"},
                           api_key_to_policy={KEY_A: KeyPolicy(max_requests_in_flight=4)})
    async with serving(config, settings) as gateway:
        response = await gateway.post("/v1/completions", json=completion(n=8), headers=AUTH_A)
        assert response.status == 400
        error = (await response.json())["error"]
        assert error["param"] == "n" and "8 choices" in error["message"] and "at most 4" in error["message"]
        assert sync_redis.xlen(settings.keys.requests) == 0
        assert (await gateway.post("/v1/completions", json=completion(n=4), headers=AUTH_A)).status == 200

