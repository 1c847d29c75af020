"""The seeded session generator (talaria/workload/generate.py) and the shipped traces."""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import msgspec
import pytest

from shared.catalog import load_catalog
from talaria.workload.trace import encode_trace, load_trace, session_prompts
from talaria.workload.generate import (
    GeneratorSettings,
    configure_parser,
    generate,
    load_settings,
    run,
    trace_stats,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TOML = ROOT / "traces" / "swebench-30.toml"
DEFAULT_JSONL = ROOT / "traces" / "swebench-30.jsonl"
# Pinned so the headline trace cannot drift silently: regenerate deliberately and update this.
DEFAULT_SHA256 = "d1931686479e693cc4af31b19025de1271151700c2801862e201c077436d1da3"
LONGEST_CONTEXT = max(m.context_limit for m in load_catalog().models.values())


def _args(*argv: str) -> argparse.Namespace:
    return configure_parser(argparse.ArgumentParser()).parse_args(list(argv))


def test_default_trace_regenerates_byte_for_byte() -> None:
    data = encode_trace(generate(load_settings(DEFAULT_TOML)))
    assert data == DEFAULT_JSONL.read_bytes()
    assert hashlib.sha256(DEFAULT_JSONL.read_bytes()).hexdigest() == DEFAULT_SHA256


def test_smoke_trace_regenerates() -> None:
    settings = load_settings(ROOT / "traces" / "smoke-4.toml")
    sessions = generate(settings)
    assert encode_trace(sessions) == (ROOT / "traces" / "smoke-4.jsonl").read_bytes()
    assert len(sessions) == 4 and sum(len(s.calls) for s in sessions) == 20
    assert max(s.arrival_s for s in sessions) <= 20.0
    assert {s.model for s in sessions} == set(settings.models)


def test_deterministic_and_seed_sensitive() -> None:
    s = GeneratorSettings()
    assert generate(s, seed=7) == generate(s, seed=7)
    assert generate(s, seed=7) != generate(s, seed=8)
    assert generate(s) == generate(s, seed=s.seed)


@pytest.mark.parametrize("seed", range(5))
def test_sums_and_invariants(seed: int) -> None:
    s = load_settings(DEFAULT_TOML)
    sessions = generate(s, seed=seed)
    cat = load_catalog()
    assert len(sessions) == s.sessions
    assert sum(len(x.calls) for x in sessions) == s.calls_total
    assert [x.session_id for x in sessions] == [f"swe-{i:03d}" for i in range(s.sessions)]
    assert sessions[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(sessions, sessions[1:]))
    assert set(x.model for x in sessions) == set(s.models)  # every model gets a session
    for x in sessions:
        assert len(x.calls) >= s.min_calls
        assert x.calls[-1].tool_s == 0.0
        assert not x.calls[0].compact
        limit = cat.model(x.model).context_limit
        for (prompt, _), call in zip(session_prompts(x), x.calls):
            assert prompt + call.output_tokens <= limit  # no prompt exceeds its model's context
            assert 1 <= call.output_tokens <= s.output_max
            assert 0.0 <= call.tool_s <= 600.0
            assert round(call.tool_s, 3) == call.tool_s


def test_uneven_counts_and_skew() -> None:
    s = GeneratorSettings(sessions=7, calls_total=101, calls_sigma=1.5, min_calls=3, popularity_skew=2.0)
    for seed in range(20):
        sessions = generate(s, seed=seed)
        assert sum(len(x.calls) for x in sessions) == 101
        assert min(len(x.calls) for x in sessions) >= 3


def test_default_stats_within_published_ranges() -> None:
    st = trace_stats(load_trace(DEFAULT_JSONL))
    assert (st["sessions"], st["calls"]) == (30, 960)
    assert st["calls_per_session"]["mean"] == 32.0
    assert 25 <= st["calls_per_session"]["p50"] <= 40
    assert 500 <= st["appended_tokens"]["median"] <= 1200  # published ~875
    assert 30_000 <= st["mean_context_per_call"] <= 50_000  # published 35k-42k
    assert 120 <= st["output_tokens_median"] <= 300  # published ~200 (110-250)
    assert 1.5 <= st["tool_gap_s"]["mean"] <= 8.0  # fit ~3.7 s; measured 3.4-4.6 s per step
    assert 0.2 <= st["tool_gap_s"]["p50"] <= 1.0
    assert 0.02 <= st["sessions_compacted_share"] <= 0.5  # published 4-18% (see docs/trace.md)
    assert st["prefix_reuse_share"] >= 0.9  # published 96-99%
    assert st["last_arrival_s"] <= 400
    assert sum(st["sessions_per_model"].values()) == 30


def test_claude_code_gaps_are_heavy_tailed() -> None:
    st = trace_stats(generate(GeneratorSettings(tool_gap_style="claude-code"), seed=1))
    assert 0.1 <= st["tool_gap_s"]["p50"] <= 0.8  # published p50 0.3 s
    assert st["tool_gap_s"]["p90"] >= 5.0  # published p90 13.6 s


def test_cli_writes_trace_and_stats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.jsonl"
    assert run(_args("--settings", str(DEFAULT_TOML), "--seed", "3", "--out", str(out), "--stats")) == 0
    assert out.read_bytes() == encode_trace(generate(load_settings(DEFAULT_TOML), seed=3))
    assert '"calls_per_session"' in capsys.readouterr().out


@pytest.mark.parametrize(
    "content,fragment",
    [
        ("sessions = 'thirty'", "Expected `int`"),
        ("sesions = 30", "unknown field `sesions`"),
        ("models = ['no-such-model']", "no-such-model"),
        ("calls_total = 10\nsessions = 30", "calls_total"),
        ("tool_gap_style = 'aider'", "tool_gap_style"),
        ("server = 'tpu'", "tpu"),
        ("this is not toml", "invalid TOML"),
        # past these bounds a draw overflowed (a traceback) or the trace was absurd (arrivals ~1e300 s)
        ("calls_sigma = inf", "calls_sigma: Expected `float` <= 5.0"),
        ("calls_sigma = 1000", "calls_sigma: Expected `float` <= 5.0"),
        ("output_sigma = 1000", "output_sigma: Expected `float` <= 5.0"),
        ("output_median = inf", f"output_median must be at most {LONGEST_CONTEXT} tokens"),
        ("append_median = 1e308", f"append_median must be at most {LONGEST_CONTEXT} tokens"),
        ("popularity_skew = 1e300", "popularity_skew: Expected `float` <= 50.0"),
        ("arrival_rate_per_s = 1e-300", "arrival_rate_per_s: Expected `float` >= 1e-06"),
        ("arrival_rate_per_s = 1e-6\nsessions = 1000\ncalls_total = 2000", "arrival_rate_per_s (1e-06) spreads 1000"),
    ],
)
def test_cli_bad_settings_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, fragment: str) -> None:
    p = tmp_path / "bad.toml"
    p.write_text(content + "\n")
    assert run(_args("--settings", str(p))) == 2
    err = capsys.readouterr().err
    assert err.startswith("talaria generate: error: ") and fragment in err and "Traceback" not in err


