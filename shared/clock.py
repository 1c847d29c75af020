"""The one clock: model seconds, scaled from wall time.

Every timer in every service (slot quantum, reservation expiry, engine
progress, tool gaps in the replay) is expressed in model seconds through this
clock, so the time scale never changes an answer. All processes of a stack
share the epoch (TALARIA_CLOCK_EPOCH, wall seconds since 1970).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ScaledClock:
    scale: float = 1.0        # model seconds per wall second
    epoch: float = 0.0        # wall time (time.time()) of model time 0

    def now(self) -> float:
        return (time.time() - self.epoch) * self.scale

    def wall_s(self, model_s: float) -> float:
        return model_s / self.scale

    def at_source(self, at: float | None, floor: float) -> float:
        """`at_source` at this clock's now, back at most SOURCE_LAG_MAX_WALL_S of wall
        time: what held an event up longer than a hop (a stalled Redis under its
        sender, a stopped process) is time that passed, not latency to take out; taken
        back whole, a switch held up 30 s ended in the past and its calls' tokens came
        all at once, their waits under-reported."""
        return at_source(at, self.now(), floor, SOURCE_LAG_MAX_WALL_S * self.scale)

    async def sleep(self, model_s: float) -> None:
        await asyncio.sleep(max(0.0, model_s) / self.scale)

    async def sleep_until(self, model_t: float) -> None:
        await asyncio.sleep(max(0.0, model_t - self.now()) / self.scale)


async def done_within(aw: Awaitable[object], timeout_s: float) -> bool:
    """Await `aw` for at most `timeout_s` wall seconds; True if it completed.
    With asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
    cancellation that races the completion, and a task told to stop would not."""
    try:
        async with asyncio.timeout(timeout_s):
            await aw
    except TimeoutError:
        return False
    return True


LAG_REPORT_WALL_S = 1.0  # how often a process's lag figures reach its metrics (and Redis, for a replay's guard)
LAG_WINDOW_S = 30.0  # the recent worst lag covers the last 30-60 wall s
STALL_MIN_WALL_S = 0.01  # a wake-up at least this late is a stall (the loop held up), not the timer's jitter
SOURCE_LAG_MAX_WALL_S = 5.0  # how far back an event's source time is taken: a hop's latency, not a stall's


def at_source(at: float | None, now: float, floor: float, max_lag: float = float("inf")) -> float:
    """The model time an event takes effect: `at`, when it was decided or
    happened at its source, rather than `now`, when its message landed (wall
    latency, which the time scale multiplies, stays out of the answer); never in
    the future, never before `floor`, the receiver's last step, and never more
    than `max_lag` before `now` (`ScaledClock.at_source`)."""
    return max(floor, now - max_lag, now if at is None else min(at, now))


class LagMonitor:
    """Measures event-loop lag: how late a short sleep wakes up.

    A wake-up is not free (about 0.25 ms of CPU on the 2-core development machine,
    so 20 a second were most of an idle service's CPU, and a 16-server stack has
    about fifty services). Lag comes from work, so the sleep is `interval_s` while
    the process is busy (its CPU over the last sleep at least `busy_fraction` of
    it) and doubles, up to `idle_interval_s`, while it is not; the first sleep
    that finds it busy again returns to `interval_s`. An idle process's stall is
    still measured when it covers a wake-up.
    """

    def __init__(self, interval_s: float = 0.05, idle_interval_s: float = 0.8, busy_fraction: float = 0.02) -> None:
        self.interval_s = interval_s
        self.idle_interval_s = max(interval_s, idle_interval_s)
        self.busy_fraction = busy_fraction
        self.worst_s = 0.0
        # the stalls' total (wall s): a run is distorted by stalls adding up, not by one short one
        self.stalled_s = 0.0
        # the worst in the current and the previous window of LAG_WINDOW_S: the recent worst, for an
        # alert that ends when the lag does (the worst since the start never comes down)
        self.window = (0.0, 0.0)
        self.window_began = time.monotonic()
        self.last_tick = time.monotonic()  # when the loop last ran this monitor (a stuck loop stops it)
        self.due = self.last_tick + interval_s  # when it should run next (monotonic): a watchdog's reference
        self.sleep_s = interval_s  # the sleep now

    def observe(self, lag_s: float, now: float) -> None:
        """One measured lag (wall s) at monotonic time `now`."""
        self.worst_s = max(self.worst_s, lag_s)
        if lag_s >= STALL_MIN_WALL_S:
            self.stalled_s += lag_s
        if now - self.window_began >= 2 * LAG_WINDOW_S:  # (nothing observed for a whole window)
            self.window, self.window_began = (0.0, 0.0), now
        elif now - self.window_began >= LAG_WINDOW_S:
            self.window, self.window_began = (self.window[1], 0.0), self.window_began + LAG_WINDOW_S
        self.window = (self.window[0], max(self.window[1], lag_s))

    def recent_worst_s(self, now: float) -> float:
        """The worst lag of the last LAG_WINDOW_S to 2 x LAG_WINDOW_S (0 once that long passed without one)."""
        if now - self.window_began >= 2 * LAG_WINDOW_S:
            return 0.0
        if now - self.window_began >= LAG_WINDOW_S:
            return self.window[1]
        return max(self.window)

    def next_sleep_s(self, slept_s: float, elapsed_s: float, cpu_s: float) -> float:
        """The next sleep, given the last one and the process's CPU meanwhile."""
        if cpu_s >= self.busy_fraction * elapsed_s:
            return self.interval_s
        return min(self.idle_interval_s, 2 * slept_s)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        cpu0 = time.process_time()
        while True:
            t0 = loop.time()
            self.due = time.monotonic() + self.sleep_s
            await asyncio.sleep(self.sleep_s)
            self.last_tick = time.monotonic()
            elapsed = loop.time() - t0
            self.observe(elapsed - self.sleep_s, self.last_tick)
            cpu = time.process_time()
            self.sleep_s, cpu0 = self.next_sleep_s(self.sleep_s, elapsed, cpu - cpu0), cpu


async def drive_timer(
    clock: ScaledClock,
    next_at: Callable[[], float | None],
    wakeup: asyncio.Event,
    on_due: Callable[[float], Awaitable[None]],
) -> None:
    """Drive a state machine's wake-ups on the model clock: sleep until its
    next wake-up (model time), or until `wakeup` says its state changed, then
    call `on_due` with the wake-up's model time. Never returns; run it as a task."""
    while True:
        wakeup.clear()
        nxt = next_at()
        if nxt is None:
            await wakeup.wait()
            continue
        delay = clock.wall_s(nxt - clock.now())
        if delay > 0 and await done_within(wakeup.wait(), delay):
            continue  # something changed: recompute
        await on_due(nxt)
