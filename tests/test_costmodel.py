"""Cost model (shared/costmodel.py) against the figures of docs/calibration.md."""

from __future__ import annotations

import pytest

from shared.costmodel import CostModel
from shared.catalog import GB, load_catalog

CAT = load_catalog()
H100 = CAT.server("h100x8")
QWEN = CAT.model("qwen3-235b-a22b-fp8")
GLM = CAT.model("glm-4.5-fp8")
AIR = CAT.model("glm-4.5-air-fp8")
OSS = CAT.model("gpt-oss-120b")


@pytest.fixture
def cm() -> CostModel:
    return CostModel(CAT, H100)


# -- prefill -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("new", "cached", "lo", "hi"),
    [
        (64_000, 0, 3.70, 3.80),   # CALIBRATION: full 64k prefill ~3.8 s
        (65_536, 0, 3.75, 3.90),   # 64 Ki tokens
        (1_000, 60_000, 0.075, 0.085),  # CALIBRATION: 1k appended to a cached 60k ~80 ms
        (60_000, 0, 3.2, 3.6),     # recomputing a 60k session ~3.5 s
    ],
)
def test_prefill_matches_calibration_checks(cm: CostModel, new: int, cached: int, lo: float, hi: float) -> None:
    assert lo <= cm.prefill_s(QWEN, new, cached) <= hi


@pytest.mark.parametrize("model", [QWEN, GLM, AIR, OSS], ids=lambda m: m.name)
@pytest.mark.parametrize(("new", "cached"), [(1, 0), (700, 40_000), (10_000, 0), (10_000, 50_000)])
def test_prefill_formula(cm: CostModel, model, new: int, cached: int) -> None:
    # T = n / R + c_attn * n * (p + n/2) / F
    expected = new / model.prefill_tok_s + model.attn_flops_per_pair * new * (cached + new / 2) / (H100.usable_pflops * 1e15)
    assert cm.prefill_s(model, new, cached) == pytest.approx(expected, rel=1e-12)


def test_prefill_of_nothing_is_free(cm: CostModel) -> None:
    assert cm.prefill_s(QWEN, 0, 50_000) == 0.0
    assert cm.prefill_s(QWEN, -5, 50_000) == 0.0


def test_prefill_grows_with_cached_prefix_and_new_tokens(cm: CostModel) -> None:
    by_prefix = [cm.prefill_s(QWEN, 1_000, p) for p in (0, 10_000, 30_000, 60_000, 120_000)]
    assert by_prefix == sorted(by_prefix) and len(set(by_prefix)) == len(by_prefix)
    by_new = [cm.prefill_s(QWEN, n, 10_000) for n in (1, 100, 1_000, 10_000)]
    assert by_new == sorted(by_new) and len(set(by_new)) == len(by_new)
    # a cached prefix is far cheaper than recomputing it
    assert cm.prefill_s(QWEN, 1_000, 60_000) < cm.prefill_s(QWEN, 61_000, 0) / 20


# -- decode ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch", "ms"),
    [
        (1, 12.0),
        (16, 15.5),
        (64, 22.75),
        (0, 12.0),  # an empty batch is priced as one call
        (8, 12.0 + 7 / 15 * 3.5),  # linear between the measured points
        (40, 15.5 + 24 / 48 * 7.25),
        (128, 22.75 + 64 * 7.25 / 48),  # extrapolated along the last segment
    ],
)
def test_base_itl_interpolation(cm: CostModel, batch: int, ms: float) -> None:
    assert cm.base_itl_s(batch) == pytest.approx(ms / 1000.0, rel=1e-12)


def test_base_itl_monotonic_between_points(cm: CostModel) -> None:
    values = [cm.base_itl_s(b) for b in range(1, 129)]
    assert all(b > a for a, b in zip(values, values[1:]))


