"""The sim engine (services/engine/sim_engine.py): timing, prefix reuse, KV accounting."""

from __future__ import annotations

import random

import pytest

from shared.costmodel import CostModel
from services.engine.sim_engine import CallResult, EngineCall, EngineError, SimEngine
from shared.catalog import load_catalog

CAT = load_catalog()
CM = CostModel(CAT, CAT.server("h100x8"))
QWEN = CAT.model("qwen3-235b-a22b-fp8")
CAP = 500_000


def engine(capacity: int = CAP, host_kv: dict[str, int] | None = None, now: float = 0.0) -> SimEngine:
    e = SimEngine(QWEN, CM)
    e.wake(now, capacity, host_kv or {})
    return e


def call(cid: str, sid: str, prompt: int, prefix: int = 0, stop: int = 200, max_tokens: int = 4096, reserved: int | None = None) -> EngineCall:
    return EngineCall(cid, sid, QWEN.name, prompt, prefix, max_tokens, stop, prompt + max_tokens if reserved is None else reserved)


def run_to_end(e: SimEngine) -> list[CallResult]:
    done: list[CallResult] = []
    while (t := e.next_event_at()) is not None:
        done += e.advance(t)
    return done


# -- one call ----------------------------------------------------------------------------


@pytest.mark.parametrize(("prompt", "stop", "max_tokens"), [(10_000, 200, 4096), (60_000, 1, 4096), (4_000, 900, 300), (100, 4000, 4096)])
def test_single_call_finish_is_prefill_plus_output_times_itl(prompt: int, stop: int, max_tokens: int) -> None:
    e = engine()
    e.submit(call("c", "s", prompt, stop=stop, max_tokens=max_tokens), 5.0)
    [r] = e.advance(1e6)
    out = min(stop, max_tokens)
    prefill = CM.prefill_s(QWEN, prompt, 0)
    assert r.output_tokens == out
    assert r.prefill_s == pytest.approx(prefill)
    assert r.first_token_at == pytest.approx(5.0 + prefill)
    assert r.finished_at == pytest.approx(5.0 + prefill + out * CM.itl_s(QWEN, 1, prompt), rel=1e-12)
    assert r.decode_s == pytest.approx(r.finished_at - r.first_token_at)
    assert (r.cached_tokens, r.restored_tokens, r.reprefill_tokens, r.restore_s) == (0, 0, 0, 0.0)
    assert not e.running and e.next_event_at() is None
    # the whole context stays cached for the session
    assert e.hbm_kv == {"s": prompt + out}


def test_nothing_happens_before_the_finish_time() -> None:
    e = engine()
    e.submit(call("c", "s", 10_000), 0.0)
    t_end = e.next_event_at()
    assert t_end is not None
    assert e.advance(t_end / 2) == []
    finish = CM.prefill_s(QWEN, 10_000, 0) + 200 * CM.itl_s(QWEN, 1, 10_000)
    assert e.advance(finish - 1e-3) == []
    [r] = e.advance(finish + 1e-3)
    assert r.finished_at == pytest.approx(finish, rel=1e-9)


def test_second_call_of_a_session_prefills_only_new_tokens() -> None:
    e = engine()
    e.submit(call("c0", "s", 8_000, stop=300), 0.0)
    [r0] = e.advance(100.0)
    prefix = 8_000 + 300
    e.submit(call("c1", "s", prefix + 700, prefix=prefix), 110.0)
    [r1] = e.advance(1e6)
    assert r1.cached_tokens == prefix
    assert r1.restored_tokens == 0 and r1.reprefill_tokens == 0
    assert r1.prefill_s == pytest.approx(CM.prefill_s(QWEN, 700, prefix))
    assert r1.prefill_s < r0.prefill_s / 5
    assert r1.finished_at == pytest.approx(110.0 + CM.prefill_s(QWEN, 700, prefix) + 200 * CM.itl_s(QWEN, 1, prefix + 700))


