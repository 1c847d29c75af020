"""The round scheduler (services/admission/scheduler.py): the rules of its module docstring."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from services.admission.scheduler import (
    AbandonSwitch,
    Action,
    AdmissionCall,
    Arrive,
    Dispatch,
    EngineAway,
    Finished,
    Preempt,
    Protect,
    RoundScheduler,
    SessionEnded,
    SlotClosed,
    SlotOpened,
    Stage,
    StartSwitch,
    SwitchDone,
    Tick,
)
from shared.costmodel import CostModel
from shared.catalog import load_catalog
from shared.policy import PRESETS, PolicyConfig

CAT = load_catalog()
CM = CostModel(CAT, CAT.server("h100x8"))
A, B, C = "glm-4.5-fp8", "qwen3-235b-a22b-fp8", "glm-4.5-air-fp8"  # round-robin order
CAP = 1_000_000

_ids = itertools.count()


def policy(name: str = "baseline", **kw: object) -> PolicyConfig:
    """A preset with field changes (never the tuned parameters: the rules are what is tested)."""
    return msgspec.structs.replace(PRESETS[name], **kw)


def sched(p: PolicyConfig | None = None) -> RoundScheduler:
    return RoundScheduler("s0", {m: CAT.model(m) for m in (A, B, C)}, CM, p or policy())


def mk(model: str, at: float, *, sid: str | None = None, cont: bool = False, prompt: int = 10_000, prefix: int = 0,
       max_tokens: int = 4096, gaps: tuple[float, ...] = (), outs: tuple[int, ...] = ()) -> AdmissionCall:
    n = next(_ids)
    return AdmissionCall(f"c{n}", sid or f"S{n}", model, prompt, prefix, max_tokens, at, cont, gaps, outs)


def of(actions: list[Action], kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def dispatched(actions: list[Action]) -> list[str]:
    return [d.call.call_id for d in of(actions, Dispatch)]


def open_slot(s: RoundScheduler, model: str, at: float, *calls: AdmissionCall, cap: int = CAP) -> list[Action]:
    """Arrive `calls` (the first triggers a switch to `model`), then finish the switch at `at`."""
    for c in calls:
        s.step(Arrive(c), c.arrived_at)
    assert s.phase == "switching" and s.switch_to == model
    return s.step(SwitchDone(model, cap), at)


# -- slots and switches --------------------------------------------------------------------


def test_first_call_triggers_a_switch() -> None:
    s = sched()
    c = mk(B, 0.0)
    acts = s.step(Arrive(c), 0.0)
    assert acts == [StartSwitch(None, B)]
    assert s.phase == "switching" and s.stats.switches == 1
    # more arrivals while switching: no second switch, nothing dispatched
    assert s.step(Arrive(mk(B, 1.0)), 1.0) == []
    assert s.step(Arrive(mk(A, 2.0)), 2.0) == []
    assert s.queued() == 3


def test_switch_done_opens_a_slot_and_dispatches_queued_calls() -> None:
    s = sched()
    c1, c2, other = mk(B, 0.0), mk(B, 1.0), mk(A, 2.0)
    acts = open_slot(s, B, 6.0, c1, c2, other)
    assert of(acts, SlotOpened) == [SlotOpened(B, 1, 6.0)]
    ds = of(acts, Dispatch)
    assert [d.call.call_id for d in ds] == [c1.call_id, c2.call_id]  # FIFO, only B's calls
    assert [d.waited_s for d in ds] == pytest.approx([6.0, 5.0])
    assert [d.switch_wait_s for d in ds] == pytest.approx([6.0, 5.0])  # all of the wait was the switch
    assert all(d.slot_id == 1 and not d.round_wait for d in ds)
    assert ds[0].reserved_tokens == 10_000 + 4096
    assert Stage(A) in acts  # the next model with demand is staged
    assert s.queued(A) == 1 and s.queued(B) == 0
    assert s.active == B and s.phase == "open"


def test_switch_done_for_another_model_is_ignored() -> None:
    s = sched()
    s.step(Arrive(mk(B, 0.0)), 0.0)
    assert s.step(SwitchDone(A, CAP), 5.0) == []
    assert s.phase == "switching" and s.active is None


def _continuation_scenario(p: PolicyConfig) -> tuple[RoundScheduler, AdmissionCall, list[Action]]:
    """B's slot is open with a long call running and A waiting; B's session returns."""
    s = sched(p)
    first = mk(B, 0.0, sid="X")
    open_slot(s, B, 5.0, first, mk(B, 0.5), mk(A, 1.0))
    s.step(Finished(first.call_id, "X", 10_300), 7.0)
    cont = mk(B, 9.0, sid="X", cont=True, prompt=10_800, prefix=10_300, gaps=(2.0,), outs=(300,))
    return s, cont, s.step(Arrive(cont), 9.0)


def test_baseline_continuation_waits_for_the_next_slot() -> None:
    s, cont, acts = _continuation_scenario(policy("baseline"))
    assert dispatched(acts) == []
    assert s.queued(B) == 1
    other = s.running.copy()
    (busy,) = other  # the second B call keeps the slot open
    acts = s.step(Finished(busy, "x", 20_000), 20.0)  # drained, A waits: close, switch
    assert of(acts, SlotClosed)[0].reason == "drained"
    assert of(acts, StartSwitch) == [StartSwitch(B, A)]
    acts = s.step(SwitchDone(A, CAP), 26.0)
    (da,) = of(acts, Dispatch)
    acts = s.step(Finished(da.call.call_id, da.call.session_id, 15_000), 40.0)
    assert of(acts, StartSwitch) == [StartSwitch(A, B)]
    acts = s.step(SwitchDone(B, CAP), 46.0)
    (d,) = of(acts, Dispatch)
    assert d.call == cont
    assert d.round_wait is True
    assert d.waited_s == pytest.approx(46.0 - 9.0)
    assert 0.0 < d.switch_wait_s < d.waited_s
    assert s.stats.round_waits == 1 and s.stats.sp_admits == 0


@pytest.mark.parametrize("p", [policy("talaria-no-reservations"), policy("baseline", session_prefill=True)], ids=["preset", "replaced"])
def test_session_prefill_admits_continuation_at_once(p: PolicyConfig) -> None:
    s, cont, acts = _continuation_scenario(p)
    (d,) = of(acts, Dispatch)
    assert d.call == cont and d.round_wait is False and d.waited_s == 0.0
    assert d.slot_id == s.slot_id == 1
    assert s.stats.sp_admits == 1 and s.queued(B) == 0


@pytest.mark.parametrize("new_sessions", [False, True])
def test_session_prefill_for_new_sessions_only_when_switched_on(new_sessions: bool) -> None:
    s = sched(policy("talaria-no-reservations", sp_new_sessions=new_sessions))
    open_slot(s, B, 5.0, mk(B, 0.0), mk(A, 1.0))
    new = mk(B, 6.0)  # a new session of B: not a continuation
    acts = s.step(Arrive(new), 6.0)
    assert dispatched(acts) == ([new.call_id] if new_sessions else [])
    assert s.stats.round_waits == 0


def test_new_session_admission_keeps_the_budget_rule() -> None:
    """A new session's first call meets the SP budget like a continuation: not past the quantum."""
    s = sched(policy("talaria-no-reservations", sp_new_sessions=True, slot_s=30.0))
    open_slot(s, B, 5.0, mk(B, 0.0, sid="L"), mk(A, 1.0))
    late = mk(B, 36.0)  # after the 30-s quantum: waits for B's next slot
    assert dispatched(s.step(Arrive(late), 36.0)) == []
    assert s.queued(B) == 1


