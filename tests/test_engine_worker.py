"""The engine-worker's call protocol (services/engine/worker.py), on the sim
backend over real processes: a run already answered is answered again with
its CallFinished re-sent, a second generation of one call id is never a second
answer, a streamed call gets its tokens at decode pace, an agent's cancel ends
a running call, and a released session is released by every service."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
from nats.aio.client import Client as NATS

from polling import until
from services.engine.sim_backend import placeholder_tokens
from services.engine.worker import EngineBackend
from shared.call_record import CallRecords, record_key
from shared.keys import CALL_TTL_S, Keys
from shared.subjects import AGENT_NAMESPACE
from shared.schema import (
    AdmissionCall, CallRecord, CallReply, CallTokens, CancelCall, EnginePayload, EngineHint, RunCall, Wake,
    call_event_decoder, encode, finished_decoder,
)
from talaria.client import CallTimeout, TalariaClient
from talaria.ops.nats_server import NatsServer
from talaria.ops.redis_server import RedisServer
from test_services import MODEL_A, SERVER, Services

pytestmark = pytest.mark.timeout(120)


def _run(call_id: str, session_id: str, reply_to: str, *, out: int = 20, stream: bool = False) -> RunCall:
    bound = max(512, out)
    return RunCall(call=AdmissionCall(call_id, session_id, MODEL_A, 1000, 0, bound, 0.0, False),
                   engine=EnginePayload(hint=EngineHint(sim_output_tokens=out), stream=stream),
                   reply_to=reply_to, reserved_tokens=1000 + bound, waited_s=0.0, switch_wait_s=0.0, round_wait=False)


class _AwakeBackend(EngineBackend):
    """A backend in this process that is awake and runs nothing: a test gives it its `run`."""

    can_run = awake = True  # type: ignore[assignment]

    def running(self) -> list[RunCall]:
        return []

    async def run(self, rc: RunCall) -> None: ...

    async def sleep(self) -> dict[str, int]:
        return {}

    async def wake(self, cmd: Wake) -> None: ...
    async def abort(self, call_id: str, at: float | None) -> None: ...
    async def cancel(self, call_id: str) -> None: ...


async def _collect(nc: NATS, subject: str) -> tuple[list[bytes], Any]:
    got: list[bytes] = []

    async def cb(msg: Any) -> None:
        got.append(msg.data)

    sub = await nc.subscribe(subject, cb=cb)
    return got, sub


@pytest.fixture
async def engine_only(nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
                      tmp_path: Path) -> Any:
    """One sim engine-worker alone, woken by hand: this test plays admission."""
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs",
                   models=[MODEL_A], which=("engine",))
    await svc.start()
    nc = NATS()
    await nc.connect(nats_server.url)
    await nc.request(svc.subjects.engine_control(SERVER, MODEL_A), encode(Wake(kv_capacity_tokens=200_000)), timeout=5)
    try:
        yield svc, nc
    finally:
        await nc.close()
        await svc.stop()


async def test_a_finish_that_failed_is_tried_again_until_it_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """The vllm backend's finish of a generated call: a failed write (the call record past
    its deadline while a NATS node was stopped, in a chaos run) is logged and tried again,
    not raised out of the run, which had left the call held by the worker with no answer
    ever stored, so every resend of it was ignored."""
    import structlog

    from services.engine import worker

    monkeypatch.setattr(worker, "FINISH_RETRY_WALL_S", (0.0,))
    tries: list[int] = []

    async def finish() -> None:
        tries.append(len(tries))
        if len(tries) < 3:
            raise RuntimeError("call record unavailable")

    log = structlog.get_logger()
    with structlog.testing.capture_logs() as logs:
        await worker.finish_until_told(finish, log, "c9")
    assert len(tries) == 3
    assert [(e["event"], e["call_id"], e["attempt"]) for e in logs] == [("engine.finish_failed", "c9", 1),
                                                                       ("engine.finish_failed", "c9", 2)]


async def test_a_run_already_answered_is_answered_again_with_its_finish(engine_only: Any,
                                                                          redis_server: RedisServer) -> None:
    svc, nc = engine_only
    s = svc.subjects
    replies, _ = await _collect(nc, s.reply_inbox("t", "r1"))
    finishes, _ = await _collect(nc, s.call_finished(SERVER))
    await nc.publish(s.engine_run(SERVER, MODEL_A), encode(_run("c1", "S1", s.reply_inbox("t", "r1"))))
    answers = lambda: [e for e in replies if isinstance(call_event_decoder.decode(e), CallReply)]  # noqa: E731
    await until(lambda: len(answers()) == 1 and len(finishes) == 1, 10, "the run never finished")
    first = msgspec.json.decode(answers()[0], type=CallReply)
    # admission restarted and dispatched it again: the stored reply, and admission hears the finish again
    await nc.publish(s.engine_run(SERVER, MODEL_A), encode(_run("c1", "S1", s.reply_inbox("t", "r1"))))
    await until(lambda: len(answers()) == 2 and len(finishes) == 2, 10, "the duplicate run was not answered")
    assert msgspec.json.decode(answers()[1], type=CallReply) == first
    again = finished_decoder.decode(finishes[1])
    assert again.call_id == "c1" and again.context_tokens == first.prompt_tokens + first.output_tokens
    started = [d for d in svc.log_lines(svc.engine(MODEL_A)) if d.get("event") == "engine.started"]
    assert len(started) == 1, "a second generation ran"


async def test_a_second_generation_is_never_a_second_answer(engine_only: Any, redis_server: RedisServer,
                                                            key_prefix: str) -> None:
    """A reply stored while this generation ran (another engine's, say, after the
    dispatch was lost and sent twice) wins: the agent hears one answer."""
    svc, nc = engine_only
    s = svc.subjects
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        replies, _ = await _collect(nc, s.reply_inbox("t", "r2"))
        await nc.publish(s.engine_run(SERVER, MODEL_A), encode(_run("c2", "S2", s.reply_inbox("t", "r2"), out=3000)))
        await until(lambda: any(d.get("event") == "engine.started"
                                for d in svc.log_lines(svc.engine(MODEL_A))), 10, "not started")
        earlier = CallReply(call_id="c2", session_id="S2", server_id="s9", model=MODEL_A, prompt_tokens=1000,
                            cached_tokens=0, restored_tokens=0, reprefill_tokens=0, output_tokens=7, arrived_at=0.0,
                            finished_at=1.0, waited_s=0.0, switch_wait_s=0.0, round_wait=False, restore_s=0.0,
                            prefill_s=0.0, decode_s=0.0)
        records = await CallRecords.open(nc, svc.subjects.prefix, replicas=1, ttl_s=CALL_TTL_S)
        await records.kv.put(record_key("S2", "c2"), encode(CallRecord(state="answered", reply=encode(earlier))))
        answers = lambda: [e for e in replies if isinstance(call_event_decoder.decode(e), CallReply)]  # noqa: E731
        await until(lambda: len(answers()) == 1, 30, "no answer")
        assert msgspec.json.decode(answers()[0], type=CallReply) == earlier
        assert any(d.get("event") == "engine.second_generation" for d in svc.log_lines(svc.engine(MODEL_A)))
    finally:
        await r.aclose()


async def test_a_streamed_sim_call_gets_its_tokens_and_a_cancel_ends_it(engine_only: Any) -> None:
    svc, nc = engine_only
    s = svc.subjects
    events, _ = await _collect(nc, s.reply_inbox(f"{AGENT_NAMESPACE}.t", "r3"))
    finishes, _ = await _collect(nc, s.call_finished(SERVER))
    # a short streamed call: every token arrives, in order, before the reply
    await nc.publish(s.engine_run(SERVER, MODEL_A), encode(_run("c3", "S3", s.reply_inbox(f"{AGENT_NAMESPACE}.t", "r3"), out=3000, stream=True)))
    await until(lambda: any(isinstance(call_event_decoder.decode(e), CallReply) for e in events), 30, "no reply")
    decoded = [call_event_decoder.decode(e) for e in events]
    tokens = [t for e in decoded if isinstance(e, CallTokens) for t in e.token_ids]
    assert tokens == placeholder_tokens(0, 3000)
    assert sum(isinstance(e, CallTokens) for e in decoded) > 1, "not streamed: one batch"
    assert isinstance(decoded[-1], CallReply) and decoded[-1].output_tokens == 3000
    # a long one, cancelled mid-decode: no reply, a CallFinished, an aborted finish in the log
    events.clear()
    finishes.clear()
    await nc.publish(s.engine_run(SERVER, MODEL_A), encode(_run("c4", "S4", s.reply_inbox(f"{AGENT_NAMESPACE}.t", "r3"), out=100_000, stream=True)))
    await until(lambda: any(isinstance(call_event_decoder.decode(e), CallTokens) for e in events), 30, "no tokens")
    await nc.publish(s.call_cancel(), encode(CancelCall(call_id="c4")))
    await until(lambda: any(finished_decoder.decode(f).call_id == "c4" for f in finishes), 10, "no CallFinished")
    await asyncio.sleep(0.3)
    assert not any(isinstance(call_event_decoder.decode(e), CallReply) for e in events), "a cancelled call was answered"
    cancel = [d for d in svc.log_lines(svc.engine(MODEL_A)) if d.get("event") == "engine.cancel"]
    assert cancel and cancel[-1]["call_id"] == "c4" and 0 < cancel[-1]["output_tokens"] < 100_000


async def test_an_agent_giving_up_cancels_its_sim_call(nats_server: NatsServer, redis_server: RedisServer,
                                                       subject_prefix: str, key_prefix: str, tmp_path: Path) -> None:
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs", models=[MODEL_A])
    await svc.start()
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix) as c:
            sess = await c.open_session(MODEL_A)
            call = asyncio.ensure_future(sess.call(prompt_tokens=1000, max_tokens=16384, sim_output_tokens=16000))
            await until(lambda: any(d.get("event") == "engine.started" for d in svc.log_lines(svc.engine(MODEL_A))),
                        15, "not started")
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await until(lambda: any(d.get("event") == "engine.cancel" for d in svc.log_lines(svc.engine(MODEL_A))),
                        10, "the engine never heard the agent give up")
            # the slot is free again: the next call runs at once
            nxt = await asyncio.wait_for(sess.call(prompt_tokens=1000, max_tokens=64, sim_output_tokens=5), 20)
            assert nxt.output_tokens == 5
    except CallTimeout:
        raise AssertionError("the cancelled call kept the engine busy")
    finally:
        await svc.stop()


async def test_an_ended_session_is_released_by_every_service(nats_server: NatsServer, redis_server: RedisServer,
                                                              subject_prefix: str, key_prefix: str,
                                                              tmp_path: Path) -> None:
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs",
                   models=[MODEL_A], policy="talaria")
    await svc.start()
    keys = Keys(key_prefix)
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix) as c:
            sess = await c.open_session(MODEL_A)
            await sess.call(prompt_tokens=2000, max_tokens=256, sim_output_tokens=10)
            assert await r.hget(keys.kv_locality(sess.session_id), SERVER) is not None
            await sess.end()

            def released(name: str, event: str) -> bool:
                return any(d.get("event") == event and d.get("session_id") == sess.session_id
                           for d in svc.log_lines(name))
            await until(lambda: released(svc.engine(MODEL_A), "engine.session_released"), 10, "engine kept the KV")
            await until(lambda: released(svc.substrate, "substrate.session_released"), 10, "substrate kept host KV")
            rel = [d for d in svc.log_lines(svc.engine(MODEL_A)) if d.get("event") == "engine.session_released"]
            assert rel[-1]["kv_tokens"] > 0
            sub = [d for d in svc.log_lines(svc.substrate) if d.get("event") == "substrate.session_released"]
            assert sub[-1]["reason"] == "ended"
            await until(lambda: _none(r, keys.kv_locality(sess.session_id)), 10, "locality kept")
    finally:
        await r.aclose()
        await svc.stop()


async def _none(r: aioredis.Redis, key: str) -> bool:
    return await r.hget(key, SERVER) is None


async def test_a_resend_whose_claim_was_read_before_the_answer_is_answered_not_run_again(service_logging: None) -> None:
    """A resend of a run whose claim is held up (a NATS outage) past the first run's whole
    generation and answer: its claim says "run" (this process's own, read before the answer
    was stored), so it ran again, a second generation. It is answered from the record."""
    from shared.call_record import Claim
    from shared.settings import Settings
    from services.engine.worker import EngineWorker

    class Backend(_AwakeBackend):
        runs: list[str] = []

        async def run(self, rc: RunCall) -> None:
            self.runs.append(rc.call_id)

    class Records:
        def __init__(self) -> None:
            self.claims, self.stored, self.answered = 0, b"", asyncio.Event()

        async def claim(self, session_id: str, call_id: str, **_: Any) -> Claim:
            self.claims += 1
            if self.stored:
                return Claim("answered", CallRecord(state="answered", reply=self.stored), 3)
            if self.claims == 2:  # the resend's: held up until the first run has been answered
                await self.answered.wait()
            return Claim("run", CallRecord(state="claimed", owner="engine", epoch="e"), 1)

        async def answer(self, session_id: str, call_id: str, reply: bytes, claim: Claim) -> tuple[bytes, bool]:
            self.stored = reply
            return reply, True

    class Pipe:
        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: self

        async def execute(self) -> list[Any]:
            return []

    published: list[tuple[str, bytes]] = []

    class Bus:
        async def publish(self, subject: str, data: bytes, headers: Any = None) -> None:
            published.append((subject, data))

    w = EngineWorker(Settings(model=MODEL_A), Backend)
    records = Records()
    w.call_records, w.nc = records, Bus()  # type: ignore[assignment]
    w.redis = type("Redis", (), {"pipeline": lambda self, transaction=True: Pipe()})()  # type: ignore[assignment]
    writes = asyncio.ensure_future(w.state_writes.run())  # (its task, as setup() spawns it)
    rc = _run("c9", "S9", "inbox.r9")
    await w._take_run(rc)
    resend = asyncio.create_task(w._take_run(rc))  # admission heard no acknowledgement and sent it again
    await asyncio.sleep(0.01)
    reply = CallReply(call_id="c9", session_id="S9", server_id=SERVER, model=MODEL_A, prompt_tokens=1000,
                      cached_tokens=0, restored_tokens=0, reprefill_tokens=0, output_tokens=20, arrived_at=0.0,
                      finished_at=1.0, waited_s=0.0, switch_wait_s=0.0, round_wait=False, restore_s=0.0,
                      prefill_s=0.0, decode_s=0.0)
    await w.finish(rc, reply, 1020)
    records.answered.set()
    await resend
    writes.cancel()
    assert Backend.runs == ["c9"], "a second generation ran"
    assert [d for s, d in published if s == "inbox.r9"] == [records.stored, records.stored]  # answered again


async def test_a_sleep_while_calls_run_is_refused_by_name_and_the_engine_runs_on(engine_only: Any) -> None:
    """The substrate's Sleep can overtake admission's preemptions of a switch (they come
    from two services): refused as unavailable, which the substrate retries, not a
    handler failure with a traceback; the call runs to its end."""
    from shared.schema import ApiError, Sleep, control_reply_decoder

    svc, nc = engine_only
    s = svc.subjects
    replies, _ = await _collect(nc, s.reply_inbox("t", "r7"))
    await nc.publish(s.engine_run(SERVER, MODEL_A), encode(_run("c7", "S7", s.reply_inbox("t", "r7"), out=3000)))
    await until(lambda: any(d.get("event") == "engine.started" for d in svc.log_lines(svc.engine(MODEL_A))), 10,
                "not started")
    resp = await nc.request(s.engine_control(SERVER, MODEL_A), encode(Sleep()), timeout=5)
    refused = control_reply_decoder.decode(resp.data)
    assert isinstance(refused, ApiError) and refused.code == "unavailable" and refused.retry_after_s, refused
    await until(lambda: any(isinstance(call_event_decoder.decode(e), CallReply) for e in replies), 30, "no answer")
    assert not [d for d in svc.log_lines(svc.engine(MODEL_A)) if d.get("event") == "handler.failed"]


async def test_a_cancel_that_crosses_its_run_on_the_bus_stops_the_run_and_not_a_later_ask(engine_only: Any) -> None:
    """Admission dispatched the call just before its agent's cancel reached it; the cancel
    reached this worker first (unknown here then). The run is dropped when it comes, and
    admission told; the same call id dispatched after the cancel (the agent asked again) runs."""
    svc, nc = engine_only
    s = svc.subjects
    inbox = s.reply_inbox(f"{AGENT_NAMESPACE}.t", "r9")
    events, _ = await _collect(nc, inbox)
    finishes, _ = await _collect(nc, s.call_finished(SERVER))
    await nc.publish(s.call_cancel(), encode(CancelCall(call_id="c9")))
    await nc.flush()
    await asyncio.sleep(0.2)
    sent_before = msgspec.structs.replace(_run("c9", "S9", inbox, out=50), dispatched_at=0.0)
    await nc.publish(s.engine_run(SERVER, MODEL_A), encode(sent_before))
    await until(lambda: any(finished_decoder.decode(f).call_id == "c9" for f in finishes), 10, "admission not told")
    await asyncio.sleep(0.3)
    assert not events, "a run its agent had given up was run"
    lines = svc.log_lines(svc.engine(MODEL_A))
    assert any(d.get("event") == "engine.cancelled_before_start" and d.get("call_id") == "c9" for d in lines)
    assert not any(d.get("event") == "engine.started" and d.get("call_id") == "c9" for d in lines)
    # a call whose run was dispatched after its cancel was heard (the agent asked again): run and answered
    await nc.publish(s.call_cancel(), encode(CancelCall(call_id="c10")))
    await nc.flush()
    await asyncio.sleep(0.2)
    asked_again = msgspec.structs.replace(_run("c10", "S10", inbox, out=50), dispatched_at=1e12)
    await nc.publish(s.engine_run(SERVER, MODEL_A), encode(asked_again))
    await until(lambda: any(isinstance(call_event_decoder.decode(e), CallReply) for e in events), 10, "not answered")


async def test_a_vllm_worker_says_its_context_limit_as_it_starts(redis_server: RedisServer, key_prefix: str) -> None:
    """While vLLM loaded (seconds on CPU, minutes on a GPU), routers and the gateway knew only
    the catalog's limit (131,072 for an engine started at 2,048): a call sized to it waited
    for the engine, then was refused, and the same call sent later was served."""
    import types

    from services.engine.vllm_backend import VllmBackend
    from shared.settings import VllmSettings

    r = aioredis.Redis.from_url(redis_server.url)
    started: list[Any] = []
    worker = types.SimpleNamespace(
        settings=types.SimpleNamespace(vllm=VllmSettings(model_dir="unread", max_model_len=2048, sleep_level=0), server_id=SERVER,
                                       model=MODEL_A, log_format="console"),  # (console: vLLM's logging left alone)
        name="engine", log=None, redis=r, keys=Keys(key_prefix), spawn=lambda coro, name: started.append(coro.close()))
    try:
        await VllmBackend(worker).start()  # type: ignore[arg-type]
        engine = await r.hgetall(Keys(key_prefix).engine(SERVER, MODEL_A))
        assert engine[b"state"] == b"starting" and int(engine[b"context_limit"]) == 2048
        assert started  # (the load itself, not run here)
    finally:
        await r.aclose()


async def test_a_run_the_backend_raises_on_is_refused_to_its_agent_and_frees_its_slot(service_logging: None) -> None:
    """A run whose own content makes the backend raise (a tool schema the sim engine could
    not read, in a probe) was answered to admission as "try again": it was sent again every
    10 s for ever, counted as running, and held its model's slot open, so every other model
    of the server waited. It is refused: its agent hears why, admission frees its slot."""
    from shared.call_record import Claim
    from shared.schema import ApiError
    from shared.settings import Settings
    from services.engine.worker import EngineWorker

    class Backend(_AwakeBackend):
        held: set[str] = set()

        def holds(self, call_id: str) -> bool:
            return call_id in self.held

        async def run(self, rc: RunCall) -> None:
            if rc.call_id == "taken":  # (taken, then failed: the backend's to finish)
                self.held.add(rc.call_id)
            raise RecursionError("maximum recursion depth exceeded")

    class Records:
        async def claim(self, session_id: str, call_id: str, **_: Any) -> Claim:
            return Claim("run", CallRecord(state="claimed", owner="engine", epoch="e"), 1)

    published: list[tuple[str, bytes]] = []

    class Bus:
        async def publish(self, subject: str, data: bytes, headers: Any = None) -> None:
            published.append((subject, data))

    w = EngineWorker(Settings(model=MODEL_A), Backend)
    w.call_records, w.nc = Records(), Bus()  # type: ignore[assignment]
    await w._take_run(_run("poison", "S1", "inbox.p"))
    (err,) = [call_event_decoder.decode(d) for s, d in published if s == "inbox.p"]
    assert isinstance(err, ApiError) and err.code == "internal" and "RecursionError" in err.message
    (done,) = [finished_decoder.decode(d) for s, d in published if s == w.subjects.call_finished(w.settings.server_id)]
    assert (done.call_id, done.context_tokens) == ("poison", 0)
    assert not w._taken("poison") and "poison" not in w.claims  # (a retry of it is taken afresh)
    published.clear()
    with pytest.raises(RecursionError):
        await w._take_run(_run("taken", "S2", "inbox.t"))
    assert not published


async def test_a_vllm_run_that_raises_before_its_answer_is_refused_not_left_running() -> None:
    """The vLLM backend runs each call in a task: one that raised before its answer (its
    prompt's tokenizing, a request vLLM refused) was logged and left live, so its agent
    waited for ever and admission held its slot. It is refused; one answered or refused
    already is not refused again."""
    import structlog

    from services.engine.vllm_backend import Live, VllmBackend

    refused: list[tuple[str, str]] = []

    class Worker:
        async def refuse(self, rc: RunCall, code: str, message: str) -> None:
            refused.append((rc.call_id, code))

    backend = VllmBackend.__new__(VllmBackend)  # (no engine: only its run's bookkeeping)
    backend.worker, backend.live, backend.log = Worker(), {}, structlog.get_logger("test")  # type: ignore[assignment]

    async def raises(live: Live) -> None:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a tokenizer's fault")

    backend._serve_call = raises  # type: ignore[method-assign]
    live = backend.live["c1"] = Live(rc=_run("c1", "S1", "inbox.1"), request_id="c1~x")
    await backend._serve(live)
    assert refused == [("c1", "internal")] and "c1" not in backend.live
    with pytest.raises(UnicodeDecodeError):  # (no longer live: answered or refused, not refused again)
        await backend._serve(live)
    assert refused == [("c1", "internal")]
