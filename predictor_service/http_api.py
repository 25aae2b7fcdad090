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
- ``GET /metrics``: Prometheus text format 0.0.4 (see :func:`render_metrics`).

The model call runs in a worker thread (``predict`` is thread-safe) so that a large
batch does not stall the stream stage sharing the loop.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from blockq.protocol import DEFAULT_LIMITS, ProtocolLimits
from blockq.tokenizer import TokenCounter
from predictor_service.models import LengthPrediction, LengthPredictor, PredictionInput
from predictor_service.online import PredictorSlot

if TYPE_CHECKING:
    from predictor_service.feedback import FeedbackConsumer
    from predictor_service.online import OnlineRefitter
    from predictor_service.stage import PredictorStage

log = structlog.get_logger(__name__)

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_KNOWN_FIELDS = frozenset({"prompt", "prompts", "max_tokens", "num_turns"})


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


@dataclass
class StaticSlot:
    """A :class:`PredictorSlot` holding one fixed predictor (no stage)."""

    predictor: LengthPredictor


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
                 feedback: FeedbackConsumer | None = None,
                 refitter: OnlineRefitter | None = None) -> None:  # fmt: skip
        self.slot = slot
        self.token_counter = token_counter
        self.options = options or HttpApiOptions()
        self.stage = stage
        self.feedback = feedback
        self.refitter = refitter
        self.stats = HttpApiStats()

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
        """``GET /metrics``: Prometheus text."""
        return web.Response(text=render_metrics(self), content_type="text/plain",
                            headers={"X-Content-Type-Options": "nosniff"})  # fmt: skip


API_APP_KEY: web.AppKey[PredictorHttpApi] = web.AppKey("predictor_api", PredictorHttpApi)


def create_app(slot: PredictorSlot, token_counter: TokenCounter, *,
               options: HttpApiOptions | None = None, stage: PredictorStage | None = None,
               feedback: FeedbackConsumer | None = None,
               refitter: OnlineRefitter | None = None) -> web.Application:  # fmt: skip
    """The aiohttp application; ``stage``/``feedback``/``refitter`` (optional) add
    their figures to ``/metrics``. ``app[API_APP_KEY]`` is the :class:`PredictorHttpApi`."""
    api = PredictorHttpApi(slot, token_counter, options=options, stage=stage,
                           feedback=feedback, refitter=refitter)  # fmt: skip
    # aiohttp's own cap sits above ours so that oversized bodies get our 400, not a 413.
    app = web.Application(client_max_size=api.options.max_body_bytes + 1)
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


# --- /metrics ---------------------------------------------------------------------------


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return f"{value:.6g}"


def _labels(**labels: str) -> str:
    if not labels:
        return ""
    pairs = (f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
             for k, v in sorted(labels.items()))  # fmt: skip
    return "{" + ",".join(pairs) + "}"


class _Lines:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_text: str,
               samples: list[tuple[dict[str, str], float]]) -> None:  # fmt: skip
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        self.lines += [f"{name}{_labels(**labels)} {_number(value)}" for labels, value in samples]

    def histogram(self, name: str, help_text: str, source_to_counts: dict[str, Counter[int]]) -> None:
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for source, size_to_count in sorted(source_to_counts.items()):
            for bound in (*BATCH_SIZE_BUCKETS, math.inf):
                cumulative = sum(n for size, n in size_to_count.items() if size <= bound)
                le = "+Inf" if math.isinf(bound) else str(bound)
                self.lines.append(f"{name}_bucket{_labels(source=source, le=le)} {cumulative}")
            total = sum(size * n for size, n in size_to_count.items())
            self.lines.append(f"{name}_sum{_labels(source=source)} {total}")
            self.lines.append(f"{name}_count{_labels(source=source)} {sum(size_to_count.values())}")


