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
``line_too_long``, ``generation_failed``, ``cancelled``, ``timeout``.

Input is read line by line within :class:`LineLimits`: a line longer than ``max_line_bytes``
is an error line (skipped in chunks, never held whole) and a file of more than ``max_lines``
lines is refused (:class:`InputTooLarge`), so a reader holds one line at a time whatever
the file's size (docs/batch.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from blockq.client import build_request
from blockq.config import ConfigError, Settings
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
# The gateway's request body limit (GatewayConfig.max_body_bytes): a line carries one body.
DEFAULT_MAX_LINE_BYTES = 4 * 1024 * 1024
# OpenAI's limit on requests per batch file.
DEFAULT_MAX_LINES = 50_000
# How much of an over-long line is read at a time while it is skipped.
SKIP_CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True)
class LineLimits:
    """How much of an input file a job reads: lines of at most ``max_line_bytes`` bytes
    (UTF-8, without the newline) and at most ``max_lines`` lines, blank ones included."""

    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    max_lines: int = DEFAULT_MAX_LINES

    def __post_init__(self) -> None:
        for name in ("max_line_bytes", "max_lines"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1 (got {getattr(self, name)})")


class InputTooLarge(ConfigError):
    """The input file has more lines than :attr:`LineLimits.max_lines`."""


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


def _skip_rest_of_line(file: BinaryIO) -> int:
    """Read past the end of the current line in bounded chunks; returns the bytes skipped."""
    num_bytes = 0
    while chunk := file.readline(SKIP_CHUNK_BYTES):
        num_bytes += len(chunk)
        if chunk.endswith(b"\n"):
            return num_bytes - 1
    return num_bytes


def _too_long(number: int, num_bytes: int, max_bytes: int) -> LineError:
    return LineError(number, None, "line_too_long",
                     f"line {number} is {num_bytes} bytes, over the limit of {max_bytes} bytes (max_line_bytes)")


def _decoded(number: int, body: bytes) -> str | LineError:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return LineError(number, None, "invalid_json", f"line is not valid UTF-8 ({exc.reason})")


def iter_nonblank_lines(path: Path, limits: LineLimits) -> Iterator[tuple[int, str | LineError]]:
    """(line number from 1, text) of every non-blank line, one line in memory at a time.
    A line over ``limits.max_line_bytes`` or not valid UTF-8 comes as a :class:`LineError`;
    raises :class:`InputTooLarge` on reaching line ``limits.max_lines + 1``."""
    max_bytes = limits.max_line_bytes
    with path.open("rb") as file:
        number = 0
        # readline(max + 2): a line of exactly `max` bytes still comes with its newline
        # (and its \r, if any); anything longer is cut and the rest skipped.
        while raw := file.readline(max_bytes + 2):
            number += 1
            if number > limits.max_lines:
                raise InputTooLarge(f"input_path: {path} is over the limit of {limits.max_lines} lines "
                                    f"(max_lines = {limits.max_lines}: --max-lines, BLOCKQ_BATCH_MAX_LINES)")
            if not raw.endswith(b"\n") and len(raw) == max_bytes + 2:
                yield number, _too_long(number, len(raw) + _skip_rest_of_line(file), max_bytes)
                continue
            body = raw.rstrip(b"\r\n")
            if len(body) > max_bytes:
                yield number, _too_long(number, len(body), max_bytes)
            elif body.strip():
                yield number, _decoded(number, body)


def count_lines(path: Path, limits: LineLimits) -> int:
    """Non-blank lines of ``path`` (raises :class:`InputTooLarge` past ``limits.max_lines``)."""
    return sum(1 for _ in iter_nonblank_lines(path, limits))


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


def read_batch_input(path: Path, render: Renderer, defaults: RequestDefaults, settings: Settings,
                     limits: LineLimits) -> Iterator[BatchLine | LineError]:
    """Every non-blank line of ``path``, parsed, in order, read as they are consumed; a
    repeated custom_id is an error. Holds one line and the custom ids seen so far (at most
    ``limits.max_lines`` of them); raises :class:`InputTooLarge` when it reaches a line past
    the limit, after yielding the lines before it."""
    seen: set[str] = set()
    for number, text in iter_nonblank_lines(path, limits):
        item = text if isinstance(text, LineError) else parse_line(number, text, render, defaults, settings)
        if isinstance(item, BatchLine):
            if item.custom_id in seen:
                item = LineError(number, item.custom_id, "duplicate_custom_id",
                                 f"custom_id: {item.custom_id!r} appears on an earlier line", "custom_id")
            else:
                seen.add(item.custom_id)
        yield item