@pytest.mark.parametrize("model", [QWEN, GLM, AIR], ids=lambda m: m.name)
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_itl_is_scaled_base_plus_kv_read(cm: CostModel, model, batch: int) -> None:
    ctx = 40_000 * batch
    kv_read = ctx * model.kv_bytes_per_token / H100.gpus / (H100.hbm_tb_s_per_gpu * 1e12)
    assert cm.itl_s(model, batch, 0) == pytest.approx(cm.base_itl_s(batch) * model.decode_itl_scale, rel=1e-12)
    assert cm.itl_s(model, batch, ctx) == pytest.approx(cm.base_itl_s(batch) * model.decode_itl_scale + kv_read, rel=1e-12)


def test_kv_read_term_grows_with_context(cm: CostModel) -> None:
    ctxs = [0, 1_000, 10_000, 60_000, 250_000, 1_000_000]
    itls = [cm.itl_s(QWEN, 4, c) for c in ctxs]
    assert all(b > a for a, b in zip(itls, itls[1:]))
    # linear in context: +60k tokens of Qwen3 KV (~23 GB) over 8 x 3.35 TB/s ~ 0.86 ms
    delta = cm.itl_s(QWEN, 1, 60_000) - cm.itl_s(QWEN, 1, 0)
    assert delta == pytest.approx(60_000 * 385_024 / 8 / 3.35e12, rel=1e-9)
    assert 0.8e-3 < delta < 0.9e-3


def test_per_sequence_kv_is_charged_per_batch_member(cm: CostModel) -> None:
    # gpt-oss keeps a sliding-window KV per sequence
    one = cm.itl_s(OSS, 2, 10_000) - cm.base_itl_s(2) * OSS.decode_itl_scale
    expected = (10_000 * OSS.kv_bytes_per_token + 2 * OSS.kv_bytes_per_seq) / 8 / (3.35e12)
    assert one == pytest.approx(expected, rel=1e-9)


def test_decode_alone_uses_midpoint_context(cm: CostModel) -> None:
    assert cm.decode_alone_s(QWEN, 20_000, 200) == pytest.approx(200 * cm.itl_s(QWEN, 1, 20_100), rel=1e-12)
    assert cm.decode_alone_s(QWEN, 20_000, 400) > 2 * cm.decode_alone_s(QWEN, 20_000, 200) - 1e-12


# -- transfers -------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [1e6, 1e9, 235e9, 355e9])
def test_transfers_scale_with_bytes(cm: CostModel, nbytes: float) -> None:
    assert cm.h2d_s(nbytes) == pytest.approx(nbytes / 8 / (35.0 * GB), rel=1e-12)
    assert cm.d2h_s(nbytes) == pytest.approx(cm.h2d_s(nbytes), rel=1e-12)
    assert cm.d2d_s(nbytes) == pytest.approx(nbytes / 8 / (380.0 * GB), rel=1e-12)
    assert cm.h2d_s(2 * nbytes) == pytest.approx(2 * cm.h2d_s(nbytes), rel=1e-12)
    assert cm.d2d_s(3 * nbytes) == pytest.approx(3 * cm.d2d_s(nbytes), rel=1e-12)
    assert cm.d2d_s(nbytes) < cm.h2d_s(nbytes) / 10  # NVLink is an order of magnitude faster than PCIe


def test_transfer_reference_points(cm: CostModel) -> None:
    assert cm.h2d_s(8 * 35e9) == pytest.approx(1.0)
    assert cm.d2d_s(8 * 380e9) == pytest.approx(1.0)
    assert cm.h2d_s(0) == 0.0 and cm.d2d_s(0) == 0.0
    # Qwen3 weights from host: 235 GB over 8 x 35 GB/s ~ 0.84 s
    assert cm.h2d_s(QWEN.weights_bytes) == pytest.approx(235e9 / 280e9)


