"""One way for tests to replay a trace through an embedded stack and strike it mid-way."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable

from shared.clock import ScaledClock
from talaria.client import TalariaClient
from talaria.ops.stack import EmbeddedStack
from talaria.replay import ReplayOutcome, drive
from talaria.workload.trace import TraceSession


async def replay_with_a_fault(stack: EmbeddedStack, sessions: list[TraceSession], fault: Callable[[], object],
                              *, after_calls: int, timeout_s: float) -> ReplayOutcome:
    """Replay `sessions` as the `talaria` policy, calling `fault()` (plain or async) once
    `after_calls` calls have been answered, and return the replay's outcome."""
    client = await TalariaClient.connect(stack.nats_urls, subject_prefix=stack.subject_prefix,
                                         silence_s=5.0, retries=20, **stack.nats_auth("agent"))
    done: list[str] = []
    try:
        clock = ScaledClock(stack.spec.time_scale, stack.clock_epoch)
        replay = asyncio.ensure_future(drive(client, clock, sessions, "talaria",
                                             on_reply=lambda r: done.append(r.call_id), error_retries=10))
        while len(done) < after_calls:
            assert not replay.done(), replay
            await asyncio.sleep(0.05)
        struck = fault()
        if inspect.isawaitable(struck):
            await struck
        return await asyncio.wait_for(replay, timeout=timeout_s)
    finally:
        await client.close()
