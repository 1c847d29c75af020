"""Each service as a real subprocess over a real NATS and Redis (the session fixtures).

Services are started with `talaria.ops.processes.ProcessGroup` (`python -m services.<name>`,
configured only through TALARIA_* environment variables) and are healthy once
`<prefix>.health.<instance>` answers. Time runs 100x faster than the wall clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import signal
import time
import uuid
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
import pytest
import redis.asyncio as aioredis
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from polling import until
from services.router.placement import InFlight, InFlightPlacements
from services.router.service import PLACE_SCRIPT, Router
from shared import state
from shared.call_record import CallRecords
from shared.keys import CALL_TTL_S, Keys
from shared.settings import Settings
from shared.logs import read_log_events
from shared.schema import (
    EngineHint, EnginePayload,
    MAX_MESSAGE_BYTES, ApiError, CallAccepted, CallQueued, CallReply, CallRunning, api_reply_decoder,
    call_event_decoder, encode, CallRequest, CancelCall, PromptRef,
)
from shared.prompt_store import PromptStore, object_name
from shared.subjects import AGENT_NAMESPACE, GATEWAY_NAMESPACE, Subjects
from talaria.client import (
    ContextLimit, Malformed, TalariaClient, UnknownModel, UnknownSession,
)
from talaria.ops.nats_server import NatsServer
from talaria.ops.processes import ProcessGroup
from talaria.ops.redis_server import RedisServer
from talaria.ops.sessionlog import session_lines, summarize_calls

ROOT = Path(__file__).resolve().parents[1]
SERVER = "s0"
MODEL_A = "glm-4.5-air-fp8"   # small, quick to switch in
MODEL_B = "glm-4.5-fp8"
MODELS = [MODEL_A, MODEL_B]
TIME_SCALE = 100.0
HEALTH_TIMEOUT_S = 45.0       # 2-core box: five Python processes importing at once
pytestmark = pytest.mark.timeout(150)
TYPED_CODES = {"malformed", "unknown_model", "unknown_session", "context_limit", "too_large"}


# -- helpers ------------------------------------------------------------------------------
class Services:
    """router, admission, substrate and engine-workers as processes in one ProcessGroup."""

    def __init__(self, nats_url: str, redis_url: str, subject_prefix: str, key_prefix: str, log_dir: Path,
                 *, models: list[str] = MODELS, which: tuple[str, ...] = ("router", "admission", "substrate", "engine"),
                 policy: str = "baseline", extra_env: dict[str, str] | None = None) -> None:
        self.nats_url = nats_url
        self.redis_url = redis_url
        self.subject_prefix = subject_prefix
        self.key_prefix = key_prefix
        self.log_dir = log_dir
        self.models = list(models)
        self.subjects = Subjects(subject_prefix)
        self.group = ProcessGroup()
        self.router_id = uuid.uuid4().hex[:6]
        base = {
            "TALARIA_NATS_URL": nats_url,
            "TALARIA_REDIS_URL": redis_url,
            "TALARIA_SUBJECT_PREFIX": subject_prefix,
            "TALARIA_KEY_PREFIX": key_prefix,
            "TALARIA_TIME_SCALE": repr(TIME_SCALE),
            "TALARIA_CLOCK_EPOCH": repr(time.time()),
            "TALARIA_POLICY": policy,
            "TALARIA_SERVERS": SERVER,
            "TALARIA_MODELS": ",".join(self.models),
            "TALARIA_SERVER_ID": SERVER,
            "TALARIA_HEARTBEAT_WALL_S": "0.05",
            # every Services of the session shares one test NATS: each prompt store reserves its
            # bound there, and at the default 1 GiB each the server ran out of storage to reserve
            "TALARIA_PROMPT_STORE_MAX_BYTES": str(64 * 2**20),
            "TALARIA_CALL_RECORD_MAX_BYTES": str(64 * 2**20),  # (the same for the call record's bound)
            "TALARIA_LOG_FORMAT": "json",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
            **(extra_env or {}),
        }
        table: list[tuple[str, str, dict[str, str]]] = []
        if "router" in which:
            table.append((f"router-{self.router_id}", "services.router", {"TALARIA_INSTANCE_ID": self.router_id}))
        if "admission" in which:
            table.append((f"admission-{SERVER}", "services.admission", {}))
        if "substrate" in which:
            table.append((f"substrate-{SERVER}", "services.substrate", {}))
        if "engine" in which:
            for m in self.models:
                table.append((f"engine-{SERVER}-{m}", "services.engine", {"TALARIA_MODEL": m}))
        self.names = [name for name, _, _ in table]
        for name, module, extra in table:
            self.group.add(name, [sys.executable, "-m", module], env={**base, **extra}, log_path=log_dir / f"{name}.log")

    @property
    def router(self) -> str:
        return f"router-{self.router_id}"

    @property
    def admission(self) -> str:
        return f"admission-{SERVER}"

    @property
    def substrate(self) -> str:
        return f"substrate-{SERVER}"

    def engine(self, model: str) -> str:
        return f"engine-{SERVER}-{model}"

    async def start(self) -> None:
        self.group.start_all()
        await self.wait_healthy()

    async def wait_healthy(self, names: list[str] | None = None, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        nc = await nats.connect(self.nats_url, connect_timeout=5)
        try:
            for name in names or self.names:
                await health(nc, self.subject_prefix, name, timeout_s, self)
        finally:
            await nc.close()

    async def restart(self, name: str) -> None:
        await asyncio.to_thread(self.group.restart, name, 10.0)
        await self.wait_healthy([name])

    async def stop(self) -> None:
        await self.group.astop_all(timeout=10)

    def log_lines(self, name: str) -> list[dict[str, Any]]:
        return read_log_events(self.log_dir / f"{name}.log")

    def log_tail(self, name: str, n: int = 20) -> str:
        p = self.log_dir / f"{name}.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-n:]) if p.exists() else "(no log)"


async def health(nc: NATS, prefix: str, instance: str, timeout_s: float = 10.0, svc: Services | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            resp = await nc.request(f"{prefix}.health.{instance}", b"", timeout=0.5)
            assert json.loads(resp.data) == {"status": "ok"}
            return
        except Exception:
            if svc is not None and instance in svc.group.children and not svc.group.running(instance):
                raise AssertionError(f"{instance} exited:\n{svc.log_tail(instance)}") from None
            if time.monotonic() > deadline:
                tail = svc.log_tail(instance) if svc is not None else ""
                raise AssertionError(f"{instance} not healthy in {timeout_s:.0f} s\n{tail}") from None
            await asyncio.sleep(0.1)


async def request_error(nc: NATS, subject: str, payload: bytes, timeout: float = 5.0) -> ApiError:
    resp = await nc.request(subject, payload, timeout=timeout)
    out = api_reply_decoder.decode(resp.data)
    assert isinstance(out, ApiError), f"{subject} answered {out!r} to {payload[:120]!r}"
    return out


def agent_inbox(nc: NATS, subjects: Subjects) -> str:
    """A fresh reply subject in the agents' namespace (the router answers a call only there)."""
    return f"{subjects.reply_namespace(AGENT_NAMESPACE)}.t{nc.new_inbox().rsplit('.', 1)[-1]}"


async def call_raw(nc: NATS, subjects: Subjects, req: CallRequest, timeout: float = 5.0) -> Any:
    """Publish a call with a fresh reply subject; return the first event."""
    inbox = agent_inbox(nc, subjects)
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(subjects.api_call(), encode(msgspec.structs.replace(req, reply_to=inbox)))
        msg = await sub.next_msg(timeout=timeout)
        return call_event_decoder.decode(msg.data)
    finally:
        await sub.unsubscribe()


async def call_until(nc: NATS, subjects: Subjects, req: CallRequest, timeout_s: float,
                     events: list[Any] | None = None) -> CallReply:
    """Make a call by hand and wait for its reply with a deadline, never by cancelling a wait.

    (Cancelling a `next_msg` while heartbeats stream in can be swallowed on Python 3.11, whose
    `asyncio.wait_for` loses a cancellation that races a completion; a lost call then hangs.)
    """
    inbox = agent_inbox(nc, subjects)
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(subjects.api_call(), encode(msgspec.structs.replace(req, reply_to=inbox)))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                msg = await sub.next_msg(timeout=0.25)
            except nats.errors.TimeoutError:
                continue
            ev = call_event_decoder.decode(msg.data)
            if events is not None:
                events.append(ev)
            if isinstance(ev, CallReply):
                return ev
            if isinstance(ev, ApiError):
                raise AssertionError(f"call {req.call_id} failed: {ev}")
        raise TimeoutError(f"call {req.call_id}: no reply in {timeout_s} s (last events {events[-3:] if events else []})")
    finally:
        await sub.unsubscribe()


async def keys_under(r: aioredis.Redis, prefix: str) -> set[str]:
    return {k.decode() async for k in r.scan_iter(match=f"{prefix}*")}


def _j(obj: Any) -> bytes:
    return json.dumps(obj).encode()


# -- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
async def stack(nats_server: NatsServer, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory):
    """All four services, shared by the tests that leave them in a sane state."""
    svc = Services(nats_server.url, redis_server.url, f"t{uuid.uuid4().hex[:8]}", f"t-{uuid.uuid4().hex[:8]}:",
                   tmp_path_factory.mktemp("svc-logs"))
    try:
        await svc.start()
        yield svc
    finally:
        await svc.stop()


