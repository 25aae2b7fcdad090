"""Batch input and output lines, in OpenAI's batch file formats.

Input: one JSON object a line, ``{"custom_id", "method": "POST", "url", "body"}`` with
``url`` ``/v1/completions`` or ``/v1/chat/completions`` and ``body`` a request body as the
HTTP gateway takes it (``stream`` must be false). Blank lines are skipped; custom ids
must be unique within a file.

Output (results file, input order)::

    {"id": "batch_req_<request id>", "custom_id": ..., "error": null,
     "response": {"status_code": 200, "request_id": ..., "body": <completion object>}}

Errors file (input order), one line per invalid input line or failed request::

    {"id": null, "custom_id": ... or null, "line": N, "response": null,
     "error": {"code": ..., "message": ..., "param": ...}}

with ``code`` one of ``invalid_json``, ``invalid_request``, ``duplicate_custom_id``,
``generation_failed``, ``cancelled``, ``timeout``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockq.client import build_request
from blockq.config import Settings
from blockq.frontdoors.gateway.chat_template import Renderer
from blockq.frontdoors.gateway.openai_requests import (
    GenerationPlan,
    RequestDefaults,
    parse_chat_request,
    parse_completion_request,
)
from blockq.wire.protocol import ValidationError

URLS = ("/v1/completions", "/v1/chat/completions")
MAX_CUSTOM_ID_CHARS = 512


@dataclass(frozen=True)
class BatchLine:
    """A valid input line. ``line_number`` counts from 1."""

    line_number: int
    custom_id: str
    url: str
    plan: GenerationPlan


@dataclass(frozen=True)
class LineError:
    """An input line that cannot run, or a request that failed."""

    line_number: int
    custom_id: str | None
    code: str
    message: str
    param: str | None = None

    def to_output(self) -> dict[str, Any]:
        return {"id": None, "custom_id": self.custom_id, "line": self.line_number, "response": None,
                "error": {"code": self.code, "message": self.message, "param": self.param}}


def result_line(custom_id: str, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """One line of the results file."""
    return {"id": f"batch_req_{request_id}", "custom_id": custom_id, "error": None,
            "response": {"status_code": 200, "request_id": request_id, "body": body}}


def iter_nonblank_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number from 1, text) of every non-blank line."""
    with path.open(encoding="utf-8") as file:
        for number, text in enumerate(file, start=1):
            if text.strip():
                yield number, text


def count_lines(path: Path) -> int:
    return sum(1 for _ in iter_nonblank_lines(path))


def parse_line(number: int, text: str, render: Renderer, defaults: RequestDefaults,
               settings: Settings) -> BatchLine | LineError:
    """Validate one input line, including the protocol limits a stage would enforce."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        return LineError(number, None, "invalid_json", f"line is not valid JSON ({getattr(exc, 'msg', exc)})")
    if not isinstance(data, dict):
        return LineError(number, None, "invalid_json", "line must be a JSON object")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return LineError(number, None, "invalid_request",
                         f"custom_id: must be a non-empty string of at most {MAX_CUSTOM_ID_CHARS} characters",
                         "custom_id")
    try:
        if data.get("method", "POST") != "POST":
            raise ValidationError("method", "must be POST")
        url = data.get("url")
        if url not in URLS:
            raise ValidationError("url", f"must be one of {', '.join(URLS)} (got {url!r})")
        body = data.get("body")
        if not isinstance(body, dict):
            raise ValidationError("body", "must be an object")
        if body.get("stream"):
            raise ValidationError("body.stream", "must be false in a batch")
        try:
            if url == "/v1/completions":
                plan = parse_completion_request(body, defaults)
            else:
                plan = parse_chat_request(body, render, defaults)
            for spec in plan.submit_specs("validate", "default"):
                build_request(spec, settings)
        except ValidationError as exc:
            raise ValidationError(f"body.{exc.field}", exc.problem) from None
    except ValidationError as exc:
        return LineError(number, custom_id, "invalid_request", str(exc), exc.field)
    return BatchLine(number, custom_id, url, plan)


def read_batch_input(path: Path, render: Renderer, defaults: RequestDefaults,
                     settings: Settings) -> list[BatchLine | LineError]:
    """Every non-blank line of ``path``, parsed, in order; a repeated custom_id is an error."""
    seen: set[str] = set()
    items: list[BatchLine | LineError] = []
    for number, text in iter_nonblank_lines(path):
        item = parse_line(number, text, render, defaults, settings)
        if isinstance(item, BatchLine):
            if item.custom_id in seen:
                item = LineError(number, item.custom_id, "duplicate_custom_id",
                                 f"custom_id: {item.custom_id!r} appears on an earlier line", "custom_id")
            else:
                seen.add(item.custom_id)
        items.append(item)
    return items
