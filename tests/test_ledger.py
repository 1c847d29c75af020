"""The substrate's memory ledger and switch planner (services/substrate/ledger.py)."""

from __future__ import annotations

import dataclasses

import pytest

from shared.costmodel import CostModel
from services.substrate.ledger import SubstrateLedger, kv_capacity_tokens, region_plan
from shared.catalog import GB, load_catalog
import msgspec

from shared.policy import BASELINE, PRESETS, PolicyConfig

CAT = load_catalog()
H100 = CAT.server("h100x8")
DEFAULT_MODELS = ["glm-4.5-fp8", "qwen3-235b-a22b-fp8", "glm-4.5-air-fp8"]  # the generator's default catalog
GLM, QWEN, AIR = (CAT.model(m) for m in DEFAULT_MODELS)
SPECS = {m.name: m for m in (GLM, QWEN, AIR)}


def pol(base: str = "baseline", **kw: object) -> PolicyConfig:
    """A preset with field changes (the presets themselves, not any tuned parameters)."""
    return msgspec.structs.replace(PRESETS[base], **kw)


def ledger(policy: PolicyConfig, server=H100) -> SubstrateLedger:
    return SubstrateLedger(server, dict(SPECS), CostModel(CAT, server), policy)


# -- region plan ---------------------------------------------------------------------------


