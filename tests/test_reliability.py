"""Reliability over real service processes: admission restarts with calls in
flight, bounded queues, idle-session release (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families
import redis.asyncio as aioredis

from services.router.placement import affinity_server
from services.router.service import ENGINE_STATES_TTL_WALL_S
from shared.keys import Keys
from shared.logs import LogEvery, read_log_events
from shared.schema import CallAccepted, CallQueued, CallReply, CallRunning, EngineDraining, encode
from talaria.client import NoCapacity, TalariaClient, TalariaError
from talaria.ops.nats_server import NatsServer
from talaria.ops.stack import EmbeddedStack, StackSpec
from shared.policy import resolve_policy
from talaria.ops.redis_server import RedisServer
from polling import until
from test_services import MODEL_A, MODEL_B, SERVER, Services, svc_redis_hash

pytestmark = pytest.mark.timeout(150)


def engine_counts(svc: Services, event: str) -> Counter[str]:
    out: Counter[str] = Counter()
    for m in svc.models:
        for d in svc.log_lines(svc.engine(m)):
            if d.get("event") == event and d.get("call_id"):
                out[d["call_id"]] += 1
    return out


async def test_admission_sigkilled_with_calls_queued_and_running(nats_server: NatsServer, redis_server: RedisServer,
                                                                 subject_prefix: str, key_prefix: str,
                                                                 tmp_path: Path) -> None:
    """SIGKILL admission while one call runs and two queue (behind a switch):
    the restarted admission adopts the running call (no switch under it) and
    re-queues the others from Redis; all complete exactly once, with no client
    retry (silence_s far above the test's length)."""
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs",
                   models=[MODEL_A, MODEL_B])
    await svc.start()
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix,
                                               silence_s=600.0, retries=0) as c:
            a = await c.open_session(MODEL_A)
            b = await c.open_session(MODEL_B)
            b2 = await c.open_session(MODEL_B)
            ev_a: list[Any] = []
            ev_b: list[Any] = []
            # a long call of A (~8-10 wall s at 100x: long enough to outlast admission's restart on a
            # loaded 2-core machine) holds the server; B's calls queue behind it
            ta = asyncio.ensure_future(a.call(prompt_tokens=3000, max_tokens=60000, sim_output_tokens=59000,
                                              call_id=f"{a.session_id}-0", on_event=ev_a.append))
            await until(lambda: _has(ev_a, CallRunning), 15, "A never ran")
            tb = asyncio.ensure_future(b.call(prompt_tokens=2000, max_tokens=512, sim_output_tokens=30,
                                              call_id=f"{b.session_id}-0", on_event=ev_b.append))
            tb2 = asyncio.ensure_future(b2.call(prompt_tokens=1500, max_tokens=512, sim_output_tokens=20,
                                                call_id=f"{b2.session_id}-0"))

            async def queued_two() -> bool:
                return int((await svc_redis_hash(svc)).get(b"queued", b"0")) >= 2
            await until(queued_two, 10, "B calls never queued")
            assert not ta.done()
            svc.group.kill(svc.admission)          # SIGKILL: no graceful anything
            svc.group.start(svc.admission)
            ra, rb, rb2 = await asyncio.wait_for(asyncio.gather(ta, tb, tb2), timeout=90)
            assert (ra.output_tokens, rb.output_tokens, rb2.output_tokens) == (59000, 30, 20)
            assert not (ra.duplicate or rb.duplicate or rb2.duplicate)
            assert sum(isinstance(e, CallReply) for e in ev_a) == 1
            assert sum(isinstance(e, CallReply) for e in ev_b) == 1
        cids = (f"{a.session_id}-0", f"{b.session_id}-0", f"{b2.session_id}-0")
        deadline = time.monotonic() + 10  # the replies are in; give the engine's log lines a moment
        while True:
            await asyncio.sleep(0.3)  # also lets any (wrong) second generation show up
            finished = engine_counts(svc, "engine.finished")
            if all(finished[cid] for cid in cids) or time.monotonic() > deadline:
                break
        for cid in cids:
            assert finished[cid] == 1, (cid, finished)
        adm = svc.log_lines(svc.admission)
        # A was adopted, not re-sent: after the restart it is dispatched again only if the
        # (tuned) policy preempted it at its quantum, never before its slot closed
        after = adm[max(i for i, d in enumerate(adm) if d.get("event") == "service.started"):]
        for i, d in enumerate(after):
            if d.get("event") == "admission.dispatched" and d.get("call_id") == f"{a.session_id}-0":
                assert any(x.get("event") == "admission.slot_closed" for x in after[:i]), after[:i]
        rec = [d for d in adm if d.get("event") == "admission.recovered"]
        assert rec and rec[-1]["running"] == 1 and rec[-1]["requeued"] == 2 and rec[-1]["active"] == MODEL_A, rec
        # the router never had to resubmit (no client retry happened)
        assert "resubmitted" not in (tmp_path / "logs" / f"{svc.router}.log").read_text()
        # no engine was put to sleep with calls running
        sub = svc.log_tail(svc.substrate, 400)
        assert "sleep with" not in sub, sub
        # the durable set is empty again
        r = aioredis.Redis.from_url(redis_server.url)
        try:
            assert await r.hlen(Keys(key_prefix).admission_calls(SERVER)) == 0
        finally:
            await r.aclose()
    finally:
        await svc.stop()


def _has(events: list[Any], kind: type) -> bool:
    return any(isinstance(e, kind) for e in events)


async def test_a_stopped_engine_worker_finishes_its_running_call_and_its_successor_takes_the_next(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """SIGTERM to an engine-worker (a rolling restart; compose gives it 60 s): it takes no
    new run and lets its running call finish, which is generated once. A call sent
    meanwhile is heard by nobody and taken by the worker started after it; its agent hears
    it is queued all the while (silent, it was sent again every `silence_s` and timed out
    after its tries: minutes under vLLM, whose next worker loads its weights first).
    Before, the stop cut the run, and the next worker generated it again from its first token."""
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs", models=[MODEL_A])
    await svc.start()
    engine = svc.engine(MODEL_A)
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix,
                                               silence_s=3.0, retries=0) as c:
            a, b = await c.open_session(MODEL_A), await c.open_session(MODEL_A)
            ev_a: list[Any] = []
            ta = asyncio.ensure_future(a.call(prompt_tokens=3000, max_tokens=60000, sim_output_tokens=20000,
                                              call_id=f"{a.session_id}-0", on_event=ev_a.append))
            await until(lambda: _has(ev_a, CallRunning), 15, "A never ran")
            pid = svc.group.pids()[engine]
            assert pid is not None
            os.kill(pid, signal.SIGTERM)
            tb = asyncio.ensure_future(b.call(prompt_tokens=2000, max_tokens=512, sim_output_tokens=30,
                                              call_id=f"{b.session_id}-0"))
            await until(lambda: not svc.group.running(engine), 60, "the stopped engine-worker never exited")
            assert ta.done() and not tb.done()  # A finished on it before it exited; B waited for the next
            await asyncio.sleep(4.0)  # (no worker for longer than the agent's silence_s)
            assert not tb.done(), tb
            svc.group.start(engine)
            ra, rb = await asyncio.wait_for(asyncio.gather(ta, tb), timeout=60)
            assert (ra.output_tokens, rb.output_tokens) == (20000, 30)
        await asyncio.sleep(0.5)  # (a wrong second generation would show in the log meanwhile)
        started = engine_counts(svc, "engine.started")
        assert started[f"{a.session_id}-0"] == 1 and started[f"{b.session_id}-0"] == 1, started
        assert any(d.get("event") == "engine.draining" for d in svc.log_lines(engine))
        # B's dispatch went unheard each second of the drain: one warning, then its count at the acknowledgement
        adm = svc.log_lines(svc.admission)
        b_id = f"{b.session_id}-0"
        warned = [d for d in adm if d.get("event") == "admission.redispatch" and d.get("call_id") == b_id
                  and d.get("level") == "warning" and d.get("reason") == "no acknowledgement"]
        acked = [d for d in adm if d.get("event") == "admission.dispatch_acknowledged" and d.get("call_id") == b_id]
        assert len(warned) == 1 and len(acked) == 1 and acked[0]["resends"] >= 2, (warned, acked)
    finally:
        await svc.stop()


@contextlib.asynccontextmanager
async def _one_server_of(models: list[str], nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str,
                         key_prefix: str, tmp_path: Path, **env: str) -> AsyncIterator[tuple[Services, TalariaClient]]:
    """The services of one server of `models` (`env`: their settings) and an agent that waits
    as long as it takes (no silence retries): the test's timeouts decide."""
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs", models=models,
                   extra_env=env or None)
    await svc.start()
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix,
                                               silence_s=600.0, retries=0) as c:
            yield svc, c
    finally:
        await svc.stop()


async def _bs_engine_stopped_and_a_call_of_b_queued(svc: Services, c: TalariaClient) -> tuple[Any, asyncio.Future[CallReply]]:
    """Model B's engine-worker stopped (SIGTERM, exited), a call of B queued for its successor;
    returns a session of A and B's call."""
    engine_b = svc.engine(MODEL_B)
    pid = svc.group.pids()[engine_b]
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    await until(lambda: not svc.group.running(engine_b), 30, "the stopped engine-worker never exited")
    b, a = await c.open_session(MODEL_B), await c.open_session(MODEL_A)
    tb = await _started(lambda on_event: b.call(prompt_tokens=1000, max_tokens=256, sim_output_tokens=10,
                                                on_event=on_event), CallQueued, "B's call never queued")
    return a, tb


