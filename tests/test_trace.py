"""The trace reader/writer (talaria/workload/trace.py) against docs/trace-format.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.catalog import load_catalog
from shared.schema import ID_MAX_CHARS
from talaria.workload.agent import call_id_for
from talaria.workload.trace import SESSION_ID_MAX_CHARS
from talaria.workload.trace import (
    MAX_MODEL_S,
    TraceCall,
    TraceError,
    TraceSession,
    dump_trace,
    encode_trace,
    load_trace,
    parse_trace,
    session_prompts,
)

ROOT = Path(__file__).resolve().parents[1]


def _call(n: int = 100, o: int = 10, t: float = 0.5, **extra: object) -> dict:
    return {"new_input_tokens": n, "output_tokens": o, "tool_s": t, **extra}


def _line(sid: str = "s-0", model: str = "m", arrival: object = 0.0, calls: object = None, **extra: object) -> str:
    obj = {"session_id": sid, "model": model, "arrival_s": arrival, "calls": calls if calls is not None else [_call()]}
    obj.update(extra)
    return json.dumps(obj)


GOOD = "\n".join(
    [
        _line("a", arrival=0.0, calls=[_call(8192, 180, 0.6), _call(640, 95, 12.4), _call(31000, 210, 0.0, compact=True)]),
        "",  # blank lines are skipped
        _line("b", model="m2", arrival=41.5, calls=[_call(5000, 1, 0)]),
    ]
) + "\n"


def test_good_file_parses_and_round_trips(tmp_path: Path) -> None:
    sessions = parse_trace(GOOD, known_models=["m", "m2"])
    assert [s.session_id for s in sessions] == ["a", "b"]
    assert sessions[0].calls[2].compact is True and sessions[0].calls[0].compact is False
    assert sessions[1].arrival_s == 41.5 and isinstance(sessions[1].calls[0].tool_s, float)
    path = tmp_path / "t.jsonl"
    dump_trace(sessions, path)
    text = path.read_text()
    assert text.endswith("\n") and text.count("\n") == 2
    assert '"compact"' in text.splitlines()[0] and text.count('"compact"') == 1  # omitted when false
    first = json.loads(text.splitlines()[0])
    assert list(first) == ["session_id", "model", "arrival_s", "calls"]
    assert list(first["calls"][0]) == ["new_input_tokens", "output_tokens", "tool_s"]
    assert load_trace(path) == sessions
    assert encode_trace(load_trace(path)) == path.read_bytes()


def test_shipped_traces_parse_against_catalog() -> None:
    models = load_catalog().models
    for name in ("swebench-30.jsonl", "smoke-4.jsonl"):
        assert load_trace(ROOT / "traces" / name, known_models=models)


def test_unknown_fields_ignored() -> None:
    text = _line("x", calls=[_call(extra_field=[1, 2])], note="hello", version=2)
    (s,) = parse_trace(text)
    assert s.calls[0] == TraceCall(new_input_tokens=100, output_tokens=10, tool_s=0.5)


BAD_CASES = [
    # (bad line, expected field, a fragment of the message)
    ('{"session_id": "z", "model": "m"', "", "invalid JSON"),
    ("[1, 2]", "", "JSON object"),
    (_line("z", calls=[_call(), _call(), _call(o=-3)]), "calls[2].output_tokens", "integer >= 1 (got -3)"),
    (_line("z", calls=[_call(n=0)]), "calls[0].new_input_tokens", "integer >= 1"),
    (_line("z", calls=[_call(n=1.5)]), "calls[0].new_input_tokens", "integer >= 1 (got 1.5)"),
    (_line("z", calls=[_call(n="100")]), "calls[0].new_input_tokens", "integer"),
    (_line("z", calls=[_call(o=True)]), "calls[0].output_tokens", "integer"),
    (_line("z", calls=[_call(t=-0.1)]), "calls[0].tool_s", ">= 0"),
    (_line("z", calls=[_call(), _call(t=float("nan"))]), "calls[1].tool_s", "finite"),
    (_line("z", calls=[_call(t=float("inf"))]), "calls[0].tool_s", "finite"),
    (_line("z", arrival=-1), "arrival_s", ">= 0"),
    (_line("z", arrival=float("nan")), "arrival_s", "finite"),
    (_line("z", arrival=float("inf")), "arrival_s", "finite"),
    (_line("z", arrival="soon"), "arrival_s", "number"),
    (_line("z", calls=[]), "calls", "non-empty"),
    (_line("z", calls={"a": 1}), "calls", "list"),
    (_line("z", calls=[7]), "calls[0]", "call object"),
    (_line("z", calls=[_call(compact="yes")]), "calls[0].compact", "true or false"),
    (_line("z", model=5), "model", "string"),
    (_line(5), "session_id", "string"),
    # ids the live stack cannot carry: the bus schema's Id less a replay's run tag and call
    # index (a 200-character one failed mid-replay), and a newline breaks an HTTP header
    (_line(""), "session_id", f"string of 1-{SESSION_ID_MAX_CHARS} characters"),
    (_line("x" * (SESSION_ID_MAX_CHARS + 1)), "session_id", f"string of 1-{SESSION_ID_MAX_CHARS} characters"),
    (_line("x" * ID_MAX_CHARS), "session_id", f"string of 1-{SESSION_ID_MAX_CHARS} characters"),
    (_line("ends\n"), "session_id", "no control characters"),
    (_line("a\x00b"), "session_id", "no control characters"),
    # JSON "\ud800" is a lone surrogate: it loaded, then `sim` crashed printing it and a replay failed mid-run
    ('{"session_id": "a\\ud800b", "model": "m", "arrival_s": 0, "calls": [' + json.dumps(_call()) + "]}",
     "session_id", "lone surrogates"),
    # model seconds past MAX_MODEL_S lose precision (1e300 read as an SCT of 2.97e+284 s)
    (_line("z", arrival=1e300), "arrival_s", "at most 1,000,000,000"),
    (_line("z", arrival=MAX_MODEL_S + 1), "arrival_s", "at most 1,000,000,000"),
    (_line("z", calls=[_call(t=1e300), _call()]), "calls[0].tool_s", "past 1,000,000,000 s"),
    (_line("z", arrival=6e8, calls=[_call(t=3e8), _call(t=3e8), _call()]), "calls[1].tool_s", "reach 1.2e+09 s"),
    (json.dumps({"model": "m", "arrival_s": 0, "calls": [_call()]}), "session_id", "missing"),
    (json.dumps({"session_id": "z", "model": "m", "arrival_s": 0, "calls": [{"new_input_tokens": 1, "tool_s": 0}]}),
     "calls[0].output_tokens", "missing"),
]


@pytest.mark.parametrize("bad,field,fragment", BAD_CASES)
def test_rejections_name_line_and_field(bad: str, field: str, fragment: str) -> None:
    # The bad line is line 4 (after a good line and a blank line, and another good line).
    text = _line("ok-1") + "\n\n" + _line("ok-2") + "\n" + bad + "\n" + _line("ok-3") + "\n"
    with pytest.raises(TraceError) as info:
        parse_trace(text, source="trace.jsonl")
    err = info.value
    assert (err.line, err.field) == (4, field), str(err)
    assert str(err).startswith("trace.jsonl line 4" + (f", field {field}: " if field else ": "))
    assert fragment in str(err)


def test_the_longest_id_and_latest_times_still_load() -> None:
    """The limits are inclusive; unicode and punctuation in an id are the bus's to carry."""
    text = "\n".join([_line("x" * SESSION_ID_MAX_CHARS, arrival=MAX_MODEL_S, calls=[_call(t=0.0)]),
                      _line("日本語 a.b:c*>", arrival=MAX_MODEL_S - 3.0, calls=[_call(t=2.0), _call(t=1.0)])])
    assert [s.arrival_s for s in parse_trace(text)] == [MAX_MODEL_S, MAX_MODEL_S - 3.0]


