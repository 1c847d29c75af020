"""`talaria bench-control-plane`: what the live control plane costs per call.

Brings up the embedded stack (NATS, Redis, router(s), and per server an
admission, a substrate-manager and a sim engine-worker; durability and metrics
on, as deployed) at a high time scale so model time is nearly nothing, and
drives tiny calls from the project's own agent client open loop at each asked
rate: call i starts at i / rate seconds whatever the earlier ones are doing,
over a pool of sessions. Per rate it prints:

- the calls served per second (completed in the window, over its length);
- the added latency, p50 / p90 / p99 in wall milliseconds: a call's wall time
  minus its model time (the scheduler's wait and the engine's restore, prefill
  and decode, divided by the time scale), i.e. what the hops cost;
- the CPU each process kind spent per served call (user + system time from
  `/proc/<pid>/stat`, summed over the kind's processes), and the stack's total
  (the agent client, this process, is reported apart, never in the total).

Not a timed test: a benchmark that prints figures; on a shared machine compare
the rows of one run. `--out` writes them as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from talaria.argtypes import output_file, positive_float, positive_float_list, positive_int, server_count, write_output
from talaria.lab.load import measure_rate, open_loop

MODEL = "glm-4.5-air-fp8"


def process_kinds(stack: object) -> dict[str, list[int]]:
    """Every process of the stack by kind: router, admission, substrate, engine, nats, redis."""
    kinds: dict[str, list[int]] = {}
    for name, pid in stack.group.pids().items():  # type: ignore[attr-defined]
        if pid is not None:
            kinds.setdefault(name.split("-", 1)[0], []).append(pid)
    for node in stack.nats_nodes:  # type: ignore[attr-defined]
        if node.pid is not None:
            kinds.setdefault("nats", []).append(node.pid)
    if stack.redis is not None and stack.redis.pid is not None:  # type: ignore[attr-defined]
        kinds.setdefault("redis", []).append(stack.redis.pid)  # type: ignore[attr-defined]
    return kinds


PYTHON_KINDS = ("router", "admission", "substrate", "engine")


def start_profilers(stack: object, out_dir: Path, duration_s: float) -> list[tuple[str, object]]:
    """py-spy (the `profile` extra) sampling each Python service for `duration_s`, as collapsed stacks."""
    import shutil
    import subprocess

    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        raise SystemExit("--profile needs py-spy: pip install -e '.[profile]'")
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for name, pid in stack.group.pids().items():  # type: ignore[attr-defined]
        if pid is None or name.split("-", 1)[0] not in PYTHON_KINDS:
            continue
        path = out_dir / f"{name}.txt"
        procs.append((name, subprocess.Popen(
            [spy, "record", "--pid", str(pid), "--rate", "250", "--duration", str(max(1, int(duration_s))),
             "--format", "raw", "--nonblocking", "--output", str(path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
    return procs


def top_frames(path: Path, n: int = 8) -> list[tuple[str, float]]:
    """Where a process's busy samples were (self time: the innermost frame), from py-spy's
    collapsed stacks; idle samples (the event loop waiting in its poll) left out."""
    own: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = stack.split(";")[-1]
        if "select" in leaf or "epoll" in leaf or "_run_once" in leaf and "base_events" in leaf:
            continue  # waiting in the loop's poll: not work
        total += int(count)
        own[leaf] = own.get(leaf, 0) + int(count)
    ranked = sorted(own.items(), key=lambda kv: -kv[1])
    return [(f, c / total) for f, c in ranked][:n] if total else []


def agent_call(sessions: list[object], time_scale: float) -> Callable[[int], Awaitable[float]]:
    """Call i: one tiny call on session i mod n; its added wall ms (wall time less model time)."""

    async def call(i: int) -> float:
        sess = sessions[i % len(sessions)]
        start = time.perf_counter()
        r = await sess.call(prompt_tokens=64 + i % 64, max_tokens=1, sim_output_tokens=1)  # type: ignore[attr-defined]
        wall_ms = (time.perf_counter() - start) * 1000
        return wall_ms - (r.waited_s + r.restore_s + r.prefill_s + r.decode_s) / time_scale * 1000

    return call


async def bench(rates: list[float], duration_s: float, servers: int, routers: int, session_count: int,
                time_scale: float, log_dir: Path, profile: Path | None = None) -> list[dict[str, object]]:
    from shared.agent_client import TalariaClient
    from shared.policy import resolve_policy
    from talaria.ops.stack import EmbeddedStack, StackSpec

    run_dir = log_dir / f"cp-{servers}s-{routers}r"
    shutil.rmtree(run_dir, ignore_errors=True)  # (logs are appended: an earlier run's would be counted too)
    spec = StackSpec(policy=resolve_policy("talaria"), models=[MODEL], servers=servers, routers=routers,
                     time_scale=time_scale, log_dir=run_dir)
    rows: list[dict[str, object]] = []
    async with EmbeddedStack(spec) as stack:
        print(f"[bench] stack up: {servers} server(s), {routers} router(s); logs in {stack.log_dir}",
              file=sys.stderr, flush=True)
        client = await TalariaClient.connect(stack.nats_urls, subject_prefix=stack.subject_prefix, silence_s=30.0,
                                             **stack.nats_auth("agent"))
        try:
            tag = uuid.uuid4().hex[:6]
            sessions = [await client.open_session(MODEL, session_id=f"cp-{tag}-{i}") for i in range(session_count)]
            call = agent_call(sessions, time_scale)
            await open_loop(50.0, 1.0, call)  # warm up: connections, scripts, first switch
            kinds = process_kinds(stack)
            for rate in rates:
                spies = start_profilers(stack, profile / f"{servers}s-{routers}r-{rate:g}", duration_s) if profile else []
                row: dict[str, object] = {"servers": servers, "routers": routers,
                                          **await measure_rate(rate, duration_s, call, kinds, stack)}
                rows.append(row)
                print(format_row(row), flush=True)
                for name, spy in spies:
                    await asyncio.to_thread(spy.wait)  # type: ignore[attr-defined]
                    path = profile / f"{servers}s-{routers}r-{rate:g}" / f"{name}.txt"  # type: ignore[operator]
                    if path.exists():
                        print(f"    {name}: " + "; ".join(f"{f} {share:.0%}" for f, share in top_frames(path, 6)))
        finally:
            await client.close()
    return rows


HEADER = (f"{'servers':>7} {'routers':>7} {'asked/s':>8} {'served/s':>8} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7} "
          f"{'stack CPU ms/call':>17} {'NATS msg/call':>13} {'Redis cmd/call':>14} {'Redis trips/call':>16}  by kind (ms/call; client apart)")


def format_row(r: dict[str, object]) -> str:
    kinds = r["cpu_ms_per_call"]
    assert isinstance(kinds, dict)
    by = " ".join(f"{k} {v:.2f}" for k, v in kinds.items())
    return (f"{r['servers']:>7} {r['routers']:>7} {r['rate_asked']:>8g} {r['served_per_s']:>8.1f} "
            f"{r['added_ms_p50']:>7.2f} {r['added_ms_p90']:>7.2f} {r['added_ms_p99']:>7.2f} "
            f"{r['stack_cpu_ms_per_call']:>17.2f} {r['nats_msgs_per_call']:>13.1f} {r['redis_cmds_per_call']:>14.1f} {r['redis_reads_per_call']:>16.1f}  {by}" + (f"  ({r['failed']} failed)" if r["failed"] else ""))


def run(a: argparse.Namespace) -> int:
    rates = list(a.rates)
    print(f"control plane: tiny calls from the agent client, open loop, {a.duration:g} s per rate, time scale "
          f"{a.time_scale:g}x, {a.sessions} sessions, one sim engine per server; wall ms and CPU ms on this machine")
    print(HEADER, flush=True)
    rows: list[dict[str, object]] = []
    for servers in a.servers:
        for routers in a.routers:
            rows += asyncio.run(bench(rates, a.duration, servers, routers, a.sessions, a.time_scale, Path(a.log_dir),
                                      Path(a.profile) if a.profile else None))
    if a.floor:
        from talaria.lab.hop_floor import LAYOUTS, measure

        print("floor: a call's hops with no logic behind them (talaria/lab/hop_floor.py): bare processes for "
              "router, admission and engine (3 procs, today's path), admission and engine in one (2 procs) or "
              "one for all three (1 proc); the call record's JetStream writes, nine Redis round trips", flush=True)
        for layout in LAYOUTS:
            for row in asyncio.run(measure(rates, a.duration, a.sessions, layout)):
                row.update(servers="floor", routers=layout)
                rows.append(row)
                print(format_row(row), flush=True)
    if a.out:
        write_output(a.out, json.dumps({"rows": rows}, indent=2))
        print(f"wrote {a.out}")
    return 0


def configure_parser(p: argparse.ArgumentParser, default_log_dir: Path) -> None:
    p.add_argument("--rates", type=positive_float_list, default=(100.0, 200.0, 500.0, 1000.0),
                   help="calls asked per second, comma-separated (default 100,200,500,1000)")
    p.add_argument("--duration", type=positive_float, default=10.0, help="wall seconds per rate")
    p.add_argument("--servers", type=server_count, nargs="+", default=[1], help="servers per stack (e.g. 1 4)")
    p.add_argument("--routers", type=positive_int, nargs="+", default=[1], help="router replicas (e.g. 1 2)")
    p.add_argument("--sessions", type=positive_int, default=64, help="sessions the calls go round")
    p.add_argument("--time-scale", type=positive_float, default=1000.0, help="model seconds per wall second")
    p.add_argument("--out", type=output_file, help="write the rows as JSON here")
    p.add_argument("--profile", metavar="DIR", help="sample every Python service with py-spy during each rate "
                                                    "(collapsed stacks in DIR; the top frames printed)")
    p.add_argument("--log-dir", default=str(default_log_dir), help="the embedded stacks' logs")
    p.add_argument("--floor", action="store_true",
                   help="also run the transport floor: the call's hops (messages, record writes, Redis round trips) "
                        "between bare processes with no logic, at the same rates")
    p.set_defaults(fn=run)
