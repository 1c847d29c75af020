"""structlog set-up: JSON lines by default, console renderer for humans.

`log_format="console"` (TALARIA_LOG_FORMAT=console, shared/settings.py)
switches to the console renderer. Handlers bind
session_id and call_id with `bound_contextvars` so every line of a call's work
carries them.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import stat
import sys
import tempfile
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
            # every line names its process's service, a logger made without the bound one too
            # (the gateway's, the metrics endpoint's): merged logs are read by it
            lambda _, __, event: {"service": service, **event},
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
    handler.setFormatter(stdlib_formatter(service, renderer))
    handler.set_name(_STDLIB_HANDLER)
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if h.get_name() != _STDLIB_HANDLER] + [handler]
    root.setLevel(lvl)
    return structlog.get_logger()  # (named by the first processor: every line carries `service`)


def stdlib_formatter(service: str, renderer: structlog.types.Processor | None = None,
                     extra: tuple[structlog.types.Processor, ...] = ()) -> logging.Formatter:
    """A stdlib logging formatter writing a record as one of the service's JSON lines
    (`event`, `level`, `logger`, `timestamp`, `service`, and what `extra` adds)."""
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, structlog.processors.add_log_level,
                           structlog.processors.TimeStamper(fmt="iso", utc=True),
                           lambda _, __, event: {**event, "service": service}, *extra],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer or structlog.processors.JSONRenderer()])


def _vllm_process(_: Any, __: str, event: structlog.types.EventDict) -> structlog.types.EventDict:
    record = event.get("_record")
    if record is not None:  # (vLLM names its processes on its records: EngineCore, Worker, ...)
        event["vllm_process"] = getattr(record, "vllm_process_name", None) or record.processName
        event["pid"] = record.process
    return event


def vllm_formatter(service: str) -> logging.Formatter:
    """vLLM's lines as the engine-worker's JSON lines, each naming its vLLM process and pid."""
    return stdlib_formatter(service, extra=(_vllm_process,))


VLLM_LOGGING_CONFIG = "VLLM_LOGGING_CONFIG_PATH"


def vllm_logging_config(service: str, level: str) -> dict[str, Any]:
    """vLLM's logging configuration (a `logging.config.dictConfig`): its `vllm` logger's lines
    through `vllm_formatter` to stdout, at `level`."""
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"talaria": {"()": f"{__name__}.vllm_formatter", "service": service}},
            "handlers": {"talaria": {"class": "logging.StreamHandler", "formatter": "talaria",
                                     "stream": "ext://sys.stdout", "level": level.upper()}},
            "loggers": {"vllm": {"handlers": ["talaria"], "level": level.upper(), "propagate": False}}}


def route_vllm_logs(service: str, log_format: str) -> Path | None:
    """Before vLLM is first imported: its lines become JSON lines of this service's log, in
    this process and in those vLLM starts (its engine core and workers configure their
    logging from `VLLM_LOGGING_CONFIG_PATH` as they import it); they were vLLM's own text
    among the JSON lines, which log readers skip or choke on. Left alone where an operator
    configured vLLM's logging (`VLLM_LOGGING_CONFIG_PATH`, `VLLM_CONFIGURE_LOGGING=0`) or
    asked for console lines. Returns the file written (removed when this process exits)."""
    if log_format != "json" or os.environ.get(VLLM_LOGGING_CONFIG) or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        return None
    fd, name = tempfile.mkstemp(prefix="talaria-vllm-logging-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(vllm_logging_config(service, os.environ.get("VLLM_LOGGING_LEVEL", "INFO")), f)
    atexit.register(lambda: Path(name).unlink(missing_ok=True))
    os.environ[VLLM_LOGGING_CONFIG] = name
    return Path(name)


class LogEvery:
    """A repeated event logged at most once per `every_s` (wall seconds), saying how many
    happened since: `due(now)` counts one and returns the count to log, or 0 to stay quiet."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.count = 0
        self.logged_at: float | None = None

    def due(self, now: float) -> int:
        self.count += 1
        if self.logged_at is not None and now - self.logged_at < self.every_s:
            return 0
        count, self.count, self.logged_at = self.count, 0, now
        return count


LOG_ROTATE_CHECK_S = 5.0  # wall seconds between two looks at the log file's size
# the file a supervisor appends a child's output to, named in the child's environment: what the
# descriptor points at is not enough, since a warm spare's file may have been rotated under it
LOG_FILE_ENV = "TALARIA_LOG_FILE"


class StdoutRotation:
    """Size-based rotation of the log file this process's stdout and stderr append to
    (the embedded stack's supervisor opens `NAME.log` for each service; under compose
    they are pipes, which Docker's log driver rotates). Past `max_bytes` the file becomes
    `NAME.1.log` (the older ones `NAME.2.log` ... up to `keep`, the oldest dropped) and
    the process goes on in a new `NAME.log`. The process moves its own descriptors
    (dup2), so no line is lost or split, and a log reader's `*.log` finds them all."""

    def __init__(self, path: Path, max_bytes: int, keep: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.keep = max(1, keep)

    @classmethod
    def for_stdout(cls, max_bytes: int, keep: int) -> "StdoutRotation | None":
        """The rotation of this process's stdout, where it is the `*.log` file its
        supervisor named (`TALARIA_LOG_FILE`; else None: a terminal, a pipe, a file of
        the caller's own, or rotation off with `max_bytes` 0)."""
        named = os.environ.get(LOG_FILE_ENV, "")
        if max_bytes <= 0 or not named.endswith(".log"):
            return None
        rotation = cls(Path(named), max_bytes, keep)
        try:
            out = os.fstat(1)
            if not stat.S_ISREG(out.st_mode):
                return None
            # stdout is that file, or one of its generations (a warm spare's file rotated under
            # it); not a file of the caller's own beside a variable inherited from elsewhere
            for path in (rotation.path, *(rotation.generation(n) for n in range(1, rotation.keep + 1))):
                with contextlib.suppress(OSError):
                    if os.path.samestat(out, os.stat(path)):
                        return rotation
        except OSError:
            pass
        return None

    def generation(self, n: int) -> Path:
        """The n-th rotated file (1: the newest)."""
        return self.path.with_name(f"{self.path.name[:-len('.log')]}.{n}.log")

    def due(self) -> bool:
        return os.fstat(1).st_size >= self.max_bytes

    def rotate(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for n in range(self.keep - 1, 0, -1):
            if self.generation(n).exists():
                self.generation(n).replace(self.generation(n + 1))
        if self.path.exists():
            self.path.replace(self.generation(1))
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.dup2(fd, 1)
            os.dup2(fd, 2)
        finally:
            os.close(fd)


async def rotate_logs(max_bytes: int, keep: int) -> None:
    """A service's background task: rotate its log file whenever it has grown past its
    bound; ends at once where there is nothing to rotate (`StdoutRotation.for_stdout`)."""
    rotation = StdoutRotation.for_stdout(max_bytes, keep)
    if rotation is None:
        return
    while True:
        await asyncio.sleep(LOG_ROTATE_CHECK_S)
        try:
            if rotation.due():
                rotation.rotate()
        except OSError as exc:  # (a full disk, a folder removed): logged, tried again later
            structlog.get_logger().warning("log.rotation_failed", path=str(rotation.path), error=str(exc))


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