def test_concurrent_calls_of_a_session_each_find_its_prefix() -> None:
    """Two calls of one session at once (sub-agents sharing a session id): both reuse
    what the session holds, as a prefix cache serves blocks in use; a third, arriving
    while the first still prefills, finds only what that one had cached. Before, the
    first call took the session's KV and the others found none."""
    e = engine()
    e.submit(call("a", "s", 10_000), 0.0)
    [first] = e.advance(1e6)
    held = first.prompt_tokens + first.output_tokens
    t = first.finished_at + 5.0
    e.submit(call("b", "s", 12_000, prefix=held), t)
    e.submit(call("c", "s", 11_000, prefix=held), t)
    e.submit(call("d", "s", 11_000, prefix=held + 500), t)
    done = {r.call_id: r for r in run_to_end(e)}
    assert done["b"].cached_tokens == done["c"].cached_tokens == held
    assert done["d"].cached_tokens == held and done["d"].reprefill_tokens == 500
    assert e._running_in_session == {}
    # in the middle of a prefill: what the running call found cached, not its whole prompt
    e.submit(call("e", "s", 40_000, prefix=1_000), 0.0 + e.t)
    e.submit(call("f", "s", 40_000, prefix=30_000), e.t)
    done = {r.call_id: r for r in run_to_end(e)}
    assert done["f"].cached_tokens == 1_000 and done["f"].reprefill_tokens == 29_000


def test_other_sessions_prefix_is_not_reused() -> None:
    e = engine()
    e.submit(call("a0", "A", 8_000), 0.0)
    e.advance(100.0)
    e.submit(call("b1", "B", 9_000, prefix=8_200), 100.0)
    [r] = e.advance(1e6)
    assert r.cached_tokens == 0 and r.reprefill_tokens == 8_200
    assert r.prefill_s == pytest.approx(CM.prefill_s(QWEN, 9_000, 0))


@pytest.mark.parametrize(("host", "prefix", "restored", "reprefill"), [(50_000, 50_000, 50_000, 0), (30_000, 50_000, 30_000, 20_000), (60_000, 50_000, 50_000, 0)])
def test_host_kv_view_is_restored(host: int, prefix: int, restored: int, reprefill: int) -> None:
    e = engine(host_kv={"s": host}, now=10.0)
    e.submit(call("c", "s", prefix + 1_000, prefix=prefix), 10.0)
    [r] = e.advance(1e6)
    restore_s = CM.kv_restore_s(QWEN, restored)
    prefill = CM.prefill_s(QWEN, prefix + 1_000 - restored, restored)
    assert (r.cached_tokens, r.restored_tokens, r.reprefill_tokens) == (0, restored, reprefill)
    assert r.restore_s == pytest.approx(restore_s)
    assert r.prefill_s == pytest.approx(prefill)
    assert r.first_token_at == pytest.approx(10.0 + restore_s + prefill)
    assert r.finished_at == pytest.approx(10.0 + restore_s + prefill + 200 * CM.itl_s(QWEN, 1, prefix + 1_000))
    # the host copy stays (as in the substrate's ledger): restoring does not consume it
    assert e.host_kv == {"s": host}


def test_restore_beats_recompute() -> None:
    restored = engine(host_kv={"s": 60_000})
    restored.submit(call("c", "s", 61_000, prefix=60_000), 0.0)
    [a] = restored.advance(1e6)
    cold = engine()
    cold.submit(call("c", "s", 61_000, prefix=60_000), 0.0)
    [b] = cold.advance(1e6)
    assert b.reprefill_tokens == 60_000 and b.restored_tokens == 0
    assert a.finished_at < b.finished_at - 2.0


def test_no_kv_counts_reprefill_tokens() -> None:
    e = engine()
    e.submit(call("c", "s", 45_000, prefix=44_000), 0.0)
    [r] = e.advance(1e6)
    assert (r.cached_tokens, r.restored_tokens, r.reprefill_tokens) == (0, 0, 44_000)
    assert r.prefill_s == pytest.approx(CM.prefill_s(QWEN, 45_000, 0))


# -- batches ---------------------------------------------------------------------------