@pytest.fixture
async def client(stack: Services, nats_server: NatsServer):
    c = await TalariaClient.connect(nats_server.url, subject_prefix=stack.subject_prefix, silence_s=10.0, retries=1)
    yield c
    await c.close()


# -- bad input ---------------------------------------------------------------------------
COMMON_BAD = [
    b"\xff\x00" + os.urandom(62),                     # random bytes, never valid UTF-8/JSON
    b"",                                              # empty
    b"{}",                                            # no tag
    b"[1, 2, 3]",
    b"null",
    b'{"type": "definitely-not-a-type"}',             # unknown tag
    b'{"type": 7}',
    b'{"type": "call", "call_id": ',                  # truncated JSON
]


def _admission_call(**over: Any) -> dict[str, Any]:
    c = {"call_id": "bad-1", "session_id": "bad-s", "model": MODEL_A, "prompt_tokens": 100, "prefix_tokens": 0,
         "max_tokens": 10, "arrived_at": 0.0, "continuation": False}
    c.update(over)
    return c


def _run(call: dict[str, Any] | None = None, sim_output_tokens: Any = 5, **over: Any) -> dict[str, Any]:
    r = {"type": "run", "call": _admission_call(**(call or {})), "engine": {"hint": {"sim_output_tokens": sim_output_tokens}},
         "reserved_tokens": 110, "reply_to": "x.y", "waited_s": 0.0, "switch_wait_s": 0.0, "round_wait": False}
    r.update(over)
    return r


def _api_call(**over: Any) -> dict[str, Any]:
    c = {"type": "call", "call_id": "bad-1", "session_id": "bad-s", "model": MODEL_A, "prompt_tokens": 100}
    c.update(over)
    return c


def bad_inputs(s: Subjects, model: str) -> dict[str, list[bytes]]:
    router = COMMON_BAD + [
        _j(_api_call(call_id=7)),                              # wrong type
        _j(_api_call(prompt_tokens="lots")),
        _j(_api_call(prompt_tokens=-5)),                       # negative token counts
        _j(_api_call(prefix_tokens=-1, prompt_tokens=10)),
        _j(_api_call(max_tokens=-100)),
        _j(_api_call(prompt_tokens=0)),
        _j(_api_call(engine_hint={"sim_output_tokens": -3})),
        _j(_api_call(call_id="")),
        _j({"type": "call"}),                                  # missing fields
        _j({"type": "open_session", "session_id": ["x"], "model": 1}),
        _j({"type": "open_session", "session_id": "x"}),
        _j({"type": "end_session", "session_id": None}),
        _j({"type": "info", "x": 1, "type2": []}) + b"garbage",
    ]
    admission = COMMON_BAD + [
        _j({"type": "submit", "call": "nope", "reply_to": 1}),
        _j({"type": "submit", "call": _admission_call(prompt_tokens="x"), "reply_to": "a.b"}),
        _j({"type": "submit", "call": _admission_call(prompt_tokens=-5), "reply_to": "a.b"}),
        _j({"type": "submit", "call": _admission_call(max_tokens=-1), "reply_to": "a.b"}),
        _j({"type": "submit", "call": _admission_call(prefix_tokens=-10), "reply_to": "a.b"}),
        _j({"type": "submit", "call": _admission_call(), "reply_to": "a.b", "engine": {"hint": {"sim_output_tokens": -4}}}),
        _j({"type": "submit", "call": _admission_call(model="no-such-model"), "reply_to": "a.b"}),  # unknown_model
        _j({"type": "submit"}),
    ]
    substrate = COMMON_BAD + [
        _j({"type": "switch", "from_model": 1, "to_model": None}),
        _j({"type": "switch", "from_model": None}),
        _j({"type": "switch", "from_model": None, "to_model": "no-such-model"}),  # unknown_model
        _j({"type": "stage", "model": 5}),
        _j({"type": "stage"}),
    ]
    run = COMMON_BAD + [
        _j(_run(call={"prompt_tokens": "x"})),
        _j(_run(call={"prompt_tokens": -5})),
        _j(_run(sim_output_tokens=-1)),
        _j(_run(reserved_tokens=-1000)),
        _j(_run(call={"max_tokens": 0})),
        _j(_run(round_wait="maybe")),
        _j({"type": "run"}),
        _j({"type": "sleep"}),                                 # a control message on the run subject
    ]
    control = COMMON_BAD + [
        _j({"type": "wake", "kv_capacity_tokens": "lots"}),
        _j({"type": "wake", "kv_capacity_tokens": -100}),      # negative token count
        _j({"type": "wake", "kv_capacity_tokens": 10, "host_kv": {"s": -5}}),
        _j({"type": "abort", "call_id": 5}),
        _j({"type": "protect", "session_id": "x", "on": "yes"}),
        _j(_run()),                                            # a run on the control subject
    ]
    return {
        s.api_call(): router, s.api_session_open(): router, s.api_session_end(): router, s.api_info: router,
        s.admission_submit(SERVER): admission,
        s.substrate_switch(SERVER): substrate, s.substrate_stage(SERVER): substrate,
        s.engine_run(SERVER, model): run, s.engine_control(SERVER, model): control,
    }


async def test_router_replicas_never_place_on_the_same_snapshot(redis_client: aioredis.Redis) -> None:
    """The placement compare-and-set (docs/deploy.md, several routers): two
    replicas that ranked on the same snapshot race to record their placements;
    one lands, the other reads again and then sees the first in flight."""
    keys = Keys(f"tpl{uuid.uuid4().hex[:6]}:")
    place = redis_client.register_script(PLACE_SCRIPT)
    first, second = InFlight("c1", MODEL_A, 1_000, time.time()), InFlight("c2", MODEL_A, 2_000, time.time())

    async def land(call: InFlight, seq: str, router: str = "router-0", counted: tuple[str, ...] = ()) -> int:
        return int(await place(keys=[keys.placements(), keys.in_flight(SERVER), keys.placement_log()],
                               args=[seq, call.call_id, call.encode(), 60, f"{router} {call.call_id}",
                                     *(f"{router} {c}" for c in counted)]))

    seq = (await redis_client.get(keys.placements()) or b"0").decode()
    assert sorted(await asyncio.gather(land(first, seq), land(second, seq))) == [0, 1]
    held = await redis_client.hgetall(keys.in_flight(SERVER))
    assert len(held) == 1
    winner = InFlight.decode(*(x.decode() for x in next(iter(held.items()))))
    assert winner is not None and winner.call_id in ("c1", "c2")
    loser = second if winner.call_id == first.call_id else first
    # the loser's next snapshot holds the winner, and with its sequence it lands
    seq = (await redis_client.get(keys.placements())).decode()
    assert seq == "1" and await land(loser, seq) == 1
    assert {k.decode() for k in await redis_client.hgetall(keys.in_flight(SERVER))} == {"c1", "c2"}
    # a stale sequence never lands; '' (a fallback candidate, or the last attempt) always does
    third = InFlight("c3", MODEL_B, 10, time.time())
    assert await land(third, "1") == 0
    assert await land(third, "") == 1
    assert (await redis_client.get(keys.placements())) == b"3"
    assert await redis_client.ttl(keys.in_flight(SERVER)) > 0
    # placements since the snapshot that the ranking counted (the router's own) do not refuse
    # it; one it did not count (another replica's, or its own it did not know of) does
    own, other = InFlight("c4", MODEL_A, 10, time.time()), InFlight("c5", MODEL_A, 10, time.time())
    assert await land(own, "3") == 1
    assert await land(InFlight("c6", MODEL_A, 10, time.time()), "3", counted=("c4",)) == 1
    assert await land(other, "5", router="router-1") == 1
    assert await land(InFlight("c7", MODEL_A, 10, time.time()), "3", counted=("c4", "c6")) == 0
    assert await land(InFlight("c8", MODEL_A, 10, time.time()), "5", counted=("c4", "c6")) == 0
    assert await land(InFlight("c9", MODEL_A, 10, time.time()), "6") == 1