def test_talaria_presets_switch_new_session_admission() -> None:
    assert policy("talaria").sp_new_sessions and not policy("talaria-no-sp-new").sp_new_sessions
    assert not policy("baseline").sp_new_sessions


@pytest.mark.parametrize(
    ("arrive_at", "overrun", "admitted"),
    [
        (10.0, 0.0, True),    # well inside the 30 s quantum
        (34.9, 0.0, True),    # ~0.1 s left, ~0.06 s prefill + 1 x ~20 ms decode: fits
        (35.0, 0.0, False),   # at the quantum
        (40.0, 0.0, False),   # past the quantum (the slot is still draining)
        (40.0, 100.0, False),  # the overrun budget never re-opens a passed quantum
    ],
)
def test_session_prefill_refuses_past_the_quantum(arrive_at: float, overrun: float, admitted: bool) -> None:
    s = sched(policy("talaria-no-reservations", sp_overrun_s=overrun, slot_s=30.0))
    long_call = mk(B, 0.0, sid="L")
    open_slot(s, B, 5.0, long_call, mk(A, 1.0))
    cont = mk(B, arrive_at, sid="X", cont=True, prompt=10_800, prefix=10_300, max_tokens=4096, outs=(1, 1, 1))
    acts = s.step(Arrive(cont), arrive_at)
    assert (dispatched(acts) == [cont.call_id]) is admitted


