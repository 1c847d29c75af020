"""`talaria chaos TRACE`: replay a trace while killing, stopping and
restarting, on a seeded schedule, every kind of component, and count what was
lost or done twice.

A fault-free reference run of the trace through the embedded stack (3-node
NATS cluster by default), then a chaos run per seed (`--seeds a,b,c`: one
reference for all). Fault kinds (`FAULT_KINDS`): SIGKILL of the router, an
admission, a substrate-manager, an engine-worker (the stack's supervisor
restarts each); `hang` (a service SIGSTOPped: the liveness watch must replace
it); `overlap` (two services killed within a second, no wait between);
`switch` (the substrate or the incoming engine killed during a model switch);
a NATS node (restarted by this command); Redis killed (restarted empty) or
stalled (SIGSTOP); `nats-redis` (a NATS node killed while Redis is down).
`EXTRA_KINDS`, only when named in `--kinds`: `nats-stall` (a NATS node stopped
for `NATS_STALL_S`: its clients must leave it for another node).
`--via-gateway`: the agents speak HTTP to the stack's gateway (each call a chat
completion under its session header and an `Idempotency-Key`, sent again on a
lost connection or a status the official SDKs retry), and `gateway` (its process
SIGKILLed mid-call, restarted on its port by the stack) joins the kinds.
Faults are spread over 10-70 % of the reference's wall duration, in a seeded
order, each after the previous one recovered (healthy and a call completed
since, waited for at most `RECOVERY_WAIT_S`; a service is healthy when it
answers "ok", a NATS node when the call record's stream has a leader again),
and each only while calls are in flight (one the replay outlives is reported
as not injected, never injected into an idle stack). A watchdog ends a run in which no call
completes for `--stall-s` and lists the stuck calls.

Per fault: `at_s`, `in_flight`, `healthy_s` (wall seconds until the component
answers its health check again) and `recovered_s` (until then and the next
call completes after it). Per run: calls total / completed / lost (never
answered) / generated twice (an engine generated it to the end more than
once, from the engines' logs) / delivered twice (an agent heard two different
final replies for it, observed on the agents' reply subjects) / answered with
the stored reply (a retry: neither), and SCT against the reference.
docs/reliability.md has the figures.
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
import redis.asyncio as aioredis
from nats.aio.msg import Msg

from shared import state
from shared.auth import AGENT_REPLY_NAMESPACE
from shared.clock import ScaledClock
from shared.keys import Keys
from shared.net import NATS_CONNECT_TIMEOUT_S, NATS_KEEPALIVE
from shared.schema import HEALTH_OK, CallReply, reply_decoder
from shared.logs import read_log_events
from shared.policy import resolve_policy
from shared.catalog import load_catalog
from shared.subjects import GATEWAY_NAMESPACE, Subjects
from talaria.workload.trace import TraceSession, load_runnable_trace
from talaria.argtypes import output_file, positive_float, positive_int, seed_list, server_count
from talaria.client import TalariaClient
from talaria.gateway_agent import GatewayAgents
from talaria.replay import ReplayOutcome, drive, write_json
from talaria.ops.stack import EmbeddedStack, StackSpec, default_log_dir

FAULT_KINDS = ("router", "admission", "substrate", "engine", "nats", "redis", "hang", "redis-stall",
               "overlap", "switch", "nats-redis")
EXTRA_KINDS = ("nats-stall",)  # named in --kinds only: the default schedule (and its recorded figures) stays
GATEWAY_KINDS = ("gateway",)   # with --via-gateway only (and then in the default schedule)
SERVICE_KINDS = ("router", "admission", "substrate", "engine")
NATS_DOWN_S = 1.0    # wall seconds a killed NATS node stays down before it is started again
REDIS_DOWN_S = 0.5
HANG_S = 8.0         # wall seconds a hung service stays stopped unless the stack's liveness watch replaces it first
REDIS_STALL_S = 2.0  # wall seconds redis-server is stopped (SIGSTOP; DEBUG SLEEP is off in Redis 7)
NATS_STALL_S = 20.0  # wall seconds a NATS node is stopped: longer than its clients take to leave it (about 10 s)
LIVENESS_GRACE_S = 0.5  # chaos runs are short: a service is judged hung this soon after its (re)start (and only
                        # once it has answered since; a longer grace let a stop soon after a restart go unjudged)
# ... and, if it has not answered since, this soon: a sim service answers in about 0.5 s, but one whose
# first pick of a NATS node is a stopped one (`nats-stall`) waits out the connect timeout before the next
# (at 2 s such restarts were killed before they could connect, again and again)
LIVENESS_STARTUP_S = NATS_CONNECT_TIMEOUT_S + 2.0
OVERLAP_WITHIN_S = 1.0  # the second fault of an `overlap` comes this soon after the first, with no wait between
SWITCH_WAIT_S = 15.0    # wall seconds a `switch` fault waits for a model switch to start (then it kills anyway)
RECOVERY_WAIT_S = 15.0  # wall seconds the next fault waits for the previous one's recovery at most
STALL_S = 120.0         # wall seconds without a completed call (calls open) after which the watchdog ends a run


@dataclass
class Fault:
    kind: str
    target: str
    at_s: float
    healthy_s: float | None = None
    recovered_s: float | None = None
    in_flight: int = 0   # calls sent and not answered when it was injected
    note: str = ""


class RunStalled(RuntimeError):
    """No call completed for the watchdog's window while calls were open."""

    def __init__(self, stuck: list[str], idle_s: float) -> None:
        super().__init__(f"no call completed for {idle_s:.0f} s of wall time; {len(stuck)} call(s) open")
        self.stuck = stuck


