"""Redis topologies for tests, from the redis-server binary the test session already uses
(:func:`blockq.local.embedded_redis.find_redis_server`; no network installs): a Redis Cluster
of N primaries, and a Sentinel group (one primary, one replica, three Sentinels).

Every data node is an embedded Redis (:func:`start_embedded_redis`: AOF, password,
maxmemory) with the topology's lines added, and all of one topology share one password.
The Sentinels listen on loopback without a password of their own. Each ``start_*`` stops
whatever it started if it fails; ``stop()`` is always safe to call.
"""

from __future__ import annotations

import random
import secrets
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import redis

from blockq.local.embedded_redis import (
    PASSWORD_FILE,
    EmbeddedRedis,
    find_redis_server,
    start_embedded_redis,
    stop_process,
)
from blockq.local.state import write_private_text

NUM_SLOTS = 16384
# Redis 6.2 puts a node's cluster bus on its port + 10000 (``cluster-port`` is 7.0+).
CLUSTER_BUS_OFFSET = 10000
SENTINEL_SERVICE = "blockq"
T = TypeVar("T")


def _can_bind(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port(rng: random.Random | None = None) -> int:
    """A port free on 127.0.0.1 whose cluster bus port (+10000) is free too."""
    rng = rng or random.Random()
    for _ in range(200):
        port = rng.randint(20_000, 55_000)
        if _can_bind(port) and _can_bind(port + CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _start_node(data_dir: Path, password: str, extra_config: list[str], port: int | None = None) -> EmbeddedRedis:
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_private_text(data_dir / PASSWORD_FILE, password + "\n")
    # Replicas and a demoted primary authenticate to their primary with the shared password.
    return start_embedded_redis(data_dir, port=port, extra_config=[f"masterauth {password}", *extra_config])


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """Poll ``predicate`` until truthy (returned); RuntimeError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
        except (redis.RedisError, OSError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s} s")
        time.sleep(interval_s)


# --- Redis Cluster ---------------------------------------------------------------------------

@dataclass
class RedisClusterTopology:
    """A running Redis Cluster of primaries only (slots split evenly, in port order)."""

    nodes: list[EmbeddedRedis]
    password: str = field(repr=False)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)
        return f"redis+cluster://:{self.password}@{hosts}"

    def node_client(self, node: EmbeddedRedis) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=node.port, password=self.password)

    def flush(self) -> None:
        for node in self.nodes:
            with self.node_client(node) as client:
                client.flushall()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def start_redis_cluster(base_dir: Path, num_primaries: int = 3, timeout_s: float = 30.0) -> RedisClusterTopology:
    """Start ``num_primaries`` cluster-enabled servers, give each an equal range of slots
    (CLUSTER ADDSLOTS: 6.2 has no ADDSLOTSRANGE), join them (CLUSTER MEET) and wait until
    every node sees the whole cluster in state ``ok``."""
    password = secrets.token_urlsafe(24)
    topology = RedisClusterTopology([], password)
    config = ["cluster-enabled yes", "cluster-config-file nodes.conf", "cluster-node-timeout 2000",
              "cluster-require-full-coverage yes"]
    try:
        for i in range(num_primaries):
            topology.nodes.append(_start_node(base_dir / f"node-{i}", password, config, port=free_cluster_port()))
        bounds = [NUM_SLOTS * i // num_primaries for i in range(num_primaries + 1)]
        clients = [topology.node_client(node) for node in topology.nodes]
        for client, start, end in zip(clients, bounds, bounds[1:], strict=False):
            client.execute_command("CLUSTER", "ADDSLOTS", *range(start, end))
        for node in topology.nodes[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)

        def is_whole() -> bool:
            infos = [client.execute_command("CLUSTER", "INFO").decode() for client in clients]
            return all("cluster_state:ok" in info and f"cluster_known_nodes:{num_primaries}" in info
                       and f"cluster_slots_ok:{NUM_SLOTS}" in info for info in infos)

        wait_for(is_whole, timeout_s, "cluster state ok on every node")
        for client in clients:
            client.close()
    except BaseException:
        topology.stop()
        raise
    return topology


# --- Sentinel -------------------------------------------------------------------------------

@dataclass
class SentinelProcess:
    process: subprocess.Popen[bytes]
    port: int
    data_dir: Path

    def stop(self, timeout_s: float = 5.0) -> None:
        stop_process(self.process, timeout_s)


@dataclass
class SentinelTopology:
    """One primary, its replicas, and Sentinels monitoring them as :data:`SENTINEL_SERVICE`."""

    primary: EmbeddedRedis
    replicas: list[EmbeddedRedis]
    sentinels: list[SentinelProcess]
    password: str = field(repr=False)
    service_name: str = SENTINEL_SERVICE

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://:{self.password}@{hosts}/{self.service_name}/0"

    @property
    def servers(self) -> list[EmbeddedRedis]:
        return [self.primary, *self.replicas]

    def primary_port(self) -> int | None:
        """The primary's port as the first Sentinel that answers names it (None: none answers)."""
        for sentinel in self.sentinels:
            try:
                with redis.Redis(host="127.0.0.1", port=sentinel.port, socket_timeout=0.5) as client:
                    address = client.sentinel_get_master_addr_by_name(self.service_name)
            except (redis.RedisError, OSError):
                continue
            if address:
                return int(address[1])
        return None

    def stop(self) -> None:
        for sentinel in self.sentinels:
            sentinel.stop()
        for server in self.servers:
            server.stop()


def _start_sentinel(data_dir: Path, primary_port: int, password: str, down_after_ms: int) -> SentinelProcess:
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    port = free_cluster_port()
    lines = [
        f"port {port}", "bind 127.0.0.1", f'dir "{data_dir.resolve()}"', 'logfile "sentinel.log"',
        f"sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {primary_port} 2",
        f"sentinel auth-pass {SENTINEL_SERVICE} {password}",
        f"sentinel down-after-milliseconds {SENTINEL_SERVICE} {down_after_ms}",
        f"sentinel failover-timeout {SENTINEL_SERVICE} 10000",
        f"sentinel parallel-syncs {SENTINEL_SERVICE} 1",
    ]
    # A Sentinel rewrites its configuration file (what it learns), so it gets its own.
    config_path = data_dir / "sentinel.conf"
    write_private_text(config_path, "\n".join(lines) + "\n")
    process = subprocess.Popen([find_redis_server(), str(config_path.resolve()), "--sentinel"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    sentinel = SentinelProcess(process, port, data_dir)

    def answers() -> bool:
        with redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5) as client:
            return bool(client.ping())

    try:
        wait_for(answers, 10.0, f"sentinel on {port}")
    except BaseException:
        sentinel.stop()
        raise
    return sentinel


def start_sentinel_group(base_dir: Path, num_replicas: int = 1, num_sentinels: int = 3,
                         down_after_ms: int = 1000, timeout_s: float = 30.0) -> SentinelTopology:
    """A primary, ``num_replicas`` replicas in sync with it, and ``num_sentinels`` Sentinels
    (quorum 2) that all know the replicas and each other; returns once that holds."""
    password = secrets.token_urlsafe(24)
    primary = _start_node(base_dir / "primary", password, [])
    topology = SentinelTopology(primary, [], [], password)
    try:
        for i in range(num_replicas):
            topology.replicas.append(_start_node(base_dir / f"replica-{i}", password,
                                                 [f"replicaof 127.0.0.1 {primary.port}"]))
        with redis.Redis(host="127.0.0.1", port=primary.port, password=password) as client:
            wait_for(lambda: client.info("replication").get("connected_slaves") == num_replicas
                     and all(client.info("replication")[f"slave{i}"]["state"] == "online"
                             for i in range(num_replicas)), timeout_s, "replicas online")
        for i in range(num_sentinels):
            topology.sentinels.append(_start_sentinel(base_dir / f"sentinel-{i}", primary.port, password,
                                                      down_after_ms))

        def sentinels_agree() -> bool:
            for sentinel in topology.sentinels:
                with redis.Redis(host="127.0.0.1", port=sentinel.port, socket_timeout=0.5) as client:
                    state = client.sentinel_master(SENTINEL_SERVICE)
                if int(state["num-slaves"]) < num_replicas or int(state["num-other-sentinels"]) < num_sentinels - 1:
                    return False
            return True

        wait_for(sentinels_agree, timeout_s, "sentinels know the replicas and each other", interval_s=0.2)
    except BaseException:
        topology.stop()
        raise
    return topology