async def test_a_routers_placements_are_written_in_their_order_a_batch_a_round_trip(redis_client: aioredis.Redis,
                                                                                   service_logging: None) -> None:
    """Placements queued while a write is in flight go in one pipeline, in the order they
    were ranked, so each one that counted an earlier one of this router's finds it in the
    log before it and lands; another replica's placement since the snapshot still refuses."""
    router = Router(Settings(key_prefix=f"tpw{uuid.uuid4().hex[:6]}:"))
    router.redis = redis_client
    router.in_flight = InFlightPlacements(max_age=60.0)
    router.start_placement_writes()
    keys = router.keys
    seq = (await redis_client.get(keys.placements()) or b"0").decode()
    calls = [InFlight(f"c{i}", MODEL_A, 100, time.time()) for i in range(20)]
    pipelines: list[int] = []
    execute = redis_client.pipeline(transaction=False).__class__.execute

    async def counting(pipe: Any, *args: Any, **kw: Any) -> Any:
        pipelines.append(len(pipe.command_stack))
        return await execute(pipe, *args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(redis_client.pipeline(transaction=False)), "execute", counting)
        # every call ranked on the same snapshot, each counting the ones before it
        landed = [router._queue_placement(SERVER, c, expect_seq=seq, counted=[x.call_id for x in calls[:i]])
                  for i, c in enumerate(calls)]
        assert all(await asyncio.gather(*landed))
        assert sum(pipelines) == len(calls) and len(pipelines) < len(calls)  # batched, not a round trip each
    log = [x.decode() for x in await redis_client.lrange(keys.placement_log(), 0, -1)]
    assert log == [router._token(c.call_id) for c in calls]
    assert {k.decode() for k in await redis_client.hgetall(keys.in_flight(SERVER))} == {c.call_id for c in calls}
    # another replica places; a call ranked on the old snapshot is refused and uncounted here
    await redis_client.incr(keys.placements())
    await redis_client.rpush(keys.placement_log(), "router-9 x1")
    late = InFlight("late", MODEL_A, 100, time.time())
    assert not await router._queue_placement(SERVER, late, expect_seq=str(int(seq) + len(calls)),
                                             counted=[c.call_id for c in calls])
    assert "late" not in router.in_flight.own.get(SERVER, {})
    assert await router.mark_in_flight(SERVER, late)  # unconditionally (the last attempt) it lands


async def test_the_servers_snapshot_is_one_command_that_reads_what_the_pipeline_read(redis_client: aioredis.Redis,
                                                                                    service_logging: None) -> None:
    """The router reads every server's in-flight hash and mirror with one script call,
    and decodes what a GET and an HGETALL per hash gave (less the mirror's counters,
    which placement does not read); a Redis that lost its scripts (restarted empty) is
    answered after loading the script again."""
    router = Router(Settings(key_prefix=f"tsn{uuid.uuid4().hex[:6]}:", servers=["s0", "s1", "s2"]))
    router.redis = redis_client
    router.in_flight = InFlightPlacements(max_age=60.0)
    router.start_placement_writes()
    keys = router.keys
    await redis_client.set(keys.placements(), "7")
    await redis_client.hset(keys.in_flight("s0"), mapping={"c1": "a", "c2": "b"})
    pipe = redis_client.pipeline(transaction=True)
    state.write_server_load(pipe, keys, "s0", state.ServerLoad(active=MODEL_A, queued=3, live_models=frozenset({MODEL_A})))
    state.write_substrate_view(pipe, keys, "s0", state.SubstrateView(resident=MODEL_A, staged=MODEL_B))
    state.add_counters(pipe, keys, "s0", {"switches": 4})
    state.write_server_load(pipe, keys, "s2", state.ServerLoad(active=MODEL_B))  # s1: nothing mirrored yet
    await pipe.execute()
    in_flight = [await redis_client.hgetall(keys.in_flight(s)) for s in ("s0", "s1", "s2")]
    mirrors = [state.decode_server(await redis_client.hgetall(keys.server(s))) for s in ("s0", "s1", "s2")]
    assert mirrors[0].counters and mirrors[0].substrate.staged == MODEL_B
    commands: list[int] = []
    execute = redis_client.pipeline(transaction=False).__class__.execute

    async def counting(pipe: Any, *args: Any, **kw: Any) -> Any:
        commands.append(len(pipe.command_stack))
        return await execute(pipe, *args, **kw)

    for flushed in (False, True):
        if flushed:
            await redis_client.script_flush()
        pipe = redis_client.pipeline(transaction=False)
        pipe.get(keys.placements())  # another read before it, as on a call's first snapshot
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(type(pipe), "execute", counting)
            n = router._queue_server_reads(pipe)
            read, results = await router._execute_read(pipe)
        assert n == 7 and results[:2] == [b"7", b"7"] and commands[-1] == 2
        assert results[2::2] == in_flight
        for raw, full in zip(results[3::2], mirrors):
            got = state.decode_server(raw)
            assert (got.load, got.substrate, got.counters) == (full.load, full.substrate, {})
        router.in_flight.end_read(read)
    # an error of another read in the pipeline is raised, and the snapshot's read is closed
    pipe = redis_client.pipeline(transaction=False)
    pipe.hgetall(keys.placements())  # WRONGTYPE: a string
    router._queue_server_reads(pipe)
    with pytest.raises(aioredis.ResponseError):
        await router._execute_read(pipe)
    assert not router.in_flight.open_reads


async def test_bad_input_gets_typed_error_and_never_crashes(stack: Services, nc: NATS) -> None:
    failures: list[str] = []
    n = 0
    for model in stack.models:
        for subject, payloads in bad_inputs(stack.subjects, model).items():
            if model != stack.models[0] and ".engine." not in subject:
                continue  # the shared subjects once; every engine's
            for payload in payloads:
                n += 1
                try:
                    err = await request_error(nc, subject, payload)
                except Exception as exc:  # noqa: BLE001 - collect all, report together
                    failures.append(f"{subject} <- {payload[:100]!r}: {type(exc).__name__}: {exc}")
                    continue
                if err.code not in TYPED_CODES:
                    failures.append(f"{subject} <- {payload[:100]!r}: code {err.code} ({err.message})")
    assert not failures, f"{len(failures)}/{n} bad inputs not answered with a typed error:\n" + "\n".join(failures)
    for name in stack.names:
        assert stack.group.running(name), f"{name} died:\n{stack.log_tail(name)}"
        await health(nc, stack.subject_prefix, name, 5.0, stack)
    # the bad input was logged as a rejection, not as a crash
    adm = stack.log_lines(stack.admission)
    assert any(d.get("event") == "request.rejected" and d.get("code") == "malformed" for d in adm)
    for name in stack.names:
        assert not any(d.get("event") == "handler.failed" for d in stack.log_lines(name)), stack.log_tail(name)


async def test_malformed_call_with_reply_to_answers_on_the_request_reply(stack: Services, nc: NATS) -> None:
    # a call that does not validate cannot be trusted for its reply_to: the error goes to msg.reply
    err = await request_error(nc, stack.subjects.api_call(), _j(_api_call(prompt_tokens=-1, reply_to="x.nowhere")))
    assert err.code == "malformed" and "prompt_tokens" in err.message


# -- router validation -----------------------------------------------------------------------
async def test_router_rejections(stack: Services, nc: NATS, redis_client: aioredis.Redis, client: TalariaClient) -> None:
    s = stack.subjects
    before = {k for k in await keys_under(redis_client, stack.key_prefix) if ":lag:" not in k}
    sid = f"never-opened-{uuid.uuid4().hex[:6]}"
    cid = f"rejected-{uuid.uuid4().hex[:6]}"

    # unknown model: before any work, nothing written under the key prefix
    for model in ("no-such-model", "gpt-oss-120b"):  # not in the catalog / in the catalog but not served
        ev = await call_raw(nc, s, CallRequest(call_id=cid, session_id=sid, model=model, prompt_tokens=100))
        assert isinstance(ev, ApiError) and ev.code == "unknown_model", ev
        assert ev.call_id == cid
    with pytest.raises(UnknownModel) as unknown:
        await client.open_session("no-such-model")
    # it names what this deployment serves (a catalog model it does not would be refused next)
    assert "gpt-oss-120b" not in str(unknown.value) and MODEL_A in str(unknown.value), unknown.value
    # unknown session
    ev = await call_raw(nc, s, CallRequest(call_id=cid, session_id=sid, model=MODEL_A, prompt_tokens=100))
    assert isinstance(ev, ApiError) and ev.code == "unknown_session", ev
    with pytest.raises(UnknownSession):
        await client.call(sid, MODEL_A, prompt_tokens=100, call_id=cid)

    after = {k for k in await keys_under(redis_client, stack.key_prefix) if ":lag:" not in k}
    assert not {k for k in after - before if cid in k or sid in k}, after - before
    assert not any(cid in k or sid in k for k in after)

    # context limit, prefix >= prompt: on an open session
    sess = await client.open_session(MODEL_A)
    limit = sess.context_limit
    assert limit > 1000
    ev = await call_raw(nc, s, CallRequest(call_id=cid, session_id=sess.session_id, model=MODEL_A, prompt_tokens=limit))
    assert isinstance(ev, ApiError) and ev.code == "context_limit", ev
    with pytest.raises(ContextLimit):
        await sess.call(prompt_tokens=limit + 5000, call_id=cid)
    for prefix, prompt in ((100, 100), (101, 100)):
        ev = await call_raw(nc, s, CallRequest(call_id=cid, session_id=sess.session_id, model=MODEL_A,
                                               prompt_tokens=prompt, prefix_tokens=prefix))
        assert isinstance(ev, ApiError) and ev.code == "malformed" and "prefix" in ev.message, ev
    with pytest.raises(Malformed):
        await sess.call(prompt_tokens=100, prefix_tokens=100, call_id=cid)
    # a call open for another model
    ev = await call_raw(nc, s, CallRequest(call_id=cid, session_id=sess.session_id, model=MODEL_B, prompt_tokens=100))
    assert isinstance(ev, ApiError) and ev.code == "malformed", ev
    # none of the rejected calls was placed or answered
    records = await CallRecords.open(nc, stack.subject_prefix, replicas=1, ttl_s=CALL_TTL_S)
    assert await records.get(sess.session_id, cid) == (None, 0)
    assert [k async for k in redis_client.scan_iter(match=f"{stack.key_prefix}*{cid}*")] == []
    await health(nc, stack.subject_prefix, stack.router, 5.0, stack)


