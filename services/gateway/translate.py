"""The gateway's pure part: HTTP requests into Talaria calls and replies into
each API's own shapes (no I/O; the service around it does the HTTP and NATS).

- keys: `tenant_for` finds a request's tenant (the keys: `shared.settings.parse_api_keys`).
- sessions: `session_name` takes the agent's own session header, in the
  documented order (`SESSION_HEADERS`); `talaria_session_id` namespaces it by
  tenant, agent id and model, so two tenants' `x-session-id: 1` never meet.
- calls: an `Idempotency-Key` names its call (`idempotent_call_id`); otherwise the
  service gives an SDK's retry its first attempt's call id (`retry_count`), so the
  router answers it from the call record instead of running a second call.
- tokens: a prompt's stand-in token ids (`services/gateway/prefix.py`: about
  four UTF-8 bytes a token plus four per message for the role framing, the
  models' own tokenizers not being at hand); `estimate_tokens` is their count
  for one text.
- errors: `openai_error` / `anthropic_error` turn a Talaria error code into the
  API's status and body.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
import zlib
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from services.gateway import prefix as px
from services.gateway import reasoning
from shared import tool_calls
from shared.schema import JSON_SCHEMA_MAX_BYTES, Sampling

# The agents' own session headers, first match wins (docs/front-door.md lists who sends which).
SESSION_HEADERS = (
    "x-session-id",              # generic, OpenCode
    "x-dynamo-session-id",       # NVIDIA Dynamo clients
    "x-claude-code-session-id",  # Claude Code (with its agent id below)
    "session_id",                # Codex
    "session-id",                # Codex
    "x-session-affinity",        # OpenCode
    "x-litellm-session-id",      # LiteLLM
    "x-smg-routing-key",         # SGLang model gateway clients
    "x-session-token",           # llm-d clients (its former session header)
)
AGENT_ID_HEADER = "x-claude-code-agent-id"
SESSION_FINAL_HEADER = "x-dynamo-session-final"
IDEMPOTENCY_HEADER = "idempotency-key"
RETRY_COUNT_HEADER = "x-stainless-retry-count"  # the official SDKs' attempt number (0 = first)


# -- keys and tenants ---------------------------------------------------------------------
def presented_keys(headers: Mapping[str, str]) -> list[str]:
    """The keys a request carries: `Authorization: Bearer K` (OpenAI) and `x-api-key: K`
    (Anthropic), in that order. Both count: Claude Code sends both where its user set both
    kinds of key, and a proxy may add a bearer of its own beside the agent's `x-api-key`."""
    auth = headers.get("authorization", "")
    keys = [auth[7:].strip()] if auth[:7].lower() == "bearer " else []
    keys.append(headers.get("x-api-key", "").strip())
    return [k for i, k in enumerate(keys) if k and k not in keys[:i]]


def tenant_for(headers: Mapping[str, str], keys: Mapping[str, str]) -> str | None:
    """The tenant of the first key presented that is known (None: no key is)."""
    for key in presented_keys(headers):
        # constant-time over the known keys: the answer's timing says nothing about a guess
        found = None
        for known, tenant in keys.items():
            if _eq(known, key):
                found = tenant
        if found is not None:
            return found
    return None


def _eq(a: str, b: str) -> bool:
    import hmac

    return hmac.compare_digest(a.encode(), b.encode())


# -- bodies -----------------------------------------------------------------------------------
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def lenient_json(raw: bytes) -> Any:
    """A body msgspec refused, read as JSON allows it: a lone UTF-16 surrogate escape
    (`"\\ud83d"`, what a JavaScript agent writes when it cuts a string inside an emoji)
    becomes U+FFFD, as a tokenizer would read it, and a leading UTF-8 byte-order mark is
    skipped. A ValueError (the stdlib parser's, with the position) where it is not JSON."""
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    return _without_lone_surrogates(json.loads(raw, parse_constant=_no_constant))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _without_lone_surrogates(v: Any) -> Any:
    if isinstance(v, str):
        return _LONE_SURROGATE.sub("\ufffd", v)
    if isinstance(v, list):
        return [_without_lone_surrogates(x) for x in v]
    if isinstance(v, dict):
        return {_without_lone_surrogates(k): _without_lone_surrogates(x) for k, x in v.items()}
    return v


# -- sessions ---------------------------------------------------------------------------------
def session_name(headers: Mapping[str, str], body: Mapping[str, Any]) -> tuple[str, str] | None:
    """(where it came from, the agent's session name), or None: a one-call session."""
    for h in SESSION_HEADERS:
        v = headers.get(h, "").strip()
        if v:
            return h, v
    # (not `user` nor `metadata.user_id`: an end user's id spans all their conversations,
    # which as one session would each read the other's last call as their prefix)
    meta = body.get("metadata")
    if isinstance(meta, Mapping):
        v = meta.get("session_id")
        if isinstance(v, str) and v.strip():
            return "metadata.session_id", v.strip()
    return None


def _digest(*parts: str) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def talaria_session_id(tenant: str, name: str, agent_id: str, model: str) -> str:
    """A Talaria session is one (tenant, session name, agent id, model): Claude Code
    sends its main and its small model under one session id, and a session has one model."""
    return "gw-" + _digest("session", tenant, name, agent_id, model)


def headerless_scope(tenant: str, model: str) -> str:
    """What a header-less request's call id is scoped by: its tenant and model, not its
    session, which is found by matching and must not change an HTTP retry's call id."""
    return "gwh-" + _digest("headerless", tenant, model)


def fresh_call_id() -> str:
    """A header-less first attempt's own call id (two identical first requests are two runs)."""
    return "gwc-" + uuid.uuid4().hex


def forked_session_id(tenant: str, model: str, call_id: str) -> str:
    """A header-less request that joins no open session starts this one, named by its
    call so a retry of it (its call id the same) is given the same session even without
    the gateway's soft state."""
    return "gwf-" + _digest("fork", tenant, model, call_id)


def request_hash(path: str, body: bytes) -> str:
    return _digest("request", path, hashlib.sha256(body).hexdigest())


def idempotent_call_id(tenant: str, idempotency_key: str, request: str) -> str:
    """The call an `Idempotency-Key` names (per tenant) with the request it came with
    (`request_hash`): every attempt that sends both. The key reused with another request
    is another call, so it can never be answered with the first request's reply."""
    return "gwc-" + _digest("idempotency", tenant, idempotency_key, request)


def idempotency_key_digest(tenant: str, idempotency_key: str) -> str:
    """The key's name in the gateway's state (bounded, whatever the client sent)."""
    return _digest("idempotency-key", tenant, idempotency_key)


def is_final(headers: Mapping[str, str]) -> bool:
    return headers.get(SESSION_FINAL_HEADER, "").strip().lower() in ("1", "true", "yes")


def retry_count(headers: Mapping[str, str]) -> int | None:
    """The SDK's attempt number (0: the first); None where the client does not count its attempts."""
    raw = headers.get(RETRY_COUNT_HEADER)
    if raw is None:
        return None
    try:
        return max(0, int(raw))
    except ValueError:
        return 0


# -- prompts ------------------------------------------------------------------------------------
def estimate_tokens(text: str) -> int:
    """The stand-in tokenizer's count: ceil(UTF-8 bytes / 4), at least 1."""
    return len(px.text_ids(text))


# What a text-only model is shown for a part it cannot read (every model in the catalog
# reads text only): a short note in its place, not the part's bytes, which as text would
# be tens of thousands of tokens of base64 and crowd the conversation out of the context.
_NOT_READ = {"image": "image", "image_url": "image", "input_image": "image",
             "input_audio": "audio", "audio": "audio",
             "file": "file", "input_file": "file", "document": "document"}
_DROPPED = frozenset({"thinking", "redacted_thinking"})  # a past turn's reasoning: chat templates drop it


def content_text(content: Any, where: str, tool_format: str = "none") -> str:
    """A message's content: a string, or a list of parts whose text parts are kept
    (OpenAI `{"type":"text","text":...}`, Anthropic the same). An Anthropic `tool_use`
    part is written as the model writes a call (`tool_format`), a `tool_result` by its
    content, a text document by its text; a past turn's thinking is left out; an image,
    audio, a file or a binary document becomes a one-line note that it was not read
    (`part_not_read`); other parts count by their JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, Mapping):
                raise BadRequest(f"{where}: a content part must be an object", where)
            text = _part_text(part, where, tool_format)
            if text is not None:
                out.append(text)
        return "\n".join(out)
    raise BadRequest(f"{where}: content must be a string or a list of parts", where)


def _part_text(part: Mapping[str, Any], where: str, tool_format: str) -> str | None:
    kind = part.get("type")
    if isinstance(part.get("text"), str):
        return part["text"]
    if kind == "text":  # (both APIs refuse it: rendered as JSON it would be text the agent never wrote)
        raise BadRequest(f"{where}: a text part's text must be a string", where)
    if kind == "tool_use":
        _check_tool_use(part, where)
    if kind in _DROPPED:
        return None
    if kind == "tool_use" and tool_format != "none":  # (checked above: a name and an input object)
        return tool_calls.render([(part["name"], part["input"])], tool_format)
    if kind in ("tool_result", "search_result") and part.get("content") is not None:
        return content_text(part["content"], where, tool_format)
    source = part.get("source")
    if kind == "document" and isinstance(source, Mapping):
        if source.get("type") == "text" and isinstance(source.get("data"), str):
            return source["data"]
        if source.get("type") == "content" and source.get("content") is not None:
            return content_text(source["content"], where, tool_format)
    if kind in _NOT_READ:
        return part_not_read(part)
    return json.dumps(part, sort_keys=True)  # other parts: counted, not read


def _check_tool_use(part: Mapping[str, Any], where: str) -> None:
    """A past `tool_use` block as Anthropic's API takes it: a name and an input object."""
    if not isinstance(part.get("name"), str) or not isinstance(part.get("input"), Mapping):
        raise BadRequest(f"{where}: a tool_use part needs a name and an input object", where)


def part_not_read(part: Mapping[str, Any]) -> str:
    """The note a text-only model reads in place of an image, audio, a file or a binary
    document, with the file's name where the part gives one."""
    kind = _NOT_READ[str(part.get("type"))]
    named = part.get("file") if isinstance(part.get("file"), Mapping) else part
    name = named.get("filename") or named.get("title")
    label = f"{kind} {str(name)[:200]!r}" if isinstance(name, str) and name else kind
    return f"[{label} not shown: this model reads text only]"


