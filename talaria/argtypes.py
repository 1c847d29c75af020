"""argparse types for the command line: numbers and output paths are checked
where they are read, so a bad value is a one-line usage error (exit 2), never a
traceback, an embedded stack that starts and then fails, or a long run that
cannot write its figures at its end."""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from pathlib import Path


def _number(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return v


def seconds(text: str) -> float:
    """A finite number of seconds, zero or more."""
    v = _number(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be zero or more seconds, got {text}")
    return v


def model_seconds(text: str) -> float:
    """Model seconds, zero to MAX_MODEL_S, the trace format's cap on model time: past it a
    float's step passes the engines' microsecond timings (a --call-latency of 1e12 ran)."""
    from talaria.workload.trace import MAX_MODEL_S

    v = seconds(text)
    if v > MAX_MODEL_S:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_MODEL_S:,.0f} model seconds, got {text}")
    return v


def positive_float(text: str) -> float:
    """A finite number above zero (a time scale, a cost factor, a timeout)."""
    v = _number(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be above zero, got {text}")
    return v


SPEED_SCALE_RANGE = (0.01, 100.0)


def speed_scale(text: str) -> float:
    """A factor on the catalog's speeds, in SPEED_SCALE_RANGE: a hundred times faster or slower
    than the measured hardware is past any sensitivity question, and far beyond it a step
    falls below the clock's float precision and the simulated clock stops (1e9 hung `sim`)."""
    v = _number(text)
    lo, hi = SPEED_SCALE_RANGE
    if not lo <= v <= hi:
        raise argparse.ArgumentTypeError(f"must be in {lo:g}..{hi:g}, got {text}")
    return v


def positive_int(text: str) -> int:
    """A whole number, one or more (servers, replicas, processes)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {text}")
    return v


MAX_SERVERS = 4096  # a fleet past this is a typo (10**7 servers filled memory for minutes without a word)


def server_count(text: str) -> int:
    """A number of servers, 1 to MAX_SERVERS."""
    v = positive_int(text)
    if v > MAX_SERVERS:
        raise argparse.ArgumentTypeError(f"at most {MAX_SERVERS} servers, got {text}")
    return v


MAX_SEEDS = 10_000  # more is a typo (`1-1000000000` ran on without a word), not a study
_SEED_PART = re.compile(r"(\d+)(?:-(\d+))?")


def seed_list(text: str) -> tuple[int, ...]:
    """Seeds as `1-10`, `2001,2003` or both (`1-3,7`); each at most once (a seed run twice
    only weighs its trace double). A range needs both ends (`5-` ran seed 5 alone)."""
    out: list[int] = []
    for part in text.split(","):
        m = _SEED_PART.fullmatch(part.strip())
        if m is None or (m[2] is not None and int(m[2]) < int(m[1])):
            raise argparse.ArgumentTypeError(f"not a seed list: {text!r} (e.g. 2001-2020 or 1,2,3)")
        lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if len(out) + hi - lo + 1 > MAX_SEEDS:
            raise argparse.ArgumentTypeError(f"{text!r} names over {MAX_SEEDS} seeds")
        out.extend(range(lo, hi + 1))
    if len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"seeds must be distinct: {text!r}")
    return tuple(out)


def port_number(text: str) -> int:
    """A TCP port, 1..65535."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 1..65535, got {text}")
    return v


def positive_float_list(text: str) -> tuple[float, ...]:
    """Comma-separated finite numbers above zero (rates): `100,200,500`."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("names no number")
    return tuple(positive_float(x) for x in parts)


def output_file(text: str) -> str:
    """A file a command writes its results to, checked before the run (a long run must not
    fail at its end): not a folder, and its nearest existing folder writable (missing
    folders are made when it is written, by `write_output`)."""
    path = Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file to write")
    _check_writable(text, path.parent)
    return text


def _check_writable(text: str, folder: Path) -> None:
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: no write permission in {folder}")
    # permission bits do not say it all (root passes os.access, and /proc takes no new file): try
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:
        raise argparse.ArgumentTypeError(
            f"cannot write {text}: {folder} takes no new file ({exc.strerror or exc})") from None


class OutputError(OSError):
    """An output file could not be written after all (the command line prints it in one line)."""


def output_folder(text: str) -> str:
    """A folder a command writes files into, checked before the run: not an existing file,
    and its nearest existing folder writable (the rest is made when written)."""
    path = Path(text)
    if not text or (path.exists() and not path.is_dir()):
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder to write into")
    _check_writable(text, path)
    return text


def write_output(path: str | Path, text: str) -> None:
    """Write a command's output file, making its missing folders."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    except OSError as exc:
        raise OutputError(f"cannot write {p}: {exc.strerror or exc}") from None
