"""structlog set-up: JSON lines by default, console renderer for humans.

TALARIA_LOG_FORMAT=console switches to the console renderer. Handlers bind
session_id and call_id with `bound_contextvars` so every line of a call's work
carries them.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(service: str, level: str | None = None) -> structlog.stdlib.BoundLogger:
    fmt = os.environ.get("TALARIA_LOG_FORMAT", "json")
    lvl = getattr(logging, (level or os.environ.get("TALARIA_LOG_LEVEL", "INFO")).upper(), logging.INFO)
    renderer: structlog.types.Processor = (
        structlog.dev.ConsoleRenderer() if fmt == "console" else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stdout),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger().bind(service=service)