def test_the_longest_session_id_leaves_room_for_the_ids_a_replay_makes_of_it() -> None:
    longest = "x" * SESSION_ID_MAX_CHARS
    run_tag = "r1a2b3c-"  # a replay against a running deployment
    assert len(run_tag + longest) <= ID_MAX_CHARS
    assert len(call_id_for(longest, 99_999, run_tag)) <= ID_MAX_CHARS


def test_error_message_format() -> None:
    text = "\n".join(_line(f"s{i}") for i in range(6)) + "\n" + _line("z", calls=[_call(), _call(), _call(o=-3)])
    with pytest.raises(TraceError, match=r"^trace\.jsonl line 7, field calls\[2\]\.output_tokens: "
                       r"must be an integer >= 1 \(got -3\)$"):
        parse_trace(text, source="trace.jsonl")


def test_duplicate_session_id_names_both_lines() -> None:
    text = "\n".join([_line("a"), _line("b"), _line("a")])
    with pytest.raises(TraceError) as info:
        parse_trace(text)
    assert (info.value.line, info.value.field) == (3, "session_id")
    assert "lines 1 and 3" in str(info.value)


def test_unknown_model_only_with_known_models() -> None:
    text = _line("a", model="gpt-9")
    assert parse_trace(text)[0].model == "gpt-9"
    with pytest.raises(TraceError) as info:
        parse_trace(text, known_models=load_catalog().models)
    assert (info.value.line, info.value.field) == (1, "model") and "gpt-9" in str(info.value)


