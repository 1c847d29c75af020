"""A service whose event loop is stuck exits on its own (compose restarts what
exits, never what is merely unhealthy); one whose loop runs does not."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from shared.bus import LOOP_STALL_EXIT_CODE

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import asyncio, time
from shared.bus import start_loop_watchdog
from shared.clock import LagMonitor

async def main(block: bool) -> None:
    lag = LagMonitor()
    asyncio.ensure_future(lag.run())
    await asyncio.sleep(0.2)
    start_loop_watchdog(lag, 1.0, "test")
    if block:
        time.sleep(20)      # the loop is stuck: nothing else runs
    else:
        await asyncio.sleep(3)  # the loop runs: the watchdog stays quiet

asyncio.run(main({block}))
"""


def _run(block: bool) -> tuple[int, float, str]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", SCRIPT.format(block=block)], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    return p.returncode, time.monotonic() - t0, p.stderr


def test_a_stuck_loop_ends_the_process() -> None:
    code, took, err = _run(True)
    assert code == LOOP_STALL_EXIT_CODE, err
    assert took < 15, took  # well before the 20-s block ends
    assert "service.loop_stuck" in err


def test_a_running_loop_is_left_alone() -> None:
    code, _, err = _run(False)
    assert code == 0, err
