"""A short chaos run (CI): the smoke trace through a 3-node NATS cluster while
each kind of component is killed once; nothing lost, nothing generated twice.
And item 3 of docs/reliability.md on its own: a NATS node killed mid-replay."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from shared.clock import ScaledClock
from shared.policy import resolve_policy
from talaria.workload.trace import load_trace
from talaria.lab.chaos import FAULT_KINDS, run_chaos
from talaria.client import TalariaClient
from talaria.replay import drive
from talaria.ops.stack import EmbeddedStack, StackSpec

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "traces" / "smoke-4.jsonl"


@pytest.mark.timeout(240)
async def test_chaos_smoke_loses_nothing(tmp_path: Path) -> None:
    sessions = load_trace(SMOKE)
    r = await run_chaos(sessions, seed=1, time_scale=10.0, log_dir=tmp_path)
    assert {f["kind"] for f in r["faults"]} == set(FAULT_KINDS)
    assert r["calls_total"] == sum(len(s.calls) for s in sessions)
    assert r["calls_lost"] == 0, r
    assert r["calls_duplicated"] == 0, r
    assert r["calls_completed"] == r["calls_total"]
    assert not r["session_failures"], r["session_failures"]
    assert all(f["recovered_s"] is not None and f["recovered_s"] < 60 for f in r["faults"]), r["faults"]


@pytest.mark.timeout(180)
async def test_nats_cluster_node_killed_mid_replay(tmp_path: Path) -> None:
    sessions = load_trace(SMOKE)
    models = sorted({s.model for s in sessions})
    spec = StackSpec(policy=resolve_policy("talaria"), models=models, time_scale=10.0, log_dir=tmp_path,
                     nats_cluster=3)
    async with EmbeddedStack(spec) as stack:
        assert len(stack.nats_nodes) == 3 and len(stack.nats_urls) == 3
        assert stack.creds is not None  # authentication stays on with the cluster
        client = await TalariaClient.connect(stack.nats_urls, subject_prefix=stack.subject_prefix,
                                             silence_s=5.0, retries=20, **stack.nats_auth("agent"))
        done: list[str] = []
        try:
            clock = ScaledClock(spec.time_scale, stack.clock_epoch)
            replay = asyncio.ensure_future(drive(client, clock, sessions, "talaria",
                                                 on_reply=lambda r: done.append(r.call_id), error_retries=10))
            while len(done) < 4:
                assert not replay.done(), replay
                await asyncio.sleep(0.05)
            victim = stack.nats_nodes[1]
            await asyncio.to_thread(victim.kill)
            out = await asyncio.wait_for(replay, timeout=150)
        finally:
            await client.close()
    total = sum(len(s.calls) for s in sessions)
    assert not out.failures, out.failures
    assert len({r.call_id for r in out.records}) == total
