"""`talaria replay`: play a trace's agents against the running services.

Each session is a coroutine: it waits for its arrival, opens its session,
issues each call over NATS request-reply through the agent client, waits the
tool gap on the stack's model clock, and ends the session. SCT comes from the
driver's own timestamps (first call issued -> last reply received).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import nats.errors

from shared.clock import LagMonitor, ScaledClock
from shared.keys import Keys
from shared.redis_client import open_redis
from shared.state import decode_server
from shared.policy import PolicyConfig
from shared.schema import CallReply
from talaria.argtypes import write_output
from talaria.workload.trace import TraceSession
from talaria.workload.agent import DEFAULT_MAX_TOKENS, call_id_for, plan_session
from talaria.client import Deployment, LoginRefused, TalariaClient, TalariaError
from talaria.gateway_agent import GatewayAgents
from talaria.results.records import CallRecord
from talaria.ops.stack import EmbeddedStack, StackSpec

T = TypeVar("T")


@dataclass
class ReplayOutcome:
    policy: str
    sct: dict[str, float]
    records: list[CallRecord]
    failures: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    worst_lag_model_s: float = 0.0
    worst_lag_service: str = ""
    duplicates: int = 0
    server_stats: dict[str, float] = field(default_factory=dict)
    time_scale: float = 0.0  # model seconds per wall second of the run (0: not recorded)
    log_dir: str = ""  # where this run's service logs are (an embedded stack's own folder)
    session_prefix: str = ""  # against a running deployment: what its session ids were prefixed with
    servers: int = 0  # the servers it ran on (a deployment's own count; 0: not recorded)
    driver_lag_wall_s: float = 0.0  # the replay's own event loop: a late agent distorts SCT as a late service does
    services_lag_read: bool = False  # False: only the driver's lag is known (a deployment without its Redis)
    # wall seconds each process's event loop stalled during the run (the driver's as "replay-driver")
    stalled_wall_s: dict[str, float] = field(default_factory=dict)

    @property
    def stalled_share(self) -> float:
        """The processes' stalls during the run, summed, over the run's wall time: how
        much later than its model time an event was handled, on average, along a
        session's path through every process (an upper bound: no path meets them all)."""
        return sum(self.stalled_wall_s.values()) / self.wall_s if self.wall_s > 0 else 0.0


class Progress:
    def __init__(self, policy: str, total_calls: int, total_sessions: int, stream=sys.stderr) -> None:
        self.policy = policy
        self.total_calls = total_calls
        self.total_sessions = total_sessions
        self.calls_done = 0
        self.sessions_done = 0
        self.queued_events = 0
        self.stream = stream

    def line(self, model_t: float) -> str:
        return (f"[{self.policy}] model t={model_t:8.1f} s  calls {self.calls_done}/{self.total_calls}  "
                f"sessions {self.sessions_done}/{self.total_sessions}")

    async def run(self, clock: ScaledClock, t0: float, every_wall_s: float = 5.0) -> None:
        while True:
            await asyncio.sleep(every_wall_s)
            print(self.line(clock.now() - t0), file=self.stream, flush=True)