async def test_a_session_belongs_to_the_namespace_that_opened_it(stack: Services, nats_server: NatsServer,
                                                                  client: TalariaClient) -> None:
    """The gateway's sessions (all its HTTP tenants) and an agent's are apart, whatever the
    NATS permissions: an agent that names a gateway session's id cannot call on it, end it or
    open it again, nor send a call's reply into the gateway's inbox; a cancel under another
    namespace leaves the call running."""
    gw = await TalariaClient.connect(nats_server.url, subject_prefix=stack.subject_prefix, silence_s=10.0,
                                     retries=1, namespace=GATEWAY_NAMESPACE)
    try:
        theirs = await gw.open_session(MODEL_A, session_id=f"gw-{uuid.uuid4().hex[:6]}")
        with pytest.raises(UnknownSession):
            await client.call(theirs.session_id, MODEL_A, prompt_tokens=100, call_id="intruder#0")
        with pytest.raises(UnknownSession):
            await client.end_session(theirs.session_id)
        with pytest.raises(Malformed):
            await client.open_session(MODEL_A, session_id=theirs.session_id)
        # a call of the agent's own whose replies it would send into the gateway's inbox
        mine = await client.open_session(MODEL_A)
        nc = client.nc
        stray = f"{stack.subjects.reply_namespace(GATEWAY_NAMESPACE)}.x.y"
        resp = await nc.request(stack.subjects.api_call(), encode(CallRequest(
            call_id="stray#0", session_id=mine.session_id, model=MODEL_A, prompt_tokens=100, reply_to=stray)), timeout=5)
        err = api_reply_decoder.decode(resp.data)
        assert isinstance(err, ApiError) and err.code == "malformed" and "reply_to" in err.message, err
        # the gateway's session still works; a cancel from the agent's namespace does not stop its call
        running = asyncio.Event()
        task = asyncio.ensure_future(theirs.call(
            prompt_tokens=800, max_tokens=4000, call_id="theirs#0", sim_output_tokens=4000,
            on_event=lambda ev: running.set() if isinstance(ev, CallRunning) else None))
        await asyncio.wait_for(running.wait(), 30)
        await nc.publish(stack.subjects.call_cancel(), encode(CancelCall(call_id="theirs#0")))
        reply = await asyncio.wait_for(task, 60)
        assert reply.output_tokens == 4000 and not reply.aborted
        cancels = [d for d in stack.log_lines(stack.engine(MODEL_A))
                   if d.get("event", "").startswith("engine.cancel") and d.get("call_id") == "theirs#0"]
        assert cancels == [], cancels
        await theirs.end()
    finally:
        await gw.close()


async def test_a_large_prompt_goes_by_reference_and_is_deleted_after_the_reply(stack: Services, nc: NATS,
                                                                                 client: TalariaClient) -> None:
    """A 100k-token conversation as ids and text is over NATS's 1 MiB message limit: the
    client puts it in the prompt store, router and admission carry only its reference and
    counts, and the engine-worker deletes it once the call is answered."""
    ids = list(range(100_000))
    text = "word " * 100_000
    assert len(msgspec.json.encode({"t": text, "i": ids})) > 1024 * 1024
    submits: list[bytes] = []

    async def spy(msg: Any) -> None:
        submits.append(msg.data)

    sub = await nc.subscribe(stack.subjects.admission_submit("*"), cb=spy)
    try:
        sess = await client.open_session(MODEL_A)
        reply = await sess.call(prompt_tokens=100_000, max_tokens=16, prompt_token_ids=ids, prompt_text=text,
                                sim_output_tokens=8, call_id="big#0")
        assert reply.prompt_tokens == 100_000 and reply.output_tokens == 8
        assert submits and max(map(len, submits)) < 16 * 1024, [len(x) for x in submits]  # the reference only
        store = PromptStore(nc, stack.subject_prefix)
        ref = PromptRef(namespace=AGENT_NAMESPACE, name=object_name(sess.session_id, "big#0"))
        for _ in range(50):  # deleted right after the reply is published
            if await store.get(ref) is None:
                break
            await asyncio.sleep(0.1)
        assert await store.get(ref) is None, "the prompt was not deleted after its reply"
        # a small prompt still rides inline
        submits.clear()
        await sess.call(prompt_tokens=10, max_tokens=4, prompt_text="short prompt", sim_output_tokens=2)
        assert submits and all(b"short prompt" in x and b"prompt_ref" not in x for x in submits)
        await sess.end()
    finally:
        await sub.unsubscribe()


async def test_a_prompt_sent_by_reference_is_deleted_when_its_call_is_given_up(nc: NATS, stack: "Services",
                                                                                 client: TalariaClient) -> None:
    """An agent that gives up on a call (its caller cancelled it mid-run) deletes the prompt
    it put in the store: no engine answers it now to delete it, and a big prompt left for
    the store's age (6 h) filled it with abandoned streams (a soak probe: about 108 KB
    each). A retry puts it again."""
    text = "word " * 30_000
    sess = await client.open_session(MODEL_A)
    call = asyncio.ensure_future(sess.call(prompt_tokens=30_000, max_tokens=25_000, prompt_text=text,
                                           sim_output_tokens=20_000, call_id="gone#0"))
    store = PromptStore(nc, stack.subject_prefix)
    ref = PromptRef(namespace=AGENT_NAMESPACE, name=object_name(sess.session_id, "gone#0"))
    for _ in range(50):  # in the store while the call runs
        if await store.get(ref) is not None:
            break
        await asyncio.sleep(0.05)
    assert await store.get(ref) is not None
    await asyncio.sleep(0.5)
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await call
    for _ in range(50):
        if await store.get(ref) is None:
            break
        await asyncio.sleep(0.1)
    assert await store.get(ref) is None, "a given-up call's prompt stayed in the store"
    reply = await sess.call(prompt_tokens=30_000, max_tokens=16, prompt_text=text, sim_output_tokens=8,
                            call_id="gone#1")  # the session goes on
    assert reply.output_tokens == 8


async def test_a_full_prompt_store_refuses_at_once_as_no_capacity(nc: NATS, subject_prefix: str) -> None:
    """A namespace's bucket at its bound is an answer, not an outage: the put is refused at
    once and the agent told to send again shortly (429 at the front door). It had been
    waited out for the retry deadline (20 s) by every caller of the namespace, so one
    tenant's flood of large prompts held the others', then failed as internal (500)."""
    from shared.agent_client import NoCapacity
    from shared.prompt_store import FULL_RETRY_AFTER_S, PromptStoreFull
    from talaria.client import TalariaClient

    await PromptStore(nc, subject_prefix).create([AGENT_NAMESPACE], replicas=1, ttl_s=60, max_bytes=1024 * 1024)
    client = TalariaClient(nc, subject_prefix=subject_prefix)
    chunk = os.urandom(300 * 1024)
    for i in range(3):
        await client._put_prompt(f"p{i}", chunk)
    t0 = time.monotonic()
    with pytest.raises(PromptStoreFull):
        await PromptStore(nc, subject_prefix).put(AGENT_NAMESPACE, "over", chunk)
    with pytest.raises(NoCapacity) as refused:
        await client._put_prompt("over", chunk)
    assert time.monotonic() - t0 < 5.0, "a full store was waited out as if it were away"
    assert refused.value.code == "no_capacity" and refused.value.retry_after_s == FULL_RETRY_AFTER_S
    assert "full" in refused.value.message and "nats" not in refused.value.message.lower()
    await PromptStore(nc, subject_prefix).delete(PromptRef(namespace=AGENT_NAMESPACE, name="p0"))
    await client._put_prompt("over", chunk)  # taken once a call's prompt has gone


class BigNats(NatsServer):
    """A nats-server whose max_payload lets a message over the router's front-door limit through."""

    def render_config(self) -> str:
        return super().render_config() + f"max_payload: {8 * 1024 * 1024}\nmax_pending: {64 * 1024 * 1024}\n"


