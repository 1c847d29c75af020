"""Tool calls: from a model's text to each API's shape, and back (pure; no I/O).

An engine returns tokens, not tool calls: a model that calls a tool writes the
call in its own format, and a per-model parser finds it (as vLLM's
`--tool-call-parser` does). The catalog names each model's format
(`tool_call_format`):

- `hermes` (Qwen3): one JSON object per call between tags,
  `<tool_call>\\n{"name": "read_file", "arguments": {"path": "a.py"}}\\n</tool_call>`;
- `glm45` (GLM-4.5, GLM-4.5-Air): the name, then each argument as a key/value
  pair, `<tool_call>read_file\\n<arg_key>path</arg_key>\\n<arg_value>a.py</arg_value>\\n</tool_call>`;
  a value is the string itself, or JSON where the tool's schema says the
  parameter is not a string;
- `pythonic` (Llama 4, as vLLM's `llama4_pythonic` parser reads it): the whole reply
  is a Python list of calls with keyword arguments of literal values,
  `[read_file(path="a.py", limit=40), run_tests()]`, optionally between
  `<|python_start|>` and `<|python_end|>`; a reply with anything else in it is text;
- `harmony` (gpt-oss, `shared/harmony.py`): a call is a message on the `commentary`
  channel addressed to the tool, its JSON arguments the message,
  `<|start|>assistant<|channel|>commentary to=functions.read_file <|constrain|>json<|message|>{"path": "a.py"}<|call|>`;
- `none`: no parser yet; a request with tools is refused by name (400).

`render` writes calls in a format (what a model would have written): the sim
engine's synthetic mode uses it, and it is the inverse the parsers are tested
against. `synthetic_call` picks a tool and fills its required arguments from
the tool's JSON schema (`shared/synthetic_json.py`), so an agent's loop runs on
well-formed calls on the sim engine (docs/front-door.md).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import keyword
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shared import harmony, synthetic_json
from shared.catalog import TOOL_CALL_FORMATS

FORMATS = TOOL_CALL_FORMATS  # (the catalog's `tool_call_format` is checked against them as it loads)

# Objects and arrays a schema may nest (32 levels of `properties`; tools' schemas nest a
# handful): the metaschema check, the grammar and the sim engine's made-up arguments all
# recurse on it, and one nested some 200 deep passed the gateway's check yet failed the
# engine's (less stack left there), so its call was refused and sent again for ever
MAX_SCHEMA_DEPTH = 64

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_GLM_CALL = re.compile(r"<tool_call>\s*([^\n<]*?)\s*(?:\n|(?=<arg_key>)|(?=</tool_call>))(.*?)</tool_call>", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def schema_error(schema: Mapping[str, Any]) -> str | None:
    """Why `schema` is not a JSON Schema (checked against its metaschema, draft 2020-12
    unless it names another), or None: what both APIs refuse in a tool's parameters or a
    structured output (`"type": "strin"`), and vLLM's grammar cannot enforce."""
    if (why := schema_depth_error(schema)) is not None:  # (before it is written out: a deep one cannot be)
        return why
    return schema_text_error(json.dumps(schema, separators=(",", ":")))


def schema_depth_error(schema: Any) -> str | None:
    """Why `schema` nests too deep to be checked, written out or used (else None)."""
    depth = json_depth(schema)
    return _too_deep(depth) if depth > MAX_SCHEMA_DEPTH else None


def _too_deep(depth: int | None) -> str:
    return f"it nests {'over 900' if depth is None else depth} objects and arrays deep, over {MAX_SCHEMA_DEPTH}"


