"""`talaria sim`: the policies' own code on a virtual clock, in one process.

The same objects the services drive — placement (router), RoundScheduler
(admission), SubstrateLedger (substrate-manager), SimEngine (engine-worker) —
wired by direct calls instead of NATS, with one virtual clock. Decode is
stepped analytically between events, so a 960-call trace takes seconds.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

from services.admission import scheduler as sch
from shared.costmodel import CostModel
from services.engine.sim_engine import EngineCall, SimEngine
from services.router.placement import ServerView, rank, server_view
from services.substrate.ledger import SubstrateLedger
from shared.catalog import Catalog
from shared.policy import DECISION_HISTORY, PolicyConfig
from shared.state import ServerLoad
from talaria.workload.trace import TraceSession
from talaria.workload.agent import DEFAULT_MAX_TOKENS, PlannedCall, call_id_for, plan_session
from talaria.results.records import CallRecord


@dataclass
class _Server:
    server_id: str
    scheduler: sch.RoundScheduler
    ledger: SubstrateLedger
    engines: dict[str, SimEngine]
    switch_s: float = 0.0
    models: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.models = frozenset(self.engines)


@dataclass
class _Session:
    trace: TraceSession
    plan: list[PlannedCall]
    next_index: int = 0
    last_finish: float | None = None
    gaps: list[float] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    last_server: str | None = None
    started_at: float | None = None
    finished_at: float | None = None


@dataclass
class SimResult:
    policy: str
    records: list[CallRecord]
    sct: dict[str, float]
    wall_s: float
    horizon_s: float
    servers: list[dict]
    stats: dict


class Simulator:
    def __init__(
        self,
        sessions: list[TraceSession],
        catalog: Catalog,
        policy: PolicyConfig,
        *,
        servers: int = 1,
        server_profile: str = "h100x8",
        max_tokens: int = DEFAULT_MAX_TOKENS,
        switch_cost_scale: float = 1.0,
        prefill_speed_scale: float = 1.0,
        decode_speed_scale: float = 1.0,
        call_latency_s: float = 0.0,
        check_invariants: bool = False,
    ) -> None:
        if call_latency_s < 0:
            raise ValueError(f"call_latency_s must be >= 0, got {call_latency_s}")
        self.catalog = catalog
        # model seconds between a reply and the session's next call reaching
        # admission, beyond the tool gap: the live control plane's hops
        self.call_latency_s = call_latency_s
        self.policy = policy
        self.check = check_invariants
        profile = catalog.server(server_profile)
        self.cost = CostModel(catalog, profile, switch_cost_scale, prefill_speed_scale, decode_speed_scale)
        model_names = list(dict.fromkeys(s.model for s in sessions))
        specs = {m: catalog.model(m) for m in sorted(model_names)}
        self.servers: dict[str, _Server] = {}
        for i in range(servers):
            sid = f"s{i}"
            self.servers[sid] = _Server(
                server_id=sid,
                scheduler=sch.RoundScheduler(sid, specs, self.cost, policy),
                ledger=SubstrateLedger(profile, specs, self.cost, policy),
                engines={m: SimEngine(spec, self.cost, spill_to_host=policy.host_kv) for m, spec in specs.items()},
            )
        self.sessions = {s.session_id: _Session(s, plan_session(s, max_tokens, context_limit=catalog.model(s.model).context_limit)) for s in sessions}
        self.records: dict[str, CallRecord] = {}
        self._heap: list[tuple[float, int, str, tuple]] = []
        self._seq = itertools.count()
        self._engine_version: dict[tuple[str, str], int] = {}
        self._admission_version: dict[str, int] = {}
        self.now = 0.0
        self._need_load_tokens = policy.placement in ("kv-overlap", "cache-aware")
        self._need_live_models = policy.placement == "talaria"  # round contention is Talaria's term

    # -- event plumbing ------------------------------------------------------------
    def _push(self, t: float, kind: str, payload: tuple) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    def _arm_engine(self, server: _Server, model: str) -> None:
        key = (server.server_id, model)
        v = self._engine_version.get(key, 0) + 1
        self._engine_version[key] = v
        t = server.engines[model].next_event_at()
        if t is not None:
            self._push(max(t, self.now), "engine", (server.server_id, model, v))

    def _arm_admission(self, server: _Server) -> None:
        v = self._admission_version.get(server.server_id, 0) + 1
        self._admission_version[server.server_id] = v
        t = server.scheduler.next_wakeup()
        if t is not None:
            self._push(max(t, self.now), "tick", (server.server_id, v))

    # -- the run -----------------------------------------------------------------
    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        for s in self.sessions.values():
            self._push(s.trace.arrival_s, "issue", (s.trace.session_id,))
        while self._heap:
            t, _, kind, payload = heapq.heappop(self._heap)
            if t < self.now - 1e-9:
                raise AssertionError(f"time travel: event at {t} after {self.now}")
            self.now = max(self.now, t)
            if kind == "issue":
                self._issue(payload[0])
            elif kind == "engine":
                sid, model, v = payload
                if self._engine_version.get((sid, model)) == v:
                    self._engine_step(self.servers[sid], model)
            elif kind == "tick":
                sid, v = payload
                if self._admission_version.get(sid) == v:
                    self._admission_step(self.servers[sid], sch.Tick())
            elif kind == "switch_done":
                sid, model, cap, host_view = payload
                srv = self.servers[sid]
                srv.engines[model].wake(self.now, cap, host_view)
                srv.ledger.finish_switch()
                self._sync_spills(srv, model)
                self._admission_step(srv, sch.SwitchDone(model, cap))
        unfinished = [s.trace.session_id for s in self.sessions.values() if s.finished_at is None]
        if unfinished:
            raise AssertionError(f"{len(unfinished)} sessions never finished, e.g. {unfinished[:3]}")
        sct = {sid: s.finished_at - s.started_at for sid, s in self.sessions.items()}  # type: ignore[operator]
        stats = self._stats()
        return SimResult(
            policy=self.policy.name,
            records=sorted(self.records.values(), key=lambda r: (r.session_id, r.index)),
            sct=sct,
            wall_s=time.perf_counter() - wall0,
            # the run ends when its last session does (a timer left armed past it is not the run)
            horizon_s=max((s.finished_at or 0.0 for s in self.sessions.values()), default=self.now),
            servers=[{"server_id": s.server_id, "busy_s": sum(e.busy_s for e in s.engines.values()), "switch_s": s.switch_s}
                     for s in self.servers.values()],
            stats=stats,
        )

    def _stats(self) -> dict:
        total: dict[str, float] = {}
        max_wait: dict[str, float] = {}
        for srv in self.servers.values():
            st = srv.scheduler.stats
            for k in ("switches", "slots", "round_waits", "sp_admits", "preemptions", "reservations_made",
                      "reservations_hit", "reservations_expired", "reserved_idle_s"):
                total[k] = total.get(k, 0) + getattr(st, k)
            for m, w in st.max_wait_s.items():
                max_wait[m] = max(max_wait.get(m, 0.0), w)
            total["kv_bytes_to_host"] = total.get("kv_bytes_to_host", 0) + srv.ledger.kv_bytes_to_host
            total["kv_bytes_dropped"] = total.get("kv_bytes_dropped", 0) + srv.ledger.kv_bytes_dropped
            total["region_reservations"] = total.get("region_reservations", 0) + srv.ledger.region_reservations
        total["max_wait_s_by_model"] = max_wait  # type: ignore[assignment]
        return total

    # -- agents and router ---------------------------------------------------------
    def _issue(self, session_id: str) -> None:
        s = self.sessions[session_id]
        pc = s.plan[s.next_index]
        if s.started_at is None:
            s.started_at = self.now
        if s.last_finish is not None:
            s.gaps.append(self.now - s.last_finish)
        cid = call_id_for(session_id, pc.index)
        call = sch.AdmissionCall(
            call_id=cid,
            session_id=session_id,
            model=s.trace.model,
            prompt_tokens=pc.prompt_tokens,
            prefix_tokens=pc.prefix_tokens,
            max_tokens=pc.max_tokens,
            arrived_at=self.now,
            continuation=pc.index > 0,
            gap_history=tuple(s.gaps[-DECISION_HISTORY:]),
            output_history=tuple(s.outputs[-DECISION_HISTORY:]),
            session_started_at=s.started_at,
        )
        srv = self._place(s, call)
        self.records[cid] = CallRecord(
            call_id=cid, session_id=session_id, model=call.model, index=pc.index,
            server_id=srv.server_id, issued_at=self.now, prompt_tokens=pc.prompt_tokens,
        )
        self._admission_step(srv, sch.Arrive(call))

    def _place(self, s: _Session, call: sch.AdmissionCall) -> _Server:
        if len(self.servers) == 1:
            return next(iter(self.servers.values()))
        views = [self._view(srv, call) for srv in self.servers.values()]
        best = rank(call.model, views, self.policy, session_id=call.session_id, call_id=call.call_id,
                    prompt_tokens=call.prompt_tokens, prefix_tokens=call.prefix_tokens)[0]
        return self.servers[best.server_id]

    def _view(self, srv: _Server, call: sch.AdmissionCall) -> ServerView:
        sc = srv.scheduler
        eng = srv.engines.get(sc.active) if sc.active else None
        kv = "none"
        if call.model in srv.engines:
            e = srv.engines[call.model]
            if call.session_id in e.hbm_kv:
                kv = "hbm"
            elif (call.model, call.session_id) in srv.ledger.host_kv:
                kv = "host"
        load = ServerLoad(
            active=sc.active, queued=sc.queued(), running=len(sc.running),
            kv_occupancy=(eng.reserved_kv_tokens() / eng.kv_capacity_tokens) if eng and eng.kv_capacity_tokens else 0.0,
            reservations=len(sc.reservations),  # reservations are keyed by session
            load_tokens=sc.load_tokens() if self._need_load_tokens else 0,
            live_models=sc.live_models() if self._need_live_models else frozenset(),
        )
        reserved_on = srv.server_id if call.session_id in sc.reservations else None
        return server_view(srv.server_id, srv.models, load, srv.ledger.incoming_model(self.now), kv,  # type: ignore[arg-type]
                           reserved_on)

    # -- admission and substrate ---------------------------------------------------
    def _admission_step(self, srv: _Server, event: sch.Event) -> None:
        actions = srv.scheduler.step(event, self.now)
        self._apply(srv, actions)
        self._arm_admission(srv)

    def _apply(self, srv: _Server, actions: list[sch.Action]) -> None:
        touched: set[str] = set()
        for a in actions:
            match a:
                case sch.Dispatch(call=c, reserved_tokens=reserved):
                    s = self.sessions[c.session_id]
                    pc = s.plan[int(c.call_id.rsplit("#", 1)[1])]
                    srv.engines[c.model].submit(
                        EngineCall(c.call_id, c.session_id, c.model, c.prompt_tokens, c.prefix_tokens,
                                   c.max_tokens, pc.sim_stop_tokens, reserved),
                        self.now,
                    )
                    rec = self.records[c.call_id]
                    rec.waited_s = a.waited_s
                    rec.switch_wait_s = a.switch_wait_s
                    rec.round_wait = a.round_wait
                    touched.add(c.model)
                case sch.StartSwitch(from_model=old, to_model=new):
                    kv_out = srv.engines[old].sleep(self.now) if old else {}
                    plan = srv.ledger.plan_switch(self.now, new, kv_out)
                    srv.switch_s += plan.duration_s
                    if self.check:
                        srv.ledger.check_bounds()
                    self._push(self.now + plan.duration_s, "switch_done", (srv.server_id, new, plan.kv_capacity_tokens, plan.host_kv_view))
                case sch.Stage(model=m):
                    srv.ledger.stage(m, self.now)
                    if self.check:
                        srv.ledger.check_bounds()
                case sch.Preempt(call_id=cid):
                    for e in srv.engines.values():
                        if cid in e.running:
                            e.abort(cid, self.now)
                            touched.add(e.model.name)
                case sch.Protect(session_id=sid, model=m, on=on):
                    prot = srv.engines[m].protected
                    (prot.add if on else prot.discard)(sid)
                case _:
                    pass
        for m in touched:
            self._sync_spills(srv, m)
            self._arm_engine(srv, m)

    def _sync_spills(self, srv: _Server, model: str) -> None:
        """KV the engine pushed to host for room goes into the substrate's ledger,
        which owns host memory; what the tier cannot keep the engine forgets."""
        eng = srv.engines[model]
        if eng.spilled:
            eng.forget_host(srv.ledger.accept_spill(model, eng.take_spilled()))
            if self.check:
                srv.ledger.check_bounds()

    def _engine_step(self, srv: _Server, model: str) -> None:
        eng = srv.engines[model]
        done = eng.advance(self.now)
        self._sync_spills(srv, model)
        for r in done:
            rec = self.records[r.call_id]
            rec.finished_at = r.finished_at
            rec.restore_s, rec.prefill_s, rec.decode_s = r.restore_s, r.prefill_s, r.decode_s
            rec.cached_tokens, rec.restored_tokens, rec.reprefill_tokens = r.cached_tokens, r.restored_tokens, r.reprefill_tokens
            rec.output_tokens = r.output_tokens
            if self.check and eng.reserved_kv_tokens() > eng.kv_capacity_tokens:
                raise AssertionError(f"{srv.server_id}/{model}: KV over-committed")
            self._admission_step(srv, sch.Finished(r.call_id, r.session_id, r.prompt_tokens + r.output_tokens))
            self._deliver(r.session_id, r.output_tokens, r.finished_at)
        self._arm_engine(srv, model)

    def _deliver(self, session_id: str, output_tokens: int, at: float) -> None:
        s = self.sessions[session_id]
        pc = s.plan[s.next_index]
        s.outputs.append(output_tokens)
        s.last_finish = at
        s.next_index += 1
        if s.next_index >= len(s.plan):
            s.finished_at = at
            for srv in self.servers.values():  # SessionReleased(reason="ended"), as the services apply it
                self._admission_step(srv, sch.SessionEnded(session_id))
                srv.ledger.forget_session(session_id)
                for eng in srv.engines.values():
                    eng.release_session(session_id)
            return
        self._push(at + pc.tool_s + self.call_latency_s, "issue", (session_id,))


def simulate(sessions: list[TraceSession], catalog: Catalog, policy: PolicyConfig, **kw: object) -> SimResult:
    return Simulator(sessions, catalog, policy, **kw).run()  # type: ignore[arg-type]