def test_a_settings_file_and_a_scenario_given_for_each_other_are_named_as_what_they_are(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A trace's generator settings (traces/*.toml) given to `talaria sim`, or a scenario to
    `talaria generate --settings`: each had said only "unknown field `seed`" (or `name`)."""
    from talaria.cli import main

    assert run(_args("--settings", str(ROOT / "scenarios" / "4x120x5.toml"))) == 2
    assert "4x120x5.toml is a scenario (talaria sim, compare, paired" in capsys.readouterr().err
    assert main(["sim", str(ROOT / "traces" / "smoke-4.toml")]) == 2
    assert "smoke-4.toml is a trace generator's settings (talaria generate --settings), not a scenario file" \
        in capsys.readouterr().err
    assert main(["sim", str(ROOT / "scenarios" / "4x120x5.toml"), "--policy", "talaria"]) == 0  # (each as itself)


def test_cli_missing_settings_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(_args("--settings", str(tmp_path / "nope.toml"))) == 2
    assert "cannot read settings" in capsys.readouterr().err


def test_settings_struct_decodes_defaults() -> None:
    assert msgspec.toml.decode(b"", type=GeneratorSettings) == GeneratorSettings()


def test_the_bounds_leave_every_real_setting_and_keep_extremes_finite(tmp_path: Path) -> None:
    """Each knob at its bound still gives a trace the loader accepts; an infinite rate (every
    session at 0) stays allowed."""
    p = tmp_path / "edge.toml"
    p.write_text("calls_sigma = 5\nappend_sigma = 5\nappend_large_sigma = 5\noutput_sigma = 5\n"
                 f"append_median = {LONGEST_CONTEXT}\noutput_median = {LONGEST_CONTEXT}\npopularity_skew = 50\n"
                 "arrival_rate_per_s = 1e-6\nsessions = 5\ncalls_total = 100\n")
    out = tmp_path / "edge.jsonl"
    out.write_bytes(encode_trace(generate(load_settings(p))))
    assert len(load_trace(out, known_models=load_catalog().models)) == 5
    p.write_text("arrival_rate_per_s = inf\n")
    assert {s.arrival_s for s in generate(load_settings(p))} == {0.0}