def json_depth(value: Any) -> int:
    """How deep `value`'s objects and arrays nest (0 for a scalar); without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, depth = todo.pop()
        items = v.values() if isinstance(v, Mapping) else v if isinstance(v, list) else None
        if items is not None:
            deepest = max(deepest, depth)
            todo.extend((item, depth + 1) for item in items)
    return deepest


@functools.lru_cache(maxsize=1024)  # (an agent sends the same tools with every call)
def schema_text_error(text: str) -> str | None:
    """`schema_error` of a schema already written as JSON text (checked once per text)."""
    from jsonschema import Draft202012Validator, SchemaError, validators

    try:
        schema = json.loads(text)
    except RecursionError:
        return _too_deep(None)
    if (why := schema_depth_error(schema)) is not None:
        return why
    if isinstance(schema, Mapping) and "$schema" in schema and not isinstance(schema["$schema"], str):
        return "$schema must be a metaschema's URI (a string)"  # (jsonschema raised on it)
    try:
        validators.validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        return exc.message[:200] + (f" (at {where})" if where else "")
    except (RecursionError, ValueError, TypeError, AttributeError, LookupError) as exc:
        return f"it cannot be checked against its metaschema ({type(exc).__name__})"  # (a schema, not a server, fault)
    return None


class ToolsError(ValueError):
    """A request's tools or tool choice the gateway refuses (400), naming the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's shape: a message's `tool_calls` entry, or with `index` a streamed delta's."""
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}
        return out if index is None else {"index": index, **out}

    @property
    def anthropic_id(self) -> str:
        """The id in Anthropic's style (`toolu_...`, as its API writes them), the same hash."""
        return "toolu_" + self.id.removeprefix("call_")

    def anthropic(self) -> dict[str, Any]:
        return {"type": "tool_use", "id": self.anthropic_id, "name": self.name, "input": self.arguments}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments


def _call_id(call_key: str, i: int) -> str:
    return "call_" + hashlib.sha256(f"{call_key}:{i}".encode()).hexdigest()[:24]


# -- requests ----------------------------------------------------------------------------------------
def openai_tools(body: Mapping[str, Any]) -> tuple[list[Tool], str | None]:
    """The request's tools and its tool choice (None: the model decides; `none`; or a tool's name)."""
    raw = body.get("tools")
    for i, t in enumerate(raw if isinstance(raw, list) else []):
        kind = t.get("type") if isinstance(t, Mapping) else None
        if isinstance(kind, str) and kind != "function":  # (a tool of another type had been told it had no name)
            where = "custom (freeform) tools are served on the Responses API, /v1/responses" if kind == "custom" else \
                "only function tools are served here"
            raise ToolsError(f"tools[{i}].type {kind[:40]!r} is not served on chat completions: {where}",
                             f"tools[{i}].type")
    return _tools(raw, "tools", lambda t: (t.get("function") if t.get("type") == "function" else None),
                  "parameters", "function.parameters"), _openai_choice(body.get("tool_choice"))


def anthropic_tools(body: Mapping[str, Any]) -> tuple[list[Tool], str | None]:
    """Messages' tools as the model sees them: the custom ones (a name and an `input_schema`),
    and Anthropic's typed tools that the agent itself runs (`bash_...`, `text_editor_...`,
    `memory_...`) with the arguments Anthropic documents for them (`anthropic_client_tool`).
    Anthropic's other typed tools (`web_search_...`, `web_fetch_...`, `code_execution_...`,
    `computer_...`, the MCP connector's) are left out: the server ones run on Anthropic's
    servers and the computer needs screenshots, so a model here that called one would hand
    the agent a call it cannot run (Claude Code offers web search this way wherever it is
    pointed)."""
    raw = body.get("tools")
    if isinstance(raw, list):
        for i, t in enumerate(raw):
            kind = t.get("type") if isinstance(t, Mapping) else None
            if kind is not None and kind != "custom" and not anthropic_builtin(t):
                raise ToolsError(f"tools[{i}].type {str(kind)[:100]!r} is not a Messages tool (custom, or one of "
                                 "Anthropic's own such as web_search_20250305); an OpenAI function tool is "
                                 "written {name, description, input_schema} here", f"tools[{i}].type")
        raw = [anthropic_client_tool(t) or t for t in raw if not anthropic_left_out(t)]
    return _tools(raw, "tools", lambda t: t, "input_schema"), _anthropic_choice(body.get("tool_choice"))


# Anthropic's own tools are typed by name and version date (`bash_20250124`); the MCP
# connector's tool set is the one without a date
_ANTHROPIC_TOOL_TYPE = re.compile(r"[a-z][a-z0-9_]*_\d{8}|mcp_toolset")


def anthropic_builtin(tool: Any) -> bool:
    """One of Anthropic's own typed tools (`web_search_20250305`, `mcp_toolset`, ...)."""
    return isinstance(tool, Mapping) and isinstance(tool.get("type"), str) \
        and _ANTHROPIC_TOOL_TYPE.fullmatch(tool["type"]) is not None