@pytest.mark.parametrize(("overrun", "admitted"), [(0.0, False), (10.0, True)])
def test_session_prefill_needs_the_estimated_service_to_fit(overrun: float, admitted: bool) -> None:
    s = sched(policy("talaria-no-reservations", sp_overrun_s=overrun, slot_s=30.0))
    open_slot(s, B, 5.0, mk(B, 0.0, sid="L"), mk(A, 1.0))
    # 1 s before the quantum; its history says ~300 tokens -> ~5 s of decode: does not fit without overrun
    cont = mk(B, 34.0, sid="X", cont=True, prompt=10_800, prefix=10_300, outs=(250, 300, 400))
    acts = s.step(Arrive(cont), 34.0)
    assert (dispatched(acts) == [cont.call_id]) is admitted


@pytest.mark.parametrize(("next_model", "expect"), [("round-robin", C), ("oldest-first", A)])
def test_next_model_round_robin_vs_oldest_first(next_model: str, expect: str) -> None:
    s = sched(policy("baseline", next_model=next_model))
    busy = mk(B, 0.0)
    open_slot(s, B, 5.0, busy)
    s.step(Arrive(mk(A, 6.0)), 6.0)   # A waits longest, but comes before B in round-robin order
    s.step(Arrive(mk(C, 7.0)), 7.0)   # C is next after B
    acts = s.step(Finished(busy.call_id, busy.session_id, 10_200), 10.0)
    assert of(acts, StartSwitch) == [StartSwitch(B, expect)]


def test_model_without_queued_calls_gets_no_slot() -> None:
    s = sched()
    busy = mk(A, 0.0)
    open_slot(s, A, 5.0, busy)
    s.step(Arrive(mk(C, 6.0)), 6.0)  # B (next in order) has nothing queued
    acts = s.step(Finished(busy.call_id, busy.session_id, 10_200), 10.0)
    assert of(acts, StartSwitch) == [StartSwitch(A, C)]
    # when nobody has demand, nothing switches
    s2 = sched()
    only = mk(A, 0.0)
    open_slot(s2, A, 5.0, only)
    acts = s2.step(Finished(only.call_id, only.session_id, 10_200), 10.0)
    assert of(acts, StartSwitch) == [] and of(acts, SlotClosed) == []


