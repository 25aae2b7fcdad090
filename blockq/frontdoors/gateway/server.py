"""The aiohttp application: OpenAI-compatible routes in front of the blockq pipeline.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``"stream": true`` for
server-sent events ending ``data: [DONE]``), ``GET /v1/models``, ``GET /healthz``,
``GET /metrics``. Errors use OpenAI's shape ``{"error": {"message", "type", "param",
"code"}}``: 400 invalid input (``param`` names the field), 401 missing or wrong API key,
403 a field the API key may not set (``param`` names it), 404 unknown model or route, 408
body not received within ``read_timeout_s``, 413 body too large, 429 overloaded, gateway or
key in-flight cap (``Retry-After``), 504 timeout, 500 anything else (logged with the
request id; no traceback is sent).

A generation call takes its in-flight slot (gateway and key caps) before its body is read,
and holds it until it ends; see :mod:`blockq.frontdoors.gateway.in_flight`.

Request headers: ``Authorization: Bearer KEY`` (when keys are configured; the key's
tenant is the request's tenant) and ``x-blockq-timeout-s`` (seconds, at most the server's
``request_timeout_s``). Response headers: ``x-request-id`` and, for non-streaming calls,
``x-blockq-instance``, ``x-blockq-predicted-output-tokens``, ``x-blockq-predicted-ttft-ms``,
``x-blockq-predicted-e2e-ms``, ``x-blockq-ttft-ms``, ``x-blockq-e2e-ms``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any

import structlog
from aiohttp import web

from blockq.client import AsyncClient, Overloaded
from blockq.config import Settings
from blockq.frontdoors.gateway.api_keys import (
    Caller,
    ForbiddenField,
    apply_key_policy,
    key_fingerprint,
)
from blockq.frontdoors.gateway.chat_template import load_chat_template
from blockq.frontdoors.gateway.config import GatewayConfig, is_loopback_host
from blockq.frontdoors.gateway.errors import GatewayError
from blockq.frontdoors.gateway.generation import GenerationCall
from blockq.frontdoors.gateway.in_flight import InFlightSlots, SlotLimit
from blockq.frontdoors.gateway.metrics import GatewayMetrics
from blockq.frontdoors.gateway.openai_requests import (
    GenerationPlan,
    check_json_depth,
    parse_chat_request,
    parse_completion_request,
)
from blockq.runtime.metrics_server import metrics_response
from blockq.wire.beats import decode_heartbeat
from blockq.wire.health import InstanceState
from blockq.wire.protocol import ValidationError
from blockq.wire.served_models import served_names

log = structlog.get_logger(__name__)

MODELS_REFRESH_S = 5.0
CLIENT_CLOSED_CODE = "499"  # nginx's code for "client closed the request"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Gateway:
    """The state behind the routes: config, client, metrics, served model names."""

    def __init__(self, config: GatewayConfig, settings: Settings, client: AsyncClient | None = None) -> None:
        self.config = config
        self.settings = settings
        self.client = client
        self.render_chat = load_chat_template(config.chat_template)
        self.defaults = replace(config.defaults, max_max_tokens=settings.limits.max_max_tokens)
        self.metrics = GatewayMetrics()
        self.background: set[asyncio.Task[Any]] = set()
        self.slots = InFlightSlots(config.max_in_flight)
        self.metrics.in_flight.set_function(lambda: self.slots.num_in_flight)
        # Resolved once: a request only looks its key up.
        max_backlog = settings.max_ingress_backlog
        self.key_to_caller = {key: Caller(tenant, key_fingerprint(key), config.policy_of(key, max_backlog))
                              for key, tenant in config.api_key_to_tenant.items()}
        self.open_caller = Caller("default", "", config.policy_of(None, max_backlog))
        self.started_at_s = int(time.time())
        self._instance_models: tuple[str, ...] = ()
        self._models_read_at_s = -math.inf
        self._models_reading: asyncio.Future[None] | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    async def on_startup(self, app: web.Application) -> None:
        if self.client is None:
            # Every streaming request holds a connection while it blocks on XREAD.
            self.client = AsyncClient(settings=self.settings, max_connections=self.config.max_in_flight + 32)

    async def on_cleanup(self, app: web.Application) -> None:
        if self.background:
            await asyncio.wait(list(self.background), timeout=5.0)
        if self.client is not None:
            await self.client.close()

    @property
    def num_in_flight(self) -> int:
        return self.slots.num_in_flight

    def require_client(self) -> AsyncClient:
        if self.client is None:
            raise RuntimeError("gateway used before its application started")
        return self.client

    # --- middleware --------------------------------------------------------------------------

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """OpenAI-shaped errors for every failure, and request metrics."""
        started_s = time.perf_counter()
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else "unmatched"
        code = "500"
        try:
            response = await handler(request)
            code = str(response.status)
            return response
        except asyncio.CancelledError:
            code = CLIENT_CLOSED_CODE
            raise
        except Exception as exc:
            response = self._error_response(request, exc)
            code = str(response.status)
            return response
        finally:
            self.metrics.requests.inc(endpoint=endpoint, code=code)
            self.metrics.duration.observe(time.perf_counter() - started_s, endpoint=endpoint)

    def _error_response(self, request: web.Request, exc: Exception) -> web.Response:
        if isinstance(exc, GatewayError):
            return exc.to_response()
        if isinstance(exc, ValidationError):
            return GatewayError(400, str(exc), "invalid_request_error", param=exc.field).to_response()
        if isinstance(exc, ForbiddenField):
            return GatewayError(403, str(exc), "permission_error", param=exc.field,
                                code="field_not_allowed").to_response()
        if isinstance(exc, Overloaded):
            retry_after_s = max(1, math.ceil(exc.retry_after_s))
            return GatewayError(429, "blockq is overloaded; retry later", "rate_limit_error", code="overloaded",
                                headers={"Retry-After": str(retry_after_s)}).to_response()
        if isinstance(exc, web.HTTPRequestEntityTooLarge):
            return GatewayError(413, f"request body larger than {self.config.max_body_bytes} bytes",
                                "invalid_request_error", param="body").to_response()
        if isinstance(exc, web.HTTPException):
            return GatewayError(exc.status, exc.reason, "invalid_request_error").to_response()
        log.exception("request_failed", path=request.path)
        return GatewayError(500, "internal server error", "server_error").to_response()

    # --- helpers -----------------------------------------------------------------------------

    def caller_of(self, request: web.Request) -> Caller:
        """The caller of the request's bearer token (tenant "default", every right, when no
        keys are configured); 401 without a known key."""
        if not self.config.auth_required:
            return self.open_caller
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise GatewayError(401, "missing API key: send 'Authorization: Bearer KEY'", "invalid_request_error",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        caller = None
        for key, key_caller in self.key_to_caller.items():
            if hmac.compare_digest(key.encode(), token.encode()):  # constant time per key
                caller = key_caller
        if caller is None:
            raise GatewayError(401, "incorrect API key", "invalid_request_error", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
        return caller

    @contextlib.contextmanager
    def in_flight_slot(self, caller: Caller) -> Iterator[None]:
        """Hold one in-flight slot for ``caller`` (429 when the gateway or its key is full).
        The message names the key's tenant and fingerprint and its limit, never the key."""
        key_max_in_flight = caller.policy.max_in_flight or self.config.max_in_flight
        refused = self.slots.take(caller.key_id, key_max_in_flight)
        if refused is SlotLimit.GATEWAY:
            raise GatewayError(429, f"more than {self.config.max_in_flight} requests in flight; retry later",
                               "rate_limit_error", code="too_many_requests", headers={"Retry-After": "1"})
        if refused is SlotLimit.KEY:
            raise GatewayError(429, f"the API key of tenant {caller.tenant!r} ({caller.key_id}) has "
                               f"{key_max_in_flight} requests in flight, its max_in_flight; retry later",
                               "rate_limit_error", param="max_in_flight", code="key_too_many_requests",
                               headers={"Retry-After": "1"})
        try:
            yield
        finally:
            self.slots.give_back(caller.key_id)

    @contextlib.contextmanager
    def requests_share(self, caller: Caller, num_requests: int) -> Iterator[None]:
        """Count a parsed call's ``num_requests`` against its key's share of the backlog while
        it runs: 429 when the key's open calls already carry too many, 400 when this call
        alone carries more than the whole share (it could never run)."""
        key_max_requests = caller.policy.max_requests_in_flight or self.settings.max_ingress_backlog
        where = f"the API key of tenant {caller.tenant!r} ({caller.key_id})"
        if num_requests > key_max_requests:
            raise GatewayError(400, f"this call asks for {num_requests} choices (prompts x n); {where} may have "
                               f"at most {key_max_requests} in flight, its max_requests_in_flight",
                               "invalid_request_error", param="n", code="key_too_many_requests")
        if self.slots.take_requests(caller.key_id, num_requests, key_max_requests) is not None:
            raise GatewayError(429, f"{where} has {self.slots.num_requests_of(caller.key_id)} requests in flight; "
                               f"{num_requests} more would pass its max_requests_in_flight ({key_max_requests}); "
                               "retry later", "rate_limit_error", param="max_requests_in_flight",
                               code="key_too_many_requests", headers={"Retry-After": "1"})
        try:
            yield
        finally:
            self.slots.give_back_requests(caller.key_id, num_requests)

    async def read_json(self, request: web.Request) -> Any:
        """The body as JSON: 413 past ``max_body_bytes``, 408 when it has not arrived whole
        within ``read_timeout_s`` (a trickling client holds its slot no longer than that)."""
        if request.content_length is not None and request.content_length > self.config.max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(self.config.max_body_bytes, request.content_length)
        try:
            async with asyncio.timeout(self.config.read_timeout_s):
                raw = await request.read()
        except TimeoutError:
            self.metrics.slow_clients.inc(phase="body_read")
            raise GatewayError(408, f"request body not received within {self.config.read_timeout_s:g} s "
                               "(read_timeout_s)", "invalid_request_error", param="body", code="request_timeout",
                               close_connection=True) from None
        return parse_json_body(raw, self.config.max_json_depth)

    def timeout_of(self, request: web.Request) -> float:
        raw = request.headers.get("x-blockq-timeout-s")
        if raw is None:
            return self.config.request_timeout_s
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not 0 < value <= self.config.request_timeout_s:
            raise ValidationError("x-blockq-timeout-s",
                                  f"must be a number of seconds in (0, {self.config.request_timeout_s:g}]")
        return value

    async def model_names(self, fresh_within_s: float = MODELS_REFRESH_S) -> tuple[str, ...]:
        """Configured names plus the models live instances report (read again when the
        last read is older than ``fresh_within_s``). Concurrent callers share one read:
        each waits for it rather than answering from the list it replaces."""
        if time.monotonic() - self._models_read_at_s > fresh_within_s and self.client is not None:
            if self._models_reading is None or self._models_reading.done():
                self._models_reading = asyncio.ensure_future(self._read_instance_models())
            await asyncio.shield(self._models_reading)
        names = list(self.config.model_names)
        names += [m for m in self._instance_models if m and m not in names]
        return tuple(names)

    async def _read_instance_models(self) -> None:
        assert self.client is not None
        try:
            first_cell = self.client.router.first_link  # the cluster, or with cells the first one
            beats = await first_cell.redis.hvals(first_cell.settings.keys.instances)
            models = set()
            for payload in beats:
                try:
                    beat = decode_heartbeat(payload)
                except ValidationError:
                    continue
                if beat.state != InstanceState.STOPPED:  # what the fleet serves now, adapters included
                    models.update(served_names(beat))
            self._instance_models = tuple(sorted(models))
        except Exception:
            log.warning("models_refresh_failed", exc_info=True)
        self._models_read_at_s = time.monotonic()

    # --- routes ------------------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        try:
            await asyncio.wait_for(self.require_client().redis.ping(), timeout=1.0)
        except Exception:
            return web.json_response({"status": "unavailable", "redis": False}, status=503)
        return web.json_response({"status": "ok", "redis": True, "in_flight": self.num_in_flight})

    async def metrics_text(self, request: web.Request) -> web.Response:
        return metrics_response(self.metrics.registry, request)

    async def models(self, request: web.Request) -> web.Response:
        self.caller_of(request)
        data = [{"id": name, "object": "model", "created": self.started_at_s, "owned_by": "blockq",
                 "root": name, "parent": None} for name in await self.model_names()]
        return web.json_response({"object": "list", "data": data})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/chat/completions")

    async def _generate(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        caller = self.caller_of(request)
        timeout_s = self.timeout_of(request)
        # The slot comes before the body: a body is memory, and a slow one time.
        with self.in_flight_slot(caller):
            plan = await self._plan(request, endpoint, caller)
            with self.requests_share(caller, plan.num_choices):
                call = GenerationCall(self.require_client(), self.metrics, self.background, plan, caller.tenant,
                                      timeout_s, endpoint, write_timeout_s=self.config.write_timeout_s)
                return await call.respond(request)

    async def _plan(self, request: web.Request, endpoint: str, caller: Caller) -> GenerationPlan:
        """The call's body read, validated and held to the caller's key policy."""
        body = await self.read_json(request)
        if endpoint == "/v1/completions":
            plan = parse_completion_request(body, self.defaults)
        else:
            plan = parse_chat_request(body, self.render_chat, self.defaults)
        plan = apply_key_policy(plan, body, caller.policy)
        # A name not seen yet is looked up again (at most once a second): an instance that
        # has just joined serves its model before the next periodic refresh.
        if plan.model not in await self.model_names() and plan.model not in await self.model_names(1.0):
            raise GatewayError(404, f"the model {plan.model!r} does not exist", "invalid_request_error",
                               param="model", code="model_not_found")
        if plan.model not in self.config.model_names:  # a name instances serve: only they may take it
            plan = replace(plan, routed_model=plan.model)
        return plan


def parse_json_body(raw: bytes, max_json_depth: int) -> Any:
    """``raw`` as JSON; ValidationError("body") for bad UTF-8, nesting past ``max_json_depth``
    (checked before parsing) or invalid JSON. Runs on the event loop: every step is linear
    and in C, a few ms for 4 MiB (docs/gateway.md)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValidationError("body", "must be UTF-8 encoded JSON") from None
    check_json_depth(text, max_json_depth)
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValidationError("body", f"invalid JSON ({getattr(exc, 'msg', 'too deep')})") from None


def create_app(config: GatewayConfig, settings: Settings, client: AsyncClient | None = None) -> web.Application:
    """The aiohttp application; ``client`` defaults to an AsyncClient on ``settings``."""
    gateway = Gateway(config, settings, client)
    app = web.Application(middlewares=[gateway.middleware], client_max_size=config.max_body_bytes)
    app.on_startup.append(gateway.on_startup)
    app.on_cleanup.append(gateway.on_cleanup)
    app.router.add_post("/v1/completions", gateway.completions)
    app.router.add_post("/v1/chat/completions", gateway.chat_completions)
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_get("/healthz", gateway.healthz)
    app.router.add_get("/metrics", gateway.metrics_text)
    return app


async def serve(config: GatewayConfig, settings: Settings, stop: asyncio.Event) -> None:
    """Listen on ``config.host:config.port`` until ``stop`` is set; in-flight calls get
    ``config.shutdown_timeout_s`` to finish, then are cancelled (and so are their requests)."""
    runner = web.AppRunner(create_app(config, settings), handler_cancellation=True, access_log=None,
                           shutdown_timeout=config.shutdown_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_address=True)
    await site.start()
    if not config.auth_required and not is_loopback_host(config.host):
        # Allowed only by an explicit --allow-unauthenticated (GatewayConfig refuses otherwise).
        log.warning("gateway_unauthenticated", host=config.host, reason="allow_unauthenticated is set")
    log.info("gateway_listening", url=f"http://{config.host}:{config.port}", auth=config.auth_required,
             models=list(config.model_names))
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        log.info("gateway_stopped")