async def test_a_model_whose_engine_worker_drains_gets_no_turn_and_holds_up_no_other(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """One server of two models; model B's engine-worker is stopped (a rolling restart) and
    its successor is slow to come (under vLLM it loads its weights first). A call of B waits
    for it, but a call of A, sent after it, runs at once: before, admission switched to B
    for the call that came first and asked again and again while the switch found no
    worker, every other model's call waiting behind it. Once B's next worker is up, B's
    call runs."""
    async with _one_server_of([MODEL_A, MODEL_B], nats_server, redis_server, subject_prefix, key_prefix,
                              tmp_path) as (svc, c):
        engine_b = svc.engine(MODEL_B)
        a, tb = await _bs_engine_stopped_and_a_call_of_b_queued(svc, c)
        ra = await asyncio.wait_for(a.call(prompt_tokens=1000, max_tokens=256, sim_output_tokens=10), 15)
        assert ra.output_tokens == 10 and not tb.done()
        svc.group.start(engine_b)
        assert (await asyncio.wait_for(tb, 30)).output_tokens == 10
        retries = [d for d in svc.log_lines(svc.admission) if d.get("event") == "admission.switch_retry"]
        assert not retries, retries[:3]


async def test_an_admission_restarted_while_a_models_engine_worker_is_away_gives_that_model_no_turn(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """As above, but admission is restarted (SIGKILL) after model B's engine-worker stopped,
    so it never heard the drain: it reads B's engine hash (`draining`) at start. A call of
    A, sent after B's, runs at once; before, the restarted admission switched to B for the
    call that came first, A's call waiting behind a switch no worker answered. B's call,
    queued by the predecessor, runs once B's next worker is up."""
    async with _one_server_of([MODEL_A, MODEL_B], nats_server, redis_server, subject_prefix, key_prefix,
                              tmp_path) as (svc, c):
        engine_b = svc.engine(MODEL_B)
        a, tb = await _bs_engine_stopped_and_a_call_of_b_queued(svc, c)
        svc.group.kill(svc.admission)
        svc.group.start(svc.admission)
        ra = await asyncio.wait_for(a.call(prompt_tokens=1000, max_tokens=256, sim_output_tokens=10), 15)
        assert ra.output_tokens == 10 and not tb.done()
        svc.group.start(engine_b)
        assert (await asyncio.wait_for(tb, 30)).output_tokens == 10
        adm = svc.log_lines(svc.admission)
        away = [d for d in adm if d.get("event") == "admission.engine_away_at_start"]
        assert [(d["model"], d["state"]) for d in away] == [(MODEL_B, "draining")], away
        assert not [d for d in adm if d.get("event") == "admission.switch_retry"]


async def test_a_switch_to_a_model_whose_engine_worker_stops_is_abandoned_for_the_waiting_model(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """One server of two models, switches made slow (seconds of wall time): model B's
    engine-worker is stopped while the server switches to B. The switch is abandoned and
    the server switches to A, whose call waits; before, the switch was asked again and
    again until B's next worker came (minutes under vLLM), A's call waiting behind it."""
    async with _one_server_of([MODEL_A, MODEL_B], nats_server, redis_server, subject_prefix, key_prefix, tmp_path,
                              TALARIA_SWITCH_COST_SCALE="40") as (svc, c):
        engine_b = svc.engine(MODEL_B)
        a, b = await c.open_session(MODEL_A), await c.open_session(MODEL_B)
        await asyncio.wait_for(a.call(prompt_tokens=1000, max_tokens=256, sim_output_tokens=10,
                                      call_id=f"{a.session_id}-0"), 30)
        tb = asyncio.ensure_future(b.call(prompt_tokens=1000, max_tokens=256, sim_output_tokens=10))

        def switching_to_b() -> bool:
            return any(d.get("event") == "admission.switch" and d.get("to_model") == MODEL_B
                       for d in svc.log_lines(svc.admission))
        await until(switching_to_b, 15, "the switch to B never began")
        ta = await _started(lambda on_event: a.call(prompt_tokens=1400, prefix_tokens=1010, max_tokens=256,
                                                    sim_output_tokens=10, call_id=f"{a.session_id}-1",
                                                    on_event=on_event), CallQueued, "A's call never queued")
        pid = svc.group.pids()[engine_b]
        assert pid is not None
        os.kill(pid, signal.SIGTERM)
        assert (await asyncio.wait_for(ta, 20)).output_tokens == 10 and not tb.done()
        svc.group.start(engine_b)
        assert (await asyncio.wait_for(tb, 30)).output_tokens == 10
        adm, sub = svc.log_lines(svc.admission), svc.log_lines(svc.substrate)
        assert [d["to_model"] for d in adm if d.get("event") == "admission.switch_abandoned"] == [MODEL_B]
        assert any(d.get("event") == "substrate.sleep_unanswered" and d.get("model") == MODEL_B for d in sub)


async def test_a_drained_models_successor_lost_announcement_is_made_up_for_by_its_engine_hash(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """A model whose engine-worker drains gets no turn until its successor announces itself;
    an announcement lost on the bus (a NATS node lost under it) would leave it without a
    turn for good. Here the drain is announced and no successor announces anything (the
    worker never stopped): admission finds the engine `ready` in its hash and gives the
    model its turns again."""
    async with _one_server_of([MODEL_A, MODEL_B], nats_server, redis_server, subject_prefix, key_prefix,
                              tmp_path) as (svc, c):
        nc = await nats.connect(nats_server.url)
        try:
            await nc.publish(svc.subjects.engine_draining(SERVER), encode(EngineDraining(server_id=SERVER, model=MODEL_B)))
            await nc.flush()
        finally:
            await nc.close()
        b = await c.open_session(MODEL_B)
        assert (await asyncio.wait_for(b.call(prompt_tokens=1000, max_tokens=256, sim_output_tokens=10), 15)
                ).output_tokens == 10
        back = [d for d in svc.log_lines(svc.admission) if d.get("event") == "admission.engine_back"]
        assert [(d["model"], d["source"]) for d in back] == [(MODEL_B, "its engine hash")], back


def _two_servers_of_one_model(tmp_path: Path) -> StackSpec:
    return StackSpec(policy=resolve_policy("talaria"), models=[MODEL_A], servers=2, time_scale=20.0,
                     log_dir=tmp_path / "logs")


async def _long_call_then_its_engine_stopped(stack: EmbeddedStack, x: Any, home: str) -> asyncio.Future[CallReply]:
    """Session `x`'s next call, a long one, running on `home`; then the engine-worker
    running it is stopped (SIGTERM: a rolling restart), so it drains it."""
    long = await _started(lambda on_event: x.call(prompt_tokens=2100, prefix_tokens=2008, max_tokens=60000,
                                                  sim_output_tokens=20000, call_id=f"{x.session_id}-1",
                                                  on_event=on_event), CallRunning, "the long call never ran")
    _stop_engine(stack, home, MODEL_A)
    return long


async def _started(call: Any, news: type, never: str, within_s: float = 15.0) -> asyncio.Future[CallReply]:
    """`call(on_event)` started, once its agent has heard `news` of it (CallQueued, CallRunning)."""
    ev: list[Any] = []
    fut = asyncio.ensure_future(call(ev.append))
    await until(lambda: _has(ev, news), within_s, never)
    return fut


def _stop_engine(stack: EmbeddedStack, server: str, model: str) -> None:
    """SIGTERM to an engine-worker (a rolling restart): it drains."""
    pid = stack.group.pids()[f"engine-{server}-{model}"]
    assert pid is not None
    os.kill(pid, signal.SIGTERM)


@pytest.mark.timeout(150)
async def test_a_new_call_goes_to_another_server_while_its_engine_worker_drains(tmp_path: Path) -> None:
    """Two servers of one model; the engine-worker of the server where a session runs a long
    call is stopped (a rolling restart) and drains. A new session's call goes to the other
    server, though the draining one has the model active: it would wait there for the drain
    and the next worker (minutes under vLLM). The draining call finishes whole."""
    async with EmbeddedStack(_two_servers_of_one_model(tmp_path)) as stack:
        async with await TalariaClient.from_deployment(stack.deployment()) as c:
            x = await c.open_session(MODEL_A)
            first = await x.call(prompt_tokens=2000, max_tokens=64, sim_output_tokens=8, call_id=f"{x.session_id}-0")
            home = first.server_id
            long = await _long_call_then_its_engine_stopped(stack, x, home)
            await asyncio.sleep(ENGINE_STATES_TTL_WALL_S + 1.0)  # (routers read the engines' states this often)
            assert not long.done()  # still draining
            y = await c.open_session(MODEL_A)
            other = await asyncio.wait_for(y.call(prompt_tokens=1500, max_tokens=64, sim_output_tokens=8), 30)
            assert other.server_id != home and other.output_tokens == 8
            assert (await asyncio.wait_for(long, 60)).output_tokens == 20000


@pytest.mark.timeout(150)
async def test_a_call_waiting_for_a_draining_engine_worker_moves_to_another_server(tmp_path: Path) -> None:
    """Two servers of one model; a session runs a long call on its server, whose
    engine-worker is then stopped (a rolling restart) and drains it. Another session's
    next call, placed there (its KV is there, and the routers have not read the drain
    yet), is handed back and placed on the other server, where it runs at once: it
    waited for the drain and the next worker (minutes under vLLM)."""
    async with EmbeddedStack(_two_servers_of_one_model(tmp_path)) as stack:
        async with await TalariaClient.from_deployment(stack.deployment()) as c:
            x = await c.open_session(MODEL_A)
            home = (await x.call(prompt_tokens=2000, max_tokens=64, sim_output_tokens=8,
                                 call_id=f"{x.session_id}-0")).server_id
            for _ in range(8):  # a second session whose KV is on the same server
                y = await c.open_session(MODEL_A)
                if (await y.call(prompt_tokens=1500, max_tokens=64, sim_output_tokens=8,
                                 call_id=f"{y.session_id}-0")).server_id == home:
                    break
            else:
                pytest.skip("no second session was placed beside the first")
            long = await _long_call_then_its_engine_stopped(stack, x, home)
            await asyncio.sleep(0.3)  # (its drain announced; the routers read the engines' states every 2 s)
            started = time.monotonic()
            nxt = await asyncio.wait_for(y.call(prompt_tokens=1600, prefix_tokens=1508, max_tokens=64,
                                                sim_output_tokens=8, call_id=f"{y.session_id}-1"), 30)
            took = time.monotonic() - started
            assert nxt.server_id != home and nxt.output_tokens == 8, nxt
            assert not long.done(), f"the next call took {took:.1f} s: it waited for the drain"
            assert (await asyncio.wait_for(long, 60)).output_tokens == 20000


@pytest.mark.timeout(150)
async def test_calls_queued_for_an_engine_worker_that_starts_draining_move_to_another_server(tmp_path: Path) -> None:
    """Two servers of two models, sessions pinned by pure session affinity: on one server a
    long call of model B holds its turn and a call of model A is queued behind it. A's
    engine-worker there is stopped (a rolling restart): the queued call is handed back and
    runs on the other server, before the long call ends; before, it waited for B's turn
    there and then for A's next worker."""
    policy = resolve_policy("session-affinity", {"affinity_load_factor": 100.0})  # (never spilled by load)
    spec = StackSpec(policy=policy, models=[MODEL_A, MODEL_B], servers=2, time_scale=20.0, log_dir=tmp_path / "logs")
    home = "s0"
    pinned_home = (sid for i in range(10_000)
                   if affinity_server(sid := f"sess-pin-{uuid.uuid4().hex[:6]}-{i}", ("s0", "s1"),
                                      policy.affinity_vnodes) == home)
    async with EmbeddedStack(spec) as stack:
        async with await TalariaClient.from_deployment(stack.deployment()) as c:
            y_sid = next(pinned_home)
            y = await c.open_session(MODEL_A, session_id=y_sid)
            first = await y.call(prompt_tokens=1500, max_tokens=64, sim_output_tokens=8, call_id=f"{y_sid}-0")
            assert first.server_id == home
            x = await c.open_session(MODEL_B, session_id=next(pinned_home))
            long = await _started(lambda on_event: x.call(prompt_tokens=3000, max_tokens=60000, sim_output_tokens=20000,
                                                          on_event=on_event), CallRunning, "the long call never ran")
            nxt = await _started(lambda on_event: y.call(prompt_tokens=1600, prefix_tokens=1508, max_tokens=64,
                                                         sim_output_tokens=8, call_id=f"{y_sid}-1", on_event=on_event),
                                 CallQueued, "the next call never queued behind the long one", within_s=10)
            _stop_engine(stack, home, MODEL_A)
            moved = await asyncio.wait_for(nxt, 30)
            assert moved.server_id != home and moved.output_tokens == 8, moved
            assert not long.done(), "the queued call waited for the long call's turn"
            async with aiohttp.ClientSession() as http, \
                    http.get(f"http://127.0.0.1:{stack.metrics_ports[f'admission-{home}']}/metrics") as m:
                counted = {tuple(sorted(sm.labels.items())): sm.value for f in text_string_to_metric_families(await m.text())
                           for sm in f.samples if sm.name == "talaria_calls_moved_total"}
            assert counted == {(("model", MODEL_A), ("outcome", "moved"), ("server", home)): 1.0}, counted
            assert (await asyncio.wait_for(long, 60)).output_tokens == 20000


@pytest.mark.timeout(150)
async def test_a_call_whose_every_server_drains_its_engine_stays_where_it_was_placed(tmp_path: Path) -> None:
    """Two servers of one model, each running a long call; both engine-workers are stopped
    at once. A new call, placed on one of them, is not moved to the other (its engine
    drains too) nor back again: it waits where it was for that server's next worker.
    A probe saw three such calls handed between two servers 630 times in 1.7 s."""
    async with EmbeddedStack(_two_servers_of_one_model(tmp_path)) as stack:
        async with await TalariaClient.from_deployment(stack.deployment()) as c:
            x = await c.open_session(MODEL_A)
            home = (await x.call(prompt_tokens=2000, max_tokens=64, sim_output_tokens=8,
                                 call_id=f"{x.session_id}-0")).server_id
            for _ in range(8):  # a session on the other server
                z = await c.open_session(MODEL_A)
                if (await z.call(prompt_tokens=1500, max_tokens=64, sim_output_tokens=8,
                                 call_id=f"{z.session_id}-0")).server_id != home:
                    break
            else:
                pytest.skip("no session was placed on the other server")
            longs = [await _started(lambda on_event, s=s: s.call(prompt_tokens=2100, prefix_tokens=1508, max_tokens=60000,
                                                                 sim_output_tokens=20000, call_id=f"{s.session_id}-1",
                                                                 on_event=on_event), CallRunning, "a long call never ran")
                     for s in (x, z)]
            for server in stack.server_ids:
                _stop_engine(stack, server, MODEL_A)
            await asyncio.sleep(0.3)
            y = await c.open_session(MODEL_A)
            served = await asyncio.wait_for(y.call(prompt_tokens=1000, max_tokens=64, sim_output_tokens=8,
                                                   call_id=f"{y.session_id}-0"), 60)
            assert served.output_tokens == 8
            for long in longs:
                assert (await asyncio.wait_for(long, 60)).output_tokens == 20000
        moves = [e for name in stack.group.children if name.startswith("admission-")
                 for e in read_log_events(Path(stack.log_dir) / f"{name}.log")
                 if e.get("event") in ("admission.moved", "admission.move_declined")
                 and e.get("call_id") == f"{y.session_id}-0"]
        assert len(moves) <= 1, moves


def test_a_repeated_event_is_logged_once_per_period_with_its_count() -> None:
    every = LogEvery(10.0)
    assert [every.due(t) for t in (0.0, 1.0, 2.0, 9.9, 10.0, 10.5, 25.0)] == [1, 0, 0, 0, 4, 0, 2]


async def test_bounded_queue_refuses_new_sessions_only(nats_server: NatsServer, redis_server: RedisServer,
                                                       subject_prefix: str, key_prefix: str, tmp_path: Path) -> None:
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs",
                   models=[MODEL_A, MODEL_B], extra_env={"TALARIA_MAX_QUEUED": "1"})
    await svc.start()
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix,
                                               silence_s=30.0, retries=0) as c:
            w = await c.open_session(MODEL_A)
            r1 = await w.call(prompt_tokens=1000, max_tokens=256, sim_output_tokens=10, call_id=f"{w.session_id}-0")
            x = await c.open_session(MODEL_B)
            ev_x: list[Any] = []
            tx = asyncio.ensure_future(x.call(prompt_tokens=3000, max_tokens=16384, sim_output_tokens=12000,
                                              on_event=ev_x.append))
            await until(lambda: _has(ev_x, CallRunning), 15, "X never ran")
            y = await c.open_session(MODEL_A)
            ev_y: list[Any] = []
            ty = asyncio.ensure_future(y.call(prompt_tokens=1000, max_tokens=256, sim_output_tokens=10,
                                              on_event=ev_y.append))

            async def one_queued() -> bool:
                return int((await svc_redis_hash(svc)).get(b"queued", b"0")) >= 1
            await until(one_queued, 10, "Y never queued")
            z = await c.open_session(MODEL_A)
            with pytest.raises(NoCapacity) as exc:
                await z.call(prompt_tokens=1000, max_tokens=256, sim_output_tokens=10, call_id=f"{z.session_id}-0")
            assert exc.value.retry_after_s and exc.value.retry_after_s > 0
            # a continuation is still admitted over the bound
            ev_w: list[Any] = []
            tw = asyncio.ensure_future(w.call(prompt_tokens=1400, prefix_tokens=1010, max_tokens=256,
                                              sim_output_tokens=5, call_id=f"{w.session_id}-1", on_event=ev_w.append))
            await until(lambda: _has(ev_w, CallAccepted), 10, "the continuation was not accepted")
            rx, ry, rw = await asyncio.wait_for(asyncio.gather(tx, ty, tw), timeout=60)
            assert r1.output_tokens == 10 and rw.output_tokens == 5 and ry.output_tokens == 10
            # once drained, the refused session's first call goes through under the same id
            rz = await z.call(prompt_tokens=1000, max_tokens=256, sim_output_tokens=7, call_id=f"{z.session_id}-0")
            assert rz.output_tokens == 7 and not rz.duplicate
            assert any(isinstance(e, CallQueued) for e in ev_y)
    finally:
        await svc.stop()


async def _queued_behind_a_long_call(c: TalariaClient, call_id: str | None = None, out: int = 6000
                                     ) -> tuple[asyncio.Future[CallReply], asyncio.Future[CallReply], Any]:
    """A long call of MODEL_B running (its model's turn), and then a call of MODEL_A queued
    behind it: (the long call, the queued call, the queued call's session)."""
    x = await c.open_session(MODEL_B)
    ev_x: list[Any] = []
    tx = asyncio.ensure_future(x.call(prompt_tokens=3000, max_tokens=16384, sim_output_tokens=out, on_event=ev_x.append))
    await until(lambda: _has(ev_x, CallRunning), 15, "X never ran")
    y = await c.open_session(MODEL_A)
    ev_y: list[Any] = []
    ty = asyncio.ensure_future(y.call(prompt_tokens=1000, max_tokens=256, sim_output_tokens=10,
                                      call_id=call_id or f"{y.session_id}-0", on_event=ev_y.append))
    await until(lambda: _has(ev_y, CallQueued), 10, "Y never queued")
    return tx, ty, y


async def test_a_call_whose_agent_gives_up_while_it_is_queued_is_dropped_not_run_later(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str, tmp_path: Path) -> None:
    """Only an engine heard an agent's cancel, and only of a call it held: one still in
    admission's queue ran later for nobody, its model given a turn (a switch) for it
    alone. Admission drops it; the session's next call is served as usual."""
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs",
                   models=[MODEL_A, MODEL_B])
    await svc.start()
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix,
                                               silence_s=30.0, retries=0) as c:
            tx, ty, y = await _queued_behind_a_long_call(c)
            gone = f"{y.session_id}-0"
            ty.cancel()  # the agent gives up: its client sends CancelCall
            with contextlib.suppress(asyncio.CancelledError):
                await ty
            admission_log = tmp_path / "logs" / f"{svc.admission}.log"
            await until(lambda: "admission.cancelled_while_queued" in admission_log.read_text(), 10,
                        "admission kept the abandoned call queued")

            async def none_queued() -> bool:
                return int((await svc_redis_hash(svc)).get(b"queued", b"1")) == 0
            await until(none_queued, 10, "the abandoned call still counts as queued")
            assert (await asyncio.wait_for(tx, 60)).output_tokens == 6000
            await asyncio.sleep(1.0)
            dispatched = [line for line in admission_log.read_text().splitlines()
                          if "admission.dispatched" in line and gone in line]
            assert not dispatched, dispatched
            assert gone not in (tmp_path / "logs" / f"{svc.engine(MODEL_A)}.log").read_text()
            # the session goes on: its next call (and the abandoned one asked again) are served
            again = await asyncio.wait_for(y.call(prompt_tokens=1000, max_tokens=256, sim_output_tokens=7,
                                                  call_id=gone), 30)
            assert again.output_tokens == 7 and not again.duplicate
    finally:
        await svc.stop()