class Flight:
    """What the agents sent and heard: the in-flight count faults wait for, the
    completion times recovery is measured by, and the watchdog's last progress."""

    def __init__(self) -> None:
        self.open: dict[str, float] = {}
        self.answered: set[str] = set()
        self.completions: list[float] = []  # wall (monotonic) time of every reply
        self.last_progress = time.monotonic()

    def issued(self, call_id: str) -> None:
        self.open[call_id] = time.monotonic()

    def replied(self, reply: CallReply) -> None:
        now = time.monotonic()
        self.open.pop(reply.call_id, None)
        self.answered.add(reply.call_id)
        self.completions.append(now)
        self.last_progress = now


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
    def __init__(self, stack: EmbeddedStack, rng: random.Random, t0: float, flight: Flight,
                 via_gateway: bool = False) -> None:
        self.stack = stack
        self.via_gateway = via_gateway
        self.rng = rng
        self.t0 = t0
        self.flight = flight
        self.nats_errors = 0  # errors on the injector's own NATS connections (nodes it kills)
        self.faults: list[Fault] = []
        self.skipped: list[str] = []  # kinds not injected: the replay ended first (nothing in flight to hurt)
        self.nc: nats.NATS | None = None
        self.observer: nats.NATS | None = None
        self.store: nats.NATS | None = None
        # every distinct final reply an agent received, per call id (a re-sent stored reply is the same bytes)
        self.finals: dict[str, set[bytes]] = {}

    def now(self) -> float:
        return time.monotonic() - self.t0

    @property
    def reply_namespace(self) -> str:
        return GATEWAY_NAMESPACE if self.via_gateway else AGENT_REPLY_NAMESPACE

    async def _service_healthy(self, name: str) -> None:
        """Back and serving: its health endpoint answers "ok" (a restarted admission
        answers "starting" while it recovers; that is not recovered yet)."""
        assert self.nc is not None
        while True:
            try:
                resp = await self.nc.request(Subjects(self.stack.subject_prefix).health(name), b"", timeout=0.5)
                if resp.data == HEALTH_OK:
                    return
            except Exception:  # noqa: BLE001 - not back yet
                pass
            await asyncio.sleep(0.05)

    async def _store_healthy(self) -> None:
        """The NATS cluster serves the at-most-once record again: its stream's leader
        answers (a node's own /healthz is up long before a stream that lost its leader
        with that node has elected another: nats-server's raft waits 4-9 s for that)."""
        assert self.store is not None
        js = self.store.jetstream(timeout=1.0)
        stream = f"KV_{Subjects(self.stack.subject_prefix).call_record_bucket}"
        while True:
            try:
                await js.stream_info(stream)
                return
            except Exception:  # noqa: BLE001 - no leader yet
                await asyncio.sleep(0.05)

    def _services(self, kind: str | None = None) -> list[str]:
        return [n for n, _, _ in self.stack.service_table() if kind is None or n.startswith(kind)]

    async def _switch_started(self, done: asyncio.Future) -> tuple[str, str] | None:
        """Wait for a server to start a model switch: (server, incoming model), from the substrate's mirror."""
        r = aioredis.Redis.from_url(self.stack.redis_url)
        keys = Keys(self.stack.key_prefix)
        try:
            seen: dict[str, int] = {}
            deadline = time.monotonic() + SWITCH_WAIT_S
            while time.monotonic() < deadline and not done.done():
                for server in self.stack.server_ids:
                    with contextlib.suppress(Exception):
                        view = state.decode_server(await r.hgetall(keys.server(server))).substrate
                        if server in seen and (view.switches > seen[server] or view.staged):
                            return server, view.staged or view.resident or ""
                        seen[server] = view.switches
                await asyncio.sleep(0.01)
            return None
        finally:
            await r.aclose()

    async def inject(self, kind: str, done: asyncio.Future) -> Fault:
        st = self.stack
        at = self.now()
        in_flight = len(self.flight.open)
        if kind in SERVICE_KINDS:
            target = self.rng.choice(self._services(kind))
            st.group.kill(target)   # SIGKILL; the stack's supervisor restarts it
            fault = Fault(kind, target, at)
            await asyncio.sleep(0.05)
            await self._service_healthy(target)
        elif kind == "gateway":
            assert st.gateway_url is not None
            st.group.kill("gateway")  # SIGKILL mid-call: the agents' connections drop, they send again
            fault = Fault(kind, "gateway", at)
            await asyncio.sleep(0.05)
            await st.wait_gateway(60.0)
        elif kind == "overlap":
            # two kills within a second, no wait for health between them
            first, second = self.rng.sample(self._services(), 2)
            fault = Fault(kind, f"{first} + {second}", at)
            st.group.kill(first)
            await asyncio.sleep(self.rng.uniform(0.1, OVERLAP_WITHIN_S - 0.1))
            st.group.kill(second)
            await asyncio.sleep(0.05)
            await self._service_healthy(first)
            await self._service_healthy(second)
        elif kind == "switch":
            started = await self._switch_started(done)
            at = self.now()
            if started is None:
                target = self.rng.choice(self._services("substrate"))
                note = f"no switch started within {SWITCH_WAIT_S:.0f} s"
            else:
                server, incoming = started
                target = self.rng.choice([f"substrate-{server}"] + ([f"engine-{server}-{incoming}"] if incoming else []))
                note = f"during a switch to {incoming} on {server}"
            fault = Fault(kind, target, at, note=note)
            in_flight = len(self.flight.open)
            st.group.kill(target)
            await asyncio.sleep(0.05)
            await self._service_healthy(target)
        elif kind == "nats":
            i = self.rng.randrange(len(st.nats_nodes))
            node = st.nats_nodes[i]
            fault = Fault(kind, f"nats-n{i}", at)
            await asyncio.to_thread(node.kill)
            await asyncio.sleep(NATS_DOWN_S)
            await asyncio.to_thread(node.start, 60.0)   # start() waits for /healthz
            await self._store_healthy()
        elif kind == "redis":
            assert st.redis is not None
            fault = Fault(kind, "redis", at)
            await asyncio.to_thread(st.redis.kill)
            await asyncio.sleep(REDIS_DOWN_S)
            await asyncio.to_thread(st.redis.start, 30.0)  # no persistence: it comes back empty
        elif kind == "nats-redis":
            # a NATS node killed while Redis is down
            assert st.redis is not None
            i = self.rng.randrange(len(st.nats_nodes))
            node = st.nats_nodes[i]
            fault = Fault(kind, f"redis + nats-n{i}", at)
            await asyncio.to_thread(st.redis.kill)
            await asyncio.sleep(0.2)
            await asyncio.to_thread(node.kill)
            await asyncio.sleep(NATS_DOWN_S)
            await asyncio.to_thread(node.start, 60.0)
            await asyncio.to_thread(st.redis.start, 30.0)
            await self._store_healthy()
        elif kind == "hang":
            # stopped, not crashed: only the liveness watch can tell (talaria/ops/liveness.py)
            target = self.rng.choice(self._services())
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
        elif kind == "nats-stall":
            i = self.rng.randrange(len(st.nats_nodes))
            node = st.nats_nodes[i]
            assert node.pid is not None
            fault = Fault(kind, f"nats-n{i} (stopped)", at)
            os.kill(node.pid, signal.SIGSTOP)
            await asyncio.sleep(NATS_STALL_S)
            os.kill(node.pid, signal.SIGCONT)
            await self._store_healthy()
        elif kind == "redis-stall":
            assert st.redis is not None and st.redis.pid is not None
            fault = Fault(kind, "redis (stopped)", at)
            pid = st.redis.pid
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(REDIS_STALL_S)
            os.kill(pid, signal.SIGCONT)
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        fault.in_flight = in_flight
        fault.healthy_s = self.now() - at
        self.faults.append(fault)
        verb = "stopped" if "(stopped)" in fault.target else "killed"
        print(f"[chaos] wall t={at:6.1f} s  {verb:<7} {fault.target:<28} healthy after {fault.healthy_s:5.2f} s"
              f"  ({in_flight} in flight{'; ' + fault.note if fault.note else ''})", file=sys.stderr, flush=True)
        return fault

    def settle(self) -> None:
        """recovered_s: healthy again, and the next call completed after that."""
        for f in self.faults:
            healthy_at = f.at_s + (f.healthy_s or 0.0)
            after = [c - self.t0 for c in self.flight.completions if c - self.t0 >= healthy_at]
            f.recovered_s = (min(after) if after else healthy_at) - f.at_s

    @property
    def delivered_twice(self) -> list[str]:
        return sorted(cid for cid, bodies in self.finals.items() if len(bodies) > 1)

    async def _observe(self, msg: Msg) -> None:
        if not msg.data.startswith(b'{"type":"reply"'):
            return  # heartbeats, acks, tokens
        with contextlib.suppress(Exception):
            reply = reply_decoder.decode(msg.data)
            if not reply.duplicate and not reply.aborted:
                self.finals.setdefault(reply.call_id, set()).add(msg.data)

    async def _recovered(self, fault: Fault, done: asyncio.Future) -> None:
        """The next fault waits for this one's recovery (a call completed after its
        component was healthy), at most `RECOVERY_WAIT_S`: otherwise a fault's recovery
        time measured the faults injected on top of it (two faults on purpose are the
        `overlap` and `nats-redis` kinds). One that outlasts the wait is overlapped by
        the next, and says so."""
        healthy_at = self.t0 + fault.at_s + (fault.healthy_s or 0.0)
        deadline = time.monotonic() + RECOVERY_WAIT_S
        while not done.done() and time.monotonic() < deadline:
            if self.flight.completions and self.flight.completions[-1] >= healthy_at:
                return
            await asyncio.sleep(0.02)
        if not done.done():
            fault.note = "; ".join(x for x in (fault.note, "not recovered when the next fault came") if x)

    async def _wait_in_flight(self, done: asyncio.Future) -> bool:
        """A fault hurts only while calls are open: wait for one (False: the replay ended first)."""
        while not self.flight.open:
            if done.done():
                return False
            await asyncio.sleep(0.02)
        return True

    async def run(self, plan: list[tuple[float, str]], done: asyncio.Future) -> None:
        async def on_error(e: Exception) -> None:
            # the node this connection uses is killed on purpose: expected, and the
            # library's default callback would print a traceback each time
            self.nats_errors += 1

        async def quiet() -> None:
            pass

        # (the services' keep-alive: a stopped node is left in about 10 s, as they leave it)
        opts = dict(servers=self.stack.nats_urls, max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                    **NATS_KEEPALIVE,
                    error_cb=on_error, disconnected_cb=quiet, reconnected_cb=quiet)
        self.nc = await nats.connect(name="talaria-chaos", **opts, **self.stack.nats_auth("operator"))
        # what the agents hear, as an agent may: their reply subjects
        self.observer = await nats.connect(name="talaria-chaos-observer", **opts,
                                           **self.stack.nats_auth("gateway" if self.via_gateway else "agent"))
        # the replies the agents' client hears: the gateway's, where the agents speak HTTP to it
        await self.observer.subscribe(f"{self.stack.subject_prefix}.reply.{self.reply_namespace}.>", cb=self._observe)
        # reads the call record's stream state as admission may (a NATS fault is healthy once it answers)
        self.store = await nats.connect(name="talaria-chaos-store", **opts, **self.stack.nats_auth("admission"))
        try:
            for at, kind in plan:
                wait = at - self.now()
                if wait > 0:
                    await asyncio.wait([done], timeout=wait)
                if not await self._wait_in_flight(done):
                    self.skipped.append(kind)
                    print(f"[chaos] not injected: {kind} (the replay ended first)", file=sys.stderr, flush=True)
                    continue
                fault = await self.inject(kind, done)
                await self._recovered(fault, done)
        finally:
            await self.nc.close()
            await self.store.close()

    async def close(self) -> None:
        if self.observer is not None:
            with contextlib.suppress(Exception):
                await self.observer.close()


