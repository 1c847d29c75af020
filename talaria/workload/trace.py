"""Reader and writer for agent-session traces (JSON Lines; spec: docs/trace-format.md).

One session per line. The replay driver and the simulator both read traces
through `parse_trace`/`load_trace`, so a malformed file is rejected the same
way everywhere: a `TraceError` naming the line and the field, and nothing
partial is returned.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from shared.schema import ID_MAX_CHARS

if TYPE_CHECKING:
    from shared.catalog import Catalog

__all__ = [
    "TraceCall",
    "TraceSession",
    "TraceError",
    "parse_trace",
    "load_trace",
    "dump_trace",
    "encode_trace",
    "session_prompts",
]

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]
# Latest model second a session may reach (its arrival plus its tool gaps): past it a float's
# step passes the engines' microsecond timings and the simulator's 1e-9 s tolerances, and at
# 1e300 a session's completion time read 2.97e+284 s.
MAX_MODEL_S = 1e9
# C0 and C1 control characters: a newline in an id breaks the HTTP session header of `replay --via-gateway`
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


# A replay names each call `<run tag><session id>#<index>` (`call_id_for`: a run tag such as
# `r1a2b3c-` against a running deployment, an index of up to 5 digits), and the bus carries
# ids of at most ID_MAX_CHARS: a trace's session id leaves room for both.
CALL_ID_ROOM_CHARS = 20
SESSION_ID_MAX_CHARS = ID_MAX_CHARS - CALL_ID_ROOM_CHARS
SessionId = Annotated[str, msgspec.Meta(min_length=1, max_length=SESSION_ID_MAX_CHARS)]


class TraceCall(msgspec.Struct, frozen=True, forbid_unknown_fields=False, omit_defaults=True):
    """One LLM call of a session (omit_defaults: `compact` is written only when true)."""

    new_input_tokens: PositiveInt
    output_tokens: PositiveInt
    tool_s: NonNegFloat
    compact: bool = False


class TraceSession(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    session_id: SessionId  # within the bus schema's ids, with room for what a replay adds
    model: str
    arrival_s: NonNegFloat
    calls: Annotated[list[TraceCall], msgspec.Meta(min_length=1)]


class TraceError(ValueError):
    """A trace failed to load: `line` is 1-based (0: the file as a whole, e.g.
    it cannot be read), `field` a path like `calls[2].output_tokens`."""

    def __init__(self, source: str, line: int, field: str, problem: str) -> None:
        self.source = source
        self.line = line
        self.field = field
        self.problem = problem
        where = source + (f" line {line}" if line else "") + (f", field {field}" if field else "")
        super().__init__(f"{where}: {problem}")


# What each field must be, in words, for error messages (keyed by the last path element).
_REQUIREMENT = {
    "session_id": f"must be a string of 1-{SESSION_ID_MAX_CHARS} characters, no control characters or lone "
                  "surrogates (\\ud800-\\udfff)",
    "model": "must be a string",
    "arrival_s": f"must be a finite number >= 0, at most {MAX_MODEL_S:,.0f}",
    "calls": "must be a non-empty list of call objects",
    "new_input_tokens": "must be an integer >= 1",
    "output_tokens": "must be an integer >= 1",
    "tool_s": "must be a finite number >= 0",
    "compact": "must be true or false",
}

_PATH_RE = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")
_MSG_RE = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_MISSING_RE = re.compile(r"Object missing required field `([^`]+)`")


def _split_path(path: str) -> list[str | int]:
    return [name if name else int(idx) for name, idx in _PATH_RE.findall(path)]


def _fmt_path(parts: Sequence[str | int]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _lookup(obj: Any, parts: Sequence[str | int]) -> Any:
    for p in parts:
        obj = obj[p]
    return obj


def _short(value: Any) -> str:
    text = json.dumps(value, allow_nan=True)  # NaN/Infinity spelled as in the input
    return text if len(text) <= 40 else text[:37] + "..."


def _translate(exc: msgspec.ValidationError, raw: Any, source: str, line: int) -> TraceError:
    """Turn msgspec's `Expected ... - at `$.calls[0].x`` into a TraceError with a field name."""
    m = _MSG_RE.match(str(exc))
    msg, path = (m.group("msg"), m.group("path") or "") if m else (str(exc), "")
    parts = _split_path(path)
    missing = _MISSING_RE.match(msg)
    if missing:
        parts = [*parts, missing.group(1)]
        leaf = parts[-1]
        need = _REQUIREMENT.get(leaf, "is required") if isinstance(leaf, str) else "is required"
        return TraceError(source, line, _fmt_path(parts), f"is missing ({need.replace('must be', 'required:', 1)})")
    if not parts:
        return TraceError(source, line, "", f"a line must be a JSON object describing one session (got {_short(raw)})")
    leaf = parts[-1]
    if isinstance(leaf, int):  # an element of `calls` that is not an object
        need = "must be a call object"
    else:
        need = _REQUIREMENT.get(leaf, msg)
    try:
        got = _short(_lookup(raw, parts))
    except (KeyError, IndexError, TypeError):
        got = "?"
    return TraceError(source, line, _fmt_path(parts), f"{need} (got {got})")


