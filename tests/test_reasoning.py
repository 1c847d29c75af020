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


def test_harmonys_analysis_channel_is_reasoning() -> None:
    text = ("<|channel|>analysis<|message|>the test imports a.py<|end|><|start|>assistant<|channel|>final"
            "<|message|>It fails on import.<|return|>")
    assert rs.split(text, "harmony") == ("the test imports a.py", "It fails on import.")
    assert rs.split("<|channel|>analysis<|message|>cut off while thin", "harmony") == ("cut off while thin", "")
    assert rs.split("no markup at all", "harmony") == (None, "no markup at all")  # (the sim engine's filler)
    # two thoughts, a preamble, then a call: the call stays in the answer, in its markup, for the tool parser
    call = "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}"
    text = ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
            "<|start|>assistant<|channel|>analysis<|message|>b<|end|>" + call)
    assert rs.split(text, "harmony") == ("a\n\nb", "Checking.\n\n" + call)


_PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "<th", "think>", "ink", "\n", "  ", "a", "b c", "<tool_call>", "é"])


_HARMONY_PIECES = st.sampled_from(["<|channel|>", "analysis", "final", "commentary", " to=functions.f ", "<|message|>",
                                   "<|end|>", "<|start|>assistant", "<|constrain|>json", "<|call|>", "<|return|>", "<|",
                                   "<|en", "<", "|>", "\n", " ", "a", "b c", "{}", "é", "to=", "t"])


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(_PIECES, max_size=14), harmony_parts=st.lists(_HARMONY_PIECES, max_size=16),
       cuts=st.lists(st.integers(0, 80), max_size=8), fmt=st.sampled_from(["think", "harmony"]))
def test_a_stream_hands_out_the_whole_replys_split_whatever_its_batches(
        parts: list[str], harmony_parts: list[str], cuts: list[int], fmt: str) -> None:
    text = "".join(parts if fmt == "think" else harmony_parts)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    s = rs.Splitter(fmt)
    reasoning, answer = "", ""
    for a, b in zip(bounds, bounds[1:]):
        r, t = s.feed(text[a:b])
        reasoning, answer = reasoning + r, answer + t
    whole_r, whole_a = rs.split(text, fmt)
    assert whole_a.startswith(answer)  # what was sent stands: the rest completes it
    assert (s.reasoning_sent, s.answer_sent) == (reasoning, answer)
    reasoning += s.reasoning_rest(whole_r)
    assert reasoning == (whole_r or "")
