"""Reading a TOML settings file into a msgspec struct, with errors that name
the file and the field (shared by the trace generator and scenario files)."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import msgspec

T = TypeVar("T")


def load_toml_struct(path: str | Path, type_: type[T], error: type[Exception], what: str,
                     other: tuple[type, str] | None = None) -> T:
    """`other`: (the struct of the other kind of TOML file here, what it is for): a file of
    that kind given where this one is wanted is said to be one (its fields read as unknown)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise error(f"cannot read {what} {p}: {exc.strerror or exc}") from None
    try:
        return msgspec.toml.decode(data, type=type_)
    except msgspec.ValidationError as exc:
        msg, _, where = str(exc).partition(" - at `$.")
        hint = ""
        if other is not None:
            try:
                msgspec.toml.decode(data, type=other[0])
                hint = f" ({p.name} is {other[1]}, not a {what} file)"
            except (msgspec.ValidationError, msgspec.DecodeError):
                pass
        raise error(f"{p}: " + (f"{where.rstrip('`')}: {msg}" if where else msg) + hint) from None
    except msgspec.DecodeError as exc:
        raise error(f"{p}: invalid TOML: {exc}") from None