async def test_a_call_id_in_flight_for_another_session_is_refused_as_malformed_not_no_capacity(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str, tmp_path: Path) -> None:
    """Admission refuses a call id already queued for another session; the router took that
    for a full server and told the agent `no_capacity` with a retry-after, so it retried
    in vain until the other call ended."""
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs",
                   models=[MODEL_A, MODEL_B])
    await svc.start()
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix,
                                               silence_s=30.0, retries=0) as c:
            tx, ty, _ = await _queued_behind_a_long_call(c, call_id="shared-id", out=4000)
            with pytest.raises(TalariaError) as refused:  # (another agent: its own inbox)
                async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix,
                                                       silence_s=30.0, retries=0) as other:
                    z = await other.open_session(MODEL_A)
                    await z.call(prompt_tokens=1000, max_tokens=256, sim_output_tokens=10, call_id="shared-id")
            assert refused.value.code == "malformed" and "another session" in refused.value.message
            assert not isinstance(refused.value, NoCapacity)
            assert (await asyncio.wait_for(ty, 60)).output_tokens == 10  # the first is served as usual
            await asyncio.wait_for(tx, 60)
    finally:
        await svc.stop()


@pytest.mark.parametrize("restarted", [False, True])
async def test_idle_session_releases_reservation_and_kv(nats_server: NatsServer, redis_server: RedisServer,
                                                        subject_prefix: str, key_prefix: str, tmp_path: Path,
                                                        restarted: bool) -> None:
    """`restarted`: admission restarts while the session is at rest. It knew when each
    session was last seen only in memory, so such a session was never released (a soak:
    217 sessions' KV and claims kept for hours, host KV growing); the time is kept in
    Redis beside the calls (`adm:<server>:sessions`) and read back, so the new process
    releases it in its turn, and forgets it then."""
    idle_s = 600 if restarted else 20  # (6 wall s at 100x: the restart comes well before)
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs",
                   models=[MODEL_A], policy="talaria", extra_env={"TALARIA_SESSION_IDLE_S": str(idle_s)})
    await svc.start()
    keys = Keys(key_prefix)
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix) as c:
            s = await c.open_session(MODEL_A)
            await s.call(prompt_tokens=2000, max_tokens=256, sim_output_tokens=10)
            assert await r.hget(keys.kv_locality(s.session_id), SERVER) is not None
            if restarted:
                await until(lambda: r.hexists(keys.admission_sessions(SERVER), s.session_id), 5)
                await svc.restart(svc.admission)  # nothing of the session queued or running
                assert not [d for d in svc.log_lines(svc.admission)
                            if d.get("event") == "admission.session_idle_released"]

            async def released() -> bool:
                return any(d.get("event") == "engine.session_released" and d.get("session_id") == s.session_id
                           for d in svc.log_lines(svc.engine(MODEL_A)))
            await until(released, 20, "the idle session was never released")
            rel = [d for d in svc.log_lines(svc.engine(MODEL_A)) if d.get("event") == "engine.session_released"]
            assert rel[-1]["kv_tokens"] > 0, rel
            assert await r.get(keys.reservation(s.session_id)) is None
            assert await r.hget(keys.kv_locality(s.session_id), SERVER) is None
            adm = [d for d in svc.log_lines(svc.admission) if d.get("event") == "admission.session_idle_released"]
            assert adm and adm[-1]["idle_s"] >= idle_s
            await until(lambda: _not(r.hexists(keys.admission_sessions(SERVER), s.session_id)), 5)
            # a session that comes back after release is served (from scratch)
            again = await s.call(prompt_tokens=2500, prefix_tokens=2010, max_tokens=256, sim_output_tokens=5)
            assert again.output_tokens == 5 and again.cached_tokens == 0
    finally:
        await r.aclose()
        await svc.stop()