async def _watchdog(flight: Flight, replay: asyncio.Future, stall_s: float) -> list[str] | None:
    """End a run in which nothing completes: the calls still open, or None if the replay ended."""
    while not replay.done():
        await asyncio.sleep(0.5)
        idle = time.monotonic() - flight.last_progress
        if flight.open and idle > stall_s:
            stuck = sorted(flight.open)
            print(f"[chaos] watchdog: no call completed for {idle:.0f} s; stuck: {', '.join(stuck[:20])}"
                  + (" ..." if len(stuck) > 20 else ""), file=sys.stderr, flush=True)
            replay.cancel()
            return stuck
    return None


@dataclass
class RunResult:
    outcome: ReplayOutcome | None   # None when the watchdog ended it
    injector: Injector | None
    flight: Flight
    log_dir: Path
    wall_s: float
    stuck: list[str] | None = None


async def _run_once(sessions: list[TraceSession], spec: StackSpec, *, plan: list[tuple[float, str]] | None,
                    seed: int, silence_s: float, stall_s: float = STALL_S) -> RunResult:
    async with EmbeddedStack(spec) as stack:
        client = await TalariaClient.from_deployment(stack.deployment(), silence_s=silence_s, retries=50)
        agents: TalariaClient | GatewayAgents = client
        if spec.gateway:  # the agents speak HTTP to the gateway; the client above only asks the limits
            agents = await GatewayAgents.of_stack(stack, client)
        flight = Flight()
        t0 = time.monotonic()
        flight.last_progress = t0
        inj = Injector(stack, random.Random(seed), t0, flight, via_gateway=spec.gateway) if plan is not None else None
        out: ReplayOutcome | None = None
        stuck: list[str] | None = None
        try:
            clock = ScaledClock(spec.time_scale, stack.clock_epoch)
            replay = asyncio.ensure_future(drive(agents, clock, sessions, spec.policy.name, on_reply=flight.replied,
                                                 on_issue=flight.issued, error_retries=30 if inj else 0,
                                                 progress_every_wall_s=10.0))
            watch = asyncio.ensure_future(_watchdog(flight, replay, stall_s))
            injector = asyncio.ensure_future(inj.run(plan, replay)) if inj and plan else None
            with contextlib.suppress(asyncio.CancelledError):
                out = await replay
            stuck = await watch
            if injector is not None:
                await injector   # every scheduled fault is injected or counted as not injected
        finally:
            if isinstance(agents, GatewayAgents):
                await agents.close()
            await client.close()
        wall = time.monotonic() - t0
        if inj:
            inj.settle()
        await asyncio.sleep(0.5)  # let the last log lines land (and the observer hear the last replies)
        if inj:
            await inj.close()
        return RunResult(out, inj, flight, stack.log_dir, wall, stuck)