async def test_router_refuses_oversize_message(redis_server: RedisServer, tmp_path: Path,
                                               subject_prefix: str, key_prefix: str) -> None:
    # NATS's default max_payload (1 MiB) is below MAX_MESSAGE_BYTES (4 MiB), so over a default
    # server the client refuses first; a deployment that raises max_payload gets the router's check.
    big = BigNats(jetstream=True, store_dir=tmp_path / "js", log_file=tmp_path / "nats.log")
    await big.astart(timeout=30)
    svc = Services(big.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs", which=("router",))
    try:
        await svc.start()
        nc = await nats.connect(big.url, connect_timeout=5)
        try:
            assert nc.max_payload > MAX_MESSAGE_BYTES
            filler = "x" * (MAX_MESSAGE_BYTES + 1024)
            payload = encode(CallRequest(call_id="big", session_id="big", model=MODEL_A, prompt_tokens=10,
                                         prompt_text=filler))
            err = await request_error(nc, svc.subjects.api_call(), payload, timeout=10.0)
            assert err.code == "too_large", err
            await health(nc, subject_prefix, svc.router, 5.0, svc)
        finally:
            await nc.close()
    finally:
        await svc.stop()
        await big.astop()


# -- the client over all four services ---------------------------------------------------------
async def test_client_session_calls_cache_and_duplicates(stack: Services, client: TalariaClient,
                                                         redis_client: aioredis.Redis) -> None:
    info = await client.info()
    assert info.policy == "baseline" and info.time_scale == TIME_SCALE and set(info.models) == set(MODELS)

    sess = await client.open_session(MODEL_A)
    events: list[Any] = []
    out1 = 800
    r1 = await sess.call(prompt_tokens=6000, max_tokens=2048, sim_output_tokens=out1, call_id=f"{sess.session_id}-c1",
                         on_event=events.append)
    assert isinstance(r1, CallReply)
    assert r1.output_tokens == out1 and r1.session_id == sess.session_id and r1.model == MODEL_A
    assert r1.cached_tokens == 0 and not r1.duplicate
    assert r1.finished_at > r1.arrived_at
    assert any(isinstance(e, CallRunning) for e in events), events
    assert any(isinstance(e, CallAccepted) for e in events), events

    # the second call of the session reuses its prefix
    prefix = 6000 + out1
    r2 = await sess.call(prompt_tokens=prefix + 500, prefix_tokens=prefix, max_tokens=1024, sim_output_tokens=50,
                         call_id=f"{sess.session_id}-c2")
    assert r2.output_tokens == 50
    assert r2.cached_tokens > 0, r2
    assert r2.cached_tokens <= prefix

    # the same call id again: the same reply, marked duplicate, no second generation
    dup = await sess.call(prompt_tokens=prefix + 500, prefix_tokens=prefix, max_tokens=1024, sim_output_tokens=50,
                          call_id=f"{sess.session_id}-c2")
    assert dup.duplicate is True
    assert msgspec.structs.replace(dup, duplicate=False) == r2
    await asyncio.sleep(0.3)  # let any (wrong) second generation show up in the log
    cid = f"{sess.session_id}-c2"
    eng = stack.log_lines(stack.engine(MODEL_A))
    assert sum(1 for d in eng if d.get("event") == "engine.started" and d.get("call_id") == cid) == 1
    assert sum(1 for d in eng if d.get("event") == "engine.finished" and d.get("call_id") == cid) == 1
    outputs = await redis_client.lrange(f"{stack.key_prefix}session:{sess.session_id}:outputs", 0, -1)
    assert [int(x) for x in outputs] == [out1, 50]
    await sess.end()


@pytest.mark.timeout(60)
async def test_kv_reported_after_its_sessions_release_is_released_when_the_release_settles(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path, redis_client: aioredis.Redis) -> None:
    """An engine's spill of a session's KV that lands at the substrate after the session's
    release (the engine spilled before it heard the release) is booked in host memory,
    then released once the release has settled; before, it stayed booked for good."""
    from shared.schema import KvSpilled, SessionReleased
    from shared.state import decode_server

    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs",
                   models=[MODEL_A], which=("substrate",), policy="talaria")
    await svc.start()
    nc = NATS()
    await nc.connect(nats_server.url)
    key = Keys(key_prefix).server(SERVER)

    async def host_kv_gb() -> float:
        return decode_server(await redis_client.hgetall(key)).substrate.host_kv_gb

    try:
        await nc.publish(svc.subjects.session_released, encode(SessionReleased(session_id="gone", reason="idle",
                                                                               server_id=SERVER)))
        await nc.publish(svc.subjects.kv_spilled(SERVER), encode(KvSpilled(server_id=SERVER, model=MODEL_A,
                                                                           sessions={"gone": 100_000})))
        def said(event: str) -> list[dict[str, Any]]:
            return [d for d in svc.log_lines(svc.substrate) if d.get("event") == event]

        await until(lambda: said("substrate.kv_spilled"), 5.0, "the late spill was not heard")
        assert said("substrate.kv_spilled")[0]["host_kv_gb"] > 1.0  # booked, the release before it
        await until(lambda: said("substrate.released_kv_dropped"), 15.0, "the late spill stayed booked")
        assert said("substrate.released_kv_dropped")[0]["host_kv_gb"] == 0.0
        await until(lambda: _is_zero(host_kv_gb()), 5.0, "the view still books it")
    finally:
        await nc.close()
        await svc.stop()


async def _is_zero(value: Awaitable[float]) -> bool:
    return await value == 0.0


async def test_a_sessions_decision_history_keeps_what_decisions_read(stack: Services, client: TalariaClient,
                                                                        redis_client: aioredis.Redis) -> None:
    """A session's tool gaps and outputs in Redis are the last DECISION_HISTORY, all a
    decision reads: a long-lived session's lists grew by one entry a call for as long as
    it kept coming back (a soak probe: 213 each), its TTL renewed every call."""
    from shared.policy import DECISION_HISTORY

    sess = await client.open_session(MODEL_A)
    for i in range(DECISION_HISTORY + 4):
        await sess.call(prompt_tokens=100 + 10 * i, prefix_tokens=0, max_tokens=8, sim_output_tokens=1 + i % 5)
    key = f"{stack.key_prefix}session:{sess.session_id}"
    outputs = [int(x) for x in await redis_client.lrange(f"{key}:outputs", 0, -1)]
    assert outputs == [1 + i % 5 for i in range(4, DECISION_HISTORY + 4)]
    assert await redis_client.llen(f"{key}:gaps") == DECISION_HISTORY
    await sess.end()


async def test_a_call_records_its_server_before_the_submit_and_the_engine_claims_without_a_read(
        stack: Services, client: TalariaClient, nc: NATS) -> None:
    """The call record's path of one call: the router's create and its placement
    (written before the submit, so the engine's claim never races it), the engine's
    claim on the revision the run carries and its answer; no read of the record."""
    from shared.call_record import record_key

    sess = await client.open_session(MODEL_A)
    cid = f"{sess.session_id}-c1"
    bucket = stack.subjects.call_record_bucket
    writes: list[bytes] = []
    reads: list[str] = []
    key_subject = f"$KV.{bucket}.{record_key(sess.session_id, cid)}"

    async def on_write(m: Msg) -> None:
        writes.append(m.data)

    async def on_read(m: Msg) -> None:
        reads.append(m.subject + " " + m.data.decode())

    w = await nc.subscribe(key_subject, cb=on_write)
    r = await nc.subscribe(f"$JS.API.STREAM.MSG.GET.KV_{bucket}", cb=on_read)
    r2 = await nc.subscribe(f"$JS.API.DIRECT.GET.KV_{bucket}.>", cb=on_read)
    await nc.flush()
    reply = await sess.call(prompt_tokens=1000, max_tokens=256, sim_output_tokens=20, call_id=cid)
    await until(lambda: len(writes) >= 4, 5.0)
    await asyncio.sleep(0.2)  # any (wrong) later write or read shows up
    for sub in (w, r, r2):
        await sub.unsubscribe()
    states = [msgspec.json.decode(x)["state"] for x in writes]
    assert states == ["placing", "placed", "claimed", "answered"], states
    assert msgspec.json.decode(writes[1])["server_id"] == reply.server_id
    assert not [x for x in reads if record_key(sess.session_id, cid) in x], reads
    await sess.end()


async def test_queued_and_running_heartbeats(stack: Services, client: TalariaClient) -> None:
    # a long call of one model and, at the same time, a call of another: the second waits for a
    # model switch after the first one's slot, and hears `queued` heartbeats meanwhile
    a = await client.open_session(MODEL_B)
    b = await client.open_session(MODEL_A)
    ev_a: list[Any] = []
    ev_b: list[Any] = []
    ta = asyncio.ensure_future(a.call(prompt_tokens=3000, max_tokens=4096, sim_output_tokens=3000, on_event=ev_a.append))
    await asyncio.sleep(0.05)
    tb = asyncio.ensure_future(b.call(prompt_tokens=2000, max_tokens=512, sim_output_tokens=20, on_event=ev_b.append))
    # the router sees both models contending for this server's rounds (one running, one queued)
    async def both_live() -> bool:
        return (await svc_redis_hash(stack)).get(b"live_models") == f"{MODEL_A},{MODEL_B}".encode()
    await until(both_live, 20, "the mirror never showed both models live")
    ra, rb = await asyncio.gather(ta, tb)  # bounded by the module's pytest timeout
    assert ra.output_tokens == 3000 and rb.output_tokens == 20
    kinds_a = {type(e).__name__ for e in ev_a}
    kinds_b = {type(e).__name__ for e in ev_b}
    assert "CallRunning" in kinds_a, kinds_a
    running_beats = sum(isinstance(e, CallRunning) for e in ev_a)
    assert running_beats >= 2, ev_a  # the engine's start plus admission's heartbeats
    assert "CallQueued" in kinds_b, kinds_b
    assert any(isinstance(e, CallQueued) and e.waited_s > 0 for e in ev_b)
    assert rb.waited_s > 0 and rb.switch_wait_s > 0  # it waited, and part of that was a model switch
    await a.end()
    await b.end()