async def _not(check: Any) -> bool:
    return not await check


async def black_hole(url: str, subject: str, queue: str, taken: list[float], leave_after: int | None = None) -> Any:
    """A NATS client in `queue`'s group on `subject` that takes its share of the
    messages and never answers them (a peer that died holding them); it notes when.
    `leave_after`: it leaves the group once it has taken that many (messages lost with
    a node, not a member that eats half of them forever: NATS picks a member at random,
    so a command sent again once a second can meet it several times in a row)."""
    from nats.aio.client import Client as NATS

    hole = NATS()
    await hole.connect(url)
    sub: Any = None

    async def take(msg: Any) -> None:
        taken.append(time.monotonic())
        if leave_after is not None and len(taken) >= leave_after and sub is not None:
            await sub.unsubscribe()

    sub = await hole.subscribe(subject, queue=queue, cb=take)
    await hole.flush()
    return hole


async def call_until_dropped(sessions: list[Any], dropped: list[float], *, wait_s: float, tries: int = 20) -> float:
    """Calls on each of `sessions` in turn (two models: a model switch each time) until a
    black hole has dropped two messages, each served in full; the slowest one's wall seconds."""
    n, slowest = 0, 0.0
    while len(dropped) < 2 and n < tries:
        n += 1
        for sess in sessions:
            t0 = time.monotonic()
            r = await asyncio.wait_for(sess.call(prompt_tokens=300 + 100 * n, max_tokens=16, sim_output_tokens=2), wait_s)
            assert r.output_tokens == 2
            slowest = max(slowest, time.monotonic() - t0)
    return slowest


async def test_a_dispatch_lost_on_the_bus_is_sent_again(nats_server: NatsServer, redis_server: RedisServer,
                                                        subject_prefix: str, key_prefix: str, tmp_path: Path) -> None:
    """A black hole joins the engine's queue group on its run subject, so NATS hands it
    about half of admission's dispatches, which it drops, until it has dropped two. Each call still finishes in
    moments: admission sends a dispatch until the engine acknowledges it (and heartbeats
    only acknowledged runs as running), instead of waiting forever on a run nobody has."""
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs", models=[MODEL_A])
    await svc.start()
    dropped: list[float] = []  # neither run nor acknowledged: lost
    # it leaves after the two drops the test needs: a member that stays takes each resend
    # with even odds, and a run of eight in a row outlasts a call's wait
    hole = await black_hole(nats_server.url, svc.subjects.engine_run(SERVER, MODEL_A), "engine", dropped,
                            leave_after=2)
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix, silence_s=60.0) as c:
            await call_until_dropped([await c.open_session(MODEL_A)], dropped, wait_s=10.0, tries=30)
        assert len(dropped) >= 2, "the black hole never got a dispatch: the test proved nothing"
        redispatched = [d for d in svc.log_lines(svc.admission) if d.get("event") == "admission.redispatch"]
        assert redispatched and all(d["reason"] == "no acknowledgement" for d in redispatched)
        assert max(engine_counts(svc, "engine.started").values()) == 1  # each call ran once
    finally:
        await hole.close()
        await svc.stop()


async def test_a_submit_lost_with_its_admission_holds_up_no_other_call(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """A black hole joins admission's queue group on the submit subject and never
    answers: an admission that took a submit and died. The router waits out that
    submit's timeout (5 s); other agents' calls meanwhile are served at once. When
    the router handled its requests one after another, every call behind the lost
    submit waited for its timeout (a chaos run stalled all sessions that way)."""
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs", models=[MODEL_A])
    await svc.start()
    swallowed: list[float] = []  # taken, never answered
    hole = await black_hole(nats_server.url, svc.subjects.admission_submit(SERVER), "admission", swallowed)
    pending: list[asyncio.Task] = []
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix, silence_s=60.0,
                                               retries=0) as c:
            served_at: float | None = None
            for n in range(40):
                sess = await c.open_session(MODEL_A)
                before = len(swallowed)
                t = asyncio.create_task(sess.call(prompt_tokens=400 + n, max_tokens=16, sim_output_tokens=2))
                pending.append(t)
                await until(lambda: t.done() or len(swallowed) > before, 10.0)
                if swallowed and t.done() and len(swallowed) == before:
                    assert (await t).output_tokens == 2
                    served_at = time.monotonic()
                    break
            assert swallowed, "the black hole never took a submit: the test proved nothing"
            assert served_at is not None
            # served while the lost submit was still waiting out its 5-s timeout
            assert served_at - swallowed[0] < 3.0, f"served {served_at - swallowed[0]:.1f} s after the lost submit"
    finally:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await hole.close()
        await svc.stop()


async def test_a_switch_request_lost_on_the_bus_is_asked_again(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """A black hole joins the substrate's queue group on the switch subject and drops
    what it gets: a switch request lost on the bus. The substrate acknowledges a
    request on receipt, so admission asks again after a second instead of waiting
    out its switch timeout (36 s at this time scale), and calls for both models,
    which need a switch each time, are served in moments."""
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs",
                   models=[MODEL_A, MODEL_B])
    await svc.start()
    dropped: list[float] = []
    hole = await black_hole(nats_server.url, svc.subjects.substrate_switch(SERVER), "substrate", dropped, leave_after=2)
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix, silence_s=60.0) as c:
            sessions = [await c.open_session(MODEL_A), await c.open_session(MODEL_B)]
            slowest = await call_until_dropped(sessions, dropped, wait_s=20.0)
            assert slowest < 6.0, f"served after {slowest:.1f} s"
        assert len(dropped) >= 2, "the black hole never took a switch request: the test proved nothing"
        assert "no word from the substrate" in svc.log_tail(svc.admission, 400)
    finally:
        await hole.close()
        await svc.stop()


async def test_redis_commands_wait_out_an_outage_for_their_budget_then_fail(redis_server: RedisServer) -> None:
    """The services' Redis retry (`BoundedRetry`): a stopped Redis (it accepts connections
    and answers nothing) fails a command once the budget is spent, where attempts alone
    had left it waiting for ever; one back within the budget is waited out."""
    import os
    import signal

    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from shared.bus import BoundedRetry

    pool = aioredis.BlockingConnectionPool.from_url(
        redis_server.url, max_connections=4, timeout=30, socket_timeout=0.5,
        retry=BoundedRetry(ExponentialBackoff(cap=0.5, base=0.05), retries=1000, budget_s=1.5),
        retry_on_error=[RedisConnectionError, RedisTimeoutError])
    r = aioredis.Redis.from_pool(pool)
    assert redis_server.pid is not None
    try:
        await r.set("k", "v")
        os.kill(redis_server.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(RedisTimeoutError):
                await r.get("k")
            took = time.monotonic() - t0
            assert 1.5 <= took < 10.0, took  # (the budget, then the attempt under way)

            async def resume() -> None:
                await asyncio.sleep(0.8)
                os.kill(redis_server.pid, signal.SIGCONT)  # type: ignore[arg-type]

            resumed = asyncio.ensure_future(resume())
            assert await r.get("k") == b"v"  # back within the budget: waited out
            await resumed
        finally:
            os.kill(redis_server.pid, signal.SIGCONT)
    finally:
        await r.aclose()


@pytest.mark.timeout(90)
async def test_a_process_says_on_its_metrics_when_it_cannot_reach_redis(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """`talaria_dependency_up{dependency="redis"}` falls to 0 while Redis is stopped and
    comes back with it (TalariaDependencyDown pages on it); NATS's stays 1. Before, no
    metric said so: a stall before admission showed only in the gateway's 5xx."""
    import aiohttp

    from shared.bus import REDIS_UP_WITHIN_S
    from shared.net import free_port

    port = free_port()
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs",
                   models=[MODEL_A], which=("router",),
                   extra_env={"TALARIA_METRICS_PORT": str(port), "TALARIA_METRICS_HOST": "127.0.0.1"})
    await svc.start()

    async def up() -> dict[str, float]:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
                text = await r.text()
        return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("talaria_dependency_up{")}

    assert redis_server.pid is not None
    try:
        await until(lambda: _async_is(up, {"nats": 1.0, "redis": 1.0}), 10, "never up")
        os.kill(redis_server.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            await until(lambda: _async_is(up, {"nats": 1.0, "redis": 0.0}), 15, "Redis never reported down")
            assert time.monotonic() - t0 >= REDIS_UP_WITHIN_S - 1.5
        finally:
            os.kill(redis_server.pid, signal.SIGCONT)
        await until(lambda: _async_is(up, {"nats": 1.0, "redis": 1.0}), 20, "Redis never reported back")
    finally:
        await svc.stop()


async def _async_is(read: Any, want: Any) -> bool:
    return await read() == want


@pytest.mark.timeout(120)
async def test_a_stopped_redis_is_unavailable_to_agents_and_holds_up_no_switch(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """Redis stopped (SIGSTOP), not dead: an agent opening a session hears `unavailable`
    within its own request timeout (the router's Redis wait is shorter than it), and a
    model switch completes (the substrate's mirror for the router is written once Redis
    answers). Before, both waited on the stopped Redis for as long as it stayed stopped."""
    import os
    import signal

    from nats.aio.client import Client as NATS

    from shared.agent_client import Unavailable
    from shared.schema import SwitchRequest, SwitchResult, encode, switch_reply_decoder

    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs",
                   models=[MODEL_A, MODEL_B])
    await svc.start()
    nc = NATS()
    await nc.connect(nats_server.url)
    assert redis_server.pid is not None
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix, retries=0) as c:
            sess = await c.open_session(MODEL_A)  # (warm: every service's Redis connections are open)
            assert (await sess.call(prompt_tokens=300, max_tokens=8, sim_output_tokens=2)).output_tokens == 2
            os.kill(redis_server.pid, signal.SIGSTOP)
            try:
                with pytest.raises(Unavailable) as e:  # (the client's own request timeout: 5 s)
                    await c.open_session(MODEL_A)
                assert "session store (Redis)" in e.value.message and e.value.retry_after_s
                resp = await nc.request(svc.subjects.substrate_switch(SERVER),
                                        encode(SwitchRequest(from_model=MODEL_A, to_model=MODEL_B)), timeout=60.0)
                assert isinstance(switch_reply_decoder.decode(resp.data), SwitchResult)
            finally:
                os.kill(redis_server.pid, signal.SIGCONT)
        r = aioredis.Redis.from_url(redis_server.url)
        try:  # the substrate's view catches up once Redis answers
            await until(lambda: _resident_is(r, Keys(key_prefix), MODEL_B), 15.0)
        finally:
            await r.aclose()
    finally:
        await nc.close()
        await svc.stop()


