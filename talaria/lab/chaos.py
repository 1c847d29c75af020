"""`talaria chaos TRACE`: replay a trace while killing and restarting, on a
seeded schedule, every kind of component, and count what was lost.

Two runs of the same trace through the embedded stack (3-node NATS cluster by
default): a fault-free reference, then the chaos run. The chaos run SIGKILLs,
one at a time, the router, an admission, a substrate-manager, an
engine-worker (the stack's supervisor restarts each), a NATS node (restarted
by this command) and Redis (restarted empty: no persistence). Faults are
spread over the reference run's wall duration, in a seeded order, each one
after the previous one recovered.

Per fault: `at_s` (wall seconds since the replay started), `healthy_s` (wall
seconds until the killed component answers its health check again) and
`recovered_s` (until then and the next call completes after it). Per run:
calls total / completed / duplicated (generated more than once by the
engines, from their logs) / lost (never answered), and SCT against the
reference. docs/reliability.md has the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import asyncio
import random
import shutil
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import nats

from shared.clock import ScaledClock
from shared.logs import read_log_events
from shared.policy import resolve_policy
from shared.catalog import load_catalog
from shared.subjects import Subjects
from talaria.workload.trace import TraceSession, load_runnable_trace
from talaria.argtypes import positive_float, positive_int
from talaria.client import TalariaClient
from talaria.replay import ReplayOutcome, drive, write_json
from talaria.ops.stack import EmbeddedStack, StackSpec, default_log_dir

FAULT_KINDS = ("router", "admission", "substrate", "engine", "nats", "redis", "hang", "redis-stall")
NATS_DOWN_S = 1.0    # wall seconds a killed NATS node stays down before it is started again
REDIS_DOWN_S = 0.5
HANG_S = 8.0         # wall seconds a hung service stays stopped unless the stack's liveness watch replaces it first
REDIS_STALL_S = 2.0  # wall seconds redis-server is stopped (SIGSTOP; DEBUG SLEEP is off in Redis 7)
LIVENESS_GRACE_S = 3.0  # chaos runs are short: a service is judged hung this soon after its (re)start


@dataclass
class Fault:
    kind: str
    target: str
    at_s: float
    healthy_s: float | None = None
    recovered_s: float | None = None


def schedule(seed: int, duration_s: float, kinds: tuple[str, ...] = FAULT_KINDS, rounds: int = 1) -> list[tuple[float, str]]:
    """Seeded fault times over [10 %, 70 %] of the run, each kind `rounds` times, in a shuffled order."""
    rng = random.Random(seed)
    order = [k for _ in range(rounds) for k in kinds]
    rng.shuffle(order)
    n = len(order)
    lo, hi = 0.1 * duration_s, 0.7 * duration_s
    times = sorted(lo + (hi - lo) * (i + rng.random()) / n for i in range(n))
    return list(zip(times, order))


def _sct_summary(sct: dict[str, float]) -> dict[str, float]:
    v = sorted(sct.values())
    if not v:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan")}
    return {"mean": statistics.fmean(v), "p50": v[len(v) // 2], "p90": v[min(len(v) - 1, int(0.9 * len(v)))]}


def _engine_generations(log_dir: Path) -> Counter[str]:
    """How many times each call id was generated to the end (engine.finished), over every engine log."""
    return Counter(d["call_id"] for p in log_dir.glob("engine-*.log") for d in read_log_events(p)
                   if d.get("event") == "engine.finished" and d.get("call_id"))


class Injector:
    def __init__(self, stack: EmbeddedStack, rng: random.Random, t0: float) -> None:
        self.stack = stack
        self.rng = rng
        self.t0 = t0
        self.nats_errors = 0  # errors on the injector's own NATS connection (nodes it kills)
        self.completions: list[float] = []  # wall (monotonic) time of every reply
        self.faults: list[Fault] = []
        self.nc: nats.NATS | None = None

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def _service_healthy(self, name: str) -> None:
        assert self.nc is not None
        while True:
            try:
                await self.nc.request(Subjects(self.stack.subject_prefix).health(name), b"", timeout=0.5)
                return
            except Exception:  # noqa: BLE001 - not back yet
                await asyncio.sleep(0.05)

    async def inject(self, kind: str) -> Fault:
        st = self.stack
        at = self.now()
        if kind in ("router", "admission", "substrate", "engine"):
            names = [n for n, _, _ in st.service_table() if n.startswith(kind)]
            target = self.rng.choice(names)
            st.group.kill(target)   # SIGKILL; the stack's supervisor restarts it
            fault = Fault(kind, target, at)
            await asyncio.sleep(0.05)
            await self._service_healthy(target)
        elif kind == "nats":
            i = self.rng.randrange(len(st.nats_nodes))
            node = st.nats_nodes[i]
            fault = Fault(kind, f"nats-n{i}", at)
            await asyncio.to_thread(node.kill)
            await asyncio.sleep(NATS_DOWN_S)
            await asyncio.to_thread(node.start, 60.0)   # start() waits for /healthz
        elif kind == "redis":
            assert st.redis is not None
            fault = Fault(kind, "redis", at)
            await asyncio.to_thread(st.redis.kill)
            await asyncio.sleep(REDIS_DOWN_S)
            await asyncio.to_thread(st.redis.start, 30.0)  # no persistence: it comes back empty
        elif kind == "hang":
            # stopped, not crashed: only the liveness watch can tell (talaria/ops/liveness.py)
            names = [n for n, _, _ in st.service_table()]
            target = self.rng.choice(names)
            fault = Fault(kind, f"{target} (stopped)", at)
            pid = st.group.pids().get(target)
            if pid is not None:
                os.kill(pid, signal.SIGSTOP)
                deadline = time.monotonic() + HANG_S
                while time.monotonic() < deadline and st.group.pids().get(target) == pid:
                    await asyncio.sleep(0.05)
                with contextlib.suppress(OSError):  # not replaced in time: it resumes where it stopped
                    os.kill(pid, signal.SIGCONT)
            await self._service_healthy(target)
        elif kind == "redis-stall":
            assert st.redis is not None and st.redis.pid is not None
            fault = Fault(kind, "redis (stopped)", at)
            pid = st.redis.pid
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(REDIS_STALL_S)
            os.kill(pid, signal.SIGCONT)
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        fault.healthy_s = self.now() - at
        self.faults.append(fault)
        verb = "stopped" if "(stopped)" in fault.target else "killed"
        print(f"[chaos] t={at:6.1f} s  {verb:<7} {fault.target:<28} healthy after {fault.healthy_s:5.2f} s",
              file=sys.stderr, flush=True)
        return fault

    def settle(self) -> None:
        """recovered_s: healthy again, and the next call completed after that."""
        for f in self.faults:
            healthy_at = f.at_s + (f.healthy_s or 0.0)
            after = [c - self.t0 for c in self.completions if c - self.t0 >= healthy_at]
            f.recovered_s = (min(after) if after else healthy_at) - f.at_s

    async def run(self, plan: list[tuple[float, str]], done: asyncio.Future) -> None:
        async def on_error(e: Exception) -> None:
            # the node this connection uses is killed on purpose: expected, and the
            # library's default callback would print a traceback each time
            self.nats_errors += 1

        async def quiet() -> None:
            pass

        self.nc = await nats.connect(servers=self.stack.nats_urls, name="talaria-chaos",
                                     max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                                     error_cb=on_error, disconnected_cb=quiet, reconnected_cb=quiet,
                                     **self.stack.nats_auth("operator"))
        try:
            for at, kind in plan:
                wait = at - self.now()
                if wait > 0:
                    await asyncio.wait([done], timeout=wait)
                if done.done():
                    # the replay ended early: inject the rest back to back, so each kind is exercised
                    pass
                await self.inject(kind)
        finally:
            await self.nc.close()


async def _run_once(sessions: list[TraceSession], spec: StackSpec, *, plan: list[tuple[float, str]] | None,
                    seed: int, silence_s: float) -> tuple[ReplayOutcome, Injector | None, Path, float]:
    async with EmbeddedStack(spec) as stack:
        client = await TalariaClient.from_deployment(stack.deployment(), silence_s=silence_s, retries=50)
        t0 = time.monotonic()
        inj = Injector(stack, random.Random(seed), t0) if plan is not None else None
        try:
            clock = ScaledClock(spec.time_scale, stack.clock_epoch)
            on_reply = (lambda r: inj.completions.append(time.monotonic())) if inj else None  # noqa: E731
            replay = asyncio.ensure_future(drive(client, clock, sessions, spec.policy.name, on_reply=on_reply,
                                                 error_retries=30 if inj else 0, progress_every_wall_s=10.0))
            injector = asyncio.ensure_future(inj.run(plan, replay)) if inj and plan else None
            out = await replay
            if injector is not None:
                await injector   # every scheduled fault is injected, even if the replay ended first
        finally:
            await client.close()
        wall = time.monotonic() - t0
        if inj:
            inj.settle()
        await asyncio.sleep(0.5)  # let the last log lines land
        return out, inj, stack.log_dir, wall


async def run_chaos(sessions: list[TraceSession], *, seed: int = 0, policy: str = "talaria", time_scale: float = 50.0,
                    log_dir: Path | None = None, nats_cluster: int = 3, kinds: tuple[str, ...] = FAULT_KINDS,
                    rounds: int = 1, silence_s: float = 5.0, servers: int = 1) -> dict:
    base = Path(log_dir or default_log_dir()) / f"chaos-{seed}"
    if base.exists():
        # the duplicate count reads these logs: an earlier run's lines would count twice
        shutil.rmtree(base)
        print(f"[chaos] removed the logs of an earlier run in {base}", file=sys.stderr, flush=True)
    models = sorted({s.model for s in sessions})
    pol = resolve_policy(policy)

    def spec(sub: str) -> StackSpec:
        return StackSpec(policy=pol, models=models, servers=servers, time_scale=time_scale,
                         log_dir=base / sub, nats_cluster=nats_cluster, liveness=True, liveness_grace_s=LIVENESS_GRACE_S)

    print(f"[chaos] fault-free reference run ({len(sessions)} sessions) ...", file=sys.stderr, flush=True)
    ref, _, _, ref_wall = await _run_once(sessions, spec("reference"), plan=None, seed=seed, silence_s=silence_s)
    plan = schedule(seed, ref_wall, kinds, rounds)
    print(f"[chaos] reference took {ref_wall:.1f} s wall; faults at "
          + ", ".join(f"{k}@{t:.1f}s" for t, k in plan), file=sys.stderr, flush=True)
    out, inj, logs, wall = await _run_once(sessions, spec("chaos"), plan=plan, seed=seed, silence_s=silence_s)
    assert inj is not None
    total = sum(len(s.calls) for s in sessions)
    completed = len({r.call_id for r in out.records})
    gens = _engine_generations(logs)
    duplicated = sum(1 for n in gens.values() if n > 1)
    worst: dict[str, float] = {}
    for f in inj.faults:
        worst[f.kind] = max(worst.get(f.kind, 0.0), f.recovered_s or 0.0)
    sct_ref, sct_chaos = _sct_summary(ref.sct), _sct_summary(out.sct)
    return {
        "trace_sessions": len(sessions),
        "seed": seed,
        "policy": policy,
        "time_scale": time_scale,
        "nats_nodes": nats_cluster,
        "calls_total": total,
        "calls_completed": completed,
        "calls_duplicated": duplicated,
        "calls_lost": total - completed,
        "replies_from_cache": out.duplicates,   # a retried call id answered with the stored reply (not a 2nd generation)
        "session_failures": out.failures,
        "faults": [asdict(f) for f in inj.faults],
        "worst_recovery_s": worst,
        "sct_reference": sct_ref,
        "sct_chaos": sct_chaos,
        "sct_mean_ratio": sct_chaos["mean"] / sct_ref["mean"] if sct_ref["mean"] else float("nan"),
        "wall_s": {"reference": ref_wall, "chaos": wall},
        "log_dir": str(base),
    }


def format_report(r: dict) -> str:
    lines = [
        f"chaos: {r['trace_sessions']} sessions, seed {r['seed']}, policy {r['policy']}, "
        f"{r['nats_nodes']} NATS node(s), time scale {r['time_scale']:g}",
        f"faults injected: {len(r['faults'])}",
    ]
    for f in r["faults"]:
        lines.append(f"  {f['kind']:<10} {f['target']:<30} at {f['at_s']:6.1f} s  healthy {f['healthy_s']:5.2f} s"
                     f"  recovered {f['recovered_s']:5.2f} s")
    lines.append(f"calls: total {r['calls_total']}  completed {r['calls_completed']}  "
                 f"duplicated {r['calls_duplicated']}  lost {r['calls_lost']}  (replies from cache: {r['replies_from_cache']})")
    lines.append("worst recovery (wall s, health + next completed call): "
                 + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["worst_recovery_s"].items())))
    a, b = r["sct_reference"], r["sct_chaos"]
    lines.append(f"SCT (model s) fault-free mean {a['mean']:.1f} p50 {a['p50']:.1f} p90 {a['p90']:.1f} | "
                 f"chaos mean {b['mean']:.1f} p50 {b['p50']:.1f} p90 {b['p90']:.1f} | ratio {r['sct_mean_ratio']:.3f}")
    if r["session_failures"]:
        lines.append(f"session failures: {len(r['session_failures'])}: {r['session_failures'][:3]}")
    return "\n".join(lines)


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="the trace to replay under faults (JSON Lines)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault schedule (what is killed when; default 0)")
    p.add_argument("--out", default=None, help="write the figures as JSON")
    p.add_argument("--policy", default="talaria", help="the policy the stack runs (default talaria)")
    p.add_argument("--time-scale", type=positive_float, default=50.0, help="model seconds per wall second (default 50)")
    p.add_argument("--nats-nodes", type=positive_int, default=3, help="nodes of the embedded NATS cluster, one of which is killed (default 3)")
    p.add_argument("--rounds", type=positive_int, default=1, help="how many times each fault kind is injected")
    p.add_argument("--silence-s", type=positive_float, default=5.0, help="the agents' silence before a retry (wall s)")
    p.add_argument("--log-dir", default=str(default_log_dir()), help=f"log folder; each seed's run is cleared first (default {default_log_dir()})")
    p.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    sessions = load_runnable_trace(a.trace, load_catalog())
    r = asyncio.run(run_chaos(sessions, seed=a.seed, policy=a.policy, time_scale=a.time_scale,
                              log_dir=Path(a.log_dir), nats_cluster=a.nats_nodes, rounds=a.rounds,
                              silence_s=a.silence_s))
    print(format_report(r))
    if a.out:
        write_json(a.out, r)
    return 0 if r["calls_lost"] == 0 and r["calls_duplicated"] == 0 else 1
