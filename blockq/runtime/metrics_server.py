"""Serving a Prometheus registry: the one implementation every blockq service uses.

Each service object builds its own ``CollectorRegistry`` (so that tests can run several
in one process) and hands it here:

- :func:`serve_metrics` serves ``GET /metrics`` on a port of its own (worker,
  dispatcher, predictor serve); :func:`serving_metrics` does so for the duration of a
  ``async with`` block, and a port it cannot bind stops the service at start-up
  (:class:`MetricsPortUnavailable`, naming the port and who holds it): the port is where
  Prometheus scrapes this service, so running on without it would hand the scrapes to
  whoever holds it (a leaked process of an earlier cluster) without anyone noticing
  (docs/commands.md, "A metrics port that is taken");
- :func:`metrics_response` answers ``GET /metrics`` inside an application that has an
  HTTP port anyway (the gateway, the predictor's HTTP API);
- :func:`add_metrics_arguments` and :func:`metrics_endpoint_from_args`: the
  ``--metrics-port`` / ``--metrics-host`` options, ``BLOCKQ_METRICS_PORT`` as default.

The server is an aiohttp application in the service's own event loop, not
prometheus_client's threaded server: the collectors read the service's live state
(counters, queues, deques), which the loop alone mutates, so a scrape never sees it
half-updated. The format follows the scraper's ``Accept`` header (Prometheus text, or
OpenMetrics when asked for), as prometheus_client's own server does.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
from collections.abc import AsyncIterator

import psutil
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from blockq.config import METRICS_OFF, METRICS_PORT_ENV, MetricsEndpoint, metrics_endpoint
from blockq.local.state import CLUSTER_ENV

log = structlog.get_logger(__name__)

METRICS_PATH = "/metrics"


def render_text(registry: CollectorRegistry) -> str:
    """Every metric of ``registry`` in the Prometheus text format."""
    encoder, _ = choose_encoder("text/plain")
    return encoder(registry).decode()


def metrics_response(registry: CollectorRegistry, request: web.Request) -> web.Response:
    """The answer to ``GET /metrics`` for ``registry``, in the format ``request`` accepts."""
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    return web.Response(body=encoder(registry), headers={"Content-Type": content_type,
                                                         "X-Content-Type-Options": "nosniff"})


class MetricsPortUnavailable(SystemExit):
    """The metrics port cannot be bound. A SystemExit: the service exits non-zero with
    this one line (its supervisor restarts it; ``blockq up`` reports it)."""


def describe_port_holder(port: int) -> str:
    """Who listens on TCP ``port`` ("pid N (command line), of the blockq cluster in DIR"),
    as far as this user may see; empty when unknown."""
    try:
        holders = sorted({c.pid for c in psutil.net_connections(kind="tcp")
                          if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid})
    except psutil.Error:
        return ""
    described = []
    for pid in holders:
        try:
            process = psutil.Process(pid)
            command = " ".join(process.cmdline())[:160]
            cluster = process.environ().get(CLUSTER_ENV)
        except psutil.Error:
            continue
        # Naming the cluster points at the state directory whose `blockq down` frees the port.
        described.append(f"pid {pid} ({command})" + (f", of the blockq cluster in {cluster}" if cluster else ""))
    return "; ".join(described)


class MetricsServer:
    """``GET /metrics`` of one registry on ``host:port`` (see :func:`serve_metrics`)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        self._runner = runner
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{METRICS_PATH}"

    async def close(self) -> None:
        await self._runner.cleanup()


async def serve_metrics(registry: CollectorRegistry, endpoint: MetricsEndpoint) -> MetricsServer:
    """Serve ``registry`` at ``http://endpoint.host:endpoint.port/metrics`` in the running
    loop until :meth:`MetricsServer.close`; port 0 binds a free one (``server.port``
    says which). Raises OSError when the address cannot be bound."""

    async def handle(request: web.Request) -> web.Response:
        return metrics_response(registry, request)

    app = web.Application()
    app.router.add_get(METRICS_PATH, handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, endpoint.host, endpoint.port, reuse_address=True)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    # The bound port: the one asked for, or the free one chosen for port 0.
    port = int(runner.addresses[0][1]) if runner.addresses else endpoint.port
    return MetricsServer(runner, endpoint.host, port)


@contextlib.asynccontextmanager
async def serving_metrics(registry: CollectorRegistry, endpoint: MetricsEndpoint | None,
                          component: str) -> AsyncIterator[MetricsServer | None]:
    """Serve ``registry`` while the block runs; yields the server, or None when
    ``endpoint`` is None (metrics off). An address that cannot be bound is logged
    (``metrics_port_unavailable``) and raises :class:`MetricsPortUnavailable` before the
    block runs."""
    server = None
    if endpoint is not None:
        try:
            server = await serve_metrics(registry, endpoint)
        except OSError as exc:
            holder = describe_port_holder(endpoint.port) if exc.errno == errno.EADDRINUSE else ""
            log.error("metrics_port_unavailable", component=component, host=endpoint.host, port=endpoint.port,
                      error=str(exc), holder=holder or None)
            problem = ("is taken" + (f" by {holder}" if holder else "") if exc.errno == errno.EADDRINUSE
                       else f"cannot be bound ({exc})")
            raise MetricsPortUnavailable(
                f"{component}: metrics port {endpoint.port} on {endpoint.host} {problem}; stop that process or "
                f"choose another port (--metrics-port, or `blockq up --metrics-base-port`)") from exc
        log.info("metrics_serving", component=component, url=server.url)
    try:
        yield server
    finally:
        if server is not None:
            await server.close()


def add_metrics_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--metrics-port`` and ``--metrics-host`` (read back by :func:`metrics_endpoint_from_args`)."""
    parser.add_argument("--metrics-port", default=None,
                        help=f"serve Prometheus metrics at http://HOST:PORT{METRICS_PATH} (0: any free port, "
                             f"'{METRICS_OFF}': none; default env {METRICS_PORT_ENV}, else none)")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="address the metrics server binds (0.0.0.0 in a pod)")


def metrics_endpoint_from_args(args: argparse.Namespace) -> MetricsEndpoint | None:
    """The validated endpoint (ConfigError naming the field), None when metrics are off."""
    return metrics_endpoint(args.metrics_port, args.metrics_host)