@pytest.mark.timeout(120)
async def test_a_call_that_ends_while_redis_is_stopped_is_answered_and_its_state_follows(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """Redis stopped (SIGSTOP) while calls generate, longer than a command's retries last:
    each call is answered when its generation ends, streamed ones token by token, and
    the sessions' finishes reach Redis, in order, once it answers; streaming still works
    after. Before, the answer waited on its session's state write for as long as Redis
    stayed stopped (the engine finished the generation and held the reply)."""
    import os
    import signal

    from shared.bus import REDIS_OUTAGE_WAIT_S
    from shared.schema import CallTokens

    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs", models=[MODEL_A])
    await svc.start()
    assert redis_server.pid is not None
    batches: Counter[str] = Counter()

    def on_event(ev: Any) -> None:
        if isinstance(ev, CallTokens):
            batches[ev.call_id] += 1

    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix, retries=0) as c:
            sessions = [await c.open_session(MODEL_A) for _ in range(4)]  # (opened while Redis answers)
            assert (await sessions[0].call(prompt_tokens=300, max_tokens=8, sim_output_tokens=2)).output_tokens == 2
            calls = [asyncio.ensure_future(s.call(prompt_tokens=300, max_tokens=25000, sim_output_tokens=20000,
                                                  call_id=f"stall-{i}", stream=i % 2 == 0, on_event=on_event))
                     for i, s in enumerate(sessions)]
            await asyncio.sleep(0.5)
            os.kill(redis_server.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                # answered while Redis is still stopped, well inside a command's retry budget
                replies = await asyncio.wait_for(asyncio.gather(*calls), timeout=REDIS_OUTAGE_WAIT_S - 2)
                assert [r.output_tokens for r in replies] == [20000] * 4
                assert batches["stall-0"] > 1 and batches["stall-2"] > 1, batches  # streamed as generated
                await asyncio.sleep(max(0.0, REDIS_OUTAGE_WAIT_S + 2 - (time.monotonic() - stopped)))
            finally:
                os.kill(redis_server.pid, signal.SIGCONT)
            r = aioredis.Redis.from_url(redis_server.url)
            try:  # the finishes were kept and written once Redis answered
                keys = Keys(key_prefix)

                async def finished() -> bool:
                    return all([await r.hget(keys.session(s.session_id), "last_finish") for s in sessions[1:]])
                await until(finished, 15.0)
            finally:
                await r.aclose()
            batches.clear()
            after = await sessions[1].call(prompt_tokens=300, max_tokens=25000, sim_output_tokens=20000, call_id="after",
                                           stream=True, on_event=on_event)
            assert after.output_tokens == 20000 and batches["after"] > 1, batches
    finally:
        await svc.stop()


@pytest.mark.timeout(150)
async def test_a_switch_while_redis_is_stopped_is_not_held_until_it_returns(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """Redis stopped (SIGSTOP): a call whose model is not the active one is served
    after its switch, while Redis is still stopped, and so is the switch back. Before,
    admission's reservation claims and releases and the substrate's view each waited
    out the Redis commands' retry budget inside the switch (a probe: a call queued
    across a 30-s stop was dispatched 0.05 s after Redis came back)."""
    import os
    import signal

    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs",
                   models=[MODEL_A, MODEL_B], policy="talaria")
    await svc.start()
    assert redis_server.pid is not None
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix, retries=0) as c:
            sa, sb = await c.open_session(MODEL_A), await c.open_session(MODEL_B)  # (opened while Redis answers)
            await sa.call(prompt_tokens=300, max_tokens=8, sim_output_tokens=4)
            # a long call keeps A active; B's call waits in admission for its turn (placed while Redis answers)
            a = asyncio.ensure_future(sa.call(prompt_tokens=400, max_tokens=25000, sim_output_tokens=20000))
            await asyncio.sleep(0.3)
            b = asyncio.ensure_future(sb.call(prompt_tokens=300, max_tokens=8, sim_output_tokens=4))
            await asyncio.sleep(0.3)
            os.kill(redis_server.pid, signal.SIGSTOP)
            try:
                # A's call ends, the server switches to B and B's call is served, Redis still stopped
                done = await asyncio.wait_for(asyncio.gather(a, b), 12.0)
                assert [r.output_tokens for r in done] == [20000, 4]
            finally:
                os.kill(redis_server.pid, signal.SIGCONT)
            assert (await sa.call(prompt_tokens=500, max_tokens=8, sim_output_tokens=4)).output_tokens == 4
    finally:
        await svc.stop()


async def test_ordered_writes_land_in_order_through_an_outage_and_say_when_they_are_behind() -> None:
    """`OrderedWrites`: the writes reach Redis in the order they were made, each retried
    while Redis is away (none dropped, none reordered), and `behind` tells a caller when
    the head of the queue has waited past its patience, so it need not wait too."""
    import structlog
    from redis.exceptions import ConnectionError as RedisConnectionError

    from shared.bus import OrderedWrites

    landed: list[str] = []
    away = {"failures": 3}

    class Pipe:
        def __init__(self) -> None:
            self.cmds: list[str] = []

        def set(self, key: str) -> None:
            self.cmds.append(key)

        async def execute(self) -> None:
            await asyncio.sleep(0.01)
            if away["failures"] > 0:
                away["failures"] -= 1
                raise RedisConnectionError("Redis is away")
            landed.extend(self.cmds)

    class Redis:
        def pipeline(self, transaction: bool = True) -> Pipe:
            return Pipe()

    writes = OrderedWrites(lambda: Redis(), lambda: structlog.get_logger(), "test")  # type: ignore[arg-type,return-value]
    writes.RETRY_WALL_S = 0.05
    task = asyncio.ensure_future(writes.run())
    try:
        assert not writes.behind(0.1)
        done = [writes.write(lambda p, k=k: p.set(k)) for k in ("a", "b", "c")]
        await asyncio.sleep(0.12)
        assert writes.behind(0.1) and not done[0].done()  # (still failing: later ones wait behind it)
        await asyncio.wait_for(asyncio.gather(*done), 5.0)
        assert landed == ["a", "b", "c"] and not writes.behind(0.1) and not writes.late
        await asyncio.wait_for(writes.write(lambda p: p.set("d")), 1.0)
        assert landed == ["a", "b", "c", "d"]
    finally:
        task.cancel()


async def _resident_is(r: aioredis.Redis, keys: Keys, model: str) -> bool:
    from shared.state import decode_server
    return decode_server(await r.hgetall(keys.server(SERVER))).substrate.resident == model


async def test_a_stalled_redis_holds_up_admissions_ack_for_half_a_second_at_most(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """Redis stopped (SIGSTOP): admission acknowledges a submit after at most
    `PERSIST_WAIT_WALL_S` and its persister writes the call once Redis is back.
    Before, the ack waited for Redis, and every submit behind it with it."""
    import os
    import signal

    from nats.aio.client import Client as NATS
    from shared.schema import AdmissionCall, EngineHint, EnginePayload, SubmitCall, Submitted, encode

    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs", models=[MODEL_A])
    await svc.start()
    nc = NATS()
    await nc.connect(nats_server.url)
    assert redis_server.pid is not None
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix) as c:
            sess = await c.open_session(MODEL_A)  # (warm: admission's Redis connection is open)
            assert (await sess.call(prompt_tokens=300, max_tokens=8, sim_output_tokens=2)).output_tokens == 2
        # a long call (about 50 wall s at this time scale): still held, so still in the hash, when we look
        sub = SubmitCall(call=AdmissionCall(call_id="stall-1", session_id="stall-s", model=MODEL_A, prompt_tokens=100,
                                            prefix_tokens=0, max_tokens=30000, arrived_at=0.0, continuation=False),
                         reply_to=f"{subject_prefix}.reply.agent.test.stall-1",
                         engine=EnginePayload(hint=EngineHint(sim_output_tokens=30000)))
        os.kill(redis_server.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            resp = await nc.request(svc.subjects.admission_submit(SERVER), encode(sub), timeout=4.0)
            took = time.monotonic() - t0
        finally:
            os.kill(redis_server.pid, signal.SIGCONT)
        assert msgspec.json.decode(resp.data, type=Submitted).call_id == "stall-1"
        assert took < 1.5, f"acknowledged after {took:.2f} s"
        r = aioredis.Redis.from_url(redis_server.url)
        try:  # written once Redis is back
            await until(lambda: r.hexists(Keys(key_prefix).admission_calls(SERVER), "stall-1"), 10.0)
        finally:
            await r.aclose()
    finally:
        await nc.close()
        await svc.stop()


@contextlib.asynccontextmanager
async def router_and_fake_admissions(nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str,
                                     key_prefix: str, tmp_path: Path, session_id: str,
                                     policy: str = "baseline") -> AsyncIterator[Any]:
    """A router for servers s0 and s1 whose admissions are fakes that take every call,
    and an open session: (the services, a client, the call ids each admission was asked
    to take, each admission's subscription: unsubscribe it and that admission is away)."""
    from nats.aio.client import Client as NATS

    from shared.schema import ApiError, OpenSession, Submitted, admission_decoder, api_reply_decoder, encode

    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs",
                   models=[MODEL_A], which=("router",), extra_env={"TALARIA_SERVERS": "s0,s1"}, policy=policy)
    await svc.start()
    nc = NATS()
    await nc.connect(nats_server.url)
    got: dict[str, list[str]] = {"s0": [], "s1": []}
    subs = {}
    try:
        for server in got:
            async def take(msg: Any, server: str = server) -> None:
                sub = admission_decoder.decode(msg.data)
                got[server].append(sub.call.call_id)
                await nc.publish(msg.reply, encode(Submitted(call_id=sub.call.call_id, server_id=server)))
            subs[server] = await nc.subscribe(svc.subjects.admission_submit(server), cb=take)
        resp = await nc.request(svc.subjects.api_session_open(), encode(OpenSession(session_id=session_id, model=MODEL_A)), 5)
        assert not isinstance(api_reply_decoder.decode(resp.data), ApiError)
        yield svc, nc, got, subs
    finally:
        await nc.close()
        await svc.stop()


