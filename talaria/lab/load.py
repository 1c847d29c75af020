"""Measuring a live stack under load: an open-loop driver, each process's CPU from
`/proc`, the hops counted at NATS and Redis, and one rate's row built from them.
Shared by `talaria bench-control-plane` and its transport floor
(`talaria/lab/hop_floor.py`), so the two print the same columns."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
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


async def paced(n: int, rate: float, run: Callable[[int], Awaitable[None]], *, start_at: float | None = None) -> None:
    """Start `run(i)` at `start_at` + i / rate (monotonic seconds; default now) whatever the
    earlier ones are doing: an open loop, so a slow call does not slow the offered rate."""
    t0 = time.monotonic() if start_at is None else start_at

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        await run(i)

    await asyncio.gather(*(one(i) for i in range(n)))


async def paced_wall_ms(n: int, rate: float, call: Callable[[int], Awaitable[object]], *,
                        start_at: float | None = None) -> list[float]:
    """`paced`, timing each call: its wall milliseconds, in the order they finished."""
    out: list[float] = []

    async def timed(i: int) -> None:
        t = time.perf_counter()
        await call(i)
        out.append((time.perf_counter() - t) * 1000)

    await paced(n, rate, timed, start_at=start_at)
    return out


async def open_loop(rate: float, duration_s: float,
                    one_call: Callable[[int], Awaitable[float]]) -> tuple[list[float], int]:
    """Call i starts at i / rate seconds whatever the earlier ones are doing; `one_call(i)`
    returns the call's added wall ms. (the added ms of each served call, the failed count)"""
    added: list[float] = []
    failed = 0

    async def one(i: int) -> None:
        nonlocal failed
        try:
            added.append(await one_call(i))
        except Exception:  # noqa: BLE001 - counted, the run goes on
            failed += 1

    await paced(max(1, int(rate * duration_s)), rate, one, start_at=time.monotonic() + 0.05)
    return added, failed


def percentile(xs: list[float], q: float) -> float:
    """The q-quantile of xs, nearest rank (nan for none)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def measure_rate(rate: float, duration_s: float, one_call: Callable[[int], Awaitable[float]],
                       pids_by_kind: dict[str, list[int]], stack: object) -> dict[str, object]:
    """Drive `one_call` open loop at `rate` for `duration_s` and return the rate's row: calls
    served per second, the added wall ms (p50 / p90 / p99), the CPU ms each process kind spent per
    served call (this process, the agents, as `client`, apart from the stack's total), and the hops
    per call: NATS messages, Redis commands and round trips, and Redis's commands by name."""

    def cpu() -> dict[str, float]:
        out = {k: sum(cpu_seconds(p) for p in pids) for k, pids in pids_by_kind.items()}
        out["client"] = sum(os.times()[:2])
        return out

    before, hops_before = cpu(), bus_counts(stack)
    t0 = time.monotonic()
    added, failed = await open_loop(rate, duration_s, one_call)
    wall = time.monotonic() - t0
    after, hops_after = cpu(), bus_counts(stack)
    served = max(1, len(added))
    per_call = {k: (after[k] - before[k]) * 1000 / served for k in after}
    return {
        "rate_asked": rate, "served_per_s": len(added) / wall, "failed": failed, "wall_s": wall,
        "added_ms_p50": statistics.median(added) if added else float("nan"),
        "added_ms_p90": percentile(added, 0.90), "added_ms_p99": percentile(added, 0.99),
        "cpu_ms_per_call": {k: round(v, 3) for k, v in sorted(per_call.items())},
        "stack_cpu_ms_per_call": sum(v for k, v in per_call.items() if k != "client"),
        **{f"{k}_per_call": (hops_after[k] - hops_before.get(k, 0.0)) / served
           for k in ("nats_msgs", "redis_cmds", "redis_reads")},
        "redis_by_command_per_call": {
            k.removeprefix("redis_"): round((v - hops_before.get(k, 0.0)) / served, 2)
            for k, v in sorted(hops_after.items(), key=lambda kv: -kv[1])
            if k.startswith("redis_") and k not in ("redis_cmds", "redis_reads") and v > hops_before.get(k, 0.0)},
    }
