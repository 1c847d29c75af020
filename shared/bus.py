"""What every service process shares: connections, health, lag, shutdown.

A service subclasses `ServiceProcess`, implements `setup()` (subscriptions)
and is run by `run_service(cls)` as its module's entry point. NATS connects
with unlimited reconnects; the service registers as a NATS micro service so
`$SRV.PING` answers its health; SIGTERM/SIGINT stop taking work and drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import nats
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
import structlog
from nats.aio.msg import Msg
from nats.micro import add_service
from nats.micro.service import EndpointConfig, ServiceConfig

from shared.call_record import CallRecords
from shared.catalog import Catalog, load_catalog
from shared.clock import LAG_REPORT_WALL_S, LagMonitor, ScaledClock
from shared.keys import CALL_TTL_S, Keys
from shared.logs import configure_logging, rotate_logs
from shared import tracing
from shared.metrics import Metrics
from shared.net import NATS_CONNECT_TIMEOUT_S, NATS_KEEPALIVE
from shared.redis_client import RedisUrlError, check_target, open_redis
from shared.schema import HEALTH_OK, HEALTH_STARTING, ApiError, EngineState, ListCalls, encode, engine_state_decoder
from shared.settings import Settings
from shared.subjects import HEADER_CALL, HEADER_RECEIPT, HEADER_SESSION, Subjects

VERSION = "0.1.0"


def trace_headers(session_id: str, call_id: str | None = None) -> dict[str, str]:
    h = {HEADER_SESSION: session_id}
    if call_id:
        h[HEADER_CALL] = call_id
    return h


def trace_context(msg: Msg) -> dict[str, str]:
    h = msg.headers or {}
    out = {}
    if HEADER_SESSION in h:
        out["session_id"] = h[HEADER_SESSION]
    if HEADER_CALL in h:
        out["call_id"] = h[HEADER_CALL]
    return out


async def connect_nats(urls: list[str], name: str, log: structlog.stdlib.BoundLogger,
                       user: str | None = None, password: str | None = None) -> nats.NATS:
    client: list[nats.NATS] = []

    async def on_error(e: Exception) -> None:
        log.warning("nats.error", error=str(e))

    async def on_disconnect() -> None:
        if client and client[0].is_closed:  # (our own close, at a clean stop: not a fault)
            log.info("nats.closed")
            return
        log.warning("nats.disconnected")

    async def on_reconnect() -> None:
        log.info("nats.reconnected")

    nc = await nats.connect(
        servers=urls,
        name=name,
        max_reconnect_attempts=-1,   # never give up
        reconnect_time_wait=0.5,
        allow_reconnect=True,
        connect_timeout=NATS_CONNECT_TIMEOUT_S,
        **NATS_KEEPALIVE,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        user=user,
        password=password,
    )
    client.append(nc)
    return nc


REDIS_POOL_CONNECTIONS = 64  # Redis connections a service process keeps at most (a command waits for one)
REDIS_POOL_WAIT_S = 30.0      # ... for at most this long (a Redis restart is waited out by the commands' retries)
REDIS_AWAY = (RedisConnectionError, RedisTimeoutError)  # a Redis restarting or stopped, not a bad command
REDIS_SOCKET_TIMEOUT_S = 2.0  # a reply a stalled Redis (stopped, not dead: it accepts and answers nothing) owes fails so late
REDIS_UP_WITHIN_S = 5.0       # a process reports Redis down (its metric) this long after its last answer
REDIS_OUTAGE_WAIT_S = 14.0    # how long a command waits out a Redis restart or stall, retrying, before it fails
AGENT_REQUEST_REDIS_WAIT_S = 3.0  # ... in a process that answers agents: below their request timeout
                                   # (`agent_client`, 5 s), so they hear `unavailable` and a retry time, not silence
STORE_RETRY_AFTER_S = 1.0     # what a request refused while Redis is away is told to wait (a restart takes about 0.5 s)
CONCURRENT_HANDLER_LIMIT = 256  # requests one subscription handles at once (concurrent_handler)
CONCURRENT_HANDLER_BACKLOG = 4096  # ... and takes to wait for a slot before the subscription waits
LIST_CALLS_TIMEOUT_WALL_S = 2.0  # wall seconds a recovering service waits for each engine's state
LOOP_STALL_EXIT_CODE = 70  # EX_SOFTWARE: the process's own watchdog found its event loop stuck
TASK_ENDED_EXIT_CODE = 71  # a task the process cannot serve without ended (ServiceProcess.spawn)


def start_loop_watchdog(lag: LagMonitor, stall_s: float, instance: str) -> threading.Thread:
    """A thread that ends the process when its event loop has not run for `stall_s`
    (a blocked call, a stuck driver): in compose nothing else would, since Docker
    does not restart a container that is merely unhealthy; its restart policy
    restarts one that exited. A SIGSTOPped process stops this thread too: the
    embedded stack's liveness watch (talaria/ops/liveness.py) covers that."""

    def watch() -> None:
        while True:
            time.sleep(min(1.0, stall_s / 4))
            # how long the monitor's wake-up is overdue (its sleep is longer while the process is idle)
            idle = time.monotonic() - max(lag.last_tick, lag.due)
            if idle > stall_s:
                sys.stderr.write(json.dumps({"event": "service.loop_stuck", "instance": instance, "level": "error",
                                             "idle_s": round(idle, 1), "exit_code": LOOP_STALL_EXIT_CODE}) + "\n")
                sys.stderr.flush()
                os._exit(LOOP_STALL_EXIT_CODE)

    t = threading.Thread(target=watch, name="loop-watchdog", daemon=True)
    t.start()
    return t