def test_region_plan_h100x8_default_models() -> None:
    plan = region_plan(H100, list(SPECS.values()), BASELINE)
    usable = 8 * 80 * GB * 0.9
    assert plan.usable_bytes == pytest.approx(usable)
    assert plan.weights_region_bytes == pytest.approx(355 * GB)  # the largest model (GLM-4.5)
    assert plan.kv_region_bytes == pytest.approx(usable - 355 * GB)
    # weights constrain residency: the catalog's weights do not fit HBM together
    assert sum(m.weights_bytes for m in SPECS.values()) > plan.usable_bytes
    led = ledger(BASELINE)
    assert led.plan == plan
    assert led.kv_capacity_tokens(QWEN.name) == int((usable - 355 * GB) // QWEN.kv_bytes_per_token)
    assert led.host_kv_capacity_bytes == pytest.approx(2048 * GB - 696 * GB)


def test_kv_capacity_is_the_kv_region_over_kv_per_token() -> None:
    models = list(SPECS.values())
    stable = pol()
    unstable = pol(stable_addresses=False)
    for m in models:
        assert kv_capacity_tokens(H100, models, stable, m) == int(region_plan(H100, models, stable).kv_region_bytes // m.kv_bytes_per_token)
    # without stable addresses the weights region is sized to the active model: more KV for smaller models
    assert kv_capacity_tokens(H100, models, unstable, AIR) > kv_capacity_tokens(H100, models, stable, AIR)
    assert kv_capacity_tokens(H100, models, unstable, GLM) == kv_capacity_tokens(H100, models, stable, GLM)


def test_ledger_refuses_impossible_servers() -> None:
    tiny_hbm = dataclasses.replace(H100, hbm_gb_per_gpu=40.0)  # 288 GB usable < 355 GB of GLM-4.5
    with pytest.raises(ValueError):
        ledger(BASELINE, tiny_hbm)
    tiny_host = dataclasses.replace(H100, host_dram_gb=500.0)
    with pytest.raises(ValueError):
        ledger(BASELINE, tiny_host)


# -- stable addresses ------------------------------------------------------------------------


def _switch_many(led: SubstrateLedger, n: int) -> list:
    plans = []
    order = list(SPECS)
    for i in range(n):
        plans.append(led.plan_switch(10.0 * i, order[i % 3], {}))
        led.check_bounds()
    return plans


def test_stable_addresses_reserve_regions_once() -> None:
    led = ledger(pol())
    plans = _switch_many(led, 20)
    assert led.region_reservations == 1
    assert led.switches == 20
    assert all(p.fixed_s < H100.reinit_s for p in plans)
    caps = {p.to_model: p.kv_capacity_tokens for p in plans}
    assert all(p.kv_capacity_tokens == caps[p.to_model] for p in plans)


def test_without_stable_addresses_every_switch_reserves_again() -> None:
    led = ledger(pol(stable_addresses=False))
    plans = _switch_many(led, 7)
    assert led.region_reservations == 1 + 7
    assert all(p.fixed_s >= H100.reinit_s for p in plans)
    stable = ledger(pol())
    plans_stable = _switch_many(stable, 7)
    for a, b in zip(plans, plans_stable):
        assert a.duration_s == pytest.approx(b.duration_s + H100.reinit_s)


# -- weight moves --------------------------------------------------------------------------------


def test_staging_off_is_sleep_plus_wake() -> None:
    led = ledger(BASELINE)
    cm = led.cost
    first = led.plan_switch(0.0, QWEN.name, {})
    assert first.from_model is None
    assert first.weights_out_s == 0.0
    assert first.duration_s == pytest.approx(cm.h2d_s(QWEN.weights_bytes) + H100.wake_residual_s)
    second = led.plan_switch(50.0, AIR.name, {})
    assert second.from_model == QWEN.name and led.active == AIR.name
    assert second.weights_out_s == pytest.approx(cm.d2h_s(QWEN.weights_bytes) + H100.sleep_residual_s)
    assert second.weights_in_s == pytest.approx(cm.h2d_s(AIR.weights_bytes) + H100.wake_residual_s)
    assert second.duration_s == pytest.approx(second.weights_out_s + second.weights_in_s)
    # CALIBRATION: vLLM sleep 5.8-6.0 s, wake 5.3-5.7 s for Qwen3-235B-FP8 (at TP=4: twice the bytes per GPU)
    assert 4.5 < second.weights_out_s < 6.5
    # staging does nothing with staging off
    assert led.stage(GLM.name, 60.0) is None and led.staging is None
    assert led.staged_fraction(GLM.name) == 0.0


def test_staging_on_fully_staged_model_costs_d2d_plus_remap() -> None:
    led = ledger(pol("talaria"))
    cm = led.cost
    led.plan_switch(0.0, AIR.name, {})  # active: GLM-4.5-Air (106 GB) -> 249 GB spare in the weights region
    st = led.stage(QWEN.name, 10.0)
    assert st is not None and st.nbytes == pytest.approx(QWEN.weights_bytes)
    assert st.ready_at == pytest.approx(10.0 + cm.h2d_s(QWEN.weights_bytes))
    assert led.staged_fraction(QWEN.name) == pytest.approx(1.0)
    assert led.stage(QWEN.name, 11.0) is st  # idempotent
    led.check_bounds()
    plan = led.plan_switch(10.0 + H100.wake_residual_s + 5.0, QWEN.name, {})
    assert plan.staged_bytes == pytest.approx(QWEN.weights_bytes)
    assert plan.weights_out_s == 0.0  # host copy kept: switch-out is a discard
    assert plan.weights_in_s == pytest.approx(cm.d2d_s(QWEN.weights_bytes))
    assert plan.fixed_s == pytest.approx(H100.remap_s)
    assert plan.duration_s == pytest.approx(cm.d2d_s(QWEN.weights_bytes) + H100.remap_s)
    assert plan.duration_s < 1.5
    assert led.staging is None


def test_staging_that_had_little_time_pays_the_rest() -> None:
    led = ledger(pol("talaria"))
    cm = led.cost
    led.plan_switch(0.0, AIR.name, {})
    st = led.stage(QWEN.name, 10.0)
    assert st is not None
    half = (st.ready_at - st.started_at) / 2
    plan = led.plan_switch(10.0 + half, QWEN.name, {})
    staged = QWEN.weights_bytes / 2
    assert plan.staged_bytes == pytest.approx(staged)
    assert plan.weights_in_s == pytest.approx(cm.d2d_s(staged) + cm.h2d_s(QWEN.weights_bytes - staged))
    assert plan.fixed_s == pytest.approx(H100.wake_residual_s - half + H100.remap_s)


def test_partial_staging_mixes_d2d_and_h2d() -> None:
    led = ledger(pol("talaria"))
    cm = led.cost
    led.plan_switch(0.0, QWEN.name, {})  # active Qwen3 (235 GB): 120 GB spare, GLM-4.5 needs 355 GB
    st = led.stage(GLM.name, 5.0)
    assert st is not None
    spare = 355 * GB - QWEN.weights_bytes
    assert st.nbytes == pytest.approx(spare)
    assert led.staged_fraction(GLM.name) == pytest.approx(spare / GLM.weights_bytes)
    led.check_bounds()
    plan = led.plan_switch(100.0, GLM.name, {})
    assert plan.staged_bytes == pytest.approx(spare)
    assert plan.weights_in_s == pytest.approx(cm.d2d_s(spare) + cm.h2d_s(GLM.weights_bytes - spare))
    assert plan.fixed_s == pytest.approx(H100.remap_s)
    full = ledger(pol("talaria"))
    full.plan_switch(0.0, QWEN.name, {})
    unstaged = full.plan_switch(100.0, GLM.name, {})
    assert unstaged.staged_bytes == 0.0
    assert cm.d2d_s(GLM.weights_bytes) + H100.remap_s < plan.duration_s < unstaged.duration_s


def test_staging_the_wrong_model_does_not_help() -> None:
    led = ledger(pol("talaria"))
    led.plan_switch(0.0, AIR.name, {})
    led.stage(QWEN.name, 1.0)
    plan = led.plan_switch(100.0, GLM.name, {})
    assert plan.staged_bytes == 0.0
    assert plan.weights_in_s == pytest.approx(led.cost.h2d_s(GLM.weights_bytes))
    assert plan.fixed_s == pytest.approx(H100.wake_residual_s + H100.remap_s)


def test_staging_needs_stable_addresses_for_spare_room() -> None:
    led = ledger(pol("talaria", stable_addresses=False))
    led.plan_switch(0.0, AIR.name, {})
    st = led.stage(QWEN.name, 1.0)
    assert st is not None and st.nbytes == 0.0


# -- host KV tier ---------------------------------------------------------------------------------


def test_host_kv_on_spills_to_host_and_copies_only_the_delta() -> None:
    led = ledger(pol("talaria"))
    cm = led.cost
    led.plan_switch(0.0, QWEN.name, {})
    p1 = led.plan_switch(30.0, AIR.name, {"a": 40_000, "b": 10_000})
    assert p1.kv_to_host_tokens == 50_000 and p1.kv_dropped_tokens == 0
    assert p1.kv_out_s == pytest.approx(cm.d2h_s(QWEN.kv_bytes(40_000) + QWEN.kv_bytes(10_000)))
    assert p1.duration_s == pytest.approx(p1.weights_out_s + max(p1.weights_in_s, p1.kv_out_s) + p1.fixed_s)
    assert led.host_view(QWEN.name) == {"a": 40_000, "b": 10_000}
    assert led.host_view(AIR.name) == {}
    assert p1.host_kv_view == {}  # Air has nothing on the host
    assert led.kv_bytes_to_host == pytest.approx(QWEN.kv_bytes(50_000))
    led.check_bounds()
    # back to Qwen: its sessions' KV is handed to the engine for restore
    p2 = led.plan_switch(60.0, QWEN.name, {})
    assert p2.host_kv_view == {"a": 40_000, "b": 10_000}
    # session a grew by 2k; b is unchanged: only a's 2k new tokens are copied
    before = led.kv_bytes_to_host
    p3 = led.plan_switch(90.0, AIR.name, {"a": 42_000, "b": 10_000})
    delta = QWEN.kv_bytes(42_000) - QWEN.kv_bytes(40_000)
    assert led.kv_bytes_to_host - before == pytest.approx(delta)
    assert p3.kv_out_s == pytest.approx(cm.d2h_s(delta))
    assert led.host_view(QWEN.name) == {"a": 42_000, "b": 10_000}
    led.check_bounds()


def test_host_kv_keeps_sessions_of_different_models_apart() -> None:
    led = ledger(pol("talaria"))
    led.plan_switch(0.0, QWEN.name, {})
    led.plan_switch(10.0, AIR.name, {"s": 1_000})
    led.plan_switch(20.0, QWEN.name, {"s": 3_000})
    assert led.host_view(QWEN.name) == {"s": 1_000}
    assert led.host_view(AIR.name) == {"s": 3_000}
    led.forget_session("s")
    assert led.host_view(QWEN.name) == {} and led.host_view(AIR.name) == {}


def test_host_kv_lru_eviction_when_the_tier_is_full() -> None:
    weights_gb = sum(m.weights_gb for m in SPECS.values())
    small = dataclasses.replace(H100, host_dram_gb=weights_gb + 1.0)  # 1 GB of host KV
    led = ledger(pol("talaria"), small)
    assert led.host_kv_capacity_bytes == pytest.approx(1 * GB)
    per = GLM.kv_bytes(1_000)  # ~377 MB: two fit, three do not
    led.plan_switch(0.0, GLM.name, {})
    led.plan_switch(10.0, AIR.name, {"s1": 1_000, "s2": 1_000})
    led.check_bounds()
    assert led.host_view(GLM.name) == {"s1": 1_000, "s2": 1_000}
    led.plan_switch(20.0, GLM.name, {})
    led.plan_switch(30.0, AIR.name, {"s3": 1_000})
    led.check_bounds()
    assert led.host_view(GLM.name) == {"s2": 1_000, "s3": 1_000}  # s1 was least recently used
    assert led.kv_evicted_from_host == pytest.approx(per)
    # spilling s2 again makes it most recent: s3 is evicted next
    led.plan_switch(40.0, GLM.name, {})
    led.plan_switch(50.0, AIR.name, {"s2": 1_000, "s4": 1_000})
    led.check_bounds()
    assert led.host_view(GLM.name) == {"s2": 1_000, "s4": 1_000}
    assert led.host_kv_bytes() <= led.host_kv_capacity_bytes


def test_host_kv_off_drops() -> None:
    led = ledger(pol("talaria", host_kv=False))
    led.plan_switch(0.0, QWEN.name, {})
    p = led.plan_switch(10.0, AIR.name, {"a": 20_000, "b": 5_000})
    assert p.kv_dropped_tokens == 25_000 and p.kv_to_host_tokens == 0
    assert p.kv_out_s == 0.0
    assert led.host_kv == {} and led.kv_bytes_to_host == 0.0
    assert led.kv_bytes_dropped == pytest.approx(QWEN.kv_bytes(25_000))
    back = led.plan_switch(20.0, QWEN.name, {})
    assert back.host_kv_view == {}
    led.check_bounds()


def test_check_bounds_detects_overcommit() -> None:
    led = ledger(pol("talaria"))
    led.check_bounds()
    led.host_kv[(QWEN.name, "huge")] = int(led.host_kv_capacity_bytes / QWEN.kv_bytes_per_token) + 10
    with pytest.raises(AssertionError):
        led.check_bounds()
    led2 = ledger(pol("talaria"))
    led2.plan_switch(0.0, QWEN.name, {})
    st = led2.stage(GLM.name, 0.0)
    assert st is not None
    st.nbytes = GLM.weights_bytes  # more than the 120 GB of spare room next to Qwen3
    with pytest.raises(AssertionError):
        led2.check_bounds()


def test_kv_spilled_during_a_slot_is_booked_and_bounded() -> None:
    weights_gb = sum(m.weights_gb for m in SPECS.values())
    small = dataclasses.replace(H100, host_dram_gb=weights_gb + 1.0)  # 1 GB of host KV
    led = ledger(pol("talaria"), small)
    led.plan_switch(0.0, AIR.name, {})
    led.plan_switch(10.0, GLM.name, {})
    led.plan_switch(20.0, AIR.name, {"g1": 1_000})  # a switched-out GLM session (~377 MB)
    led.check_bounds()
    # the active AIR engine spills one session (~377 MB at 2k tokens): it fits beside g1
    assert led.accept_spill(AIR.name, {"a1": 2_000}) == []
    assert led.host_view(AIR.name) == {"a1": 2_000}
    assert led.kv_bytes_to_host == pytest.approx(GLM.kv_bytes(1_000) + AIR.kv_bytes(2_000))
    # more than the tier holds: the other model's session goes first, then AIR's least recently spilled
    lost = led.accept_spill(AIR.name, {"a2": 2_000, "a3": 2_000})
    led.check_bounds()
    assert led.host_view(GLM.name) == {}
    assert lost == ["a1"] and led.host_view(AIR.name) == {"a2": 2_000, "a3": 2_000}
    # spilling again: only the part not already there is copied
    before = led.kv_bytes_to_host
    assert led.accept_spill(AIR.name, {"a3": 2_000}) == []
    assert led.kv_bytes_to_host == before


def test_kv_spill_with_host_kv_off_is_refused() -> None:
    led = ledger(pol("talaria", host_kv=False))
    led.plan_switch(0.0, QWEN.name, {})
    with pytest.raises(ValueError):
        led.accept_spill(QWEN.name, {"s": 1_000})


def test_incoming_model_is_the_staged_one_then_the_one_switching_in() -> None:
    """Placement scores the model moving into HBM as `staged`: staged ahead of
    its slot, or being switched in, until the switch is done."""
    led = ledger(pol("talaria"))
    assert led.incoming_model(0.0) is None
    plan = led.plan_switch(0.0, AIR.name, {})
    assert led.incoming_model(plan.duration_s / 2) == AIR.name  # switching in
    assert led.incoming_model(plan.duration_s) is None  # its switch has ended
    led.finish_switch()
    led.stage(QWEN.name, 10.0)
    assert led.incoming_model(10.0) == QWEN.name  # staged ahead of its slot
    plan = led.plan_switch(20.0, QWEN.name, {})
    assert led.incoming_model(20.0) == QWEN.name
    led.finish_switch()  # awake: active, no longer incoming, even before the planned end
    assert led.incoming_model(20.0) is None
