"""admission: the round scheduler of one server behind NATS.

Steps the pure RoundScheduler with the scaled clock: on each submitted call,
finished call, switch completion and timer wake-up, and carries out the
actions it returns (dispatch to an engine-worker, switch through the
substrate-manager, staging hints, KV protection for reservations). Queued and
running calls hear a heartbeat so their agents know they are alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
from nats.aio.msg import Msg

from services.admission import scheduler as sch
from shared import tracing
from shared.costmodel import CostModel
from shared.bus import REDIS_AWAY, RequestInterrupted, RequestLost, ServiceProcess, run_service, trace_headers
from shared.call_record import CallRecordUnavailable
from shared.clock import done_within, drive_timer
from shared.logs import LogEvery
from shared.net import no_responders
from shared.state import CounterMirror, ServerLoad, add_counters, write_server_load
from shared.schema import (
    Abort, AdmissionCall, ApiError, CallQueued, EngineState, CallRunning, ListCalls, MoveCall, ProtectKv, RunCall,
    SessionReleased, StageRequest, Submitted, SubmitCall, SwitchRequest, admission_decoder, cancel_decoder, encode,
    engine_announce_decoder, engine_draining_decoder, dispatch_ack_decoder, finished_decoder, reply_decoder,
    session_released_decoder, stored_submit_decoder, submit_reply_decoder, switch_accepted_decoder, switch_reply_decoder,
)

RECONCILE_WALL_S = 3.0  # wall seconds a confirmed run may go without CallFinished before its record is read
EPOCH_CHECK_WALL_S = 1.0  # wall seconds between two checks that no newer admission of this server exists
EPOCH_REFRESH_WALL_S = 60.0  # our epoch is rewritten this often (the bucket's TTL and bound drop its oldest)
SUPERSEDED_EXIT_CODE = 75  # a newer admission holds this server: this process must not go on
SWITCH_ACK_WALL_S = 1.0  # wall seconds a switch request may go unacknowledged before it is asked again
SWITCH_RESULT_MARGIN_WALL_S = 2.0  # wall seconds past a switch's planned end before its result counts as lost
PERSIST_WAIT_WALL_S = 0.5  # wall seconds a submit waits for its durable write before it is acknowledged anyway
DISPATCH_ACK_WALL_S = 1.0  # wall seconds a dispatch may go unacknowledged before it is sent again
DISPATCH_RETRY_MAX_WALL_S = 10.0  # the longest wait between two sends of a dispatch an engine refused
UNHEARD_LOG_EVERY_WALL_S = 10.0  # dispatches no engine-worker heard (one restarting): logged once per this, counted
MIRROR_COALESCE_S = 0.005  # wall seconds between two writes of the scheduler's mirror
RESERVATION_MIRROR_WAIT_WALL_S = 1.0  # how long a scheduler step waits on a reservation's claim or release in Redis
RESERVATION_MIRROR_PAUSE_WALL_S = 5.0  # ... and does without them after one failed (a stalled Redis answers nothing)
# how long a router may take to place a handed-back call elsewhere (it tries each other server, 1.5 s each at most)
MOVE_WAIT_WALL_S = 10.0
MOVES_MAX = 1  # a call moved once stays where it went (every server's engine draining: no bouncing between them)
# engine hash states of an engine-worker that runs nothing: stopped for a restart, or its successor loading
ENGINE_AWAY_STATES = frozenset({"draining", "starting"})
ENGINE_BACK_CHECK_WALL_S = 2.0  # how often a drained model's engine hash is read for its successor's `ready`


class AdmissionService(ServiceProcess):
    name = "admission"
    uses_call_records = True

    async def setup(self) -> None:
        s = self.settings
        cost = CostModel(self.catalog, self.catalog.server(s.server_profile), s.switch_cost_scale, s.prefill_speed_scale)
        specs = {m: self.catalog.model(m) for m in sorted(s.models)}
        self.scheduler = sch.RoundScheduler(s.server_id, specs, cost, s.policy)
        # the server's counters exist from the start (a zero is an answer; no series is not)
        for outcome in ("made", "returned", "expired", "yielded"):
            self.metrics.reservations.labels(server=s.server_id, outcome=outcome)
        self.metrics.reserved_idle.labels(server=s.server_id)
        self.payloads: dict[str, SubmitCall] = {}
        self.newly_counted: set[str] = set()  # calls stepped since the last mirror write: their in-flight entries go with it
        self.wakeup = asyncio.Event()
        self.dirty = asyncio.Event()
        self.persist_dirty = asyncio.Event()
        self.last_seen: dict[str, float] = {}   # session -> model time of its last arrival or finish here
        self.session_model: dict[str, str] = {}  # session -> its model, for the release event
        self.seen_dirty: set[str] = set()  # sessions whose `last_seen` changed since the persister wrote it
        self._counted = CounterMirror()  # the scheduler's stats already counted in the metrics
        self.arrived_wall: dict[str, float] = {}  # call -> wall time it reached this process (its wait span)
        self.switch_attempt: dict[str, asyncio.Event] = {}  # pending switch -> "ask again" (substrate restarted)
        self.switch_tasks: dict[str, asyncio.Task] = {}  # pending switch -> its task (cancelled if abandoned)
        self.reservation_mirror_away_until = 0.0  # (monotonic) a claim or release failed: none sent until then
        sid = s.server_id
        self.dispatched: dict[str, RunCall] = {}
        # a dispatch is sent until its engine acknowledges it: only an acknowledged run
        # is heartbeated as running, so a dispatch lost on the bus is sent again instead
        # of keeping its agent waiting on heartbeats for a call nobody runs
        self.confirmed: set[str] = set()
        self.confirmed_at: dict[str, float] = {}  # wall time a confirmed call was last checked by the reconciler
        self.resend_at: dict[str, tuple[float, float]] = {}  # unacknowledged -> (next send, backoff), wall clock
        # unacknowledged -> sends after the first: logged at the first and at the acknowledgement, not at
        # each (an engine-worker's drain and restart, minutes under vLLM, had logged every call every second)
        self.resends: dict[str, int] = {}
        self.unheard_log = LogEvery(UNHEARD_LOG_EVERY_WALL_S)
        # models whose engine-worker here drains (from its EngineDraining to its successor's announcement):
        # their waiting calls are handed to the routers to place on another server (`_move`)
        self.engines_draining: set[str] = set()
        self.moving: set[str] = set()  # calls handed to the routers, out of the scheduler until answered
        self.ack_inbox = self.nc.new_inbox()
        await self.nc.subscribe(self.ack_inbox, cb=self.guarded_handler(self.on_dispatch_ack, "dispatch_ack"))
        # the newest admission of this server: engines refuse its predecessors' dispatches from
        # now on (a stopped one that resumes cannot dispatch twice); durable, not in Redis
        # (none before us: the stack's first start, where engines not answering yet is expected)
        self.first_start = (await self.call_records.current_epoch("admission", sid))[0] == 0
        self.epoch, self.epoch_revision = await self.call_records.take_epoch("admission", sid)
        self.log.info("admission.epoch", epoch=self.epoch)
        await self.engines_away_at_start()
        # rebuild queued and running calls a predecessor held (docs/reliability.md)
        await self.recover()
        await self.nc.subscribe(self.subjects.admission_submit(sid), queue="admission",
                                cb=self.guarded_handler(self.on_submit, "submit"))
        await self.nc.subscribe(self.subjects.call_finished(sid), queue="admission",
                                cb=self.guarded_handler(self.on_finished, "finished"))
        await self.nc.subscribe(self.subjects.session_released,
                                cb=self.guarded_handler(self.on_session_released, "session_released"))
        # every admission hears every cancel (as every engine does): a call still queued here is dropped
        await self.nc.subscribe(self.subjects.call_cancel_any, cb=self.guarded_handler(self.on_cancel, "cancel"))
        await self.nc.subscribe(self.subjects.engine_announce(sid), cb=self.guarded_handler(self.on_engine_announce, "engine_announce"))
        await self.nc.subscribe(self.subjects.engine_draining(sid),
                                cb=self.guarded_handler(self.on_engine_draining, "engine_draining"))
        await self.nc.subscribe(self.subjects.substrate_announce(sid), cb=self.guarded_handler(self.on_substrate_announce, "substrate_announce"))
        await self.redis.sadd(self.keys.servers(), sid)
        # compare-and-delete: release a reservation only if it is still ours
        self._release_script = self.redis.register_script(
            "local v = redis.call('GET', KEYS[1]) "
            "if v and string.sub(v, 1, string.len(ARGV[1])) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0")
        # claim: one server's per session; this server's own (a release Redis missed while away) is renewed
        self._claim_script = self.redis.register_script(
            "local v = redis.call('GET', KEYS[1]) "
            "if (not v) or string.sub(v, 1, string.len(ARGV[1])) == ARGV[1] then "
            "redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1 end return 0")
        self._gauge()  # (every model's series from the start: a scraper reads 0 on an idle server, not nothing)
        self.spawn(self.timer(), "admission-timer")
        self.spawn(self.heartbeats(), "heartbeats")
        self.spawn(self.mirror(), "mirror")
        self.spawn(self.persister(), "persister")
        self.spawn(self.idle_sessions(), "idle-sessions")
        self.spawn(self.redispatcher(), "redispatcher")
        self.spawn(self.reconciler(), "reconciler")
        self.spawn(self.epoch_guard(), "epoch-guard")
        self.spawn(self.engines_back(), "engines-back")
        await self._settle_recovered()
        for model in list(self.engines_draining):  # (away at start: its recovered calls go elsewhere)
            self._move_waiting(model, "its engine hash")

    # -- recovery ----------------------------------------------------------------------
    async def recover(self) -> None:
        """A restarted admission rebuilds its scheduler before it takes new work:
        the calls its predecessor accepted are in Redis (`adm:<server>:calls`,
        written before each Submitted ack), and each engine-worker says whether
        it is awake and which calls it runs (ListCalls). Running calls are
        adopted as running in an open slot of the awake model; the rest queue
        again in arrival order. Calls already answered (in the call record) are dropped."""
        s = self.settings
        stored: dict[str, SubmitCall] = {}
        try:
            raw = await self.redis.hgetall(self.keys.admission_calls(s.server_id))
        except Exception as exc:
            self.log.warning("admission.recover_store_failed", error=str(exc))
            raw = {}
        recovered_at = time.time()
        await self._load_sessions()
        for cid, data in raw.items():
            try:
                stored[cid.decode()] = stored_submit_decoder.decode(data)
            except Exception:  # noqa: BLE001 - a corrupt entry is skipped, not fatal
                self.log.warning("admission.recover_bad_entry", call_id=cid.decode(errors="replace"))
        # a call whose reply goes to another deployment's subjects (a stack started again with
        # the same Redis key prefix and a new subject prefix): nobody here can hear its answer,
        # and its every publish was refused as a permissions violation, once a second
        foreign = sorted(cid for cid, sub in stored.items() if not self.subjects.is_reply_inbox(sub.reply_to))
        for cid in foreign:
            del stored[cid]
            self.spawn(self._unpersist(cid), "unpersist")
        if foreign:
            self.log.warning("admission.recover_foreign", calls=len(foreign), call_ids=foreign[:20],
                             reason="their replies go to another subject prefix: dropped")
        awake: tuple[str, int] | None = None
        running: list[RunCall] = []

        states = await self.engine_states(self.scheduler.models, ListCalls(admission_epoch=self.epoch))
        for m, st in states.items():
            if not isinstance(st, EngineState):  # engine down: it announces when back, and we re-send then
                # (the stack's first start: the engines start beside us, nothing to recover)
                first = self.first_start and not stored
                (self.log.info if first else self.log.warning)("admission.recover_engine_unknown", model=m, error=st)
                continue
            if st.awake and (awake is None or st.running):
                awake = (m, st.kv_capacity_tokens)
            if st.awake:
                running.extend(st.running)
        if not stored and not running and awake is None:
            return
        now = self.clock.now()
        adopted = []
        for rc in running:
            if awake is None or rc.model != awake[0]:
                continue
            sub = stored.pop(rc.call_id, None) or rc.submitted()
            self.payloads[rc.call_id] = sub
            self.dispatched[rc.call_id] = rc
            self.confirmed.add(rc.call_id)  # its engine said it runs it
            adopted.append((sub.call, rc.reserved_tokens))
        if awake is not None:
            self.scheduler.recover_active(awake[0], awake[1], adopted, now)
        # calls answered while nobody listened need no second run
        answered = set()
        for cid, sub in list(stored.items()):
            with contextlib.suppress(Exception):
                if await self.call_records.answered_reply(sub.call.session_id, cid) is not None:
                    answered.add(cid)
        requeued = 0
        for cid, sub in sorted(stored.items(), key=lambda kv: kv[1].call.arrived_at):
            if cid in answered:
                continue
            self.payloads[cid] = sub
            self.arrived_wall.setdefault(cid, recovered_at)  # (its wait span restarts here)
            self._saw(sub.call.session_id, sub.call.model)
            await self.step(sch.Arrive(sub.call))
            requeued += 1
        await self.step(sch.Tick())
        self.persist_dirty.set()
        self.log.warning("admission.recovered", active=awake[0] if awake else None, running=len(adopted),
                         requeued=requeued, already_answered=len(answered))

    async def _settle_recovered(self) -> None:
        """Close the race between ListCalls and our subscription to CallFinished:
        an adopted call whose reply is cached finished in between."""
        for cid in list(self.scheduler.running):
            with contextlib.suppress(Exception):
                run = self.scheduler.running[cid]
                if await self.call_records.answered_reply(run.call.session_id, cid) is not None:
                    await self._finished(cid, run.call.session_id, run.call.prompt_tokens, None)

    async def persister(self) -> None:
        """Keep `adm:<server>:calls` equal to the calls we hold: rewritten on a
        change and checked every second (Redis may have restarted empty)."""
        key = self.keys.admission_calls(self.settings.server_id)
        while True:
            await done_within(self.persist_dirty.wait(), 1.0)
            self.persist_dirty.clear()
            try:
                have = {k.decode() for k in await self.redis.hkeys(key)}
                want = set(self.payloads)
                missing = {cid: encode(self.payloads[cid]) for cid in want - have if cid in self.payloads}
                extra = list(have - want)
                if missing:
                    await self.redis.hset(key, mapping=missing)
                if extra:
                    await self.redis.hdel(key, *extra)
            except Exception as exc:
                self.log.warning("admission.persist_failed", error=str(exc))
            await self._persist_sessions()

    def _saw(self, session_id: str, model: str | None = None) -> None:
        """A call of the session arrived or finished here now: its idle time starts again."""
        self.last_seen[session_id] = self.clock.now()
        if model is not None:
            self.session_model[session_id] = model
        self.seen_dirty.add(session_id)

    def _seen_entry(self, session_id: str) -> str:
        return f"{self.last_seen.get(session_id, self.clock.now()):.3f} {self.session_model.get(session_id, '')}"

    async def _persist_sessions(self) -> None:
        """Keep `adm:<server>:sessions` equal to `last_seen`: the sessions changed since the
        last write, or all of them where the hash is gone (Redis restarted empty)."""
        key = self.keys.admission_sessions(self.settings.server_id)
        dirty, self.seen_dirty = self.seen_dirty, set()
        try:
            if self.last_seen and not await self.redis.exists(key):
                dirty = set(self.last_seen) | dirty
            if not dirty:
                return
            put = {sid: self._seen_entry(sid) for sid in dirty if sid in self.last_seen}
            gone = [sid for sid in dirty if sid not in self.last_seen]
            pipe = self.redis.pipeline(transaction=False)
            if put:
                pipe.hset(key, mapping=put)
            if gone:
                pipe.hdel(key, *gone)
            await pipe.execute()
        except Exception as exc:
            self.seen_dirty |= dirty  # (written with the next change, or within the next second)
            self.log.warning("admission.persist_failed", error=str(exc), what="sessions")

    async def _load_sessions(self) -> None:
        """The sessions a predecessor would have released when idle, with the time each was
        last seen (model time is one clock across processes): released here in their turn."""
        try:
            raw = await self.redis.hgetall(self.keys.admission_sessions(self.settings.server_id))
        except Exception as exc:
            self.log.warning("admission.recover_store_failed", error=str(exc), what="sessions")
            return
        for sid, entry in raw.items():
            seen, _, model = entry.decode(errors="replace").partition(" ")
            try:
                self.last_seen[sid.decode(errors="replace")] = float(seen)
            except ValueError:
                self.log.warning("admission.recover_bad_entry", session_id=sid.decode(errors="replace"))
                continue
            if model:
                self.session_model[sid.decode(errors="replace")] = model
        if raw:
            self.log.info("admission.sessions_recovered", sessions=len(raw))

    async def idle_sessions(self) -> None:
        """A session with nothing queued or running here and no call for
        `session_idle_s` model seconds: release its reservation and its KV."""
        idle = self.settings.session_idle_s
        if idle <= 0:
            return
        while True:
            await asyncio.sleep(max(0.05, min(1.0, self.clock.wall_s(idle) / 4)))
            now = self.clock.now()
            busy = {c.session_id for c in self.scheduler.pending_calls()} | {
                r.call.session_id for r in self.scheduler.running.values()}
            for sid, seen in list(self.last_seen.items()):
                if sid in busy or now - seen < idle:
                    continue
                del self.last_seen[sid]
                self.seen_dirty.add(sid)
                self.log.info("admission.session_idle_released", session_id=sid, idle_s=round(now - seen, 1))
                # the same event as an agent's end, for this server: every service here applies it
                await self.nc.publish(self.subjects.session_released, encode(
                    SessionReleased(session_id=sid, reason="idle", server_id=self.settings.server_id,
                                    model=self.session_model.get(sid))))

    # -- handlers ----------------------------------------------------------------
    async def on_submit(self, msg: Msg) -> None:
        sub = admission_decoder.decode(msg.data)
        c = sub.call
        with structlog.contextvars.bound_contextvars(session_id=c.session_id, call_id=c.call_id):
            if c.model not in self.scheduler.models:
                await self.reply_error(msg.reply, "unknown_model", f"{c.model} is not served on {self.settings.server_id}",
                                       c.call_id, to_agent=False)
                return
            held = self.payloads.get(c.call_id)
            if held is not None and held.call.session_id != c.session_id:
                # one call id in flight for two sessions at once: refuse, never merge them
                await self.reply_error(msg.reply, "malformed",
                                       f"call id {c.call_id} is in flight for another session; use unique call ids",
                                       c.call_id, to_agent=False)
                return
            known = held is not None
            bound = self.settings.max_queued
            if not known and not c.continuation and bound and self.scheduler.refuses_new_session(c.tenant, bound):
                held_by = self.scheduler.queued_by_tenant().get(c.tenant, 0)
                await self.reply_error(msg.reply, "no_capacity", f"{self.settings.server_id} has {self.scheduler.queued()} "
                                       f"calls queued (bound {bound}; {held_by} of them this tenant's)",
                                       c.call_id, retry_after_s=1.0, to_agent=False)
                return
            if known and held is not None and sub.reply_to != held.reply_to:
                await self._redirect(c.call_id, held, sub.reply_to)
            self.payloads.setdefault(c.call_id, sub)
            self.arrived_wall.setdefault(c.call_id, time.time())  # (the wait span's start)
            self._saw(c.session_id, c.model)
            if not known:
                # durable before the ack: a restarted admission finds it (docs/reliability.md)
                await self._persist_submit(c.call_id, sub)
            if msg.reply:
                await self.nc.publish(msg.reply, encode(Submitted(call_id=c.call_id, server_id=self.settings.server_id)))
            self.log.info("admission.queued", model=c.model, tenant=c.tenant, at=round(self.clock.now(), 3))
            self.newly_counted.add(c.call_id)
            await self.step(sch.Arrive(c), at=c.arrived_at)
            if c.model in self.engines_draining:  # (placed here before the routers read the drain)
                self.spawn(self._move(c.call_id), "move")

    async def on_cancel(self, msg: Msg) -> None:
        """The agent gave up on a call (`CancelCall`). One still queued here is dropped:
        it would run later for nobody, its model given turns (and switches) only for
        it (one being handed to the routers too: not queued again if they decline it).
        One dispatched is its engine's to abort. Only its caller may cancel it:
        the cancel's namespace must be its reply inbox's."""
        call_id = cancel_decoder.decode(msg.data).call_id
        sub = self.payloads.get(call_id)
        if sub is None or call_id in self.dispatched or not (self.scheduler.is_queued(call_id) or call_id in self.moving):
            return
        ns = self.subjects.api_namespace(msg.subject)
        if ns is None or not self.subjects.is_reply_inbox(sub.reply_to, ns):
            return
        self.payloads.pop(call_id, None)
        self.arrived_wall.pop(call_id, None)
        self.spawn(self._unpersist(call_id), "unpersist")
        self.log.info("admission.cancelled_while_queued", session_id=sub.call.session_id, call_id=call_id,
                      model=sub.call.model, reason="agent gave up")
        await self.apply(self.scheduler.forget(call_id, self.scheduler.last_step_at))
        self.wakeup.set()
        self.dirty.set()

    async def _redirect(self, call_id: str, held: SubmitCall, reply_to: str) -> None:
        """The agent asks for a call it holds from another inbox (its gateway or client was
        restarted; the first inbox is gone): its news go there from now on, a run sent later
        answers there, and a run already sent (to the first inbox) has its reply sent there
        too once it finishes (`_finished`; it was heard only by the next silence's retry,
        about 15 s later)."""
        sub = self.payloads[call_id] = msgspec.structs.replace(held, reply_to=reply_to)
        self.log.info("admission.redirected", reason="the agent asked again from another inbox")
        # (a restarted admission sends its news there too; the persister adds only missing calls)
        await self._persist_submit(call_id, sub)

    async def _send_redirected(self, call_id: str, session_id: str, reply_to: str) -> None:
        stored = await self.call_records.answered_reply(session_id, call_id)
        if stored is not None:
            await self.nc.publish(reply_to, stored, headers=trace_headers(session_id, call_id))

    async def _persist_submit(self, call_id: str, sub: SubmitCall) -> None:
        """Write an accepted call to the durable hash, waiting at most
        `PERSIST_WAIT_WALL_S`: this subscription handles submits one at a time, and a
        Redis that is restarting (its client retries for up to 15 s) held up every
        submit behind it. A write that has not landed by then goes on in the
        background, and the persister writes it again once Redis is back."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self.keys.admission_calls(self.settings.server_id), call_id, encode(sub))
        # (its session, in the same round trip: a session's first call is never lost to a restart
        # within the persister's second; later changes are the persister's)
        pipe.hset(self.keys.admission_sessions(self.settings.server_id), sub.call.session_id,
                  self._seen_entry(sub.call.session_id))
        write = asyncio.ensure_future(pipe.execute())
        done, _ = await asyncio.wait({write}, timeout=PERSIST_WAIT_WALL_S)
        if not done:
            write.add_done_callback(lambda t: t.cancelled() or t.exception())  # (its error retrieved, not lost)
            error = f"not written in {PERSIST_WAIT_WALL_S} s; the persister writes it"
        elif write.exception() is not None:
            error = str(write.exception())
        else:
            return
        self.log.warning("admission.persist_failed", error=error)
        self.persist_dirty.set()

    async def on_finished(self, msg: Msg) -> None:
        ev = finished_decoder.decode(msg.data)
        await self._finished(ev.call_id, ev.session_id, ev.context_tokens, ev.finished_at)

    async def _finished(self, call_id: str, session_id: str, context_tokens: int, finished_at: float | None) -> None:
        sub, run = self.payloads.pop(call_id, None), self.dispatched.get(call_id)
        self.arrived_wall.pop(call_id, None)  # (a call adopted or dispatched before its wait span was drawn)
        if sub is not None and run is not None and sub.reply_to != run.reply_to:
            # redirected after its run was sent (`_redirect`): the engine answered the first inbox
            self.spawn(self._send_redirected(call_id, session_id, sub.reply_to), "redirected reply")
        if sub is not None:
            # not awaited: a restarting Redis must not hold up the finishes behind this one (an
            # entry left behind is dropped by a recovering admission, whose call record says answered,
            # or by the persister's check within a second; not woken for it: its HKEYS per finish
            # was one Redis round trip a call)
            self.spawn(self._unpersist(call_id), "unpersist")
        self._forget_dispatch(call_id)
        self._saw(session_id)
        await self.step(sch.Finished(call_id, session_id, context_tokens), at=finished_at)

    async def _unpersist(self, call_id: str) -> None:
        try:
            await self.redis.hdel(self.keys.admission_calls(self.settings.server_id), call_id)
        except REDIS_AWAY as exc:  # (left behind: dropped later, above)
            self.log.warning("admission.unpersist_deferred", call_id=call_id, error=type(exc).__name__)

    async def reconciler(self) -> None:
        """Re-derive a finish lost on the bus: a call its engine confirmed but whose
        `CallFinished` never came would hold its slot, and be heartbeated as running
        to an agent that may have lost the reply too, for ever (a NATS node died
        between the engine's publish and its delivery, in a chaos run). Every call
        confirmed for `RECONCILE_WALL_S` is looked up in the call record; answered:
        its reply is sent to the agent again (the same bytes) and it finishes here."""
        while True:
            await asyncio.sleep(RECONCILE_WALL_S / 2)
            now = time.monotonic()
            for cid in list(self.confirmed):
                since = self.confirmed_at.setdefault(cid, now)
                run = self.dispatched.get(cid)
                if run is None or now - since < RECONCILE_WALL_S:
                    continue
                self.confirmed_at[cid] = now  # looked at again in RECONCILE_WALL_S
                try:
                    stored = await self.call_records.answered_reply(run.session_id, cid)
                except Exception:  # noqa: BLE001 - the record is away: look again next time
                    continue
                if stored is None or cid not in self.confirmed:
                    continue
                sub = self.payloads.get(cid)
                self.log.warning("admission.finish_recovered", call_id=cid, session_id=run.session_id,
                                 reason="answered in the call record, no CallFinished")
                if sub is not None:
                    await self.nc.publish(sub.reply_to, stored, headers=trace_headers(run.session_id, cid))
                done = reply_decoder.decode(stored)
                await self._finished(cid, run.session_id, done.prompt_tokens + done.output_tokens, done.finished_at)

    async def on_engine_draining(self, msg: Msg) -> None:
        """An engine-worker of this server stops (a rolling restart) and runs nothing new
        until its successor announces itself: seconds here, minutes under vLLM, which
        loads its weights first. Its model gets no turn meanwhile (the scheduler's rule
        4: the other models' calls do not wait on a switch to it), and the calls of
        its model waiting here (queued, or sent to it and not acknowledged) go to the
        routers to be placed on another server with its engine ready; before, they
        waited for the successor, whatever another server could do."""
        model = engine_draining_decoder.decode(msg.data).model
        await self._engine_away(model)
        self._move_waiting(model, "announced")

    async def _engine_away(self, model: str) -> None:
        self.engines_draining.add(model)
        await self.step(sch.EngineAway(model, away=True))  # (no turn, no switch to it meanwhile)

    def _move_waiting(self, model: str, source: str) -> None:
        """Hand the calls of `model` waiting here (its engine-worker drains) to the routers."""
        waiting = [c.call_id for c in self.scheduler.pending_calls() if c.model == model] + [
            cid for cid, run in self.dispatched.items() if run.model == model and cid not in self.confirmed]
        self.log.info("admission.engine_draining", model=model, waiting=len(waiting), source=source)
        for cid in waiting:
            self.spawn(self._move(cid), "move")

    async def engines_away_at_start(self) -> None:
        """A restarted admission learns which models' engine-workers are away from their
        engine hashes (`draining`: stopped for a restart; `starting`: its successor still
        loads), before it queues its predecessor's calls: it missed their announcements,
        and would otherwise switch to such a model for a queued call, every other model's
        calls waiting behind a switch no worker answers. Back as after an announcement
        (its successor's, or `ready` in its hash, `engines_back`)."""
        sid = self.settings.server_id
        for model in self.scheduler.models:
            try:
                state = await self.redis.hget(self.keys.engine(sid, model), "state")
            except Exception:  # noqa: BLE001 - Redis away: as before, turns for every model
                continue
            if state is not None and state.decode() in ENGINE_AWAY_STATES:
                self.log.info("admission.engine_away_at_start", model=model, state=state.decode())
                await self._engine_away(model)

    async def _move(self, call_id: str) -> None:
        """Hand a call waiting for a draining engine to the routers (`MoveCall`). It is out
        of the scheduler meanwhile, so it is never dispatched here and elsewhere at once;
        taken elsewhere, it is forgotten here; refused (no other server with its engine
        ready could take it) or unanswered, it is queued here again. Moved once at most
        (`MOVES_MAX`). A copy left in two places by a lost answer, or by its agent asking
        here again meanwhile, is still generated once: engines claim by compare-and-set."""
        sub = self.payloads.get(call_id)
        if len(self.settings.servers) < 2 or sub is None or call_id in self.moving or sub.moves >= MOVES_MAX:
            return
        if not (self.scheduler.is_queued(call_id) or (call_id in self.dispatched and call_id not in self.confirmed)):
            return
        self.moving.add(call_id)
        self._forget_dispatch(call_id)
        await self.apply(self.scheduler.forget(call_id, self.scheduler.last_step_at))
        try:
            resp = await self.nc.request(self.subjects.call_move,
                                         encode(MoveCall(submit=sub, from_server=self.settings.server_id)),
                                         timeout=MOVE_WAIT_WALL_S, headers=trace_headers(sub.call.session_id, call_id))
            out: Submitted | ApiError = submit_reply_decoder.decode(resp.data)
        except Exception as exc:  # noqa: BLE001 - no router answered: it stays here
            out = ApiError(code="unavailable", message=type(exc).__name__)
        finally:
            self.moving.discard(call_id)
        fields = {"session_id": sub.call.session_id, "call_id": call_id, "model": sub.call.model}
        self.metrics.calls_moved.labels(server=self.settings.server_id, model=sub.call.model,
                                        outcome="moved" if isinstance(out, Submitted) else "stayed").inc()
        if isinstance(out, Submitted):
            if self.scheduler.is_queued(call_id) or call_id in self.dispatched:
                # asked here again meanwhile (its agent's retry): kept, as elsewhere; engines claim it once
                fields["kept_here"] = "asked again meanwhile"
            else:
                self.payloads.pop(call_id, None)
                self.arrived_wall.pop(call_id, None)
                self.spawn(self._unpersist(call_id), "unpersist")
                self.dirty.set()
            self.log.info("admission.moved", to_server=out.server_id, reason="its engine-worker drains", **fields)
            return
        self.log.info("admission.move_declined", reason=out.message, **fields)
        if call_id in self.payloads:  # (not cancelled meanwhile)
            await self.step(sch.Arrive(sub.call))

    async def _engine_back(self, model: str, source: str) -> None:
        """The drained model's successor is up: its runs are heard again, turns given."""
        if model in self.engines_draining:
            self.engines_draining.discard(model)
            self.log.info("admission.engine_back", model=model, source=source)
            await self.step(sch.EngineAway(model, away=False))

    async def engines_back(self) -> None:
        """A drained model whose successor says `ready` in its engine hash is back, should its
        announcement have been lost on the bus (a NATS node lost under it): else the model
        would get no turn here again. (The draining worker writes `draining` there first.)"""
        sid = self.settings.server_id
        while True:
            await asyncio.sleep(ENGINE_BACK_CHECK_WALL_S)
            for model in list(self.engines_draining):
                try:
                    state = await self.redis.hget(self.keys.engine(sid, model), "state")
                except Exception:  # noqa: BLE001 - Redis away: its announcement, or the next look
                    continue
                if state is not None and state.decode() == "ready":
                    await self._engine_back(model, "its engine hash")

    async def on_engine_announce(self, msg: Msg) -> None:
        """An engine-worker restarted and lost what it ran: send those calls again
        (same ids; the engine holds them until it is awake)."""
        ann = engine_announce_decoder.decode(msg.data)
        await self._engine_back(ann.model, "announced")
        for cid, run in list(self.dispatched.items()):
            if run.model == ann.model and cid in self.scheduler.running:
                self._count_resend(run, reason="engine restarted")
                self.confirmed.discard(cid)
                await self._send_run(run)

    # -- dispatches: sent until acknowledged ---------------------------------------------
    async def _send_run(self, run: RunCall, backoff: float = DISPATCH_ACK_WALL_S) -> None:
        self.resend_at[run.call_id] = (time.monotonic() + backoff, backoff)
        # every send carries our epoch (a run adopted from a predecessor's dispatch too)
        run = msgspec.structs.replace(run, admission_epoch=self.epoch)
        await self.nc.publish(self.subjects.engine_run(self.settings.server_id, run.model), encode(run),
                              reply=self.ack_inbox, headers=trace_headers(run.session_id, run.call_id))

    def _count_resend(self, run: RunCall, **why: Any) -> None:
        """A dispatch sent again: the first resend is a warning, the rest are counted quietly
        until the acknowledgement says how many (`admission.dispatch_acknowledged`)."""
        resends = self.resends[run.call_id] = self.resends.get(run.call_id, 0) + 1
        (self.log.warning if resends == 1 else self.log.debug)(
            "admission.redispatch", call_id=run.call_id, session_id=run.session_id, model=run.model,
            resends=resends, **why)

    def _forget_dispatch(self, call_id: str) -> None:
        self.dispatched.pop(call_id, None)
        self.confirmed.discard(call_id)
        self.confirmed_at.pop(call_id, None)
        self.resend_at.pop(call_id, None)
        self.resends.pop(call_id, None)

    def superseded(self, newer: int | None) -> None:
        """A newer admission of this server exists (we were stopped and replaced, then
        resumed): stop at once, before we dispatch, heartbeat or take a finish again."""
        self.log.error("admission.superseded", epoch=self.epoch, newer=newer, exit_code=SUPERSEDED_EXIT_CODE)
        os._exit(SUPERSEDED_EXIT_CODE)

    async def epoch_guard(self) -> None:
        """Every `EPOCH_CHECK_WALL_S`: is our epoch still the newest? (A process that was
        stopped for longer than its liveness watch allows finds out here within a second
        of resuming.) Also rewrites it now and then, so the bucket's TTL never ages it out.
        The store unreachable: nothing is decided (the engines still fence our dispatches)."""
        sid = self.settings.server_id
        refreshed = time.monotonic()
        while True:
            await asyncio.sleep(EPOCH_CHECK_WALL_S)
            try:
                if time.monotonic() - refreshed > EPOCH_REFRESH_WALL_S:
                    rev = await self.call_records.refresh_epoch("admission", sid, self.epoch, self.epoch_revision)
                    if rev is None:
                        self.superseded(None)
                    self.epoch_revision, refreshed = rev, time.monotonic()
                else:
                    current, _ = await self.call_records.current_epoch("admission", sid)
                    if current > self.epoch:
                        self.superseded(current)
            except CallRecordUnavailable:
                continue

    async def on_dispatch_ack(self, msg: Msg) -> None:
        if no_responders(msg):
            # a dispatch published while no engine-worker of its model listened (restarting):
            # NATS says so on the shared inbox without naming the call; the unacknowledged
            # dispatch goes again (redispatcher) once the worker is back
            unheard = self.unheard_log.due(time.monotonic())
            if unheard:
                self.log.info("admission.dispatch_unheard", reason="no engine-worker listens", dispatches=unheard)
            return
        ack = dispatch_ack_decoder.decode(msg.data)
        if isinstance(ack, ApiError) and ack.code == "superseded":  # an engine has heard from a newer admission
            self.superseded(None)
        if isinstance(ack, ApiError):  # the engine could not take it: try again, slower
            cid = ack.call_id or ""
            if cid in self.resend_at:
                _, backoff = self.resend_at[cid]
                self.resend_at[cid] = (time.monotonic() + backoff, min(DISPATCH_RETRY_MAX_WALL_S, backoff * 2))
            self.log.warning("admission.dispatch_refused", call_id=ack.call_id, reason=ack.message)
            return
        if ack.call_id in self.dispatched:
            self.confirmed.add(ack.call_id)
            self.confirmed_at[ack.call_id] = time.monotonic()
            self.resend_at.pop(ack.call_id, None)
            resends = self.resends.pop(ack.call_id, 0)
            if resends:
                self.log.info("admission.dispatch_acknowledged", call_id=ack.call_id, resends=resends)

    async def redispatcher(self) -> None:
        """Send again what no engine acknowledged in time (lost on the bus, or its
        engine away): the engine runs a call id at most once, so a resend is safe."""
        while True:
            await asyncio.sleep(DISPATCH_ACK_WALL_S / 4)
            now = time.monotonic()
            for cid, (due, backoff) in list(self.resend_at.items()):
                run = self.dispatched.get(cid)
                if run is None or cid not in self.scheduler.running:
                    self.resend_at.pop(cid, None)
                    continue
                if now >= due:
                    self._count_resend(run, reason="no acknowledgement", every_s=backoff)
                    await self._send_run(run, backoff)

    async def on_substrate_announce(self, msg: Msg) -> None:
        """The substrate-manager restarted: a switch we wait for is lost; ask again now."""
        for ev in self.switch_attempt.values():
            ev.set()

    async def on_session_released(self, msg: Msg) -> None:
        ev = session_released_decoder.decode(msg.data)
        if not ev.applies_to(self.settings.server_id):
            return
        self.last_seen.pop(ev.session_id, None)
        self.session_model.pop(ev.session_id, None)
        self.seen_dirty.add(ev.session_id)
        await self.step(sch.SessionEnded(ev.session_id))
        with contextlib.suppress(Exception):  # soft state: nothing of the session is held here now
            await self.redis.hdel(self.keys.kv_locality(ev.session_id), self.settings.server_id)

    # -- the state machine ---------------------------------------------------------
    async def step(self, event: sch.Event, at: float | None = None) -> None:
        """Step the scheduler. `at`: the event's model time at its source (a
        call's arrival at the router, an engine's finish, a switch's end), so
        the wall latency of the message, which the time scale multiplies, does
        not leak into decisions; never earlier than the last step."""
        actions = self.scheduler.step(event, self.clock.at_source(at, self.scheduler.last_step_at))
        await self.apply(actions)
        self.wakeup.set()
        self.dirty.set()

    def _wait_span(self, c: AdmissionCall, sub: SubmitCall, a: sch.Dispatch) -> str | None:
        """The call's wait here as a span (wall time, from its arrival at this process, or its
        recovery, to its dispatch), with its switch wait inside; the traceparent its run carries."""
        end = time.time()
        start = min(end, self.arrived_wall.pop(c.call_id, end))  # (popped traced or not: one entry a call)
        if sub.traceparent is None:
            return None
        attrs = tracing.call_attributes(c.model, c.session_id, c.call_id, **{
            "talaria.server_id": self.settings.server_id, "talaria.waited_model_s": round(a.waited_s, 3),
            "talaria.round_wait": a.round_wait, "talaria.sp_admit": a.sp_admit})
        tp = tracing.record_span("admission.wait", sub.traceparent, start, end, attrs)
        if a.switch_wait_s > 0 and tp is not None:
            wall = min(end - start, a.switch_wait_s / max(self.settings.time_scale, 1e-9))
            tracing.record_span("admission.switch_wait", tp, end - wall, end, tracing.call_attributes(
                c.model, c.session_id, c.call_id, **{"talaria.server_id": self.settings.server_id,
                                                     "talaria.switch_wait_model_s": round(a.switch_wait_s, 3)}))
        return tp

    def _gauge(self) -> None:
        """What admission holds now, per model (the llm-d model-server contract's waiting and
        running, for a server whose waiting calls are here, not in an engine)."""
        sch_, srv = self.scheduler, self.settings.server_id
        running: dict[str, int] = {m: 0 for m in sch_.models}
        for r in sch_.running.values():
            running[r.call.model] = running.get(r.call.model, 0) + 1
        kv_used = sch_.reserved_kv_tokens() / sch_.kv_capacity if sch_.kv_capacity else 0.0
        for m in sch_.models:
            waiting = len(sch_.queues.get(m, ()))
            self.metrics.queued.labels(server=srv, model=m).set(waiting)
            self.metrics.running.labels(server=srv, model=m).set(running.get(m, 0))
            self.metrics.contract_waiting.labels(server=srv, model_name=m).set(waiting)
            self.metrics.contract_running.labels(server=srv, model_name=m).set(running.get(m, 0))
            self.metrics.contract_kv_usage.labels(server=srv, model_name=m).set(
                min(1.0, kv_used) if m == sch_.active else 0.0)
        self.metrics.reservations_held.labels(server=srv).set(len(sch_.reservations))
        # reservation outcomes: events of this process's scheduler, as increments of its stats
        st = sch_.stats
        added = self._counted.pending({
            "made": st.reservations_made, "returned": st.reservations_hit,
            "expired": st.reservations_expired - st.reservations_yielded, "yielded": st.reservations_yielded,
            "idle_s": st.reserved_idle_s})
        for name, delta in added.items():
            if name == "idle_s":
                self.metrics.reserved_idle.labels(server=srv).inc(delta)
            else:
                self.metrics.reservations.labels(server=srv, outcome=name).inc(delta)
        self._counted.written(added)

    async def apply(self, actions: list[sch.Action]) -> None:
        s = self.settings
        lost: list[str] = []
        for a in actions:
            match a:
                case sch.Dispatch(call=c):
                    sub = self.payloads.get(c.call_id)
                    if sub is None:
                        # nothing to send: forget the call, or the scheduler would count it
                        # as running and give its model turns it can never use
                        self.log.error("admission.lost_payload", call_id=c.call_id, session_id=c.session_id)
                        lost.append(c.call_id)
                        continue
                    run = RunCall(
                        call=c, engine=sub.engine, reply_to=sub.reply_to, reserved_tokens=a.reserved_tokens,
                        waited_s=a.waited_s, switch_wait_s=a.switch_wait_s, round_wait=a.round_wait,
                        dispatched_at=self.scheduler.last_step_at, sp_admit=a.sp_admit,
                        traceparent=self._wait_span(c, sub, a), record_revision=sub.record_revision,
                    )
                    self.log.info("admission.dispatched", session_id=c.session_id, call_id=c.call_id, model=c.model,
                                  slot_id=a.slot_id, waited_s=round(a.waited_s, 3), round_wait=a.round_wait,
                                  sp_admit=a.sp_admit)
                    self.dispatched[c.call_id] = run
                    self.confirmed.discard(c.call_id)
                    await self._send_run(run)
                case sch.StartSwitch(from_model=old, to_model=new):
                    self.log.info("admission.switch", from_model=old, to_model=new)
                    self.switch_tasks[new] = self.spawn(self._switch(old, new), "switch")
                case sch.AbandonSwitch(to_model=m):
                    self.log.warning("admission.switch_abandoned", to_model=m, reason="its engine-worker drains")
                    if (task := self.switch_tasks.pop(m, None)) is not None:
                        task.cancel()
                    self.switch_attempt.pop(m, None)
                case sch.Stage(model=m):
                    await self.nc.publish(self.subjects.substrate_stage(s.server_id), encode(StageRequest(model=m, requested_at=self.scheduler.last_step_at)))
                case sch.Preempt(call_id=cid):
                    for m in self.scheduler.models:
                        await self.nc.publish(self.subjects.engine_control(s.server_id, m), encode(Abort(call_id=cid, at=self.scheduler.last_step_at,
                                                                                                         admission_epoch=self.epoch)))
                case sch.Protect(session_id=sid, model=m, on=on):
                    if on and not await self._claim(sid):
                        await self.apply(self.scheduler.cancel_reservation(sid))
                        continue
                    if not on:
                        await self._release(sid)
                    await self.nc.publish(self.subjects.engine_control(s.server_id, m), encode(ProtectKv(session_id=sid, on=on)))
                case sch.SlotOpened(model=m, slot_id=i, at=t):
                    self.log.info("admission.slot_opened", model=m, slot_id=i, at=round(t, 3))
                    self.metrics.slots.labels(server=s.server_id, model=m, reason="opened").inc()
                case sch.SlotClosed(model=m, slot_id=i, at=t, reason=why):
                    self.log.info("admission.slot_closed", model=m, slot_id=i, at=round(t, 3), reason=why)
                    self.metrics.slots.labels(server=s.server_id, model=m, reason=why).inc()
        for cid in lost:
            await self.apply(self.scheduler.forget(cid, self.scheduler.last_step_at))

    async def _claim(self, session_id: str) -> bool:
        """Mirror a reservation into Redis atomically: one server's claim per session,
        expiring in model time (PX = hold / time scale)."""
        res = self.scheduler.reservations.get(session_id)
        if res is None:
            return False
        ttl_ms = max(1, int(self.clock.wall_s(res.expires_at - self.clock.now()) * 1000))
        value = f"{self.settings.server_id}|{res.expires_at:.3f}"
        ok = await self._mirror_reservation(lambda: self._claim_script(
            keys=[self.keys.reservation(session_id)], args=[f"{self.settings.server_id}|", value, ttl_ms]), "claim")
        if ok is None:  # Redis away: the claim stays local (soft state)
            return True
        if not ok:
            self.log.info("reservation.refused", session_id=session_id, reason="claimed elsewhere")
        return bool(ok)

    async def _release(self, session_id: str) -> None:
        # (not released where Redis is away: the mirrored claim expires with its hold)
        await self._mirror_reservation(lambda: self._release_script(
            keys=[self.keys.reservation(session_id)], args=[f"{self.settings.server_id}|"]), "release")

    async def _mirror_reservation(self, op: Callable[[], Awaitable[Any]], what: str) -> Any:
        """A reservation's mirror step, in the scheduler's step: waited on for a moment
        (RESERVATION_MIRROR_WAIT_WALL_S), then none for RESERVATION_MIRROR_PAUSE_WALL_S,
        so a stalled Redis does not hold every finish and switch behind it for its
        commands' retry budget (seen: a slot drained 33 s late). None where not done."""
        if time.monotonic() < self.reservation_mirror_away_until:
            return None
        try:
            async with asyncio.timeout(RESERVATION_MIRROR_WAIT_WALL_S):
                return await op()
        except Exception as exc:  # noqa: BLE001 - soft state: the scheduler's own view stands
            self.reservation_mirror_away_until = time.monotonic() + RESERVATION_MIRROR_PAUSE_WALL_S
            self.log.warning(f"reservation.{'mirror' if what == 'claim' else what}_failed",
                             error=type(exc).__name__, paused_s=RESERVATION_MIRROR_PAUSE_WALL_S)
            return None

    async def _switch(self, old: str | None, new: str) -> None:
        """Ask the substrate for a switch until it is done. The substrate says it has the
        request at once (SwitchAccepted) and again with the model time the switch will be
        done: a request it never acknowledged within `SWITCH_ACK_WALL_S`, or a result that
        has not come `SWITCH_RESULT_MARGIN_WALL_S` after that time, was lost on the bus
        (a NATS node died under it), and is asked again, which is safe (a switch to the
        active model is a wake). Before, a lost request was waited out for 600 model
        seconds plus 30 s of wall time (a chaos run stalled 33 s on one)."""
        # the switch starts when the scheduler decided it, not when the request lands
        requested_at = self.scheduler.switch_started_at
        # a switch can take a cold start's worth of model time; wait for it on the wall clock
        timeout = self.clock.wall_s(600.0) + 30.0
        subject = self.subjects.substrate_switch(self.settings.server_id)
        attempt = failures = 0  # failures: the substrate down or refusing (lost messages are not)
        while True:
            attempt += 1
            retry = self.switch_attempt[new] = asyncio.Event()
            try:
                resp = await self.acked_request(
                    subject, lambda inbox: encode(SwitchRequest(from_model=old, to_model=new,
                                                                requested_at=requested_at, ack_to=inbox)),
                    timeout_s=timeout, ack_wall_s=SWITCH_ACK_WALL_S, interrupt=retry,
                    answer_within=self._switch_result_within)
                out = switch_reply_decoder.decode(resp.data)
                if isinstance(out, ApiError):
                    raise RuntimeError(out.message)
                self.switch_attempt.pop(new, None)
                self.switch_tasks.pop(new, None)
                await self.step(sch.SwitchDone(out.to_model, out.kv_capacity_tokens), at=out.done_at)
                return
            except RequestLost:  # (a lost message is asked for again at once)
                self.log.warning("admission.switch_retry", to_model=new, attempt=attempt,
                                 error="no word from the substrate in time: the request or its result was lost")
            except Exception as exc:  # substrate down, restarting or refusing: keep trying, the calls stay queued
                error = "substrate restarted during the switch" if isinstance(exc, RequestInterrupted) else str(exc)
                self.log.warning("admission.switch_retry", to_model=new, attempt=attempt, error=error or type(exc).__name__)
                failures += 1
                await asyncio.sleep(min(5.0, 0.5 * failures))

    def _switch_result_within(self, ack: bytes) -> float | None:
        """Wall seconds the substrate's switch result may take after this acknowledgement:
        until the model time it says the switch is done, plus a margin (None: unknown yet)."""
        try:
            done_at = switch_accepted_decoder.decode(ack).done_at
        except msgspec.MsgspecError:
            return None
        if done_at is None:
            return None
        return self.clock.wall_s(max(0.0, done_at - self.clock.now())) + SWITCH_RESULT_MARGIN_WALL_S

    async def timer(self) -> None:
        # a wake-up is stepped at its own model time, not at the (later) moment the timer fired
        await drive_timer(self.clock, self.scheduler.next_wakeup, self.wakeup, lambda due: self.step(sch.Tick(), at=due))

    async def heartbeats(self) -> None:
        """Tell every waiting agent its call is alive (queued or running)."""
        sid = self.settings.server_id
        while True:
            await asyncio.sleep(self.settings.heartbeat_wall_s)
            now = self.clock.now()
            for call in self.scheduler.pending_calls():
                sub = self.payloads.get(call.call_id)
                if sub:
                    await self.nc.publish(sub.reply_to, encode(CallQueued(call_id=call.call_id, server_id=sid, waited_s=now - call.arrived_at)))
            for cid in list(self.scheduler.running):
                sub = self.payloads.get(cid)
                if sub is None:
                    continue
                # running: only a run its engine acknowledged (silence lets the agent notice a lost one);
                # queued: one sent while its engine-worker here drains and until the next one announces
                # itself, sent again until it is taken (silent, its agent gave up after its tries, and
                # a vLLM worker loads its weights for minutes first)
                if cid in self.confirmed:
                    await self.nc.publish(sub.reply_to, encode(CallRunning(call_id=cid, server_id=sid)))
                elif sub.call.model in self.engines_draining:
                    await self.nc.publish(sub.reply_to, encode(CallQueued(call_id=cid, server_id=sid,
                                                                          waited_s=now - sub.call.arrived_at)))

    async def mirror(self) -> None:
        """Mirror the scheduler's view into Redis for the router (coalesced): its
        load as fields, its counters as increments (shared/state.py)."""
        sid = self.settings.server_id
        counters = CounterMirror()
        while True:
            await self.dirty.wait()
            self.dirty.clear()
            self._gauge()  # (coalesced with the mirror: not on every step)
            sc = self.scheduler
            cap = sc.kv_capacity or 1
            counted = list(self.newly_counted)
            st = sc.stats
            added = counters.pending({
                "switches": st.switches, "slots": st.slots, "round_waits": st.round_waits, "sp_admits": st.sp_admits,
                "preemptions": st.preemptions, "reservations_made": st.reservations_made,
                "reservations_hit": st.reservations_hit, "reservations_expired": st.reservations_expired,
                "reserved_idle_s": round(st.reserved_idle_s, 3),
            })
            try:
                # one transaction: a router that reads the in-flight hash and then the
                # mirror sees each of these calls in one of them at least
                pipe = self.redis.pipeline(transaction=True)
                write_server_load(pipe, self.keys, sid, ServerLoad(
                    active=sc.active, phase=sc.phase, queued=sc.queued(), running=len(sc.running),
                    kv_occupancy=sc.reserved_kv_tokens() / cap, load_tokens=sc.load_tokens(),
                    reservations=len(sc.reservations), live_models=frozenset(sc.live_models()),
                    models=frozenset(sc.models)))
                add_counters(pipe, self.keys, sid, added)
                if counted:
                    pipe.hdel(self.keys.in_flight(sid), *counted)
                await pipe.execute()
                counters.written(added)
                self.newly_counted.difference_update(counted)
            except Exception as exc:
                self.log.warning("admission.mirror_failed", error=str(exc))
            # coalesce bursts, but keep the router's view fresh: a wall millisecond is
            # time_scale milliseconds of model time, and two arrivals that close apart
            # would otherwise both see the server as it was before either
            await asyncio.sleep(MIRROR_COALESCE_S)


def main() -> None:
    run_service(AdmissionService)