def render_metrics(api: PredictorHttpApi) -> str:
    """Every metric, ``blockq_predictor_*``: model info, predictions and batch sizes by
    source (``http``/``stage``), HTTP responses, dead letters, the feedback figures
    (rolling MAE in tokens, Acc-50/Acc-100 as fractions, prompt PSI, alerts by kind,
    records by outcome) and online refit counts. NaN while a figure has no data."""
    out = _Lines()
    predictor = api.slot.predictor
    out.metric("blockq_predictor_model_info", "gauge", "Serving model (value 1).",
               [({"backend": predictor.backend, "version": predictor.version}, 1)])
    predictions = [({"source": "http"}, api.stats.num_predictions)]
    batches = {"http": api.stats.batch_size_to_num_batches}
    if api.stage is not None:
        predictions.append(({"source": "stage"}, api.stage.num_annotated))
        batches["stage"] = api.stage.batch_size_to_num_batches
    out.metric("blockq_predictor_predictions_total", "counter", "Predictions served.", predictions)
    out.histogram("blockq_predictor_batch_size", "Requests per model call.", batches)
    out.metric("blockq_predictor_http_responses_total", "counter", "HTTP /predict responses by status.",
               [({"code": str(code)}, n) for code, n in sorted(api.stats.status_to_num_responses.items())])
    if api.stage is not None:
        out.metric("blockq_predictor_dead_letters_total", "counter",
                   "Stream entries dead-lettered by the stage.", [({}, api.stage.num_dead_lettered)])
    if api.feedback is not None:
        _render_feedback(out, api.feedback)
    if api.refitter is not None:
        _render_refit(out, api.refitter)
    return "\n".join(out.lines) + "\n"


def _render_feedback(out: _Lines, feedback: FeedbackConsumer) -> None:
    snapshot = feedback.snapshot()
    gauges = [
        ("blockq_predictor_rolling_samples", "Done records in the rolling window.", snapshot.num_samples),
        ("blockq_predictor_rolling_mae_tokens", "Rolling mean absolute error, tokens.", snapshot.rolling_mae),
        ("blockq_predictor_rolling_acc50_ratio", "Rolling share within 50 tokens.", snapshot.rolling_acc50),
        ("blockq_predictor_rolling_acc100_ratio", "Rolling share within 100 tokens.", snapshot.rolling_acc100),
        ("blockq_predictor_validation_acc50_ratio", "Validation Acc-50 of the model.", snapshot.validation_acc50),
        ("blockq_predictor_prompt_drift_psi", "Prompt-length PSI against training.", snapshot.prompt_psi),
    ]
    for name, help_text, value in gauges:
        out.metric(name, "gauge", help_text, [({}, float(value))])
    from predictor_service.quality import ACCURACY_DROP, PROMPT_DRIFT

    out.metric("blockq_predictor_alerts_total", "counter", "Quality alerts raised, by kind.",
               [({"kind": kind}, feedback.alert_kind_to_num_alerts[kind])
                for kind in (ACCURACY_DROP, PROMPT_DRIFT)])  # fmt: skip
    outcomes = [({"outcome": "counted"}, feedback.num_counted)]
    outcomes += [({"outcome": f"skipped_{reason}"}, n)
                 for reason, n in sorted(feedback.skip_reason_to_num_records.items())]  # fmt: skip
    outcomes.append(({"outcome": "dead_lettered"}, feedback.num_dead_lettered))
    out.metric("blockq_predictor_feedback_records_total", "counter", "Done records read, by outcome.", outcomes)


def _render_refit(out: _Lines, refitter: OnlineRefitter) -> None:
    out.metric("blockq_predictor_refits_total", "counter", "Online refits, by outcome.",
               [({"outcome": "ok"}, refitter.num_refits),
                ({"outcome": "failed"}, refitter.num_failed_refits)])  # fmt: skip
    out.metric("blockq_predictor_rollbacks_total", "counter", "Model rollbacks.", [({}, refitter.num_rollbacks)])
    out.metric("blockq_predictor_feedback_samples", "gauge", "Feedback samples held for refit.",
               [({}, len(refitter.samples))])
    out.metric("blockq_predictor_tracked_requests", "gauge", "Annotated requests awaiting their done record.",
               [({}, len(refitter.cache))])