async def drive(
    client: TalariaClient | GatewayAgents,
    clock: ScaledClock,
    sessions: list[TraceSession],
    policy_name: str,
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    run_tag: str = "",
    progress_every_wall_s: float = 5.0,
    on_reply: Callable[[CallReply], None] | None = None,
    on_issue: Callable[[str], None] | None = None,
    error_retries: int = 0,
    progress: Progress | None = None,
) -> ReplayOutcome:
    """`client`: the NATS agent client, or `GatewayAgents` (each session a conversation over
    HTTP through the gateway). `error_retries` > 0 (the chaos run): an agent that gets no_capacity, an
    internal error or a timeout waits `retry_after_s` (or 1 s) and tries again
    under the same call id, that many times. `on_issue(call_id)` / `on_reply`:
    a call is sent / answered (the chaos run's in-flight count and watchdog). `progress`: the
    caller's counter, read by `talaria replay` when it is interrupted mid-run."""
    total_calls = sum(len(s.calls) for s in sessions)
    prog = progress if progress is not None else Progress(policy_name, total_calls, len(sessions))
    prog.policy = policy_name  # (against a deployment, known only once it answers)
    records: list[CallRecord] = []
    sct: dict[str, float] = {}
    failures: list[str] = []
    t0 = clock.now()
    dup = 0

    async def run_session(s: TraceSession) -> None:
        nonlocal dup
        await clock.sleep_until(t0 + s.arrival_s)
        sid = f"{run_tag}{s.session_id}"
        sess = await _retrying(error_retries, lambda: client.open_session(s.model, session_id=sid))
        started = clock.now()
        for pc in plan_session(s, max_tokens, context_limit=sess.context_limit):
            issued = clock.now()
            if on_issue is not None:
                on_issue(call_id_for(sid, pc.index))
            reply: CallReply = await _retrying(error_retries, lambda: sess.call(
                prompt_tokens=pc.prompt_tokens, prefix_tokens=pc.prefix_tokens, max_tokens=pc.max_tokens,
                call_id=call_id_for(sid, pc.index), sim_output_tokens=pc.sim_stop_tokens,
            ))
            received = clock.now()
            if on_reply is not None:
                on_reply(reply)
            dup += int(reply.duplicate)
            records.append(CallRecord(
                call_id=reply.call_id, session_id=s.session_id, model=s.model, index=pc.index,
                server_id=reply.server_id, issued_at=issued - t0, finished_at=received - t0,
                waited_s=reply.waited_s, switch_wait_s=reply.switch_wait_s, round_wait=reply.round_wait,
                restore_s=reply.restore_s, prefill_s=reply.prefill_s, decode_s=reply.decode_s,
                prompt_tokens=reply.prompt_tokens, cached_tokens=reply.cached_tokens,
                restored_tokens=reply.restored_tokens, reprefill_tokens=reply.reprefill_tokens,
                output_tokens=reply.output_tokens,
            ))
            prog.calls_done += 1
            # the tool runs from the reply's model time at the engine, not from when this
            # driver received it: the delivery latency, which the time scale multiplies
            # (1 ms of wall is 0.1 model s at 100x), would otherwise pile up call by call
            await clock.sleep_until(max(clock.now(), reply.finished_at + pc.tool_s) if reply.finished_at > 0
                                    else clock.now() + pc.tool_s)
        sct[s.session_id] = clock.now() - started
        prog.sessions_done += 1
        with contextlib.suppress(TalariaError):
            await sess.end()

    wall0 = time.perf_counter()
    ticker = asyncio.ensure_future(prog.run(clock, t0, progress_every_wall_s))
    lag = LagMonitor()
    lag_task = asyncio.ensure_future(lag.run())
    try:
        results = await asyncio.gather(*(run_session(s) for s in sessions), return_exceptions=True)
    finally:
        ticker.cancel()
        lag_task.cancel()
    for s, r in zip(sessions, results):
        if isinstance(r, BaseException):
            failures.append(f"{s.session_id}: {type(r).__name__}: {r}")
    print(prog.line(clock.now() - t0), file=sys.stderr, flush=True)
    return ReplayOutcome(policy=policy_name, sct=sct, records=records, failures=failures,
                         wall_s=time.perf_counter() - wall0, duplicates=dup, driver_lag_wall_s=lag.worst_s,
                         stalled_wall_s={DRIVER: lag.stalled_s})


async def _retrying(retries: int, make: Callable[[], Awaitable[T]]) -> T:
    for attempt in range(retries + 1):
        try:
            return await make()
        except TalariaError as exc:
            if attempt >= retries or exc.code not in ("no_capacity", "unavailable", "internal", "timeout"):
                raise
            await asyncio.sleep(exc.retry_after_s or 1.0)
    raise AssertionError("unreachable")


DRIVER = "replay-driver"  # the replay's own process, among the services in lag reports


@dataclass
class LagReport:
    """Services' event-loop lag reports (wall seconds, each over its process's life)."""
    worst: tuple[str, float]  # the worst single lag and whose
    stalled_s: dict[str, float]  # each process's stalls, summed
    missing: list[str] = field(default_factory=list)  # processes that did not report in time

    def stalled_since(self, before: LagReport | None) -> dict[str, float]:
        """Each process's stalls after `before` was read (all of them where it was not)."""
        was = before.stalled_s if before is not None else {}
        return {name: max(0.0, s - was.get(name, 0.0)) for name, s in self.stalled_s.items()}


async def deployment_lag(redis_url: str, key_prefix: str) -> LagReport:
    """Every lag report in a deployment's Redis (its processes' names from the keys)."""
    keys = Keys(key_prefix)
    r = open_redis(redis_url)
    try:
        async def read(pattern: str) -> dict[str, float]:
            found = [k async for k in r.scan_iter(match=pattern)]
            values = await r.mget(found) if found else []
            return {k.decode().rsplit(":", 1)[-1]: float(v) for k, v in zip(found, values) if v is not None}

        worst = await read(keys.lag("*"))
        return LagReport(worst=max(worst.items(), key=lambda kv: kv[1], default=("", 0.0)),
                         stalled_s=await read(keys.stalled("*")))
    finally:
        await r.aclose()