def test_a_model_whose_engine_worker_is_away_gets_no_turn_until_it_is_back() -> None:
    """Its engine-worker drains for a restart (minutes under vLLM): a switch to it would be
    retried until the next worker is up, the other models' calls waiting behind it."""
    s = sched()
    busy = mk(A, 0.0)
    open_slot(s, A, 5.0, busy)
    waiting_b = mk(B, 6.0)
    s.step(Arrive(waiting_b), 6.0)
    assert s.step(EngineAway(B, away=True), 7.0) == []
    acts = s.step(Finished(busy.call_id, busy.session_id, 10_200), 10.0)
    assert of(acts, StartSwitch) == [] and of(acts, SlotClosed) == []  # A's slot stays: nobody else can run
    nxt = mk(A, 11.0, sid=busy.session_id, cont=True)
    assert dispatched(s.step(Arrive(nxt), 11.0)) == [nxt.call_id]  # admitted at once, as with no other demand
    s.step(Arrive(waiting_c := mk(C, 12.0)), 12.0)
    acts = s.step(Finished(nxt.call_id, nxt.session_id, 10_400), 15.0)
    assert of(acts, StartSwitch) == [StartSwitch(A, C)]  # C's turn, not B's, though B waited longest
    dispatched(s.step(SwitchDone(C, CAP), 16.0))
    acts = s.step(EngineAway(B, away=False), 20.0)  # B's next worker is up: its turn after C's drains
    acts += s.step(Finished(waiting_c.call_id, waiting_c.session_id, 10_100), 21.0)
    assert of(acts, StartSwitch) == [StartSwitch(C, B)]
    assert dispatched(s.step(SwitchDone(B, CAP), 22.0)) == [waiting_b.call_id]


def test_a_switch_to_a_model_whose_engine_worker_goes_away_is_abandoned_for_the_next() -> None:
    """A switch under way to a model whose engine-worker then drains would wait for the next
    worker, every model's calls behind it: it is abandoned, and the next model with demand
    switched to, naming no model to leave (the substrate knows what is awake)."""
    s = sched()
    busy = mk(A, 0.0)
    open_slot(s, A, 5.0, busy)
    waiting_b = mk(B, 6.0)
    s.step(Arrive(waiting_b), 6.0)
    acts = s.step(Finished(busy.call_id, busy.session_id, 10_200), 10.0)
    assert of(acts, StartSwitch) == [StartSwitch(A, B)] and s.phase == "switching"
    nxt = mk(A, 11.0, sid=busy.session_id, cont=True)
    s.step(Arrive(nxt), 11.0)
    acts = s.step(EngineAway(B, away=True), 12.0)
    assert of(acts, AbandonSwitch) == [AbandonSwitch(B)] and of(acts, StartSwitch) == [StartSwitch(None, A)]
    assert s.step(SwitchDone(B, CAP), 13.0) == []  # (its result, if it still comes, is not taken)
    assert dispatched(s.step(SwitchDone(A, CAP), 14.0)) == [nxt.call_id]
    # with no other demand the server idles, and B's calls wait for its next worker
    acts = s.step(Finished(nxt.call_id, nxt.session_id, 10_400), 20.0)
    assert of(acts, StartSwitch) == [] and s.queued(B) == 1
    assert of(s.step(EngineAway(B, away=False), 30.0), StartSwitch) == [StartSwitch(A, B)]


def test_single_model_demand_never_switches() -> None:
    s = sched(policy("baseline", slot_s=30.0))
    c0 = mk(B, 0.0)
    open_slot(s, B, 5.0, c0)
    t = 5.0
    prev = c0
    for i in range(10):
        t += 25.0  # long past the quantum
        acts = s.step(Finished(prev.call_id, prev.session_id, 20_000), t)
        assert of(acts, StartSwitch) == [] and of(acts, SlotClosed) == []
        prev = mk(B, t + 1.0, sid=prev.session_id, cont=True)
        acts = s.step(Arrive(prev), t + 1.0)
        (d,) = of(acts, Dispatch)
        assert d.waited_s == 0.0 and not d.round_wait  # the round has one member: admitted at once
    assert s.step(Tick(), 10_000.0) == []
    assert s.stats.switches == 1 and s.stats.slots == 1


def test_kv_budget_calls_that_do_not_fit_wait_fifo() -> None:
    s = sched()
    big1 = mk(B, 0.0, prompt=50_000, max_tokens=4_000)   # 54k
    big2 = mk(B, 0.1, prompt=50_000, max_tokens=4_000)   # 54k: does not fit next to big1
    small = mk(B, 0.2, prompt=1_000, max_tokens=1_000)   # 2k: would fit, but may not overtake big2
    acts = open_slot(s, B, 5.0, big1, big2, small, cap=60_000)
    assert dispatched(acts) == [big1.call_id]
    assert s.reserved_kv_tokens() == 54_000 <= 60_000
    assert [c.call_id for c in s.pending_calls()] == [big2.call_id, small.call_id]
    acts = s.step(Finished(big1.call_id, big1.session_id, 50_300), 30.0)
    assert dispatched(acts) == [big2.call_id, small.call_id]
    assert s.reserved_kv_tokens() == 56_000