class BoundedRetry(Retry):
    """redis-py's retry, bounded in wall time as well as in attempts: a Redis that refuses
    connections (restarting) fails each attempt at once, one that accepts them and
    answers nothing (a stopped process) only after the socket timeout, so attempts alone
    bound the first and not the second. Each connection holds its own copy (redis-py
    deep-copies it, and this bound method with it); a command's reconnects inside its
    attempts share its budget."""

    def __init__(self, backoff: ExponentialBackoff, retries: int, budget_s: float) -> None:
        super().__init__(backoff, retries, is_retryable=self._within_budget)
        self.budget_s = budget_s
        self._began = 0.0
        self._depth = 0

    def _within_budget(self, error: Exception) -> bool:
        return time.monotonic() - self._began < self.budget_s

    async def call_with_retry(self, do: Any, fail: Any, *args: Any, **kwargs: Any) -> Any:
        if self._depth == 0:
            self._began = time.monotonic()
        self._depth += 1
        try:
            return await super().call_with_retry(do, fail, *args, **kwargs)
        finally:
            self._depth -= 1


class OrderedWrites:
    """A process's Redis writes that must land in the order they were made (a session's
    finish after the spill before it, the next finish after that), written one at a
    time by one task and retried for as long as Redis is away, so that whoever makes
    one need not wait on a stalled Redis: the engine-worker answers an agent without
    its state write where that write is late, and the state follows once Redis takes it."""

    RETRY_WALL_S = 1.0  # between attempts at a write Redis did not take

    def __init__(self, redis: Callable[[], aioredis.Redis], log: Callable[[], structlog.stdlib.BoundLogger],
                 what: str) -> None:
        self.redis, self.log, self.what = redis, log, what  # (the process's, read when used: it connects later)
        self.queue: deque[tuple[Callable[[Any], None], asyncio.Future[None]]] = deque()
        self.wake = asyncio.Event()
        self.late = False  # Redis did not take the write at the head of the queue: later ones wait behind it
        self.head_since = 0.0  # (monotonic) when the write at the head was first tried

    def write(self, build: Callable[[Any], None]) -> asyncio.Future[None]:
        """Queue a write (`build` adds its commands to a transaction); done once Redis took it."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not self.queue:
            self.head_since = time.monotonic()
        self.queue.append((build, done))
        self.wake.set()
        return done

    def behind(self, by_s: float) -> bool:
        """Whether the head of the queue has waited on Redis for `by_s` or more (or failed)."""
        return self.late or (bool(self.queue) and time.monotonic() - self.head_since >= by_s)

    async def run(self) -> None:
        """Write the queue in order, forever (a task of the process)."""
        while True:
            if not self.queue:
                self.wake.clear()
                await self.wake.wait()
                continue
            build, done = self.queue[0]
            try:
                pipe = self.redis().pipeline(transaction=True)
                build(pipe)
                await pipe.execute()
            except REDIS_AWAY as exc:  # foreseen: kept, in order, and tried again
                if not self.late:
                    self.log().warning("state.writes_deferred", writes=self.what, pending=len(self.queue),
                                     error=type(exc).__name__)
                self.late = True
                await asyncio.sleep(self.RETRY_WALL_S)
                continue
            except Exception:  # a write Redis refuses as such (never foreseen): dropped, not retried forever
                self.log().exception("state.write_failed", writes=self.what)
            self.queue.popleft()
            self.head_since = time.monotonic()  # (the next one's turn starts now)
            if not done.done():
                done.set_result(None)
            if self.late:
                self.log().info("state.writes_caught_up", writes=self.what, pending=len(self.queue))
                self.late = False


class RequestLost(RuntimeError):
    """An acknowledged request (`ServiceProcess.acked_request`) whose acknowledgement, or
    whose answer after it, is overdue: lost on the bus, and safe to send again."""


class RequestInterrupted(RuntimeError):
    """The caller's event was set while its acknowledged request was out."""