# Services write their worst loop lag to Redis once a wall second (shared/bus.py), so
# a run shorter than that (a high time scale) ends before any report of it lands.
LAG_REPORT_WAIT_S = 5.0


async def reported_lag(redis_url: str, key_prefix: str, instances: list[str],
                       wait_s: float = LAG_REPORT_WAIT_S) -> LagReport:
    """`instances`' lag from reports written after this call: their worst-lag keys
    are cleared first and each is waited for (the values are over the service's
    life, so clearing loses nothing; a report writes its stalls before its worst).
    For a stack this replay owns."""
    keys = Keys(key_prefix)
    r = open_redis(redis_url)
    try:
        await r.delete(*(keys.lag(i) for i in instances))
        deadline = time.monotonic() + wait_s
        while True:
            values = await r.mget([keys.lag(i) for i in instances])
            missing = [i for i, v in zip(instances, values) if v is None]
            if not missing or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        worst = ("", 0.0)
        for i, v in zip(instances, values):
            if v is not None and float(v) >= worst[1]:
                worst = (i, float(v))
        stalled = await r.mget([keys.stalled(i) for i in instances])
        return LagReport(worst=worst, stalled_s={i: float(v) for i, v in zip(instances, stalled) if v is not None},
                         missing=missing)
    finally:
        await r.aclose()


def _lag_of(out: ReplayOutcome, services: LagReport | None, before: LagReport | None, time_scale: float) -> None:
    """Record the worst of the services' and the driver's lag, in model seconds, and
    the services' stalls during the run (after `before`) beside the driver's."""
    worst = (DRIVER, out.driver_lag_wall_s)
    if services is not None:
        out.services_lag_read = True
        if services.worst[0] and services.worst[1] > worst[1]:
            worst = services.worst
        out.stalled_wall_s.update(services.stalled_since(before))
    out.worst_lag_service, out.worst_lag_model_s = worst[0], worst[1] * time_scale


async def server_stats(redis_url: str, key_prefix: str, server_ids: list[str]) -> dict[str, float]:
    """Sum the admission schedulers' counters (mirrored in Redis) over servers."""
    r = open_redis(redis_url)
    out: dict[str, float] = {}
    try:
        for sid in server_ids:
            mirror = decode_server(await r.hgetall(Keys(key_prefix).server(sid)))
            for name, v in mirror.counters.items():
                out[name] = out.get(name, 0.0) + v
    finally:
        await r.aclose()
    return out


async def replay_embedded(sessions: list[TraceSession], policy: PolicyConfig, spec: StackSpec,
                          via_gateway: bool = False, progress: Progress | None = None) -> ReplayOutcome:
    """`via_gateway`: the agents speak HTTP to the stack's gateway (talaria/gateway_agent.py)
    instead of NATS to the router."""
    spec.policy = policy
    spec.gateway = spec.gateway or via_gateway
    stack = EmbeddedStack(spec)
    processes = len(stack.service_table()) + int(spec.gateway)
    print(f"[{policy.name}] starting the embedded stack (NATS, Redis, {processes} service processes) ...", file=sys.stderr, flush=True)
    async with stack:
        print(f"[{policy.name}] stack up; logs in {stack.log_dir}; replaying at {spec.time_scale:g}x", file=sys.stderr, flush=True)
        client = await TalariaClient.from_deployment(stack.deployment())
        services = [n for n, _, _ in stack.service_table()]
        try:
            # the services' stalls so far (starting up): the run's are those after
            before = await reported_lag(stack.redis_url, stack.key_prefix, services)
            clock = ScaledClock(spec.time_scale, stack.clock_epoch)
            if via_gateway:
                agents = await GatewayAgents.of_stack(stack, client)
                try:
                    out = await drive(agents, clock, sessions, policy.name, progress=progress)
                finally:
                    await agents.close()
            else:
                out = await drive(client, clock, sessions, policy.name, progress=progress)
        finally:
            await client.close()
        await asyncio.sleep(0.3)  # let the last mirror land
        # every service's lag as of after the run, not whatever was reported before it ended
        lag = await reported_lag(stack.redis_url, stack.key_prefix, services)
        if lag.missing:
            print(f"[{policy.name}] no event-loop lag report from {', '.join(lag.missing)} within "
                  f"{LAG_REPORT_WAIT_S:g} s; see their logs in {stack.log_dir}", file=sys.stderr, flush=True)
        _lag_of(out, lag, before, spec.time_scale)
        out.server_stats = await server_stats(stack.redis_url, stack.key_prefix, stack.server_ids)
        out.time_scale = spec.time_scale
        out.log_dir = str(stack.log_dir)
        return out


