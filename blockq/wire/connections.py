"""Building Redis clients for every form of URL blockq accepts (one server, Sentinel,
Redis Cluster): the one place clients are built (:func:`connect`, :func:`connect_async`,
:func:`connect_pinned`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel

from blockq.wire.redis_url import RedisTarget, parse_redis_url


def connect(url: str, **kwargs: Any) -> redis.Redis:
    """A synchronous client for ``url``, in any form of :mod:`blockq.wire.redis_url`: a plain
    client for one server; for Sentinel, one that asks the Sentinels for the primary at
    each (re)connect and drops its connections when the primary changes (``master_for``);
    for a cluster, a ``RedisCluster`` (typed ``redis.Redis`` here: blockq uses the commands
    both have). ``kwargs``: client options (``socket_timeout``, ``max_connections`` (per
    node on a cluster), ...), over those of the URL. The one place clients are built."""
    target = parse_redis_url(url)
    if target.kind == "server":
        return redis.Redis.from_url(url, **kwargs)
    options = {**_node_options(target), **kwargs}
    if target.kind == "sentinel":
        sentinel = redis.sentinel.Sentinel(list(target.nodes), sentinel_kwargs=_sentinel_options(target, options))
        return sentinel.master_for(target.service_name or "", **options)
    return redis.RedisCluster(startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in target.nodes],
                              **options)  # type: ignore[return-value]


def connect_async(url: str, *, wait_for_connection: bool = False, **kwargs: Any) -> aioredis.Redis:
    """The asyncio twin of :func:`connect`. ``wait_for_connection``: a call that finds
    ``max_connections`` in use waits for one to be free instead of failing (one server
    and Sentinel; a cluster client has no such pool, and fails past ``max_connections``
    connections to one node)."""
    target = parse_redis_url(url)
    if target.kind == "server":
        if wait_for_connection:
            return aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(url, timeout=None,
                                                                                           **kwargs))
        return aioredis.Redis.from_url(url, **kwargs)
    options = {**_node_options(target), **kwargs}
    if target.kind == "sentinel":
        sentinel = aioredis.sentinel.Sentinel(list(target.nodes), sentinel_kwargs=_sentinel_options(target, options))
        pool_class = _BlockingSentinelPool if wait_for_connection else aioredis.sentinel.SentinelConnectionPool
        extra = {"timeout": None} if wait_for_connection else {}
        return sentinel.master_for(target.service_name or "", connection_pool_class=pool_class, **options, **extra)
    return aioredis.RedisCluster(startup_nodes=[aioredis.cluster.ClusterNode(h, p) for h, p in target.nodes],
                                 **options)  # type: ignore[return-value]


def connect_pinned(url: str, key: str, **kwargs: Any) -> redis.Redis:
    """A synchronous plain client (its own connection pool, real MULTI/EXEC) whose
    connections go to the primary serving ``key``'s slot, for libraries that cannot use a
    cluster client (rq: it reads its client's pool and runs transactions over its own
    keys). Every key it touches must hash to that slot (share ``key``'s hash tag). Each new
    connection asks the cluster where the slot is; a ``MOVED``, ``ASK``, ``TRYAGAIN`` or
    ``CLUSTERDOWN`` reply (a failover or a resharding moved it) drops the connection as a
    ConnectionError, so the library's reconnect finds the slot's new primary. One server
    or Sentinel: :func:`connect` (its keys are all on the one primary anyway)."""
    target = parse_redis_url(url)
    if not target.is_cluster:
        return connect(url, **kwargs)
    options = {**_node_options(target), **kwargs}
    locator = connect(url, **{k: v for k, v in options.items() if k != "max_connections"})
    slot = locator.keyslot(key)  # type: ignore[attr-defined]

    def locate_primary() -> tuple[str, int]:
        locator.nodes_manager.initialize()  # type: ignore[attr-defined]  # the slot map as it is now
        node = locator.nodes_manager.get_node_from_slot(slot)  # type: ignore[attr-defined]
        return node.host, node.port

    connection_class = _SlotPrimarySSLConnection if options.pop("ssl", False) else _SlotPrimaryConnection
    pool = redis.ConnectionPool(connection_class=connection_class, locate_primary=locate_primary, **options)
    return redis.Redis(connection_pool=pool)


def _node_options(target: RedisTarget) -> dict[str, Any]:
    """The data-node connection options of a Sentinel or cluster URL, parsed by redis-py
    (types, TLS options) from the equivalent one-server URL; TLS as ``ssl=True``, which
    the Sentinel and cluster clients turn into their own connection classes."""
    options = dict(redis.connection.parse_url(target.node_url()))
    for name in ("host", "port", "connection_class"):
        options.pop(name, None)
    if target.tls:
        options["ssl"] = True
    if target.is_cluster:
        options.pop("db", None)
    return options


def _sentinel_options(target: RedisTarget, options: dict[str, Any]) -> dict[str, Any]:
    """How to reach the Sentinels: the data nodes' socket and TLS options, and the
    Sentinels' own credentials (none unless the URL's ``sentinel_*`` options give them)."""
    shared = {k: v for k, v in options.items() if k.startswith(("socket_", "ssl"))}
    own = {name.removeprefix("sentinel_"): value for name, value in target.sentinel_options}
    return {**shared, **own}


class _BlockingSentinelPool(aioredis.sentinel.SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Sentinel's pool (connections to the current primary) with the blocking pool's
    wait for a free connection past ``max_connections``."""


class _SlotPrimaryConnection(redis.Connection):
    """A connection to whichever primary serves one slot (see :func:`connect_pinned`)."""

    def __init__(self, *, locate_primary: Callable[[], tuple[str, int]], **kwargs: Any) -> None:
        self._locate_primary = locate_primary
        super().__init__(**kwargs)

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if not self._sock:
            self.host, self.port = self._locate_primary()
        super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except (redis.exceptions.AskError, redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError) as exc:
            self.disconnect()
            raise redis.ConnectionError(f"the slot moved: {exc}") from exc


class _SlotPrimarySSLConnection(_SlotPrimaryConnection, redis.SSLConnection):
    """:class:`_SlotPrimaryConnection` over TLS."""