def anthropic_left_out(tool: Any) -> bool:
    """One of Anthropic's typed tools that no model here is offered (no agent-run schema)."""
    return anthropic_builtin(tool) and anthropic_client_tool(tool) is None


# The arguments of Anthropic's client-run tools, as its tool docs describe them (the request
# names the tool; its schema is Anthropic's, not in the request). The text editor lost
# `undo_edit` in its 2025-04-29 version; the memory tool works on files under /memories.
_STR = {"type": "string"}
_EDITOR = {"path": {"type": "string", "description": "absolute path of the file or folder"},
           "file_text": {"type": "string", "description": "the new file's content (create)"},
           "old_str": {"type": "string", "description": "the exact text to replace, found once (str_replace)"},
           "new_str": {"type": "string", "description": "the replacement (str_replace) or the text to insert (insert)"},
           "insert_line": {"type": "integer", "minimum": 0, "description": "insert after this line, 0 for the top"},
           "view_range": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2,
                          "description": "first and last line to view, from 1; -1 for the end"}}
_MEMORY = {"path": _STR, "file_text": _STR, "old_str": _STR, "new_str": _STR,
           "insert_line": {"type": "integer", "minimum": 0}, "insert_text": _STR,
           "view_range": _EDITOR["view_range"], "old_path": _STR, "new_path": _STR}


def _object(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required}


def anthropic_client_tool(tool: Any) -> dict[str, Any] | None:
    """A typed tool the agent runs, as a custom tool (its name, a description, the schema of
    the arguments Anthropic documents for it); None for any other."""
    if not anthropic_builtin(tool) or not isinstance(tool.get("name"), str):
        return None
    family, _, version = str(tool["type"]).rpartition("_")
    if family == "bash":
        schema = _object({"command": {"type": "string", "description": "the shell command to run"},
                          "restart": {"type": "boolean", "description": "restart the shell instead"}}, [])
        desc = "Run a command in a persistent bash shell; its output comes back."
    elif family == "text_editor":
        commands = ["view", "create", "str_replace", "insert"] + (["undo_edit"] if version < "20250429" else [])
        schema = _object({"command": {"type": "string", "enum": commands}, **_EDITOR}, ["command", "path"])
        desc = "View, create and edit text files: " + ", ".join(commands) + "."
    elif family == "memory":
        commands = ["view", "create", "str_replace", "insert", "delete", "rename"]
        schema = _object({"command": {"type": "string", "enum": commands}, **_MEMORY}, ["command"])
        desc = "Keep notes across conversations as files under /memories: " + ", ".join(commands) + "."
    else:
        return None
    return {"name": tool["name"], "description": desc, "input_schema": schema}


def _tools(raw: Any, param: str, inner: Any, schema_field: str, schema_path: str | None = None) -> list[Tool]:
    """`schema_path`: where the schema is within a tool, as the request writes it (chat's
    `function.parameters`), for the field a refusal names."""
    where = schema_path or schema_field
    within = where.rpartition(".")[0] + "." if "." in where else ""  # chat's `function.`, for the name too
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ToolsError(f"{param} must be a list", param)
    out: list[Tool] = []
    for i, t in enumerate(raw):
        f = inner(t) if isinstance(t, Mapping) else None
        if not isinstance(f, Mapping) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ToolsError(f"{param}[{i}] must be a function tool with a name", f"{param}[{i}]")
        name_at = f"{param}[{i}].{within}name"
        if not TOOL_NAME.fullmatch(f["name"]):  # (both APIs' rule; a call names its tool in the model's text)
            raise ToolsError(f"{name_at} must be 1-128 letters, digits, _ or -", name_at)
        if any(o.name == f["name"] for o in out):
            raise ToolsError(f"{name_at}: two tools are named {f['name']!r}", name_at)
        schema = f.get(schema_field) or {"type": "object", "properties": {}}
        if not isinstance(schema, Mapping):
            raise ToolsError(f"{param}[{i}].{where} must be a JSON schema object", f"{param}[{i}].{where}")
        if (why := schema_error(schema)) is not None:
            raise ToolsError(f"{param}[{i}].{where} is not a valid JSON Schema: {why}", f"{param}[{i}].{where}")
        if schema.get("type", "object") != "object":
            # (both APIs' rule: a call's arguments are named, so an object; an engine told
            # otherwise would hand back arguments that break the schema it was given)
            raise ToolsError(f"{param}[{i}].{where} must be a JSON Schema of type object, not "
                             f"{str(schema['type'])[:100]!r}", f"{param}[{i}].{where}")
        desc = f.get("description") or ""
        out.append(Tool(f["name"], desc if isinstance(desc, str) else "", dict(schema)))
    return out


TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")  # Anthropic's pattern; OpenAI's is the same up to 64


# the tool choice that asks for a call of any of the tools (OpenAI's "required", Anthropic's
# {"type": "any"}); no tool can be named this (names are letters, digits, _ and -)
ANY_TOOL = "*"


def _openai_choice(choice: Any) -> str | None:
    if choice in (None, "auto"):
        return None
    if choice == "required":
        return ANY_TOOL
    if choice == "none":
        return "none"
    if isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping) \
            and isinstance(choice["function"].get("name"), str):
        return choice["function"]["name"]
    raise ToolsError("tool_choice must be none, auto, required or a function", "tool_choice")


def _anthropic_choice(choice: Any) -> str | None:
    if choice is None:
        return None
    if isinstance(choice, Mapping):
        kind = choice.get("type")
        if kind == "auto":
            return None
        if kind == "any":
            return ANY_TOOL
        if kind == "none":
            return "none"
        if kind == "tool" and isinstance(choice.get("name"), str):
            return choice["name"]
    raise ToolsError("tool_choice must be auto, any, none or a tool", "tool_choice")


def tools_text(tools: Sequence[Tool]) -> str:
    """The tools as JSON: what the prompt carries (a chat template puts them in its
    system part) and the engine hint's `tools_json`. Each schema keeps the order its
    agent declared (a forced call's arguments are decoded in its properties' order, as
    vLLM's server does; sorted, `read_file(path, line)` began with the optional line)."""
    return json.dumps([{"description": t.description, "name": t.name, "parameters": t.parameters} for t in tools])


def tools_from_json(text: str) -> list[Tool]:
    """`tools_text`'s inverse (ValueError on anything else)."""
    raw = json.loads(text)
    if not isinstance(raw, list):
        raise ValueError("tools_json must be a list")
    return _tools(raw, "tools_json", lambda t: t, "parameters")


# -- the engine's text -> calls ------------------------------------------------------------------------
def parse(text: str, fmt: str, tools: Sequence[Tool], call_key: str) -> tuple[str, list[ToolCall]]:
    """(the text outside the calls, the calls) found in a model's output. A call that does
    not parse (bad JSON, an unknown tool) stays in the text: the agent sees what the model wrote."""
    if fmt == "hermes":
        return _parse_hermes(text, tools, call_key)
    if fmt == "glm45":
        return _parse_glm45(text, tools, call_key)
    if fmt == "pythonic":
        return _parse_pythonic(text, tools, call_key)
    if fmt == "harmony":
        return _parse_harmony(text, tools, call_key)
    return text, []


def _parse_hermes(text: str, tools: Sequence[Tool], call_key: str) -> tuple[str, list[ToolCall]]:
    known = {t.name for t in tools}
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for m in _HERMES.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or obj.get("name") not in known:
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                continue
        if not isinstance(args, dict):
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append(ToolCall(_call_id(call_key, len(calls)), obj["name"], args))
    kept.append(text[last:])
    return "".join(kept).strip(), calls


def _parse_glm45(text: str, tools: Sequence[Tool], call_key: str) -> tuple[str, list[ToolCall]]:
    by_name = {t.name: t for t in tools}
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for m in _GLM_CALL.finditer(text):
        name = m.group(1).strip()
        tool = by_name.get(name)
        if tool is None:
            continue
        props = tool.parameters.get("properties") or {}
        args: dict[str, Any] = {}
        for k, v in _GLM_ARG.findall(m.group(2)):
            k = k.strip()
            typ = (props.get(k) or {}).get("type") if isinstance(props.get(k), Mapping) else None
            # a string as written, edge newlines too (GLM's template writes the value bare
            # between its tags, so a file's trailing newline is the file's)
            if typ == "string" or typ is None and not _looks_json(v):
                args[k] = v
            else:
                try:
                    args[k] = json.loads(v)
                except ValueError:
                    args[k] = v
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append(ToolCall(_call_id(call_key, len(calls)), name, args))
    kept.append(text[last:])
    return "".join(kept).strip(), calls


