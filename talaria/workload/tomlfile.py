"""Reading a TOML settings file into a msgspec struct, with errors that name
the file and the field (shared by the trace generator and scenario files)."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import msgspec

T = TypeVar("T")


def load_toml_struct(path: str | Path, type_: type[T], error: type[Exception], what: str) -> T:
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise error(f"cannot read {what} {p}: {exc.strerror or exc}") from None
    try:
        return msgspec.toml.decode(data, type=type_)
    except msgspec.ValidationError as exc:
        msg, _, where = str(exc).partition(" - at `$.")
        raise error(f"{p}: " + (f"{where.rstrip('`')}: {msg}" if where else msg)) from None
    except msgspec.DecodeError as exc:
        raise error(f"{p}: invalid TOML: {exc}") from None
