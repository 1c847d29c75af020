"""One way for tests to wait for a condition: poll it until a deadline.

Services answer asynchronously (a mirror written a moment after a step, a log
line after a reply), so tests poll with a deadline instead of sleeping a fixed
time: fast when the machine is idle, patient when it is loaded."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def until(pred: Callable[[], bool | Awaitable[bool]], timeout_s: float, what: str = "condition not met in time",
                interval_s: float = 0.05) -> None:
    """Return once `pred()` (plain or async) is true; fail the test with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        ok = pred()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return
        assert time.monotonic() < deadline, what
        await asyncio.sleep(interval_s)
