"""engine-worker: one (server, model) engine behind NATS.

Runs the `sim` backend's SimEngine state machine on the scaled clock: a timer
task sleeps until the engine's next event, advances it and publishes what
finished. Replies go straight to the agent's reply subject and into the reply
cache (so a retried call id gets the same reply, never a second generation).
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog
from nats.aio.msg import Msg

from shared.costmodel import CostModel
from services.engine.sim_engine import CallResult, EngineCall, SimEngine
from shared.bus import ServiceProcess, run_service, trace_headers
from shared.clock import at_source, drive_timer
from shared.keys import CALL_TTL_S, SESSION_TTL_S
from shared.schema import (
    Abort, CallFinished, EngineAnnounce, CallReply, CallRunning, ControlOk, EngineState, ForgetHostKv, KvSpilled,
    ListCalls, ProtectKv, ReleaseSession, RunCall, Sleep, Wake, control_decoder, encode, reply_decoder, run_decoder,
)


class EngineWorkerBase(ServiceProcess):
    """What every engine backend's worker shares: its identity, one (server, model)."""

    name = "engine"

    @property
    def instance(self) -> str:
        return f"engine-{self.settings.server_id}-{self.settings.model}"

    def check_model(self) -> None:
        if self.settings.model not in self.catalog.models:
            raise SystemExit(f"engine-worker: unknown model {self.settings.model!r}")


