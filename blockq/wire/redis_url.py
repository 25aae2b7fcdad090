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

Secrets: the userinfo password and the options ``password``, ``sentinel_password`` and
``ssl_password`` (any option whose name holds ``pass``, ``secret`` or ``token``).
:func:`redact_url` masks them all; :func:`parse_redis_url` refuses any that is the
placeholder ``CHANGE-ME`` of deploy/kubernetes/secret.yaml, so that no service starts on it.
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
# An option whose name holds one of these is a secret (password, sentinel_password,
# ssl_password, ...): masked by redact_url, checked against the placeholder.
SECRET_OPTION_MARKERS = ("pass", "secret", "token")
# The credential deploy/kubernetes/secret.yaml ships with: a deployment still holding it
# was applied without its secrets being set, and must not start (compared case-insensitively).
PLACEHOLDER_SECRET = "CHANGE-ME"
REDACTED = "***"

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
    """Parse ``url`` (any form above); raises :class:`RedisUrlError`, also when a password
    (userinfo or option, the Sentinels' included) is the placeholder ``CHANGE-ME``."""
    target = _parse(url)
    _refuse_placeholder(target)
    return target


def _parse(url: str) -> RedisTarget:
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
    """redis-py reads the URL itself (at connect); the credentials and options are parsed
    here only so that they can be checked (:func:`_refuse_placeholder`)."""
    parsed = urlparse(url)
    if scheme != "unix" and not parsed.hostname:
        raise RedisUrlError(f"missing host in {redact_url(url)!r}")
    userinfo, at, _ = parsed.netloc.rpartition("@")
    username, password = _credentials(userinfo) if at else (None, None)
    options, _ = _options(parsed.query, url)
    return RedisTarget("server", url, tls=scheme == "rediss", username=username, password=password,
                       options=options)


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


def is_secret_option(name: str) -> bool:
    """Whether the URL option ``name`` (percent-encoded or not) holds a secret."""
    name = unquote(name).lower()
    return any(marker in name for marker in SECRET_OPTION_MARKERS)


def _refuse_placeholder(target: RedisTarget) -> None:
    """Raise when a secret of ``target`` is the placeholder (message: the field, never a
    real secret)."""
    secrets = [("password", target.password)]
    secrets += [(unquote(name).lower(), value) for name, value in target.options + target.sentinel_options
                if is_secret_option(name)]
    for field_name, value in secrets:
        if value is not None and value.strip().upper() == PLACEHOLDER_SECRET:
            raise RedisUrlError(
                f"{field_name}: is the placeholder {PLACEHOLDER_SECRET!r} of deploy/kubernetes/secret.yaml: "
                "set a real secret (deploy/kubernetes/README.md)")


def redact_url(url: str) -> str:
    """``url`` with every secret replaced by ``***``: the userinfo password (the user name
    stays) and every secret option (:func:`is_secret_option`), in any form above, for error
    messages, logs and ``blockq status``. Also masks what a malformed URL would leak: a
    password holding an unencoded ``/``, ``#`` or ``?``, and a URL without a scheme."""
    scheme, separator, rest = url.partition("://")
    prefix = f"{scheme}://" if separator else ""
    rest = rest if separator else url
    at = _userinfo_end(rest)
    credentials = ""
    if at >= 0:
        user, colon, _ = rest[:at].partition(":")
        credentials = f"{user}{':' + REDACTED if colon else ''}@"
        rest = rest[at + 1:]
    main, question, query = rest.partition("?")
    return f"{prefix}{credentials}{main}{question}{_redact_query(query)}"


def _userinfo_end(rest: str) -> int:
    """Index of the ``@`` that ends the userinfo in ``rest`` (the URL after ``://``), -1
    for none: the last ``@`` before the query, or, where an unencoded ``?`` in a password
    made the query start early, the last ``@`` in a query item's name (option names never
    hold one, so that ``@`` is the userinfo's)."""
    main, question, query = rest.partition("?")
    at = main.rfind("@")
    if question:
        offset = len(main) + 1
        for item in query.split("&"):
            name = item.partition("=")[0]
            if "@" in name:
                at = offset + name.rindex("@")
            offset += len(item) + 1
    return at


def _redact_query(query: str) -> str:
    """``query`` with the value of every secret option masked, the rest kept as written."""
    if not query:
        return query
    items = []
    for item in query.split("&"):
        name, equals, _ = item.partition("=")
        items.append(f"{name}={REDACTED}" if equals and is_secret_option(name) else item)
    return "&".join(items)