def _openai_tool_calls_text(raw: Any, tool_format: str) -> str:
    """An assistant message's `tool_calls`, written back as the model wrote them (so a
    conversation re-sent verbatim keeps its prefix through them); as JSON where the
    model's format is unknown or a call is not well formed."""
    if tool_format != "none" and isinstance(raw, list):
        calls = []
        for c in raw:
            f = c.get("function") if isinstance(c, Mapping) else None
            try:
                args = json.loads(f["arguments"]) if isinstance(f, Mapping) and isinstance(f.get("arguments"), str) else None
            except ValueError:
                args = None
            if not isinstance(f, Mapping) or not isinstance(f.get("name"), str) or not isinstance(args, dict):
                break
            calls.append((f["name"], args))
        else:
            return tool_calls.render(calls, tool_format)
    return json.dumps(raw, sort_keys=True)


class BodyEncodingError(ValueError):
    """A body whose `Content-Encoding` cannot be decoded: `code` is the error to answer
    (`unsupported_encoding`, `malformed`, or `too_large` once decoded past the limit)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# gzip's and zlib's wrappers, and raw deflate, which some clients send as `deflate`
_DECODERS: dict[str, tuple[int, ...]] = {"gzip": (16 + zlib.MAX_WBITS,), "x-gzip": (16 + zlib.MAX_WBITS,),
                                         "deflate": (zlib.MAX_WBITS, -zlib.MAX_WBITS)}


def decode_body(raw: bytes, content_encoding: str | None, limit: int) -> bytes:
    """The body as sent before its `Content-Encoding` (codings undone last first), at most
    `limit` bytes once decoded: a corrupt or truncated body is refused by name, not a 500,
    and a small body that inflates past the limit (a zip bomb) is refused as too large."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",") if c.strip()]
    for coding in reversed(codings):
        if coding == "identity":
            continue
        if coding not in _DECODERS:
            raise BodyEncodingError("unsupported_encoding", f"Content-Encoding {coding!r} is not served "
                                    f"(gzip, deflate or identity)")
        raw = _inflate(raw, coding, limit)
    return raw


def _inflate(raw: bytes, coding: str, limit: int) -> bytes:
    """One coding undone. A gzip body may be several members one after the other (RFC 1952,
    as `gzip.decompress` reads them; the first alone had been taken, the rest dropped); any
    other bytes after the end are refused, as a truncated body is."""
    for wbits in _DECODERS[coding]:
        out, rest = bytearray(), raw
        try:
            while True:
                d = zlib.decompressobj(wbits)
                out += d.decompress(rest, limit + 1 - len(out))
                if len(out) > limit:
                    raise BodyEncodingError("too_large", f"request body over {limit} bytes once decoded ({coding})")
                rest = d.unused_data
                if not d.eof or not rest or coding not in ("gzip", "x-gzip"):
                    break
        except zlib.error:
            continue
        if d.eof and not rest:
            return bytes(out)
    raise BodyEncodingError("malformed", f"the body is not valid {coding} (Content-Encoding: {coding})")


class BadRequest(ValueError):
    """A request the gateway refuses before anything is sent (400), naming the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Prompt:
    text: str
    ids: array  # token ids, what the engine's KV is reckoned by: the model's own, or stand-ins (prefix.py)
    chat: bool  # a conversation (messages), not one prompt string
    tokenizer: Any = None  # the model's ChatTokenizer (real ids, sent to the engine); None: stand-in ids

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def real(self) -> bool:
        return self.tokenizer is not None

    def continued(self, output: str, output_ids: list[int] | None = None, output_tokens: int | None = None) -> array:
        """The ids the session's engine holds once it answered `output`: with real tokens the
        prompt's ids and the engine's own output ids (or, from an engine that returns none,
        the output's encoding); with stand-ins a conversation's next turn re-sends it as an
        assistant message, a completion as more text, cut to the `output_tokens` the engine
        generated (the message's framing and the stand-in encoding of its text are not what
        the engine holds: a prefix counted past them was re-prefilled on the next turn)."""
        if self.tokenizer is not None:
            return self.ids + array("I", output_ids if output_ids else self.tokenizer.encode_whole(output))
        ids = self.ids + px.message_ids("assistant", output) if self.chat else px.text_ids(self.text + output)
        return ids if output_tokens is None else ids[:len(self.ids) + output_tokens]


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# Anthropic's: a `system` message in `messages` is a mid-conversation instruction (Claude
# Code sends one after the first user turn), rendered in place. Anthropic takes it only
# after a user turn; it is taken anywhere here, looser on purpose, as tool results are.
ANTHROPIC_ROLES = ("user", "assistant", "system")


def chat_prompt(messages: Any, system: Any = None, *, roles: tuple[str, ...] = CHAT_ROLES,
                tool_format: str = "none", tools_json: str | None = None) -> Prompt:
    """The conversation as one text and its stand-in token ids, message by message; the
    tools (if any) after the system part, and past tool calls as the model writes them."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    parts: list[str] = []
    turns: list[tuple[str, str]] = []
    if system is not None:
        text = content_text(system, "system")
        parts.append(f"<|system|>\n{text}\n")
        turns.append(("system", text))
    if tools_json:
        parts.append(f"<|tools|>\n{tools_json}\n")
        turns.append(("tools", tools_json))
    for i, m, role in _checked(messages, roles):
        text = content_text(m.get("content"), f"messages[{i}].content", tool_format)
        if m.get("tool_calls") is not None:
            text += _openai_tool_calls_text(m["tool_calls"], tool_format)
        parts.append(f"<|{role}|>\n{text}\n")
        turns.append((role, text))
    return Prompt("".join(parts), px.conversation_ids(turns), chat=True)


def _checked(messages: Any, roles: tuple[str, ...]) -> Iterator[tuple[int, Mapping[str, Any], str]]:
    """Each message with its index and role, or a BadRequest naming the one that is not a message."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise BadRequest(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if role not in roles:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(roles)}", f"messages[{i}].role")
        # as both APIs: only an assistant's turn (of tool calls) may come without content
        if m.get("content") is None and role != "assistant":
            raise BadRequest(f"messages[{i}].content is required for the {role} role", f"messages[{i}].content")
        if m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):
            raise BadRequest(f"messages[{i}].tool_calls must be a list", f"messages[{i}].tool_calls")
        for j, call in enumerate(m.get("tool_calls") or ()):
            _check_past_call(call, f"messages[{i}].tool_calls[{j}]")
        yield i, m, role


def _check_past_call(call: Any, where: str) -> None:
    """A past tool call in an assistant message as chat's API takes it: a function with a
    name, its arguments a string (an object is taken too, as vLLM's templates take it).
    Checked here, before either engine's prompt is built, so a call the real-token path
    could not render is refused on the sim engine as well, not written in as JSON."""
    f = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(f, Mapping) or not isinstance(f.get("name"), str) or not f["name"]:
        raise BadRequest(f"{where} must be a function call with a name", f"{where}.function")
    if not isinstance(f.get("arguments"), (str, Mapping)):
        raise BadRequest(f"{where}.function.arguments must be a string of JSON", f"{where}.function.arguments")


def template_messages(messages: Any, system: Any = None, *, api: str = "openai") -> list[dict[str, Any]]:
    """The conversation in the shape chat templates take (as vLLM's OpenAI server hands
    it to one): each message's role and text, an assistant's `tool_calls` with their
    arguments as an object where they parse as one, a tool result as a `tool` message.
    Anthropic content blocks are split so: `tool_use` blocks become the assistant's
    calls, each `tool_result` a `tool` message before the user's own text."""
    roles = ANTHROPIC_ROLES if api == "anthropic" else CHAT_ROLES
    out: list[dict[str, Any]] = []
    if system is not None:
        out.append({"role": "system", "content": content_text(system, "system")})
    for i, m, role in _checked(messages, roles):
        where = f"messages[{i}].content"
        content = m.get("content")
        if api == "anthropic" and isinstance(content, list):
            out += _anthropic_turn(role, content, where)
            continue
        msg: dict[str, Any] = {"role": role, "content": content_text(content, where)}
        if isinstance(m.get("tool_calls"), list):
            msg["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])]
        for k in ("tool_call_id", "name"):
            if isinstance(m.get(k), str):
                msg[k] = m[k]
        out.append(msg)
    return out


def check_tool_results(messages: list[Mapping[str, Any]], api: str = "openai") -> None:
    """Each tool result answers a call the assistant made before it (read after the
    conversation is, so a malformed message is refused as such): one that answers none
    (a client that lost its history, a server-held conversation not held here) would
    leave the model a result with no question. Looser than either API, on purpose:
    OpenAI's chat wants the results right after their calls, Anthropic merges turns of
    one role and wants them in the next, and the Responses API takes a call anywhere
    before; what all of them accept passes."""
    asked: set[Any] = set()  # the ids of every call the assistant made so far
    for i, m in enumerate(messages):
        content, role = m.get("content"), m.get("role")
        blocks = [b for b in content if isinstance(b, Mapping)] if api == "anthropic" and isinstance(content, list) else []
        if role == "tool":
            _check_answers_a_call(m.get("tool_call_id"), asked, i, api)
        elif role == "assistant":
            asked |= ({c.get("id") for c in m.get("tool_calls") or () if isinstance(c, Mapping)} |
                      {b.get("id") for b in blocks if b.get("type") == "tool_use"})
        else:
            for b in blocks:
                if b.get("type") == "tool_result":
                    _check_answers_a_call(b.get("tool_use_id"), asked, i, api)


def _check_answers_a_call(call_id: Any, asked: set[Any], i: int, api: str) -> None:
    """A refusal in the API's own words (which its clients show) of a result answering no call."""
    if isinstance(call_id, str) and call_id in asked:
        return
    if api == "anthropic":
        raise BadRequest(f"messages.{i}.content: unexpected `tool_use_id` found in `tool_result` blocks: {str(call_id)[:100]}. "
                         "Each `tool_result` block must have a corresponding `tool_use` block in the previous message.",
                         f"messages[{i}].content")
    if call_id is None:
        raise BadRequest(f"messages[{i}]: a message with role 'tool' needs the tool_call_id of the call it answers",
                         f"messages[{i}].tool_call_id")
    raise BadRequest(f"Invalid parameter: messages with role 'tool' must be a response to a preceding message with "
                     f"'tool_calls' (messages[{i}].tool_call_id {str(call_id)[:100]!r} answers no call the "
                     "assistant made before it).", f"messages[{i}].tool_call_id")


# apply_chat_template's own parameters: a template variable may not take their names
_TEMPLATE_RESERVED = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                "add_generation_prompt", "continue_final_message", "padding", "truncation",
                                "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                                "tokenizer_kwargs"})


def chat_template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's `chat_template_kwargs`: variables of the model's chat template (Qwen3's
    `enable_thinking: false` renders the turn with thinking off); a 400 naming the field
    for anything but an object of variable names."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise BadRequest("chat_template_kwargs must be an object", "chat_template_kwargs")
    for k in kwargs:
        if not k.isidentifier() or k in _TEMPLATE_RESERVED or k.startswith("_"):
            raise BadRequest(f"chat_template_kwargs: {k[:100]!r} is not a template variable", "chat_template_kwargs")
    return dict(kwargs)


# The reasoning efforts vLLM takes (OpenAI's, and DeepSeek's `max`), and Messages' own. As
# vLLM renders them: the effort is the template variable `reasoning_effort` (gpt-oss's
# template writes it into its system message), and `none` switches thinking off in a
# template that has it switched (`enable_thinking`: Qwen3's, GLM's), any other on, unless
# the request's own `chat_template_kwargs` say.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
ANTHROPIC_EFFORTS = ("low", "medium", "high", "xhigh", "max")
THINKING_DISABLED = "thinking disabled"  # Messages' `thinking: {type: disabled}`: the model's own effort for it


def reasoning_effort(body: Mapping[str, Any], api: str) -> str | None:
    """The reasoning effort a request asks for: chat's `reasoning_effort` (the Responses
    API's `reasoning.effort`, which `responses_request` carries there), Messages'
    `output_config.effort`, or THINKING_DISABLED for Messages' thinking turned off (which
    wins, as in vLLM); a BadRequest naming a value not among the API's."""
    if api == "anthropic":
        config = body.get("output_config")
        effort = config.get("effort") if isinstance(config, Mapping) else None
        if effort is not None and effort not in ANTHROPIC_EFFORTS:
            raise BadRequest(f"output_config.effort must be one of {', '.join(ANTHROPIC_EFFORTS)}",
                             "output_config.effort")
        thinking = body.get("thinking")
        return THINKING_DISABLED if isinstance(thinking, Mapping) and thinking.get("type") == "disabled" else effort
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise BadRequest(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}", "reasoning_effort")
    return effort


def effort_template_kwargs(effort: str | None, asked: Mapping[str, Any]) -> dict[str, Any]:
    """The template variables a reasoning effort sets, beside those the request asked for
    (`chat_template_kwargs`, whose own `enable_thinking` stands)."""
    if effort is None:
        return dict(asked)
    out = {**asked, "reasoning_effort": effort}
    if "enable_thinking" not in asked:
        out["enable_thinking"] = effort != "none"
    return out


def continues_final_message(body: Mapping[str, Any], api: str) -> bool:
    """Whether the model goes on with the last message instead of starting a turn: an
    Anthropic conversation that ends with the assistant's own words (a prefill, such as
    `{` to start JSON), or chat's `continue_final_message` (vLLM's field) over a last
    assistant message."""
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages and isinstance(messages[-1], Mapping) else {}
    if api == "anthropic":  # (a last turn of tool calls is not a prefill: it starts a turn as before)
        content = last.get("content")
        return last.get("role") == "assistant" and not (isinstance(content, list) and any(
            isinstance(b, Mapping) and b.get("type") == "tool_use" for b in content))
    asked = body.get("continue_final_message")
    if asked is None or asked is False:
        return False
    if asked is not True:
        raise BadRequest("continue_final_message must be a boolean", "continue_final_message")
    if last.get("role") != "assistant":
        raise BadRequest("continue_final_message needs the last message to be the assistant's", "continue_final_message")
    return True


def _template_call(c: Any, where: str) -> dict[str, Any]:
    f = c.get("function") if isinstance(c, Mapping) else None
    if not isinstance(f, Mapping) or not isinstance(f.get("name"), str):
        raise BadRequest(f"{where} must be a function call with a name", where)
    args = f.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        args = parsed if isinstance(parsed, dict) else args  # as the model wrote it, where it is not an object
    call: dict[str, Any] = {"type": "function", "function": {"name": f["name"], "arguments": args if args is not None else {}}}
    if isinstance(c.get("id"), str):
        call["id"] = c["id"]
    return call


def _anthropic_turn(role: str, blocks: list[Any], where: str) -> list[dict[str, Any]]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        if not isinstance(b, Mapping):
            raise BadRequest(f"{where}: a content part must be an object", where)
        kind = b.get("type")
        if kind == "tool_use":
            _check_tool_use(b, f"{where}[{j}]")
            calls.append({"type": "function", "id": str(b.get("id", "")),
                          "function": {"name": b["name"], "arguments": b["input"]}})
        elif kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                            "content": content_text(b.get("content"), f"{where}[{j}].content")})
        elif (text := _part_text(b, where, "none")) is not None:
            texts.append(text)
    out: list[dict[str, Any]] = list(results)
    if texts or calls or not results:
        msg: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def text_prompt(prompt: Any) -> Prompt:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt must be a non-empty string (one prompt per request)", "prompt")
    return Prompt(prompt, px.text_ids(prompt), chat=False)


# -- Talaria's own extension field -------------------------------------------------------------------
EXTENSION_FIELD = "talaria"  # {"sim_output_tokens": N}: where the sim engine stops (a replayed trace's output)


def sim_output_tokens(body: Mapping[str, Any], max_tokens: int) -> int | None:
    """The extension's `sim_output_tokens`: the output length the sim engine gives the reply
    (a replayed trace's own, sent as an engine hint no decision reads; a real model decides
    by itself). At most `max_tokens`; a BadRequest names a bad value."""
    ext = body.get(EXTENSION_FIELD)
    if ext is None:
        return None
    where = f"{EXTENSION_FIELD}.sim_output_tokens"
    if not isinstance(ext, Mapping) or set(ext) - {"sim_output_tokens"}:
        raise BadRequest(f"{EXTENSION_FIELD} must be an object with sim_output_tokens only", EXTENSION_FIELD)
    n = whole(ext.get("sim_output_tokens"))
    if n is None:
        return None
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= max_tokens:
        raise BadRequest(f"{where} must be an integer from 1 to max_tokens ({max_tokens})", where)
    return n


def whole(v: Any) -> Any:
    """A whole-number float as its int (`100.0` -> 100), anything else as it is: a Python
    client that computes a token count in floats sends one, and vLLM takes it."""
    return int(v) if isinstance(v, float) and v.is_integer() and abs(v) < 2 ** 63 else v


# -- sampling ----------------------------------------------------------------------------------
# what the engine honours (shared/schema.py Sampling), by the API's own field names
_OPENAI_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "stop": "stop", "seed": "seed",
                    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                    # vLLM's, as its server takes them in a chat or completions request
                    "repetition_penalty": "repetition_penalty", "min_p": "min_p", "min_tokens": "min_tokens",
                    "ignore_eos": "ignore_eos", "thinking_token_budget": "thinking_token_budget"}
