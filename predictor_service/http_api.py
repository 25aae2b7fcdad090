"""The predictor's HTTP API (aiohttp), served in the stage's event loop.

- ``POST /predict``: ``{"prompt": "...", "max_tokens": N}`` or
  ``{"prompts": ["...", ...], "max_tokens": N}`` (optional ``num_turns`` >= 1).
  ``max_tokens`` is optional (default: the protocol's largest) and caps every
  prediction. All prompts of a body go through one model call. The answer holds, per
  prompt, ``prompt_tokens``, ``predicted_output_tokens``, ``p10_tokens`` and
  ``p90_tokens`` (tokens of the project tokenizer), plus ``predictor_version`` and
  ``backend``: at top level for ``prompt``, in ``predictions`` (same order) for
  ``prompts``. Invalid input gives 400 ``{"error": {"message", "field"}}``, ``field``
  naming the offending field (``body`` for an unreadable, non-object or too-large body,
  ``prompts[3]`` for one list item).
- ``GET /healthz``: ``{"ok": true, "backend", "version"}``.
- ``GET /metrics``: Prometheus metrics (:mod:`predictor_service.metrics`).

Access (:class:`HttpAccessOptions`): with a bearer token set (env ``BLOCKQ_PREDICTOR_HTTP_TOKEN``),
every route but ``/healthz`` and ``/metrics`` needs ``Authorization: Bearer <token>`` and
answers 401 without it; at most ``max_concurrent_requests`` of those requests are served at
once, one more is answered 503 with ``Retry-After``, before its body is read.

The model call runs in a worker thread (``predict`` is thread-safe) so that a large
batch does not stall the stream stage sharing the loop.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from blockq.config import PREDICTOR_HTTP_TOKEN_ENV
from blockq.runtime.metrics_server import metrics_response
from blockq.text.tokenizer import TokenCounter
from blockq.wire.protocol import DEFAULT_LIMITS, ProtocolLimits
from blockq.wire.redis_url import PLACEHOLDER_SECRET
from predictor_service.metrics import predictor_registry
from predictor_service.models import LengthPrediction, LengthPredictor, PredictionInput
from predictor_service.online import PredictorSlot

if TYPE_CHECKING:
    from predictor_service.feedback import FeedbackConsumer
    from predictor_service.online import OnlineRefitter
    from predictor_service.stage import PredictorStage

log = structlog.get_logger(__name__)

_KNOWN_FIELDS = frozenset({"prompt", "prompts", "max_tokens", "num_turns"})
TOKEN_ENV = PREDICTOR_HTTP_TOKEN_ENV
MIN_TOKEN_CHARS = 16
# Probes and scrapers carry no token, and are never turned away under load: neither
# reaches the model, and a probe refused under load would restart a busy pod.
OPEN_PATHS = frozenset({"/healthz", "/metrics"})


@dataclass(frozen=True)
class HttpApiOptions:
    """Input bounds of ``POST /predict`` (prompts per body, body bytes, characters per
    prompt, ``max_tokens`` range)."""

    max_prompts: int = 256
    max_body_bytes: int = 8 * 1024 * 1024
    max_prompt_chars: int = DEFAULT_LIMITS.max_prompt_chars
    max_max_tokens: int = DEFAULT_LIMITS.max_max_tokens

    def __post_init__(self) -> None:
        for name in ("max_prompts", "max_body_bytes", "max_prompt_chars", "max_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1 (got {getattr(self, name)})")

    @classmethod
    def from_limits(cls, limits: ProtocolLimits, **overrides: int) -> HttpApiOptions:
        """Options whose prompt and ``max_tokens`` bounds match the stream protocol's."""
        return cls(max_prompt_chars=limits.max_prompt_chars,
                   max_max_tokens=limits.max_max_tokens, **overrides)  # fmt: skip