class ServiceProcess:
    name = "service"
    redis_outage_wait_s = REDIS_OUTAGE_WAIT_S  # how long a Redis command waits out an outage before it fails

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        log = configure_logging(self.name, settings.log_format, settings.log_level)
        self.log = log.bind(server_id=settings.server_id) if self.per_server else log
        self.subjects = Subjects(settings.subject_prefix)
        self.keys = Keys(settings.key_prefix)
        self.clock = ScaledClock(settings.time_scale, settings.clock_epoch)
        self.catalog: Catalog = load_catalog(settings.catalog_path)
        self.lag = LagMonitor()
        self.nc: nats.NATS
        self.redis: aioredis.Redis
        self.call_records: CallRecords  # opened before setup() where `uses_call_records`
        self.metrics = Metrics()
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()

    per_server = True
    uses_call_records = False  # router, admission and engine-worker read or step the at-most-once record

    @property
    def instance(self) -> str:
        return self.settings.instance_name(self.name)

    async def setup(self) -> None:  # subscriptions
        raise NotImplementedError

    async def drain(self) -> None:
        """On SIGTERM, before the health endpoint and the subscriptions go: finish what
        must not be cut (a service whose work ends with the process does nothing)."""

    def spawn(self, coro: Awaitable[object], what: str, essential: bool = False) -> asyncio.Task:
        """A background task whose failure is logged, never silently lost. An `essential`
        one is a loop the process cannot serve without (its engine's clock, its token
        streamer): if it ever ends, the process exits for its supervisor to restart it,
        rather than answer health checks while its calls hang."""

        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                self.log.exception("task.failed", task=what, essential=essential)
            if essential:
                self.log.error("service.exiting", reason=f"its {what} task ended", exit_code=TASK_ENDED_EXIT_CODE)
                os._exit(TASK_ENDED_EXIT_CODE)

        t = asyncio.ensure_future(guarded())
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def reply_error(self, reply: str | None, code: str, message: str, call_id: str | None = None,
                          retry_after_s: float | None = None, to_agent: bool = True) -> None:
        """An error reply. `to_agent` false: it answers another service (admission's refusal
        to a router, which answers the agent; an engine's to admission, which sends again),
        so it is not counted as a failed call: each call's failure is counted once, by the
        service that tells its agent (`talaria_calls_failed_total` was twice the calls)."""
        # a hostile message can carry a near-1 MiB id or model name: never echo it whole (an error
        # reply over the bus's max payload would fail to send, and so would the request's answer)
        message = message if len(message) <= 2000 else message[:2000] + "..."
        call_id = call_id if call_id is None or len(call_id) <= 1024 else call_id[:1024]
        self.log.warning("request.rejected", code=code, reason=message, call_id=call_id)
        if call_id is not None and to_agent:
            self.metrics.calls_failed.labels(code=code).inc()
        if reply:
            await self.nc.publish(reply, encode(ApiError(code=code, message=message, call_id=call_id, retry_after_s=retry_after_s)))  # type: ignore[arg-type]

    def guarded_handler(self, handler: Callable[[Msg], Awaitable[None]], what: str) -> Callable[[Msg], Awaitable[None]]:
        """Wrap a subscription callback: a malformed message gets a typed error
        reply and a log line; nothing escapes to kill the subscription."""

        async def cb(msg: Msg) -> None:
            ctx = trace_context(msg)
            with structlog.contextvars.bound_contextvars(**ctx):
                try:
                    await handler(msg)
                except msgspec.ValidationError as exc:
                    await self.reply_error(msg.reply, "malformed", f"{what}: {exc}")
                except msgspec.DecodeError as exc:
                    await self.reply_error(msg.reply, "malformed", f"{what}: not a valid message ({exc})")
                except REDIS_AWAY as exc:
                    # Redis away (restarting, stopped): not this request's fault, and it passes
                    self.log.warning("handler.store_unavailable", handler=what, error=type(exc).__name__)
                    await self.reply_error(msg.reply, "unavailable", f"{what}: the session store (Redis) does not "
                                           f"answer ({type(exc).__name__}); retry shortly",
                                           retry_after_s=STORE_RETRY_AFTER_S)
                except Exception as exc:  # last resort: log, answer, keep serving
                    self.log.exception("handler.failed", handler=what)
                    await self.reply_error(msg.reply, "internal", f"{what}: {type(exc).__name__}")

        return cb

    def concurrent_handler(self, handler: Callable[[Msg], Awaitable[None]], what: str,
                           limit: int = CONCURRENT_HANDLER_LIMIT,
                           receipt: bytes | None = None,
                           on_taken: Callable[[Msg], Awaitable[None]] | None = None,
                           ) -> Callable[[Msg], Awaitable[None]]:
        """Like `guarded_handler`, but each message is handled in a task of its own:
        nats-py runs one subscription's callbacks one after another, so one request
        waiting on a dead peer (a submit to an admission killed mid-request waits out
        its timeout) held up every agent's call behind it. At most `limit` run at
        once; the next ones wait their turn in order, and beyond
        `CONCURRENT_HANDLER_BACKLOG` of those the subscription waits and NATS
        buffers (backpressure).
        `receipt`: published to the reply subject of a request that asks for it
        (`HEADER_RECEIPT`) as it is taken, before it waits for a slot: the agent's
        sign that a live process has its call. `on_taken`: called likewise for each
        message as it is taken (a command's own acknowledgement, say); with `limit=1`
        the messages are still handled one at a time, in order."""
        guarded = self.guarded_handler(handler, what)
        free = limit
        # taken and acknowledged, waiting for a slot: oldest first; beyond its bound the
        # subscription itself waits (and NATS buffers), so a receipt is never held up by
        # the slots until then
        backlog: deque[Msg] = deque()
        room = asyncio.Event()
        room.set()

        async def run(msg: Msg) -> None:
            nonlocal free
            try:
                await guarded(msg)
            finally:
                if backlog:
                    self.spawn(run(backlog.popleft()), what)  # the slot goes to the oldest waiting
                    room.set()
                else:
                    free += 1

        async def cb(msg: Msg) -> None:
            nonlocal free
            if receipt is not None and msg.reply and msg.headers and msg.headers.get(HEADER_RECEIPT):
                await self.nc.publish(msg.reply, receipt)
            if on_taken is not None:
                with contextlib.suppress(Exception):  # (the handler answers a bad message)
                    await on_taken(msg)
            if free > 0:
                free -= 1
                self.spawn(run(msg), what)
                return
            backlog.append(msg)
            if len(backlog) >= CONCURRENT_HANDLER_BACKLOG:
                room.clear()
                await room.wait()

        return cb

    async def acked_request(self, subject: str, payload: Callable[[str], bytes], *, timeout_s: float,
                            ack_wall_s: float, interrupt: asyncio.Event | None = None,
                            answer_within: Callable[[bytes], float | None] | None = None) -> Msg:
        """A request whose receiver says it has it on receipt, to the inbox that
        `payload(inbox)` names (its `ack_to`). Waits `ack_wall_s` wall seconds for that
        acknowledgement, then for the answer: `answer_within(ack)` wall seconds after
        each acknowledgement (None, or no `answer_within`: the rest of `timeout_s`).
        Returns the answer (the request's own error, a timeout or no responders, is
        raised as it is); raises `RequestLost` when an acknowledgement or an answer is
        overdue, `RequestInterrupted` when `interrupt` is set first. A request lost
        with a NATS node is so noticed within a second, not at its timeout. The
        admission's switch requests and the substrate's Sleep/Wake use it."""
        acks: asyncio.Queue[bytes] = asyncio.Queue()
        inbox = self.nc.new_inbox()

        async def on_ack(msg: Msg) -> None:
            acks.put_nowait(msg.data)

        sub = await self.nc.subscribe(inbox, cb=on_ack)
        ask = asyncio.ensure_future(self.nc.request(subject, payload(inbox), timeout=timeout_s))
        stop = asyncio.ensure_future(interrupt.wait()) if interrupt is not None else None
        heard: asyncio.Future[bytes] | None = None
        deadline = time.monotonic() + ack_wall_s
        try:
            while True:
                heard = asyncio.ensure_future(acks.get())
                await asyncio.wait([f for f in (ask, stop, heard) if f is not None],
                                   timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED)
                if ask.done():
                    return ask.result()
                if stop is not None and stop.done():
                    raise RequestInterrupted(f"interrupted while waiting on {subject}")
                if not heard.done():
                    raise RequestLost(f"no word on {subject} in time: the request or its answer was lost")
                within = answer_within(heard.result()) if answer_within is not None else None
                deadline = time.monotonic() + (timeout_s if within is None else within)
        finally:
            for f in (ask, stop, heard):
                if f is not None and not f.done():
                    f.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def engine_states(self, models: list[str], query: ListCalls) -> dict[str, EngineState | str]:
        """Each of this server's engine-workers' state (ListCalls), asked all at once, so
        a hung engine costs one timeout, not one per model after it: model -> its
        EngineState, or why there is none (down, hung, refusing). What a restarted
        admission or substrate rebuilds from (awake or not, the calls it runs)."""
        async def ask(m: str) -> EngineState | str:
            try:
                resp = await self.nc.request(self.subjects.engine_control(self.settings.server_id, m), encode(query),
                                             timeout=LIST_CALLS_TIMEOUT_WALL_S)
                st = engine_state_decoder.decode(resp.data)
            except Exception as exc:  # down or hung: it announces itself when back
                return type(exc).__name__
            return st if isinstance(st, EngineState) else f"{st.code}: {st.message}"

        return dict(zip(models, await asyncio.gather(*(ask(m) for m in models))))

    async def _lag_reporter(self) -> None:
        counted_stalls_s = 0.0
        while True:
            await asyncio.sleep(LAG_REPORT_WALL_S)
            counted_stalls_s = self.metrics.report_lag(self.lag, counted_stalls_s)
            with contextlib.suppress(Exception):
                # one round trip, the stalls first: a reader waits for the worst's report, then reads both
                pipe = self.redis.pipeline(transaction=False)
                pipe.set(self.keys.stalled(self.instance), f"{counted_stalls_s:.4f}", ex=3600)
                pipe.set(self.keys.lag(self.instance), f"{self.lag.worst_s:.4f}", ex=3600)
                await pipe.execute()
                self.redis_answered_at = time.monotonic()  # (the report is also this process's Redis probe)

    def _report_dependencies(self) -> None:
        """`talaria_dependency_up` as each scrape finds it: NATS by the connection's state,
        Redis by this process's once-a-second lag report (a stalled Redis holds the report,
        so it reads 0 after REDIS_UP_WITHIN_S)."""
        self.redis_answered_at = time.monotonic()
        up = self.metrics.dependency_up
        up.labels("nats").set_function(lambda: float(self.nc.is_connected))
        up.labels("redis").set_function(lambda: float(time.monotonic() - self.redis_answered_at < REDIS_UP_WITHIN_S))

    async def run(self) -> None:
        self.nc = await connect_nats(self.settings.nats_urls, self.instance, self.log,
                                     self.settings.nats_user, self.settings.nats_password)
        # a Redis restart or stall (seconds) is waited out command by command, not turned into
        # errors; past REDIS_OUTAGE_WAIT_S the command fails and its request hears `unavailable`.
        # A bounded pool that waits for a free connection: requests handled side by side
        # (concurrent_handler) would otherwise open more than redis-py's default pool
        # allows, and it refuses the rest (MaxConnectionsError, seen at 200 calls/s)
        # (a Sentinel-watched master's failover is waited out the same way: shared/redis_client.py)
        self.redis = open_redis(
            self.settings.redis_url, max_connections=REDIS_POOL_CONNECTIONS, pool_wait_s=REDIS_POOL_WAIT_S,
            health_check_interval=10, socket_timeout=REDIS_SOCKET_TIMEOUT_S, **self.settings.redis_credentials(),
            retry=BoundedRetry(ExponentialBackoff(cap=0.5, base=0.05), retries=30, budget_s=self.redis_outage_wait_s),
            retry_on_error=list(REDIS_AWAY))
        svc = await add_service(self.nc, ServiceConfig(name=f"talaria-{self.name}", version=VERSION,
                                                       description=f"Talaria {self.name}", metadata={
                                                           "instance": self.instance,
                                                           # (`talaria status` tells deployments sharing a NATS apart)
                                                           "subject_prefix": self.settings.subject_prefix}))

        # alive from here on (any answer: the liveness watch); "ok" only once set up and serving
        # (readiness: a restarted admission is "starting" while it recovers its calls)
        ready = asyncio.Event()

        async def health(req) -> None:  # type: ignore[no-untyped-def]
            await req.respond(HEALTH_OK if ready.is_set() else HEALTH_STARTING)

        await svc.add_endpoint(EndpointConfig(name="health", handler=health, subject=self.subjects.health(self.instance)))
        self.metrics.serve(self.settings.metrics_port, self.settings.metrics_host)
        tracing.configure(self.name, self.settings.otlp_endpoint)
        self.spawn(self.lag.run(), "lag-monitor")
        self._report_dependencies()
        self.spawn(self._lag_reporter(), "lag-reporter")
        self.spawn(rotate_logs(self.settings.log_max_bytes, self.settings.log_keep), "log-rotation")
        if self.uses_call_records:
            self.call_records = await CallRecords.open(self.nc, self.settings.subject_prefix,
                                                       replicas=self.settings.call_record_replicas, ttl_s=CALL_TTL_S,
                                                       max_bytes=self.settings.call_record_max_bytes)
        try:
            await check_target(self.redis, self.settings.redis_url)
        except RedisUrlError as exc:  # a deployment error: a restart would not mend it
            self.log.error("service.redis_unsupported", error=str(exc))
            raise SystemExit(78) from None
        await self.setup()
        ready.set()
        if self.settings.loop_stall_exit_s > 0:  # armed after start-up (a real engine blocks while it loads)
            start_loop_watchdog(self.lag, self.settings.loop_stall_exit_s, self.instance)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        self.log.info("service.started", instance=self.instance, time_scale=self.settings.time_scale,
                      policy=self.settings.policy.name)
        await self._stop.wait()
        self.log.info("service.stopping")
        try:
            await self.drain()
        except Exception:  # noqa: BLE001 - a drain that failed still stops
            self.log.exception("service.drain_failed")
        with contextlib.suppress(Exception):
            tracing.shutdown()
        with contextlib.suppress(Exception):
            await svc.stop()
        with contextlib.suppress(Exception):
            await self.nc.drain()
        for t in list(self._tasks):
            t.cancel()
        with contextlib.suppress(Exception):
            await self.redis.aclose()


def run_service(make: Callable[[Settings], ServiceProcess], argv: list[str] | None = None,
                settings: Settings | None = None) -> None:
    """A service's entry point: its settings (flags over TALARIA_* variables), then its loop."""
    if settings is None:
        settings = Settings.from_env_or_exit(argv if argv is not None else sys.argv[1:])
    run_loop(make(settings).run())


def run_loop(main: Awaitable[None]) -> None:
    """Run a process's main coroutine on uvloop where it is installed."""
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is optional off Linux
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main)  # type: ignore[arg-type]