def test_where_not_every_queued_call_fits_the_tenants_take_turns() -> None:
    """One tenant's flood queued first held another tenant's call behind all of it (a
    probe: 40 s at 20x behind 300 calls). Where the queue's demand exceeds the KV, each
    tenant's n-th call comes before any tenant's (n+1)-th; with one tenant, FIFO as before."""
    for name in ("baseline", "talaria"):
        s = sched(policy(name))
        flood = [msgspec.structs.replace(mk(B, 0.1 * i, prompt=20_000, max_tokens=1_000), tenant="bob")
                 for i in range(6)]
        hers = msgspec.structs.replace(mk(B, 1.0, prompt=20_000, max_tokens=1_000), tenant="alice")
        acts = open_slot(s, B, 5.0, *flood, hers, cap=63_000)  # three fit at a time
        assert dispatched(acts) == [flood[0].call_id, hers.call_id, flood[1].call_id], name
        acts = s.step(Finished(flood[0].call_id, flood[0].session_id, 20_300), 30.0)
        assert dispatched(acts) == [flood[2].call_id], name  # (then bob's, in his order)
    # one tenant (every call's tenant the same): the order of before
    s = sched()
    alone = [msgspec.structs.replace(mk(B, 0.1 * i, prompt=20_000, max_tokens=1_000), tenant="bob") for i in range(4)]
    assert dispatched(open_slot(s, B, 5.0, *alone, cap=63_000)) == [c.call_id for c in alone[:3]]


def test_a_full_queue_refuses_new_sessions_of_the_tenants_holding_their_share_of_it() -> None:
    s = sched()
    for i in range(4):
        s.step(Arrive(msgspec.structs.replace(mk(A, float(i)), tenant="bob")), float(i))
    assert s.queued() == 4 and s.refuses_new_session("bob", 4)       # one tenant: the bound, as before
    assert not s.refuses_new_session("bob", 5)
    assert not s.refuses_new_session("alice", 4)   # holding nothing of it: in over the bound
    s.step(Arrive(msgspec.structs.replace(mk(A, 9.0), tenant="alice")), 9.0)
    s.step(Arrive(msgspec.structs.replace(mk(A, 9.5), tenant="alice")), 9.5)
    assert s.refuses_new_session("alice", 4)       # her share of 4 between two tenants is 2
    assert s.refuses_new_session("bob", 4) and not s.refuses_new_session("carol", 4)


def test_tenants_take_turns_in_the_order_given() -> None:
    from services.admission.scheduler import _Queued, _tenants_in_turn

    calls = [msgspec.structs.replace(mk(A, float(i)), tenant=t) for i, t in enumerate("aaabbc")]
    items = [_Queued(c, 0.0, None) for c in calls]
    assert [i.call.tenant for i in _tenants_in_turn(items)] == list("abcaba")
    assert [i.call.call_id for i in _tenants_in_turn(items)][:3] == [calls[0].call_id, calls[3].call_id,
                                                                      calls[5].call_id]


def test_kv_demand_is_capped_by_the_context_limit() -> None:
    s = sched()
    limit = CAT.model(B).context_limit
    c = mk(B, 0.0, prompt=limit - 100, max_tokens=4096)
    (d,) = of(open_slot(s, B, 5.0, c), Dispatch)
    assert d.reserved_tokens == limit


