"""The round scheduler of one server, with SP and soft reservations as switches.

A pure state machine: `step(event, now) -> actions`, `next_wakeup()`; no I/O,
no sleeps. The admission service drives it with the scaled wall clock; the
simulator drives the very same object with a virtual clock.

Rules (docs/scheduler.md states them for users; keep the two in step):

1. Per server, models take slots in turn. A slot of model M opens when M is
   active (after a switch, or at once if M already is); that instant is the
   slot's *admission point*: M's queued calls are admitted FIFO while their KV
   (prompt + max_tokens) fits the KV budget.
2. A call of M arriving while M's slot is open waits for M's next slot, unless
   (a) no other model has demand — then the round has one member and the slot
   simply continues, admitting it now — or (b) SP is on, it is a
   continuation, the slot's quantum has not passed and its estimated service
   time fits what is left of it (plus `sp_overrun_s`), or (c) it is a new
   session's first call, `sp_new_sessions` is on and the same budget holds.
3. The slot closes, with the drain rule, once its admitted work has finished
   and another model has demand (never idling while others wait), except that
   a live soft reservation of M holds it open until the reservation is used
   or expires, at most until the quantum. With the preempt rule it also
   closes at the quantum: running calls go back to the head of the queue.
4. The next slot goes to the next model with demand in round-robin order, or,
   with `oldest-first`, to the model whose oldest queued call waited longest,
   or, with `most-waiting` (Talaria's tuned rule), to the model whose queue
   holds the most waiting time in all. A model with no queued calls gets no slot,
   nor one whose engine-worker is away (draining for a restart, until the next
   one is up): its calls wait without keeping the others from their turns; a
   switch under way to it is abandoned for the next model with demand.
5. Soft reservations (when on): when a call finishes, its session's KV is
   protected and a claim is held for `hold = clamp(quantile(gaps) * factor)`
   model seconds, from the session's observed tool gaps only. It yields: it
   never blocks an admission, and it is dropped when its model's slot closes.
   With `retention="ttl"` (the kv-ttl peer, Continuum-style) the claim is a
   TTL pin instead: its hold is the TTL (`ttl_s`), and it never holds an idle
   slot open. With `admission_order="program"` a model's queue is ordered by
   the session's (program's) first arrival, then the call's (program-level FCFS).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from shared.costmodel import MEDIAN_OUTPUT_TOKENS, CostModel
from shared.catalog import ModelSpec
from shared.policy import PolicyConfig
from shared.schema import AdmissionCall  # the one struct a call has from the router on

DEFAULT_OUTPUT_PRIOR = MEDIAN_OUTPUT_TOKENS  # a session's output estimate before any history


# -- inputs --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Arrive:
    call: AdmissionCall


@dataclass(frozen=True, slots=True)
class Finished:
    call_id: str
    session_id: str
    context_tokens: int  # prompt + output, the KV the session now holds


@dataclass(frozen=True, slots=True)
class SwitchDone:
    model: str
    kv_capacity_tokens: int


@dataclass(frozen=True, slots=True)
class Tick:
    pass


@dataclass(frozen=True, slots=True)
class SessionEnded:
    session_id: str


@dataclass(frozen=True, slots=True)
class EngineAway:
    """The model's engine-worker drains for a restart (`away`), or its successor is up."""

    model: str
    away: bool


Event = Arrive | Finished | SwitchDone | Tick | SessionEnded | EngineAway


# -- outputs -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Dispatch:
    call: AdmissionCall
    reserved_tokens: int
    slot_id: int
    waited_s: float
    switch_wait_s: float
    round_wait: bool  # it arrived during its model's open slot and missed it
    sp_admit: bool = False  # admitted into its model's open slot by session-prefill


@dataclass(frozen=True, slots=True)
class StartSwitch:
    from_model: str | None
    to_model: str


@dataclass(frozen=True, slots=True)
class AbandonSwitch:
    """The switch under way goes to a model whose engine-worker went away: stop asking for
    it (the next switch names no model to leave: what is awake is the substrate's to say)."""

    to_model: str


@dataclass(frozen=True, slots=True)
class Stage:
    model: str


@dataclass(frozen=True, slots=True)
class Preempt:
    call_id: str


@dataclass(frozen=True, slots=True)
class Protect:
    session_id: str
    model: str
    on: bool