@dataclass
class Reference:
    sessions: list[TraceSession]
    sct: dict[str, float]
    wall_s: float


def _stack_spec(sessions: list[TraceSession], base: Path, sub: str, *, policy: str, time_scale: float,
                nats_cluster: int, servers: int, via_gateway: bool = False) -> StackSpec:
    models = sorted({s.model for s in sessions})
    return StackSpec(policy=resolve_policy(policy), models=models, servers=servers, time_scale=time_scale,
                     log_dir=base / sub, nats_cluster=nats_cluster, liveness=True, liveness_grace_s=LIVENESS_GRACE_S,
                     liveness_startup_s=LIVENESS_STARTUP_S, gateway=via_gateway)


def _clear(base: Path) -> None:
    if base.exists():
        # the duplicate count reads these logs: an earlier run's lines would count twice
        shutil.rmtree(base)
        print(f"[chaos] removed the logs of an earlier run in {base}", file=sys.stderr, flush=True)


async def reference_run(sessions: list[TraceSession], *, policy: str = "talaria", time_scale: float = 50.0,
                        log_dir: Path | None = None, nats_cluster: int = 3, silence_s: float = 5.0,
                        servers: int = 1, name: str = "reference", via_gateway: bool = False) -> Reference:
    base = Path(log_dir or default_log_dir()) / f"chaos-{name}"
    _clear(base)
    print(f"[chaos] fault-free reference run ({len(sessions)} sessions) ...", file=sys.stderr, flush=True)
    spec = _stack_spec(sessions, base, "reference", policy=policy, time_scale=time_scale,
                       nats_cluster=nats_cluster, servers=servers, via_gateway=via_gateway)
    ref = await _run_once(sessions, spec, plan=None, seed=0, silence_s=silence_s)
    assert ref.outcome is not None
    return Reference(sessions, ref.outcome.sct, ref.wall_s)