def test_preempt_closing_rule_requeues_at_the_quantum() -> None:
    s = sched(policy("baseline", closing="preempt", slot_s=30.0))
    run1, run2 = mk(B, 0.0), mk(B, 0.5)
    open_slot(s, B, 5.0, run1, run2)
    s.step(Arrive(mk(A, 6.0)), 6.0)
    # the quantum counts from the slot's opening, but never ends before each
    # running call has had its (estimated, serial) prefill plus a quantum of decode
    spec = CAT.model(B)
    first_tokens = 5.0 + 2 * s.cost.prefill_s(spec, 10_000, 0)
    expected = max(35.0, first_tokens + 30.0)
    assert s.next_wakeup() == pytest.approx(35.0)
    assert s.step(Tick(), 20.0) == []  # before the quantum: keep draining
    assert s.step(Tick(), 35.0) == []  # the quantum, but the prefills + a quantum of decode are not over
    assert s.next_wakeup() == pytest.approx(expected)
    acts = s.step(Tick(), expected)
    assert sorted(p.call_id for p in of(acts, Preempt)) == sorted([run1.call_id, run2.call_id])
    assert of(acts, SlotClosed)[0].reason == "preempted at quantum"
    assert of(acts, StartSwitch) == [StartSwitch(B, A)]
    assert s.running == {} and s.stats.preemptions == 2
    assert [c.call_id for c in s.pending_calls() if c.model == B] == [run1.call_id, run2.call_id]  # head, in order
    # the drain rule never preempts
    d = sched(policy("baseline", closing="drain", slot_s=30.0))
    open_slot(d, B, 5.0, mk(B, 0.0))
    d.step(Arrive(mk(A, 6.0)), 6.0)
    assert of(d.step(Tick(), 100.0), Preempt) == []


def _b_running_a_waiting() -> tuple[RoundScheduler, AdmissionCall]:
    """Under the preempt rule, B's slot runs one call while A waits."""
    s = sched(policy("baseline", closing="preempt", slot_s=30.0))
    run = mk(B, 0.0, sid="X")
    open_slot(s, B, 5.0, run)
    s.step(Arrive(mk(A, 6.0)), 6.0)
    return s, run


def _preempted_at_quantum() -> tuple[RoundScheduler, AdmissionCall, float]:
    """B's only call is preempted at the quantum (A waits): it is back in B's queue."""
    s, run = _b_running_a_waiting()
    at = s.next_wakeup()
    while not of(s.step(Tick(), at), Preempt):
        at = s.next_wakeup()
    assert s.queued(B) == 1 and s.running == {}
    return s, run, at


def test_a_finish_that_crosses_its_preemption_wins() -> None:
    """Live, the engine may finish a call before the Abort reaches it: the reply is
    out, so the requeued copy must never run again (a copy without its payload
    held B's turns for the rest of a live run)."""
    s, run, at = _preempted_at_quantum()
    s.step(Finished(run.call_id, "X", 12_000), at + 0.01)
    assert s.queued(B) == 0
    acts = s.step(SwitchDone(A, CAP), at + 5.0)
    (da,) = of(acts, Dispatch)
    acts = s.step(Finished(da.call.call_id, da.call.session_id, 11_000), at + 20.0)
    assert of(acts, StartSwitch) == []  # nothing of B left to switch back for
    assert all(d.call.call_id != run.call_id for d in of(acts, Dispatch))


def test_forget_drops_a_call_that_cannot_run() -> None:
    s, run = _b_running_a_waiting()
    acts = s.forget(run.call_id, 7.0)  # e.g. its payload is gone: it can never finish
    assert s.running == {} and s.queued(B) == 0 and s.reserved_kv_tokens() == 0
    assert of(acts, SlotClosed)[0].reason == "drained" and of(acts, StartSwitch) == [StartSwitch(B, A)]
    s2, queued, at = _preempted_at_quantum()
    s2.forget(queued.call_id, at + 0.01)
    assert s2.queued(B) == 0


# -- soft reservations -----------------------------------------------------------------------