_ANTHROPIC_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "stop_sequences": "stop"}
# asked for and not served: refused with a 400 that names the field, never silently dropped
_OPENAI_REFUSED = ("logprobs", "top_logprobs", "logit_bias", "audio")
# ... and each with the values that ask for nothing, which are served: chat's legacy function
# calling (`tools` serves it), the legacy completions' echo, suffix and several candidates
_OPENAI_REFUSED_UNLESS = {"functions": (None, []), "function_call": (None, "auto"),
                          "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
                          # vLLM's own fields whose effect the engines here do not give: refused by
                          # name, not dropped (its older structured output above all: send
                          # response_format, or tool_choice, instead)
                          "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
                          "guided_grammar": (None,), "structured_outputs": (None,),
                          "stop_token_ids": (None, []), "bad_words": (None, []), "allowed_token_ids": (None,),
                          "logits_processors": (None,), "prompt_logprobs": (None,), "use_beam_search": (None, False),
                          "length_penalty": (None, 1.0, 1), "include_stop_str_in_output": (None, False),
                          "skip_special_tokens": (None, True)}
_STRUCTURED_HINT = " (send response_format, or tool_choice)"


_OUTPUT_KINDS = ("text", "json_object", "json_schema")


def response_format_schema(body: Mapping[str, Any]) -> str | None:
    """The JSON Schema (as JSON text) a chat request's `response_format` asks the output to
    match: `json_schema`'s schema (any JSON without one), `json_object` as any object; None
    for `text` or none."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, Mapping):
        raise BadRequest("response_format: type must be text, json_object or json_schema", "response_format")
    spec = rf.get("json_schema")
    schema = spec.get("schema", {}) if isinstance(spec, Mapping) else None
    return output_schema(rf.get("type"), schema, "response_format", "response_format")


def output_schema(kind: Any, schema: Any, label: str, param: str) -> str | None:
    """The schema an output format of `kind` asks for, as JSON text (None: plain text);
    refused, naming `param`, for an unknown kind and a schema that is not an object or is
    too long. Beside tools it is the schema of the model's answer, not of its calls (an
    agent with tools and a typed output: each turn a tool call or the typed answer). Chat's
    `response_format`, the Responses API's `text.format` and Messages'
    `output_config.format` (`label`) share it."""
    if kind not in _OUTPUT_KINDS:
        raise BadRequest(f"{label}: type must be text, json_object or json_schema", param)
    if kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    elif not isinstance(schema, Mapping):
        raise BadRequest(f"{label}: the schema must be a JSON Schema object", param)
    if (why := tool_calls.schema_depth_error(schema)) is not None:
        raise BadRequest(f"{label}: not a valid JSON Schema: {why}", param)
    text = json.dumps(schema, separators=(",", ":"))
    if len(text.encode()) > JSON_SCHEMA_MAX_BYTES:
        raise BadRequest(f"{label}: the schema is over {JSON_SCHEMA_MAX_BYTES} bytes", param)
    if (why := tool_calls.schema_text_error(text)) is not None:
        raise BadRequest(f"{label}: not a valid JSON Schema: {why}", param)
    return text


def messages_output_schema(body: Mapping[str, Any]) -> str | None:
    """The JSON Schema (as JSON text) an Anthropic Messages request asks the output to match:
    `output_config.format` (`{"type": "json_schema", "schema": ...}`), or the same object
    as the structured-outputs beta's top-level `output_format`; None for neither."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, Mapping):
        raise BadRequest("output_config must be an object", "output_config")
    fmt, label = (config or {}).get("format"), "output_config.format"
    if fmt is None:
        fmt, label = body.get("output_format"), "output_format"
    if fmt is None:
        return None
    param = label.split(".", 1)[0]
    if not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema":
        raise BadRequest(f"{label}: type must be json_schema", param)
    return output_schema("json_schema", fmt.get("schema"), label, param)