def test_two_decoders_are_slower_per_token_than_one() -> None:
    alone = engine()
    alone.submit(call("a", "A", 10_000, stop=500), 0.0)
    [ra] = alone.advance(1e6)
    pair = engine()
    pair.submit(call("a", "A", 10_000, stop=500), 0.0)
    pair.submit(call("b", "B", 10_000, stop=500), 0.0)
    done = pair.advance(1e6)
    assert {r.call_id for r in done} == {"a", "b"}
    assert ra.decode_s / 500 == pytest.approx(CM.itl_s(QWEN, 1, 10_000))
    for r in done:
        per_token = r.decode_s / r.output_tokens
        assert per_token > ra.decode_s / 500 * 1.01
    # prefill-first: b's prefill ran before any decoding, so a's first token waited for it
    ra2 = next(r for r in done if r.call_id == "a")
    assert ra2.first_token_at == pytest.approx(2 * CM.prefill_s(QWEN, 10_000, 0))


def test_prefill_pauses_running_decoders() -> None:
    e = engine()
    e.submit(call("a", "A", 10_000, stop=1_000), 0.0)
    t_pf = CM.prefill_s(QWEN, 10_000, 0)
    e.advance(t_pf + 1.0)  # a decodes for 1 s
    e.submit(call("b", "B", 50_000, stop=10), t_pf + 1.0)
    done = {r.call_id: r for r in e.advance(1e6)}
    itl_alone = CM.itl_s(QWEN, 1, 10_000)
    # a would have finished at t_pf + 1000 * itl alone; b's prefill (and the shared batch) delay it by at least b's prefill
    assert done["a"].finished_at > t_pf + 1_000 * itl_alone + CM.prefill_s(QWEN, 50_000, 0) - 1e-9


def _scenario(advance_times: list[float]) -> dict[str, tuple[float, float]]:
    """Calls submitted at fixed times; the engine observed at `advance_times` in between."""
    subs = [
        (0.0, call("a", "A", 60_000, stop=300)),
        (0.5, call("b", "B", 30_000, stop=100)),
        (9.0, call("c", "C", 5_000, stop=700)),
        (9.0, call("d", "D", 20_000, stop=50)),
        (15.0, call("e", "E", 40_000, stop=400)),
    ]
    e = engine()
    out: dict[str, tuple[float, float]] = {}
    events = sorted([(t, 0, c) for t, c in subs] + [(t, 1, None) for t in advance_times], key=lambda x: (x[0], x[1]))
    for t, kind, c in events:
        if kind == 0:
            e.submit(c, t)
        else:
            for r in e.advance(t):
                out[r.call_id] = (r.first_token_at, r.finished_at)
    for r in e.advance(1e6):
        out[r.call_id] = (r.first_token_at, r.finished_at)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_advance_at_arbitrary_times_is_exact(seed: int) -> None:
    reference = _scenario([])
    assert set(reference) == set("abcde")
    rng = random.Random(seed)
    times = sorted(rng.uniform(0.0, 40.0) for _ in range(rng.choice([3, 30, 300])))
    observed = _scenario(times)
    assert set(observed) == set(reference)
    for cid, (first, fin) in reference.items():
        # the only residue allowed is int() of a float token count landing on the other side of an integer
        assert observed[cid][0] == pytest.approx(first, abs=1e-5)
        assert observed[cid][1] == pytest.approx(fin, abs=1e-5)


def test_advance_is_idempotent_and_never_goes_back() -> None:
    e = engine()
    e.submit(call("a", "A", 10_000), 0.0)
    assert e.advance(1.0) == [] and e.advance(1.0) == [] and e.advance(0.5) == []
    assert e.t == pytest.approx(1.0)


# -- KV capacity, lifecycle ---------------------------------------------------------------


def test_submit_beyond_kv_capacity_raises() -> None:
    e = engine(capacity=20_000)
    e.submit(call("a", "A", 10_000, reserved=14_096), 0.0)
    with pytest.raises(EngineError):
        e.submit(call("b", "B", 2_000, reserved=6_096), 0.0)
    assert set(e.running) == {"a"}
    e.submit(call("c", "C", 1_000, reserved=5_904), 0.0)  # exactly fills the capacity
    assert e.reserved_kv_tokens() == 20_000


def test_submit_to_sleeping_engine_raises() -> None:
    e = SimEngine(QWEN, CM)
    with pytest.raises(EngineError):
        e.submit(call("a", "A", 1_000), 0.0)