async def chaos_run(ref: Reference, *, seed: int, policy: str = "talaria", time_scale: float = 50.0,
                    log_dir: Path | None = None, nats_cluster: int = 3, kinds: tuple[str, ...] = FAULT_KINDS,
                    rounds: int = 1, silence_s: float = 5.0, servers: int = 1, stall_s: float = STALL_S,
                    via_gateway: bool = False) -> dict:
    sessions = ref.sessions
    base = Path(log_dir or default_log_dir()) / f"chaos-{seed}"
    _clear(base)
    plan = schedule(seed, ref.wall_s, kinds, rounds)
    print(f"[chaos] seed {seed}: reference took {ref.wall_s:.1f} s wall; faults planned at (wall s; each also "
          "waits for the one before to recover, and for calls in flight) "
          + ", ".join(f"{k}@{t:.1f}s" for t, k in plan), file=sys.stderr, flush=True)
    spec = _stack_spec(sessions, base, "chaos", policy=policy, time_scale=time_scale,
                       nats_cluster=nats_cluster, servers=servers, via_gateway=via_gateway)
    res = await _run_once(sessions, spec, plan=plan, seed=seed, silence_s=silence_s, stall_s=stall_s)
    inj = res.injector
    assert inj is not None
    total = sum(len(s.calls) for s in sessions)
    completed = len(res.flight.answered)
    gens = _engine_generations(res.log_dir)
    generated_twice = sorted(cid for cid, n in gens.items() if n > 1)
    worst: dict[str, float] = {}
    for f in inj.faults:
        worst[f.kind] = max(worst.get(f.kind, 0.0), f.recovered_s or 0.0)
    sct_ref = _sct_summary(ref.sct)
    sct_chaos = _sct_summary(res.outcome.sct if res.outcome else {})
    return {
        "trace_sessions": len(sessions),
        "seed": seed,
        "policy": policy,
        "time_scale": time_scale,
        "nats_nodes": nats_cluster,
        "servers": servers,
        "via_gateway": via_gateway,
        "calls_total": total,
        "calls_completed": completed,
        "calls_generated_twice": len(generated_twice),   # an engine generated it to the end more than once
        "calls_delivered_twice": len(inj.delivered_twice),  # an agent heard two different final replies
        "calls_lost": total - completed,
        # a retried call id answered with the stored reply (neither a second generation nor a second answer)
        "replies_from_cache": res.outcome.duplicates if res.outcome else 0,
        # calls whose final reply the observer heard on the agents' client's reply subjects (what
        # `delivered twice` is judged on: a check that heard nothing would pass by default)
        "replies_observed": len(inj.finals),
        "generated_twice_ids": generated_twice,
        "delivered_twice_ids": inj.delivered_twice,
        "stalled": res.stuck is not None,
        "stuck_calls": res.stuck or [],
        "session_failures": res.outcome.failures if res.outcome else [],
        "faults": [asdict(f) for f in inj.faults],
        "faults_not_injected": inj.skipped,
        "worst_recovery_s": worst,
        "sct_reference": sct_ref,
        "sct_chaos": sct_chaos,
        "sct_mean_ratio": sct_chaos["mean"] / sct_ref["mean"] if sct_ref["mean"] else float("nan"),
        "wall_s": {"reference": ref.wall_s, "chaos": res.wall_s},
        "log_dir": str(base),
    }


