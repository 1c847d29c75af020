"""Measuring a live stack under load: an open-loop driver, each process's CPU from
`/proc`, and the hops counted at NATS and Redis. Shared by `talaria
bench-control-plane` and its transport floor (`talaria/lab/hop_floor.py`)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable

from shared.net import LOOPBACK

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime (fields 14 and 15 of stat)


def bus_counts(stack: object) -> dict[str, float]:
    """Messages into every NATS node (its /varz) and commands Redis ran (INFO): per call, the hops."""
    import urllib.request

    import redis

    out = {"nats_msgs": 0.0, "redis_cmds": 0.0}
    for node in stack.nats_nodes:  # type: ignore[attr-defined]
        with urllib.request.urlopen(f"http://{LOOPBACK}:{node.http_port}/varz", timeout=5) as r:
            out["nats_msgs"] += json.load(r)["in_msgs"]
    with redis.Redis.from_url(stack.redis_url) as r:  # type: ignore[attr-defined]
        stats = r.info("stats")
        out["redis_cmds"] = float(stats["total_commands_processed"])
        # reads the server processed: a client's round trip (a pipeline is one, or a few when it is large)
        out["redis_reads"] = float(stats.get("total_reads_processed", 0))
        for name, st in r.info("commandstats").items():  # each command's own count (the JSON's)
            out[f"redis_{name.removeprefix('cmdstat_')}"] = float(st["calls"])
    return out


async def open_loop(rate: float, duration_s: float,
                    one_call: Callable[[int], Awaitable[float]]) -> tuple[list[float], int]:
    """Call i starts at i / rate seconds whatever the earlier ones are doing; `one_call(i)`
    returns the call's added wall ms. (the added ms of each served call, the failed count)"""
    n = max(1, int(rate * duration_s))
    added: list[float] = []
    failed = 0
    t0 = time.monotonic() + 0.05

    async def one(i: int) -> None:
        nonlocal failed
        await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        try:
            added.append(await one_call(i))
        except Exception:  # noqa: BLE001 - counted, the run goes on
            failed += 1

    await asyncio.gather(*(one(i) for i in range(n)))
    return added, failed
