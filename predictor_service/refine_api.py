"""``POST /refine``: remaining-length refinements of running requests, for workers.

Served beside ``/predict`` when the predictor runs with ``--refine-model DIR`` (a model
of ``blockq predictor refine-train``). Body::

    {"requests": [{"request_id": "r1", "prompt": "...", "prompt_tokens": 120,
                   "first_guess": [p10, p50, p90], "generated_tokens": 64,
                   "partial_text": "...", "max_tokens": 2048}, ...]}

``first_guess`` is the request's prediction at admission (total output tokens),
``generated_tokens`` how many it has produced and ``partial_text`` their text;
``max_tokens`` is optional. The answer, in the same order::

    {"refinements": [{"request_id": "r1", "at_tokens": 64, "remaining_p10_tokens": ...,
                      "remaining_p50_tokens": ..., "remaining_p90_tokens": ...}],
     "version": "refine-..."}

with quantiles of the tokens still to come after ``at_tokens`` (each >= 1, within
``max_tokens``). Invalid input gives 400 ``{"error": {"message", "field"}}`` naming the field
(``requests[2].generated_tokens``). The model runs in a worker thread, as ``/predict``'s.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from predictor_service.http_api import API_APP_KEY, PredictRequestError
from predictor_service.models.refine import RefineInput, RefineModel

MAX_REFINE_REQUESTS = 1024
MAX_PARTIAL_TEXT_CHARS = 200_000
_FIELDS = frozenset({"request_id", "prompt", "prompt_tokens", "first_guess", "generated_tokens",
                     "partial_text", "max_tokens"})
REFINE_APP_KEY: web.AppKey[RefineModel] = web.AppKey("refine_model", RefineModel)


def _int(item: Mapping[str, Any], name: str, where: str, low: int, *, optional: bool = False) -> int | None:
    value = item.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise PredictRequestError(f"{where}.{name}", f"must be an integer >= {low} (got {value!r})")
    return value


def _text(item: Mapping[str, Any], name: str, where: str, max_chars: int) -> str:
    value = item.get(name, "")
    if not isinstance(value, str) or len(value) > max_chars:
        raise PredictRequestError(f"{where}.{name}", f"must be a string of at most {max_chars} characters")
    return value


def _refine_input(item: object, where: str, max_prompt_chars: int) -> tuple[str, RefineInput]:
    if not isinstance(item, dict):
        raise PredictRequestError(where, "must be an object")
    unknown = sorted(set(item) - _FIELDS)
    if unknown:
        raise PredictRequestError(f"{where}.{unknown[0]}", "unknown field")
    request_id = item.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise PredictRequestError(f"{where}.request_id", "must be a non-empty string")
    first_guess = item.get("first_guess")
    if (not isinstance(first_guess, list) or len(first_guess) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in first_guess)):
        raise PredictRequestError(f"{where}.first_guess", "must be [p10, p50, p90], integers >= 1")
    return request_id, RefineInput(
        prompt=_text(item, "prompt", where, max_prompt_chars),
        prompt_tokens=_int(item, "prompt_tokens", where, 0) or 0,
        first_guess_p10_tokens=first_guess[0], first_guess_p50_tokens=first_guess[1],
        first_guess_p90_tokens=first_guess[2],
        generated_tokens=_int(item, "generated_tokens", where, 0) or 0,
        partial_text=_text(item, "partial_text", where, MAX_PARTIAL_TEXT_CHARS),
        max_tokens=_int(item, "max_tokens", where, 1, optional=True))


def parse_refine_body(body: bytes, max_prompt_chars: int) -> list[tuple[str, RefineInput]]:
    """Validate a raw ``/refine`` body; ``PredictRequestError`` names the field."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise PredictRequestError("body", f"not valid JSON ({exc})") from None
    if not isinstance(data, dict) or set(data) != {"requests"}:
        raise PredictRequestError("body", "must be an object with exactly the field 'requests'")
    items = data["requests"]
    if not isinstance(items, list) or not items or len(items) > MAX_REFINE_REQUESTS:
        raise PredictRequestError("requests", f"must be a list of 1 to {MAX_REFINE_REQUESTS} objects")
    return [_refine_input(item, f"requests[{index}]", max_prompt_chars) for index, item in enumerate(items)]


async def refine(request: web.Request) -> web.Response:
    """``POST /refine`` (see the module docstring)."""
    api, model = request.app[API_APP_KEY], request.app[REFINE_APP_KEY]
    try:
        parsed = parse_refine_body(await api.read_body(request), api.options.max_prompt_chars)
    except PredictRequestError as exc:
        return web.json_response({"error": {"message": exc.message, "field": exc.field}}, status=400)
    inputs = [one for _, one in parsed]
    remaining = await asyncio.to_thread(model.predict, inputs)
    refinements = [
        {"request_id": request_id, "at_tokens": one.generated_tokens, "remaining_p10_tokens": r.p10_tokens,
         "remaining_p50_tokens": r.predicted_output_tokens, "remaining_p90_tokens": r.p90_tokens}
        for (request_id, one), r in zip(parsed, remaining, strict=True)
    ]
    return web.json_response({"refinements": refinements, "version": model.version})


def add_refine_route(app: web.Application, model: RefineModel) -> None:
    """Serve ``POST /refine`` with ``model`` on a predictor app (:func:`~predictor_service.http_api.create_app`)."""
    app[REFINE_APP_KEY] = model
    app.router.add_post("/refine", refine)
