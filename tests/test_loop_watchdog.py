"""A service whose event loop is stuck exits on its own (compose restarts what
exits, never what is merely unhealthy); one whose loop runs does not, even while
its lag monitor, the process idle, wakes seldom."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.bus import LOOP_STALL_EXIT_CODE
from shared.clock import LAG_WINDOW_S, LagMonitor

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


def test_the_recent_worst_lag_holds_a_lag_for_one_to_two_windows_then_lets_it_go() -> None:
    """What `talaria_event_loop_lag_recent_seconds` (and TalariaEventLoopLag) reads: the
    worst since the start never comes down, so one blip kept the alert open 10 minutes."""
    w = LAG_WINDOW_S
    lag = LagMonitor()
    lag.window_began = 0.0
    lag.observe(0.01, 1.0)
    lag.observe(0.7, 5.0)
    assert lag.recent_worst_s(6.0) == 0.7 and lag.recent_worst_s(w + 5.0) == 0.7  # held through the next window
    assert lag.recent_worst_s(2 * w + 1.0) == 0.0                                 # ... and gone after it
    lag.observe(0.02, w + 2.0)        # a new window: the blip is the previous one's
    assert lag.recent_worst_s(w + 3.0) == 0.7
    lag.observe(0.03, 2 * w + 2.0)    # the blip's window is two back: forgotten
    assert lag.recent_worst_s(2 * w + 3.0) == 0.03
    lag.observe(0.9, 10 * w)          # after a long quiet spell (an idle process samples seldom)
    assert lag.recent_worst_s(10 * w + 1.0) == 0.9
    assert lag.worst_s == 0.9


def test_the_lag_monitor_sleeps_longer_while_its_process_is_idle() -> None:
    lag = LagMonitor(interval_s=0.05, idle_interval_s=0.8, busy_fraction=0.02)
    assert lag.next_sleep_s(0.05, 0.05, 0.0) == 0.1  # idle: the sleep doubles ...
    assert lag.next_sleep_s(0.4, 0.41, 0.001) == 0.8
    assert lag.next_sleep_s(0.8, 0.8, 0.0) == 0.8  # ... up to idle_interval_s
    assert lag.next_sleep_s(0.8, 0.8, 0.02) == 0.05  # busy (2.5% of the sleep): back at once
    assert lag.next_sleep_s(0.05, 0.05, 0.001) == 0.05  # 2% is busy


def test_an_idle_loop_wakes_its_monitor_seldom_a_busy_one_often_and_a_stall_is_measured() -> None:
    async def main() -> None:
        lag = LagMonitor(interval_s=0.05, idle_interval_s=0.4)
        task = asyncio.ensure_future(lag.run())
        await asyncio.sleep(2.0)
        assert lag.sleep_s == 0.4  # nothing else runs here

        async def work() -> None:  # computes about a third of the time
            while True:
                until = time.process_time() + 0.005
                while time.process_time() < until:
                    pass
                await asyncio.sleep(0.01)

        busy = asyncio.ensure_future(work())
        await asyncio.sleep(0.6)  # the idle sleep under way ends, and finds the process busy
        assert lag.sleep_s == 0.05
        time.sleep(0.5)  # a stall: the loop runs nothing
        await asyncio.sleep(0.2)
        assert lag.worst_s >= 0.4
        busy.cancel()
        task.cancel()

    asyncio.run(main())


def test_stalls_add_up_only_lags_long_enough_to_be_the_loop_held_up() -> None:
    """What the replay's lag guard and `talaria_event_loop_stalled_seconds` add up: a
    wake-up late by the timer's jitter is not a stall."""
    lag = LagMonitor()
    for late in (0.001, 0.004, 0.009):
        lag.observe(late, 1.0)
    assert lag.stalled_s == 0.0
    lag.observe(0.01, 2.0)
    lag.observe(0.25, 3.0)
    assert lag.stalled_s == pytest.approx(0.26) and lag.worst_s == 0.25
