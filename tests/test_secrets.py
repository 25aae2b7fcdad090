"""Secrets at the edges of blockq's processes: ``blockq status`` never prints a Redis
password (userinfo or option form, Sentinel's included), and every service refuses at
start-up the placeholder credential that deploy/kubernetes/secret.yaml ships with, naming
the field, before it dials Redis. The manifests' secret rules (read with the helpers of
tests/test_deploy_manifests.py): every shipped secret is a placeholder blockq and the Redis
pods refuse, data nodes and Sentinels require passwords kept off argv, the predictor's
HTTP API requires the Secret's token; and the Sentinel configuration of
redis-sentinel.yaml, run for real, is reached through blockq's ``connect`` with the URL's
``sentinel_password``."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
import redis.sentinel

from blockq.cli.main import build_parser
from blockq.config import ConfigError, Settings
from blockq.local.embedded_redis import (
    EmbeddedRedis,
    find_redis_server,
    free_port,
    start_embedded_redis,
)
from blockq.local.status import collect_status
from blockq.wire.redis_url import PLACEHOLDER_SECRET
from blockq.wire.streams import connect
from predictor_service.http_api import TOKEN_ENV
from predictor_service.serve import http_access_from_args
from tests.conftest import run_blockq, wait_until
from tests.test_deploy_manifests import (
    REAL_SECRETS,
    SECRET_NAME,
    _blockq_containers,
    _container_env,
    _containers,
    _expanded_args,
    _named,
    _secret_data,
    _source_data,
)

SENTINEL_URL = ("redis+sentinel://admin:data-secret@s1:26379,s2:26379,s3:26379/blockq/0"
                "?sentinel_password=sentinel-secret&socket_timeout=2")


def test_status_redacts_the_userinfo_and_the_sentinel_password(sync_redis: redis.Redis) -> None:
    status = collect_status(sync_redis, Settings(redis_url=SENTINEL_URL))
    assert "data-secret" not in status["redis_url"] and "sentinel-secret" not in status["redis_url"]
    assert status["redis_url"] == ("redis+sentinel://admin:***@s1:26379,s2:26379,s3:26379/blockq/0"
                                   "?sentinel_password=***&socket_timeout=2")


def test_blockq_status_does_not_print_a_password_option(redis_url: str, redis_server: EmbeddedRedis) -> None:
    """The password as a URL option (redis-py reads ``?password=``) reaches Redis and is
    masked in what ``blockq status`` prints."""
    url = f"redis://127.0.0.1:{redis_server.port}/0?password={redis_server.password}"
    result = run_blockq("status", "--redis", url, timeout_s=60)
    assert result.returncode == 0, result.stderr
    assert redis_server.password not in result.stdout + result.stderr
    assert f"redis://127.0.0.1:{redis_server.port}/0?password=*** " in result.stdout


PLACEHOLDER_URLS = {
    "password": "redis+sentinel://:CHANGE-ME@blockq-redis-0.blockq-redis:26379/blockq/0",
    "sentinel_password": "redis+sentinel://:a-real-secret@blockq-redis-0.blockq-redis:26379/blockq/0"
                         "?sentinel_password=change-me",
}


@pytest.mark.parametrize(("command", "field"), [
    (["dispatcher"], "password"), (["predictor", "serve"], "sentinel_password"),
    (["gateway"], "sentinel_password"), (["status"], "password")])  # each start-up costs seconds
def test_services_refuse_the_placeholder_credential_at_start_up(command: list[str], field: str) -> None:
    result = run_blockq(*command, env={"BLOCKQ_REDIS_URL": PLACEHOLDER_URLS[field]}, timeout_s=60)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert f"configuration error: redis_url: {field}: " in result.stderr
    assert "set a real secret" in result.stderr


def test_predictor_refuses_the_placeholder_http_token(redis_url: str) -> None:
    result = run_blockq("predictor", "serve", "--http-port", "0", "--redis", redis_url,
                        env={"BLOCKQ_PREDICTOR_HTTP_TOKEN": "CHANGE-ME"}, timeout_s=60)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "BLOCKQ_PREDICTOR_HTTP_TOKEN" in result.stderr and "set a real secret" in result.stderr
    assert "CHANGE-ME" in result.stderr  # the placeholder is named; a real token never is


# --- secrets -----------------------------------------------------------------------------------

def test_every_shipped_secret_is_a_placeholder_that_blockq_refuses() -> None:
    shipped = _secret_data(_named("Secret")[SECRET_NAME])
    assert all(PLACEHOLDER_SECRET in value for value in shipped.values()), shipped
    assert set(REAL_SECRETS) | {"redis-url"} == set(shipped)
    for workload, container in _blockq_containers():
        env = _container_env(workload, container, filled=False)
        with pytest.raises(ConfigError, match="placeholder"):
            Settings.from_env(env)
        if TOKEN_ENV in env:  # and the predictor's token, once the URL is set
            args = build_parser().parse_args(_expanded_args(workload, container))
            with pytest.raises(ConfigError, match=f"{TOKEN_ENV}: .*placeholder"):
                http_access_from_args(args, env)


def test_redis_and_the_sentinels_require_passwords_kept_off_argv() -> None:
    scripts = _source_data("configMap", "blockq-redis-scripts")
    assert 'echo "requirepass ${REDIS_PASSWORD}"' in scripts["redis.sh"]
    assert 'echo "masterauth ${REDIS_PASSWORD}"' in scripts["redis.sh"]
    assert 'echo "requirepass ${REDIS_SENTINEL_PASSWORD}"' in scripts["sentinel.sh"]
    assert 'echo "sentinel auth-pass ${SENTINEL_SERVICE} ${REDIS_PASSWORD}"' in scripts["sentinel.sh"]
    assert 'REDISCLI_AUTH="$REDIS_SENTINEL_PASSWORD" redis-cli' in scripts["find-primary.sh"]
    assert all(" -a " not in text and "--pass" not in text for text in scripts.values())
    redis_pods = _named("StatefulSet")["blockq-redis"]
    keys = {c["name"]: {v["name"]: v["valueFrom"]["secretKeyRef"]["key"] for v in c["env"]
                        if "secretKeyRef" in v.get("valueFrom", {})} for c in _containers(redis_pods)}
    expected = {"REDIS_PASSWORD": "redis-password", "REDIS_SENTINEL_PASSWORD": "redis-sentinel-password"}
    assert keys["redis"] == {**expected, "REDISCLI_AUTH": "redis-password"}
    assert keys["sentinel"] == {**expected, "REDISCLI_AUTH": "redis-sentinel-password"}  # its probes


@pytest.mark.parametrize(("password", "sentinel_password", "refused"), [
    ("CHANGE-ME", "s-real", True), ("real", "change-me", True), ("real", "s-real", False)])
def test_redis_pods_refuse_the_placeholder_too(password: str, sentinel_password: str, refused: bool) -> None:
    if shutil.which("sh") is None:
        pytest.skip("no sh to run the script")
    script = _source_data("configMap", "blockq-redis-scripts")["check-secrets.sh"]
    result = subprocess.run(["sh", "-c", f"set -eu\n{script}\necho started"], capture_output=True, text=True,
                            timeout=10, env={"REDIS_PASSWORD": password, "REDIS_SENTINEL_PASSWORD": sentinel_password,
                                             "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert (result.returncode != 0) == refused and ("started" in result.stdout) != refused
    assert ("placeholder" in result.stderr) == refused


def test_the_predictor_http_api_requires_the_token_of_the_secret() -> None:
    statefulset = _named("StatefulSet")["blockq-predictor"]
    (container,) = _containers(statefulset)
    env = _container_env(statefulset, container)
    args = build_parser().parse_args(_expanded_args(statefulset, container))
    assert args.http_host == "0.0.0.0" and not args.http_allow_unauthenticated
    access = http_access_from_args(args, env)
    assert access is not None and access.bearer_token == REAL_SECRETS["predictor-http-token"]
    with pytest.raises(ConfigError, match="--http-host"):  # without the token it would not start
        http_access_from_args(args, {k: v for k, v in env.items() if k != TOKEN_ENV})


def _sentinel_config(port: int, data_port: int, data_password: str, sentinel_password: str) -> str:
    """sentinel.sh's configuration lines (redis-sentinel.yaml), its variables filled for one
    Sentinel on loopback watching the data node on ``data_port``."""
    script = _source_data("configMap", "blockq-redis-scripts")["sentinel.sh"]
    env = {"REDIS_SENTINEL_PASSWORD": sentinel_password, "REDIS_PASSWORD": data_password, "SELF": "127.0.0.1",
           "PRIMARY": "127.0.0.1", "SENTINEL_SERVICE": "blockq"}
    lines = [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], line)
             for line in re.findall(r'^\s*echo "(.*)"', script, flags=re.MULTILINE)]
    lines = [f"port {port}" if line == "port 26379" else line.replace(" 6379 2", f" {data_port} 1")
             for line in lines]
    assert f"requirepass {sentinel_password}" in lines and f"sentinel monitor blockq 127.0.0.1 {data_port} 1" in lines
    return "\n".join(["bind 127.0.0.1", *lines]) + "\n"


@pytest.fixture
def sentinel_with_auth(tmp_path: Path) -> Iterator[tuple[EmbeddedRedis, int, str]]:
    """A data node and one Sentinel configured as redis-sentinel.yaml configures them:
    ``(data node, Sentinel port, Sentinel password)``."""
    data = start_embedded_redis(tmp_path / "data")
    sentinel_password, port = "sentinel-pw-for-test", free_port()
    config = tmp_path / "sentinel.conf"  # the Sentinel rewrites it: a file of its own
    config.write_text(_sentinel_config(port, data.port, data.password, sentinel_password))
    process = subprocess.Popen([find_redis_server(), str(config), "--sentinel"], cwd=tmp_path,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        probe = redis.Redis(host="127.0.0.1", port=port, password=sentinel_password, socket_timeout=1)
        wait_until(lambda: _answers(probe), timeout_s=15)
        probe.close()
        yield data, port, sentinel_password
    finally:
        process.terminate()
        process.wait(timeout=10)
        data.stop()


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.sentinel_get_master_addr_by_name("blockq"))
    except redis.ConnectionError:
        return False


def test_the_manifests_sentinel_auth_works_through_blockqs_url(
        sentinel_with_auth: tuple[EmbeddedRedis, int, str]) -> None:
    data, port, sentinel_password = sentinel_with_auth
    base = f"redis+sentinel://:{quote(data.password, safe='')}@127.0.0.1:{port}/blockq/0"
    client = connect(f"{base}?sentinel_password={quote(sentinel_password, safe='')}", socket_timeout=5)
    try:
        assert client.set("through-sentinel", "1") and client.get("through-sentinel") == b"1"
    finally:
        client.close()
    anonymous = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)
    with pytest.raises(redis.AuthenticationError):  # the Sentinel refuses who does not AUTH
        anonymous.sentinel_get_master_addr_by_name("blockq")
    anonymous.close()
    without = connect(base, socket_timeout=2)
    with pytest.raises(redis.sentinel.MasterNotFoundError):
        without.ping()
    without.close()