def test_submit_is_at_most_once() -> None:
    e = engine()
    e.submit(call("a", "A", 1_000), 0.0)
    e.submit(call("a", "A", 1_000), 0.1)
    assert len(e.running) == 1 and len(e.prefill_queue) == 1
    assert len(e.advance(1e6)) == 1


def test_sleep_with_running_calls_raises() -> None:
    e = engine()
    e.submit(call("a", "A", 10_000), 0.0)
    with pytest.raises(EngineError):
        e.sleep(0.1)


def test_sleep_returns_idle_kv_and_clears() -> None:
    e = engine(host_kv={"Z": 5})
    e.submit(call("a", "A", 10_000, stop=100), 0.0)
    e.advance(1e3)
    out = e.sleep(1e3)
    assert out == {"A": 10_100}
    assert not e.active and not e.hbm_kv and not e.host_kv


def test_abort_during_decode_keeps_prefilled_prompt() -> None:
    e = engine()
    e.submit(call("a", "A", 10_000, stop=1_000), 0.0)
    e.submit(call("b", "B", 5_000, stop=100), 0.0)
    t = CM.prefill_s(QWEN, 10_000, 0) + CM.prefill_s(QWEN, 5_000, 0) + 0.1
    e.abort("a", t)
    assert "a" not in e.running and "a" not in e.prefill_queue
    assert e.hbm_kv["A"] == 10_000
    done = e.advance(1e6)
    assert [r.call_id for r in done] == ["b"]
    # b ran alone after the abort: faster than sharing with a
    assert done[0].finished_at < t + 100 * CM.itl_s(QWEN, 2, 15_000)


def test_abort_during_prefill_keeps_only_reused_prefix() -> None:
    e = engine(host_kv={"A": 8_000})
    e.submit(call("a", "A", 9_000, prefix=8_000), 0.0)
    e.abort("a", 0.001)
    assert e.hbm_kv == {"A": 8_000}
    assert not e.running and not e.prefill_queue and e.next_event_at() is None
    e.abort("a", 0.002)  # unknown: no-op
    e.abort("zzz", 0.002)


def test_abort_queued_prefill_frees_the_queue() -> None:
    e = engine()
    e.submit(call("a", "A", 10_000), 0.0)
    e.submit(call("b", "B", 10_000), 0.0)
    e.abort("b", 0.01)  # b had not started its prefill
    assert list(e.prefill_queue) == ["a"]
    assert "B" not in e.hbm_kv
    [r] = e.advance(1e6)
    assert r.call_id == "a"


def test_lru_eviction_keeps_protected_sessions_longest() -> None:
    e = engine(capacity=40_000)
    for i, sid in enumerate("ABC"):
        e.submit(call(f"{sid}0", sid, 9_900, stop=100, reserved=10_000), float(100 * i))
        e.advance(100.0 * i + 50)
    assert list(e.hbm_kv) == ["A", "B", "C"]  # LRU order, 10k each
    e.protected.add("A")
    # needs 15k: 30k idle + 15k > 40k -> evict one; A is the oldest but protected, so B goes
    e.submit(call("D0", "D", 10_000, stop=100, reserved=15_000), 400.0)
    assert list(e.hbm_kv) == ["A", "C"]
    # needs 30k more: unprotected C goes first, then protected A
    e.submit(call("E0", "E", 10_000, stop=100, reserved=15_000), 400.0)
    assert list(e.hbm_kv) == ["A"]
    e2 = engine(capacity=40_000)
    for i, sid in enumerate("ABC"):
        e2.submit(call(f"{sid}0", sid, 9_900, stop=100, reserved=10_000), float(100 * i))
        e2.advance(100.0 * i + 50)
    e2.submit(call("D0", "D", 10_000, stop=100, reserved=15_000), 400.0)
    assert list(e2.hbm_kv) == ["B", "C"]  # without protection, plain LRU


def test_protected_session_is_evicted_when_nothing_else_is_left() -> None:
    e = engine(capacity=30_000)
    e.submit(call("A0", "A", 9_900, stop=100, reserved=10_000), 0.0)
    e.advance(100.0)
    e.protected.add("A")
    e.submit(call("B0", "B", 20_000, stop=100, reserved=25_000), 100.0)
    assert e.hbm_kv == {}
    # accounting: running reservations + idle cache never exceed capacity
    assert e.reserved_kv_tokens() + e.idle_kv_tokens() <= e.kv_capacity_tokens