@dataclass(frozen=True, slots=True)
class SlotOpened:
    model: str
    slot_id: int
    at: float


@dataclass(frozen=True, slots=True)
class SlotClosed:
    model: str
    slot_id: int
    at: float
    reason: str


Action = Dispatch | StartSwitch | AbandonSwitch | Stage | Preempt | Protect | SlotOpened | SlotClosed


@dataclass(slots=True)
class Reservation:
    session_id: str
    model: str
    made_at: float
    expires_at: float
    tokens: int
    holds_slot: bool = True  # a TTL pin (retention="ttl") keeps KV only; it never holds an idle slot


@dataclass(slots=True)
class _Queued:
    call: AdmissionCall
    switch_clock_at_arrival: float
    open_slot_at_arrival: int | None  # slot id of its model open when it arrived


@dataclass(slots=True)
class _Running:
    call: AdmissionCall
    reserved_tokens: int
    slot_id: int
    first_token_by: float = 0.0  # estimated (upper bound): prefill done, first token out


@dataclass
class SchedulerStats:
    switches: int = 0
    slots: int = 0
    round_waits: int = 0
    sp_admits: int = 0
    preemptions: int = 0
    reservations_made: int = 0
    reservations_hit: int = 0
    reservations_expired: int = 0
    reservations_yielded: int = 0  # of the expired: dropped because their model's slot closed (yielded to others)
    reserved_idle_s: float = 0.0  # time the server sat idle holding a slot for reservations
    max_wait_s: dict[str, float] = field(default_factory=dict)


