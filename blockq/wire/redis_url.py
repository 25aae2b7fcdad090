"""The forms ``BLOCKQ_REDIS_URL`` takes, parsed without connecting (and without redis-py,
so that configuration is checked before anything is imported or dialled).

- One server, redis-py's own forms: ``redis://[[user]:password@]host[:port][/db][?options]``,
  ``rediss://`` (TLS), ``unix://[[user]:password@]/path[?db=N]``.
- Sentinel: ``redis+sentinel://[[user]:password@]host[:port][,host2[:port2]...]/service_name[/db][?options]``
  (``rediss+sentinel://``: TLS to the Sentinels and the data nodes). The hosts are the
  Sentinels (default port 26379); ``service_name`` is the monitored primary's name; the
  user and password are the data nodes'. The Sentinels' own credentials, when they have
  any, are the ``sentinel_username`` / ``sentinel_password`` options. The grammar of the
  ``Redis-Sentinel-Url`` package and of Prefect's ``redis+sentinel://`` URLs.
- Cluster: ``redis+cluster://[[user]:password@]host[:port][,host2[:port2]...][?options]``
  (``rediss+cluster://``): any reachable nodes of a Redis Cluster (default port 6379),
  from which the client learns the rest; database 0 only, as Redis Cluster has no other.

``options`` are redis-py's URL options (``socket_timeout=2``, ``ssl_cert_reqs=none``, ...).
A password with ``@``, ``:``, ``/``, ``,`` or ``%`` in it is percent-encoded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlparse

SERVER_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SCHEMES = SERVER_SCHEMES + SENTINEL_SCHEMES + CLUSTER_SCHEMES
DEFAULT_SENTINEL_PORT = 26379
DEFAULT_SERVER_PORT = 6379
# Options that configure the connections to the Sentinels, not to the data nodes.
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")

Address = tuple[str, int]


class RedisUrlError(ValueError):
    """The URL is not one of the forms above; the message says what is wrong (never the
    password)."""


@dataclass(frozen=True)
class RedisTarget:
    """A parsed URL. ``kind``: ``server``, ``sentinel`` or ``cluster``; ``nodes``: the
    Sentinels' or the cluster's addresses (empty for a server); ``options``: redis-py URL
    options for the data-node connections; ``sentinel_options``: for the Sentinels."""

    kind: str
    url: str = field(repr=False)
    tls: bool = False
    nodes: tuple[Address, ...] = ()
    service_name: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    options: tuple[tuple[str, str], ...] = ()
    sentinel_options: tuple[tuple[str, str], ...] = ()

    @property
    def is_cluster(self) -> bool:
        return self.kind == "cluster"

    def node_url(self, address: Address | None = None) -> str:
        """A one-server URL (``redis://`` or ``rediss://``) with this target's credentials,
        database and options, for ``address`` (default: the first node): what redis-py's
        own URL parser reads the data-node connection options from."""
        if self.kind == "server":
            return self.url
        host, port = address or self.nodes[0]
        credentials = ""
        if self.username is not None or self.password is not None:
            credentials = f"{quote(self.username or '', safe='')}:{quote(self.password or '', safe='')}@"
        host_part = f"[{host}]" if ":" in host else host
        query = f"?{urlencode(self.options)}" if self.options else ""
        return f"{'rediss' if self.tls else 'redis'}://{credentials}{host_part}:{port}/{self.db}{query}"


def parse_redis_url(url: str) -> RedisTarget:
    """Parse ``url`` (any form above); raises :class:`RedisUrlError`."""
    scheme, separator, rest = url.partition("://")
    scheme = scheme.lower()
    if not separator or scheme not in SCHEMES:
        raise RedisUrlError(f"scheme must be one of {', '.join(s + '://' for s in SCHEMES)} (got {redact_url(url)!r})")
    if scheme in SERVER_SCHEMES:
        return _parse_server(url, scheme)
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username, password = _credentials(userinfo) if at else (None, None)
    is_sentinel = scheme in SENTINEL_SCHEMES
    nodes = _addresses(hosts, DEFAULT_SENTINEL_PORT if is_sentinel else DEFAULT_SERVER_PORT, url)
    options, sentinel_options = _options(query, url)
    parts = [unquote(p) for p in path.split("/") if p]
    if is_sentinel:
        if not parts or len(parts) > 2:
            raise RedisUrlError(f"a Sentinel URL names the service: .../service_name[/db] (got {redact_url(url)!r})")
        return RedisTarget("sentinel", url, scheme.startswith("rediss"), nodes, parts[0], _db(parts[1:], url),
                           username, password, options, sentinel_options)
    if sentinel_options:
        raise RedisUrlError(f"{', '.join(k for k, _ in sentinel_options)}: only for Sentinel URLs")
    if _db(parts, url) != 0:
        raise RedisUrlError(f"Redis Cluster has database 0 only (got {redact_url(url)!r})")
    return RedisTarget("cluster", url, scheme.startswith("rediss"), nodes, None, 0, username, password, options)


def _parse_server(url: str, scheme: str) -> RedisTarget:
    if scheme != "unix" and not urlparse(url).hostname:
        raise RedisUrlError(f"missing host in {redact_url(url)!r}")
    return RedisTarget("server", url, tls=scheme == "rediss")


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    user, colon, password = userinfo.partition(":")
    if not colon:  # redis-py's reading of "redis://name@host": a user, no password
        return unquote(user) or None, None
    return unquote(user) or None, unquote(password)


def _addresses(hosts: str, default_port: int, url: str) -> tuple[Address, ...]:
    addresses = []
    for item in hosts.split(","):
        item = item.strip()
        if item.startswith("["):  # [IPv6]:port
            host, _, port_part = item[1:].partition("]")
            port_text = port_part.removeprefix(":")
        else:
            host, _, port_text = item.partition(":")
        if not host:
            raise RedisUrlError(f"missing host in {redact_url(url)!r}")
        try:
            port = int(port_text) if port_text else default_port
        except ValueError:
            raise RedisUrlError(f"port must be a number (got {port_text!r} in {redact_url(url)!r})") from None
        if not 0 < port < 65536:
            raise RedisUrlError(f"port out of range: {port}")
        addresses.append((host, port))
    return tuple(addresses)


def _options(query: str, url: str) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise RedisUrlError(f"malformed options in {redact_url(url)!r}") from None
    return (tuple((k, v) for k, v in pairs if k not in SENTINEL_OPTIONS),
            tuple((k, v) for k, v in pairs if k in SENTINEL_OPTIONS))


def _db(parts: list[str], url: str) -> int:
    if not parts:
        return 0
    if len(parts) > 1 or not parts[0].isdigit():
        raise RedisUrlError(f"database must be a number (got {'/'.join(parts)!r} in {redact_url(url)!r})")
    return int(parts[0])


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for error messages and logs)."""
    scheme, separator, rest = url.partition("://")
    userinfo, at, tail = rest.rpartition("@")
    if not separator or not at or "/" in userinfo:
        return url
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}://{user}{':***' if colon else ''}@{tail}"
