"""admission: the round scheduler of one server behind NATS.

Steps the pure RoundScheduler with the scaled clock: on each submitted call,
finished call, switch completion and timer wake-up, and carries out the
actions it returns (dispatch to an engine-worker, switch through the
substrate-manager, staging hints, KV protection for reservations). Queued and
running calls hear a heartbeat so their agents know they are alive.
"""

from __future__ import annotations

import asyncio

import structlog
from nats.aio.msg import Msg

from services.admission import scheduler as sch
from services.engine.costmodel import CostModel
from shared.bus import ServiceProcess, run_service, trace_headers
from shared.schema import (
    Abort, ApiError, CallQueued, CallRunning, ProtectKv, RunCall, StageRequest, Submitted, SubmitCall,
    SwitchRequest, admission_decoder, encode, engine_announce_decoder, finished_decoder, session_ended_decoder,
    switch_reply_decoder,
)


class AdmissionService(ServiceProcess):
    name = "admission"

    @property
    def instance(self) -> str:
        return f"admission-{self.settings.server_id}"

    async def setup(self) -> None:
        s = self.settings
        cost = CostModel(self.catalog, self.catalog.server(s.server_profile), s.switch_cost_scale, s.prefill_speed_scale)
        specs = {m: self.catalog.model(m) for m in sorted(s.models)}
        self.scheduler = sch.RoundScheduler(s.server_id, specs, cost, s.policy)
        self.payloads: dict[str, SubmitCall] = {}
        self.wakeup = asyncio.Event()
        self.dirty = asyncio.Event()
        sid = s.server_id
        await self.nc.subscribe(self.subjects.admission_submit(sid), queue="admission",
                                cb=self.guarded_handler(self.on_submit, "submit"))
        await self.nc.subscribe(self.subjects.call_finished(sid), queue="admission",
                                cb=self.guarded_handler(self.on_finished, "finished"))
        await self.nc.subscribe(self.subjects.session_ended, cb=self.guarded_handler(self.on_session_ended, "session_ended"))
        await self.nc.subscribe(self.subjects.engine_announce(sid), cb=self.guarded_handler(self.on_engine_announce, "engine_announce"))
        self.dispatched: dict[str, RunCall] = {}
        await self.redis.sadd(self.keys.servers(), sid)
        # compare-and-delete: release a reservation only if it is still ours
        self._release_script = self.redis.register_script(
            "local v = redis.call('GET', KEYS[1]) "
            "if v and string.sub(v, 1, string.len(ARGV[1])) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0")
        self.spawn(self.timer(), "admission-timer")
        self.spawn(self.heartbeats(), "heartbeats")
        self.spawn(self.mirror(), "mirror")

    # -- handlers ----------------------------------------------------------------
    async def on_submit(self, msg: Msg) -> None:
        sub = admission_decoder.decode(msg.data)
        c = sub.call
        with structlog.contextvars.bound_contextvars(session_id=c.session_id, call_id=c.call_id):
            if c.model not in self.scheduler.models:
                await self.reply_error(msg.reply, "unknown_model", f"{c.model} is not served on {self.settings.server_id}", c.call_id)
                return
            self.payloads.setdefault(c.call_id, sub)
            if msg.reply:
                await self.nc.publish(msg.reply, encode(Submitted(call_id=c.call_id, server_id=self.settings.server_id)))
            call = sch.AdmissionCall(
                call_id=c.call_id, session_id=c.session_id, model=c.model, prompt_tokens=c.prompt_tokens,
                prefix_tokens=c.prefix_tokens, max_tokens=c.max_tokens, arrived_at=c.arrived_at,
                continuation=c.continuation, gap_history=tuple(c.gap_history), output_history=tuple(c.output_history),
                session_started_at=c.session_started_at,
            )
            self.log.info("admission.queued", model=c.model, at=round(self.clock.now(), 3))
            await self.step(sch.Arrive(call))

    async def on_finished(self, msg: Msg) -> None:
        ev = finished_decoder.decode(msg.data)
        self.payloads.pop(ev.call_id, None)
        self.dispatched.pop(ev.call_id, None)
        await self.step(sch.Finished(ev.call_id, ev.session_id, ev.context_tokens))

    async def on_engine_announce(self, msg: Msg) -> None:
        """An engine-worker restarted and lost what it ran: send those calls again
        (same ids; the engine holds them until it is awake)."""
        ann = engine_announce_decoder.decode(msg.data)
        for cid, run in list(self.dispatched.items()):
            if run.model == ann.model and cid in self.scheduler.running:
                self.log.warning("admission.redispatch", call_id=cid, session_id=run.session_id, model=run.model)
                await self.nc.publish(self.subjects.engine_run(self.settings.server_id, run.model), encode(run),
                                      headers=trace_headers(run.session_id, cid))

    async def on_session_ended(self, msg: Msg) -> None:
        ev = session_ended_decoder.decode(msg.data)
        await self.step(sch.SessionEnded(ev.session_id))

    # -- the state machine ---------------------------------------------------------
    async def step(self, event: sch.Event) -> None:
        actions = self.scheduler.step(event, self.clock.now())
        await self.apply(actions)
        self.wakeup.set()
        self.dirty.set()

    async def apply(self, actions: list[sch.Action]) -> None:
        s = self.settings
        for a in actions:
            match a:
                case sch.Dispatch(call=c):
                    sub = self.payloads.get(c.call_id)
                    if sub is None:
                        self.log.error("admission.lost_payload", call_id=c.call_id)
                        continue
                    stop = sub.sim_output_tokens or c.max_tokens
                    run = RunCall(
                        call_id=c.call_id, session_id=c.session_id, model=c.model, prompt_tokens=c.prompt_tokens,
                        prefix_tokens=c.prefix_tokens, max_tokens=c.max_tokens, stop_tokens=stop,
                        reserved_tokens=a.reserved_tokens, reply_to=sub.reply_to, arrived_at=c.arrived_at,
                        waited_s=a.waited_s, switch_wait_s=a.switch_wait_s, round_wait=a.round_wait,
                    )
                    self.log.info("admission.dispatched", session_id=c.session_id, call_id=c.call_id, model=c.model,
                                  slot_id=a.slot_id, waited_s=round(a.waited_s, 3), round_wait=a.round_wait)
                    self.dispatched[c.call_id] = run
                    await self.nc.publish(self.subjects.engine_run(s.server_id, c.model), encode(run),
                                          headers=trace_headers(c.session_id, c.call_id))
                case sch.StartSwitch(from_model=old, to_model=new):
                    self.log.info("admission.switch", from_model=old, to_model=new)
                    self.spawn(self._switch(old, new), "switch")
                case sch.Stage(model=m):
                    await self.nc.publish(self.subjects.substrate_stage(s.server_id), encode(StageRequest(model=m)))
                case sch.Preempt(call_id=cid):
                    for m in self.scheduler.models:
                        await self.nc.publish(self.subjects.engine_control(s.server_id, m), encode(Abort(call_id=cid)))
                case sch.Protect(session_id=sid, model=m, on=on):
                    if on and not await self._claim(sid):
                        await self.apply(self.scheduler.cancel_reservation(sid))
                        continue
                    if not on:
                        await self._release(sid)
                    await self.nc.publish(self.subjects.engine_control(s.server_id, m), encode(ProtectKv(session_id=sid, on=on)))
                case sch.SlotOpened(model=m, slot_id=i, at=t):
                    self.log.info("admission.slot_opened", model=m, slot_id=i, at=round(t, 3))
                case sch.SlotClosed(model=m, slot_id=i, at=t, reason=why):
                    self.log.info("admission.slot_closed", model=m, slot_id=i, at=round(t, 3), reason=why)

    async def _claim(self, session_id: str) -> bool:
        """Mirror a reservation into Redis atomically: one claim per session
        (SET NX), expiring in model time (PX = hold / time scale)."""
        res = self.scheduler.reservations.get(session_id)
        if res is None:
            return False
        ttl_ms = max(1, int(self.clock.wall_s(res.expires_at - self.clock.now()) * 1000))
        value = f"{self.settings.server_id}|{res.expires_at:.3f}"
        try:
            ok = await self.redis.set(self.keys.reservation(session_id), value, nx=True, px=ttl_ms)
        except Exception as exc:  # Redis away: the claim stays local (soft state)
            self.log.warning("reservation.mirror_failed", error=str(exc))
            return True
        if not ok:
            self.log.info("reservation.refused", session_id=session_id, reason="claimed elsewhere")
        return bool(ok)

    async def _release(self, session_id: str) -> None:
        try:
            await self._release_script(keys=[self.keys.reservation(session_id)], args=[f"{self.settings.server_id}|"])
        except Exception as exc:
            self.log.warning("reservation.release_failed", error=str(exc))

    async def _switch(self, old: str | None, new: str) -> None:
        # a switch can take a cold start's worth of model time; wait for it on the wall clock
        timeout = self.clock.wall_s(600.0) + 30.0
        attempt = 0
        while True:
            attempt += 1
            try:
                resp = await self.nc.request(self.subjects.substrate_switch(self.settings.server_id),
                                             encode(SwitchRequest(from_model=old, to_model=new)), timeout=timeout)
                out = switch_reply_decoder.decode(resp.data)
                if isinstance(out, ApiError):
                    raise RuntimeError(out.message)
                await self.step(sch.SwitchDone(out.to_model, out.kv_capacity_tokens))
                return
            except Exception as exc:  # substrate down or restarting: keep trying, the calls stay queued
                self.log.warning("admission.switch_retry", to_model=new, attempt=attempt, error=str(exc) or type(exc).__name__)
                await asyncio.sleep(min(5.0, 0.5 * attempt))

    async def timer(self) -> None:
        while True:
            self.wakeup.clear()
            nxt = self.scheduler.next_wakeup()
            if nxt is None:
                await self.wakeup.wait()
                continue
            delay = self.clock.wall_s(nxt - self.clock.now())
            if delay > 0:
                try:
                    await asyncio.wait_for(self.wakeup.wait(), timeout=delay)
                    continue
                except TimeoutError:
                    pass
            await self.step(sch.Tick())

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
                if sub:
                    await self.nc.publish(sub.reply_to, encode(CallRunning(call_id=cid, server_id=sid)))

    async def mirror(self) -> None:
        """Mirror the scheduler's view into Redis for the router (coalesced)."""
        key = self.keys.server(self.settings.server_id)
        while True:
            await self.dirty.wait()
            self.dirty.clear()
            sc = self.scheduler
            cap = sc.kv_capacity or 1
            try:
                await self.redis.hset(key, mapping={
                    "active": sc.active or "",
                    "phase": sc.phase,
                    "queued": sc.queued(),
                    "running": len(sc.running),
                    "kv_occupancy": f"{sc.reserved_kv_tokens() / cap:.4f}",
                    "load_tokens": sc.load_tokens(),
                    "reservations": len(sc.reservations),
                    "models": ",".join(sc.models),
                    # counters for reports (the replay sums them over servers)
                    "stat_switches": sc.stats.switches,
                    "stat_slots": sc.stats.slots,
                    "stat_round_waits": sc.stats.round_waits,
                    "stat_sp_admits": sc.stats.sp_admits,
                    "stat_preemptions": sc.stats.preemptions,
                    "stat_reservations_made": sc.stats.reservations_made,
                    "stat_reservations_hit": sc.stats.reservations_hit,
                    "stat_reservations_expired": sc.stats.reservations_expired,
                    "stat_reserved_idle_s": f"{sc.stats.reserved_idle_s:.3f}",
                })
            except Exception as exc:
                self.log.warning("admission.mirror_failed", error=str(exc))
            await asyncio.sleep(0.05)


def main() -> None:
    run_service(AdmissionService)