async def test_logs_trace_a_session(stack: Services, client: TalariaClient) -> None:
    sess = await client.open_session(MODEL_A)
    r = await sess.call(prompt_tokens=1500, max_tokens=256, sim_output_tokens=10)
    await sess.end()
    sid, cid = sess.session_id, r.call_id
    expect = {
        stack.router: {"router.placed"},
        stack.admission: {"admission.queued", "admission.dispatched"},
        stack.engine(MODEL_A): {"engine.started", "engine.finished"},
    }
    for name, events in expect.items():
        deadline = time.monotonic() + 10  # log lines are unbuffered, but a loaded machine delays the pipes
        while True:
            lines = [d for d in stack.log_lines(name) if d.get("call_id") == cid]
            seen = {d["event"] for d in lines}
            if events <= seen or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert events <= seen, f"{name}: {seen}\n{stack.log_tail(name)}"
        assert all(d.get("session_id") == sid for d in lines), lines
    # the router's session lines too
    assert any(d.get("event") == "session.opened" and d.get("session_id") == sid
               for d in stack.log_lines(stack.router))
    # `talaria logs SESSION` merges them into one timeline in the order they happened
    runs = session_lines(stack.log_dir, sid)
    assert list(runs) == [stack.log_dir]
    events = [ln.record["event"] for ln in runs[stack.log_dir] if ln.record.get("call_id") == cid]
    order = ["router.placed", "admission.queued", "admission.dispatched", "engine.started", "engine.finished"]
    assert [e for e in events if e in order] == order, events
    (summary,) = summarize_calls(runs[stack.log_dir])
    assert summary.call_id == cid and summary.placed_on == "s0" and summary.output_tokens == 10 and summary.waited_s is not None


# -- restart one process without the others ------------------------------------------------------


@pytest.mark.parametrize("which", ["router", "substrate", "admission", "engine"])
async def test_restart_one_process_between_calls(which: str, nats_server: NatsServer, redis_server: RedisServer,
                                                 subject_prefix: str, key_prefix: str, tmp_path: Path) -> None:
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs", models=[MODEL_A])
    await svc.start()
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix,
                                               silence_s=4.0, retries=1) as c:
            sess = await c.open_session(MODEL_A)
            r1 = await sess.call(prompt_tokens=3000, max_tokens=512, sim_output_tokens=40)
            assert r1.output_tokens == 40
            name = {"router": svc.router, "substrate": svc.substrate, "admission": svc.admission,
                    "engine": svc.engine(MODEL_A)}[which]
            pids = {n: svc.group[n].pid for n in svc.names}
            await svc.restart(name)
            # only that one process was replaced
            for n, pid in pids.items():
                assert (svc.group[n].pid != pid) == (n == name), n
                assert svc.group.running(n), f"{n}:\n{svc.log_tail(n)}"
            prefix = 3000 + r1.output_tokens
            r2 = await call_until(c.nc, svc.subjects, CallRequest(
                call_id=f"{sess.session_id}-2", session_id=sess.session_id, model=MODEL_A, prompt_tokens=prefix + 300,
                prefix_tokens=prefix, max_tokens=512, engine_hint=EngineHint(sim_output_tokens=25)), timeout_s=6.0)
            assert r2.output_tokens == 25 and r2.session_id == sess.session_id, f"after restarting {name}: {r2}"
            await sess.end()
    finally:
        await svc.stop()


async def test_engine_killed_mid_generation_still_answers_once(nats_server: NatsServer, redis_server: RedisServer,
                                                               subject_prefix: str, key_prefix: str, tmp_path: Path) -> None:
    """An engine-worker that dies mid-generation: admission re-sends the call to
    the restarted worker, which the substrate wakes again; the agent sees one reply."""
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs", models=[MODEL_A])
    await svc.start()
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix) as c:
            sess = await c.open_session(MODEL_A)
            events: list[Any] = []
            # ~8,000 tokens of decode: tens of model seconds, about a wall second at 100x
            call = asyncio.ensure_future(call_until(c.nc, svc.subjects, CallRequest(
                call_id=f"{sess.session_id}-long", session_id=sess.session_id, model=MODEL_A, prompt_tokens=3000,
                max_tokens=8192, engine_hint=EngineHint(sim_output_tokens=8000)), timeout_s=30.0, events=events))
            deadline = time.monotonic() + 10
            while not any(isinstance(e, CallRunning) for e in events):
                assert time.monotonic() < deadline, events
                await asyncio.sleep(0.02)
            name = svc.engine(MODEL_A)
            svc.group.kill(name)
            svc.group.start(name)
            reply = await call
            assert reply.output_tokens == 8000 and not reply.duplicate
            replies = [e for e in events if isinstance(e, CallReply)]
            assert len(replies) == 1
            log = (tmp_path / "logs").glob("*.log")
            assert any("admission.redispatch" in p.read_text() for p in log)
    finally:
        await svc.stop()


async def test_switch_to_a_dead_engine_is_retried_not_stalled(nats_server: NatsServer, redis_server: RedisServer,
                                                              subject_prefix: str, key_prefix: str, tmp_path: Path) -> None:
    """The incoming model's engine-worker is down when a switch wants to wake it:
    the substrate answers the switch with an error once its Wake times out, and
    admission asks again, so the call is served soon after the worker is back
    (before, the switch hung until admission's request timeout, ~40 s of wall)."""
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs",
                   models=[MODEL_A, MODEL_B], extra_env={"TALARIA_CONTROL_TIMEOUT_S": "0.5"})
    await svc.start()
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix) as c:
            a = await c.open_session(MODEL_A)
            assert (await a.call(prompt_tokens=2000, max_tokens=64, sim_output_tokens=10)).output_tokens == 10
            name = svc.engine(MODEL_B)
            svc.group.kill(name)
            b = await c.open_session(MODEL_B)
            call = asyncio.ensure_future(b.call(prompt_tokens=2000, max_tokens=64, sim_output_tokens=12))
            await asyncio.sleep(1.5)  # the switch's Wake to B times out meanwhile
            assert not call.done()
            t0 = time.monotonic()
            svc.group.start(name)
            reply = await asyncio.wait_for(call, 20.0)
            assert reply.output_tokens == 12 and reply.model == MODEL_B
            assert time.monotonic() - t0 < 15.0
            log = svc.log_tail(svc.substrate, 400)
            assert "substrate.switch_failed" in log, log
    finally:
        await svc.stop()


async def test_the_active_engine_restarted_with_the_substrate_is_woken_again(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """The substrate-manager and the active model's engine-worker restart together (both
    on a NATS node that stopped, say), the worker first: its announcement comes while no
    substrate listens, and the new substrate finds no engine awake. It wakes the model
    its predecessor mirrored as resident, which admission still serves; before, the
    model's calls waited on the sleeping worker for ever (a chaos run stalled so)."""
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs",
                   models=[MODEL_A, MODEL_B])
    await svc.start()
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix) as c:
            a = await c.open_session(MODEL_A)
            assert (await a.call(prompt_tokens=2000, max_tokens=64, sim_output_tokens=10)).output_tokens == 10
            await asyncio.to_thread(svc.group.stop, svc.substrate)
            await svc.restart(svc.engine(MODEL_A))  # (asleep, announced to nobody)
            svc.group.start(svc.substrate)
            await svc.wait_healthy([svc.substrate])
            reply = await asyncio.wait_for(a.call(prompt_tokens=2500, max_tokens=64, sim_output_tokens=11), 30.0)
            assert reply.output_tokens == 11 and reply.model == MODEL_A
            assert "the mirrored resident" in svc.log_tail(svc.substrate, 200)
    finally:
        await svc.stop()


async def test_a_switch_to_a_hung_engine_is_resent_once_it_is_replaced(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """The incoming model's engine-worker is stopped (SIGSTOP) when a switch sends it
    its Wake; it is then killed and restarted, as the liveness watch does. The
    substrate sends the Wake again to the new process as soon as it announces itself,
    so the call is served moments after the restart, not once the Wake to the
    stopped process has timed out (`TALARIA_CONTROL_TIMEOUT_S`, 10 s here)."""
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs",
                   models=[MODEL_A, MODEL_B], extra_env={"TALARIA_CONTROL_TIMEOUT_S": "10"})
    await svc.start()
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix, silence_s=60.0) as c:
            a = await c.open_session(MODEL_A)
            assert (await a.call(prompt_tokens=2000, max_tokens=64, sim_output_tokens=10)).output_tokens == 10
            name = svc.engine(MODEL_B)
            pid = svc.group[name].pid
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            b = await c.open_session(MODEL_B)
            call = asyncio.ensure_future(b.call(prompt_tokens=2000, max_tokens=64, sim_output_tokens=12))
            await until(lambda: "substrate.switch" in svc.log_tail(svc.substrate, 200), 10.0)
            await asyncio.sleep(0.5)  # the Wake is sent to the stopped process meanwhile
            assert not call.done()
            svc.group.kill(name)
            t0 = time.monotonic()
            await asyncio.to_thread(svc.group.start, name)
            reply = await asyncio.wait_for(call, 20.0)
            assert reply.output_tokens == 12 and reply.model == MODEL_B
            assert time.monotonic() - t0 < 5.0, f"served {time.monotonic() - t0:.1f} s after the restart"
            assert "substrate.control_resent" in svc.log_tail(svc.substrate, 400)
    finally:
        await svc.stop()