def _parse_harmony(text: str, tools: Sequence[Tool], call_key: str) -> tuple[str, list[ToolCall]]:
    """Each message addressed to a known tool (`functions.<name>`, or the bare name) whose
    content is a JSON object is a call, ended or not (the engine's text leaves out the
    `<|call|>` it stopped on; arguments cut off by the token bound are no JSON object);
    the other messages' contents are the text, a message to anything else in its markup."""
    known = {t.name for t in tools}
    calls: list[ToolCall] = []
    kept: list[str] = []
    for m in harmony.messages(text):
        if m.is_call and (name := harmony.tool_name(m.recipient)) in known:
            try:
                args = json.loads(m.content)
            except ValueError:
                args = None
            if isinstance(args, dict):
                calls.append(ToolCall(_call_id(call_key, len(calls)), name, args))
                continue
        kept.append(harmony.markup(m) if m.is_call else m.content)
    return "\n\n".join(k.strip() for k in kept if k.strip()), calls


_PY_START, _PY_END = "<|python_start|>", "<|python_end|>"
_PY_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def _parse_pythonic(text: str, tools: Sequence[Tool], call_key: str) -> tuple[str, list[ToolCall]]:
    """The whole reply as a list of calls of known tools, each with keyword arguments only
    (a key that is no Python name as `**{"key": value}`, as `render` writes it), their
    values literals (JSON's spellings of true, false and null taken too); else all text.
    A tool named as no Python name can be (`copy-file`: both APIs allow `-`) is read under
    a stand-in name, put back in the call and in any string that held it."""
    body = text.strip()
    if body.startswith(_PY_START):
        body = body[len(_PY_START):].replace(_PY_END, "").strip()
    if not (body.startswith("[") and body.endswith("]")):
        return text.strip(), []
    stand_ins = {f"_tool{i}_{hashlib.sha256(t.name.encode()).hexdigest()[:8]}": t.name for i, t in enumerate(tools)
                 if not t.name.isidentifier() or keyword.iskeyword(t.name)}
    if any(alias in body for alias in stand_ins):
        return text.strip(), []
    for alias, name in sorted(stand_ins.items(), key=lambda kv: -len(kv[1])):  # (a name inside a longer one: after it)
        body = re.sub(re.escape(name) + r"(?=\s*\()", alias, body)

    def named(v: str) -> str:
        for alias, name in stand_ins.items():
            v = v.replace(alias, name)
        return v

    known = {t.name for t in tools}
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return text.strip(), []
        calls: list[ToolCall] = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and (name := stand_ins.get(node.func.id, node.func.id)) in known and not node.args):
                return text.strip(), []
            args: dict[str, Any] = {}
            for kw in node.keywords:
                value = _py_value(kw.value, named)
                if kw.arg is not None:
                    args[kw.arg] = value
                elif isinstance(value, dict):
                    args.update(value)
                else:
                    return text.strip(), []
            calls.append(ToolCall(_call_id(call_key, len(calls)), name, args))
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # (a model's text: anything may come)
        return text.strip(), []
    return "", calls


def _py_value(node: ast.expr, named: Callable[[str], str] = str) -> Any:
    """A literal's JSON value (ValueError for anything else: a name, a call, an operator);
    `named`: each string as it was before the parser's stand-in names."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return named(node.value)
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (int, float, bool))):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and isinstance(node.operand.value, (int, float)) and not isinstance(node.operand.value, bool):
        return -node.operand.value
    if isinstance(node, ast.Name) and node.id in _PY_NAMES:
        return _PY_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_py_value(e, named) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
                raise ValueError("a dict key that is not a string")
            out[named(k.value)] = _py_value(v, named)
        return out
    raise ValueError(f"not a literal: {type(node).__name__}")


def _py_literal(v: Any) -> str:
    """A JSON value as a Python literal (`_py_value`'s inverse)."""
    if isinstance(v, bool) or v is None:
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # (a JSON string literal is a Python one)
    if isinstance(v, (int, float)):
        return json.dumps(v)
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(k), ensure_ascii=False)}: {_py_literal(x)}" for k, x in v.items()) + "}"
    return "[" + ", ".join(_py_literal(x) for x in v) + "]"