def test_reservation_made_on_finish_and_hit_on_return() -> None:
    s = sched(policy("talaria"))
    c = mk(B, 0.0, sid="X", gaps=(4.0, 6.0))
    other = mk(B, 0.5)
    open_slot(s, B, 5.0, c, other)
    acts = s.step(Finished(c.call_id, "X", 10_300), 10.0)
    assert Protect("X", B, on=True) in acts
    res = s.reservations["X"]
    assert res.expires_at == pytest.approx(10.0 + s.hold_s((4.0, 6.0))) == pytest.approx(19.0)
    assert res.tokens == 10_300
    assert s.stats.reservations_made == 1
    assert s.next_wakeup() == pytest.approx(19.0)
    ret = mk(B, 12.0, sid="X", cont=True, prompt=10_800, prefix=10_300)
    acts = s.step(Arrive(ret), 12.0)
    assert Protect("X", B, on=False) in acts
    assert s.stats.reservations_hit == 1 and "X" not in s.reservations


def test_reservation_expires_at_expires_at() -> None:
    s = sched(policy("talaria"))
    c, other = mk(B, 0.0, sid="X"), mk(B, 0.5)
    open_slot(s, B, 5.0, c, other)
    s.step(Finished(c.call_id, "X", 10_300), 10.0)
    exp = s.reservations["X"].expires_at  # no gap history: hold_min_s
    assert exp == pytest.approx(12.0)
    assert of(s.step(Tick(), exp - 0.5), Protect) == []
    acts = s.step(Tick(), exp)
    assert Protect("X", B, on=False) in acts
    assert s.reservations == {} and s.stats.reservations_expired == 1


def test_no_reservations_when_off() -> None:
    s = sched(policy("talaria-no-reservations"))
    c = mk(B, 0.0, sid="X")
    open_slot(s, B, 5.0, c)
    acts = s.step(Finished(c.call_id, "X", 10_300), 10.0)
    assert of(acts, Protect) == [] and s.reservations == {}


def test_idle_slot_held_by_reservation_closes_when_it_expires() -> None:
    s = sched(policy("talaria", slot_s=30.0, idle_hold_max_s=100.0))
    c = mk(B, 0.0, sid="X", gaps=(3.0,))
    open_slot(s, B, 5.0, c)
    s.step(Arrive(mk(A, 6.0)), 6.0)  # another model waits
    acts = s.step(Finished(c.call_id, "X", 10_300), 10.0)
    # drained, A waits, but X's claim holds the slot
    assert of(acts, SlotClosed) == [] and of(acts, StartSwitch) == []
    exp = s.reservations["X"].expires_at
    assert exp == pytest.approx(14.5)
    assert s.next_wakeup() == pytest.approx(exp)
    acts = s.step(Tick(), exp)
    assert Protect("X", B, on=False) in acts
    assert of(acts, SlotClosed)[0].reason == "drained"
    assert of(acts, StartSwitch) == [StartSwitch(B, A)]
    assert s.stats.reserved_idle_s == pytest.approx(4.5)


def test_idle_hold_for_reservations_is_capped() -> None:
    s = sched(policy("talaria", slot_s=30.0, hold_min_s=20.0, hold_max_s=20.0, idle_hold_max_s=2.0))
    c = mk(B, 0.0, sid="X")
    open_slot(s, B, 5.0, c)
    s.step(Arrive(mk(A, 6.0)), 6.0)
    acts = s.step(Finished(c.call_id, "X", 10_300), 10.0)  # claim until 30 s, but idle at most 2 s
    assert of(acts, SlotClosed) == []
    assert s.next_wakeup() == pytest.approx(12.0)
    acts = s.step(Tick(), 12.0)
    assert of(acts, SlotClosed)[0].reason == "drained"
    assert of(acts, StartSwitch) == [StartSwitch(B, A)]
    assert s.stats.reserved_idle_s == pytest.approx(2.0)


def test_reservation_never_holds_past_the_quantum() -> None:
    s = sched(policy("talaria", slot_s=30.0, hold_min_s=30.0, hold_max_s=30.0, idle_hold_max_s=100.0))
    c = mk(B, 0.0, sid="X")
    open_slot(s, B, 5.0, c)
    s.step(Arrive(mk(A, 6.0)), 6.0)
    s.step(Finished(c.call_id, "X", 10_300), 30.0)  # hold until 60 s, quantum at 35 s
    assert s.next_wakeup() == pytest.approx(35.0)
    acts = s.step(Tick(), 35.0)
    assert of(acts, SlotClosed)[0].reason == "quantum"
    assert Protect("X", B, on=False) in acts  # dropped when its model's slot closes
    assert of(acts, StartSwitch) == [StartSwitch(B, A)]