async def test_a_retried_call_stays_on_the_server_that_holds_it(nats_server: NatsServer, redis_server: RedisServer,
                                                                 subject_prefix: str, key_prefix: str,
                                                                 tmp_path: Path) -> None:
    """A retry of a call that has no reply yet goes back to the server that took it,
    never to another one whose engine would run it a second time; if that server's
    admission does not answer (restarting), the agent hears unavailable and retries later."""
    from shared.schema import ApiError, CallRequest
    from test_services import call_raw

    async with router_and_fake_admissions(nats_server, redis_server, subject_prefix, key_prefix, tmp_path,
                                          "pin") as (svc, nc, got, subs):
        call = CallRequest(call_id="pin#0", session_id="pin", model=MODEL_A, prompt_tokens=1000)
        first = await call_raw(nc, svc.subjects, call)
        holder = first.server_id
        other = "s1" if holder == "s0" else "s0"
        for _ in range(3):  # the agent heard nothing more and retries
            again = await call_raw(nc, svc.subjects, call)
            assert again.server_id == holder, again
        await subs[holder].unsubscribe()  # the holder's admission is away (restarting, say)
        refused = await call_raw(nc, svc.subjects, call, timeout=15.0)
        assert isinstance(refused, ApiError) and refused.code == "unavailable", refused
        assert got[other] == [], f"the retry was placed on {other}, which would run the call again"
        assert got[holder] == ["pin#0"] * 4


