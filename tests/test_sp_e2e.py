"""Session-prefill end to end: a continuation that returns while its model's
slot is still open is admitted in that slot with SP on, and waits for the
model's next round with SP off; likewise a new session's first call with
`sp_new_sessions` on and off — through the live services and in the
simulator (the same scheduler code)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from shared.catalog import load_catalog
from shared.clock import ScaledClock
from shared.policy import resolve_policy
from talaria.workload.trace import TraceCall, TraceSession
from talaria.client import TalariaClient
from talaria.results.records import CallRecord
from talaria.replay import drive
from talaria.sim.simulator import simulate
from talaria.ops.stack import EmbeddedStack, StackSpec

AIR, GLM = "glm-4.5-air-fp8", "glm-4.5-fp8"

# a1 makes a short call and returns 0.5 s later; a2 keeps AIR's slot busy with a
# long generation; g1 (another model) is waiting, so without SP a1's second call
# must wait for AIR's next round. g1 comes while AIR is switched in (about 5 s):
# 2 model s after the others, 100 wall ms at 20x (at 0.2 s, 10 wall ms, the live
# services once took g1's call first and served GLM before AIR).
TRACE = [
    TraceSession("a1", AIR, 0.0, [TraceCall(2000, 20, 0.5), TraceCall(200, 20, 0.0)]),
    TraceSession("a2", AIR, 0.0, [TraceCall(2000, 3000, 0.0)]),
    TraceSession("g1", GLM, 2.0, [TraceCall(2000, 20, 0.0)]),
]


# a3 starts while AIR's slot is open (a2 keeps it busy, g1 waits): with
# sp_new_sessions its first call joins the slot; without it, it waits a round.
TRACE_NEW_SESSION = [*TRACE, TraceSession("a3", AIR, 16.0, [TraceCall(2000, 20, 0.0)])]


def second_call(records: list[CallRecord]) -> CallRecord:
    return next(r for r in records if r.session_id == "a1" and r.index == 1)


def new_session_call(records: list[CallRecord]) -> CallRecord:
    return next(r for r in records if r.session_id == "a3" and r.index == 0)


CASES = [
    pytest.param(TRACE, second_call, "talaria", False, id="sp-on"),
    pytest.param(TRACE, second_call, "talaria-no-sp", True, id="sp-off"),
    pytest.param(TRACE_NEW_SESSION, new_session_call, "talaria", False, id="new-session-on"),
    pytest.param(TRACE_NEW_SESSION, new_session_call, "talaria-no-sp-new", True, id="new-session-off"),
]


def check(c: CallRecord, expect_round_wait: bool) -> None:
    assert c.round_wait is expect_round_wait
    if not expect_round_wait:
        assert c.waited_s < 1.0
    else:
        assert c.waited_s > 5.0  # it sat out a2's decode, g1's slot and two switches


@pytest.mark.parametrize("trace,pick,policy,expect_round_wait", CASES)
def test_in_the_simulator(trace: list[TraceSession], pick: Callable[[list[CallRecord]], CallRecord], policy: str, expect_round_wait: bool) -> None:
    check(pick(simulate(trace, load_catalog(), resolve_policy(policy)).records), expect_round_wait)


@pytest.mark.e2e
@pytest.mark.parametrize("trace,pick,policy,expect_round_wait", CASES)
async def test_through_the_live_services(tmp_path: Path, trace: list[TraceSession],
                                         pick: Callable[[list[CallRecord]], CallRecord], policy: str,
                                         expect_round_wait: bool) -> None:
    spec = StackSpec(policy=resolve_policy(policy), models=[AIR, GLM], time_scale=20.0, log_dir=tmp_path / "logs")
    async with EmbeddedStack(spec) as stack:
        client = await TalariaClient.connect(stack.nats_urls, subject_prefix=stack.subject_prefix, **stack.nats_auth("agent"))
        try:
            out = await asyncio.wait_for(
                drive(client, ScaledClock(spec.time_scale, stack.clock_epoch), trace, policy, progress_every_wall_s=30),
                timeout=120,
            )
        finally:
            await client.close()
    assert not out.failures
    check(pick(out.records), expect_round_wait)