def test_reservation_released_when_session_ends() -> None:
    s = sched(policy("talaria"))
    c, other = mk(B, 0.0, sid="X"), mk(B, 0.5)
    open_slot(s, B, 5.0, c, other)
    s.step(Finished(c.call_id, "X", 10_300), 10.0)
    acts = s.step(SessionEnded("X"), 10.5)
    assert Protect("X", B, on=False) in acts and s.reservations == {}


def test_reservation_never_blocks_an_admission() -> None:
    s = sched(policy("talaria"))
    c = mk(B, 0.0, sid="X")
    open_slot(s, B, 5.0, c, cap=20_000)
    s.step(Finished(c.call_id, "X", 10_300), 10.0)
    assert "X" in s.reservations
    newcomer = mk(B, 10.5, prompt=15_000, max_tokens=4_000)  # needs 19k of the 20k budget
    acts = s.step(Arrive(newcomer), 10.5)
    assert dispatched(acts) == [newcomer.call_id]


@pytest.mark.parametrize(
    ("gaps", "hold"),
    [
        ((), 2.0),                       # no history: hold_min_s
        ((0.2, 0.3, 0.5), 2.0),          # 0.5 * 1.5 clamped up to 2 s
        ((10.0,), 15.0),                 # 10 * 1.5
        (tuple(float(i) for i in range(1, 11)), 15.0),  # 0.9-quantile of 1..10 is 10
        ((1.0,) * 9 + (100.0,), 30.0),   # clamped to hold_max_s
        ((100.0,) + (1.0,) * 19, 2.0),   # one outlier in 20 is above the 0.9-quantile
    ],
)
def test_hold_s_from_gap_history(gaps: tuple[float, ...], hold: float) -> None:
    assert sched(policy("talaria")).hold_s(gaps) == pytest.approx(hold)


def test_hold_s_depends_only_on_gap_history() -> None:
    gaps = (3.0, 0.5, 7.0, 1.2, 2.2)
    a = sched(policy("talaria"))
    b = sched(policy("talaria"))
    open_slot(b, B, 5.0, mk(B, 0.0), mk(A, 1.0))
    b.step(Tick(), 50.0)
    assert a.hold_s(gaps) == b.hold_s(gaps) == a.hold_s(tuple(sorted(gaps))) == a.hold_s(tuple(reversed(gaps)))
    p = policy("talaria", hold_quantile=0.5, hold_factor=2.0, hold_min_s=1.0, hold_max_s=100.0)
    assert sched(p).hold_s(gaps) == pytest.approx(2.2 * 2.0)


def test_duplicate_arrival_is_ignored() -> None:
    s = sched()
    c = mk(B, 0.0)
    s.step(Arrive(c), 0.0)
    s.step(Arrive(c), 0.1)
    assert s.queued(B) == 1
    acts = s.step(SwitchDone(B, CAP), 5.0)
    assert dispatched(acts) == [c.call_id]
    assert s.step(Arrive(c), 6.0) == []


def test_unknown_model_is_refused() -> None:
    with pytest.raises(ValueError):
        sched().step(Arrive(mk("gpt-oss-120b", 0.0)), 0.0)


def test_live_models_are_those_with_queued_running_or_claimed_work() -> None:
    s = sched(policy("talaria"))
    assert s.live_models() == frozenset()
    c = mk(B, 0.0, sid="X", gaps=(4.0,))
    waiting = mk(C, 0.5)
    open_slot(s, B, 5.0, c, waiting)
    assert s.live_models() == {B, C}  # B running, C queued
    s.step(Finished(c.call_id, "X", 10_300), 10.0)
    # B's session is at a tool under a claim: B still takes a turn of this server's rounds
    assert "X" in s.reservations and s.live_models() == {B, C}
    s.step(SessionEnded("X"), 11.0)
    assert s.live_models() == {C}
