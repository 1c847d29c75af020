"""A service's log file rotated by size (shared/logs.py `StdoutRotation`): where its output
is a `*.log` file (the embedded stack), past the bound it becomes NAME.1.log and the process
goes on in a new NAME.log, with no line lost or split; `keep` generations at most."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import nats

from polling import until
from shared.logs import LOG_FILE_ENV, read_log_events
from talaria.ops.nats_server import NatsServer
from talaria.ops.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[1]

WRITER = """
import sys
from shared.logs import StdoutRotation
rotation = StdoutRotation.for_stdout(max_bytes=4000, keep=2)
assert rotation is not None
for n in range(1000):
    print('{"n": %d, "pad": "%s"}' % (n, "x" * 40), flush=True)
    if n % 2 == 0:
        print(f"stderr {n}", file=sys.stderr, flush=True)
    if rotation.due():
        rotation.rotate()
"""


def test_a_log_past_its_bound_is_rotated_without_losing_a_line(tmp_path: Path) -> None:
    log = tmp_path / "svc.log"
    with open(log, "ab", buffering=0) as f:
        subprocess.run([sys.executable, "-c", WRITER], stdout=f, stderr=subprocess.STDOUT, check=True, cwd=ROOT,
                       env={**os.environ, LOG_FILE_ENV: str(log)})
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["svc.1.log", "svc.2.log", "svc.log"], files  # two generations kept, older ones dropped
    lines = [ln for p in (tmp_path / "svc.2.log", tmp_path / "svc.1.log", log) for ln in p.read_text().splitlines()]
    numbers = [int(ln.split('"n": ')[1].split(",")[0]) for ln in lines if ln.startswith("{")]
    # what is kept is whole and in order, ending with the last line written
    assert numbers == list(range(numbers[0], 1000)) and numbers[0] > 0
    assert all(ln.startswith("{") or ln.startswith("stderr ") for ln in lines)
    assert all(p.stat().st_size < 4000 + 200 for p in tmp_path.iterdir())


def test_output_that_is_not_a_log_file_its_supervisor_named_is_not_rotated(tmp_path: Path) -> None:
    probe = [sys.executable, "-c", "from shared.logs import StdoutRotation as R; "
             "print(R.for_stdout(1, 2) is not None, R.for_stdout(0, 2) is not None)"]
    named = {**os.environ, LOG_FILE_ENV: str(tmp_path / "svc.log")}
    piped = subprocess.run(probe, capture_output=True, text=True, check=True, cwd=ROOT, env=named)
    assert piped.stdout.split() == ["False", "False"]  # a pipe
    mine = tmp_path / "mine.log"
    with open(mine, "wb") as f:  # a file of the caller's own, named to nobody
        subprocess.run(probe, stdout=f, check=True, cwd=ROOT, env={k: v for k, v in os.environ.items()
                                                                     if k != LOG_FILE_ENV})
    assert mine.read_text().split() == ["False", "False"]
    (tmp_path / "svc.log").touch()
    with open(mine, "wb") as f:  # ... or beside a variable that names another file
        subprocess.run(probe, stdout=f, check=True, cwd=ROOT, env=named)
    assert mine.read_text().split() == ["False", "False"]
    with open(tmp_path / "svc.log", "wb") as f:
        subprocess.run(probe, stdout=f, check=True, cwd=ROOT, env=named)
    assert (tmp_path / "svc.log").read_text().split() == ["True", "False"]  # (0: rotation off)
    with open(tmp_path / "svc.1.log", "wb") as f:  # a warm spare whose file was rotated under it
        subprocess.run(probe, stdout=f, check=True, cwd=ROOT, env=named)
    assert (tmp_path / "svc.1.log").read_text().split() == ["True", "False"]


async def test_a_service_rotates_its_own_log(nats_server: NatsServer, redis_server: RedisServer,
                                             tmp_path: Path) -> None:
    from test_services import Services

    svc = Services(nats_server.url, redis_server.url, f"t{uuid.uuid4().hex[:8]}", f"t-{uuid.uuid4().hex[:8]}:",
                   tmp_path / "logs", which=("router",), extra_env={"TALARIA_LOG_MAX_BYTES": "100"})
    await svc.start()
    try:
        rotated = tmp_path / "logs" / f"{svc.router}.1.log"
        await until(lambda: rotated.exists(), 15, "the router's log was never rotated")
        assert any(d.get("event") == "service.started" for d in read_log_events(rotated))
        # the same process goes on writing to its new NAME.log: a line it logs now is there
        nc = await nats.connect(nats_server.url)
        try:
            await nc.request(svc.subjects.api_call(), b"not a call", timeout=5)
        finally:
            await nc.close()
        await until(lambda: any(d.get("event") == "request.rejected" for d in svc.log_lines(svc.router)), 10,
                    "the router's line after its rotation is not in its new log")
    finally:
        await svc.stop()
