"""API keys: the tenant each key serves and what the key may do (docs/gateway.md).

A key is configured as ``KEY[=TENANT][;OPTION=VALUE]...`` (``KEY TENANT`` in a keys file):

==============================  ==============================================================
``max_in_flight=N``             calls this key may have open at once (default: the gateway's
                                ``key_max_in_flight``, see :meth:`GatewayConfig.policy_of`)
``max_requests_in_flight=N``    requests (prompts x ``n``) this key's open calls may carry:
                                its share of the backlog (default: the gateway's
                                ``key_max_requests_in_flight``)
``priority=P``                  ``interactive`` (default) or ``batch``: the priority of the
                                key's requests that name none
``may_set_priority=B``          ``true``: a request may ask for another priority (default false)
``may_set_best_effort=B``       ``true``: a request may send ``"best_effort": true`` (default
                                false)
==============================  ==============================================================

Callers used to choose their own priority and best_effort; a key now gets its configured
priority, and a request asking for what its key may not set is refused naming the field
(:func:`apply_key_policy`), so one tenant cannot jump the queue or dodge the SLO refusal.
Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from blockq.config import ConfigError
from blockq.frontdoors.gateway.openai_requests import GenerationPlan
from blockq.wire.protocol import PRIORITIES
from blockq.wire.redis_url import PLACEHOLDER_SECRET

_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no")


@dataclass(frozen=True)
class KeyPolicy:
    """What one API key may do. ``max_in_flight`` / ``max_requests_in_flight`` None: the
    gateway's per-key defaults."""

    max_in_flight: int | None = None
    max_requests_in_flight: int | None = None
    priority: str = "interactive"
    may_set_priority: bool = False
    may_set_best_effort: bool = False

    def __post_init__(self) -> None:
        for name in ("max_in_flight", "max_requests_in_flight"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}: must be >= 1 (got {value})")
        if self.priority not in PRIORITIES:
            raise ConfigError(f"priority: must be one of {', '.join(PRIORITIES)} (got {self.priority!r})")


# Without keys the gateway serves one caller, as before keys had policies: it may ask for anything.
OPEN_POLICY = KeyPolicy(may_set_priority=True, may_set_best_effort=True)


@dataclass(frozen=True)
class Caller:
    """Who sent a request: its tenant, its key's fingerprint ("" without keys) and policy
    (every default filled in, so ``policy.max_in_flight`` and ``max_requests_in_flight`` are set)."""

    tenant: str
    key_id: str
    policy: KeyPolicy


def key_fingerprint(key: str) -> str:
    """``sha256:`` and 8 hex digits: names a key in errors and logs without revealing it."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()[:8]


def _read_option(policy: KeyPolicy, name: str, raw: str) -> KeyPolicy:
    value: object = raw
    if name in ("max_in_flight", "max_requests_in_flight"):
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"{name}: must be an integer (got {raw!r})") from None
    elif name in ("may_set_priority", "may_set_best_effort"):
        if raw.lower() not in _TRUE + _FALSE:
            raise ConfigError(f"{name}: must be true or false (got {raw!r})")
        value = raw.lower() in _TRUE
    elif name != "priority":
        raise ConfigError(f"{name or raw!r}: unknown option (known: max_in_flight, max_requests_in_flight, "
                          "priority, may_set_priority, may_set_best_effort)")
    return replace(policy, **{name: value})


def parse_api_key_item(item: str) -> tuple[str, str, KeyPolicy | None]:
    """``KEY[=TENANT][;OPTION=VALUE]...`` (or ``KEY TENANT;...``) as (key, tenant, policy);
    policy None when the item names no option. ConfigError names the bad option, and the
    key only by its fingerprint."""
    head, *options = item.split(";")
    head = head.strip()
    key, _, tenant = head.partition("=" if "=" in head else " ")
    key, tenant = key.strip(), tenant.strip() or "default"
    if PLACEHOLDER_SECRET in key.upper():
        # the shipped example secret works until someone changes it: refuse it at start-up
        raise ConfigError(f"gateway api key {key_fingerprint(key)} (tenant {tenant}): is the placeholder "
                          f"{PLACEHOLDER_SECRET!r}; set a real secret")
    policy = KeyPolicy() if any(o.strip() for o in options) else None
    for option in options:
        if not option.strip():
            continue
        name, _, raw = option.partition("=")
        try:
            policy = _read_option(policy or KeyPolicy(), name.strip(), raw.strip())
        except ConfigError as exc:
            raise ConfigError(f"gateway api key {key_fingerprint(key)} (tenant {tenant}): {exc}") from None
    return key, tenant, policy


def parse_api_key_specs(text: str, separators: str = ",\n") -> tuple[dict[str, str], dict[str, KeyPolicy]]:
    """Items separated by ``separators`` (``#`` starts a comment item) as the key-to-tenant
    map and the policies of the keys that set options."""
    items = [text]
    for sep in separators:
        items = [part for item in items for part in item.split(sep)]
    key_to_tenant: dict[str, str] = {}
    key_to_policy: dict[str, KeyPolicy] = {}
    for raw in items:
        item = raw.strip()
        if not item or item.startswith("#"):
            continue
        key, tenant, policy = parse_api_key_item(item)
        key_to_tenant[key] = tenant
        if policy is not None:
            key_to_policy[key] = policy
    return key_to_tenant, key_to_policy


class ForbiddenField(Exception):
    """A request asked for something its API key may not set; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def apply_key_policy(plan: GenerationPlan, body: Mapping[str, Any], policy: KeyPolicy) -> GenerationPlan:
    """``plan`` with the priority ``policy`` gives it. Raises ForbiddenField naming
    ``priority`` or ``best_effort`` when the body asks for what the key may not set; asking
    for what the key gets anyway (its own priority, ``"best_effort": false``) is allowed."""
    asked = body.get("priority")
    if asked is not None and asked != policy.priority and not policy.may_set_priority:
        raise ForbiddenField("priority", f"this API key may not set priority (its requests are {policy.priority!r})")
    if plan.best_effort and not policy.may_set_best_effort:
        raise ForbiddenField("best_effort", "this API key may not set best_effort")
    return replace(plan, priority=policy.priority if asked is None else asked)
