"""Every service's Prometheus endpoint, scraped over HTTP from real components: predictor
(``serve_predictor``: HTTP API and metrics port), dispatcher (block policy), two emulated
instances in one worker registry, and the gateway, all in one event loop on the test
Redis. Load goes through the client library and the gateway; the scrapes before and after
are parsed with prometheus_client's parser. Plus: a worker process given its port by
``BLOCKQ_METRICS_PORT``, port validation, the ports and URLs ``blockq up`` hands out and
``blockq status --json`` lists, and the Grafana dashboard's queries against the names
the services expose."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from blockq import AsyncClient, SubmitSpec
from blockq.config import ConfigError, MetricsEndpoint, Settings, metrics_endpoint
from blockq.frontdoors.gateway.config import GatewayConfig
from blockq.frontdoors.gateway.server import create_app as create_gateway_app
from blockq.local.cluster_config import ClusterConfig
from blockq.local.embedded_redis import EmbeddedRedis
from blockq.local.state import ClusterState
from blockq.runtime.metrics_server import serve_metrics
from blockq.text.tokenizer import get_token_counter
from blockq.wire.streams import connect_async
from dispatcher.service import create_dispatcher
from predictor_service.models import load_predictor
from predictor_service.serve import add_serve_arguments, serve_predictor
from tests.conftest import REPO_ROOT, wait_until
from workers.engines.emulated import EmulatedEngine, EmulatedEngineOptions
from workers.metrics import WorkerMetrics
from workers.worker import InstanceWorker, WorkerOptions

PREFIX = "bqmetrics:"
NUM_CLIENT_REQUESTS = 24
NUM_GATEWAY_REQUESTS = 4
INSTANCES = ("m-0", "m-1")

SERVICE_NAMES = {
    "dispatcher": {
        "blockq_dispatcher_decisions_total", "blockq_dispatcher_decision_seconds_bucket",
        "blockq_dispatcher_held_requests", "blockq_dispatcher_leader",
        "blockq_dispatcher_ttft_forecast_error_seconds_bucket", "blockq_dispatcher_e2e_forecast_error_seconds_bucket",
        "blockq_dispatcher_replica_rebuilds_total", "blockq_dispatcher_beats_rejected_total",
        "blockq_dispatcher_dead_letters"},
    "workers": {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total", "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
        "vllm:generation_tokens_total", "vllm:prompt_tokens_total", "blockq_worker_kv_blocks_used",
        "blockq_worker_kv_blocks_total", "blockq_worker_emulator_lag_seconds", "blockq_worker_delivery_seconds",
        "blockq_worker_requests_total"},
    "predictor": {
        "blockq_predictor_model_info", "blockq_predictor_predictions_total", "blockq_predictor_batch_size_bucket",
        "blockq_predictor_dead_letters_total", "blockq_predictor_rolling_mae_tokens",
        "blockq_predictor_feedback_records_total"},
    "gateway": {
        "blockq_gateway_requests_total", "blockq_gateway_request_duration_seconds_bucket",
        "blockq_gateway_in_flight_requests", "blockq_gateway_completion_tokens_total"},
}


# --- parsing -------------------------------------------------------------------------------


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(sample name, labels) -> value of one scrape."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(text: str, name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(value for (sample, sample_labels), value in samples(text).items()
               if sample == name and wanted <= sample_labels)


def exposed_names(texts: Iterable[str]) -> set[str]:
    """Every sample name the scrapes can carry: each family's own, and those its type
    implies (a labelled metric with no child yet has no samples)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
    names: set[str] = set()
    for text in texts:
        for family in text_string_to_metric_families(text):
            names.add(family.name)
            names.update(family.name + suffix for suffix in suffixes.get(family.type, ()))
            names.update(s.name for s in family.samples)
    return names


# --- the pipeline ----------------------------------------------------------------------------


@dataclass
class Scrapes:
    before: dict[str, str]
    after: dict[str, str]
    answered: int


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def scrape(session: aiohttp.ClientSession, urls: dict[str, str]) -> dict[str, str]:
    texts = {}
    for name, url in urls.items():
        async with session.get(url) as response:
            assert response.status == 200, (name, response.status)
            texts[name] = await response.text()
    return texts