# What each API's request may carry: the fields the gateway reads (acts on, or refuses where
# set to something it does not serve), and the APIs' own fields it takes with no effect here
# (an end user's id, a service tier, a provider's cache key, ...). A field in neither is no
# field of that API here (a typo, another vendor's extension): taken, since clients send
# them freely, and said once in the log (`ignored_fields`), as vLLM says what it ignores.
_SAMPLING_READ = frozenset(_OPENAI_SAMPLING) | frozenset(_OPENAI_REFUSED) | frozenset(_OPENAI_REFUSED_UNLESS)
_OPENAI_READ = _SAMPLING_READ | {"model", "stream", "stream_options", "n", "max_tokens", "metadata", "modalities",
                                 EXTENSION_FIELD}
REQUEST_FIELDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "chat": (_OPENAI_READ | {"messages", "max_completion_tokens", "response_format", "tools", "tool_choice",
                             "parallel_tool_calls", "chat_template_kwargs", "continue_final_message",
                             "reasoning_effort"},
             frozenset({"user", "store", "prediction", "service_tier", "verbosity", "web_search_options",
                        "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "safety_identifier",
                        "moderation"})),
    "completions": (_OPENAI_READ | {"prompt"}, frozenset({"user"})),
    "responses": (frozenset({"model", "input", "instructions", "previous_response_id", "store", "tools", "tool_choice",
                             "parallel_tool_calls", "text", "max_output_tokens", "temperature", "top_p", "top_logprobs",
                             "conversation", "prompt", "background", "stream", "metadata", "reasoning",
                             EXTENSION_FIELD}),
                  frozenset({"user", "include", "truncation", "service_tier", "prompt_cache_key",
                             "prompt_cache_retention", "prompt_cache_options", "safety_identifier", "max_tool_calls",
                             "moderation", "context_management", "background_options", "access_programs", "image",
                             "stream_options", "client_metadata"})),  # (Codex sends its own client_metadata)
    "messages": (frozenset({"model", "messages", "system", "max_tokens", "stream", "temperature", "top_p", "top_k",
                            "stop_sequences", "tools", "tool_choice", "thinking", "output_config", "output_format",
                            "metadata", "chat_template_kwargs", "thread", EXTENSION_FIELD}),
                 frozenset({"service_tier", "container", "cache_control", "diagnostics", "inference_geo", "speed",
                            "user_profile_id", "workspace_id", "mcp_servers", "context_management"})),
}
NO_EFFECT, NOT_A_FIELD = "taken, no effect here", "not a field of this API here"


def ignored_fields(body: Mapping[str, Any], api: str) -> dict[str, str]:
    """The request's fields the gateway does not act on, each with why (NO_EFFECT or NOT_A_FIELD)."""
    read, no_effect = REQUEST_FIELDS[api]
    return {k: NO_EFFECT if k in no_effect else NOT_A_FIELD for k in body if k not in read}


def sampling_of(body: Mapping[str, Any], api: str, max_tokens: int | None = None) -> Sampling:
    """The request's sampling fields as the engine takes them; a BadRequest names a bad or
    unserved field (`min_tokens` past `max_tokens` too, as vLLM refuses it)."""
    names = _ANTHROPIC_SAMPLING if api == "anthropic" else _OPENAI_SAMPLING
    fields: dict[str, Any] = {}
    if api != "anthropic":
        for f in _OPENAI_REFUSED:
            if body.get(f) not in (None, False, {}, 0):
                raise BadRequest(f"{f} is not served", f)
        for f, fine in _OPENAI_REFUSED_UNLESS.items():
            if not any(body.get(f) == v and type(body.get(f)) is type(v) for v in fine):
                hint = (" (send `tools` and `tool_choice`)" if f.startswith("function") else
                        _STRUCTURED_HINT if f.startswith("guided") or f == "structured_outputs" else "")
                raise BadRequest(f"{f} is not served{hint}", f)
        modalities = body.get("modalities")
        if modalities is not None and (not isinstance(modalities, list) or set(modalities) - {"text"}):
            raise BadRequest("modalities: only text output is served", "modalities")
    schema = messages_output_schema(body) if api == "anthropic" else response_format_schema(body)
    if schema is not None:
        fields["json_schema"] = schema
    for theirs, ours in names.items():
        v = body.get(theirs)
        if v is None:
            continue
        if ours == "stop" and isinstance(v, str):
            v = [v]
        fields[ours] = whole(v) if ours in ("top_k", "seed", "thinking_token_budget") else v
    if api == "anthropic" and (budget := thinking_budget(body)) is not None:
        fields["thinking_token_budget"] = budget
    if api == "anthropic" and isinstance(fields.get("temperature"), (int, float)) and fields["temperature"] > 1:
        raise BadRequest("temperature must be between 0 and 1", "temperature")
    if max_tokens is not None and isinstance(fields.get("min_tokens"), int) and fields["min_tokens"] > max_tokens:
        raise BadRequest(f"min_tokens ({fields['min_tokens']}) must be at most max_tokens ({max_tokens})", "min_tokens")
    try:
        return msgspec.convert(fields, Sampling)
    except msgspec.ValidationError as exc:
        path = str(exc).rsplit("at `$.", 1)
        ours = path[1].split("`", 1)[0].split("[", 1)[0] if len(path) == 2 else None
        theirs = next((t for t, o in names.items() if o == ours), ours)
        raise BadRequest(f"{theirs}: {str(exc).split(' - at', 1)[0]}", theirs) from None


# -- replies -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Usage:
    prompt: int
    cached: int
    completion: int

    def openai(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                "total_tokens": self.prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": self.cached}}

    def anthropic(self) -> dict[str, Any]:
        return {"input_tokens": self.prompt - self.cached, "output_tokens": self.completion,
                "cache_read_input_tokens": self.cached, "cache_creation_input_tokens": 0}


def usage_of(reply: Any) -> Usage:
    """A reply's usage; KV restored from host memory is not recomputed either, so it counts as cached."""
    cached = min(reply.prompt_tokens, reply.cached_tokens + reply.restored_tokens)
    return Usage(reply.prompt_tokens, cached, reply.output_tokens)


class TextStream:
    """A streamed reply's text: each token batch's text as it comes, and at the reply what
    of the final content was not sent yet. `held`: the request offered tools in a form
    whose calls can only be told from text once the reply is whole: nothing is sent before
    the reply. `call_opens`: the text that opens a call in the model's tool-call format
    (`<tool_call>`), where tools are offered and the model may answer in text or call: the
    text before its first occurrence is sent as it comes (as vLLM's tool parsers stream
    it), less what could be the start of it and trailing whitespace, since the answer's
    content is the text outside its calls, stripped; from the call on, the rest waits for
    the reply, where the parser reads it. `leading_call`: the format's calls are the whole
    reply (pythonic: a list), so a reply whose first visible characters open one is held
    whole, and any other is text, sent as it comes."""

    def __init__(self, held: bool, call_opens: str | None = None, leading_call: tuple[str, ...] = ()) -> None:
        self.held = held
        self.call_opens = call_opens
        self.leading_call = leading_call
        self.parsed = call_opens is not None or bool(leading_call)  # a tool parser reads the reply at its end
        self._sent: list[str] = []  # (pieces, joined when read: a long reply is not copied at every token)
        self.pending = ""  # text seen and not sent yet: a possible call opening, trailing whitespace
        self.begun = False  # the content's first visible character has come (its leading whitespace is not sent)

    @property
    def sent(self) -> str:
        return "".join(self._sent)

    @classmethod
    def for_tools(cls, offered: bool, tool_format: str, tool_choice: str | None) -> "TextStream":
        """The stream of a reply to a request that offered tools (or not) in `tool_format`."""
        if not reads_calls(offered, tool_choice):  # (the reply is text)
            return cls(held=False)
        if tool_choice is not None:  # a forced call: whole
            return cls(held=True)
        if tool_format == "pythonic":
            return cls(held=False, leading_call=tool_calls.PYTHONIC_OPENS)
        opens = tool_calls.CALL_OPENS.get(tool_format)
        return cls(held=opens is None, call_opens=opens)  # (harmony's calls are channels: held)

    def delta(self, text: str | None) -> str:
        if self.held or not text:
            return ""
        if not self.parsed:
            self._sent.append(text)
            return text
        pending = self.pending + text  # (only what is unsent: short, whatever the reply's length)
        if not self.begun:
            pending = pending.lstrip()
            self.begun = bool(pending)
        if self.leading_call:
            if any(pending.startswith(o) for o in self.leading_call):
                self.held = True  # a call (or text the parser reads whole at the reply)
                return ""
            if any(o.startswith(pending) for o in self.leading_call):
                self.pending = pending
                return ""  # (not enough yet to tell)
            self.leading_call = ()  # text: sent as it comes
        cut = len(pending)
        if self.call_opens is not None:
            found = pending.find(self.call_opens)
            if found >= 0:
                self.held, cut = True, found
            else:
                cut -= _opening_of(pending, self.call_opens)
        piece = pending[:cut].rstrip()
        self.pending = pending[len(piece):]
        if piece:
            self._sent.append(piece)
        return piece

    def rest(self, final: str) -> str:
        sent = self.sent
        if final.startswith(sent):
            return final[len(sent):]
        return ""  # the engine's final detokenisation differs from its stream: what was sent stands


def reads_calls(offered: bool, tool_choice: str | None) -> bool:
    """Whether a reply is read for tool calls: tools were offered, and not with `tool_choice:
    none` (where vLLM applies no tool parser either)."""
    return offered and tool_choice != "none"


def _opening_of(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (it may be cut there)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass(frozen=True)
class Answer:
    """What the model said: its text outside any tool call, the calls its format's parser
    found, and its reasoning (None: the reply has none)."""

    content: str
    calls: list[tool_calls.ToolCall]
    reasoning: str | None = None


def answer_of(reply: Any, tool_format: str = "none", tools: list[tool_calls.Tool] | None = None,
              one_call: bool = False, reasoning_format: str = "none") -> Answer:
    """A reply read as the model wrote it: its reasoning apart (a call written while
    thinking is not a call), then tool calls looked for in the answer where the request
    offered tools; with `one_call` (parallel calls turned off) only the first is
    answered, as vLLM answers `parallel_tool_calls: false`."""
    thought, text = reasoning.split(reply.text or "", reasoning_format)
    if not tools:
        return Answer(text, [], thought)
    content, calls = tool_calls.parse(text, tool_format, tools, reply.call_id)
    return Answer(content, calls[:1] if one_call else calls, thought)


THINKING_MIN_BUDGET = 1024  # Anthropic's least `thinking.budget_tokens`


def check_thinking(body: Mapping[str, Any], max_tokens: int) -> None:
    """`thinking` as Anthropic's API takes it: enabled with a `budget_tokens` of at least
    1,024 and below `max_tokens` (the engine enforces it: `thinking_budget`)."""
    thinking = body.get("thinking")
    if thinking is None:
        return
    if not isinstance(thinking, Mapping) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise BadRequest("thinking must be an object whose type is enabled, disabled or adaptive", "thinking")
    if thinking.get("type") != "enabled":
        return
    budget = thinking_budget(body)
    if budget is None or budget < THINKING_MIN_BUDGET:
        raise BadRequest(f"thinking.budget_tokens must be an integer of at least {THINKING_MIN_BUDGET}",
                         "thinking.budget_tokens")
    if budget >= max_tokens:
        raise BadRequest(f"max_tokens ({max_tokens}) must be greater than thinking.budget_tokens ({budget})",
                         "thinking.budget_tokens")


def thinking_budget(body: Mapping[str, Any]) -> int | None:
    """The thinking budget of a Messages request (`thinking: {type: enabled, budget_tokens}`,
    checked by `check_thinking`), as vLLM's Anthropic server hands it to the engine; None
    for thinking disabled or adaptive (the model decides, beneath `max_tokens`)."""
    thinking = body.get("thinking")
    if not isinstance(thinking, Mapping) or thinking.get("type") != "enabled":
        return None
    budget = whole(thinking.get("budget_tokens"))
    return budget if isinstance(budget, int) and not isinstance(budget, bool) else None


def thinking_asked(body: Mapping[str, Any]) -> bool:
    """Whether a Messages request asked to see the model's thinking (`thinking` enabled or adaptive)."""
    thinking = body.get("thinking")
    return isinstance(thinking, Mapping) and thinking.get("type") in ("enabled", "adaptive")


def one_call_only(body: Mapping[str, Any], api: str) -> bool:
    """Whether the request turned parallel tool calls off: chat's and Responses'
    `parallel_tool_calls: false`, Anthropic's `tool_choice.disable_parallel_tool_use`."""
    if api == "anthropic":
        choice = body.get("tool_choice")
        return isinstance(choice, Mapping) and choice.get("disable_parallel_tool_use") is True
    return body.get("parallel_tool_calls") is False


def include_usage(body: Mapping[str, Any]) -> bool:
    """Whether a streamed OpenAI call asked for its usage (`stream_options.include_usage`):
    then, and only then, a last chunk of its own with no choices carries it."""
    opts = body.get("stream_options") or {}
    return isinstance(opts, Mapping) and opts.get("include_usage") is True


def cut_off(reply: Any, max_tokens: int) -> bool:
    """Whether the output stopped at max_tokens: the engine's own reason where it gives one
    (a reply that ends on its last allowed token is whole), else read from the counts."""
    said = getattr(reply, "finish_reason", None)
    return said == "length" if said is not None else reply.output_tokens >= max_tokens


def finish_reason(reply: Any, max_tokens: int, answer: Answer | None = None) -> str:
    if answer is not None and answer.calls:
        return "tool_calls"
    return "length" if cut_off(reply, max_tokens) else "stop"


def chat_completion(call_id: str, model: str, reply: Any, max_tokens: int, answer: Answer | None = None
                    ) -> dict[str, Any]:
    answer = answer or answer_of(reply)
    message: dict[str, Any] = {"role": "assistant", "content": answer.content if answer.content or not answer.calls else None}
    if answer.reasoning is not None:
        message["reasoning"] = answer.reasoning  # (vLLM's field)
    if answer.calls:
        message["tool_calls"] = [c.openai() for c in answer.calls]
    return {"id": f"chatcmpl-{call_id}", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message,
                         "logprobs": None, "finish_reason": finish_reason(reply, max_tokens, answer)}],
            "usage": usage_of(reply).openai(), "system_fingerprint": f"talaria-{reply.server_id}"}


