"""Configuration in one place: frozen dataclasses, filled from env vars (``BLOCKQ_*``)
and, for ``blockq up``, a TOML file. Validated at start-up; never mutated.

Environment variables (all optional):

=============================  ==========================================================
``BLOCKQ_REDIS_URL``           where Redis is (user, password allowed; forms in
                               :mod:`blockq.wire.redis_url`): one server, ``redis://[:pw@]host:6379/0``
                               (``rediss://``, ``unix://``); through Sentinel,
                               ``redis+sentinel://[:pw@]s1:26379,s2:26379/<service_name>[/db]``
                               (``rediss+sentinel://``; ``?sentinel_password=`` when the
                               Sentinels have their own); a Redis Cluster,
                               ``redis+cluster://[:pw@]node1:6379,node2:6379`` (``rediss+cluster://``)
``BLOCKQ_KEY_PREFIX``          key prefix, default ``bq:``; on Redis Cluster it must hold a
                               hash tag, e.g. ``{bq}:`` (every key in one slot: :mod:`blockq.wire.keys`)
``BLOCKQ_MAX_BACKLOG``         requests accepted and not finished (entries in ``req``, ``ready``
                               and every instance queue) past which submit raises Overloaded
``BLOCKQ_MAX_DELIVERIES``      an entry delivered more often than this is dead-lettered
``BLOCKQ_REPLY_TTL_S``         reply stream lifetime after its last write, seconds
``BLOCKQ_REPLY_READ_TTL_S``    reply stream lifetime once the final record was read
``BLOCKQ_CLAIM_IDLE_MS``       pending entries idle this long are claimed by a live peer
``BLOCKQ_HEARTBEAT_MS``        worker heartbeat interval, milliseconds
``BLOCKQ_SLO_TTFT_MS``         interactive requests' TTFT objective (default 3000; 0: none):
                               one predicted to miss it is answered ``infeasible``
``BLOCKQ_STATE_DIR``           where ``blockq up`` keeps Redis data, pids and logs
``BLOCKQ_LOG_LEVEL``           debug | info | warning | error
``BLOCKQ_MAX_MESSAGE_BYTES``   protocol limit (likewise ``BLOCKQ_MAX_PROMPT_CHARS``,
                               ``BLOCKQ_MAX_PROMPT_TOKEN_IDS``, ``BLOCKQ_MAX_MAX_TOKENS``)
``BLOCKQ_METRICS_PORT``        default of ``--metrics-port`` for the processes that run one
                               service (worker, dispatcher, predictor serve): the port of
                               their Prometheus ``/metrics`` (0: any free port; ``off``:
                               none); unset: none unless the flag gives one. ``blockq up``
                               passes every child its own port (``metrics_base_port``)
``BLOCKQ_PREFIX_TOKENIZER``    the served model's directory: prompts are hashed for prefix-cache
                               hits with its tokenizer (:mod:`blockq.text.model_tokenizer`);
                               unset: the project tokenizer (the emulated engine's)
``BLOCKQ_PREFIX_BLOCK_TOKENS`` the engines' KV block size in tokens, the hashes' block
                               (default 16; vLLM on a CPU: the ``--block-size`` it runs)
``BLOCKQ_CELLS``               the cells a front (client library, gateway) routes between,
                               whitespace-separated ``PREFIX`` or ``PREFIX=REDIS_URL`` (a cell
                               without a URL is on ``BLOCKQ_REDIS_URL``); unset: one cell, the
                               plain cluster under ``BLOCKQ_KEY_PREFIX`` (:mod:`blockq.cells`)
``BLOCKQ_CELL_LOAD_MS``        how often a dispatcher leader publishes its cell's load, ms
                               (default 250; 0: never)
``BLOCKQ_CELL_STALE_MS``       a front treats a cell's load older than this as stale, ms
                               (default 2000): it avoids that cell while another is fresh
``BLOCKQ_CELL_CHOICES``        how many cells a front compares per request: 0 all (default),
                               k >= 2 a draw of k weighted by live instances (many fronts)
=============================  ==========================================================
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from blockq.cells import CellSpec, FrontOptions, parse_cells
from blockq.text.block_hashes import PREFIX_BLOCK_TOKENS, PrefixScheme
from blockq.text.model_tokenizer import TokenizerUnavailable
from blockq.wire.keys import DEFAULT_PREFIX, Keys, hash_tag
from blockq.wire.protocol import MAX_SLO_TTFT_MS, ProtocolLimits
from blockq.wire.redis_url import RedisUrlError, parse_redis_url

ENV_PREFIX = "BLOCKQ_"
LOG_LEVELS = ("debug", "info", "warning", "error")
# Running requests are refined every this many generated tokens (workers.refinement).
DEFAULT_REFINE_EVERY_TOKENS = 64


MAX_PREFIX_BLOCK_TOKENS = 4096


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the setting."""