@dataclass
class RoundScheduler:
    server_id: str
    models: dict[str, ModelSpec]  # in round-robin order
    cost: CostModel
    policy: PolicyConfig
    queues: dict[str, deque[_Queued]] = field(default_factory=dict)
    active: str | None = None
    phase: str = "idle"  # idle | switching | open
    switch_to: str | None = None
    switch_started_at: float = 0.0
    slot_id: int = 0
    slot_open_at: float = 0.0
    slot_deadline: float = 0.0
    kv_capacity: int = 0
    running: dict[str, _Running] = field(default_factory=dict)
    reservations: dict[str, Reservation] = field(default_factory=dict)
    switch_clock: float = 0.0  # total model seconds spent switching so far
    staged_hint: str | None = None
    idle_hold_since: float | None = None
    last_step_at: float = 0.0
    prefill_horizon: float = 0.0
    away: set[str] = field(default_factory=set)  # models whose engine-worker is away (rule 4)
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    _reserved_total: int = 0  # sum of running calls' reserved KV, kept in step with `running` (speed)

    def __post_init__(self) -> None:
        for m in self.models:
            self.queues.setdefault(m, deque())
            self.stats.max_wait_s.setdefault(m, 0.0)

    # -- public ------------------------------------------------------------------
    def step(self, event: Event, now: float) -> list[Action]:
        self.last_step_at = now
        actions: list[Action] = []
        match event:
            case Arrive(call=call):
                if call.model not in self.models:
                    raise ValueError(f"{self.server_id}: model {call.model!r} is not served here")
                if any(r.call.call_id == call.call_id for r in self.running.values()) or any(
                    q.call.call_id == call.call_id for q in self.queues[call.model]
                ):
                    return actions  # at most once per call_id
                res = self.reservations.pop(call.session_id, None)
                if res is not None:
                    self.stats.reservations_hit += 1
                    actions.append(Protect(res.session_id, res.model, on=False))
                open_slot = self.slot_id if (self.phase == "open" and self.active == call.model) else None
                self._enqueue(_Queued(call, self._switch_clock(now), open_slot))
            case Finished(call_id=cid, session_id=sid, context_tokens=ctx):
                run = self._pop_running(cid)
                if run is None:
                    # it finished before our preemption reached the engine (the two
                    # crossed): its reply is out, so the requeued copy must not run again
                    self._drop_queued(cid)
                if run is not None and self.policy.reservations and run.call.model == self.active:
                    ttl = self.policy.retention == "ttl"
                    hold = self.ttl_s(run.call.gap_history) if ttl else self.hold_s(run.call.gap_history)
                    self.reservations[sid] = Reservation(sid, run.call.model, now, now + hold, ctx, holds_slot=not ttl)
                    self.stats.reservations_made += 1
                    actions.append(Protect(sid, run.call.model, on=True))
            case SwitchDone(model=model, kv_capacity_tokens=cap):
                if self.phase == "switching" and self.switch_to == model:
                    self.switch_clock += now - self.switch_started_at
                    self.active = model
                    self.kv_capacity = cap
                    self._open_slot(now, actions)
            case SessionEnded(session_id=sid):
                res = self.reservations.pop(sid, None)
                if res is not None:
                    actions.append(Protect(sid, res.model, on=False))
            case EngineAway(model=model, away=away):
                (self.away.add if away else self.away.discard)(model)
                if away and self.phase == "switching" and self.switch_to == model:
                    # it would wait for the next worker (minutes under vLLM), every model's calls with it
                    self.switch_clock += now - self.switch_started_at
                    self.phase, self.switch_to, self.active = "idle", None, None
                    actions.append(AbandonSwitch(model))
            case Tick():
                pass
        self._expire_reservations(now, actions)
        self._schedule(now, actions)
        return actions

    def recover_active(self, model: str, kv_capacity: int, running: list[tuple[AdmissionCall, int]], now: float) -> None:
        """After a restart of the service that drives this scheduler: `model` is
        awake on the engine with `running` (call, reserved KV) in flight. Open a
        slot of it as at an admission point (no actions: the calls already run),
        so the slot drains them before any switch (docs/reliability.md)."""
        if model not in self.models:
            raise ValueError(f"{self.server_id}: model {model!r} is not served here")
        self.active = model
        self.kv_capacity = kv_capacity
        self.phase = "open"
        self.slot_id += 1
        self.slot_open_at = now
        self.slot_deadline = now + self.policy.slot_s
        self.idle_hold_since = None
        self.last_step_at = now
        for call, reserved in running:
            if call.call_id in self.running:
                continue
            self.running[call.call_id] = _Running(call, reserved, self.slot_id, now)
            self._reserved_total += reserved

    def next_wakeup(self) -> float | None:
        times: list[float] = [r.expires_at for r in self.reservations.values()]
        if self.phase == "open" and self.slot_deadline > self.last_step_at + 1e-9:
            times.append(self.slot_deadline)
        if self.phase == "open" and self.idle_hold_since is not None:
            until = self.idle_hold_since + self.policy.idle_hold_max_s
            if until > self.last_step_at + 1e-9:
                times.append(until)
        if self.phase == "open" and self.policy.closing == "preempt":
            at = self._preempt_at(list(self.running.values()))
            if at > self.last_step_at + 1e-9:
                times.append(at)
        return min(times) if times else None

    def hold_s(self, gaps: tuple[float, ...]) -> float:
        p = self.policy
        if not gaps:
            return p.hold_min_s
        ordered = sorted(gaps)
        q = ordered[min(len(ordered) - 1, int(p.hold_quantile * len(ordered)))]
        return max(p.hold_min_s, min(p.hold_max_s, q * p.hold_factor))

    def ttl_s(self, gaps: tuple[float, ...]) -> float:
        """kv-ttl (Continuum-style): pin a session's KV for a TTL read from its
        tool-gap history: the `ttl_quantile` of its past gaps, capped."""
        p = self.policy
        if not gaps:
            return p.ttl_default_s
        ordered = sorted(gaps)
        q = ordered[min(len(ordered) - 1, int(p.ttl_quantile * len(ordered)))]
        return max(0.0, min(p.ttl_max_s, q))

    def forget(self, call_id: str, now: float) -> list[Action]:
        """A call that can no longer run here (its payload is gone): drop it,
        running or queued, so it can neither hold a slot open nor be preempted
        and requeued forever; then schedule as after any other step."""
        self._pop_running(call_id)
        self._drop_queued(call_id)
        actions: list[Action] = []
        self._schedule(now, actions)
        return actions

    def is_queued(self, call_id: str) -> bool:
        """Waiting for admission here (not running, not unknown)."""
        return any(item.call.call_id == call_id for q in self.queues.values() for item in q)

    def cancel_reservation(self, session_id: str) -> list[Action]:
        """Another server already holds this session's claim: drop ours."""
        res = self.reservations.pop(session_id, None)
        return [Protect(session_id, res.model, on=False)] if res is not None else []

    def refuses_new_session(self, tenant: str, bound: int) -> bool:
        """Whether a new session's first call of `tenant` is refused (TALARIA_MAX_QUEUED =
        `bound`). The bound holds for all tenants together, but a tenant holding less than
        its share of it (the bound over the tenants with calls queued, itself counted) is let
        in over it: one tenant's flood filling the queue does not shut the others out. With
        one tenant: refused at the bound."""
        if self.queued() < bound:
            return False
        by_tenant = self.queued_by_tenant()
        return by_tenant.get(tenant, 0) >= bound / len(by_tenant.keys() | {tenant})

    def queued_by_tenant(self) -> dict[str, int]:
        """Calls waiting here, per tenant."""
        out: dict[str, int] = {}
        for q in self.queues.values():
            for item in q:
                out[item.call.tenant] = out.get(item.call.tenant, 0) + 1
        return out

    def queued(self, model: str | None = None) -> int:
        if model is not None:
            return len(self.queues[model])
        return sum(len(q) for q in self.queues.values())

    def load_tokens(self) -> int:
        """Prompt tokens of the calls queued or running here (a router's active-sequence load)."""
        return sum(r.call.prompt_tokens for r in self.running.values()) + sum(
            q.call.prompt_tokens for qs in self.queues.values() for q in qs)

    def pending_calls(self) -> list[AdmissionCall]:
        return [q.call for qs in self.queues.values() for q in qs]

    def reserved_kv_tokens(self) -> int:
        return self._reserved_total

    def live_models(self) -> frozenset[str]:
        """Models with work here: calls queued or running, or a session's claim.
        Each takes a turn of this server's rounds (placement's round contention)."""
        live = {m for m, q in self.queues.items() if q}
        live.update(r.call.model for r in self.running.values())
        live.update(r.model for r in self.reservations.values())
        return frozenset(live)

    # -- internals ---------------------------------------------------------------
    def _enqueue(self, item: _Queued) -> None:
        q = self.queues[item.call.model]
        if self.policy.admission_order != "program":
            q.append(item)
            return
        # program-level FCFS: by the session's first arrival, then the call's own
        key = _program_key(item.call)
        i = len(q)
        while i > 0 and _program_key(q[i - 1].call) > key:
            i -= 1
        q.insert(i, item)

    def _pop_running(self, call_id: str) -> _Running | None:
        """Stop counting a call as running (finished, preempted or forgotten)."""
        run = self.running.pop(call_id, None)
        if run is not None:
            self._reserved_total -= run.reserved_tokens
        return run

    def _drop_queued(self, call_id: str) -> None:
        for q in self.queues.values():
            for item in q:
                if item.call.call_id == call_id:
                    q.remove(item)
                    return

    def _switch_clock(self, now: float) -> float:
        extra = now - self.switch_started_at if self.phase == "switching" else 0.0
        return self.switch_clock + extra

    def _reserve_for(self, call: AdmissionCall) -> int:
        limit = self.models[call.model].context_limit
        return min(limit, call.prompt_tokens + call.max_tokens)

    def _others_waiting(self) -> bool:
        return any(q for m, q in self.queues.items() if m != self.active and m not in self.away)

    def _expire_reservations(self, now: float, actions: list[Action]) -> None:
        for sid, r in list(self.reservations.items()):
            if r.expires_at <= now + 1e-9:
                del self.reservations[sid]
                self.stats.reservations_expired += 1
                actions.append(Protect(sid, r.model, on=False))

    def _pick_next(self, exclude: str | None = None) -> str | None:
        names = list(self.models)
        candidates = [m for m in names if self.queues[m] and m != exclude and m not in self.away]
        if not candidates:
            return None
        if self.policy.next_model == "oldest-first":
            return min(candidates, key=lambda m: self.queues[m][0].call.arrived_at)
        if self.policy.next_model == "most-waiting":
            # the most waiting time in the queue: serves the most sessions per switch,
            # and a long-waiting few still accumulate weight (no starvation)
            now = self.last_step_at
            return max(candidates, key=lambda m: (sum(now - q.call.arrived_at for q in self.queues[m]), -names.index(m)))
        start = names.index(self.active) + 1 if self.active in names else 0
        for i in range(len(names)):
            m = names[(start + i) % len(names)]
            if m in candidates:
                return m
        return None

    def _open_slot(self, now: float, actions: list[Action]) -> None:
        assert self.active is not None
        self.phase = "open"
        self.slot_id += 1
        self.stats.slots += 1
        self.slot_open_at = now
        self.slot_deadline = now + self.policy.slot_s
        self.idle_hold_since = None
        actions.append(SlotOpened(self.active, self.slot_id, now))
        self._admit(now, actions, admission_point=True)
        self._hint_staging(actions)

    def _hint_staging(self, actions: list[Action]) -> None:
        nxt = self._pick_next(exclude=self.active)
        if nxt is None:
            # nobody waits yet: guess the next model in round-robin order
            names = list(self.models)
            if len(names) > 1 and self.active in names:
                nxt = names[(names.index(self.active) + 1) % len(names)]
        if nxt is not None and nxt != self.staged_hint:
            self.staged_hint = nxt
            actions.append(Stage(nxt))

    def _fits(self, call: AdmissionCall) -> bool:
        return self.reserved_kv_tokens() + self._reserve_for(call) <= self.kv_capacity

    def _estimated_service_s(self, call: AdmissionCall) -> float:
        spec = self.models[call.model]
        out = int(statistics.median(call.output_history)) if call.output_history else DEFAULT_OUTPUT_PRIOR
        out = min(out, call.max_tokens)
        new = max(1, call.prompt_tokens - call.prefix_tokens)
        batch = len(self.running) + 1
        ctx = sum(r.call.prompt_tokens for r in self.running.values()) + call.prompt_tokens
        return self.cost.prefill_s(spec, new, call.prefix_tokens) + out * self.cost.itl_s(spec, batch, ctx)

    def _admit(self, now: float, actions: list[Action], admission_point: bool) -> None:
        m = self.active
        assert m is not None
        q = self.queues[m]
        auto = self.policy.admission_order == "auto"
        several_tenants = len({item.call.tenant for item in q}) > 1
        if (auto or several_tenants) and q and self._demand_exceeds_budget(q):
            # KV-bound: not every queued call fits, so admit program-level FCFS
            # (oldest session first) instead of call order, and the tenants in turn
            ordered = sorted(q, key=lambda item: _program_key(item.call)) if auto else list(q)
            q.clear()
            q.extend(_tenants_in_turn(ordered) if several_tenants else ordered)
        alone = not self._others_waiting()
        kept: deque[_Queued] = deque()
        blocked = False
        while q:
            item = q.popleft()
            c = item.call
            ok = not blocked and self._fits(c)
            sp = False
            if ok and not (admission_point or alone):
                # SP for a session's return; with sp_new_sessions the same budget rule
                # for a new session's first call (it would otherwise wait a whole round)
                sp = (
                    (self.policy.session_prefill if c.continuation else self.policy.sp_new_sessions)
                    and now < self.slot_deadline
                    and now + self._estimated_service_s(c) <= self.slot_deadline + self.policy.sp_overrun_s
                )
                ok = sp
            if not ok:
                if not self._fits(c):
                    blocked = True  # FIFO: nobody overtakes a call that does not fit
                kept.append(item)
                continue
            if sp:
                self.stats.sp_admits += 1
            self._dispatch(item, now, actions, sp_admit=sp)
        q.extend(kept)

    def _demand_exceeds_budget(self, q: deque[_Queued]) -> bool:
        free = self.kv_capacity - self.reserved_kv_tokens()
        need = 0
        for item in q:
            need += self._reserve_for(item.call)
            if need > free:
                return True
        return False

    def _dispatch(self, item: _Queued, now: float, actions: list[Action], sp_admit: bool = False) -> None:
        c = item.call
        reserved = self._reserve_for(c)
        # prefill-first and serial: a call's first token comes after every
        # earlier prefill; estimate as a full prefill (an upper bound)
        spec = self.models[c.model]
        self.prefill_horizon = max(self.prefill_horizon, now) + self.cost.prefill_s(spec, c.prompt_tokens, 0)
        self.running[c.call_id] = _Running(c, reserved, self.slot_id, self.prefill_horizon)
        self._reserved_total += reserved
        waited = now - c.arrived_at
        round_wait = item.open_slot_at_arrival is not None and item.open_slot_at_arrival != self.slot_id
        if round_wait:
            self.stats.round_waits += 1
        self.stats.max_wait_s[c.model] = max(self.stats.max_wait_s[c.model], waited)
        switch_wait = max(0.0, min(waited, self._switch_clock(now) - item.switch_clock_at_arrival))
        res = self.reservations.pop(c.session_id, None)
        if res is not None:
            actions.append(Protect(c.session_id, res.model, on=False))
        actions.append(Dispatch(c, reserved, self.slot_id, waited, switch_wait, round_wait, sp_admit))

    def _preempt_at(self, running: list[_Running]) -> float:
        """The quantum, but never before every running call has had its prefill
        and then a quantum of decoding: preempted calls keep their tokens, so
        every slot makes real progress and the rule cannot livelock even when
        the batch's prefills alone outlast the quantum."""
        last_first_token = max((r.first_token_by for r in running), default=0.0)
        return max(self.slot_deadline, last_first_token + self.policy.slot_s)

    def _end_idle_hold(self, now: float) -> None:
        """An idle spell held open for reservations ends: count it as idle capacity."""
        if self.idle_hold_since is not None:
            self.stats.reserved_idle_s += now - self.idle_hold_since
            self.idle_hold_since = None

    def _close(self, now: float, actions: list[Action], reason: str) -> None:
        assert self.active is not None
        self._end_idle_hold(now)
        for sid, r in list(self.reservations.items()):
            if r.model == self.active:
                del self.reservations[sid]
                self.stats.reservations_expired += 1
                self.stats.reservations_yielded += 1
                actions.append(Protect(sid, r.model, on=False))
        actions.append(SlotClosed(self.active, self.slot_id, now, reason))
        self.phase = "idle"

    def _schedule(self, now: float, actions: list[Action]) -> None:
        for _ in range(4 * len(self.models) + 4):  # bounded: each pass changes the phase or stops
            if self.phase == "switching":
                return
            if self.phase == "idle":
                nxt = self._pick_next()
                if nxt is None:
                    return
                if nxt == self.active:
                    self._open_slot(now, actions)
                else:
                    self.phase = "switching"
                    self.switch_to = nxt
                    self.switch_started_at = now
                    self.stats.switches += 1
                    self.staged_hint = None
                    actions.append(StartSwitch(self.active, nxt))
                    return
                continue
            # phase == open
            self._admit(now, actions, admission_point=False)
            others = self._others_waiting()
            if not others:
                self.idle_hold_since = None
                return
            m_running = [r for r in self.running.values() if r.call.model == self.active]
            if m_running:
                self._end_idle_hold(now)
                preempt_at = self._preempt_at(m_running)
                if self.policy.closing == "preempt" and now >= preempt_at - 1e-9:
                    for r in m_running:
                        self._pop_running(r.call.call_id)
                        self.stats.preemptions += 1
                        actions.append(Preempt(r.call.call_id))
                    # back to the head of the queue in their admission (FIFO) order
                    self.queues[self.active].extendleft(
                        _Queued(r.call, self._switch_clock(now), None) for r in reversed(m_running)
                    )
                    self._close(now, actions, "preempted at quantum")
                    continue
                self._hint_staging(actions)
                return
            held = [r for r in self.reservations.values() if r.model == self.active and r.holds_slot and r.expires_at > now]
            if self.idle_hold_since is None and held:
                self.idle_hold_since = now
            idle_hold_until = (self.idle_hold_since or now) + self.policy.idle_hold_max_s
            if held and now < self.slot_deadline and now < idle_hold_until - 1e-9:
                return
            self._close(now, actions, "drained" if now < self.slot_deadline else "quantum")


def _tenants_in_turn(items: list[_Queued]) -> list[_Queued]:
    """Every tenant's n-th call before any tenant's (n+1)-th, each tenant's in the order
    given: one tenant's flood of calls does not hold another's behind it where not all
    fit (with one tenant: the order given)."""
    turn: dict[str, int] = {}
    ranked = []
    for position, item in enumerate(items):
        n = turn.get(item.call.tenant, 0)
        turn[item.call.tenant] = n + 1
        ranked.append((n, position, item))
    return [item for _, _, item in sorted(ranked, key=lambda r: (r[0], r[1]))]


def _program_key(call: AdmissionCall) -> tuple[float, str, float]:
    """Oldest session first, then the call's own arrival. Sessions that started at the same
    instant (a trace's burst; never on a live clock) are ordered by id, so each keeps its
    calls together as sessions a moment apart do: ordered by arrival alone, a session's
    return fell behind every tied session's first call."""
    started = call.session_started_at if call.session_started_at is not None else call.arrived_at
    return (started, call.session_id, call.arrived_at)