class ReplayTargetError(Exception):
    """The running deployment cannot take this replay: unreachable, the login
    refused, no router answering, or a model of the trace not served."""


async def replay_external(sessions: list[TraceSession], target: Deployment,
                          progress: Progress | None = None) -> ReplayOutcome:
    where = ",".join(target.nats_urls)
    try:
        client = await TalariaClient.from_deployment(target)
    except (nats.errors.Error, OSError) as exc:  # ConnectionError and LoginRefused are OSErrors
        hint = " (log in with --credentials FILE from `talaria up`, or --nats-user)" if isinstance(exc, LoginRefused) else ""
        raise ReplayTargetError(f"{exc}{hint}") from None
    try:
        try:
            info = await client.info()  # doubles as the health check of the deployment's router
        except TalariaError as exc:
            raise ReplayTargetError(f"no Talaria router answers at {where} under subject prefix "
                                    f"{target.subject_prefix!r}: {exc}") from None
        missing = sorted({s.model for s in sessions} - set(info.models))
        if missing:
            raise ReplayTargetError(f"the deployment at {where} does not serve {', '.join(missing)} "
                                    f"(it serves {', '.join(info.models)})")
        print(f"[{info.policy}] replaying against {where} at {info.time_scale:g}x "
              f"({len(info.servers)} server{'' if len(info.servers) == 1 else 's'})", file=sys.stderr, flush=True)
        # a running deployment's counters add up over its life: this replay's share is after - before
        before = await _deployment_stats(target, info.servers, info.policy)
        lag_before = (await _from_deployment_redis(target, info.policy, deployment_lag(target.redis_url, target.key_prefix))
                      if before is not None else None)
        clock = ScaledClock(info.time_scale, info.clock_epoch)
        # a deployment outlives replays: a per-run prefix keeps this run's sessions apart from earlier ones
        prefix = f"r{uuid.uuid4().hex[:6]}"
        print(f"[{info.policy}] session ids prefixed {prefix}- (e.g. {prefix}-{sessions[0].session_id}); "
              f"its logs: talaria logs SESSION --run {prefix} --log-dir <the deployment's log folder>",
              file=sys.stderr, flush=True)
        out = await drive(client, clock, sessions, info.policy, run_tag=f"{prefix}-", progress=progress)
        out.session_prefix = prefix
    finally:
        await client.close()
    out.time_scale = info.time_scale
    out.servers = len(info.servers)
    after = await _deployment_stats(target, info.servers, info.policy) if before is not None else None
    lag: LagReport | None = None
    if before is not None and after is not None:
        out.server_stats = {k: v - before.get(k, 0.0) for k, v in after.items()}
        # a deployment's lag keys are its own: not cleared, but read after one report
        # interval so this run's lag is in (the worst over the deployment's life; the
        # stalls since the read before the run)
        await asyncio.sleep(1.2)
        lag = await _from_deployment_redis(target, info.policy, deployment_lag(target.redis_url or "", target.key_prefix))
    _lag_of(out, lag, lag_before, info.time_scale)
    return out


async def _deployment_stats(target: Deployment, server_ids: list[str], policy: str) -> dict[str, float] | None:
    """The deployment's scheduler counters from its Redis; None without one or
    when it cannot be read (operators' extras: the replay stands without them)."""
    if not target.redis_url:
        return None
    return await _from_deployment_redis(target, policy, server_stats(target.redis_url, target.key_prefix, server_ids))


async def _from_deployment_redis(target: Deployment, policy: str, read: Awaitable[T]) -> T | None:
    try:
        return await read
    except Exception as exc:
        print(f"[{policy}] could not read the deployment's Redis at {target.redis_url}: {exc}", file=sys.stderr, flush=True)
        return None


def write_json(path: str | Path, payload: dict) -> None:
    def clean(o):  # NaN is not JSON
        if isinstance(o, float) and math.isnan(o):
            return None
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, list):
            return [clean(v) for v in o]
        return o

    write_output(path, json.dumps(clean(payload), indent=2) + "\n")