def test_kv_restore_of_60k_session(cm: CostModel) -> None:
    # CALIBRATION: ~2.9 GB per GPU -> 60-120 ms (recomputing it ~3.5 s)
    t = cm.kv_restore_s(QWEN, 60_000)
    assert t == pytest.approx(cm.h2d_s(QWEN.kv_bytes(60_000)))
    assert 0.06 <= t <= 0.12
    assert t < cm.prefill_s(QWEN, 60_000, 0) / 10
    assert cm.kv_restore_s(QWEN, 0) == 0.0


# -- switch constants and sensitivity knobs ---------------------------------------------


def test_switch_constants_come_from_the_profile(cm: CostModel) -> None:
    assert cm.wake_residual_s == H100.wake_residual_s
    assert cm.sleep_residual_s == H100.sleep_residual_s
    assert cm.remap_s == H100.remap_s
    assert cm.reinit_s == H100.reinit_s


@pytest.mark.parametrize("scale", [0.5, 2.0, 4.0])
def test_switch_cost_scale_scales_moves_and_fixed_costs_only(cm: CostModel, scale: float) -> None:
    s = CostModel(CAT, H100, switch_cost_scale=scale)
    for f in ("h2d_s", "d2h_s", "d2d_s"):
        assert getattr(s, f)(100e9) == pytest.approx(scale * getattr(cm, f)(100e9), rel=1e-12)
    for p in ("wake_residual_s", "sleep_residual_s", "remap_s", "reinit_s"):
        assert getattr(s, p) == pytest.approx(scale * getattr(cm, p), rel=1e-12)
    assert s.kv_restore_s(QWEN, 10_000) == pytest.approx(scale * cm.kv_restore_s(QWEN, 10_000), rel=1e-12)
    # compute is untouched
    assert s.prefill_s(QWEN, 5_000, 20_000) == cm.prefill_s(QWEN, 5_000, 20_000)
    assert s.itl_s(QWEN, 8, 100_000) == cm.itl_s(QWEN, 8, 100_000)


@pytest.mark.parametrize("scale", [0.5, 2.0, 3.0])
def test_prefill_speed_scale_divides_prefill_only(cm: CostModel, scale: float) -> None:
    s = CostModel(CAT, H100, prefill_speed_scale=scale)
    for new, cached in [(64_000, 0), (1_000, 60_000), (1, 0)]:
        assert s.prefill_s(QWEN, new, cached) == pytest.approx(cm.prefill_s(QWEN, new, cached) / scale, rel=1e-12)
    assert s.itl_s(QWEN, 16, 50_000) == cm.itl_s(QWEN, 16, 50_000)
    assert s.h2d_s(1e9) == cm.h2d_s(1e9)
    assert s.wake_residual_s == cm.wake_residual_s


@pytest.mark.parametrize("scale", [1 / 3, 0.5, 2.0])
def test_decode_speed_scale_divides_decode_steps_only(cm: CostModel, scale: float) -> None:
    s = CostModel(CAT, H100, decode_speed_scale=scale)
    for batch, ctx in [(1, 4_000), (16, 500_000), (64, 3_000_000)]:
        assert s.itl_s(QWEN, batch, ctx) == pytest.approx(cm.itl_s(QWEN, batch, ctx) / scale, rel=1e-12)
    assert s.decode_alone_s(QWEN, 30_000, 200) == pytest.approx(cm.decode_alone_s(QWEN, 30_000, 200) / scale, rel=1e-12)
    assert s.prefill_s(QWEN, 5_000, 20_000) == cm.prefill_s(QWEN, 5_000, 20_000)
    assert s.h2d_s(1e9) == cm.h2d_s(1e9)


def test_faster_server_has_faster_kv_read() -> None:
    h200 = CostModel(CAT, CAT.server("h200x8"))
    h100 = CostModel(CAT, H100)
    assert h200.itl_s(QWEN, 1, 100_000) < h100.itl_s(QWEN, 1, 100_000)
    assert h200.itl_s(QWEN, 1, 0) == h100.itl_s(QWEN, 1, 0)