def chat_chunk(call_id: str, model: str, created: int, delta: dict[str, Any], finish: str | None = None,
               usage: dict[str, Any] | None = None, include_usage: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"id": f"chatcmpl-{call_id}", "object": "chat.completion.chunk", "created": created,
                           "model": model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                        "finish_reason": finish}]}
    if include_usage:
        out["usage"] = usage  # null on every chunk but the last, as OpenAI sends it
    return out


def usage_chunk(call_id: str, model: str, created: int, usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"chatcmpl-{call_id}", "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [], "usage": usage}


def text_completion(call_id: str, model: str, reply: Any, max_tokens: int) -> dict[str, Any]:
    return {"id": f"cmpl-{call_id}", "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": reply.text or "", "logprobs": None,
                         "finish_reason": finish_reason(reply, max_tokens)}],
            "usage": usage_of(reply).openai()}


def text_chunk(call_id: str, model: str, created: int, text: str, finish: str | None = None) -> dict[str, Any]:
    return {"id": f"cmpl-{call_id}", "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def anthropic_stop_reason(reply: Any, max_tokens: int, answer: Answer | None = None) -> str:
    if answer is not None and answer.calls:
        return "tool_use"
    if anthropic_stop_sequence(reply, answer) is not None:
        return "stop_sequence"
    return "max_tokens" if cut_off(reply, max_tokens) else "end_turn"


def anthropic_stop_sequence(reply: Any, answer: Answer | None = None) -> str | None:
    """The stop sequence that ended the reply (Messages' `stop_sequence`), where the engine says."""
    if answer is not None and answer.calls:
        return None
    return getattr(reply, "stop_sequence", None)


def anthropic_blocks(answer: Answer, thinking: bool = False) -> list[dict[str, Any]]:
    """The reply's content blocks: its thinking where asked for, its text, its calls."""
    blocks: list[dict[str, Any]] = [thinking_block(answer.reasoning)] if thinking and answer.reasoning else []
    if answer.content or not answer.calls:
        blocks.append({"type": "text", "text": answer.content})
    return blocks + [c.anthropic() for c in answer.calls]


def thinking_block(text: str) -> dict[str, Any]:
    # (no signature: nothing here checks one, and a thinking block sent back is left out of the prompt)
    return {"type": "thinking", "thinking": text, "signature": ""}


def anthropic_message(call_id: str, model: str, reply: Any, max_tokens: int, answer: Answer | None = None,
                      thinking: bool = False) -> dict[str, Any]:
    answer = answer or answer_of(reply)
    return {"id": f"msg_{call_id}", "type": "message", "role": "assistant", "model": model,
            "content": anthropic_blocks(answer, thinking),
            "stop_reason": anthropic_stop_reason(reply, max_tokens, answer),
            "stop_sequence": anthropic_stop_sequence(reply, answer),
            "usage": usage_of(reply).anthropic()}


def model_entry(model: str, context_limit: int) -> dict[str, Any]:
    """One served model, read as OpenAI's model object and as Anthropic's `ModelInfo` alike
    (each SDK ignores the other's fields), with its context limit as vLLM names it."""
    return {"id": model, "object": "model", "created": 0, "owned_by": "talaria",
            "type": "model", "display_name": model, "created_at": "1970-01-01T00:00:00Z",
            "context_length": context_limit, "max_model_len": context_limit,
            # (Anthropic's: a prompt and an output may each take the whole context, not both)
            "max_input_tokens": context_limit, "max_tokens": context_limit}


def models_list(models: list[tuple[str, int]], query: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`GET /v1/models` for either API: OpenAI's list, with Anthropic's page fields. Anthropic's
    `limit` (1-1000), `after_id` and `before_id` page it; OpenAI sends none of them."""
    query = query or {}
    try:
        limit = int(query.get("limit", "1000"))
    except ValueError:
        raise BadRequest("limit must be a whole number in 1..1000", "limit") from None
    if not 1 <= limit <= 1000:
        raise BadRequest("limit must be a whole number in 1..1000", "limit")
    start, end, has_more = _cursor_page([m for m, _ in models], query, limit, "after_id", "before_id", "model")
    return _list_page([model_entry(m, ctx) for m, ctx in models[start:end]], has_more)


def _cursor_page(ids: list[str], query: Mapping[str, str], limit: int, after: str, before: str,
                 what: str) -> tuple[int, int, bool]:
    """The slice [start, end) of `ids` a cursor query asks (the page after the `after` id,
    or the page just before the `before` id), and whether more lie beyond it."""
    for param in (after, before):
        if param in query and query[param] not in ids:
            raise BadRequest(f"{param}: no {what} {query[param][:200]!r} here", param)
    if after in query and before in query:
        raise BadRequest(f"send {after} or {before}, not both", before)
    if before in query:
        end = ids.index(query[before])
        start = max(0, end - limit)
        return start, end, start > 0
    start = ids.index(query[after]) + 1 if after in query else 0
    end = min(len(ids), start + limit)
    return start, end, end < len(ids)


def _list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


# -- errors -------------------------------------------------------------------------------------------
# Talaria's error code -> (HTTP status, OpenAI type, OpenAI code, Anthropic type)
_ERROR_MAP: dict[str, tuple[int, str, str | None, str]] = {
    "malformed": (400, "invalid_request_error", None, "invalid_request_error"),
    "unauthorized": (401, "invalid_request_error", "invalid_api_key", "authentication_error"),
    "unknown_model": (404, "invalid_request_error", "model_not_found", "not_found_error"),
    "not_found": (404, "invalid_request_error", None, "not_found_error"),
    "previous_response_not_found": (400, "invalid_request_error", "previous_response_not_found",
                                    "invalid_request_error"),
    "too_large": (413, "invalid_request_error", "request_too_large", "request_too_large"),
    "body_timeout": (408, "invalid_request_error", "request_timeout", "invalid_request_error"),
    "context_limit": (400, "invalid_request_error", "context_length_exceeded", "invalid_request_error"),
    "no_capacity": (429, "rate_limit_error", "no_capacity", "overloaded_error"),
    "rate_limited": (429, "rate_limit_error", "rate_limit_exceeded", "rate_limit_error"),  # a tenant over its bound
    "timeout": (504, "timeout", "timeout", "timeout_error"),
    "unavailable": (503, "server_error", "service_unavailable", "api_error"),
    "internal": (500, "server_error", None, "api_error"),
    "unknown_session": (500, "server_error", None, "api_error"),
    "unsupported_encoding": (415, "invalid_request_error", "unsupported_content_encoding", "invalid_request_error"),
    "method_not_allowed": (405, "invalid_request_error", "method_not_allowed", "invalid_request_error"),
    "expectation_failed": (417, "invalid_request_error", "expectation_failed", "invalid_request_error"),
    # the IETF Idempotency-Key draft's answer to a key reused with another request
    "idempotency_key_reused": (422, "invalid_request_error", "idempotency_key_reused", "invalid_request_error"),
}
ANTHROPIC_OVERLOADED_STATUS = 529  # Anthropic's own status for no capacity


def error_status(code: str, api: str) -> int:
    status = _ERROR_MAP.get(code, _ERROR_MAP["internal"])[0]
    if api == "anthropic" and code == "no_capacity":
        return ANTHROPIC_OVERLOADED_STATUS
    return status


def openai_error(code: str, message: str, param: str | None = None) -> tuple[int, dict[str, Any]]:
    status, typ, ocode, _ = _ERROR_MAP.get(code, _ERROR_MAP["internal"])
    return status, {"error": {"message": message, "type": typ, "param": param, "code": ocode}}


def anthropic_error(code: str, message: str) -> tuple[int, dict[str, Any]]:
    typ = _ERROR_MAP.get(code, _ERROR_MAP["internal"])[3]
    if code == "context_limit":
        message = anthropic_context_words(message)
    return error_status(code, "anthropic"), {"type": "error", "error": {"type": typ, "message": message}}


_OPENAI_OVER = re.compile(r"maximum context length is (\d+) tokens\. However, you requested \d+ tokens "
                          r"\((\d+) in the messages, (\d+) in the completion\)")
_OPENAI_PROMPT_OVER = re.compile(r"maximum context length is (\d+) tokens\. However, your messages resulted in (\d+)")


def anthropic_context_words(message: str) -> str:
    """A context refusal (`schema.context_limit_message`) in Anthropic's own words, which
    its clients match on, having no error code to read ("prompt is too long"; Claude
    Code reads the figures of the second form to fit its next request)."""
    if (m := _OPENAI_OVER.search(message)) is not None:
        limit, prompt, out = m.groups()
        return (f"input length and `max_tokens` exceed context limit: {prompt} + {out} > {limit}, "
                "decrease input length or `max_tokens` and try again")
    if (m := _OPENAI_PROMPT_OVER.search(message)) is not None:
        limit, prompt = m.groups()
        return f"prompt is too long: {prompt} tokens > {limit} maximum"
    return message


# -- the Responses API (`POST /v1/responses`, as Codex sends it) -------------------------------------
# A response is stored unless asked not to (`store: true` is OpenAI's default): its object,
# and the conversation it ends as the first items of a thread (a Redis list) that the
# responses continuing it extend, so `previous_response_id` continues it with two reads and
# a conversation of T turns is stored once (whole with each response, it was T^2 / 2 turns'
# worth); Codex sends `store: false` and its whole conversation in `input`. The
# Conversations API's `conversation` is refused by name, and so is a stored prompt
# (`prompt`: a dashboard's template and variables, kept on OpenAI's side), whose
# instructions a request without them would silently lose.
_RESPONSES_NOT_SERVED = {
    "conversation": "the Conversations API is not served here; continue a stored response with "
                    "previous_response_id, or send the whole conversation in input",
    "prompt": "stored prompts are not served here; send the prompt's text as instructions and input",
}
_RESPONSES_ROLES = ("user", "assistant", "system", "developer")
_RESPONSES_TEXT_PARTS = ("input_text", "output_text", "text")


def responses_store_asked(body: Mapping[str, Any]) -> bool:
    """Whether the request asks its response to be stored (`store`, true unless sent false)."""
    store = body.get("store")
    if store is None:
        return True
    if not isinstance(store, bool):
        raise BadRequest("store must be a boolean", "store")
    return store


def previous_response_id(body: Mapping[str, Any]) -> str | None:
    """The stored response the request continues (`previous_response_id`), if it names one."""
    prev = body.get("previous_response_id")
    if prev is None:
        return None
    if not isinstance(prev, str) or not prev or len(prev) > 256:
        raise BadRequest("previous_response_id must be a response's id", "previous_response_id")
    return prev


def response_digest(tenant: str, response_id: str) -> str:
    """A stored response's name in the gateway's state: a tenant reads only its own."""
    return _digest("response", tenant, response_id)


def responses_input_items(body: Mapping[str, Any]) -> list[Any]:
    """The request's `input` as a list of items (a string is one user message)."""
    items = body.get("input")
    if isinstance(items, str):
        return [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("input must be a string or a non-empty list of items", "input")
    return items


def item_digest(tenant: str, item_id: str) -> str:
    """A stored response's output item's name in the gateway's state (for `item_reference`)."""
    return _digest("item", tenant, item_id)


def item_references(body: Mapping[str, Any]) -> dict[str, int]:
    """The ids the request's input names by `item_reference` (each to its first `input[i]`)."""
    items = body.get("input")
    refs: dict[str, int] = {}
    for i, item in enumerate(items if isinstance(items, list) else []):
        if isinstance(item, Mapping) and item.get("type") == "item_reference":
            ref = item.get("id")
            if not isinstance(ref, str) or not ref or len(ref) > 256:
                raise BadRequest(f"input[{i}].id must be an item's id", f"input[{i}].id")
            refs.setdefault(ref, i)
    return refs


def with_items_resolved(body: Mapping[str, Any], found: Mapping[str, Any]) -> dict[str, Any]:
    """The request with each `item_reference` replaced by the stored item it names
    (`found`: id -> item); one not found is a 400 in OpenAI's words."""
    refs = item_references(body)
    for ref, i in refs.items():
        if ref not in found:
            raise BadRequest(f"Item with id '{ref[:256]}' not found.", f"input[{i}]")
    if not refs:
        return dict(body)
    return {**body, "input": [found[it["id"]] if isinstance(it, Mapping) and it.get("type") == "item_reference"
                              else it for it in body["input"]]}


@dataclass(frozen=True)
class StoredResponse:
    """A stored response: its object, and the conversation it ends (the items before it, its
    input and its output): the first `length` items of `thread`, or, as gateways before
    threads stored it, whole in `conversation` (`thread` None)."""

    response: dict[str, Any]
    thread: str | None
    length: int
    conversation: list[Any] | None = None


def stored_response(thread: str, length: int, response: Mapping[str, Any]) -> bytes:
    """What is kept of a stored response: the response object and where its conversation is
    (the first `length` items of `thread`), compressed."""
    return zlib.compress(msgspec.json.encode({"thread": thread, "length": length, "response": response}), 3)


def read_stored_response(blob: bytes) -> StoredResponse:
    doc = msgspec.json.decode(zlib.decompress(blob))
    if "conversation" in doc:  # (stored whole, by a gateway before threads)
        return StoredResponse(doc["response"], None, len(doc["conversation"]), doc["conversation"])
    return StoredResponse(doc["response"], doc["thread"], doc["length"])


def thread_item(item: Any) -> bytes:
    """One conversation item as its thread keeps it: compressed (conversations are mostly text)."""
    return zlib.compress(msgspec.json.encode(item), 3)


def read_thread_item(blob: bytes) -> Any:
    return msgspec.json.decode(zlib.decompress(blob))


_INPUT_ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs",
                         "custom_tool_call": "ctc", "custom_tool_call_output": "ctco"}


def _input_item(item: Any, response_id: str, index: int) -> dict[str, Any]:
    """One input item as OpenAI lists it: typed, with an id (an item the agent sent
    without one is named by its response and place, so the pages stay put), a
    message's text as content parts."""
    out = dict(item) if isinstance(item, Mapping) else {"type": "message", "role": "user", "content": str(item)}
    kind = out.setdefault("type", "message")
    if kind == "message":
        content = out.get("content")
        if isinstance(content, str):
            part = "output_text" if out.get("role") == "assistant" else "input_text"
            out["content"] = [{"type": part, "text": content}]
        out.setdefault("status", "completed")
    if not isinstance(out.get("id"), str):
        out["id"] = f"{_INPUT_ITEM_ID_PREFIX.get(kind, 'item')}_{_digest('input_item', response_id, str(index))[:24]}"
    return out


def input_items_page(conversation: list[Any], response: Mapping[str, Any],
                     query: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`GET /v1/responses/{id}/input_items`: the items the response was generated from
    (the stored conversation it continued and its own input, without its output), a
    page of them in OpenAI's list shape. `order` (desc by default, newest first),
    `limit` (1-100, 20 by default), and `after` or `before` an item's id page them;
    `include` names extra output fields and changes nothing here."""
    query = query or {}
    output = response.get("output") or []
    inputs = conversation[:len(conversation) - len(output)] if output else list(conversation)
    rid = str(response.get("id", ""))
    items = [_input_item(it, rid, i) for i, it in enumerate(inputs)]
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("order must be asc or desc", "order")
    if order == "desc":
        items.reverse()
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        raise BadRequest("limit must be a whole number in 1..100", "limit") from None
    if not 1 <= limit <= 100:
        raise BadRequest("limit must be a whole number in 1..100", "limit")
    start, end, has_more = _cursor_page([it["id"] for it in items], query, limit, "after", "before",
                                        "input item of this response")
    return _list_page(items[start:end], has_more)


def _turn_starts(messages: list[Any]) -> tuple[int, list[int]]:
    """(how many leading system and developer messages, the index where each turn after them begins)."""
    head = 0
    while head < len(messages) and isinstance(messages[head], dict) and \
            messages[head].get("role") in ("system", "developer"):
        head += 1
    return head, [i for i in range(head, len(messages))
                  if not (isinstance(messages[i], dict) and messages[i].get("role") == "tool")]


def droppable_turns(messages: list[Any]) -> int:
    """The turns `truncated_turns` can leave out: all but the last."""
    return max(0, len(_turn_starts(messages)[1]) - 1)


def truncated_turns(messages: list[Any], dropped: int) -> list[Any]:
    """`truncation: "auto"`: the conversation with its `dropped` oldest turns left out, as
    OpenAI's API drops items from its beginning to fit the context. The leading system and
    developer messages (the instructions) are kept, and a turn goes whole (an assistant's
    tool calls with their results: a result without its call is no conversation a
    template renders)."""
    head, starts = _turn_starts(messages)
    assert 0 <= dropped <= max(0, len(starts) - 1)
    return messages[:head] + messages[starts[dropped]:] if dropped else list(messages)


def responses_request(body: Mapping[str, Any], previous: list[Any] | None = None) -> dict[str, Any]:
    """A Responses request as the chat request it asks for: `instructions` and the `input`
    items, after the `previous` conversation it continues (a stored response's, which
    does not carry that response's instructions, as OpenAI's does not), as messages (a
    `function_call` item joins the assistant turn before it, a `function_call_output`
    is a `tool` message, a past `reasoning` item is left out as the chat templates leave
    it), its function tools in chat's shape. What the chat path reads keeps the Responses
    name (`max_output_tokens`), so a refusal names the field the agent sent. A BadRequest
    names what is malformed or not served."""
    for name, instead in _RESPONSES_NOT_SERVED.items():
        if body.get(name) is not None:
            raise BadRequest(f"{name} is not served: {instead}", name)
    if body.get("background") not in (None, False):
        raise BadRequest("background responses are not served", "background")
    text = body.get("text")
    if text is not None and not isinstance(text, Mapping):
        raise BadRequest("text must be an object", "text")
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if fmt is not None and not isinstance(fmt, Mapping):
        raise BadRequest("text.format: type must be text, json_object or json_schema", "text")
    # checked here, so a refusal names the Responses field; the chat path reads the same format
    structured = (output_schema(fmt.get("type"), fmt.get("schema"), "text.format", "text")
                  if fmt is not None else None)
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("instructions must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    previous = previous or []
    messages += _responses_messages(previous + responses_input_items(body), len(previous))
    out: dict[str, Any] = {"model": body.get("model"), "messages": messages, "stream": body.get("stream", False)}
    tools = body.get("tools")
    if tools is not None:
        out["tools"] = _responses_tools(tools)
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping) and choice.get("type") in ("function", "custom"):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        out["tool_choice"] = choice
    for name in ("max_output_tokens", "temperature", "top_p", "top_logprobs", "parallel_tool_calls", EXTENSION_FIELD):
        if body.get(name) is not None:
            out[name] = body[name]
    reasoning_asked = body.get("reasoning")
    if reasoning_asked is not None and not isinstance(reasoning_asked, Mapping):
        raise BadRequest("reasoning must be an object", "reasoning")
    if isinstance(reasoning_asked, Mapping) and reasoning_asked.get("effort") is not None:
        if reasoning_asked["effort"] not in REASONING_EFFORTS:
            raise BadRequest(f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}", "reasoning")
        out["reasoning_effort"] = reasoning_asked["effort"]
    if structured is not None:  # the same structured output as chat's
        out["response_format"] = ({"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"]}}
                                  if fmt["type"] == "json_schema" else {"type": "json_object"})
    return out


def _responses_messages(items: list[Any], previous: int = 0) -> list[dict[str, Any]]:
    """The items as chat messages; the first `previous` are a stored conversation's (a
    refusal names the request's own `input[i]`)."""
    out: list[dict[str, Any]] = []
    calls: set[str] = set()  # (a function_call_output answers one of these, as OpenAI requires)
    ids: set[str] = set()  # (an item twice, as its stored copy and sent again, is refused as OpenAI refuses it)
    for i, item in enumerate(items):
        where = f"input[{i - previous}]" if i >= previous else "previous_response_id"
        if not isinstance(item, Mapping):
            raise BadRequest(f"{where} must be an object", where)
        if isinstance(item.get("id"), str):
            if item["id"] in ids:
                raise BadRequest(f"Duplicate item found with id {item['id'][:256]}. Remove duplicate items from "
                                 "your input and try again.", where if i >= previous else "input")
            ids.add(item["id"])
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _RESPONSES_ROLES:
                raise BadRequest(f"{where}.role must be one of {', '.join(_RESPONSES_ROLES)}", f"{where}.role")
            out.append({"role": role, "content": _responses_content(item.get("content"), f"{where}.content")})
        elif kind in ("function_call", "custom_tool_call"):
            field_name = "input" if kind == "custom_tool_call" else "arguments"
            name, call_id, given = item.get("name"), item.get("call_id"), item.get(field_name)
            if not isinstance(name, str) or not name or not isinstance(call_id, str) or not isinstance(given, str):
                raise BadRequest(f"{where}: a {kind} needs a name, a call_id and its {field_name} as a string", where)
            # (a custom tool's call as the model was offered the tool: a function of one string)
            args = json.dumps({CUSTOM_INPUT: given}) if kind == "custom_tool_call" else given
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            calls.add(call_id)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output" and item.get("call_id") is None and isinstance(item.get("name"), str):
            # a tool's output the client adds with no call before it (Codex's `goal_objective`, in
            # its `agent` namespace, after a goal is set): context for the model, given as the
            # user's, since it answers no call (a `tool` message would answer none)
            out.append({"role": "user", "content": _responses_content(item.get("output"), f"{where}.output")})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise BadRequest(f"{where}: a {kind} needs the call_id it answers", where)
            if call_id not in calls:
                raise BadRequest(f"No tool call found for function call output with call_id {call_id[:100]}.", where)
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _responses_content(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue  # a past turn's reasoning: the engine keeps none, and chat templates drop it
        else:
            raise BadRequest(f"{where}.type {str(kind)[:100]!r} is not served (message, function_call, "
                             "function_call_output, custom_tool_call, custom_tool_call_output, reasoning)",
                             f"{where}.type")
    if not out:
        raise BadRequest("input must hold at least one message", "input")
    return out


def _responses_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's or a tool output's content: a string, or parts whose text parts
    (`input_text`, `output_text`) become chat's text parts; other parts (images, files)
    are carried as they are and counted by their JSON."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of parts", where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise BadRequest(f"{where}[{j}] must be an object", f"{where}[{j}]")
        if part.get("type") in _RESPONSES_TEXT_PARTS:
            if not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}[{j}].text must be a string", f"{where}[{j}].text")
            parts.append({"type": "text", "text": part["text"]})
        else:
            parts.append(dict(part))
    return parts


# The Responses API's tools that run on OpenAI's servers (or need its screenshots loop):
# left out of what the model is offered, as Messages leaves out Anthropic's server tools.
# Codex offers `web_search` on every request by default, so a refusal refused all of them.
RESPONSES_HOSTED_TOOLS = frozenset({
    "web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
    "code_interpreter", "image_generation", "mcp", "computer", "computer_use_preview"})


def responses_left_out(tools: Any) -> list[str]:
    """The hosted tools of a Responses request, by type: not offered to the model."""
    if not isinstance(tools, list):
        return []
    return [t["type"] for t in tools if isinstance(t, Mapping) and t.get("type") in RESPONSES_HOSTED_TOOLS]


@dataclass(frozen=True)
class OfferedTools:
    """What a Responses request's tools say of the items its calls come back as: the
    namespace each function offered inside a `namespace` tool came from (Codex's
    `multi_agent_v1`; its `function_call` items carry it, as OpenAI's do), and the names
    of its custom (freeform) tools, whose calls are `custom_tool_call` items."""

    namespaces: Mapping[str, str] = field(default_factory=dict)
    custom: frozenset[str] = frozenset()


def responses_offered(tools: Any) -> OfferedTools:
    namespaces: dict[str, str] = {}
    custom: set[str] = set()
    for t in tools if isinstance(tools, list) else ():
        if isinstance(t, Mapping) and t.get("type") == "namespace" and isinstance(t.get("tools"), list):
            namespaces.update({f["name"]: str(t.get("name")) for f in t["tools"]
                               if isinstance(f, Mapping) and isinstance(f.get("name"), str)})
        elif isinstance(t, Mapping) and t.get("type") == "custom" and isinstance(t.get("name"), str):
            custom.add(t["name"])
    return OfferedTools(namespaces, frozenset(custom))


CUSTOM_INPUT = "input"  # the one string parameter a custom tool is offered to the model with


def _custom_as_function(t: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A custom (freeform) tool offered as a function of one string, `input`: the engines
    parse a model's calls as JSON arguments, and decode no grammar. The tool's format (a
    Lark or regex grammar, Codex's `apply_patch`) is given in the parameter's description,
    so the model writes to it; its call goes back as a `custom_tool_call` with that string."""
    if not isinstance(t.get("name"), str) or not t["name"]:
        raise BadRequest(f"{where}: a custom tool needs a name", where)
    fmt = t.get("format")
    if fmt is not None and (not isinstance(fmt, Mapping) or fmt.get("type") not in ("text", "grammar")):
        raise BadRequest(f"{where}.format: type must be text or grammar", f"{where}.format")
    about = "The tool's whole input, as raw text."
    if isinstance(fmt, Mapping) and fmt.get("type") == "grammar":
        definition, syntax = fmt.get("definition"), fmt.get("syntax")
        if not isinstance(definition, str) or syntax not in ("lark", "regex"):
            raise BadRequest(f"{where}.format: a grammar needs its definition and a syntax of lark or regex",
                             f"{where}.format")
        about += f" It must match this {syntax} grammar:\n{definition}"
    function = {"name": t.get("name"), "parameters": {
        "type": "object", "properties": {CUSTOM_INPUT: {"type": "string", "description": about}},
        "required": [CUSTOM_INPUT], "additionalProperties": False}}
    if "description" in t:
        function["description"] = t["description"]
    return {"type": "function", "function": function}


def custom_input(arguments: Any) -> str:
    """A custom tool's input from the model's call of it as a function: its `input`, else
    the one string it gave under another name, else the arguments as JSON."""
    if isinstance(arguments, Mapping):
        if isinstance(arguments.get(CUSTOM_INPUT), str):
            return arguments[CUSTOM_INPUT]
        strings = [v for v in arguments.values() if isinstance(v, str)]
        if len(arguments) == 1 and strings:
            return strings[0]
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def _responses_tools(tools: Any) -> list[Any]:
    """Function tools in chat's shape; a `namespace` tool's functions flat, under their own
    names (the model calls them so; each call names its namespace again on the way out);
    a custom tool as a function of one string (`_custom_as_function`); hosted tools left
    out. A name offered twice is refused, as the call could not say which."""
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list", "tools")
    out: list[Any] = []
    named: set[str] = set()

    def function(t: Any, where: str) -> None:
        if not isinstance(t, Mapping) or t.get("type") not in ("function", "custom"):
            kind = t.get("type") if isinstance(t, Mapping) else None
            raise BadRequest(f"{where}: only function and custom tools are served, not {str(kind)[:100]!r}", where)
        if isinstance(t.get("name"), str):
            if t["name"] in named:
                raise BadRequest(f"{where}: the tool name {t['name'][:100]!r} is offered twice", where)
            named.add(t["name"])
        if t["type"] == "custom":
            out.append(_custom_as_function(t, where))
            return
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}})

    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, Mapping) else None
        if kind in RESPONSES_HOSTED_TOOLS:
            continue
        if kind == "namespace":
            inner = t.get("tools")  # type: ignore[union-attr]
            if not isinstance(t.get("name"), str) or not isinstance(inner, list):  # type: ignore[union-attr]
                raise BadRequest(f"tools[{i}]: a namespace needs a name and its tools", f"tools[{i}]")
            for j, f in enumerate(inner):
                function(f, f"tools[{i}].tools[{j}]")
            continue
        function(t, f"tools[{i}]")
    return out


def response_usage(reply: Any) -> dict[str, Any]:
    u = usage_of(reply)
    return {"input_tokens": u.prompt, "input_tokens_details": {"cached_tokens": u.cached},
            "output_tokens": u.completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt + u.completion}


def response_message_id(call_id: str) -> str:
    """The reply's message item's id (one message per reply)."""
    return f"msg_{call_id}"


def response_message_item(call_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" else []
    return {"type": "message", "id": response_message_id(call_id), "status": status, "role": "assistant",
            "content": content}


def response_call_item(call: tool_calls.ToolCall, status: str, offered: OfferedTools | None = None
                       ) -> dict[str, Any]:
    """A `function_call` item; one of a namespace's functions names it (`namespace`); a
    custom tool's call is a `custom_tool_call` with its `input`."""
    done = status != "in_progress"
    if offered and call.name in offered.custom:
        return {"type": "custom_tool_call", "id": f"ctc_{call.id}", "call_id": call.id,
                "name": call.name, "input": custom_input(call.arguments) if done else "", "status": status}
    item = {"type": "function_call", "id": f"fc_{call.id}", "call_id": call.id, "name": call.name,
            "arguments": json.dumps(call.arguments) if done else "", "status": status}
    if offered and call.name in offered.namespaces:
        item["namespace"] = offered.namespaces[call.name]
    return item


def response_output(call_id: str, answer: Answer, status: str = "completed",
                    offered: OfferedTools | None = None) -> list[dict[str, Any]]:
    """The reply's output items: its reasoning as a `reasoning` item where it has any, its
    text as a message (none where the model only called tools; `incomplete` as the
    response is, where it stopped at max_output_tokens), then each tool call as a
    `function_call` item (a custom tool's as a `custom_tool_call`)."""
    text_status = "incomplete" if status == "incomplete" else "completed"
    items = [response_reasoning_item(call_id, answer.reasoning)] if answer.reasoning else []
    if answer.content or not answer.calls:
        items.append(response_message_item(call_id, answer.content, text_status))
    return items + [response_call_item(c, "completed", offered) for c in answer.calls]


def response_reasoning_id(call_id: str) -> str:
    return f"rs_{call_id}"


def response_reasoning_item(call_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": response_reasoning_id(call_id), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def response_status(reply: Any, max_tokens: int, answer: Answer) -> str:
    """`incomplete` where the reply stopped at max_output_tokens, as OpenAI reports it."""
    return "incomplete" if finish_reason(reply, max_tokens, answer) == "length" else "completed"


def response_text_settings(request: Mapping[str, Any]) -> dict[str, Any]:
    """The request's `text` settings as a response echoes them: its `format` (plain text
    unless it asked for a schema or JSON) and whatever else it set (`verbosity`)."""
    text = request.get("text")
    text = text if isinstance(text, dict) else {}
    return {**text, "format": text.get("format") or {"type": "text"}}


def response_object(call_id: str, model: str, created: int, request: Mapping[str, Any], *, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None, store: bool = False) -> dict[str, Any]:
    """A `response` object: what it produced, and the request's settings echoed as OpenAI
    echoes them; `store`: whether it is kept to be read back and continued."""
    return {
        "id": f"resp_{call_id}", "object": "response", "created_at": created, "status": status,
        "model": model, "output": output, "usage": usage, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.get("instructions"), "max_output_tokens": request.get("max_output_tokens"),
        "temperature": request.get("temperature"), "top_p": request.get("top_p"),
        "tools": request.get("tools") or [], "tool_choice": request.get("tool_choice") or "auto",
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "previous_response_id": request.get("previous_response_id"),
        "metadata": request.get("metadata") or {}, "store": store,
        # (echoed as sent: a client reads the reply's `text.format` to parse it as the schema it asked for)
        "truncation": request.get("truncation") or "disabled", "text": response_text_settings(request),
        "reasoning": request.get("reasoning"), "user": request.get("user"),
        "prompt_cache_key": request.get("prompt_cache_key"),
    }


class ResponseEvents:
    """A streamed response's events in order, each with its `sequence_number`:
    `response.created` and `response.in_progress`; the model's reasoning, where it has
    any, as a `reasoning` item first (its text as `response.reasoning_text.delta`s); the
    message item and its text part, opened at once when no tools are offered and the
    model writes no reasoning, else with the answer's first text (its text then comes as
    `response.output_text.delta`s), or at the reply where tools are offered (the text may
    be a call the parser must read whole); each tool call as a `function_call` item with
    its arguments in one delta (a custom tool's as a `custom_tool_call`, its input in one
    delta); then `response.completed` (or `response.incomplete` at
    max_output_tokens, `response.failed` on an error)."""

    def __init__(self, call_id: str, model: str, created: int, request: Mapping[str, Any], text: TextStream,
                 reasoning_format: str = "none", store: bool = False) -> None:
        self.call_id, self.model, self.created, self.request = call_id, model, created, request
        self.store = store  # (the response's `store`: cleared where keeping it failed before the end)
        self.offered = responses_offered(request.get("tools"))
        self.text = text  # (how the request's tools have its text streamed: TextStream.for_tools)
        self.thought = reasoning.Splitter(reasoning_format)
        self.seq = 0
        self.reasoning_open = self.reasoning_done = False
        self.message_open = False

    @property
    def message_index(self) -> int:
        """The message's output index: after the reasoning item, where there is one."""
        return 1 if self.reasoning_open else 0

    def _ev(self, kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return kind, ev

    def _response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                  error: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_object(self.call_id, self.model, self.created, self.request, status=status, output=output,
                               usage=usage, error=error, store=self.store)

    def _open_message(self) -> list[tuple[str, dict[str, Any]]]:
        self.message_open = True
        item_id, i = response_message_id(self.call_id), self.message_index
        return [self._ev("response.output_item.added", output_index=i,
                         item=response_message_item(self.call_id, "", "in_progress")),
                self._ev("response.content_part.added", item_id=item_id, output_index=i, content_index=0,
                         part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def _reasoning(self, piece: str) -> list[tuple[str, dict[str, Any]]]:
        """The reasoning item opened (at index 0, before the message) and `piece` of its text."""
        out = []
        if not self.reasoning_open:
            self.reasoning_open = True
            out.append(self._ev("response.output_item.added", output_index=0,
                                item={**response_reasoning_item(self.call_id, ""), "content": []}))
        if piece:
            out.append(self._ev("response.reasoning_text.delta", item_id=response_reasoning_id(self.call_id),
                                output_index=0, content_index=0, delta=piece))
        return out

    def _close_reasoning(self, final: str) -> list[tuple[str, dict[str, Any]]]:
        self.reasoning_done = True
        item_id = response_reasoning_id(self.call_id)
        return [self._ev("response.reasoning_text.done", item_id=item_id, output_index=0, content_index=0, text=final),
                self._ev("response.output_item.done", output_index=0, item=response_reasoning_item(self.call_id, final))]

    def start(self) -> list[tuple[str, dict[str, Any]]]:
        out = [self._ev("response.created", response=self._response("in_progress", [])),
               self._ev("response.in_progress", response=self._response("in_progress", []))]
        # (where tools are offered the reply may be calls alone: the message opens with its first text)
        return out + ([] if self.text.held or self.text.parsed or self.thought.fmt != "none" else self._open_message())

    def tokens(self, text: str | None) -> list[tuple[str, dict[str, Any]]]:
        thought, answer = self.thought.feed(text)
        out = self._reasoning(thought) if thought else []
        delta = self.text.delta(answer)
        if not delta:
            return out
        if self.reasoning_open and not self.reasoning_done:
            out += self._close_reasoning(self.thought.reasoning_sent)
        if not self.message_open:
            out += self._open_message()
        return out + [self._ev("response.output_text.delta", item_id=response_message_id(self.call_id),
                               output_index=self.message_index, content_index=0, delta=delta, logprobs=[])]

    def finish(self, reply: Any, max_tokens: int, answer: Answer) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        status = response_status(reply, max_tokens, answer)
        items = response_output(self.call_id, answer, status, self.offered)
        if answer.reasoning and not self.reasoning_done:  # (the whole thought where it came at once)
            out += self._reasoning(self.thought.reasoning_rest(answer.reasoning))
            out += self._close_reasoning(answer.reasoning)
        m = self.message_index
        if len(items) > m and items[m]["type"] == "message" and not self.message_open:
            out += self._open_message()
        if self.message_open:
            item_id, rest = response_message_id(self.call_id), self.text.rest(answer.content)
            final = self.text.sent + rest
            if rest:
                out.append(self._ev("response.output_text.delta", item_id=item_id, output_index=m, content_index=0,
                                    delta=rest, logprobs=[]))
            part = {"type": "output_text", "text": final, "annotations": [], "logprobs": []}
            item = items[m] = response_message_item(self.call_id, final, items[m]["status"])  # (no tools: no calls either)
            out += [self._ev("response.output_text.done", item_id=item_id, output_index=m, content_index=0,
                             text=final, logprobs=[]),
                    self._ev("response.content_part.done", item_id=item_id, output_index=m, content_index=0, part=part),
                    self._ev("response.output_item.done", output_index=m, item=item)]
        first_call = len(items) - len(answer.calls)
        for i, c in enumerate(answer.calls, start=first_call):
            item_id = items[i]["id"]
            out.append(self._ev("response.output_item.added", output_index=i,
                                item=response_call_item(c, "in_progress", self.offered)))
            if items[i]["type"] == "custom_tool_call":
                text = items[i]["input"]
                out += [self._ev("response.custom_tool_call_input.delta", item_id=item_id, output_index=i, delta=text),
                        self._ev("response.custom_tool_call_input.done", item_id=item_id, output_index=i, input=text)]
            else:
                args = items[i]["arguments"]
                out += [self._ev("response.function_call_arguments.delta", item_id=item_id, output_index=i, delta=args),
                        self._ev("response.function_call_arguments.done", item_id=item_id, output_index=i,
                                 arguments=args)]
            out.append(self._ev("response.output_item.done", output_index=i, item=items[i]))
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*out, self._ev(kind, response=self._response(status, items, response_usage(reply)))]

    def failed(self, code: str, message: str) -> list[tuple[str, dict[str, Any]]]:
        _, body = openai_error(code, message)
        err = {"code": body["error"]["code"] or "server_error", "message": message}
        return [self._ev("response.failed", response=self._response("failed", [], error=err))]