def test_wake_evicts_an_oversized_hbm_table() -> None:
    e = SimEngine(QWEN, CM)
    e.wake(0.0, 25_000, {}, hbm_kv={"A": 10_000, "B": 10_000, "C": 10_000})
    assert list(e.hbm_kv) == ["B", "C"]


def test_call_finished_inside_submit_is_handed_out_by_next_advance() -> None:
    e = engine()
    e.submit(call("a", "A", 1_000, stop=10), 0.0)
    e.submit(call("b", "B", 1_000, stop=10), 100.0)  # a finished long before: found inside submit
    done = e.advance(100.0)
    assert [r.call_id for r in done] == ["a"]
    assert done[0].finished_at < 1.0
    assert [r.call_id for r in e.advance(1e6)] == ["b"]
    assert e.advance(2e6) == []  # handed out once


# -- KV pushed out for room goes to host with host-KV restore on -------------------------


def test_kv_pushed_out_for_room_is_spilled_to_host_and_restored() -> None:
    e = SimEngine(QWEN, CM, spill_to_host=True)
    e.wake(0.0, 30_000, {})
    e.submit(call("A0", "A", 9_900, stop=100, reserved=10_000), 0.0)
    e.advance(100.0)
    assert e.hbm_kv == {"A": 10_000}
    e.submit(call("B0", "B", 20_000, stop=100, reserved=25_000), 100.0)
    assert e.hbm_kv == {} and e.host_kv == {"A": 10_000}
    assert e.take_spilled() == {"A": 10_000} and e.take_spilled() == {}
    [b] = e.advance(1e4)
    # the call that needed the room waited for the copy to host
    assert b.restore_s == pytest.approx(CM.d2h_s(QWEN.kv_bytes(10_000)))
    # A returns: its prefix comes back from host instead of being computed again
    e.submit(call("A1", "A", 10_500, prefix=10_000, stop=10, reserved=11_000), 2e4)
    [a] = run_to_end(e)
    assert (a.cached_tokens, a.restored_tokens, a.reprefill_tokens) == (0, 10_000, 0)


def test_spill_off_drops_and_forget_host_undoes_a_spill() -> None:
    dropped = SimEngine(QWEN, CM)
    dropped.wake(0.0, 30_000, {})
    dropped.submit(call("A0", "A", 9_900, stop=100, reserved=10_000), 0.0)
    dropped.advance(100.0)
    dropped.submit(call("B0", "B", 20_000, stop=100, reserved=25_000), 100.0)
    assert dropped.host_kv == {} and dropped.take_spilled() == {}
    e = SimEngine(QWEN, CM, spill_to_host=True)
    e.wake(0.0, 30_000, {"A": 4_000})
    e.submit(call("A0", "A", 9_900, prefix=4_000, stop=100, reserved=10_000), 0.0)
    e.advance(100.0)
    e.submit(call("B0", "B", 20_000, stop=100, reserved=25_000), 100.0)
    assert e.host_kv == {"A": 10_000} and e.spilled == {"A": 10_000}
    e.forget_host(["A"])  # the substrate's tier could not keep it
    assert e.host_kv == {} and e.spilled == {}


def test_a_restored_session_spilled_again_copies_only_its_new_tokens() -> None:
    """The ledger keeps a session's host copy after a restore, so pushing the
    grown context out again copies only the tokens host DRAM lacks; the engine
    charges the same bytes as the ledger books."""
    e = SimEngine(QWEN, CM, spill_to_host=True)
    e.wake(0.0, 30_000, {"A": 4_000})
    e.submit(call("A0", "A", 9_900, prefix=4_000, stop=100, reserved=10_000), 0.0)
    [a] = e.advance(100.0)
    assert a.restored_tokens == 4_000
    e.submit(call("B0", "B", 20_000, stop=100, reserved=25_000), 100.0)
    [b] = e.advance(1e4)
    assert b.restore_s == pytest.approx(CM.d2h_s(QWEN.kv_bytes(10_000) - QWEN.kv_bytes(4_000)))
    assert e.take_spilled() == {"A": 10_000}