class EngineWorker(EngineWorkerBase):
    async def setup(self) -> None:
        s = self.settings
        self.check_model()
        self.log = self.log.bind(model=s.model)
        cost = CostModel(self.catalog, self.catalog.server(s.server_profile), s.switch_cost_scale, s.prefill_speed_scale)
        self.engine = SimEngine(self.catalog.model(s.model), cost, spill_to_host=s.policy.host_kv)
        self.calls: dict[str, RunCall] = {}
        self.wakeup = asyncio.Event()
        await self.nc.subscribe(self.subjects.engine_run(s.server_id, s.model), queue="engine",
                                cb=self.guarded_handler(self.on_run, "run"))
        await self.nc.subscribe(self.subjects.engine_control(s.server_id, s.model), queue="engine",
                                cb=self.guarded_handler(self.on_control, "control"))
        self.pending: dict[str, RunCall] = {}  # runs that arrived while asleep, submitted at wake-up
        self.spawn(self.timer(), "engine-timer")
        # announce (re)start: a restarted worker comes back asleep and empty
        await self.nc.publish(self.subjects.engine_announce(s.server_id),
                              encode(EngineAnnounce(server_id=s.server_id, model=s.model, awake=False)))

    async def on_run(self, msg: Msg) -> None:
        rc = run_decoder.decode(msg.data)
        with structlog.contextvars.bound_contextvars(session_id=rc.session_id, call_id=rc.call_id):
            cached = await self.redis.get(self.keys.reply(rc.call_id))
            if cached is not None:  # already served: hand back the same reply
                await self.nc.publish(rc.reply_to, cached)
                self.log.info("engine.duplicate_run", served_from="reply-cache")
                # tell admission again: it may have missed the first CallFinished (restarted meanwhile)
                with contextlib.suppress(Exception):
                    done = reply_decoder.decode(cached)
                    await self.nc.publish(self.subjects.call_finished(self.settings.server_id),
                                          encode(CallFinished(call_id=rc.call_id, session_id=rc.session_id,
                                                              context_tokens=done.prompt_tokens + done.output_tokens)))
                return
            if rc.call_id in self.calls:
                return
            if not self.engine.active:
                # e.g. this worker restarted and the substrate has not re-woken it yet
                self.pending[rc.call_id] = rc
                self.log.info("engine.run_deferred", reason="asleep")
                return
            await self._submit(rc)

    async def _submit(self, rc: RunCall) -> None:
        with structlog.contextvars.bound_contextvars(session_id=rc.session_id, call_id=rc.call_id):
            # start at the dispatch's own model time (not when the message landed), never
            # before the engine's clock: message latency stays out of the model's answer
            now = at_source(rc.dispatched_at, self.clock.now(), self.engine.t)
            self.engine.submit(
                EngineCall(rc.call_id, rc.session_id, rc.model, rc.prompt_tokens, rc.prefix_tokens,
                           rc.max_tokens, rc.stop_tokens, rc.reserved_tokens),
                now,
            )
            self.calls[rc.call_id] = rc
            self.log.info("engine.started", at=round(now, 3), prompt_tokens=rc.prompt_tokens, prefix_tokens=rc.prefix_tokens)
            await self._report_spills()
            await self.nc.publish(rc.reply_to, encode(CallRunning(call_id=rc.call_id, server_id=self.settings.server_id)))
            self.wakeup.set()

    async def on_control(self, msg: Msg) -> None:
        cmd = control_decoder.decode(msg.data)
        now = self.clock.now()
        out = ControlOk()
        match cmd:
            case Sleep():
                await self._publish(self.engine.advance(now))
                kv = self.engine.sleep(now)
                out = ControlOk(kv_out=kv)
                self.log.info("engine.sleep", kv_sessions=len(kv), at=round(now, 3))
            case Wake(kv_capacity_tokens=cap, host_kv=host, at=at):
                if self.engine.active:  # a repeated wake only refreshes the budget
                    self.engine.kv_capacity_tokens = cap
                else:
                    # awake from the switch's end in model time, not from when the message landed
                    self.engine.wake(at_source(at, now, self.engine.t), cap, host)
                self.log.info("engine.wake", kv_capacity_tokens=cap, host_kv_sessions=len(host), at=round(now, 3))
                for rc in list(self.pending.values()):
                    del self.pending[rc.call_id]
                    await self._submit(rc)
            case Abort(call_id=cid, at=at):
                # preempted at admission's decision time, not when the message landed
                self.engine.abort(cid, at_source(at, now, self.engine.t))
                self.calls.pop(cid, None)
            case ProtectKv(session_id=sid, on=on):
                (self.engine.protected.add if on else self.engine.protected.discard)(sid)
            case ListCalls():
                await self._publish(self.engine.advance(now))
                state = EngineState(awake=self.engine.active, kv_capacity_tokens=self.engine.kv_capacity_tokens,
                                    running=[rc for cid, rc in self.calls.items() if cid in self.engine.running],
                                    pending=list(self.pending.values()))
                if msg.reply:
                    await self.nc.publish(msg.reply, encode(state))
                return
            case ReleaseSession(session_id=sid):
                self.engine.protected.discard(sid)
                dropped = self.engine.hbm_kv.pop(sid, 0) + self.engine.host_kv.pop(sid, 0)
                self.log.info("engine.session_released", session_id=sid, kv_tokens=dropped)
            case ForgetHostKv(session_ids=sids):
                self.engine.forget_host(sids)
                self.log.info("engine.host_kv_forgotten", sessions=len(sids))
        await self._report_spills()
        self.wakeup.set()
        if msg.reply:
            await self.nc.publish(msg.reply, encode(out))

    async def timer(self) -> None:
        # advance to now, not just to the due time: it computes every finish up to now in one go
        await drive_timer(self.clock, self.engine.next_event_at, self.wakeup,
                          lambda _due: self._publish(self.engine.advance(self.clock.now())))

    async def _report_spills(self) -> None:
        """KV pushed out of HBM to host for room: the locality view says `host`
        and the substrate books it (it owns host memory and may refuse some)."""
        spilled = self.engine.take_spilled()
        if not spilled:
            return
        s = self.settings
        pipe = self.redis.pipeline(transaction=False)
        for sid in spilled:
            pipe.hset(self.keys.kv_locality(sid), s.server_id, "host")
        await pipe.execute()
        await self.nc.publish(self.subjects.kv_spilled(s.server_id),
                              encode(KvSpilled(server_id=s.server_id, model=s.model, sessions=spilled, at=self.engine.t)))
        self.log.info("engine.kv_spilled", sessions=len(spilled), tokens=sum(spilled.values()), at=round(self.engine.t, 3))

    async def _publish(self, done: list[CallResult]) -> None:
        s = self.settings
        await self._report_spills()
        for r in done:
            rc = self.calls.pop(r.call_id, None)
            if rc is None:
                continue
            reply = CallReply(
                call_id=r.call_id, session_id=r.session_id, server_id=s.server_id, model=r.model,
                prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens, restored_tokens=r.restored_tokens,
                reprefill_tokens=r.reprefill_tokens, output_tokens=r.output_tokens, arrived_at=rc.arrived_at,
                finished_at=r.finished_at, waited_s=rc.waited_s, switch_wait_s=rc.switch_wait_s,
                round_wait=rc.round_wait, restore_s=r.restore_s, prefill_s=r.prefill_s, decode_s=r.decode_s,
            )
            data = encode(reply)
            skey = self.keys.session(r.session_id)
            pipe = self.redis.pipeline(transaction=True)
            pipe.set(self.keys.reply(r.call_id), data, ex=CALL_TTL_S)
            pipe.hset(skey, mapping={"last_finish": repr(r.finished_at), "last_server": s.server_id})
            pipe.rpush(self.keys.session_outputs(r.session_id), r.output_tokens)
            pipe.expire(skey, SESSION_TTL_S)
            pipe.expire(self.keys.session_outputs(r.session_id), SESSION_TTL_S)
            pipe.hset(self.keys.kv_locality(r.session_id), s.server_id, "hbm")
            # model seconds with a call running, for the replay's utilisation (one field per engine)
            pipe.hset(self.keys.server(s.server_id), f"stat_busy_s_{s.model}", f"{self.engine.busy_s:.3f}")
            await pipe.execute()
            hdrs = trace_headers(r.session_id, r.call_id)
            await self.nc.publish(rc.reply_to, data, headers=hdrs)
            await self.nc.publish(self.subjects.call_finished(s.server_id),
                                  encode(CallFinished(call_id=r.call_id, session_id=r.session_id,
                                                      context_tokens=r.prompt_tokens + r.output_tokens,
                                                      finished_at=r.finished_at)), headers=hdrs)
            self.log.info("engine.finished", session_id=r.session_id, call_id=r.call_id, at=round(r.finished_at, 3),
                          cached_tokens=r.cached_tokens, restored_tokens=r.restored_tokens,
                          reprefill_tokens=r.reprefill_tokens, output_tokens=r.output_tokens,
                          prefill_s=round(r.prefill_s, 3), decode_s=round(r.decode_s, 3))


def main() -> None:
    import os

    backend = os.environ.get("TALARIA_ENGINE", "sim").strip() or "sim"
    if backend == "vllm":
        from services.engine.vllm_backend import VllmEngineWorker  # imports vLLM only when asked

        run_service(VllmEngineWorker)
    elif backend == "sim":
        run_service(EngineWorker)
    else:
        raise SystemExit(f"engine-worker: unknown TALARIA_ENGINE {backend!r} (sim|vllm)")
