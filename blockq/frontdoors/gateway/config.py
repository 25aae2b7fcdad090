"""Gateway configuration: a frozen dataclass filled from ``BLOCKQ_GATEWAY_*`` variables and
overridden by ``blockq gateway`` flags.

=====================================  ========================================================
``BLOCKQ_GATEWAY_HOST`` / ``_PORT``     listen address (default 127.0.0.1:8000)
``BLOCKQ_GATEWAY_API_KEYS``             ``KEY=TENANT,KEY2=TENANT2`` (``KEY`` alone: tenant
                                        ``default``); when any key is set, every ``/v1/*`` call
                                        needs ``Authorization: Bearer KEY``. A key's policy
                                        follows as ``;OPTION=VALUE`` items (``api_keys.py``)
``BLOCKQ_GATEWAY_API_KEYS_FILE``        file with one ``KEY=TENANT`` (or ``KEY TENANT``) a line
``BLOCKQ_GATEWAY_KEY_MAX_IN_FLIGHT``    calls one key may have open unless its policy says
                                        (default: half of ``MAX_IN_FLIGHT`` with two keys or
                                        more, all of it with one)
``BLOCKQ_GATEWAY_KEY_MAX_REQUESTS_IN_FLIGHT``  requests (prompts x ``n``) one key's open calls
                                        may carry unless its policy says (default: half of
                                        ``BLOCKQ_MAX_BACKLOG`` with two keys or more, all of
                                        it with one)
``BLOCKQ_GATEWAY_MODEL_NAMES``          comma-separated served model names (default ``blockq``)
``BLOCKQ_GATEWAY_CHAT_TEMPLATE``        ``chatml`` (default), ``plain`` or a Jinja2 file path
``BLOCKQ_GATEWAY_REQUEST_TIMEOUT_S``    longest a request may take (default 600 s)
``BLOCKQ_GATEWAY_MAX_BODY_BYTES``       request body limit (default 4 MiB)
``BLOCKQ_GATEWAY_MAX_JSON_DEPTH``       JSON nesting limit (default 32)
``BLOCKQ_GATEWAY_MAX_IN_FLIGHT``        concurrent generation requests before 429 (default 512);
                                        a call holds its slot from before its body is read
``BLOCKQ_GATEWAY_READ_TIMEOUT_S``       longest a whole request body may take to arrive, else
                                        408 (default 30 s)
``BLOCKQ_GATEWAY_WRITE_TIMEOUT_S``      longest one stream write may wait for the client to
                                        read, else the connection is dropped (default 5 s)
``BLOCKQ_GATEWAY_ALLOW_UNAUTHENTICATED``  ``1``: allow a non-loopback host without API keys
=====================================  ========================================================

A host other than a loopback address (``127.0.0.0/8``, ``::1``, ``localhost``) with no API
key is refused unless ``allow_unauthenticated`` is set (``--allow-unauthenticated``):
an open gateway on a network lets anyone spend the fleet.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from blockq.config import ConfigError, Settings
from blockq.frontdoors.gateway.api_keys import (
    OPEN_POLICY,
    KeyPolicy,
    key_fingerprint,
    parse_api_key_specs,
)
from blockq.frontdoors.gateway.openai_requests import RequestDefaults

ENV_PREFIX = "BLOCKQ_GATEWAY_"


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key_to_tenant: Mapping[str, str] = field(default_factory=dict)
    model_names: tuple[str, ...] = ("blockq",)
    chat_template: str = "chatml"
    request_timeout_s: float = 600.0
    max_body_bytes: int = 4 * 1024 * 1024
    max_json_depth: int = 32
    max_in_flight: int = 512
    shutdown_timeout_s: float = 10.0
    defaults: RequestDefaults = field(default_factory=RequestDefaults)
    allow_unauthenticated: bool = False
    # Slow clients: a body must arrive whole within read_timeout_s (30 s carries 4 MiB at
    # about 1 Mbit/s), and a stream write that a client leaves unread for write_timeout_s
    # drops the connection (a client reading 10 KB/s never waits that long; docs/gateway.md).
    read_timeout_s: float = 30.0
    write_timeout_s: float = 5.0
    # Per-key policies (keys absent here get KeyPolicy()) and the per-key in-flight defaults
    # (None: see policy_of).
    api_key_to_policy: Mapping[str, KeyPolicy] = field(default_factory=dict)
    key_max_in_flight: int | None = None
    key_max_requests_in_flight: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"gateway port: must be a TCP port (got {self.port})")
        if not self.model_names or not all(self.model_names):
            raise ConfigError("gateway model_names: need at least one non-empty name")
        for name in ("request_timeout_s", "read_timeout_s", "write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"gateway {name}: must be > 0 (got {getattr(self, name)})")
        for name in ("max_body_bytes", "max_json_depth", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ConfigError(f"gateway {name}: must be >= 1 (got {getattr(self, name)})")
        for key, tenant in self.api_key_to_tenant.items():
            if not key or any(c.isspace() for c in key) or not tenant:
                raise ConfigError("gateway api keys: keys must be non-empty without whitespace, tenants non-empty")
        self._check_key_policies()
        if not self.auth_required and not self.allow_unauthenticated and not is_loopback_host(self.host):
            raise ConfigError(f"gateway host: {self.host!r} is reachable from other machines and no API key is set; "
                              "set API keys (--api-key, --api-keys-file, BLOCKQ_GATEWAY_API_KEYS) or pass "
                              "--allow-unauthenticated (BLOCKQ_GATEWAY_ALLOW_UNAUTHENTICATED=1) to serve anyone")

    def _check_key_policies(self) -> None:
        """Keys are named by fingerprint only: a config error must not print a secret."""
        if self.key_max_in_flight is not None and not 1 <= self.key_max_in_flight <= self.max_in_flight:
            raise ConfigError(f"gateway key_max_in_flight: must be between 1 and max_in_flight "
                              f"({self.max_in_flight}) (got {self.key_max_in_flight})")
        if self.key_max_requests_in_flight is not None and self.key_max_requests_in_flight < 1:
            raise ConfigError(f"gateway key_max_requests_in_flight: must be >= 1 "
                              f"(got {self.key_max_requests_in_flight})")
        for key, policy in self.api_key_to_policy.items():
            where = f"gateway api key {key_fingerprint(key)}"
            if key not in self.api_key_to_tenant:
                raise ConfigError(f"{where}: api_key_to_policy names a key that is not configured")
            if not isinstance(policy, KeyPolicy):
                raise ConfigError(f"{where}: api_key_to_policy: must map keys to KeyPolicy (got {policy!r})")
            if policy.max_in_flight is not None and policy.max_in_flight > self.max_in_flight:
                raise ConfigError(f"{where} (tenant {self.api_key_to_tenant[key]}): max_in_flight: must be at most "
                                  f"the gateway's max_in_flight ({self.max_in_flight}) (got {policy.max_in_flight})")

    @property
    def auth_required(self) -> bool:
        return bool(self.api_key_to_tenant)

    def _key_share(self, whole: int) -> int:
        """A key's default share of ``whole`` (slots or backlog): with two keys or more,
        half, so no single key can lock the others out while a busy key may still use half
        when the others are idle; with one key, all of it."""
        return whole if len(self.api_key_to_tenant) <= 1 else max(1, whole // 2)

    def policy_of(self, key: str | None, max_backlog: int = Settings.max_ingress_backlog) -> KeyPolicy:
        """``key``'s policy with every default filled in; None: the caller of a gateway
        without keys, who may set priority and best_effort and use every slot and the whole
        backlog (``max_backlog``, the pipeline's ``BLOCKQ_MAX_BACKLOG``)."""
        if key is None:
            return replace(OPEN_POLICY, max_in_flight=self.max_in_flight, max_requests_in_flight=max_backlog)
        policy = self.api_key_to_policy.get(key, KeyPolicy())
        if policy.max_in_flight is None:
            policy = replace(policy, max_in_flight=self.key_max_in_flight or self._key_share(self.max_in_flight))
        if policy.max_requests_in_flight is None:
            policy = replace(policy, max_requests_in_flight=self.key_max_requests_in_flight
                             or self._key_share(max_backlog))
        return policy


def is_loopback_host(host: str) -> bool:
    """True for an address only this machine can reach; any other name counts as public
    (it may resolve to anything, and ``""`` means every interface)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_api_keys(text: str, separators: str = ",\n") -> dict[str, str]:
    """``KEY=TENANT`` items separated by commas or newlines (``#`` starts a comment line);
    the tenants only (:func:`parse_api_key_specs` also returns the keys' policies)."""
    return parse_api_key_specs(text, separators)[0]


def read_api_keys_file(path: Path) -> tuple[dict[str, str], dict[str, KeyPolicy]]:
    """A keys file, one ``KEY=TENANT[;OPTION=VALUE]...`` a line: tenants and policies."""
    try:
        return parse_api_key_specs(path.read_text(), separators="\n")
    except OSError as exc:
        raise ConfigError(f"gateway api_keys_file: cannot read {path}: {exc.strerror}") from None


def gateway_config_from_env(env: Mapping[str, str] | None = None, **overrides: object) -> GatewayConfig:
    """Config from ``BLOCKQ_GATEWAY_*``; ``overrides`` that are not None win (flags)."""
    env = os.environ if env is None else env

    def get(name: str) -> str | None:
        return env.get(ENV_PREFIX + name) or None

    def number(name: str, kind: type) -> object:
        raw = get(name)
        if raw is None:
            return None
        try:
            return kind(raw)
        except ValueError:
            raise ConfigError(f"{ENV_PREFIX}{name}: must be a number (got {raw!r})") from None

    sources = []
    if get("API_KEYS_FILE"):
        sources.append(read_api_keys_file(Path(get("API_KEYS_FILE") or "")))
    sources.append(parse_api_key_specs(get("API_KEYS") or ""))
    sources.append((overrides.pop("api_key_to_tenant", None) or {},  # type: ignore[arg-type]
                    overrides.pop("api_key_to_policy", None) or {}))
    keys, policies = merge_api_keys(sources)
    values: dict[str, object] = {
        "host": get("HOST"), "port": number("PORT", int), "chat_template": get("CHAT_TEMPLATE"),
        "request_timeout_s": number("REQUEST_TIMEOUT_S", float), "max_body_bytes": number("MAX_BODY_BYTES", int),
        "max_json_depth": number("MAX_JSON_DEPTH", int), "max_in_flight": number("MAX_IN_FLIGHT", int),
        "read_timeout_s": number("READ_TIMEOUT_S", float), "write_timeout_s": number("WRITE_TIMEOUT_S", float),
        "key_max_in_flight": number("KEY_MAX_IN_FLIGHT", int),
        "key_max_requests_in_flight": number("KEY_MAX_REQUESTS_IN_FLIGHT", int),
        "model_names": tuple(n.strip() for n in (get("MODEL_NAMES") or "").split(",") if n.strip()) or None,
        "api_key_to_tenant": keys or None, "api_key_to_policy": policies or None,
        "allow_unauthenticated": (get("ALLOW_UNAUTHENTICATED") or "").lower() in ("1", "true", "yes") or None,
    }
    values.update({k: v for k, v in overrides.items() if v is not None})
    return GatewayConfig(**{k: v for k, v in values.items() if v is not None})  # type: ignore[arg-type]


def merge_api_keys(sources: list[tuple[Mapping[str, str], Mapping[str, KeyPolicy]]]
                   ) -> tuple[dict[str, str], dict[str, KeyPolicy]]:
    """(tenants, policies) of several sources, later ones winning: a key named again is
    replaced whole, so its policy is the one given with it there (none: the defaults)."""
    keys: dict[str, str] = {}
    policies: dict[str, KeyPolicy] = {}
    for key_to_tenant, key_to_policy in sources:
        for key, tenant in key_to_tenant.items():
            keys[key] = tenant
            policies.pop(key, None)
        policies.update(key_to_policy)
    return keys, policies