@functools.cache
def _prefix_scheme(block_tokens: int, tokenizer_dir: str | None) -> PrefixScheme:
    """One scheme per setting, so its tokenizer fingerprint is read once per process."""
    return PrefixScheme(block_tokens, tokenizer_dir)


def validate_redis_url(url: str, key_prefix: str | None = None) -> str:
    """Check a Redis URL, in any form of :mod:`blockq.wire.redis_url` (one server, Sentinel,
    Cluster); returns it unchanged. On Redis Cluster, ``key_prefix`` (when given) must
    hold a hash tag, so that every blockq key shares one slot (:mod:`blockq.wire.keys`)."""
    try:
        target = parse_redis_url(url)
    except RedisUrlError as exc:
        raise ConfigError(f"redis_url: {exc}") from None
    if target.is_cluster and key_prefix is not None and hash_tag(key_prefix) is None:
        raise ConfigError(f"key_prefix: on Redis Cluster it must hold a hash tag, such as "
                          f"{{{key_prefix.rstrip(':') or 'bq'}}}: (BLOCKQ_KEY_PREFIX), so that the keys one "
                          f"script or transaction touches share a slot (got {key_prefix!r})")
    return url


# The predictor's HTTP API token (``/predict``, ``/refine``): the predictor requires it, the
# workers that ask it for refinements send it; both read it from this variable.
PREDICTOR_HTTP_TOKEN_ENV = "BLOCKQ_PREDICTOR_HTTP_TOKEN"
# The API key of the vLLM servers `--engine vllm-http` workers drive (`vllm serve --api-key`).
VLLM_HTTP_API_KEY_ENV = "BLOCKQ_VLLM_HTTP_API_KEY"


