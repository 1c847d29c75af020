"""A thinking model's reasoning read apart from its answer (services/gateway/reasoning.py):
whole replies, and streams cut at any point giving the same split."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from services.gateway import reasoning as rs


def test_a_thought_before_the_answer_is_reasoning() -> None:
    assert rs.split("<think>\nthe test imports a.py\n</think>\n\nIt fails on import.", "think") == \
        ("the test imports a.py", "It fails on import.")
    assert rs.split("  <think>cut off while thin", "think") == ("cut off while thin", "")  # max_tokens in a thought
    assert rs.split("no thought at all", "think") == (None, "no thought at all")
    assert rs.split("an answer that mentions <think> later", "think") == (None, "an answer that mentions <think> later")
    assert rs.split("<think>x</think>y", "none") == (None, "<think>x</think>y")  # a model that does not think
    # a call written in a thought is reasoning, not a call: only the answer reaches the tool parser
    assert rs.split("<think>maybe <tool_call>{}</tool_call></think>done", "think")[1] == "done"


_PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "<th", "think>", "ink", "\n", "  ", "a", "b c", "<tool_call>", "é"])


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(_PIECES, max_size=14), cuts=st.lists(st.integers(0, 60), max_size=8))
def test_a_stream_hands_out_the_whole_replys_split_whatever_its_batches(parts: list[str], cuts: list[int]) -> None:
    text = "".join(parts)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    s = rs.Splitter("think")
    reasoning, answer = "", ""
    for a, b in zip(bounds, bounds[1:]):
        r, t = s.feed(text[a:b])
        reasoning, answer = reasoning + r, answer + t
    whole_r, whole_a = rs.split(text, "think")
    assert whole_a.startswith(answer)  # what was sent stands: the rest completes it
    reasoning += s.reasoning_rest(whole_r)
    assert reasoning == (whole_r or "")