def _py_call(name: str, args: Mapping[str, Any]) -> str:
    named = [f"{k}={_py_literal(v)}" for k, v in args.items() if k.isidentifier() and not keyword.iskeyword(k)]
    other = {k: v for k, v in args.items() if not (k.isidentifier() and not keyword.iskeyword(k))}
    return f"{name}({', '.join(named + ([f'**{_py_literal(other)}'] if other else []))})"


def _looks_json(v: str) -> bool:
    v = v.strip()
    return v[:1] in ("{", "[") or v in ("true", "false", "null") or bool(re.fullmatch(r"-?\d+(\.\d+)?([eE][-+]?\d+)?", v))


# -- calls -> a model's text (the inverse; the sim engine's synthetic mode) ------------------------------
def render(calls: Sequence[tuple[str, Mapping[str, Any]]], fmt: str) -> str:
    if fmt == "harmony":
        return "".join(harmony.call_markup(name, json.dumps(args)) for name, args in calls)
    out = []
    for name, args in calls:
        if fmt == "pythonic":
            out.append(_py_call(name, args))
        elif fmt == "glm45":
            pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
                            for k, v in args.items())
            out.append(f"<tool_call>{name}\n{pairs}</tool_call>")
        else:
            out.append(f"<tool_call>\n{json.dumps({'name': name, 'arguments': dict(args)})}\n</tool_call>")
    return "[" + ", ".join(out) + "]" if fmt == "pythonic" else "\n".join(out)


# A call forced by `tool_choice` naming a tool: its text before and after the JSON object
# {"name": ..., "arguments": ...} (formats whose calls are one JSON object only)
_JSON_CALL_TAGS = {"hermes": ("<tool_call>\n", "\n</tool_call>")}
# how each format opens a call (harmony's calls are not constrained: its markup is special tokens)
CALL_OPENS = {"hermes": "<tool_call>", "glm45": "<tool_call>", "pythonic": "["}
PYTHONIC_OPENS = ("[", _PY_START)  # a pythonic reply is calls only where it begins so (else it is text)


def forced_call(tools: Sequence[Tool], choice: str | None, fmt: str) -> tuple[str, dict[str, Any], str] | None:
    """What a real engine's structured output must produce when the request names the tool
    to call (as vLLM's OpenAI server constrains a named `tool_choice`), or asks for a call of
    any of them (`ANY_TOOL`): the format's text before the call, the JSON schema of
    `{"name": <the tool>, "arguments": <its schema>}` (one of these for any tool), the text
    after. None when nothing is forced or the format's calls are not one JSON object."""
    chosen = list(tools) if choice == ANY_TOOL else [t for t in tools if t.name == choice][:1]
    tags = _JSON_CALL_TAGS.get(fmt)
    if not chosen or tags is None:
        return None
    one = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    return tags[0], one[0] if len(one) == 1 else {"anyOf": one}, tags[1]


def tool_rounds(messages: Any) -> int:
    """Tool results a conversation holds since its last message from the user: how many
    rounds of tools the agent has run on its current request. A chat `tool` (or older
    `function`) message is one; so is each `tool_result` block of an Anthropic user message
    (a user message with anything else in it is the user speaking, and starts the count
    again)."""
    count = 0
    for m in messages if isinstance(messages, list) else []:
        if not isinstance(m, Mapping):
            continue
        role, content = m.get("role"), m.get("content")
        if role in ("tool", "function"):  # (`function`: chat's older name for a tool result)
            count += 1
        elif role == "user":
            blocks = content if isinstance(content, list) else [content]
            results = [b for b in blocks if isinstance(b, Mapping) and b.get("type") == "tool_result"]
            count = count + len(results) if results and len(results) == len(blocks) else 0
    return count


def synthetic_call(tools: Sequence[Tool], choice: str | None, seed: str) -> tuple[str, dict[str, Any]] | None:
    """A well-formed call the sim engine makes: the chosen tool, or one picked by `seed`,
    with every required argument filled from its schema. None when tools are off."""
    if not tools or choice == "none":
        return None
    pick = next((t for t in tools if t.name == choice), None) if choice else None
    if pick is None:
        pick = tools[int(hashlib.sha256(seed.encode()).hexdigest(), 16) % len(tools)]
    try:
        args = synthetic_json.example({"type": "object", **pick.parameters}, seed)
    except ValueError:  # a schema too large or malformed to fill: the call without arguments
        args = {}
    return pick.name, args if isinstance(args, dict) else {}