async def test_a_restarted_substrate_learns_the_active_model_from_the_engines(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """The substrate-manager restarts while model A is awake, then A's engine-worker
    restarts (it comes back asleep). The new substrate asked the engines which model
    is awake, so A's restart announcement gets it woken and A's next call is served.
    Before, the new substrate thought no model active, never woke the worker, and
    admission's open slot for A waited for ever (a chaos run stalled on it)."""
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs",
                   models=[MODEL_A, MODEL_B])
    await svc.start()
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix, silence_s=60.0) as c:
            a = await c.open_session(MODEL_A)
            assert (await a.call(prompt_tokens=2000, max_tokens=64, sim_output_tokens=10)).output_tokens == 10
            await svc.restart(svc.substrate)
            assert "substrate.recovered" in svc.log_tail(svc.substrate, 200)
            await svc.restart(svc.engine(MODEL_A))
            reply = await asyncio.wait_for(a.call(prompt_tokens=2500, prefix_tokens=2010, max_tokens=64,
                                                  sim_output_tokens=11), 15.0)
            assert reply.output_tokens == 11
    finally:
        await svc.stop()


async def test_a_call_sent_while_no_router_runs_is_sent_again_when_one_is_back(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """The router is down when an agent sends a call: NATS says at once that nobody
    is subscribed (a 503 on the call's reply inbox), so the client sends it again
    every 0.2 s and it is served moments after a router is back. Before, the call
    was dropped on the floor and the agent noticed only after its silence (30 s here)."""
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs", models=[MODEL_A])
    await svc.start()
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix, silence_s=30.0) as c:
            sess = await c.open_session(MODEL_A)
            svc.group.kill(svc.router)
            await until(lambda: not svc.group.running(svc.router), 5.0)
            call = asyncio.ensure_future(sess.call(prompt_tokens=500, max_tokens=16, sim_output_tokens=3))
            await asyncio.sleep(1.0)
            assert not call.done()
            t0 = time.monotonic()
            await asyncio.to_thread(svc.group.start, svc.router)
            reply = await asyncio.wait_for(call, 20.0)
            assert reply.output_tokens == 3
            assert time.monotonic() - t0 < 5.0, f"served {time.monotonic() - t0:.1f} s after the router was back"
    finally:
        await svc.stop()


async def test_call_queued_in_a_killed_admission_is_resubmitted(nats_server: NatsServer, redis_server: RedisServer,
                                                                subject_prefix: str, key_prefix: str, tmp_path: Path) -> None:
    """Admission dies holding a queued call: the agent's retry (same call id,
    after silence) makes the router submit it again, and it is served once."""
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs",
                   models=[MODEL_A, MODEL_B])
    await svc.start()
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix, silence_s=1.5, retries=4) as c:
            a = await c.open_session(MODEL_A)
            b = await c.open_session(MODEL_B)
            # A's long call holds the server; B's call queues behind it (baseline: drain)
            long_a = asyncio.ensure_future(a.call(prompt_tokens=3000, max_tokens=8192, sim_output_tokens=8000))
            events: list[Any] = []
            deadline = time.monotonic() + 10
            while not (await svc_has_running(c, svc)):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            call_b = asyncio.ensure_future(b.call(prompt_tokens=2000, max_tokens=512, sim_output_tokens=30,
                                                  call_id=f"{b.session_id}-0", on_event=events.append))
            while not any(isinstance(e, (CallAccepted, CallQueued)) for e in events):
                assert time.monotonic() < deadline, events
                await asyncio.sleep(0.01)
            svc.group.kill(svc.admission)
            svc.group.start(svc.admission)
            rb = await asyncio.wait_for(asyncio.shield(call_b), timeout=60)
            ra = await asyncio.wait_for(asyncio.shield(long_a), timeout=60)
            assert rb.output_tokens == 30 and ra.output_tokens == 8000
            assert sum(isinstance(e, CallReply) for e in events) == 1
            # recovered by the restarted admission from its durable set (docs/reliability.md), or,
            # failing that, resubmitted by the router on the agent's retry
            assert ("resubmitted" in (tmp_path / "logs" / f"{svc.router}.log").read_text()
                    or "admission.recovered" in (tmp_path / "logs" / f"{svc.admission}.log").read_text())
    finally:
        await svc.stop()


async def svc_has_running(c: TalariaClient, svc: "Services") -> bool:
    h = await svc_redis_hash(svc)
    return int(h.get(b"running", b"0")) > 0


async def svc_redis_hash(svc: "Services") -> dict[bytes, bytes]:
    r = aioredis.Redis.from_url(svc.redis_url)
    try:
        return await r.hgetall(Keys(svc.key_prefix).server(SERVER))
    finally:
        await r.aclose()


async def test_redis_loss_mid_session_is_survived(nats_server: NatsServer, redis_server: RedisServer,
                                                 subject_prefix: str, key_prefix: str, tmp_path: Path) -> None:
    """Redis loses everything (FLUSHALL) between two calls of a session: the
    client re-opens its session, the services rebuild their soft state, and the
    call is served."""
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs", models=[MODEL_A])
    await svc.start()
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix) as c:
            sess = await c.open_session(MODEL_A)
            r1 = await sess.call(prompt_tokens=3000, max_tokens=512, sim_output_tokens=40)
            r = aioredis.Redis.from_url(redis_server.url)
            await r.flushall()
            r2 = await sess.call(prompt_tokens=3000 + 40 + 200, prefix_tokens=3040, max_tokens=512, sim_output_tokens=20)
            assert r1.output_tokens == 40 and r2.output_tokens == 20
            # the server's mirror is back (rebuilt from the admission service's own state)
            deadline = time.monotonic() + 5
            while not await r.exists(Keys(key_prefix).server(SERVER)):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await r.aclose()
    finally:
        await svc.stop()


async def test_a_malformed_call_is_refused_at_once(stack: Services, client: TalariaClient) -> None:
    """The agent hears a call that does not validate as `Malformed` in moments,
    on the reply subject the call names, not a timeout after every retry."""
    sess = await client.open_session(MODEL_A)
    bad: list[dict[str, Any]] = [{"prompt_tokens": -5}, {"prompt_tokens": 0}, {"prompt_tokens": 100, "max_tokens": 0},
                                 {"prompt_tokens": 100, "prefix_tokens": -50}, {"prompt_tokens": "lots"}]
    for fields in bad:
        t0 = time.monotonic()
        with pytest.raises(Malformed):
            await asyncio.wait_for(client.call(sess.session_id, MODEL_A, **fields), 5.0)  # type: ignore[arg-type]
        assert time.monotonic() - t0 < 3.0, fields
    assert (await sess.call(prompt_tokens=100, max_tokens=8, sim_output_tokens=4)).output_tokens == 4


async def test_a_call_id_reused_by_another_session_is_a_new_call(stack: Services, client: TalariaClient) -> None:
    """Call ids are the agent's own: the at-most-once record is keyed by the
    session too, so another session's call with the same id runs and is answered
    to that session, never with the first session's reply."""
    first = await client.open_session(MODEL_A)
    r1 = await first.call(prompt_tokens=500, max_tokens=16, sim_output_tokens=7, call_id="swe-007#000")
    second = await client.open_session(MODEL_A)
    r2 = await second.call(prompt_tokens=600, max_tokens=16, sim_output_tokens=9, call_id="swe-007#000")
    assert not r2.duplicate and r2.session_id == second.session_id and r2.output_tokens == 9
    assert r1.session_id == first.session_id and r1.output_tokens == 7
    again = await first.call(prompt_tokens=500, max_tokens=16, sim_output_tokens=7, call_id="swe-007#000")
    assert again.duplicate and again.session_id == first.session_id and again.output_tokens == 7


async def test_a_call_asked_for_again_from_another_inbox_is_answered_there_when_it_finishes(
        stack: Services, nats_server: NatsServer) -> None:
    """The agent's process (a gateway, say) died mid-call and its replacement asks for the
    call again: admission sends its news to the new inbox, and its reply there once the run
    ends. It went to the dead inbox only, and the new one heard it after its next silence."""
    first = await TalariaClient.connect(nats_server.url, subject_prefix=stack.subject_prefix, silence_s=30.0, retries=0)
    sess = await first.open_session(MODEL_A)
    cid = f"{sess.session_id}-long"
    events: list[Any] = []
    ask = {"prompt_tokens": 3000, "max_tokens": 16384, "sim_output_tokens": 6000, "call_id": cid}
    task = asyncio.ensure_future(sess.call(**ask, on_event=events.append))
    await until(lambda: any(isinstance(e, CallRunning) for e in events), 20, "the call never ran")
    await first.nc.close()  # killed: no cancel goes out, the engine runs on
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    second = await TalariaClient.connect(nats_server.url, subject_prefix=stack.subject_prefix, silence_s=30.0, retries=0)
    try:
        again = await second.open_session(MODEL_A, session_id=sess.session_id)
        t0 = time.monotonic()
        reply = await asyncio.wait_for(again.call(**ask), timeout=60)
        finished = [d for d in stack.log_lines(stack.engine(MODEL_A))
                    if d.get("event") == "engine.finished" and d.get("call_id") == cid]
        assert reply.output_tokens == 6000 and len(finished) == 1
        assert time.monotonic() - t0 < 20, "answered only after the new inbox's silence"
        assert any(d.get("event") == "admission.redirected" for d in stack.log_lines(stack.admission))
    finally:
        await second.close()


