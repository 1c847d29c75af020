"""`talaria logs SESSION` (talaria/ops/sessionlog.py): one session's lines from
every service's log, merged in wall-clock order, per run folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from talaria.cli import main
from talaria.ops.sessionlog import details, session_lines, summarize_calls


def _write(path: Path, *records: dict | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def _line(ts: str, event: str, session: str = "swe-007", call: str | None = "swe-007#000", **kw: object) -> dict:
    rec: dict = {"event": event, "session_id": session, "level": "info", "timestamp": f"2026-11-30T03:21:{ts}Z", **kw}
    if call is not None:
        rec["call_id"] = call
    return rec


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    run = tmp_path / "talaria"
    _write(run / "router-0.log",
           _line("38.100000", "session.opened", call=None, model="m"),
           _line("38.200000", "router.placed", at=51.2, candidates=[{"server": "s1", "score": 0.8, "residency": "active",
                                                                       "kv": "hbm"}]),
           _line("38.250000", "router.placed", session="swe-008", call="swe-008#000"),
           "--- [infra 2026-11-30 03:21:40] exited with code 1; restart in 10.0s")
    _write(run / "admission-s1.log",
           _line("38.300000", "admission.queued", at=51.3),
           _line("38.400000", "admission.dispatched", waited_s=12.5, round_wait=True, switch_wait_s=2.0),
           "{not json")
    _write(run / "engine-s1-m.log",
           _line("38.350000", "engine.kv_spilled", level="warning"),
           _line("38.500000", "engine.started", at=64.0),
           _line("38.900000", "engine.finished", at=70.0, output_tokens=40, cached_tokens=900, restored_tokens=300,
                 prefill_s=0.1, decode_s=5.9),
           _line("39.000000", "engine.finished", call="swe-007#001", at=80.0, output_tokens=7))
    _write(tmp_path / "baseline" / "router-0.log", _line("10.000000", "router.placed"))
    return tmp_path


def test_lines_merge_in_wall_order_per_run(logs: Path) -> None:
    runs = session_lines(logs, "swe-007")
    assert set(runs) == {logs / "talaria", logs / "baseline"}
    events = [(ln.source, ln.record["event"]) for ln in runs[logs / "talaria"]]
    assert events == [
        ("router-0", "session.opened"), ("router-0", "router.placed"), ("admission-s1", "admission.queued"),
        ("engine-s1-m", "engine.kv_spilled"), ("admission-s1", "admission.dispatched"), ("engine-s1-m", "engine.started"),
        ("engine-s1-m", "engine.finished"), ("engine-s1-m", "engine.finished"),
    ]
    assert all(ln.record["session_id"] == "swe-007" for lines in runs.values() for ln in lines)


def test_one_call_only(logs: Path) -> None:
    runs = session_lines(logs, "swe-007", call_id="swe-007#001")
    assert [ln.record["output_tokens"] for ln in runs[logs / "talaria"]] == [7]
    assert logs / "baseline" not in runs


def test_call_summaries(logs: Path) -> None:
    first, second = summarize_calls(session_lines(logs, "swe-007")[logs / "talaria"])
    assert (first.call_id, first.placed_on, first.waited_s, first.round_wait, first.switch_wait_s) == (
        "swe-007#000", "s1", 12.5, True, 2.0)
    assert (first.output_tokens, first.cached_tokens, first.prefill_s, first.decode_s) == (40, 900, 0.1, 5.9)
    assert (first.restored_tokens, second.restored_tokens) == (300, None)  # (restored from host memory: not cached)
    assert first.problems == ["engine.kv_spilled"]
    assert (second.call_id, second.output_tokens, second.placed_on, second.waited_s) == ("swe-007#001", 7, "", None)


def test_details_condense_candidates() -> None:
    text = details(_line("1", "router.placed", at=1.0, attempts=2,
                         candidates=[{"server": "s0", "score": -3.5, "residency": "host", "kv": "none"}]))
    assert text == "attempts=2 candidates=[s0 -3.5 (host/none)]"


def test_cli_prints_a_timeline_and_a_call_table(logs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["logs", "swe-007", "--log-dir", str(logs)]) == 0
    out = capsys.readouterr().out
    assert f"== {logs / 'talaria'}" in out and f"== {logs / 'baseline'}" in out
    assert "router.placed" in out and "swe-008" not in out
    talaria_run = out.split(f"== {logs / 'talaria'}")[1].split("== ")[0]
    row = next(ln for ln in talaria_run.splitlines() if ln.startswith("swe-007#000 "))
    assert row.split()[:4] == ["swe-007#000", "s1", "12.5", "yes"]


def test_cli_json_lines(logs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["logs", "swe-007", "--call", "swe-007#000", "--log-dir", str(logs / "talaria"), "--json"]) == 0
    recs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["event"] for r in recs][:2] == ["router.placed", "admission.queued"]
    assert {r["source"] for r in recs} == {"router-0", "admission-s1", "engine-s1-m"}


def test_cli_errors(logs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["logs", "swe-999", "--log-dir", str(logs)]) == 1
    assert "no log line names session swe-999" in capsys.readouterr().err
    assert main(["logs", "swe-007", "--log-dir", str(tmp_path / "nowhere")]) == 2
    assert "no log folder at" in capsys.readouterr().err


def test_a_merged_log_names_each_line_by_its_service(tmp_path: Path) -> None:
    """`docker compose logs --no-log-prefix > all.log`: one file, every service."""
    _write(tmp_path / "all.log",
           _line("38.2", "router.placed", service="router"),
           _line("38.3", "admission.queued", service="admission"))
    (lines,) = session_lines(tmp_path, "swe-007").values()
    assert [ln.source for ln in lines] == ["all:router", "all:admission"]


def test_run_picks_a_run_folder_or_a_deployment_prefix(logs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a replay against `talaria up` renamed the trace's swe-007 as r5c397f-swe-007
    _write(logs / "up" / "router-0.log", _line("50.000000", "router.placed", session="r5c397f-swe-007",
                                               call="r5c397f-swe-007#000"))
    assert main(["logs", "swe-007", "--run", "r5c397f", "--log-dir", str(logs), "--json"]) == 0
    recs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["session_id"] for r in recs] == ["r5c397f-swe-007"]
    assert main(["logs", "swe-007", "--run", "baseline", "--log-dir", str(logs), "--json"]) == 0
    recs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["timestamp"] for r in recs] == ["2026-11-30T03:21:10.000000Z"]  # that run folder's line only
    # the folder's path as the replay printed it picks it too
    assert main(["logs", "swe-007", "--run", str(logs / "baseline"), "--log-dir", str(logs), "--json"]) == 0
    recs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["timestamp"] for r in recs] == ["2026-11-30T03:21:10.000000Z"]
    # without --run, the renamed session is found and the prefix named
    _write(logs / "up2" / "router-0.log", _line("50.000000", "router.placed", session="r5c397f-swe-009"))
    assert main(["logs", "swe-009", "--log-dir", str(logs)]) == 1
    assert "renamed it r5c397f-swe-009: pass --run r5c397f" in capsys.readouterr().err


def test_json_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    import subprocess
    import sys

    # more lines than a pipe buffers, so the writer meets the closed pipe (`| head -1`)
    _write(tmp_path / "run" / "router-0.log",
           *(_line(f"{i // 1000 + 10}.{i % 1000:06d}", "router.placed", pad="x" * 200) for i in range(3000)))
    proc = subprocess.Popen([sys.executable, "-m", "talaria.cli", "logs", "swe-007", "--log-dir", str(tmp_path), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1])
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=30)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_an_http_agent_finds_its_calls_by_its_session_name_or_a_request_id(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # what an HTTP agent holds: the x-session-id it sent, and each reply's x-request-id
    sid, first, second = "gw-5a3540d561ec91c4", "gwc-4782ea75", "gwc-9f00c1d2"
    _write(tmp_path / "up" / "gateway.log",
           _line("38.000000", "gateway.call", session=sid, call=first, session_name="my-task-1", status=200),
           _line("39.000000", "gateway.call", session=sid, call=second, session_name="my-task-1", status=200))
    _write(tmp_path / "up" / "router-0.log",
           _line("37.900000", "router.placed", session=sid, call=first),
           _line("38.900000", "router.placed", session=sid, call=second))
    assert main(["logs", "my-task-1", "--log-dir", str(tmp_path), "--json"]) == 0
    assert {json.loads(x)["call_id"] for x in capsys.readouterr().out.splitlines()} == {first, second}
    assert main(["logs", second, "--log-dir", str(tmp_path), "--json"]) == 0
    recs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert {r["call_id"] for r in recs} == {second} and {r["source"] for r in recs} == {"gateway", "router-0"}


def test_a_session_name_two_tenants_sent_is_refused_with_both_sessions_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # each tenant's `x-session-id: shared-1` is its own session: the first tenant's alone had been
    # shown, as if it were the only one
    alice, bob = "gw-aaaaaaaaaaaaaaaa", "gw-bbbbbbbbbbbbbbbb"
    _write(tmp_path / "up" / "gateway.log",
           _line("38.000000", "gateway.call", session=alice, call="gwc-1", session_name="shared-1", tenant="alice",
                 model="m", status=200),
           _line("39.000000", "gateway.call", session=bob, call="gwc-2", session_name="shared-1", tenant="bob",
                 model="m", status=200))
    assert main(["logs", "shared-1", "--log-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (f"shared-1 names 2 sessions of different tenants: {alice} (tenant alice, model m), "
            f"{bob} (tenant bob, model m); give one of their ids") in err
    assert main(["logs", bob, "--log-dir", str(tmp_path), "--json"]) == 0
    assert {json.loads(x)["tenant"] for x in capsys.readouterr().out.splitlines()} == {"bob"}
    # one tenant's name sent with two models (Claude Code's main and small model): both sessions, together
    small = "gw-cccccccccccccccc"
    _write(tmp_path / "up" / "gateway.log",
           _line("38.000000", "gateway.call", session=alice, call="gwc-1", session_name="task", tenant="alice",
                 model="m", status=200),
           _line("38.500000", "gateway.call", session=small, call="gwc-3", session_name="task", tenant="alice",
                 model="small", status=200))
    assert main(["logs", "task", "--log-dir", str(tmp_path), "--json"]) == 0
    assert [json.loads(x)["call_id"] for x in capsys.readouterr().out.splitlines()] == ["gwc-1", "gwc-3"]


def test_an_unknown_run_is_refused_and_the_runs_there_named(logs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # it printed every run's timeline with exit 0, as if --run were not given
    _write(logs / "up" / "router-0.log", _line("50.000000", "router.placed", session="r5c397f-swe-007"))
    assert main(["logs", "swe-007", "--run", "nope", "--log-dir", str(logs)]) == 2
    assert capsys.readouterr() == ("", f"talaria: error: no run nope under {logs} "
                                       f"(runs there: baseline, r5c397f, talaria, up)\n")
    # a prefix that names another session's replay is a run; this session is just not in it
    _write(logs / "up" / "router-1.log", _line("51.000000", "router.placed", session="r0000ff-swe-008"))
    assert main(["logs", "swe-007", "--run", "r0000ff", "--log-dir", str(logs)]) == 1
    assert "no log line names session r0000ff-swe-007" in capsys.readouterr().err


def test_a_clients_text_in_a_log_field_is_shown_escaped_never_as_control_characters(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A session header or a path is the client's text: shown raw, a newline in it forged a
    line of the timeline and an escape sequence drove the reader's terminal."""
    forged = "evil\x1b]0;pwned\x07\x1b[31m\nswe-007#999 s9 forged line\u202e"
    _write(tmp_path / "up" / "gateway.log",
           _line("38.100000", "gateway.call", session_name=forged, path="/v1/chat/completions"),
           {"event": "gateway.refused", "request_id": "req_1", "level": "info", "timestamp": "2026-11-30T03:21:39Z",
            "method": "GET", "path": "/v1/\x1b[31mX\n{\"event\":\"forged\"}", "status": 404, "code": "not_found",
            "message": "no such endpoint\r\nforged"})
    for session in ("swe-007", "req_1"):
        assert main(["logs", session, "--log-dir", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert not any(c in out for c in "\x1b\x07\r\u202e"), out
        lines = out.splitlines()
        assert "forged" in out and not any(ln.startswith(("swe-007#999", '{"event"', "forged")) for ln in lines), out
        assert "\\x1b" in out and "\\x0a" in out
    assert len(out.strip().splitlines()) == 1  # (the refusal: one line)