async def run_chaos(sessions: list[TraceSession], *, seed: int = 0, policy: str = "talaria", time_scale: float = 50.0,
                    log_dir: Path | None = None, nats_cluster: int = 3, kinds: tuple[str, ...] = FAULT_KINDS,
                    rounds: int = 1, silence_s: float = 5.0, servers: int = 1, stall_s: float = STALL_S,
                    via_gateway: bool = False) -> dict:
    """One seed: a fault-free reference run, then the chaos run."""
    common = dict(policy=policy, time_scale=time_scale, log_dir=log_dir, nats_cluster=nats_cluster,
                  silence_s=silence_s, servers=servers, via_gateway=via_gateway)
    ref = await reference_run(sessions, name=f"{seed}-reference", **common)  # type: ignore[arg-type]
    return await chaos_run(ref, seed=seed, kinds=kinds, rounds=rounds, stall_s=stall_s, **common)  # type: ignore[arg-type]


def clean(r: dict) -> bool:
    """Nothing lost, generated twice or delivered twice, and no stall."""
    return (r["calls_lost"] == 0 and r["calls_generated_twice"] == 0 and r["calls_delivered_twice"] == 0
            and not r["stalled"])


def format_report(r: dict) -> str:
    lines = [
        f"chaos: {r['trace_sessions']} sessions, seed {r['seed']}, policy {r['policy']}, "
        f"{r.get('servers', 1)} server(s), {r['nats_nodes']} NATS node(s), time scale {r['time_scale']:g}"
        + (", agents over HTTP through the gateway" if r.get("via_gateway") else ""),
        f"faults injected: {len(r['faults'])} (at: wall seconds into the run; healthy, recovered: wall seconds after it)"
        + (f" (not injected, the replay ended first: {', '.join(r['faults_not_injected'])})"
           if r["faults_not_injected"] else ""),
    ]
    for f in r["faults"]:
        lines.append(f"  {f['kind']:<11} {f['target']:<44} at {f['at_s']:6.1f} s  in flight {f['in_flight']:3d}"
                     f"  healthy {f['healthy_s']:5.2f} s  recovered {f['recovered_s']:5.2f} s"
                     + (f"  ({f['note']})" if f["note"] else ""))
    lines.append(f"calls: total {r['calls_total']}  completed {r['calls_completed']}  lost {r['calls_lost']}  "
                 f"generated twice {r['calls_generated_twice']}  delivered twice {r['calls_delivered_twice']}  "
                 f"(retries answered with the stored reply: {r['replies_from_cache']})")
    if (heard := r.get("replies_observed", r["calls_completed"])) < r["calls_completed"]:
        # the listener is a NATS client too: replies sent while its node was down went unheard
        lines.append(f"delivered twice is judged on the {heard} of {r['calls_completed']} replies the listener heard "
                     f"(it missed {r['calls_completed'] - heard} while its NATS node was down)")
    if r["stalled"]:
        lines.append(f"STALLED: the watchdog ended the run; stuck calls: {', '.join(r['stuck_calls'][:20])}")
    lines.append("worst recovery (wall s, health + next completed call): "
                 + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["worst_recovery_s"].items())))
    a, b = r["sct_reference"], r["sct_chaos"]
    lines.append(f"SCT (model s) fault-free mean {a['mean']:.1f} p50 {a['p50']:.1f} p90 {a['p90']:.1f} | "
                 f"chaos mean {b['mean']:.1f} p50 {b['p50']:.1f} p90 {b['p90']:.1f} | ratio {r['sct_mean_ratio']:.3f}")
    if r["session_failures"]:
        lines.append(f"session failures: {len(r['session_failures'])}: {r['session_failures'][:3]}")
    return "\n".join(lines)