def test_load_trace_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(_line("a") + "\n" + _line("b", calls=[]) + "\n")
    with pytest.raises(TraceError, match=r"bad\.jsonl line 2, field calls"):
        load_trace(p)


def test_a_file_written_on_windows_loads_the_same(tmp_path: Path) -> None:
    """A byte-order mark and CRLF line ends (what some editors and tools write) change nothing."""
    text = _line("a") + "\n\n" + _line("b") + "\n"
    plain, windows = tmp_path / "plain.jsonl", tmp_path / "windows.jsonl"
    plain.write_text(text)
    windows.write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    assert load_trace(windows) == load_trace(plain) and len(load_trace(plain)) == 2


def test_session_prompts_arithmetic() -> None:
    s = TraceSession(
        session_id="s",
        model="m",
        arrival_s=0.0,
        calls=[
            TraceCall(8000, 200, 1.0),
            TraceCall(500, 100, 1.0),
            TraceCall(300, 50, 1.0),
            TraceCall(9000, 400, 1.0, compact=True),  # context restarts from the summary
            TraceCall(700, 10, 0.0),
        ],
    )
    assert session_prompts(s) == [
        (8000, 0),
        (8000 + 200 + 500, 8200),
        (8700 + 100 + 300, 8800),
        (9000, 0),
        (9000 + 400 + 700, 9400),
    ]


def test_session_prompts_single_and_first_compact() -> None:
    s = TraceSession("s", "m", 0.0, [TraceCall(10, 5, 0.0, compact=True), TraceCall(1, 1, 0.0)])
    assert session_prompts(s) == [(10, 0), (16, 15)]


def test_a_raw_line_separator_inside_a_string_is_not_a_line_end() -> None:
    """U+2028 and U+2029 may stand raw in a JSON string; only "\\n" (or "\\r\\n") ends a trace line
    (splitlines() split there and refused a valid line)."""
    raw = json.dumps({"session_id": "a", "model": "m", "arrival_s": 0, "calls": [_call()],
                      "note": "one\u2028two\u2029three"}, ensure_ascii=False)
    text = raw + "\r\n" + _line("b") + "\n"
    assert "\u2028" in text and "\u2029" in text
    assert [s.session_id for s in parse_trace(text)] == ["a", "b"]


def test_invalid_json_says_where_once() -> None:
    with pytest.raises(TraceError) as info:
        parse_trace('{"session_id": "a\n')
    assert "invalid JSON: Unterminated string starting at column 16" in str(info.value)
    assert "at at" not in str(info.value)


@pytest.mark.parametrize(("extra", "said"), [
    ("[" * 1000 + "]" * 1000, "invalid JSON: nested too deeply"),
    ("9" * 5000, "invalid JSON: an integer of more than"),
])
def test_json_past_the_parsers_limits_is_refused_by_line(extra: str, said: str) -> None:
    # even in a field the format ignores: these had raised RecursionError and ValueError
    line = _line("a")[:-1] + f', "meta": {extra}}}'
    with pytest.raises(TraceError, match="line 2: " + said):
        parse_trace(_line("b") + "\n" + line + "\n")
