"""structlog set-up: JSON lines by default, console renderer for humans.

`log_format="console"` (TALARIA_LOG_FORMAT=console, shared/settings.py)
switches to the console renderer. Handlers bind
session_id and call_id with `bound_contextvars` so every line of a call's work
carries them.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import structlog


_STDLIB_HANDLER = "talaria-json"  # (configured again, it replaces itself, not another's handler)


def configure_logging(service: str, fmt: str = "json", level: str = "INFO") -> structlog.stdlib.BoundLogger:
    lvl = getattr(logging, level.upper(), logging.INFO)
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
    # the libraries' own lines (nats-py, aiohttp, asyncio, the agent client's stdlib logger)
    # as JSON lines of the same log, not bare text that log readers skip
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, structlog.processors.add_log_level,
                           structlog.processors.TimeStamper(fmt="iso", utc=True),
                           lambda _, __, event: {**event, "service": service}],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer]))
    handler.set_name(_STDLIB_HANDLER)
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if h.get_name() != _STDLIB_HANDLER] + [handler]
    root.setLevel(lvl)
    return structlog.get_logger().bind(service=service)


def read_log_events(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a service's log, parsed; other lines (a supervisor's
    notes, a traceback) are skipped."""
    out: list[dict[str, Any]] = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out