@dataclass(frozen=True)
class Settings:
    """Settings shared by every blockq component."""

    redis_url: str | None = field(default=None, repr=False)  # holds the password
    key_prefix: str = DEFAULT_PREFIX
    max_ingress_backlog: int = 50_000
    reply_ttl_s: int = 3600
    reply_read_ttl_s: int = 60
    claim_idle_ms: int = 30_000
    max_deliveries: int = 5
    heartbeat_interval_ms: int = 100
    # How often a waiting client checks that Redis still holds its request's admission
    # (a crash can lose the last second of writes; blockq/client_admission.py).
    submit_check_ms: int = 1000
    dead_letter_max_bytes: int = 64 * 1024  # of each dead-lettered payload kept in bq:dead
    idle_consumer_ms: int = 3_600_000  # consumers idle this long with nothing pending are deleted (0: never)
    # Every interactive request's TTFT objective unless it carries its own: one the
    # dispatcher predicts it cannot meet is answered "infeasible" (0: no cluster-wide SLO).
    slo_ttft_ms: int = 3000
    state_dir: Path = field(default_factory=lambda: Path(".blockq"))
    log_level: str = "info"
    limits: ProtocolLimits = field(default_factory=ProtocolLimits)
    # How prompts are hashed for prefix-cache hits (blockq.text.block_hashes.PrefixScheme):
    # the served model's tokenizer directory (None: the project's) and the engines' block size.
    prefix_tokenizer: str | None = None
    prefix_block_tokens: int = PREFIX_BLOCK_TOKENS
    # Cells (blockq.cells): the ones a front routes between (empty: the one cluster under
    # key_prefix), how often a leader publishes its cell's load (0: never), when a front
    # counts a load stale, and how many cells it compares per request (0: all).
    cells: tuple[CellSpec, ...] = ()
    cell_load_interval_ms: int = 250
    cell_stale_after_ms: int = 2000
    cell_choices: int = 0

    def __post_init__(self) -> None:
        if self.redis_url is not None:
            validate_redis_url(self.redis_url, self.key_prefix)
        for name in ("max_ingress_backlog", "reply_ttl_s", "reply_read_ttl_s", "claim_idle_ms",
                     "max_deliveries", "heartbeat_interval_ms", "submit_check_ms"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1 (got {getattr(self, name)})")
        for name in ("dead_letter_max_bytes", "idle_consumer_ms"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0 (got {getattr(self, name)})")
        if not 0 <= self.slo_ttft_ms <= MAX_SLO_TTFT_MS:
            raise ConfigError(f"slo_ttft_ms: must be between 0 and {MAX_SLO_TTFT_MS:.0f} (got {self.slo_ttft_ms})")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level: must be one of {', '.join(LOG_LEVELS)} (got {self.log_level!r})")
        try:
            Keys(self.key_prefix)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        # The wire caps a request's hashes at max_prompt_token_ids / 16 (blockq.wire.protocol).
        if not PREFIX_BLOCK_TOKENS <= self.prefix_block_tokens <= MAX_PREFIX_BLOCK_TOKENS:
            raise ConfigError(f"prefix_block_tokens: must be between {PREFIX_BLOCK_TOKENS} and "
                              f"{MAX_PREFIX_BLOCK_TOKENS} (got {self.prefix_block_tokens})")
        self._validate_cells()
        if self.prefix_tokenizer:
            try:
                self.prefix_scheme.tokenizer_id  # noqa: B018  (reads the tokenizer's files now)
            except TokenizerUnavailable as exc:
                raise ConfigError(f"prefix_tokenizer: {exc}") from None

    def _validate_cells(self) -> None:
        if self.cell_load_interval_ms < 0:
            raise ConfigError(f"cell_load_interval_ms: must be >= 0 (got {self.cell_load_interval_ms})")
        try:
            self.front_options  # noqa: B018  (validates the stale bound and the choices)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for cell in self.cells:
            try:
                Keys(cell.prefix)
            except ValueError as exc:
                raise ConfigError(f"cells: {exc}") from None
            url = cell.redis_url or self.redis_url
            if url is not None:
                try:
                    validate_redis_url(url, cell.prefix)
                except ConfigError as exc:
                    raise ConfigError(f"cells: cell {cell.prefix!r}: {exc}") from None

    @property
    def keys(self) -> Keys:
        return Keys(self.key_prefix)

    @property
    def front_options(self) -> FrontOptions:
        return FrontOptions(stale_after_s=self.cell_stale_after_ms / 1000, num_choices=self.cell_choices)

    def for_cell(self, cell: CellSpec) -> Settings:
        """These settings for one cell: its key prefix and Redis, no cells of its own."""
        return dataclasses.replace(self, key_prefix=cell.prefix, redis_url=cell.redis_url or self.redis_url,
                                   cells=())

    @property
    def prefix_scheme(self) -> PrefixScheme:
        return _prefix_scheme(self.prefix_block_tokens, self.prefix_tokenizer or None)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> Settings:
        """Settings from ``BLOCKQ_*`` variables; explicit ``overrides`` that are not None win."""
        env = os.environ if env is None else env

        def read_int(name: str, default: int) -> int:
            raw = env.get(ENV_PREFIX + name)
            if raw is None or raw == "":
                return default
            try:
                return int(raw)
            except ValueError:
                raise ConfigError(f"{ENV_PREFIX}{name}: must be an integer (got {raw!r})") from None

        limits_default = ProtocolLimits()
        try:
            limits = ProtocolLimits(
                max_message_bytes=read_int("MAX_MESSAGE_BYTES", limits_default.max_message_bytes),
                max_prompt_chars=read_int("MAX_PROMPT_CHARS", limits_default.max_prompt_chars),
                max_prompt_token_ids=read_int("MAX_PROMPT_TOKEN_IDS", limits_default.max_prompt_token_ids),
                max_max_tokens=read_int("MAX_MAX_TOKENS", limits_default.max_max_tokens),
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        values: dict[str, object] = {
            "redis_url": env.get(ENV_PREFIX + "REDIS_URL") or None,
            "key_prefix": env.get(ENV_PREFIX + "KEY_PREFIX") or DEFAULT_PREFIX,
            "max_ingress_backlog": read_int("MAX_BACKLOG", cls.max_ingress_backlog),
            "reply_ttl_s": read_int("REPLY_TTL_S", cls.reply_ttl_s),
            "reply_read_ttl_s": read_int("REPLY_READ_TTL_S", cls.reply_read_ttl_s),
            "claim_idle_ms": read_int("CLAIM_IDLE_MS", cls.claim_idle_ms),
            "max_deliveries": read_int("MAX_DELIVERIES", cls.max_deliveries),
            "heartbeat_interval_ms": read_int("HEARTBEAT_MS", cls.heartbeat_interval_ms),
            "submit_check_ms": read_int("SUBMIT_CHECK_MS", cls.submit_check_ms),
            "dead_letter_max_bytes": read_int("DEAD_LETTER_MAX_BYTES", cls.dead_letter_max_bytes),
            "idle_consumer_ms": read_int("IDLE_CONSUMER_MS", cls.idle_consumer_ms),
            "slo_ttft_ms": read_int("SLO_TTFT_MS", cls.slo_ttft_ms),
            "state_dir": Path(env.get(ENV_PREFIX + "STATE_DIR") or ".blockq"),
            "log_level": (env.get(ENV_PREFIX + "LOG_LEVEL") or "info").lower(),
            "limits": limits,
            "prefix_tokenizer": env.get(ENV_PREFIX + "PREFIX_TOKENIZER") or None,
            "prefix_block_tokens": read_int("PREFIX_BLOCK_TOKENS", cls.prefix_block_tokens),
            "cells": _read_cells(env.get(ENV_PREFIX + "CELLS") or ""),
            "cell_load_interval_ms": read_int("CELL_LOAD_MS", cls.cell_load_interval_ms),
            "cell_stale_after_ms": read_int("CELL_STALE_MS", cls.cell_stale_after_ms),
            "cell_choices": read_int("CELL_CHOICES", cls.cell_choices),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


def _read_cells(text: str) -> tuple[CellSpec, ...]:
    try:
        return parse_cells(text)
    except ValueError as exc:
        raise ConfigError(f"{ENV_PREFIX}CELLS: {exc}") from None


# Every scaler the project has; the dispatcher leader runs the ones that need only the
# fleet's own signals (``static`` holds a given size and ``scheduled`` follows a timetable:
# the simulation compares them with the others).
SCALERS = ("static", "reactive", "predictive", "scheduled")
LIVE_SCALERS = ("predictive", "reactive")
MAX_FLEET_INSTANCES = 1024


@dataclass(frozen=True)
class ScalingRules:
    """The bounds, step and cooldowns every scaler's wish passes through
    (:mod:`dispatcher.autoscale.rules`), for the leader and the simulation alike; validated
    on construction (ConfigError naming the field). At least one instance: every scaler
    reads a live one (its engine, its load)."""

    min_instances: int = 1
    max_instances: int = 16
    max_step_fraction: float = 0.2
    cooldown_s: float = 300.0
    reversal_hold_s: float = 600.0

    def __post_init__(self) -> None:
        if isinstance(self.min_instances, bool) or not isinstance(self.min_instances, int) or self.min_instances < 1:
            raise ConfigError(f"min_instances: must be an integer >= 1 (got {self.min_instances!r})")
        if (isinstance(self.max_instances, bool) or not isinstance(self.max_instances, int)
                or not self.min_instances <= self.max_instances <= MAX_FLEET_INSTANCES):
            raise ConfigError(f"max_instances: must be between min_instances and {MAX_FLEET_INSTANCES} "
                              f"(got {self.max_instances!r})")
        if not 0 < self.max_step_fraction <= 1:
            raise ConfigError(f"max_step_fraction: must be in (0, 1] (got {self.max_step_fraction})")
        if self.cooldown_s < 0:
            raise ConfigError(f"cooldown_s: must be >= 0 (got {self.cooldown_s})")
        if self.reversal_hold_s < self.cooldown_s:
            raise ConfigError(f"reversal_hold_s: must be >= cooldown_s (got {self.reversal_hold_s})")

    def max_step(self, current: int) -> int:
        """The most instances one action may add or remove from a fleet of ``current``."""
        return max(1, math.floor(self.max_step_fraction * current))


# The autoscaler's bounds, step and timings as command-line options, one list for every
# command that takes them (the dispatcher, `blockq up`, `blockq simulate autoscale`): each
# sets the AutoscaleOptions (ScalingRules) field of its name.
SCALING_OPTIONS: tuple[tuple[str, type, str], ...] = (
    ("--min-instances", int, "fleet lower bound"),
    ("--max-instances", int, "fleet upper bound"),
    ("--startup-s", float, "seconds a new instance takes to serve after it is asked for"),
    ("--cycle-s", float, "seconds between decisions"),
    ("--cooldown-s", float, "seconds between two actions in the same direction"),
    ("--reversal-hold-s", float, "seconds before an action in the other direction (>= --cooldown-s)"),
    ("--max-step-fraction", float, "most of the fleet one action adds or removes (at least one instance)"),
)


def add_scaling_options(group: Any, *, dest_prefix: str = "", with_defaults: bool = True) -> None:
    """Add :data:`SCALING_OPTIONS` to an argparse group: with :class:`AutoscaleOptions`'
    defaults, or None (to tell an option given from one left out)."""
    defaults = AutoscaleOptions()
    for option, kind, text in SCALING_OPTIONS:
        name = option[2:].replace("-", "_")
        default = getattr(defaults, name) if with_defaults else None
        group.add_argument(option, dest=dest_prefix + name, type=kind, default=default,
                           help=f"{text} (default {getattr(defaults, name):g})")


@dataclass(frozen=True)
class AutoscaleOptions(ScalingRules):
    """How the dispatcher leader sizes the fleet (``--autoscale``): the scaler, its
    :class:`ScalingRules` and what only the live leader needs; every ``*_s`` is wall
    seconds. ``startup_s``: how long a new instance takes to serve, ``cycle_s``: between
    decisions. ``scale_command``: a shell command run when the target changes, ``{n}``
    replaced by the target size. The autoscaler's metrics are served with the
    dispatcher's (:class:`MetricsEndpoint`)."""

    scaler: str = "predictive"
    startup_s: float = 90.0
    cycle_s: float = 60.0
    scale_command: str | None = None
    scale_command_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scaler not in LIVE_SCALERS:
            raise ConfigError(f"autoscale: must be one of {', '.join(LIVE_SCALERS)} (got {self.scaler!r})")
        if self.startup_s < 0:
            raise ConfigError(f"startup_s: must be >= 0 (got {self.startup_s})")
        if self.cycle_s <= 0:
            raise ConfigError(f"cycle_s: must be > 0 (got {self.cycle_s})")
        if self.scale_command is not None and not self.scale_command.strip():
            raise ConfigError("scale_command: must not be empty")
        if self.scale_command_timeout_s <= 0:
            raise ConfigError(f"scale_command_timeout_s: must be > 0 (got {self.scale_command_timeout_s})")

    @property
    def rules(self) -> ScalingRules:
        """The scaling rules alone, as the autoscaler takes them."""
        return ScalingRules(**{f.name: getattr(self, f.name) for f in fields(ScalingRules)})


METRICS_PORT_ENV = ENV_PREFIX + "METRICS_PORT"
METRICS_OFF = "off"


@dataclass(frozen=True)
class MetricsEndpoint:
    """Where a service serves Prometheus ``GET /metrics``: ``port`` 0 is any free port
    (the server reports the one it bound), ``host`` the address bound (``0.0.0.0`` in a pod)."""

    port: int
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"metrics_port: must be a TCP port in 0-65535 (got {self.port!r})")
        if not self.host or any(c.isspace() for c in self.host):
            raise ConfigError(f"metrics_host: must be a host name or address (got {self.host!r})")


def metrics_endpoint(port: str | None, host: str = "127.0.0.1",
                     env: Mapping[str, str] | None = None) -> MetricsEndpoint | None:
    """The endpoint a ``--metrics-port`` value names (None: not given, then
    ``BLOCKQ_METRICS_PORT``); None when metrics are off (neither set, or ``off``).
    ConfigError names ``metrics_port`` or ``metrics_host``."""
    env = os.environ if env is None else env
    raw = port if port is not None else env.get(METRICS_PORT_ENV) or None
    if raw is None or raw.strip().lower() == METRICS_OFF:
        return None
    try:
        number = int(raw)
    except ValueError:
        raise ConfigError(f"metrics_port: must be a TCP port or '{METRICS_OFF}' (got {raw!r})") from None
    return MetricsEndpoint(number, host)


def add_refine_arguments(parser: argparse.ArgumentParser, *, defaults: bool = True) -> None:
    """``--refine-model`` and ``--refine-every-tokens``, as ``blockq up``, ``bench`` and
    ``simulate`` take them (``defaults`` False: None unless given, for overrides)."""
    parser.add_argument("--refine-model", default=None,
                        help="a refinement model directory (blockq predictor refine-train): running requests "
                             "report their remaining length refined from their partial output")
    parser.add_argument("--refine-every-tokens", type=int, default=DEFAULT_REFINE_EVERY_TOKENS if defaults else None,
                        help=f"refine each running request every this many generated tokens "
                             f"(default {DEFAULT_REFINE_EVERY_TOKENS})")