async def test_a_call_waits_out_an_admission_restarting_and_is_not_refused_as_if_servers_were_full(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """Every admission is away for a moment (killed, its replacement starting): the
    router asks again for a few seconds, so the call is taken when one is back; only an
    admission away for longer is answered, and as unavailable (retry), not no_capacity."""
    from shared.schema import ApiError, CallRequest, Submitted, admission_decoder, encode
    from test_services import call_raw

    async with router_and_fake_admissions(nats_server, redis_server, subject_prefix, key_prefix, tmp_path,
                                          "back") as (svc, nc, got, subs):
        for sub in subs.values():
            await sub.unsubscribe()
        call = CallRequest(call_id="back#0", session_id="back", model=MODEL_A, prompt_tokens=1000)
        pending = asyncio.ensure_future(call_raw(nc, svc.subjects, call, timeout=15.0))
        await asyncio.sleep(1.0)  # the replacement comes up

        async def take(msg: Any) -> None:
            sub = admission_decoder.decode(msg.data)
            got["s1"].append(sub.call.call_id)
            await nc.publish(msg.reply, encode(Submitted(call_id=sub.call.call_id, server_id="s1")))

        back = await nc.subscribe(svc.subjects.admission_submit("s1"), cb=take)
        taken = await pending
        assert isinstance(taken, CallAccepted) and taken.server_id == "s1", taken
        await back.unsubscribe()
        away = await call_raw(nc, svc.subjects, CallRequest(call_id="back#1", session_id="back", model=MODEL_A,
                                                            prompt_tokens=1200, prefix_tokens=1000), timeout=15.0)
        assert isinstance(away, ApiError) and away.code == "unavailable", away


async def test_a_continuation_waits_a_moment_for_the_admission_of_the_server_holding_its_kv(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """The admission of the server that holds a session's KV restarts (away for 0.4 s,
    as a warm spare takes over) just as the session's next call comes: the call waits
    for it instead of moving to the other server, where its whole prefix would be
    prefilled again. A server whose admission stays away is left after about a second."""
    from shared.schema import CallRequest, Submitted, admission_decoder, encode
    from test_services import call_raw

    async with router_and_fake_admissions(nats_server, redis_server, subject_prefix, key_prefix, tmp_path,
                                          "home", policy="talaria") as (svc, nc, got, subs):
        first = await call_raw(nc, svc.subjects, CallRequest(call_id="home#0", session_id="home", model=MODEL_A,
                                                              prompt_tokens=20_000))
        holder = first.server_id
        other = "s1" if holder == "s0" else "s0"
        r = aioredis.Redis.from_url(redis_server.url)
        try:
            await r.hset(Keys(key_prefix).kv_locality("home"), holder, "hbm")  # (its engine's report)
        finally:
            await r.aclose()

        async def take(msg: Any) -> None:
            sub = admission_decoder.decode(msg.data)
            got[holder].append(sub.call.call_id)
            await nc.publish(msg.reply, encode(Submitted(call_id=sub.call.call_id, server_id=holder)))

        await subs[holder].unsubscribe()  # restarting
        cont = CallRequest(call_id="home#1", session_id="home", model=MODEL_A, prompt_tokens=21_000,
                           prefix_tokens=20_000)
        pending = asyncio.ensure_future(call_raw(nc, svc.subjects, cont, timeout=15.0))
        await asyncio.sleep(0.4)
        subs[holder] = await nc.subscribe(svc.subjects.admission_submit(holder), cb=take)  # back
        taken = await pending
        assert isinstance(taken, CallAccepted) and taken.server_id == holder, taken
        assert "home#1" not in got[other], got

        await subs[holder].unsubscribe()  # away for good: the other server takes the next one
        t0 = time.monotonic()
        moved = await call_raw(nc, svc.subjects, CallRequest(call_id="home#2", session_id="home", model=MODEL_A,
                                                              prompt_tokens=22_000, prefix_tokens=21_000), timeout=15.0)
        assert isinstance(moved, CallAccepted) and moved.server_id == other, moved
        assert time.monotonic() - t0 < 3.0


async def test_copies_of_a_call_sent_at_once_are_each_answered_and_held_by_one_server(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """An agent's call and its resends arrive together: several find the call record
    still `placing`, each ranks and names a server, and one of those writes wins. Every
    copy is answered (the ones that lost as retries are: the server that holds it), and
    only that server is asked to run it."""
    from shared.schema import CallRequest
    from test_services import call_raw

    async with router_and_fake_admissions(nats_server, redis_server, subject_prefix, key_prefix, tmp_path,
                                          "many") as (svc, nc, got, _):
        for n in range(4):
            call = CallRequest(call_id=f"many#{n}", session_id="many", model=MODEL_A, prompt_tokens=1000)
            answers = await asyncio.gather(*(call_raw(nc, svc.subjects, call, timeout=10.0) for _ in range(6)))
            assert all(isinstance(a, CallAccepted) for a in answers), answers
            holders = {a.server_id for a in answers}
            assert len(holders) == 1, answers
            holder = holders.pop()
            assert call.call_id not in got["s1" if holder == "s0" else "s0"], got


async def test_a_reply_lost_and_redis_emptied_is_answered_again_not_generated_again(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """The engine finishes a call whose reply reaches no one (the agent's connection
    was moving to another NATS node), then Redis loses everything; the agent
    retries the call id. The retry is answered with the stored reply
    from the call record (JetStream, not Redis): the call is generated once. The
    session itself is still open (its record is durable too): no reopen needed."""
    from nats.aio.client import Client as NATS

    from shared.schema import CallRequest, EngineHint, OpenSession, encode
    from test_services import agent_inbox, call_until

    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs", models=[MODEL_A])
    await svc.start()
    nc = NATS()
    await nc.connect(nats_server.url)
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        await nc.request(svc.subjects.api_session_open(), encode(OpenSession(session_id="away", model=MODEL_A)), 5)
        call = CallRequest(call_id="away#0", session_id="away", model=MODEL_A, prompt_tokens=800, max_tokens=16,
                           engine_hint=EngineHint(sim_output_tokens=4), reply_to=agent_inbox(nc, svc.subjects))  # nobody listens there
        await nc.publish(svc.subjects.api_call(), encode(call))
        await until(lambda: engine_counts(svc, "engine.finished").get("away#0", 0) == 1, 30, "never finished")
        await r.flushall()  # the store restarts empty
        again = await call_until(nc, svc.subjects, call, 30.0)  # the agent's retry, without reopening
        assert again.duplicate and again.output_tokens == 4, again
        nxt = await call_until(nc, svc.subjects, msgspec.structs.replace(call, call_id="away#1", prompt_tokens=900), 30.0)
        assert not nxt.duplicate and nxt.output_tokens == 4, nxt
        await asyncio.sleep(1.0)  # a second generation, if one started, would show by now
        assert engine_counts(svc, "engine.started").get("away#0") == 1, "the call was generated again"
        assert engine_counts(svc, "engine.finished").get("away#0") == 1
    finally:
        await r.aclose()
        await nc.close()
        await svc.stop()


async def test_a_finish_lost_on_the_bus_is_re_derived_from_the_call_record(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """An engine acknowledges a run, answers it in the call record, and then both
    its reply and its `CallFinished` are lost (its NATS node died between publish
    and delivery, as in a chaos run). Admission, which heartbeats the call as
    running, would hold it for ever and the agent would never retry; instead it
    reads the record, sends the stored reply again and finishes the call."""
    from nats.aio.client import Client as NATS

    from shared.call_record import CallRecords
    from shared.keys import CALL_TTL_S
    from shared.schema import (
        CallReply, ControlOk, EngineState, ListCalls, RunAccepted, control_decoder, encode, run_decoder,
    )

    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs", models=[MODEL_A],
                   which=("router", "admission", "substrate"))
    eng = NATS()
    await eng.connect(nats_server.url)
    records = await CallRecords.open(eng, subject_prefix, replicas=1, ttl_s=CALL_TTL_S)
    runs: list[str] = []

    async def control(msg: Any) -> None:  # a fake engine: awake, runs nothing
        cmd = control_decoder.decode(msg.data)
        out = EngineState(awake=True, kv_capacity_tokens=500_000) if isinstance(cmd, ListCalls) else ControlOk()
        await eng.publish(msg.reply, encode(out))

    async def run(msg: Any) -> None:
        rc = run_decoder.decode(msg.data)
        runs.append(rc.call_id)
        await eng.publish(msg.reply, encode(RunAccepted(call_id=rc.call_id)))
        reply = CallReply(call_id=rc.call_id, session_id=rc.session_id, server_id=SERVER, model=MODEL_A,
                          prompt_tokens=rc.call.prompt_tokens, cached_tokens=0, restored_tokens=0,
                          reprefill_tokens=0, output_tokens=5, arrived_at=rc.call.arrived_at, finished_at=1.0,
                          waited_s=0.0, switch_wait_s=0.0, round_wait=False, restore_s=0.0, prefill_s=0.0,
                          decode_s=0.0)
        # claimed and answered as the real engine does (compare-and-set, racing the router's `placed`)
        claim = await records.claim(rc.session_id, rc.call_id, server_id=SERVER, owner="fake", epoch="1")
        if claim.outcome == "run":
            await records.answer(rc.session_id, rc.call_id, encode(reply), claim)
        # ... and neither the reply nor CallFinished is ever published: lost

    await eng.subscribe(svc.subjects.engine_control(SERVER, MODEL_A), queue="engine", cb=control)
    await eng.subscribe(svc.subjects.engine_run(SERVER, MODEL_A), queue="engine", cb=run)
    await eng.flush()
    await svc.start()
    try:
        # silence_s far above the test's deadline: only the reconciler can answer in time
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix, silence_s=120.0) as c:
            sess = await c.open_session(MODEL_A)
            got = await asyncio.wait_for(sess.call(prompt_tokens=700, max_tokens=16, sim_output_tokens=5), 30.0)
            assert got.output_tokens == 5 and runs == [got.call_id], (got, runs)
            second = await asyncio.wait_for(sess.call(prompt_tokens=900, max_tokens=16, sim_output_tokens=5), 30.0)
            assert second.output_tokens == 5  # the slot was freed: the next call runs too
        assert [d for d in svc.log_lines(svc.admission) if d.get("event") == "admission.finish_recovered"]
    finally:
        await eng.close()
        await svc.stop()


async def test_a_stopped_admission_that_resumes_after_its_replacement_stands_down(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """Admission is stopped (SIGSTOP) and a new one starts for its server, as a
    supervisor does; then the old one resumes. Each admission takes a durable epoch
    (the call record's bucket, not Redis) and every dispatch carries it: the engines
    refuse the old one's, and the old one sees a newer epoch within a second and
    exits. Calls go on being served once each."""
    import os
    import signal
    import sys

    from nats.aio.client import Client as NATS
    from shared.schema import ApiError, RunCall, AdmissionCall, EnginePayload, encode, dispatch_ack_decoder

    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs", models=[MODEL_A])
    await svc.start()
    old = svc.group[svc.admission]
    assert old.pid is not None
    old_pid = old.pid
    newer = svc.group.add("admission-new", [sys.executable, "-m", "services.admission"], env=dict(old.env or {}),
                          log_path=tmp_path / "logs" / "admission-new.log", inherit_env=False)
    nc = NATS()
    await nc.connect(nats_server.url)
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix, silence_s=5.0) as c:
            sess = await c.open_session(MODEL_A)
            assert (await sess.call(prompt_tokens=300, max_tokens=8, sim_output_tokens=2)).output_tokens == 2
            os.kill(old_pid, signal.SIGSTOP)
            svc.group.start("admission-new")
            await until(lambda: "admission.recovered" in newer.log_path.read_text() or
                        "service.started" in newer.log_path.read_text(), 30.0, "the new admission never started")
            # the engine has heard the new epoch: a dispatch under the old one is refused
            run = RunCall(call=AdmissionCall(call_id="old-1", session_id=sess.session_id, model=MODEL_A,
                                             prompt_tokens=100, prefix_tokens=0, max_tokens=4, arrived_at=0.0,
                                             continuation=False),
                          engine=EnginePayload(), reply_to=f"{subject_prefix}.reply.agent.x.old-1", reserved_tokens=104,
                          waited_s=0.0, switch_wait_s=0.0, round_wait=False, admission_epoch=1)
            ack = dispatch_ack_decoder.decode((await nc.request(svc.subjects.engine_run(SERVER, MODEL_A), encode(run),
                                                                timeout=5.0)).data)
            assert isinstance(ack, ApiError) and ack.code == "superseded", ack
            os.kill(old_pid, signal.SIGCONT)
            await until(lambda: not old.running, 10.0, "the resumed old admission never stood down")
            assert old.proc is not None and old.proc.returncode == 75
            assert "admission.superseded" in old.log_path.read_text()
            for n in range(3):  # served by the new one, once each
                r = await sess.call(prompt_tokens=400 + n * 100, max_tokens=8, sim_output_tokens=2)
                assert r.output_tokens == 2
        assert "old-1" not in engine_counts(svc, "engine.started")
        assert max(engine_counts(svc, "engine.started").values()) == 1
    finally:
        with contextlib.suppress(OSError):
            os.kill(old_pid, signal.SIGCONT)
        await nc.close()
        await svc.stop()


async def test_a_call_record_write_whose_ack_is_lost_is_retried_to_its_own_revision(
        nats_server: NatsServer, subject_prefix: str) -> None:
    """The bucket stores a write but its ack never arrives (the stream leader died
    after storing it, or answered after the client's short timeout). The retry is
    answered with that write's revision — a create is not taken for another
    router's, an update not for a lost race — and the record moves on once."""
    import nats.errors
    from nats.aio.client import Client as NATS

    from shared.call_record import CallRecords
    from shared.keys import CALL_TTL_S
    from shared.schema import CallRecord

    nc = NATS()
    await nc.connect(nats_server.url)
    try:
        records = await CallRecords.open(nc, subject_prefix, replicas=1, ttl_s=CALL_TTL_S)
        real_publish = records.js.publish
        lost: list[str] = []

        async def publish_ack_lost_once(subject: str, payload: bytes = b"", **kw: Any) -> Any:
            ack = await real_publish(subject, payload, **kw)
            if not lost:
                lost.append(subject)
                raise nats.errors.TimeoutError  # stored, but the client never hears it
            return ack

        records.js.publish = publish_ack_lost_once  # type: ignore[method-assign]
        rev = await records.create("s-1", "c-1", CallRecord(state="placing"))
        assert lost and rev is not None
        record, current = await records.get("s-1", "c-1")
        assert record is not None and record.state == "placing" and current == rev
        # another writer's create is refused: the id is taken
        assert await records.create("s-1", "c-1", CallRecord(state="placing")) is None
        lost.clear()
        rev2 = await records.update("s-1", "c-1", CallRecord(state="placed", server_id="s0"), rev)
        assert lost and rev2 is not None and rev2 > rev
        assert (await records.get("s-1", "c-1")) == (CallRecord(state="placed", server_id="s0"), rev2)
        # a stale writer (at the first revision) is refused
        assert await records.update("s-1", "c-1", CallRecord(state="placed", server_id="s1"), rev) is None
        # a released (deleted) key can be created again: its tombstone's revision is the one to write on
        await records.release("s-1", "c-1", rev2)
        assert (await records.get("s-1", "c-1"))[0] is None
        assert await records.create("s-1", "c-1", CallRecord(state="placing")) is not None
        # epochs go through the same write
        one = (await records.take_epoch("admission", "s0"))[0]
        assert (await records.take_epoch("admission", "s0"))[0] > one
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def _call_records(nats_server: NatsServer, subject_prefix: str) -> AsyncIterator[Any]:
    """A bucket of call records on its own NATS connection."""
    from shared.call_record import CallRecords
    from shared.keys import CALL_TTL_S

    nc = await nats.connect(nats_server.url)
    try:
        yield await CallRecords.open(nc, subject_prefix, replicas=1, ttl_s=CALL_TTL_S)
    finally:
        await nc.close()


async def test_a_retry_refused_as_still_in_process_is_waited_out(nats_server: NatsServer, subject_prefix: str) -> None:
    """A write's first try is stored but its ack is lost, and the retry reaches the stream
    while that try is still in process (JetStream's 10158, "duplicate message id is in
    process": seen in chaos runs while a NATS node was stopped). That is not an answer:
    the step waits it out and returns the first try's revision. It had been taken for a
    refusal and raised, failing the engine's claim or answer of a call it was running."""
    import nats.errors
    import nats.js.errors

    from shared.call_record import WRITE_IN_PROCESS
    from shared.schema import CallRecord

    async with _call_records(nats_server, subject_prefix) as records:
        real_publish = records.js.publish
        tries: list[str] = []

        async def publish(subject: str, payload: bytes = b"", **kw: Any) -> Any:
            tries.append(subject)
            if len(tries) == 2:
                raise nats.js.errors.BadRequestError(code=400, err_code=WRITE_IN_PROCESS,
                                                     description="duplicate message id is in process")
            ack = await real_publish(subject, payload, **kw)
            if len(tries) == 1:
                raise nats.errors.TimeoutError  # stored, but the client never hears it
            return ack

        records.js.publish = publish  # type: ignore[method-assign]
        rev = await records.create("s-1", "c-1", CallRecord(state="placing"))
        assert len(tries) == 3 and rev is not None
        assert await records.get("s-1", "c-1") == (CallRecord(state="placing"), rev)


async def test_the_call_record_bucket_keeps_to_its_bound_dropping_its_oldest_records(
        nats_server: NatsServer, subject_prefix: str) -> None:
    """Past `max_bytes` the bucket drops its oldest records, and every write still lands (a
    key-value bucket's own discard-new refused them: every call failed once the NATS store
    was full, which nothing bounded). An admission's epoch dropped with them is written again
    by its refresh, and a successor's epoch is still newer (counting from 1 again, every
    engine would refuse it as older than the one it last heard)."""
    from nats.aio.client import Client as NATS

    from shared.call_record import CallRecords
    from shared.keys import CALL_TTL_S
    from shared.schema import CallRecord

    bound = 256 * 1024
    nc = NATS()
    await nc.connect(nats_server.url)
    try:
        records = await CallRecords.open(nc, subject_prefix, replicas=1, ttl_s=CALL_TTL_S, max_bytes=bound)
        first, first_rev = await records.take_epoch("admission", "s0")
        # a long call claimed before the flood: its record is dropped while it runs
        placed = await records.create("sess-long", "long", CallRecord(state="placed", server_id="s0"))
        claim = await records.claim("sess-long", "long", server_id="s0", owner="w0", epoch="e1",
                                    placed_revision=placed or 0)
        assert claim.outcome == "run"
        reply = b"r" * 4096  # (a real engine's reply: its text and token ids)
        n = 3 * bound // len(reply)
        for i in range(n):
            rev = await records.create("sess", f"c-{i}", CallRecord(state="placing"))
            assert rev is not None
            assert await records.update("sess", f"c-{i}", CallRecord(state="answered", reply=reply), rev) is not None
        size, oldest = await records.usage()
        assert 0 < size <= bound and oldest is not None and oldest < 60
        assert (await records.get("sess", "c-0"))[0] is None  # dropped early
        # the long call is answered all the same (it had been taken as fenced: no reply, no finish,
        # and its admission counted it running for ever), and its answer is stored again
        assert (await records.get("sess-long", "long"))[0] is None
        assert await records.answer("sess-long", "long", b"the long reply", claim) == (b"the long reply", True)
        assert (await records.answered_reply("sess-long", "long")) == b"the long reply"
        assert (await records.get("sess", f"c-{n - 1}"))[0] is not None
        assert (await records.current_epoch("admission", "s0"))[0] == 0  # the epoch was dropped too
        assert await records.refresh_epoch("admission", "s0", first, first_rev) is not None  # and is written again
        assert (await records.current_epoch("admission", "s0"))[0] == first
        assert (await records.take_epoch("admission", "s0"))[0] > first
        # a second process opening it with the same bound changes nothing; the bound is the stream's
        again = await CallRecords.open(nc, subject_prefix, replicas=1, ttl_s=CALL_TTL_S, max_bytes=bound)
        assert (await again.js.stream_info(again.stream)).config.max_bytes == bound
    finally:
        await nc.close()


async def test_a_claim_on_the_placements_revision_reads_nothing_and_one_that_moved_reads_again(
        nats_server: NatsServer, subject_prefix: str) -> None:
    """The engine claims on the revision of the router's placement, which the run
    carries: one write, no read. When the record moved on since (a retry placed it
    again, another worker claimed it, this worker's earlier process did), it reads
    the record and decides as without it."""
    from nats.aio.client import Client as NATS

    from shared.call_record import CallRecords
    from shared.keys import CALL_TTL_S
    from shared.schema import CallRecord

    nc = NATS()
    await nc.connect(nats_server.url)
    try:
        records = await CallRecords.open(nc, subject_prefix, replicas=1, ttl_s=CALL_TTL_S)
        real_get = records.get
        gets: list[str] = []

        async def counted_get(session_id: str, call_id: str) -> Any:
            gets.append(call_id)
            return await real_get(session_id, call_id)

        records.get = counted_get  # type: ignore[method-assign]
        rev = await records.create("s-1", "c-1", CallRecord(state="placing"))
        assert rev is not None
        placed = await records.update("s-1", "c-1", CallRecord(state="placed", server_id="s0"), rev)
        assert placed is not None
        claim = await records.claim("s-1", "c-1", server_id="s0", owner="w0", epoch="e1", placed_revision=placed)
        assert claim.outcome == "run" and claim.revision > placed and gets == []
        # a resend of the same run to the same process: the revision moved (its own claim); read, run again
        again = await records.claim("s-1", "c-1", server_id="s0", owner="w0", epoch="e1", placed_revision=placed)
        assert again.outcome == "run" and again.revision == claim.revision and gets == ["c-1"]
        # another worker with the stale placement revision: held elsewhere, never run twice
        other = await records.claim("s-1", "c-1", server_id="s1", owner="w1", epoch="e9", placed_revision=placed)
        assert other.outcome == "held_elsewhere" and other.record.owner == "w0"
        # answered: a late claim on the old revision gets the stored reply
        await records.answer("s-1", "c-1", b"reply", claim)
        late = await records.claim("s-1", "c-1", server_id="s0", owner="w0", epoch="e2", placed_revision=placed)
        assert late.outcome == "answered" and late.record.reply == b"reply"
    finally:
        await nc.close()


async def test_a_call_taken_by_a_router_that_never_answers_is_sent_again_soon(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """A black hole joins the routers' queue group on the call subject: a router that
    took calls and then hung (SIGSTOP) or died. NATS delivered them, so no 503 comes
    back; the client, having heard nothing at all, sends each again after about a
    second (its accept timer) instead of after its whole silence (60 s here), and
    every call is served once."""
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs", models=[MODEL_A])
    await svc.start()
    swallowed: list[float] = []
    hole = await black_hole(nats_server.url, svc.subjects.api_call("agent"), "router", swallowed,
                            leave_after=2)
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix, silence_s=60.0) as c:
            slowest = await call_until_dropped([await c.open_session(MODEL_A)], swallowed, wait_s=30.0, tries=30)
        assert len(swallowed) >= 2, "the black hole never took a call: the test proved nothing"
        assert slowest < 8.0, f"a swallowed call was served {slowest:.1f} s after it was sent"
        assert max(engine_counts(svc, "engine.started").values()) == 1  # each call ran once
    finally:
        await hole.close()
        await svc.stop()


async def test_a_sleep_or_wake_lost_on_the_bus_is_sent_again(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """A black hole joins an engine-worker's queue group on its control subject and
    drops what it gets: a Sleep or Wake lost on the bus (a NATS node died under it).
    The worker acknowledges a command on receipt, so the substrate sends it again
    after a second instead of waiting out its control timeout (30 s here), and calls
    for both models, which need a switch each time, are served in moments."""
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs",
                   models=[MODEL_A, MODEL_B], extra_env={"TALARIA_CONTROL_TIMEOUT_S": "30"})
    await svc.start()
    dropped: list[float] = []
    hole = await black_hole(nats_server.url, svc.subjects.engine_control(SERVER, MODEL_B), "engine", dropped, leave_after=2)
    try:
        async with await TalariaClient.connect(nats_server.url, subject_prefix=subject_prefix, silence_s=60.0) as c:
            sessions = [await c.open_session(MODEL_A), await c.open_session(MODEL_B)]
            slowest = await call_until_dropped(sessions, dropped, wait_s=40.0)
            assert slowest < 10.0, f"served after {slowest:.1f} s"
        assert len(dropped) >= 2, "the black hole never took a control command: the test proved nothing"
        resent = [d for d in svc.log_lines(svc.substrate) if d.get("event") == "substrate.control_resent"]
        assert any(d["reason"] == "no acknowledgement" for d in resent), resent
    finally:
        await hole.close()
        await svc.stop()


async def test_a_store_step_that_waited_out_errors_says_so_once_and_one_that_gave_up_says_so() -> None:
    """The bucket's transient errors are retried in silence to the caller; the log
    tells an operator which step stalled, how long and on what."""
    import nats.errors
    import structlog

    from shared.call_record import CallRecordUnavailable, retry_transient

    tries = 0

    async def flaky() -> str:
        nonlocal tries
        tries += 1
        if tries < 3:
            raise nats.errors.TimeoutError
        return "ok"

    async def down() -> str:
        raise nats.errors.NoRespondersError

    async def answered() -> str:
        return "ok"

    with structlog.testing.capture_logs() as logs:
        assert await retry_transient("claim", answered, 5.0) == "ok"
        assert logs == []  # a step that answered at once logs nothing
        assert await retry_transient("claim", flaky, 5.0) == "ok"
        with pytest.raises(CallRecordUnavailable):
            await retry_transient("answer", down, 0.05)
    assert [(e["event"], e["what"]) for e in logs] == [("store.retried", "claim"), ("store.unavailable", "answer")]
    assert logs[0]["attempts"] == 3 and "TimeoutError" in logs[0]["first_error"] and logs[0]["waited_s"] > 0
    assert logs[1]["attempts"] >= 2 and "NoResponders" in logs[1]["first_error"]


async def test_a_first_start_without_its_engines_yet_is_not_a_warning(nats_server: NatsServer, redis_server: RedisServer,
                                                                      subject_prefix: str, key_prefix: str,
                                                                      tmp_path: Path) -> None:
    """The stack's first admission starts beside its engines, which may not answer yet:
    nothing is lost, so it is said at info; a restarted admission that cannot reach an
    engine is still a warning (tests above restart it)."""
    svc = Services(nats_server.url, redis_server.url, subject_prefix, key_prefix, tmp_path / "logs", models=[MODEL_A],
                   which=("admission",))
    await svc.start()
    try:
        lines = [d for d in svc.log_lines(svc.admission) if d.get("event") == "admission.recover_engine_unknown"]
        assert lines and all(d["level"] == "info" for d in lines), lines
    finally:
        await svc.stop()


@pytest.mark.e2e
@pytest.mark.timeout(240)
async def test_a_stopped_nats_node_is_left_for_another_and_calls_go_on(tmp_path: Path) -> None:
    """One node of a three-node NATS cluster stopped (SIGSTOP: a frozen host, a partition
    that drops packets), not dead: its TCP connections stay open, so only unanswered
    PINGs tell. The services and the agent leave it for another node within seconds
    and calls go on while it stays stopped; at nats-py's default PINGs (every 2 minutes)
    every call waited for as long as the node did."""
    import json
    import os
    import signal
    import urllib.request

    from shared.policy import resolve_policy
    from talaria.ops.stack import EmbeddedStack, StackSpec

    spec = StackSpec(policy=resolve_policy("talaria"), models=[MODEL_A], time_scale=50.0, log_dir=tmp_path / "logs",
                     nats_cluster=3)
    async with EmbeddedStack(spec) as stack:
        client = await TalariaClient.from_deployment(stack.deployment())
        try:
            session = await client.open_session(MODEL_A)
            await session.call(prompt_tokens=300, max_tokens=8, sim_output_tokens=2)

            def connections(node: Any) -> set[str]:
                with urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}/connz", timeout=5) as r:
                    return {c.get("name", "") for c in json.load(r).get("connections", [])}

            # the node the router talks through: stopping it cuts the agents' calls off
            node = next(n for n in stack.nats_nodes if any(c.startswith("router") for c in connections(n)))
            assert node.pid is not None
            os.kill(node.pid, signal.SIGSTOP)
            # resumed after 90 s whatever happens: calls that waited for it take that long
            resume = asyncio.get_running_loop().call_later(90.0, os.kill, node.pid, signal.SIGCONT)
            try:
                t0 = time.monotonic()
                for k in range(3):
                    for _ in range(10):  # (a call refused while the router moves over is asked again)
                        try:
                            await session.call(prompt_tokens=400 + 100 * k, max_tokens=8, sim_output_tokens=2)
                            break
                        except Exception:  # noqa: BLE001 - unavailable while it reconnects: an agent retries
                            await asyncio.sleep(1.0)
                    else:
                        pytest.fail(f"call {k} failed ten times with a NATS node stopped")
                took = time.monotonic() - t0
            finally:
                resume.cancel()
                os.kill(node.pid, signal.SIGCONT)
            assert took < 75.0, f"three calls took {took:.0f} s with a NATS node stopped"
        finally:
            await client.close()
