"""structlog set-up: one JSON object per line on stderr, with the component bound."""

from __future__ import annotations

import logging
import sys

import structlog


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
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    if component:
        structlog.contextvars.bind_contextvars(component=component)