def _utf8(text: str) -> bool:
    """JSON's "\\ud800" decodes to a lone surrogate, which no UTF-8 carries: the bus, the logs
    and the terminal all failed on it mid-run."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_values(s: TraceSession, source: str, line: int) -> None:
    """What the types cannot say: no control character in the id, and times that stay finite and
    within MAX_MODEL_S (msgspec's ge=0 rejects NaN and -inf but lets +inf through: JSON 1e999)."""
    if _CONTROL_RE.search(s.session_id) or not _utf8(s.session_id):
        raise TraceError(source, line, "session_id", f"{_REQUIREMENT['session_id']} (got {_short(s.session_id)})")
    if not s.arrival_s <= MAX_MODEL_S:
        raise TraceError(source, line, "arrival_s", f"{_REQUIREMENT['arrival_s']} (got {_short(s.arrival_s)})")
    end = s.arrival_s
    for i, c in enumerate(s.calls):
        if not math.isfinite(c.tool_s):
            raise TraceError(source, line, f"calls[{i}].tool_s", f"{_REQUIREMENT['tool_s']} (got {_short(c.tool_s)})")
        end += c.tool_s
        if end > MAX_MODEL_S:
            raise TraceError(source, line, f"calls[{i}].tool_s",
                             f"arrival_s plus the tool gaps so far reach {end:g} s, past {MAX_MODEL_S:,.0f} s "
                             f"(model-second arithmetic would lose precision)")


def parse_trace(
    text: str, *, source: str = "<trace>", known_models: Iterable[str] | None = None,
    context_limits: Mapping[str, int] | None = None,
) -> list[TraceSession]:
    """Parse a whole JSONL trace; raise TraceError at the first bad line (nothing partial is returned).

    Blank lines are skipped. With `known_models`, a session naming another model
    is an error here, i.e. before any replay starts. With `context_limits` (model
    -> tokens), so is a session whose context (a call's prompt plus its output)
    passes its model's limit: the router would refuse that call mid-replay, and
    the simulator has no router to refuse it.
    """
    known = None if known_models is None else frozenset(known_models)
    sessions: list[TraceSession] = []
    first_line: dict[str, int] = {}
    # "\n" alone ends a line: splitlines() also split at U+2028 and U+2029, which JSON strings may hold raw
    for lineno, raw_line in enumerate(text.split("\n"), start=1):
        raw_line = raw_line.removesuffix("\r")
        if not raw_line.strip():
            continue
        # json (not msgspec.json) so NaN/Infinity/1e999 reach validation and get a field name.
        try:
            raw = json.loads(raw_line)
        except json.JSONDecodeError as exc:
            raise TraceError(source, lineno, "", f"invalid JSON: {exc.msg.removesuffix(' at')} at column {exc.colno}") from None
        except RecursionError:  # (nesting past the parser's depth, even in a field the format ignores)
            raise TraceError(source, lineno, "", "invalid JSON: nested too deeply") from None
        except ValueError:  # an integer of more digits than Python converts
            raise TraceError(source, lineno, "", "invalid JSON: an integer of more than "
                             f"{sys.get_int_max_str_digits()} digits") from None
        try:
            session = msgspec.convert(raw, TraceSession)
        except msgspec.ValidationError as exc:
            raise _translate(exc, raw, source, lineno) from None
        _check_values(session, source, lineno)
        if session.session_id in first_line:
            raise TraceError(
                source,
                lineno,
                "session_id",
                f"duplicate session_id {session.session_id!r} (lines {first_line[session.session_id]} and {lineno})",
            )
        if known is not None and session.model not in known:
            raise TraceError(
                source, lineno, "model", f"unknown model {session.model!r}; the catalog has {sorted(known)}"
            )
        if context_limits is not None and session.model in context_limits:
            _check_context(session, context_limits[session.model], source, lineno)
        first_line[session.session_id] = lineno
        sessions.append(session)
    return sessions


def _check_context(s: TraceSession, limit: int, source: str, line: int) -> None:
    for i, ((prompt, _), call) in enumerate(zip(session_prompts(s), s.calls)):
        if prompt + call.output_tokens > limit:
            raise TraceError(source, line, f"calls[{i}]",
                             f"context of {prompt + call.output_tokens} tokens (prompt {prompt} + output "
                             f"{call.output_tokens}) passes {s.model}'s context limit of {limit} "
                             f"(mark an earlier call compact)")


def load_trace(path: str | Path, known_models: Iterable[str] | None = None,
               context_limits: Mapping[str, int] | None = None) -> list[TraceSession]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")  # a leading byte-order mark (as some editors write) is dropped
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise TraceError(str(p), 0, "", f"cannot read the trace: {reason}") from None
    return parse_trace(text, source=str(p), known_models=known_models, context_limits=context_limits)


def load_runnable_trace(path: str | Path, catalog: "Catalog") -> list[TraceSession]:
    """A trace to run (sim, replay, chaos): every model in the catalog, every
    context within its model's limit, and at least one session; checked before
    anything starts."""
    sessions = load_trace(path, known_models=catalog.models,
                          context_limits={name: m.context_limit for name, m in catalog.models.items()})
    if not sessions:
        raise TraceError(str(path), 0, "", "trace has no sessions")
    return sessions


_encoder = msgspec.json.Encoder()


def encode_trace(sessions: Iterable[TraceSession]) -> bytes:
    """The JSONL bytes of `sessions`: one compact object per line in field order, trailing newline."""
    return b"".join(_encoder.encode(s) + b"\n" for s in sessions)


def dump_trace(sessions: Iterable[TraceSession], path: str | Path) -> None:
    Path(path).write_bytes(encode_trace(sessions))


def session_prompts(session: TraceSession) -> list[tuple[int, int]]:
    """Per call, (prompt_tokens, reusable_prefix_tokens).

    The prompt is everything since the last compaction (earlier inputs and
    outputs) plus this call's new input; the reusable prefix is that earlier
    part. A compact call restarts the context, so its prefix is 0, as is the
    first call's.
    """
    out: list[tuple[int, int]] = []
    context = 0
    for call in session.calls:
        if call.compact:
            context = 0
        prompt = context + call.new_input_tokens
        out.append((prompt, context))
        context = prompt + call.output_tokens
    return out