async def wait_for(predicate: Any, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def predictor_args(http_port: int, metrics_port: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(["--http-port", str(http_port), "--metrics-port", str(metrics_port),
                              "--batch-size", "16", "--consumer-name", "predict-metrics"])


async def run_pipeline(settings: Settings) -> Scrapes:
    client = connect_async(settings.redis_url)
    stop = asyncio.Event()
    http_port, predictor_port = free_port(), free_port()
    tasks = [asyncio.create_task(serve_predictor(stop, client, settings, load_predictor("heuristic"),
                                                 get_token_counter(), predictor_args(http_port, predictor_port)))]
    dispatcher = create_dispatcher(client, settings, "block", dispatcher_id="d-metrics", seed=1)
    worker_metrics = WorkerMetrics()
    workers = [InstanceWorker(client, settings, instance_id,
                              EmulatedEngine(EmulatedEngineOptions(time_scale=0.1, noise_sigma=0.0, seed=i)),
                              WorkerOptions(stream_interval_ms=0), worker_metrics)
               for i, instance_id in enumerate(INSTANCES)]
    servers = [await serve_metrics(dispatcher.metrics.registry, MetricsEndpoint(0)),
               await serve_metrics(worker_metrics.registry, MetricsEndpoint(0))]
    gateway = TestServer(create_gateway_app(GatewayConfig(), settings))
    await gateway.start_server()
    tasks += [asyncio.create_task(dispatcher.run(stop))] + [asyncio.create_task(w.run(stop)) for w in workers]
    urls = {"dispatcher": servers[0].url, "workers": servers[1].url, "gateway": str(gateway.make_url("/metrics")),
            "predictor": f"http://127.0.0.1:{predictor_port}/metrics",
            "predictor_http": f"http://127.0.0.1:{http_port}/metrics"}
    try:
        await wait_for(lambda: len(dispatcher.view.live_instances()) == len(INSTANCES))
        async with aiohttp.ClientSession() as session:
            await wait_for_predictor(session, urls["predictor_http"])
            before = await scrape(session, urls)
            answered = await put_load(session, settings, str(gateway.make_url("/v1/completions")))
            await wait_for(lambda: dispatcher.done_follower.num_read >= answered)
            await asyncio.sleep(3 * settings.heartbeat_interval_ms / 1000)  # beats after the load
            after = await scrape(session, urls)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=15)
        for server in servers:
            await server.close()
        await gateway.close()
        await client.aclose()
    return Scrapes(before, after, answered)


async def wait_for_predictor(session: aiohttp.ClientSession, url: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            async with session.get(url) as response:
                if response.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        assert time.monotonic() < deadline, "predictor did not start"
        await asyncio.sleep(0.05)


async def put_load(session: aiohttp.ClientSession, settings: Settings, completions_url: str) -> int:
    """Requests through the client library and the gateway; returns how many were answered ok."""
    async with AsyncClient(settings=settings) as client:
        handles = await client.submit_many([SubmitSpec(prompt=f"request {i} " * (1 + i % 5), max_tokens=4 + i % 9)
                                            for i in range(NUM_CLIENT_REQUESTS)])
        finals = await asyncio.gather(*(handle.result(timeout_s=30) for handle in handles))
    statuses = [final.status for final in finals]
    for i in range(NUM_GATEWAY_REQUESTS):
        async with session.post(completions_url, json={"model": "blockq", "prompt": f"hello {i}",
                                                       "max_tokens": 5}) as response:
            statuses.append("ok" if response.status == 200 else str(response.status))
    assert statuses == ["ok"] * len(statuses)
    return len(statuses)


@pytest.fixture(scope="module")
def scrapes(redis_server: EmbeddedRedis) -> Scrapes:
    settings = Settings(redis_url=redis_server.url, key_prefix=PREFIX, heartbeat_interval_ms=50, claim_idle_ms=1000)
    return asyncio.run(asyncio.wait_for(run_pipeline(settings), timeout=60))


# --- what the scrapes show -------------------------------------------------------------------


def test_every_service_exposes_its_metrics(scrapes: Scrapes) -> None:
    for service, names in SERVICE_NAMES.items():
        missing = names - exposed_names([scrapes.after[service]])
        assert not missing, f"{service} lacks {sorted(missing)}"
    # The HTTP API's /metrics and the metrics port serve the one registry.
    assert exposed_names([scrapes.after["predictor_http"]]) == exposed_names([scrapes.after["predictor"]])


def test_values_move_under_load(scrapes: Scrapes) -> None:
    before, after, answered = scrapes.before, scrapes.after, scrapes.answered
    placed = 'blockq_dispatcher_decisions_total'
    grown = total(after["dispatcher"], placed, outcome="placed") - total(before["dispatcher"], placed, outcome="placed")
    assert grown == answered and total(after["dispatcher"], placed, outcome="placed", policy="block") == grown
    assert total(after["dispatcher"], "blockq_dispatcher_decision_seconds_count") == answered
    assert total(after["dispatcher"], "blockq_dispatcher_leader") == 1
    assert total(after["dispatcher"], "blockq_dispatcher_held_requests") == 0
    assert total(after["dispatcher"], "blockq_dispatcher_replica_rebuilds_total") >= len(INSTANCES)
    # Every answered request carried the block policy's forecast into its done record.
    for histogram in ("ttft", "e2e"):
        name = f"blockq_dispatcher_{histogram}_forecast_error_seconds_count"
        assert total(after["dispatcher"], name) == answered
        assert {dict(labels)["instance_id"] for (sample, labels) in samples(after["dispatcher"])
                if sample == name} <= set(INSTANCES)

    workers = after["workers"]
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert total(workers, name) == answered, name
        assert total(before["workers"], name) == 0
    assert total(workers, "blockq_worker_requests_total", outcome="ok") == answered
    assert total(workers, "vllm:time_to_first_token_seconds_bucket", le="+Inf") == answered
    assert total(workers, "vllm:generation_tokens_total") > answered  # several tokens each
    assert total(workers, "blockq_worker_delivery_seconds") > 0  # placed requests took time to arrive
    for instance_id in INSTANCES:
        assert total(workers, "blockq_worker_kv_blocks_total", instance_id=instance_id) > 0
        assert total(workers, "vllm:num_requests_running", instance_id=instance_id) == 0  # idle again
        assert 0 <= total(workers, "vllm:kv_cache_usage_perc", instance_id=instance_id) <= 1

    assert total(after["predictor"], "blockq_predictor_predictions_total", source="stage") == answered
    assert total(after["gateway"], "blockq_gateway_requests_total", code="200",
                 endpoint="/v1/completions") == NUM_GATEWAY_REQUESTS
    assert total(after["gateway"], "blockq_gateway_in_flight_requests") == 0


# --- a worker process with its port from the environment -------------------------------------


def test_worker_process_serves_metrics_on_the_env_port(settings: Settings, tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "BLOCKQ_METRICS_PORT": str(port), "BLOCKQ_REDIS_URL": settings.redis_url or "",
           "BLOCKQ_HEARTBEAT_MS": "50"}
    with open(tmp_path / "worker.log", "wb") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "workers", "--instance-id", "env", "--instances", "2"],
                                   cwd=REPO_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        def scraped() -> str | None:
            import urllib.request

            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
                    text = reply.read().decode()
            except OSError:
                return None
            # Both instances' gauges exist from the start at 0; a beat sets them. Wait for
            # both instances and env-0's first beat, not only for the labels to appear.
            ready = 'instance_id="env-1"' in text and total(text, "blockq_worker_kv_blocks_total", instance_id="env-0")
            return text if ready else None

        try:
            text = str(wait_until(scraped, timeout_s=60, interval_s=0.1))
        except AssertionError as exc:  # say why: the worker's own log
            raise AssertionError(f"{exc}; worker log:\n{(tmp_path / 'worker.log').read_text()[-3000:]}") from exc
        assert total(text, "blockq_worker_kv_blocks_total", instance_id="env-0") > 0
        assert total(text, "vllm:num_requests_waiting", instance_id="env-1") == 0
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def test_a_taken_metrics_port_stops_the_service_naming_the_port() -> None:
    """A service that cannot bind its metrics port exits at start-up, naming the port and
    who holds it: running on without metrics hid a leaked dispatcher that was answering
    the scrapes in its place."""
    import structlog

    from blockq.runtime.metrics_server import MetricsPortUnavailable, serving_metrics

    registry = WorkerMetrics().registry
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        with structlog.testing.capture_logs() as logs, pytest.raises(MetricsPortUnavailable) as raised:
            async with serving_metrics(registry, MetricsEndpoint(port), "worker"):
                pytest.fail("the block ran without its metrics port")
    assert isinstance(raised.value, SystemExit) and raised.value.code != 0
    assert f"worker: metrics port {port} on 127.0.0.1 is taken" in str(raised.value)
    assert f"pid {os.getpid()}" in str(raised.value)  # this process holds it
    assert [entry["port"] for entry in logs if entry["event"] == "metrics_port_unavailable"] == [port]
    async with serving_metrics(registry, MetricsEndpoint(0), "worker") as server:
        assert server is not None and server.port > 0


def test_a_service_exits_non_zero_on_a_taken_metrics_port(settings: Settings) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        process = subprocess.run([sys.executable, "-m", "dispatcher", "--metrics-port", str(port)],
                                 env={**os.environ, "BLOCKQ_REDIS_URL": settings.redis_url or ""},
                                 capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert process.returncode != 0
    assert f"dispatcher: metrics port {port} on 127.0.0.1 is taken" in process.stderr, process.stderr


# --- ports: validation, `blockq up`, `blockq status` ---------------------------------------


def test_ports_are_validated_naming_the_field() -> None:
    assert metrics_endpoint(None, env={}) is None
    assert metrics_endpoint("off", env={"BLOCKQ_METRICS_PORT": "9500"}) is None
    assert metrics_endpoint(None, "0.0.0.0", env={"BLOCKQ_METRICS_PORT": "9500"}) == MetricsEndpoint(9500, "0.0.0.0")
    assert metrics_endpoint("9600", env={"BLOCKQ_METRICS_PORT": "9500"}) == MetricsEndpoint(9600)
    for raw in ("70000", "-1", "lots"):
        with pytest.raises(ConfigError, match="^metrics_port: "):
            metrics_endpoint(raw, env={})
    with pytest.raises(ConfigError, match="^metrics_port: "):
        metrics_endpoint(None, env={"BLOCKQ_METRICS_PORT": "x"})
    with pytest.raises(ConfigError, match="^metrics_host: "):
        metrics_endpoint("9400", "", env={})
    from dispatcher.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ConfigError, match="^metrics_port: "):
        from blockq.runtime.metrics_server import metrics_endpoint_from_args

        metrics_endpoint_from_args(parser.parse_args(["--metrics-port", "65536"]))
    with pytest.raises(ConfigError, match="^metrics_base_port: .* include gateway_port"):
        ClusterConfig(gateway=True, gateway_port=9401)
    with pytest.raises(ConfigError, match="^metrics_base_port: .* no room"):
        ClusterConfig(metrics_base_port=65534)
    with pytest.raises(ConfigError, match="^metrics_base_port: "):
        ClusterConfig(metrics_base_port=-5)


def test_up_assigns_a_port_per_process() -> None:
    config = ClusterConfig(instances=8, instances_per_process=4, gateway=True)
    ports = {name: argv[argv.index("--metrics-port") + 1] for name, argv in config.child_argvs()
             if "--metrics-port" in argv}
    assert ports == {"predictor": "9401", "dispatcher": "9400", "workers-0": "9402", "workers-1": "9403"}
    assert config.metrics_url("gateway") == "http://127.0.0.1:8000/metrics"
    assert config.metrics_url("batch-worker") is None
    off = ClusterConfig(metrics_base_port=0)
    # Off is said explicitly: an inherited BLOCKQ_METRICS_PORT must not give every child one port.
    assert {argv[argv.index("--metrics-port") + 1] for _, argv in off.child_argvs()} == {"off"}
    assert off.metrics_url("dispatcher") is None
    shipped = ClusterConfig.from_toml(REPO_ROOT / "deploy" / "cluster.toml").with_overrides(metrics_host="0.0.0.0")
    assert shipped.metrics_url("workers-1") == "http://127.0.0.1:9403/metrics"  # a wildcard bind, reached on loopback


def test_status_json_lists_metrics_urls(settings: Settings, tmp_path: Path, stdlib_logging: None,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from blockq.cli.main import main
    from blockq.local.supervisor import Supervisor
    from blockq.local.up import child_spec

    config = ClusterConfig(instances=2, gateway=True)
    specs = [child_spec(config, name, argv) for name, argv in config.child_argvs()]
    supervisor = Supervisor(tmp_path, specs, redis_url=settings.redis_url, num_instances=2)
    state = ClusterState(supervisor_pid=os.getpid(), redis_url=settings.redis_url or "")
    supervisor._update_state(state, force=True)
    assert main(["status", "--json", "--state-dir", str(tmp_path), "--redis", settings.redis_url or ""]) == 0
    assert json.loads(capsys.readouterr().out)["metrics_urls"] == {
        "dispatcher": "http://127.0.0.1:9400/metrics", "predictor": "http://127.0.0.1:9401/metrics",
        "workers-0": "http://127.0.0.1:9402/metrics", "gateway": "http://127.0.0.1:8000/metrics"}


# --- deploy/: the dashboard and the scrape config --------------------------------------------

METRIC_NAME = re.compile(r"(?<![A-Za-z0-9_:])((?:blockq_|vllm:)[A-Za-z0-9_:]+)")


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[str]:
    """Every PromQL expression of the dashboard: panel targets (rows' too) and variable queries."""
    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard["panels"]):
        yield from (target["expr"] for target in panel.get("targets", []))
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if variable["type"] == "query":
            yield query["query"] if isinstance(query, dict) else query


def unknown_metric_names(queries: Iterable[str], exposed: set[str]) -> set[str]:
    return {name for query in queries for name in METRIC_NAME.findall(query)} - exposed


async def test_dashboard_queries_use_only_exposed_names(scrapes: Scrapes, settings: Settings) -> None:
    from blockq.config import AutoscaleOptions
    from blockq.runtime.metrics_server import render_text

    dashboard = json.loads((REPO_ROOT / "deploy" / "grafana" / "blockq.json").read_text())
    queries = list(dashboard_queries(dashboard))
    assert len(queries) >= 20
    assert any(v["type"] == "datasource" and v["query"] == "prometheus" for v in dashboard["templating"]["list"])
    # The autoscaler's metrics are on the registry of a dispatcher that autoscales.
    client = connect_async(settings.redis_url)
    autoscaling = create_dispatcher(client, settings, "round_robin", dispatcher_id="d-auto",
                                    autoscale=AutoscaleOptions(scaler="reactive"))
    exposed = exposed_names([*scrapes.after.values(), render_text(autoscaling.metrics.registry)])
    await client.aclose()
    assert "blockq_autoscaler_desired_instances" in exposed
    assert unknown_metric_names(queries, exposed) == set()
    assert unknown_metric_names(["sum(rate(blockq_worker_request_total[1m]))"], exposed) == {
        "blockq_worker_request_total"}  # the check can fail
    # The SLO panel reads the 3 s bucket, which the TTFT histogram has.
    assert any('le="3.0"' in query for query in queries)
    assert total(scrapes.after["workers"], "vllm:time_to_first_token_seconds_bucket", le="3.0") > 0


def test_prometheus_config_scrapes_the_default_ports() -> None:
    config = yaml.safe_load((REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {job["job_name"]: [t for c in job["static_configs"] for t in c["targets"]]
               for job in config["scrape_configs"]}
    cluster = ClusterConfig.from_toml(REPO_ROOT / "deploy" / "cluster.toml")
    for name, _ in cluster.child_argvs():
        url = cluster.metrics_url(name)
        if url is None:
            continue
        host_port = url.removeprefix("http://").removesuffix("/metrics")
        job = "blockq-workers" if name.startswith("workers-") else f"blockq-{name}"
        assert host_port in targets[job], (name, host_port)
