"""Serving a Prometheus registry: the one implementation every blockq service uses.

Each service object builds its own ``CollectorRegistry`` (so that tests can run several
in one process) and hands it here:

- :func:`serve_metrics` serves ``GET /metrics`` on a port of its own (worker,
  dispatcher, predictor serve); :func:`serving_metrics` does so for the duration of a
  ``async with`` block and logs, rather than raises, when the port cannot be bound: a
  taken metrics port must not stop a dispatcher or a worker from serving requests;
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
from collections.abc import AsyncIterator

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from blockq.config import METRICS_OFF, METRICS_PORT_ENV, MetricsEndpoint, metrics_endpoint

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
    """Serve ``registry`` while the block runs (nothing when ``endpoint`` is None). An
    address that cannot be bound is logged (``metrics_server_failed``) and the block runs
    without metrics; yields the server, or None."""
    server = None
    if endpoint is not None:
        try:
            server = await serve_metrics(registry, endpoint)
            log.info("metrics_serving", component=component, url=server.url)
        except OSError as exc:
            log.error("metrics_server_failed", component=component, host=endpoint.host, port=endpoint.port,
                      error=str(exc))
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
