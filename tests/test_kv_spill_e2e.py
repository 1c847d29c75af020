"""KV pushed out of HBM for room during a slot goes to host DRAM (host-KV
restore on) and comes back from there when its session returns — in the
simulator and through the live services (engine-worker reports the spill, the
substrate books it in its ledger), on a server whose KV region is made small
enough that two sessions' KV cannot stay in HBM together."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from shared.catalog import DEFAULT_CATALOG_PATH, load_catalog
from shared.clock import ScaledClock
from shared.logs import read_log_events
from shared.policy import resolve_policy
from talaria.workload.trace import TraceCall, TraceSession
from talaria.client import TalariaClient
from talaria.replay import drive
from talaria.sim.simulator import simulate
from talaria.ops.stack import EmbeddedStack, StackSpec

AIR = "glm-4.5-air-fp8"
KV_TOKENS = 27_000  # room for one call's reservation (prompt + 4,096) and little else

# x's first call leaves ~14k tokens of KV; y's call (16k + 4,096 reserved) needs that
# room, so x's KV is pushed out; x returns after y is done and needs its 14,100-token prefix.
TRACE = [
    TraceSession("x", AIR, 0.0, [TraceCall(14_000, 100, 8.0), TraceCall(500, 20, 0.0)]),
    TraceSession("y", AIR, 0.5, [TraceCall(16_000, 100, 0.0)]),
]
PREFIX = 14_100


def small_kv_catalog(tmp_path: Path) -> Path:
    """The default catalog with h100x8's HBM cut so the KV region holds about KV_TOKENS of AIR."""
    cat = load_catalog()
    air, server = cat.model(AIR), cat.server("h100x8")
    usable_gb = air.weights_gb + KV_TOKENS * air.kv_bytes_per_token / 1e9
    per_gpu = usable_gb / (server.gpus * (1 - server.runtime_reserve_frac))
    text = DEFAULT_CATALOG_PATH.read_text()
    head, sep, rest = text.partition("[servers.h100x8]")
    rest = re.sub(r"hbm_gb_per_gpu = [0-9.]+", f"hbm_gb_per_gpu = {per_gpu:.6f}", rest, count=1)
    path = tmp_path / "catalog.toml"
    path.write_text(head + sep + rest)
    return path


def x_return(records):  # type: ignore[no-untyped-def]
    return next(r for r in records if r.session_id == "x" and r.index == 1)


@pytest.mark.parametrize("policy,restored", [("talaria", PREFIX), ("talaria-no-hostkv", 0)])
def test_spill_in_the_simulator(tmp_path: Path, policy: str, restored: int) -> None:
    catalog = load_catalog(small_kv_catalog(tmp_path))
    r = simulate(TRACE, catalog, resolve_policy(policy), check_invariants=True)
    c = x_return(r.records)
    assert (c.cached_tokens, c.restored_tokens, c.reprefill_tokens) == (0, restored, PREFIX - restored)


@pytest.mark.e2e
async def test_spill_through_the_live_services(tmp_path: Path) -> None:
    catalog = small_kv_catalog(tmp_path)
    spec = StackSpec(policy=resolve_policy("talaria"), models=[AIR], time_scale=10.0, log_dir=tmp_path / "logs",
                     extra_env={"TALARIA_CATALOG": str(catalog)})
    async with EmbeddedStack(spec) as stack:
        client = await TalariaClient.connect(stack.nats_urls, subject_prefix=stack.subject_prefix, **stack.nats_auth("agent"))
        try:
            out = await asyncio.wait_for(
                drive(client, ScaledClock(spec.time_scale, stack.clock_epoch), TRACE, "talaria", progress_every_wall_s=30),
                timeout=120,
            )
        finally:
            await client.close()
    assert not out.failures
    c = x_return(out.records)
    assert (c.cached_tokens, c.restored_tokens, c.reprefill_tokens) == (0, PREFIX, 0)
    events = [d for f in (tmp_path / "logs").glob("*.log") for d in read_log_events(f)]
    booked = [d for d in events if d.get("event") == "substrate.kv_spilled"]
    assert booked and booked[0]["model"] == AIR and booked[0]["lost"] == 0, booked
