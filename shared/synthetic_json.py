"""A JSON value that a JSON Schema admits, made up deterministically (pure; no I/O).

The sim engine has no model, yet an agent on it should see replies its code can
parse: a tool call's arguments of the tool's schema, and for structured output
(`response_format`, `text.format`) a JSON text of the requested schema, as a real
engine's structured output would produce. `example` builds the smallest
informative value: every required property (every property where the schema
lists none), arrays at their least length (one item where allowed),
numbers inside their bounds, strings of their format and length bounds.

It covers what agents' schemas use (OpenAI's strict structured outputs, pydantic's
`model_json_schema()`, tool parameters): `type` (or a list of types), `properties`,
`required`, `items` and `prefixItems`, `enum`, `const`, `anyOf` / `oneOf` (the
first branch that is not null), `allOf` (merged), local `$ref`s into `$defs` or
`definitions`, numeric and length bounds (also where Anthropic's SDK writes them
into the description), and the common string formats. A
`pattern` is not followed (no regular-expression inverse); a recursive schema
ends past `MAX_DEPTH`, where arrays take their least length and `anyOf` its
null branch.
"""

from __future__ import annotations

import hashlib
import math
import re
import uuid
from collections.abc import Mapping
from typing import Any

MAX_DEPTH = 12  # past it arrays take their least length and anyOf its null branch
_GIVE_UP_DEPTH = 4 * MAX_DEPTH
MAX_VALUES = 10_000  # values in one example, and characters in one string: a schema that asks more is refused

_FORMATS = {
    "date-time": "2026-01-01T00:00:00Z",
    "date": "2026-01-01",
    "time": "00:00:00Z",
    "duration": "PT1S",
    "email": "synthetic@example.com",
    "hostname": "example.com",
    "ipv4": "192.0.2.1",
    "ipv6": "2001:db8::1",
    "uri": "https://example.com/synthetic",
    "uri-reference": "https://example.com/synthetic",
    "url": "https://example.com/synthetic",
}


class TooLarge(ValueError):
    """The schema's least value is too large or too deep to make (a request's schema may be hostile)."""


def example(schema: Any, seed: str) -> Any:
    """A value `schema` admits (a JSON Schema as parsed JSON); the same for the same seed.
    Raises TooLarge where that value would pass `MAX_VALUES` or nest without end, and
    ValueError for a schema no value can meet as written (a bound that is not a number)."""
    root = schema if isinstance(schema, Mapping) else {}
    try:
        return _value(schema, seed, root, 0, [MAX_VALUES])
    except RecursionError as e:
        raise TooLarge("the schema nests too deep") from e
    except (TypeError, OverflowError) as e:
        raise ValueError(f"the schema has a keyword of the wrong kind: {e}") from e


def _digest(seed: str) -> int:
    return int(hashlib.sha256(seed.encode()).hexdigest()[:12], 16)


def _resolve(schema: Mapping[str, Any], root: Mapping[str, Any], depth: int) -> Mapping[str, Any]:
    """`schema` with its local `$ref` followed and its `allOf` merged into it."""
    if depth >= _GIVE_UP_DEPTH:
        raise TooLarge("the schema refers to itself without end")
    seen = 0
    while isinstance(schema.get("$ref"), str) and seen < MAX_DEPTH:
        target: Any = root
        ref = schema["$ref"]
        if not ref.startswith("#"):
            break  # a remote reference: nothing to follow here
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, Mapping) else None
        if not isinstance(target, Mapping):
            break
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        seen += 1
    parts = schema.get("allOf")
    if isinstance(parts, list) and parts:
        merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
        for part in parts:
            if not isinstance(part, Mapping):
                continue
            part = _resolve(part, root, depth + 1)
            for k, v in part.items():
                if k == "properties" and isinstance(v, Mapping):
                    merged["properties"] = {**(merged.get("properties") or {}), **v}
                elif k == "required" and isinstance(v, list):
                    merged["required"] = list(dict.fromkeys([*(merged.get("required") or []), *v]))
                else:
                    merged.setdefault(k, v)
        schema = merged
    return schema


