"""structlog set-up: one JSON object per line on stderr, with the component bound.

Log values may carry text from outside (prompts, headers, error messages): every string
is cut to :data:`MAX_VALUE_CHARS` (tracebacks to :data:`MAX_EXCEPTION_CHARS`) with a marker
saying how much was cut, so one request cannot flood the logs."""

from __future__ import annotations

import logging
import sys

import structlog
from structlog.typing import EventDict, WrappedLogger

MAX_VALUE_CHARS = 1000
MAX_EXCEPTION_CHARS = 10_000
# Nested containers deeper than this are rendered as their (bounded) repr.
_MAX_DEPTH = 4


def bound_value(value: object, max_chars: int = MAX_VALUE_CHARS, depth: int = 0) -> object:
    """``value`` with every string (and bytes) in it at most ``max_chars`` long plus a
    ``…[N chars cut]`` marker; dicts, lists and tuples are bounded item by item."""
    if isinstance(value, str | bytes):
        if len(value) <= max_chars:
            return value
        text = value if isinstance(value, str) else repr(value)
        return f"{text[:max_chars]}…[{len(value) - max_chars} chars cut]"
    if isinstance(value, dict | list | tuple):
        if depth >= _MAX_DEPTH:
            return bound_value(repr(value), max_chars)
        if isinstance(value, dict):
            return {bound_value(k, max_chars, depth + 1): bound_value(v, max_chars, depth + 1)
                    for k, v in value.items()}
        return [bound_value(item, max_chars, depth + 1) for item in value]
    return value


def bound_strings(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    """structlog processor: bound every value of the event (see :func:`bound_value`)."""
    for key, value in event_dict.items():
        event_dict[key] = bound_value(value, MAX_EXCEPTION_CHARS if key == "exception" else MAX_VALUE_CHARS)
    return event_dict


def configure_logging(level: str = "info", component: str | None = None) -> None:
    """Configure structlog for a process. Library code only calls ``structlog.get_logger``."""
    numeric_level = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(level=numeric_level, stream=sys.stderr, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            bound_strings,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    if component:
        structlog.contextvars.bind_contextvars(component=component)