@dataclass(frozen=True)
class HttpAccessOptions:
    """Who may call the model routes (``/predict``, ``/refine``) and how many at once.
    ``bearer_token``: when set, those routes need ``Authorization: Bearer <token>`` (401
    otherwise); None: no authentication (serve it on loopback only). ``max_concurrent_requests``:
    model requests served at once (count); one more is answered 503 with ``Retry-After:
    retry_after_s`` (seconds). ``/healthz`` and ``/metrics`` are neither authenticated nor capped."""

    bearer_token: str | None = field(default=None, repr=False)
    max_concurrent_requests: int = 32
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        token = self.bearer_token
        if token is not None:
            if token.strip().upper() == PLACEHOLDER_SECRET:
                raise ValueError(f"bearer_token: is the placeholder {PLACEHOLDER_SECRET!r} of "
                                 "deploy/kubernetes/secret.yaml: set a real secret")
            if len(token) < MIN_TOKEN_CHARS:
                raise ValueError(f"bearer_token: must be at least {MIN_TOKEN_CHARS} characters")
            if not all(33 <= ord(c) <= 126 for c in token):  # what a header value carries as is
                raise ValueError("bearer_token: must be printable ASCII without spaces")
        for name in ("max_concurrent_requests", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1 (got {getattr(self, name)})")


class PredictRequestError(ValueError):
    """Invalid ``/predict`` input; ``field`` names what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = f"{field}: {message}"


@dataclass(frozen=True)
class PredictBody:
    """A validated ``/predict`` body; ``is_batch`` says it used ``prompts``."""

    prompts: tuple[str, ...]
    max_tokens: int
    num_turns: int
    is_batch: bool


def parse_predict_body(body: bytes, options: HttpApiOptions) -> PredictBody:
    """Validate a raw ``/predict`` body; ``PredictRequestError`` names the field."""
    if len(body) > options.max_body_bytes:
        raise PredictRequestError("body", f"must be at most {options.max_body_bytes} bytes")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise PredictRequestError("body", f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise PredictRequestError("body", "must be a JSON object")
    unknown = sorted(set(data) - _KNOWN_FIELDS)
    if unknown:
        raise PredictRequestError(unknown[0], "unknown field")
    if ("prompt" in data) == ("prompts" in data):
        raise PredictRequestError("prompt", "give exactly one of 'prompt' or 'prompts'")
    is_batch = "prompts" in data
    if is_batch:
        prompts = data["prompts"]
        if not isinstance(prompts, list) or not prompts:
            raise PredictRequestError("prompts", "must be a non-empty list of strings")
        if len(prompts) > options.max_prompts:
            raise PredictRequestError(
                "prompts", f"must have at most {options.max_prompts} items (got {len(prompts)})"
            )
        for index, prompt in enumerate(prompts):
            _check_prompt(f"prompts[{index}]", prompt, options)
    else:
        prompts = [data["prompt"]]
        _check_prompt("prompt", prompts[0], options)
    return PredictBody(
        prompts=tuple(prompts),
        max_tokens=_int_field(data, "max_tokens", options.max_max_tokens, 1, options.max_max_tokens),
        num_turns=_int_field(data, "num_turns", 1, 1, 10_000),
        is_batch=is_batch,
    )


def _check_prompt(field: str, prompt: object, options: HttpApiOptions) -> None:
    if not isinstance(prompt, str) or not prompt:
        raise PredictRequestError(field, "must be a non-empty string")
    if len(prompt) > options.max_prompt_chars:
        raise PredictRequestError(field, f"must be at most {options.max_prompt_chars} characters")


def _int_field(data: Mapping[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise PredictRequestError(name, f"must be an integer (got {type(value).__name__})")
    if not low <= value <= high:
        raise PredictRequestError(name, f"must be between {low} and {high} (got {value})")
    return value


class HttpApiStats:
    """What the API served: predictions, batch sizes (prompts per call), responses."""

    def __init__(self) -> None:
        self.num_predictions = 0
        self.batch_size_to_num_batches: Counter[int] = Counter()
        self.status_to_num_responses: Counter[int] = Counter()


def _error(status: int, field: str, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "field": field}}, status=status)


def _prediction_json(prompt_tokens: int, prediction: LengthPrediction) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "predicted_output_tokens": prediction.predicted_output_tokens,
        "p10_tokens": prediction.p10_tokens,
        "p90_tokens": prediction.p90_tokens,
    }


class PredictorHttpApi:
    """Request handlers; ``slot.predictor`` is read once per request (refits swap it)."""

    def __init__(self, slot: PredictorSlot, token_counter: TokenCounter, *,
                 options: HttpApiOptions | None = None, stage: PredictorStage | None = None,
                 feedback: FeedbackConsumer | None = None, refitter: OnlineRefitter | None = None,
                 access: HttpAccessOptions | None = None) -> None:  # fmt: skip
        self.slot = slot
        self.token_counter = token_counter
        self.options = options or HttpApiOptions()
        self.access = access or HttpAccessOptions()
        self.num_in_flight = 0  # model requests being served (one event loop: no lock)
        self.stage = stage
        self.feedback = feedback
        self.refitter = refitter
        self.stats = HttpApiStats()
        self.registry = predictor_registry(slot, http_stats=self.stats, stage=stage, feedback=feedback,
                                           refitter=refitter)

    @web.middleware
    async def guard(self, request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Middleware: the token, then the concurrency cap, both checked before the body is
        read (so a refused request costs no upload or parsing)."""
        if request.path in OPEN_PATHS:
            return await handler(request)
        if not self._authorized(request):
            response = _error(401, "authorization", "a valid 'Authorization: Bearer <token>' header is required")
            response.headers["WWW-Authenticate"] = "Bearer"
            return self._respond(response)
        if self.num_in_flight >= self.access.max_concurrent_requests:
            response = _error(503, "concurrency", f"more than {self.access.max_concurrent_requests} "
                                                  "requests in flight: retry later")
            response.headers["Retry-After"] = str(self.access.retry_after_s)
            return self._respond(response)
        self.num_in_flight += 1
        try:
            return await handler(request)
        finally:
            self.num_in_flight -= 1

    def _authorized(self, request: web.Request) -> bool:
        token = self.access.bearer_token
        if token is None:
            return True
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        # Constant-time comparison: the time taken must not tell how much of a guess matched.
        return scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), token.encode())

    async def read_body(self, request: web.Request) -> bytes:
        """The body, refusing (``PredictRequestError`` on ``body``) past the byte limit
        without reading it all."""
        limit = self.options.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise PredictRequestError("body", f"must be at most {limit} bytes")
        chunks, num_bytes = [], 0
        async for chunk in request.content.iter_chunked(64 * 1024):
            num_bytes += len(chunk)
            if num_bytes > limit:
                raise PredictRequestError("body", f"must be at most {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def predict(self, request: web.Request) -> web.Response:
        """``POST /predict`` (see the module docstring)."""
        try:
            body = parse_predict_body(await self.read_body(request), self.options)
        except PredictRequestError as exc:
            return self._respond(_error(400, exc.field, exc.message))
        predictor = self.slot.predictor
        try:
            prompt_tokens, predictions = await asyncio.to_thread(self._run_model, predictor, body)
        except ValueError as exc:  # a backend that needs fields HTTP does not carry
            field = str(exc).split(":", 1)[0] if ":" in str(exc) else "prompt"
            return self._respond(_error(400, field, str(exc)))
        self.stats.num_predictions += len(predictions)
        self.stats.batch_size_to_num_batches[len(predictions)] += 1
        items = [_prediction_json(n, p) for n, p in zip(prompt_tokens, predictions, strict=True)]
        meta = {"predictor_version": predictor.version, "backend": predictor.backend}
        payload = {"predictions": items, **meta} if body.is_batch else {**items[0], **meta}
        return self._respond(web.json_response(payload))

    def _run_model(self, predictor: LengthPredictor, body: PredictBody) -> tuple[list[int], list[LengthPrediction]]:
        prompt_tokens = self.token_counter.count(list(body.prompts))
        inputs = [
            PredictionInput(prompt=prompt, prompt_tokens=count, max_tokens=body.max_tokens,
                            num_turns=body.num_turns)  # fmt: skip
            for prompt, count in zip(body.prompts, prompt_tokens, strict=True)
        ]
        return prompt_tokens, predictor.predict(inputs)

    def _respond(self, response: web.Response) -> web.Response:
        self.stats.status_to_num_responses[response.status] += 1
        return response

    async def healthz(self, request: web.Request) -> web.Response:
        """``GET /healthz``: the serving backend and version."""
        predictor = self.slot.predictor
        return web.json_response({"ok": True, "backend": predictor.backend, "version": predictor.version})

    async def metrics(self, request: web.Request) -> web.Response:
        """``GET /metrics``: every metric of :attr:`registry`."""
        return metrics_response(self.registry, request)


API_APP_KEY: web.AppKey[PredictorHttpApi] = web.AppKey("predictor_api", PredictorHttpApi)


def create_app(slot: PredictorSlot, token_counter: TokenCounter, *,
               options: HttpApiOptions | None = None, stage: PredictorStage | None = None,
               feedback: FeedbackConsumer | None = None, refitter: OnlineRefitter | None = None,
               access: HttpAccessOptions | None = None) -> web.Application:  # fmt: skip
    """The aiohttp application; ``stage``/``feedback``/``refitter`` (optional) add
    their figures to ``/metrics``; ``access`` (default: no token, the default cap) guards
    every route added to it, ``/refine`` included. ``app[API_APP_KEY]`` is the
    :class:`PredictorHttpApi`."""
    api = PredictorHttpApi(slot, token_counter, options=options, stage=stage,
                           feedback=feedback, refitter=refitter, access=access)  # fmt: skip
    # aiohttp's own cap sits above ours so that oversized bodies get our 400, not a 413.
    app = web.Application(client_max_size=api.options.max_body_bytes + 1, middlewares=[api.guard])
    app[API_APP_KEY] = api
    app.router.add_post("/predict", api.predict)
    app.router.add_get("/healthz", api.healthz)
    app.router.add_get("/metrics", api.metrics)
    return app


async def start_http_api(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Serve ``app`` on ``host:port`` in the running loop; ``await runner.cleanup()``
    stops it."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("predictor_http_started", host=host, port=port)
    return runner