# -- per-call state held in memory ---------------------------------------------------------
async def test_admission_forgets_each_call_it_served_tracing_off(nats_server: NatsServer, redis_server: RedisServer,
                                                                  tmp_path: Path, service_logging: None) -> None:
    """Admission holds a few entries per call while it queues and runs it (its payload,
    its dispatch, its arrival's wall time for the wait span); after the reply none is
    left, traced or not. (Untraced calls, the default, once kept their arrival time for
    good: about 130 bytes a call, never freed, 11 MB after 85,000 calls in a probe.)
    Admission runs in this process so its memory can be read; the rest as processes."""
    from services.admission.service import AdmissionService
    from shared.policy import resolve_policy

    prefix, key_prefix = f"t{uuid.uuid4().hex[:8]}", f"t-{uuid.uuid4().hex[:8]}:"
    svc = Services(nats_server.url, redis_server.url, prefix, key_prefix, tmp_path / "logs",
                   models=[MODEL_A], which=("router", "substrate", "engine"))
    epoch = float(svc.group.children[svc.names[0]].env["TALARIA_CLOCK_EPOCH"])  # type: ignore[index]  # (one clock)
    settings = Settings(nats_urls=[nats_server.url], redis_url=redis_server.url, subject_prefix=prefix,
                        key_prefix=key_prefix, time_scale=TIME_SCALE, clock_epoch=epoch,
                        policy=resolve_policy("baseline"), servers=[SERVER], models=[MODEL_A], server_id=SERVER,
                        heartbeat_wall_s=0.05)
    admission = AdmissionService(settings)
    running = asyncio.create_task(admission.run())
    client = None
    try:
        await svc.start()
        await until(lambda: hasattr(admission, "payloads"), 20, "admission did not set up")
        client = await TalariaClient.connect(nats_server.url, subject_prefix=prefix, silence_s=10.0, retries=1)
        sessions = [await client.open_session(MODEL_A) for _ in range(3)]
        for turn in range(4):
            await asyncio.gather(*(s.call(prompt_tokens=400 * (turn + 1), prefix_tokens=400 * turn if turn else 0,
                                          max_tokens=64, sim_output_tokens=16) for s in sessions))
        assert not running.done()
        held = {"payloads": admission.payloads, "dispatched": admission.dispatched,
                "arrived_wall": admission.arrived_wall, "resend_at": admission.resend_at,
                "confirmed": admission.confirmed, "confirmed_at": admission.confirmed_at}
        await until(lambda: not any(held.values()), 10, f"admission still holds per-call state: {held}")
    finally:
        if client is not None:
            await client.close()
        admission._stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(running, 15)
        await svc.stop()


async def test_a_sessions_kv_locality_expires_like_its_other_soft_state(stack: Services, client: TalariaClient,
                                                                      redis_client: aioredis.Redis) -> None:
    """The sim engine's note of where a session's KV lives is soft state with the
    session's lifetime, as the vLLM path's is: a session whose idle release never comes
    (an admission restarted while it was idle knows nothing of it) leaves no key for good."""
    from shared.keys import SESSION_TTL_S

    sess = await client.open_session(MODEL_A)
    await sess.call(prompt_tokens=300, max_tokens=32, sim_output_tokens=8)
    key = Keys(stack.key_prefix).kv_locality(sess.session_id)
    assert await redis_client.hget(key, SERVER) == b"hbm"
    assert 0 < await redis_client.ttl(key) <= SESSION_TTL_S


async def test_an_engine_down_with_its_substrate_is_waited_for_without_errors(
        nats_server: NatsServer, redis_server: RedisServer, tmp_path: Path) -> None:
    """The active model's engine-worker and the substrate die together; the substrate
    comes back first. Its wake of the engine finds nobody listening, and admission's
    dispatch of a call meanwhile hears NATS's "no responders" on its inbox: both wait
    for the worker (its announcement wakes it, the unacknowledged dispatch goes again),
    and neither is logged as a failure (they were a traceback and a "malformed" reply)."""
    svc = Services(nats_server.url, redis_server.url, f"t{uuid.uuid4().hex[:8]}", f"t-{uuid.uuid4().hex[:8]}:",
                   tmp_path / "logs", models=[MODEL_A])
    await svc.start()
    client = await TalariaClient.connect(nats_server.url, subject_prefix=svc.subject_prefix, silence_s=20.0, retries=1)
    try:
        sess = await client.open_session(MODEL_A)
        await sess.call(prompt_tokens=300, max_tokens=32, sim_output_tokens=8)  # (model A active)
        svc.group.kill(svc.engine(MODEL_A))
        svc.group.kill(svc.substrate)
        await asyncio.sleep(0.3)
        svc.group.start(svc.substrate)
        await svc.wait_healthy([svc.substrate])
        call = asyncio.create_task(sess.call(prompt_tokens=500, prefix_tokens=308, max_tokens=32, sim_output_tokens=8,
                                             call_id="while-away"))
        await until(lambda: any(d.get("event") == "admission.dispatched" and d.get("call_id") == "while-away"
                                for d in svc.log_lines(svc.admission)), 10, "admission never dispatched the call")
        await asyncio.sleep(0.5)
        assert not call.done()
        svc.group.start(svc.engine(MODEL_A))
        reply = await asyncio.wait_for(call, 30)
        assert reply.output_tokens == 8
        substrate = svc.log_lines(svc.substrate)
        admission = svc.log_lines(svc.admission)
        assert not [d for d in substrate if d.get("level") == "error"]
        assert not [d for d in admission if d.get("event") == "request.rejected"]
        assert any(d.get("event") == "substrate.rewake_deferred" for d in substrate), substrate[-10:]
        assert any(d.get("event") == "admission.dispatch_unheard" for d in admission)
    finally:
        await client.close()
        await svc.stop()


async def test_a_call_refused_between_services_is_counted_failed_once_by_whoever_tells_its_agent() -> None:
    """Admission's refusal of a submit answers the router, which answers the agent; an
    engine's refusal of a dispatch answers admission, which sends it again. Both had been
    counted in `talaria_calls_failed_total` beside the router's answer to the agent, so its
    sum over processes was twice the calls refused (and every resend of a refused dispatch
    counted an `internal` failure that no agent saw)."""
    import inspect

    from shared.bus import ServiceProcess
    from services.admission.service import AdmissionService

    published: list[str] = []

    class Bus:
        async def publish(self, subject: str, data: bytes, headers: Any = None) -> None:
            published.append(subject)

    svc = ServiceProcess(Settings())
    svc.nc = Bus()  # type: ignore[assignment]
    await svc.reply_error("inbox.router", "no_capacity", "full", "c1", to_agent=False)
    await svc.reply_error("inbox.agent", "no_capacity", "no server could take it", "c1")
    assert published == ["inbox.router", "inbox.agent"]
    assert svc.metrics.registry.get_sample_value("talaria_calls_failed_total", {"code": "no_capacity"}) == 1
    # admission never answers an agent: none of its refusals is counted
    source = inspect.getsource(AdmissionService)
    assert source.count("self.reply_error(") == source.count("to_agent=False") > 0


async def test_a_stored_call_of_another_subject_prefix_is_dropped_at_recovery(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """`talaria up` started again on a Redis kept across restarts (the same key prefix) and a
    fresh subject prefix: its admission recovered the calls the last stack had accepted and
    ran them for replies nobody could hear, and every publish of them was refused as a
    permissions violation, once a second. They are dropped, and said so; its own are run."""
    from shared.schema import AdmissionCall, SubmitCall

    own, foreign = f"{subject_prefix}-own-0", f"{subject_prefix}-foreign-0"
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        for cid, prefix in ((own, subject_prefix), (foreign, "an-older-stack")):
            sub = SubmitCall(call=AdmissionCall(cid, f"s-{cid}", MODEL_A, 1000, 0, 64, 0.0, False),
                             reply_to=f"{prefix}.reply.{AGENT_NAMESPACE}.c.{cid}",
                             engine=EnginePayload(hint=EngineHint(sim_output_tokens=5)))
            await r.hset(Keys(key_prefix).admission_calls(SERVER), cid, encode(sub))
        svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs",
                       models=[MODEL_A])
        await svc.start()
        try:
            await until(lambda: any(d.get("event") == "admission.recover_foreign"
                                    for d in svc.log_lines(svc.admission)), 20, "no foreign call dropped")
            (said,) = [d for d in svc.log_lines(svc.admission) if d.get("event") == "admission.recover_foreign"]
            assert said["call_ids"] == [foreign]
            await until(lambda: any(d.get("event") == "engine.finished" and d.get("call_id") == own
                                    for d in svc.log_lines(svc.engine(MODEL_A))), 30, "its own call never ran")
            async def none_stored() -> bool:  # (the foreign one deleted, the own one once answered)
                return await r.hlen(Keys(key_prefix).admission_calls(SERVER)) == 0
            await until(none_stored, 20, "stored calls left")
            assert not any(d.get("call_id") == foreign for d in svc.log_lines(svc.engine(MODEL_A)))
        finally:
            await svc.stop()
    finally:
        await r.aclose()