def format_table(results: list[dict]) -> str:
    """One line per seed (`--seeds`), then the worst recovery per kind over all of them."""
    head = (f"{'seed':>5} {'faults':>6} {'skip':>4} {'completed':>11} {'lost':>4} {'gen2':>4} {'del2':>4} "
            f"{'heard':>5} {'cached':>6} {'stall':>5} {'SCT ratio':>9}")
    lines = [head]
    worst: dict[str, float] = {}
    for r in results:
        lines.append(f"{r['seed']:>5} {len(r['faults']):>6} {len(r['faults_not_injected']):>4} "
                     f"{r['calls_completed']:>5}/{r['calls_total']:<5} {r['calls_lost']:>4} "
                     f"{r['calls_generated_twice']:>4} {r['calls_delivered_twice']:>4} "
                     f"{r.get('replies_observed', r['calls_completed']):>5} {r['replies_from_cache']:>6} "
                     f"{'yes' if r['stalled'] else 'no':>5} {r['sct_mean_ratio']:>9.3f}")
        for k, v in r["worst_recovery_s"].items():
            worst[k] = max(worst.get(k, 0.0), v)
    lines.append("worst recovery over all seeds (wall s): " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(worst.items())))
    lines.append("(del2 is judged on the replies heard: the listener, a NATS client, misses those sent while its "
                 "node is down)")
    return "\n".join(lines)


