"""`talaria bench-observability`: what tracing adds per call (metrics are always on).

Brings up the embedded stack twice on the sim engine (one model, a high time
scale, one output token): once with tracing off, once exporting every span over
OTLP/HTTP to a sink in this process (it accepts and drops them). Each time it
makes the same calls through the agent client at a fixed rate and prints the
latency distributions (wall milliseconds) and the difference. Not a timed test:
compare the columns of one run on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import uuid
from pathlib import Path

from talaria.argtypes import positive_float, positive_int
from talaria.lab.gateway_bench import MODEL
from talaria.lab.load import paced_wall_ms
from talaria.lab.load import percentile


async def _sink() -> tuple[object, int, list[int]]:
    """An OTLP/HTTP endpoint that takes every export (and counts the bytes)."""
    from aiohttp import web

    from shared.net import free_port

    got: list[int] = []

    async def take(request: web.Request) -> web.Response:
        got.append(len(await request.read()))
        return web.Response(status=200, content_type="application/x-protobuf", body=b"")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", take)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port, got


async def _one_run(tracing_on: bool, calls: int, rate: float, log_dir: Path) -> tuple[list[float], int]:
    from shared.agent_client import TalariaClient
    from shared.policy import resolve_policy
    from talaria.ops.stack import EmbeddedStack, StackSpec

    runner, port, got = await _sink() if tracing_on else (None, 0, [])
    env = {"TALARIA_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"} if tracing_on else {}
    spec = StackSpec(policy=resolve_policy("baseline"), models=[MODEL], time_scale=1000.0,
                     log_dir=log_dir / ("tracing-on" if tracing_on else "tracing-off"), extra_env=env)
    try:
        async with EmbeddedStack(spec) as stack:
            client = await TalariaClient.connect(stack.nats_urls, subject_prefix=stack.subject_prefix,
                                                 **stack.nats_auth("agent"))
            try:
                tag = uuid.uuid4().hex[:6]
                session = await client.open_session(MODEL, session_id=f"obs-{tag}")

                async def one(i: int) -> None:
                    await session.call(prompt_tokens=1000, max_tokens=1, call_id=f"obs-{tag}-{i}",
                                       prompt_text="x" * 3984)

                await paced_wall_ms(min(20, calls), rate, one)  # warm up
                out = await paced_wall_ms(calls, rate, lambda i: one(i + 100_000))
            finally:
                await client.close()
    finally:
        if runner is not None:
            await runner.cleanup()  # type: ignore[attr-defined]
    return out, sum(got)


async def bench(calls: int, rate: float, log_dir: Path) -> dict[str, float]:
    off, _ = await _one_run(False, calls, rate, log_dir)
    on, exported = await _one_run(True, calls, rate, log_dir)
    return {"off_p50": statistics.median(off), "off_p99": percentile(off, 0.99), "on_p50": statistics.median(on),
            "on_p99": percentile(on, 0.99), "exported_bytes": float(exported)}


def run(a: argparse.Namespace) -> int:
    r = asyncio.run(bench(a.calls, a.rate, Path(a.log_dir)))
    print(f"{'tracing':>8} {'p50':>8} {'p99':>8}   (wall ms per call, {a.calls} calls at {a.rate:g}/s, "
          f"agent client -> router -> admission -> sim engine; metrics on in both)")
    print(f"{'off':>8} {r['off_p50']:>8.2f} {r['off_p99']:>8.2f}")
    print(f"{'on':>8} {r['on_p50']:>8.2f} {r['on_p99']:>8.2f}   ({r['exported_bytes'] / 1e6:.1f} MB of spans exported)")
    print(f"{'added':>8} {r['on_p50'] - r['off_p50']:>8.2f} {r['on_p99'] - r['off_p99']:>8.2f}")
    return 0


def configure_parser(p: argparse.ArgumentParser, default_log_dir: Path) -> None:
    p.add_argument("--calls", type=positive_int, default=1000, help="calls per run")
    p.add_argument("--rate", type=positive_float, default=200.0, help="calls started per second")
    p.add_argument("--log-dir", default=str(default_log_dir), help="the embedded stacks' logs")
    p.set_defaults(fn=run)
