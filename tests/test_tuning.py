"""The fairness rules of `talaria study tune` (docs/results.md): the same budget
for every policy, grids that name real policy fields, tuning settings that are
never scored, and tuned parameters that are points of the sweep."""

from __future__ import annotations

import itertools
from pathlib import Path

import msgspec
import pytest

from shared.policy import FIELD_RANGES, PEERS, PRESETS, PolicyConfig, PolicyError, resolve_policy, tuned_overrides
from talaria.lab import experiments as ex
from talaria.workload.scenarios import load_scenario

ROOT = Path(__file__).resolve().parent.parent


def _configs(name: str) -> list[dict]:
    grid = ex.GRIDS[name]
    keys = list(grid)
    return [ex._expand(dict(zip(keys, values))) for values in itertools.product(*(grid[k] for k in keys))]


def test_every_policy_gets_the_same_budget() -> None:
    budgets = {name: len(_configs(name)) for name in ex.GRIDS}
    assert set(budgets.values()) == {32}, budgets


@pytest.mark.parametrize("name", list(ex.GRIDS))
def test_grid_points_are_distinct_valid_policies(name: str) -> None:
    configs = _configs(name)
    assert len({msgspec.json.encode(c) for c in configs}) == len(configs)
    for ov in configs:
        assert set(ov) <= set(PolicyConfig.__struct_fields__), ov
        pol = resolve_policy(name, ov, tuned=False)
        assert all(getattr(pol, k) == v for k, v in ov.items())


def test_tuning_settings_are_never_scored() -> None:
    for path in ex.TUNING_SCENARIOS:
        sc = load_scenario(ROOT / path)  # load_scenario refuses tuning seeds among the scored ones
        assert not set(sc.seeds) & set(ex.TUNE_SEEDS)
        assert sc.servers > 1, "the one-server setting is the default generator settings"
    assert not set(ex.SCORE_SEEDS) & set(ex.TUNE_SEEDS)


@pytest.mark.parametrize("name", list(ex.GRIDS))
def test_tuned_parameters_are_a_point_of_the_sweep(name: str) -> None:
    """shared/data/tuned.toml holds what the sweep chose, nothing hand-set."""
    tuned = tuned_overrides()[name]
    assert any(ov == tuned for ov in _configs(name)), tuned


def test_a_configuration_is_scored_on_every_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """One configuration's score covers the one-server settings and every tuning scenario."""
    calls: list[tuple] = []

    def fake_run_one(sessions, policy, **kw):  # type: ignore[no-untyped-def]
        calls.append((len(sessions), 1))
        return {"sct_mean_s": 100.0}

    def fake_run_policy(sc, sessions, policy, **kw):  # type: ignore[no-untyped-def]
        calls.append((len(sessions), sc.servers))
        return {"sct_mean_s": 100.0 * sc.servers}

    monkeypatch.setattr(ex, "run_one", fake_run_one)
    monkeypatch.setattr(ex, "run_policy", fake_run_policy)
    per_set = ex._score_config(("talaria", _configs("talaria")[0], "sct_mean_s"))
    names = [load_scenario(ROOT / p).name for p in ex.TUNING_SCENARIOS]
    assert list(per_set) == ["1x30x3 (default settings)", *names]
    assert len(calls) == len(ex.TUNE_SEEDS) * (1 + len(names))
    assert per_set["1x30x3 (default settings)"] == 100.0


def test_latency_study_decides_on_unscored_seeds_and_includes_the_tuned_policy() -> None:
    """`talaria study latency` judges idle holds on tuning seeds only, and its
    first row is the tuned policy (no idle hold) at no latency."""
    assert not set(ex.ROBUSTNESS_SEEDS) & set(ex.SCORE_SEEDS)
    assert min(ex.ROBUSTNESS_SEEDS) > max(ex.SCORE_SEEDS)
    assert ex.IDLE_HOLDS_S[0] == tuned_overrides()["talaria"]["idle_hold_max_s"] and ex.LATENCIES_S[0] == 0.0


def test_sharing_study_lays_out_turns_three_servers_and_thirds() -> None:
    """`talaria study sharing`: three servers' capacity beats turns on one, and
    a third of a server decodes every session more slowly than a whole one."""
    report, md = ex.sharing_study()
    turns, servers, thirds = report.values()
    assert servers["sct_mean_s"] < turns["sct_mean_s"]
    assert thirds["decode_per_session_s"] > 2.5 * servers["decode_per_session_s"]
    assert len([line for line in md if line.startswith("| ") and "---" not in line]) == 4


def test_every_preset_and_tuned_toml_pass_the_field_ranges() -> None:
    for name in [*PRESETS, *(f"{peer}@baseline" for peer in PEERS)]:
        resolve_policy(name)  # with shared/data/tuned.toml applied; raises PolicyError when out of range


def test_every_numeric_policy_field_has_a_range() -> None:
    numeric = {f.name for f in msgspec.structs.fields(PolicyConfig) if f.type in (int, float)}
    assert numeric == set(FIELD_RANGES)


@pytest.mark.parametrize("field,value,fragment", [
    ("slot_s", 0, "slot_s must be finite and 1 or more, got 0"),  # a zero quantum hung paired and sim
    ("slot_s", -30, "slot_s must be finite and 1 or more"),
    ("slot_s", float("inf"), "slot_s must be finite"),
    ("affinity_vnodes", 0, "affinity_vnodes must be finite and in 1..4096"),  # ZeroDivisionError in placement
    ("hold_factor", -1, "hold_factor must be finite and 0 or more"),
    ("hold_max_s", -1, "hold_max_s must be finite and 0 or more"),
    ("hold_min_s", 40, "hold_min_s (40.0) must not exceed hold_max_s (30.0)"),
    ("ttl_max_s", -1, "ttl_max_s must be finite and 0 or more"),
    ("sp_overrun_s", -100, "sp_overrun_s must be finite and 0 or more"),
    ("kv_block_tokens", 0, "kv_block_tokens must be finite and 1 or more"),
    ("affinity_load_factor", 0, "affinity_load_factor must be finite and 1 or more"),
    ("balance_rel_threshold", 0, "balance_rel_threshold must be finite and 1 or more"),
    ("cache_threshold", float("nan"), "cache_threshold must be finite and in 0..1"),
    ("slot_s", "soon", "Expected `float`, got `str`"),
])
def test_a_policy_field_out_of_range_is_one_line_naming_field_and_range(field: str, value: object,
                                                                        fragment: str) -> None:
    with pytest.raises(PolicyError) as exc:
        resolve_policy("talaria", {field: value})
    assert str(exc.value).startswith("policy 'talaria': ") and fragment in str(exc.value)
    assert "\n" not in str(exc.value)


def test_a_policy_built_in_code_is_checked_as_well() -> None:
    with pytest.raises(PolicyError, match="slot_s must be finite and 1 or more"):
        msgspec.structs.replace(PRESETS["baseline"], slot_s=0.0)