# Bounds a schema states in its description rather than as keywords: Anthropic's SDK moves
# those its structured outputs do not take there, as "{minimum: 1, maxItems: 3}", for the
# model to read, and validates the reply against the full model afterwards.
_DESCRIBED_BOUND = re.compile(r"\b(minimum|maximum|exclusiveMinimum|exclusiveMaximum|multipleOf|minItems|maxItems|"
                              r"minLength|maxLength): (-?\d+(?:\.\d+)?)(?=[,}])")


def _with_described_bounds(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    text = schema.get("description")
    if not isinstance(text, str) or "{" not in text:
        return schema
    found = {k: float(v) if "." in v else int(v) for k, v in _DESCRIBED_BOUND.findall(text[text.rfind("{"):])}
    return {**found, **schema} if found else schema


def _value(schema: Any, seed: str, root: Mapping[str, Any], depth: int, budget: list[int]) -> Any:
    budget[0] -= 1
    if budget[0] < 0:
        raise TooLarge(f"the schema's least value has over {MAX_VALUES} parts")
    if not isinstance(schema, Mapping):
        return "synthetic" if schema is not False else None  # `true` admits anything
    schema = _with_described_bounds(_resolve(schema, root, depth))
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    deep = depth >= MAX_DEPTH
    for key in ("anyOf", "oneOf"):
        listed = schema.get(key)
        branches = [b for b in listed if isinstance(b, Mapping)] if isinstance(listed, list) else []
        if branches:
            # the first informative branch; past the depth bound the null one, to end a recursion
            nulls = [b for b in branches if _resolve(b, root, depth).get("type") == "null"]
            chosen = (nulls[0] if deep and nulls else
                      next((b for b in branches if _resolve(b, root, depth).get("type") != "null"), branches[0]))
            rest = {k: v for k, v in schema.items() if k != key}
            return _value({**rest, **chosen}, seed, root, depth + 1, budget)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
    if kind is None:
        if "properties" in schema or "required" in schema:
            kind = "object"
        elif "items" in schema or "prefixItems" in schema:
            kind = "array"
        else:
            kind = "string"
    match kind:
        case "object":
            props = schema.get("properties")
            props = props if isinstance(props, Mapping) else {}
            required = schema.get("required")
            names = [k for k in (required if isinstance(required, list) and required else list(props))
                     if isinstance(k, str)]
            extra = schema.get("additionalProperties")
            return {k: _value(props.get(k, extra if isinstance(extra, Mapping) else {}), f"{seed}:{k}", root,
                              depth + 1, budget) for k in names}
        case "array":
            return _array(schema, seed, root, depth, budget)
        case "integer":
            return _integer(schema, seed)
        case "number":
            return _number(schema)
        case "boolean":
            return True
        case "null":
            return None
        case _:
            return _string(schema, seed)


def _array(schema: Mapping[str, Any], seed: str, root: Mapping[str, Any], depth: int,
           budget: list[int]) -> list[Any]:
    prefix = schema.get("prefixItems")
    prefix = prefix if isinstance(prefix, list) else []
    least = _count(schema.get("minItems"))
    most = schema.get("maxItems")
    items = schema.get("items")
    n = max(least, len(prefix), 1 if items not in (None, False) else 0)
    if isinstance(most, int):
        n = min(n, most)
    if depth >= MAX_DEPTH:
        n = min(n, least)
    out = []
    for i in range(n):
        sub = prefix[i] if i < len(prefix) else (items if isinstance(items, Mapping) else {})
        out.append(_value(sub, f"{seed}[{i}]", root, depth + 1, budget))
    return out


def _count(v: Any) -> int:
    """A size keyword's value (minItems, minLength), refused past MAX_VALUES."""
    n = v if isinstance(v, int) and not isinstance(v, bool) else 0
    if n > MAX_VALUES:
        raise TooLarge(f"the schema asks for over {MAX_VALUES} items or characters")
    return max(0, n)


def _integer(schema: Mapping[str, Any], seed: str) -> int:
    lo, hi = _bounds(schema, integer=True)
    step = schema.get("multipleOf")
    step = int(step) if isinstance(step, (int, float)) and step >= 1 and float(step).is_integer() else 1
    value = int(hashlib.sha256(seed.encode()).hexdigest()[:4], 16) % 100
    if lo is not None and value < lo:
        value = math.ceil(lo)
    if hi is not None and value > hi:
        value = math.floor(hi)
    value = (value // step) * step
    if lo is not None and value < lo:
        value += step
    return int(value)


def _number(schema: Mapping[str, Any]) -> float | int:
    """A whole number where one fits the bounds (as a model writes `1000` for a timeout, and
    clients that declare `number` often read an integer: Codex's `i32`s), else a fraction."""
    lo, hi = _bounds(schema, integer=False)
    if lo is not None and hi is not None:
        value = (lo + hi) / 2
    elif lo is not None:
        value = float(lo) + 1
    elif hi is not None:
        value = float(hi) - 1
    else:
        value = 1.0
    step = _num(schema, "multipleOf")
    if step is not None and step > 0 and abs(value / step) < 2 ** 53:
        near = [step * f(value / step) for f in (round, math.floor, math.ceil)]  # (the multiples nearest)
    else:
        near = [round(value), math.floor(value), math.ceil(value)]
    fits = [c for c in near if abs(c) < 2 ** 53 and _admits(schema, c)]
    if fits:
        return int(fits[0]) if float(fits[0]).is_integer() else fits[0]
    if lo is not None and hi is None:
        return float(lo) + 0.5
    if hi is not None and lo is None:
        return float(hi) - 0.5
    return value


def _num(schema: Mapping[str, Any], key: str) -> float | None:
    """A numeric keyword's value (a bound, `multipleOf`); None where it is not a number."""
    v = schema.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _admits(schema: Mapping[str, Any], value: float) -> bool:
    """Whether `value` meets the schema's numeric bounds and its `multipleOf`."""
    lo, hi, xlo, xhi, step = (_num(schema, k) for k in
                              ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"))
    if (lo is not None and value < lo) or (hi is not None and value > hi) \
            or (xlo is not None and value <= xlo) or (xhi is not None and value >= xhi):
        return False
    if step is None or step <= 0:
        return True
    q = value / step
    return math.isfinite(q) and abs(q) < 2 ** 53 and math.isclose(q, round(q), abs_tol=1e-9)


def _bounds(schema: Mapping[str, Any], integer: bool) -> tuple[float | None, float | None]:
    lo, hi = _num(schema, "minimum"), _num(schema, "maximum")
    xlo, xhi = _num(schema, "exclusiveMinimum"), _num(schema, "exclusiveMaximum")
    gap = 1.0 if integer else 0.0
    if xlo is not None and (lo is None or xlo >= lo):
        lo = xlo + gap if integer else xlo
    if xhi is not None and (hi is None or xhi <= hi):
        hi = xhi - gap if integer else xhi
    if integer:
        lo = math.floor(lo) + (0 if float(lo).is_integer() else 1) if lo is not None else None
        hi = math.floor(hi) if hi is not None else None
    return lo, hi


def _string(schema: Mapping[str, Any], seed: str) -> str:
    fmt = schema.get("format")
    if fmt == "uuid":
        text = str(uuid.UUID(int=_digest(seed) << 80 | _digest(seed + "/") & ((1 << 80) - 1), version=4))
    else:
        text = _FORMATS.get(fmt) if isinstance(fmt, str) else None
        text = text or "synthetic-" + hashlib.sha256(seed.encode()).hexdigest()[:8]
    least, most = _count(schema.get("minLength")), schema.get("maxLength")
    if len(text) < least:
        text = (text + "-" * least)[:least]
    if isinstance(most, int) and not isinstance(most, bool) and len(text) > max(0, most):
        text = text[:most]
    return text
