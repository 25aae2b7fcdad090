"""Running an asyncio service until SIGTERM/SIGINT, and resolving the Redis URL."""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

from blockq.config import ConfigError, Settings
from blockq.local.state import ClusterState
from blockq.runtime.logs import configure_logging


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """--redis, --prefix, --state-dir, --log-level: accepted by every command."""
    parser.add_argument("--redis", dest="redis_url", default=None,
                        help="Redis URL: redis://, rediss://, unix://, redis+sentinel://, redis+cluster:// "
                             "(user:password@ allowed; forms in deploy/README.md); env BLOCKQ_REDIS_URL")
    parser.add_argument("--prefix", dest="key_prefix", default=None, help="key prefix (default bq:)")
    parser.add_argument("--state-dir", default=None, type=Path,
                        help="state directory of a local cluster (default .blockq); env BLOCKQ_STATE_DIR")
    parser.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"])


def settings_from_args(args: argparse.Namespace, *, require_redis: bool = True) -> Settings:
    """Settings from env vars overridden by flags; the Redis URL falls back to the one a
    running ``blockq up`` recorded in the state directory."""
    settings = Settings.from_env(redis_url=args.redis_url, key_prefix=args.key_prefix,
                                 state_dir=args.state_dir, log_level=args.log_level)
    if settings.redis_url is None:
        state = ClusterState.read(settings.state_dir)
        if state is not None:
            settings = Settings.from_env(redis_url=state.redis_url, key_prefix=args.key_prefix,
                                         state_dir=args.state_dir, log_level=args.log_level)
    if require_redis and settings.redis_url is None:
        raise ConfigError("redis_url: not set: pass --redis URL, set BLOCKQ_REDIS_URL, or start a "
                          "local cluster with `blockq up`")
    return settings


def run_service(settings: Settings, component: str,
                main: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run ``main(stop)`` until it returns; SIGTERM/SIGINT set ``stop``."""
    configure_logging(settings.log_level, component)

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await main(stop)

    asyncio.run(runner())
    return 0