def _kind_list(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in kinds if k not in FAULT_KINDS + EXTRA_KINDS + GATEWAY_KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"unknown fault kind(s) {bad}; choose from "
                                         f"{', '.join(FAULT_KINDS + EXTRA_KINDS + GATEWAY_KINDS)}")
    return kinds


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="the trace to replay under faults (JSON Lines)")
    seeds = p.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, default=0, help="seed of the fault schedule (what is killed when; default 0)")
    seeds.add_argument("--seeds", type=seed_list, default=None,
                       help="several distinct seeds, e.g. 0,1,2 or 0-4: one reference run, a chaos run per seed, a table")
    p.add_argument("--kinds", type=_kind_list, default=None,
                   help=f"fault kinds, comma-separated (default all: {','.join(FAULT_KINDS)}, and gateway with "
                        f"--via-gateway; also {','.join(EXTRA_KINDS)})")
    p.add_argument("--via-gateway", action="store_true",
                   help="the agents speak HTTP (OpenAI chat completions) to the stack's gateway, sending a call "
                        "again under its Idempotency-Key as an SDK does; adds the gateway's own kill to the kinds")
    p.add_argument("--out", type=output_file, default=None, help="write the figures as JSON")
    p.add_argument("--policy", default="talaria", help="the policy the stack runs (default talaria)")
    p.add_argument("--time-scale", type=positive_float, default=50.0, help="model seconds per wall second (default 50)")
    p.add_argument("--nats-nodes", type=positive_int, default=3, help="nodes of the embedded NATS cluster, one of which is killed (default 3)")
    p.add_argument("--servers", type=server_count, default=1,
                   help="servers of the stack (default 1); a fault picks its target among all of them")
    p.add_argument("--rounds", type=positive_int, default=1, help="how many times each fault kind is injected")
    p.add_argument("--silence-s", type=positive_float, default=5.0, help="the agents' silence before a retry (wall s)")
    p.add_argument("--stall-s", type=positive_float, default=STALL_S,
                   help=f"wall seconds without a completed call after which the watchdog ends the run (default {STALL_S:g})")
    p.add_argument("--log-dir", default=str(default_log_dir()), help=f"log folder; each seed's run is cleared first (default {default_log_dir()})")
    p.set_defaults(fn=run)


async def _run_seeds(sessions: list[TraceSession], a: argparse.Namespace) -> list[dict]:
    common = dict(policy=a.policy, time_scale=a.time_scale, log_dir=Path(a.log_dir), nats_cluster=a.nats_nodes,
                  silence_s=a.silence_s, servers=a.servers, via_gateway=a.via_gateway)
    ref = await reference_run(sessions, **common)  # type: ignore[arg-type]
    out = []
    for seed in a.seeds:
        r = await chaos_run(ref, seed=seed, kinds=a.kinds, rounds=a.rounds, stall_s=a.stall_s, **common)  # type: ignore[arg-type]
        print(format_report(r), flush=True)
        out.append(r)
    return out


def run(a: argparse.Namespace) -> int:
    """Exit 0 when every run lost nothing, generated and delivered nothing twice and never stalled; else 1."""
    resolve_policy(a.policy)  # an unknown policy is refused before any earlier run's logs are cleared
    if a.kinds is None:
        a.kinds = FAULT_KINDS + (GATEWAY_KINDS if a.via_gateway else ())
    elif not a.via_gateway and set(a.kinds) & set(GATEWAY_KINDS):
        print("talaria chaos: error: --kinds gateway kills the gateway the agents call: add --via-gateway",
              file=sys.stderr)
        return 2
    sessions = load_runnable_trace(a.trace, load_catalog())
    if a.seeds:
        results = asyncio.run(_run_seeds(sessions, a))
        print(format_table(results))
        if a.out:
            write_json(a.out, {"runs": results})
        return 0 if all(clean(r) for r in results) else 1
    r = asyncio.run(run_chaos(sessions, seed=a.seed, policy=a.policy, time_scale=a.time_scale,
                              log_dir=Path(a.log_dir), nats_cluster=a.nats_nodes, kinds=a.kinds, rounds=a.rounds,
                              silence_s=a.silence_s, stall_s=a.stall_s, servers=a.servers, via_gateway=a.via_gateway))
    print(format_report(r))
    if a.out:
        write_json(a.out, r)
    return 0 if clean(r) else 1
