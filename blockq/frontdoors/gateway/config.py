"""Gateway configuration: a frozen dataclass filled from ``BLOCKQ_GATEWAY_*`` variables and
overridden by ``blockq gateway`` flags.

=====================================  ========================================================
``BLOCKQ_GATEWAY_HOST`` / ``_PORT``     listen address (default 127.0.0.1:8000)
``BLOCKQ_GATEWAY_API_KEYS``             ``KEY=TENANT,KEY2=TENANT2`` (``KEY`` alone: tenant
                                        ``default``); when any key is set, every ``/v1/*`` call
                                        needs ``Authorization: Bearer KEY``
``BLOCKQ_GATEWAY_API_KEYS_FILE``        file with one ``KEY=TENANT`` (or ``KEY TENANT``) a line
``BLOCKQ_GATEWAY_MODEL_NAMES``          comma-separated served model names (default ``blockq``)
``BLOCKQ_GATEWAY_CHAT_TEMPLATE``        ``chatml`` (default), ``plain`` or a Jinja2 file path
``BLOCKQ_GATEWAY_REQUEST_TIMEOUT_S``    longest a request may take (default 600 s)
``BLOCKQ_GATEWAY_MAX_BODY_BYTES``       request body limit (default 4 MiB)
``BLOCKQ_GATEWAY_MAX_JSON_DEPTH``       JSON nesting limit (default 32)
``BLOCKQ_GATEWAY_MAX_IN_FLIGHT``        concurrent generation requests before 429 (default 512)
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
from dataclasses import dataclass, field
from pathlib import Path

from blockq.config import ConfigError
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

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"gateway port: must be a TCP port (got {self.port})")
        if not self.model_names or not all(self.model_names):
            raise ConfigError("gateway model_names: need at least one non-empty name")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"gateway request_timeout_s: must be > 0 (got {self.request_timeout_s})")
        for name in ("max_body_bytes", "max_json_depth", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ConfigError(f"gateway {name}: must be >= 1 (got {getattr(self, name)})")
        for key, tenant in self.api_key_to_tenant.items():
            if not key or any(c.isspace() for c in key) or not tenant:
                raise ConfigError("gateway api keys: keys must be non-empty without whitespace, tenants non-empty")
        if not self.auth_required and not self.allow_unauthenticated and not is_loopback_host(self.host):
            raise ConfigError(f"gateway host: {self.host!r} is reachable from other machines and no API key is set; "
                              "set API keys (--api-key, --api-keys-file, BLOCKQ_GATEWAY_API_KEYS) or pass "
                              "--allow-unauthenticated (BLOCKQ_GATEWAY_ALLOW_UNAUTHENTICATED=1) to serve anyone")

    @property
    def auth_required(self) -> bool:
        return bool(self.api_key_to_tenant)


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
    """``KEY=TENANT`` items separated by commas or newlines (``#`` starts a comment line)."""
    out: dict[str, str] = {}
    items = [text]
    for sep in separators:
        items = [part for item in items for part in item.split(sep)]
    for raw in items:
        item = raw.strip()
        if not item or item.startswith("#"):
            continue
        key, _, tenant = item.partition("=" if "=" in item else " ")
        out[key.strip()] = tenant.strip() or "default"
    return out


def read_api_keys_file(path: Path) -> dict[str, str]:
    try:
        return parse_api_keys(path.read_text(), separators="\n")
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

    keys: dict[str, str] = {}
    if get("API_KEYS_FILE"):
        keys.update(read_api_keys_file(Path(get("API_KEYS_FILE") or "")))
    keys.update(parse_api_keys(get("API_KEYS") or ""))
    values: dict[str, object] = {
        "host": get("HOST"), "port": number("PORT", int), "chat_template": get("CHAT_TEMPLATE"),
        "request_timeout_s": number("REQUEST_TIMEOUT_S", float), "max_body_bytes": number("MAX_BODY_BYTES", int),
        "max_json_depth": number("MAX_JSON_DEPTH", int), "max_in_flight": number("MAX_IN_FLIGHT", int),
        "model_names": tuple(n.strip() for n in (get("MODEL_NAMES") or "").split(",") if n.strip()) or None,
        "api_key_to_tenant": keys or None,
        "allow_unauthenticated": (get("ALLOW_UNAUTHENTICATED") or "").lower() in ("1", "true", "yes") or None,
    }
    extra_keys = overrides.pop("api_key_to_tenant", None)
    if extra_keys:
        values["api_key_to_tenant"] = {**keys, **extra_keys}  # type: ignore[dict-item]
    values.update({k: v for k, v in overrides.items() if v is not None})
    return GatewayConfig(**{k: v for k, v in values.items() if v is not None})  # type: ignore[arg-type]
