"""substrate-manager: owns one server's memory ledger and executes switches.

A switch request from admission is carried out as: put the old engine to
sleep (it hands back its idle KV table), plan the switch on the ledger (host-KV
spill, staged weights, fixed costs), wait the planned duration on the model
clock, wake the new engine with its KV budget and host-KV view, answer. The
ledger is mirrored into Redis for the router; the engines only report.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import nats.errors
from nats.aio.msg import Msg

from shared.costmodel import CostModel
from services.substrate.ledger import SubstrateLedger
from shared.bus import REDIS_AWAY, RequestInterrupted, RequestLost, ServiceProcess, run_service
from shared.state import SubstrateView, decode_server, write_substrate_view
from shared.schema import (
    ApiError, ControlOk, EngineState, ForgetHostKv, ListCalls, Sleep, StageRequest, SubstrateAnnounce, SwitchAccepted,
    SwitchRequest, SwitchResult, Wake,
    control_reply_decoder, encode, engine_announce_decoder, kv_spilled_decoder, session_released_decoder,
    substrate_decoder,
)


CONTROL_RESENDS_ON_RESTART = 3  # a worker that restarts more often than this during one command fails the switch
CONTROL_ACK_WALL_S = 1.0  # wall seconds a Sleep/Wake may go unacknowledged before it is sent again
MIRROR_RETRY_WALL_S = 1.0  # how often a view Redis did not take is written again
MIRROR_WAIT_WALL_S = 1.0   # how long a switch waits on its view's write before it goes on without it
RELEASE_SETTLE_WALL_S = 5.0  # after a session's release, when KV reports that raced it have all landed


class SubstrateManager(ServiceProcess):
    name = "substrate"

    async def setup(self) -> None:
        s = self.settings
        profile = self.catalog.server(s.server_profile)
        cost = CostModel(self.catalog, profile, s.switch_cost_scale, s.prefill_speed_scale)
        self.switching_to: set[str] = set()
        # model -> set when its engine-worker announces a (re)start: a Sleep/Wake sent to the
        # process it replaced (hung, then killed) is sent again at once, not waited out
        self.engine_restarted: dict[str, asyncio.Event] = {}
        self.switch_lock = asyncio.Lock()  # one switch at a time, even if a restarted admission asks again
        self.mirror_lock = asyncio.Lock()  # one mirror write at a time, each of the ledger as it is then: the last is the latest
        self.mirror_behind = False  # a mirror failed (Redis away): written again until it takes
        self.last_switch_end = 0.0  # model time
        self.ledger = SubstrateLedger(profile, {m: self.catalog.model(m) for m in sorted(s.models)}, cost, s.policy)
        await self.nc.subscribe(self.subjects.substrate_switch(s.server_id), queue="substrate",
                                cb=self.guarded_handler(self.on_request, "substrate"))
        await self.nc.subscribe(self.subjects.substrate_stage(s.server_id), queue="substrate",
                                cb=self.guarded_handler(self.on_request, "substrate"))
        await self.nc.subscribe(self.subjects.engine_announce(s.server_id),
                                cb=self.guarded_handler(self.on_engine_announce, "engine_announce"))
        await self.nc.subscribe(self.subjects.kv_spilled(s.server_id), queue="substrate",
                                cb=self.guarded_handler(self.on_kv_spilled, "kv_spilled"))
        await self.nc.subscribe(self.subjects.session_released,
                                cb=self.guarded_handler(self.on_session_released, "session_released"))
        await self._recover_active()
        await self._mirror_or_defer()
        # a switch an admission was waiting for died with our predecessor: it asks again
        await self.nc.publish(self.subjects.substrate_announce(s.server_id), encode(SubstrateAnnounce(server_id=s.server_id)))

    async def _recover_active(self) -> None:
        """Which model is awake is known by the engine-workers, not by us after a
        restart: ask each (ListCalls, all at once). Without it, a worker of the active
        model that restarted after us was never woken again (we did not know its model
        was active), and its open slot waited for ever (a chaos run stalled 15 s so)."""
        models = sorted(self.ledger.models)
        async with self.switch_lock:  # (a switch asked meanwhile waits for what we learn)
            states = await self.engine_states(models, ListCalls())
        # (one down or hung announces itself when back)
        up = [m for m, st in states.items() if isinstance(st, EngineState) and st.awake]
        if up and self.ledger.active is None:
            if len(up) > 1:
                self.log.warning("substrate.several_awake", models=up)
            self.ledger.recover_active(up[0])
            self.log.warning("substrate.recovered", active=up[0])
        elif not up and self.ledger.active is None and (last := await self._last_resident()) is not None:
            # none awake, yet our predecessor had one resident: its worker restarted with us (both
            # on a lost NATS node, say), and its restart announcement came before we listened.
            # Admission still serves that model; wake it, or its calls wait on a sleeping engine for ever
            self.ledger.recover_active(last)
            self.log.warning("substrate.recovered", active=last, source="the mirrored resident; its worker restarted")
            self.spawn(self._rewake(last), "rewake")

    def _wake_active(self, model: str) -> Wake:
        """The Wake that brings the active model's worker back as the ledger has it (its KV
        capacity, and its host KV view where the policy keeps one)."""
        view = self.ledger.host_view(model) if self.settings.policy.host_kv else {}
        return Wake(kv_capacity_tokens=self.ledger.kv_capacity_tokens(model), host_kv=view)

    async def _rewake(self, model: str) -> None:
        """Wake the active model's worker again. None listening (it is down too, restarting
        beside us) is no failure: its announcement, when it is back, wakes it (above)."""
        try:
            await self._control(model, self._wake_active(model))
        except nats.errors.NoRespondersError:
            self.log.warning("substrate.rewake_deferred", model=model,
                             reason="no engine-worker listens; woken when it announces itself")

    async def _last_resident(self) -> str | None:
        """The resident model our predecessor mirrored (None: none, or Redis away)."""
        try:
            resident = decode_server(await self.redis.hgetall(self.keys.server(self.settings.server_id))).substrate.resident
        except REDIS_AWAY as exc:
            self.log.warning("substrate.mirror_unread", error=type(exc).__name__)
            return None
        return resident if resident in self.ledger.models else None

    async def on_engine_announce(self, msg: Msg) -> None:
        ann = engine_announce_decoder.decode(msg.data)
        if not ann.awake and ann.model in self.engine_restarted:
            self.engine_restarted[ann.model].set()
        if ann.model == self.ledger.active and not ann.awake and ann.model not in self.switching_to:
            # the active model's worker restarted: wake it again (its KV is gone)
            self.log.warning("substrate.rewake", model=ann.model)
            self.spawn(self._rewake(ann.model), "rewake")

    async def on_session_released(self, msg: Msg) -> None:
        """An ended or idle session's host KV is released (the ledger owns host memory)."""
        ev = session_released_decoder.decode(msg.data)
        if ev.applies_to(self.settings.server_id):
            self.ledger.forget_session(ev.session_id)
            self.log.info("substrate.session_released", session_id=ev.session_id, reason=ev.reason,
                          host_kv_gb=round(self.ledger.host_kv_bytes() / 1e9, 1))
            await self._mirror_or_defer()
            self.spawn(self._forget_again(ev.session_id), "release settles")

    async def _forget_again(self, session_id: str) -> None:
        """A release settles over the bus: an engine's report of KV it held before it heard
        the release (a switch's Sleep, a spill) can land here after it, and booked the
        session's KV in host memory for good (a soak probe: 179 MB booked with every
        session released). What such a report booked is released once they have landed."""
        await asyncio.sleep(RELEASE_SETTLE_WALL_S)
        tokens = self.ledger.forget_session(session_id)
        if tokens:
            self.log.info("substrate.released_kv_dropped", session_id=session_id, kv_tokens=tokens,
                          host_kv_gb=round(self.ledger.host_kv_bytes() / 1e9, 1))
            await self._mirror_or_defer()

    async def on_kv_spilled(self, msg: Msg) -> None:
        ev = kv_spilled_decoder.decode(msg.data)
        if not self.settings.policy.host_kv or ev.model not in self.ledger.models:
            self.log.warning("substrate.kv_spill_refused", model=ev.model, sessions=len(ev.sessions))
            lost = list(ev.sessions)
        else:
            lost = self.ledger.accept_spill(ev.model, ev.sessions)
            self.log.info("substrate.kv_spilled", model=ev.model, sessions=len(ev.sessions), lost=len(lost),
                          host_kv_gb=round(self.ledger.host_kv_bytes() / 1e9, 1))
        if lost:  # refused, or the tier is full: the engine must not restore what host DRAM does not hold
            await self.nc.publish(self.subjects.engine_control(self.settings.server_id, ev.model),
                                  encode(ForgetHostKv(session_ids=lost)))

    async def on_request(self, msg: Msg) -> None:
        req = substrate_decoder.decode(msg.data)
        match req:
            case StageRequest(model=m, requested_at=at):
                if m in self.ledger.models:
                    st = self.ledger.stage(m, self.clock.at_source(at, self.last_switch_end))
                    if st is not None:
                        self.log.info("substrate.stage", model=m, staged_gb=round(st.nbytes / 1e9, 1))
                    await self._mirror_or_defer()
            case SwitchRequest():
                # a switch takes model time: run it beside the subscription
                self.spawn(self._switch(req, msg.reply), "switch")

    async def _control(self, model: str, cmd: Sleep | Wake) -> ControlOk:
        """Send a Sleep/Wake to a model's engine-worker and wait for its answer. The
        worker says it has the command on receipt (ControlAccepted): one it has not
        acknowledged within `CONTROL_ACK_WALL_S` was lost on the bus (a NATS node died
        under it) and goes again, until the control timeout; one acknowledged is waited
        for. If the worker announces a restart meanwhile (the one we asked hung and was
        replaced), the command goes again to the new process at once. Before, a lost
        command, or one held by a process that is gone, stalled the switch behind it for
        the whole control timeout (10 s in a 200x chaos run)."""
        subject = self.subjects.engine_control(self.settings.server_id, model)
        restarted = self.engine_restarted.setdefault(model, asyncio.Event())
        give_up_at = time.monotonic() + self.settings.control_timeout_s
        restarts = 0
        while True:
            restarted.clear()
            try:
                resp = await self.acked_request(subject, lambda inbox: encode(msgspec.structs.replace(cmd, ack_to=inbox)),
                                                timeout_s=self.settings.control_timeout_s,
                                                ack_wall_s=CONTROL_ACK_WALL_S, interrupt=restarted)
                out = control_reply_decoder.decode(resp.data)
                if isinstance(out, ApiError):
                    raise RuntimeError(f"engine {model}: {out.message}")
                return out
            except RequestInterrupted:
                restarts += 1
                if restarts > CONTROL_RESENDS_ON_RESTART:
                    raise RuntimeError(f"engine {model} restarted {CONTROL_RESENDS_ON_RESTART} times during one command")
                reason = "engine-worker restarted"
            except RequestLost:
                if time.monotonic() >= give_up_at:
                    raise RuntimeError(f"engine {model}: no answer to {type(cmd).__name__} in "
                                       f"{self.settings.control_timeout_s:g} s") from None
                reason = "no acknowledgement"
            self.log.warning("substrate.control_resent", model=model, command=type(cmd).__name__, reason=reason)

    async def _accepted(self, req: SwitchRequest, done_at: float | None = None) -> None:
        if req.ack_to:
            await self.nc.publish(req.ack_to, encode(SwitchAccepted(to_model=req.to_model, done_at=done_at)))

    async def _switch(self, req: SwitchRequest, reply: str | None) -> None:
        await self._accepted(req)  # (on receipt: the requester stops waiting for a lost request)
        if req.to_model not in self.ledger.models:
            await self.reply_error(reply, "unknown_model", f"{req.to_model} is not served on {self.settings.server_id}")
            return
        if req.from_model is not None and req.from_model not in self.ledger.models:
            # no engine answers for it: its Sleep would fail and the requester would hear nothing
            await self.reply_error(reply, "unknown_model", f"{req.from_model} is not served on {self.settings.server_id}")
            return
        self.switching_to.add(req.to_model)
        try:
            async with self.switch_lock:
                await self._switch_locked(req, reply)
        except Exception as exc:
            # e.g. the incoming engine is down and its Wake found no responder or timed
            # out: say so now, so admission asks again soon (once the ledger has the
            # model active, a retry only wakes it) instead of waiting out its request
            # timeout; the worker's restart announcement gets it woken meanwhile
            self.log.warning("substrate.switch_failed", to_model=req.to_model, error=str(exc) or type(exc).__name__)
            await self.reply_error(reply, "internal", f"switch to {req.to_model} failed: "
                                   f"{str(exc) or type(exc).__name__}; ask again", retry_after_s=0.5)
        finally:
            self.switching_to.discard(req.to_model)

    async def _switch_locked(self, req: SwitchRequest, reply: str | None) -> None:
        if req.to_model == self.ledger.active:
            # already active (a repeated request, e.g. from a restarted admission): wake is idempotent
            wake = self._wake_active(req.to_model)
            await self._control(req.to_model, wake)
            if reply:
                await self.nc.publish(reply, encode(SwitchResult(
                    to_model=req.to_model, kv_capacity_tokens=wake.kv_capacity_tokens, duration_s=0.0)))
            return
        if self.ledger.active and req.from_model != self.ledger.active:
            # the requester's view is stale (it restarted): put to sleep what is really awake
            self.log.warning("substrate.switch_from_corrected", asked=req.from_model, active=self.ledger.active)
            req = SwitchRequest(from_model=self.ledger.active, to_model=req.to_model, requested_at=req.requested_at)
        await self._do_switch(req, reply, self.clock.at_source(req.requested_at, self.last_switch_end))

    async def _do_switch(self, req: SwitchRequest, reply: str | None, t0: float) -> None:
        kv_out: dict[str, int] = {}
        if req.from_model:
            try:
                kv_out = (await self._control(req.from_model, Sleep())).kv_out
            except nats.errors.NoRespondersError:
                # no worker of it listens (it stopped for a restart; its successor starts asleep and
                # empty): nothing of it is awake to put to sleep, and waiting would hold every switch
                self.log.warning("substrate.sleep_unanswered", model=req.from_model, reason="no engine-worker listens")
                kv_out = {}
        plan = self.ledger.plan_switch(t0, req.to_model, kv_out)
        self.last_switch_end = t0 + plan.duration_s
        await self._accepted(req, done_at=t0 + plan.duration_s)  # when to expect the result
        await self._mirror_or_defer()  # the router sees the model moving in for the switch's duration
        self.ledger.check_bounds()
        self.log.info("substrate.switch", from_model=req.from_model, to_model=req.to_model,
                      duration_s=round(plan.duration_s, 3), weights_in_s=round(plan.weights_in_s, 3),
                      weights_out_s=round(plan.weights_out_s, 3), kv_out_s=round(plan.kv_out_s, 3),
                      fixed_s=round(plan.fixed_s, 3), staged_gb=round(plan.staged_bytes / 1e9, 1),
                      kv_to_host_tokens=plan.kv_to_host_tokens, kv_dropped_tokens=plan.kv_dropped_tokens,
                      region_reservations=self.ledger.region_reservations)
        await self.clock.sleep_until(t0 + plan.duration_s)
        await self._control(req.to_model, Wake(kv_capacity_tokens=plan.kv_capacity_tokens, host_kv=plan.host_kv_view,
                                               at=t0 + plan.duration_s))
        self.ledger.finish_switch()
        await self._mirror_or_defer()
        kind = "staged" if plan.staged_bytes > 0 else "host"  # (the cost model loads every model from host memory)
        self.metrics.switches.labels(server=self.settings.server_id, to_model=req.to_model, kind=kind).inc()
        self.metrics.switch_duration.labels(server=self.settings.server_id, kind=kind).observe(plan.duration_s)
        if reply:
            await self.nc.publish(reply, encode(SwitchResult(
                to_model=req.to_model, kv_capacity_tokens=plan.kv_capacity_tokens, duration_s=plan.duration_s,
                staged_bytes=plan.staged_bytes, kv_to_host_tokens=plan.kv_to_host_tokens,
                kv_dropped_tokens=plan.kv_dropped_tokens, done_at=t0 + plan.duration_s)))

    async def _mirror_or_defer(self) -> None:
        """The view mirrored for the router; where Redis is away (past its retries) the
        switch or request goes on, and the view is written again each second until it
        takes: the router's placement reads a stale view meanwhile, which is soft."""
        if self.mirror_behind:  # (Redis is away: the loop writes the latest view when it answers)
            return
        try:
            # (a stalled Redis is waited on for a moment, not for the commands' whole retry budget)
            async with asyncio.timeout(MIRROR_WAIT_WALL_S):
                await self._mirror()
        except (TimeoutError, *REDIS_AWAY) as exc:
            self.log.warning("substrate.mirror_deferred", error=type(exc).__name__)
            if not self.mirror_behind:
                self.mirror_behind = True
                self.spawn(self._mirror_until_it_takes(), "mirror")

    async def _mirror_until_it_takes(self) -> None:
        while self.mirror_behind:
            await asyncio.sleep(MIRROR_RETRY_WALL_S)
            try:
                await self._mirror()
                self.mirror_behind = False
                self.log.info("substrate.mirror_caught_up")
            except REDIS_AWAY:
                continue

    async def _mirror(self) -> None:
        async with self.mirror_lock:
            await self._write_mirror()

    async def _write_mirror(self) -> None:
        led = self.ledger
        srv = self.settings.server_id
        self.metrics.host_kv_bytes.labels(server=srv).set(led.host_kv_bytes())
        self.metrics.host_kv_capacity_bytes.labels(server=srv).set(led.host_kv_capacity_bytes)
        weights = led.models[led.active].weights_bytes if led.active else 0.0
        if led.staging is not None:
            weights += led.staging.nbytes
        self.metrics.hbm_weights_bytes.labels(server=srv).set(weights)
        for m in led.models:
            self.metrics.active_model.labels(server=srv, model=m).set(1 if m == led.active else 0)
        pipe = self.redis.pipeline(transaction=False)
        write_substrate_view(pipe, self.keys, self.settings.server_id, SubstrateView(
            resident=led.active, staged=led.incoming_model(self.clock.now()), host_kv_gb=led.host_kv_bytes() / 1e9,
            region_reservations=led.region_reservations, switches=led.switches))
        await pipe.execute()


def main() -> None:
    run_service(SubstrateManager)
