"""A command that starts servers leaves nothing running when it is stopped by
a signal: SIGTERM, SIGHUP and SIGINT to `talaria replay`, `talaria up` and
`talaria chaos`, while their stacks run. Every process a command starts
inherits its environment, so a marker variable finds them all, also the
NATS nodes and Redis that no longer have it as their parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "traces" / "smoke-4.jsonl")
MARK = "TALARIA_TEST_SIGNAL_MARK"

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240), pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")]


def marked(mark: str) -> list[int]:
    """Live processes whose environment carries `mark` (zombies excluded)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if f"{MARK}={mark}".encode() not in (d / "environ").read_bytes():
                continue
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone, or not ours to read
            continue
        if state != "Z":
            out.append(int(d.name))
    return out


CASES = [
    ("replay", ["replay", SMOKE, "--policy", "talaria", "--time-scale", "5"], "stack up", signal.SIGTERM),
    ("up", ["up", "--policy", "talaria", "--time-scale", "5"], "talaria is up", signal.SIGHUP),
    ("chaos", ["chaos", SMOKE, "--time-scale", "50"], "[chaos] fault-free reference run", signal.SIGTERM),
    ("replay-int", ["replay", SMOKE, "--policy", "baseline", "--time-scale", "5"], "stack up", signal.SIGINT),
    # after chaos has restarted a NATS node and Redis itself (from worker threads)
    ("chaos-after-restarts", ["chaos", SMOKE, "--time-scale", "5", "--kinds", "nats,redis"], "killed  redis",
     signal.SIGTERM),
    ("fidelity", ["fidelity", "--seeds", "1", "--time-scale", "50"], "stack up", signal.SIGTERM),
    ("bench-control-plane", ["bench-control-plane", "--rates", "20", "--duration", "120"], "stack up", signal.SIGTERM),
]


@pytest.mark.parametrize(("name", "argv", "ready", "sig"), CASES, ids=[c[0] for c in CASES])
def test_a_signal_leaves_nothing_running(name: str, argv: list[str], ready: str, sig: signal.Signals,
                                         tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    env = {**os.environ, MARK: mark, "TALARIA_LOG_DIR": str(tmp_path / "logs"), "PYTHONUNBUFFERED": "1"}
    if name == "up":
        argv = [*argv, "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.Popen([sys.executable, "-m", "talaria.cli", *argv], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    up = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if ready in line:
                up.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert up.wait(120), f"{name} never got ready:\n{''.join(seen)}"
        time.sleep(1.0)  # the services are running now
        assert len(marked(mark)) >= 3, "the marker does not reach the children: the check would prove nothing"
        proc.send_signal(sig)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 5
        while marked(mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = marked(mark)
        cmdlines = [(Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:120]) for p in left
                    if Path(f"/proc/{p}").exists()]
        assert not left, f"{name}: left running after {sig.name}: {cmdlines}\n{''.join(seen)[-2000:]}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in marked(mark):  # never leave a test's servers behind, whatever failed
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
