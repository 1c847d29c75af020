"""Paired comparisons over seeds and the SCT lower bound: the pure parts."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import pytest

from shared.catalog import load_catalog
from shared.costmodel import CostModel
from talaria.lab.paired import paired_rows, seed_list
from talaria.results.bound import call_work_s, decode_token_share_s, sct_lower_bound, trace_bound
from talaria.results.paired import bootstrap_median, meets, paired, relative_differences
from talaria.workload.trace import TraceCall, TraceSession


# -- statistics ----------------------------------------------------------------------
def test_relative_differences_sign_and_pairing() -> None:
    assert relative_differences([90.0, 110.0], [100.0, 100.0]) == pytest.approx([-0.1, 0.1])
    with pytest.raises(ValueError):
        relative_differences([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        relative_differences([1.0], [0.0])


def test_bootstrap_interval_holds_the_median_and_is_reproducible() -> None:
    values = [0.01 * i - 0.1 for i in range(21)]  # -0.10 .. +0.10, median 0
    p = bootstrap_median(values)
    assert p.n == 21 and p.median == pytest.approx(0.0)
    assert p.low <= p.median <= p.high
    assert -0.1 < p.low < 0 < p.high < 0.1
    assert bootstrap_median(values) == p  # seeded: the same table every time


def test_bootstrap_of_constant_differences_is_a_point() -> None:
    p = paired([95.0] * 20, [100.0] * 20)
    assert p.median == p.low == p.high == pytest.approx(-0.05)
    assert meets(p)


def test_interval_narrows_with_more_seeds() -> None:
    few = bootstrap_median([(-1) ** i * 0.05 + 0.01 * (i % 3) for i in range(8)])
    many = bootstrap_median([(-1) ** i * 0.05 + 0.01 * (i % 3) for i in range(80)])
    assert many.high - many.low <= few.high - few.low


def test_target_needs_median_at_most_zero_and_upper_end_at_most_one_percent() -> None:
    from talaria.results.paired import Paired

    assert meets(Paired(20, -0.02, -0.04, 0.009))
    assert not meets(Paired(20, -0.02, -0.04, 0.011))
    assert not meets(Paired(20, 0.001, -0.01, 0.005))


def test_paired_rows_pair_by_seed() -> None:
    runs = {str(s): {"talaria": {"sct_p50_s": 100.0, "sct_p95_s": 200.0},
                     "kv-ttl": {"sct_p50_s": 100.0 + s, "sct_p95_s": 200.0}} for s in (1, 2, 3)}
    rows = paired_rows({"reference": "talaria", "policies": ["talaria", "kv-ttl"], "runs": {"x/a.toml": runs}})
    assert len(rows) == 1 and rows[0]["setting"] == "a" and rows[0]["policy"] == "kv-ttl" and rows[0]["seeds"] == [1, 2, 3]
    assert rows[0]["sct_p50_s"].median == pytest.approx(100 / 102 - 1)
    assert rows[0]["sct_p95_s"].median == 0.0 and rows[0]["met"]


def test_seed_list() -> None:
    assert seed_list("2001-2003,7") == (2001, 2002, 2003, 7)
    assert seed_list(" 3 , 5-6") == (3, 5, 6)
    for bad in ("", "a-b", "1,1", "5-", "-3", "1,,2", "1,", "10-1", "1-1000000000", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            seed_list(bad)


# -- the bound -----------------------------------------------------------------------
def test_bound_is_the_oracle_without_contention() -> None:
    # sessions far apart in time with little work: capacity never binds
    b = sct_lower_bound([0.0, 1000.0, 2000.0], [10.0, 20.0, 30.0], [1.0, 1.0, 1.0])
    assert b.mean_s == pytest.approx(20.0) and b.p50_s == pytest.approx(20.0)


def test_bound_capacity_binds_when_everyone_arrives_at_once() -> None:
    # three sessions of 100 s of server work each, arriving together on one server:
    # the k-th completes no earlier than 100 k s, whatever the order
    b = sct_lower_bound([0.0, 0.0, 0.0], [100.0] * 3, [100.0] * 3)
    assert b.mean_s == pytest.approx(200.0)
    assert b.p50_s == pytest.approx(200.0)  # the lower of the middle pair: two sessions' work
    two = sct_lower_bound([0.0, 0.0, 0.0], [100.0] * 3, [100.0] * 3, servers=3)
    assert two.mean_s == pytest.approx(100.0)


def test_bound_is_below_any_schedule_of_a_single_machine() -> None:
    # brute force: every order of serving three jobs back to back on one machine
    import itertools

    arrivals, work = [0.0, 5.0, 7.0], [10.0, 3.0, 4.0]
    best_mean = best_p50 = float("inf")
    for order in itertools.permutations(range(3)):
        t, sct = 0.0, [0.0] * 3
        for i in order:
            t = max(t, arrivals[i]) + work[i]
            sct[i] = t - arrivals[i]
        best_mean = min(best_mean, statistics.fmean(sct))
        best_p50 = min(best_p50, statistics.median(sct))
    b = sct_lower_bound(arrivals, work, work)  # alone = its own work
    assert b.mean_s <= best_mean + 1e-9 and b.p50_s <= best_p50 + 1e-9


def test_bound_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        sct_lower_bound([], [], [])
    with pytest.raises(ValueError):
        sct_lower_bound([0.0], [1.0, 2.0], [1.0])


def test_work_share_uses_the_best_batch() -> None:
    cat = load_catalog()
    cost = CostModel(cat, cat.server("h100x8"))
    spec = cat.model("glm-4.5-fp8")
    one = decode_token_share_s(cost, spec, 1)
    assert one == pytest.approx(cost.base_itl_s(1) * spec.decode_itl_scale)
    assert decode_token_share_s(cost, spec, 16) <= one
    # a call's work is below its time alone (batch of one, own KV read)
    assert call_work_s(cost, spec, 8000, 6000, 200, one) <= (
        cost.prefill_s(spec, 2000, 6000) + cost.decode_alone_s(spec, 8000, 200) + 1e-9)


def test_trace_bound_is_below_what_the_simulator_measures() -> None:
    from talaria.workload.scenarios import ROOT
    from talaria.workload.trace import load_trace
    from talaria.sim.simulator import simulate
    from shared.policy import resolve_policy
    from talaria.results.report import percentile

    cat = load_catalog()
    sessions = load_trace(ROOT / "traces" / "swebench-30.jsonl")
    b = trace_bound(sessions, cat)
    r = simulate(sessions, cat, resolve_policy("talaria"))
    sct = list(r.sct.values())
    assert 0 < b.mean_s <= statistics.fmean(sct)
    assert 0 < b.p50_s <= percentile(sct, 50)
    tiny = [TraceSession("s", "glm-4.5-fp8", 0.0, [TraceCall(100, 10, 1.0), TraceCall(100, 10, 0.0)])]
    assert trace_bound(tiny, cat).p50_s > 1.0  # at least the tool gap


def test_variant_is_a_preset_with_fields_changed() -> None:
    from talaria.lab.paired import _resolve, variant

    label, spec = variant("short=talaria:hold_factor=1.0,hold_min_s=0,retention=ttl")
    assert label == "short" and spec == ("talaria", {"hold_factor": 1.0, "hold_min_s": 0, "retention": "ttl"})
    p = _resolve("short", {label: spec})
    assert p.name == "short" and p.hold_factor == 1.0 and p.retention == "ttl"
    for bad in ("x=nosuch:", "x=talaria:nosuch=1", "=talaria:"):
        with pytest.raises(argparse.ArgumentTypeError):
            variant(bad)
    # a zero quantum hung the simulator; a ring of no virtual nodes divided by zero in placement
    for bad, fragment in (("x=baseline:slot_s=0", "slot_s must be finite and 1 or more, got 0"),
                          ("x=session-affinity:affinity_vnodes=0", "affinity_vnodes must be finite and in 1..4096")):
        with pytest.raises(argparse.ArgumentTypeError, match=fragment):
            variant(bad)


def test_merge_keeps_each_setting_with_its_own_seeds_and_policies() -> None:
    from talaria.lab.paired import markdown, merge

    def fig(p50: float) -> dict[str, float]:
        return {"sct_p50_s": p50, "sct_p95_s": 2 * p50}

    small = {"reference": "talaria", "policies": ["talaria", "kv-ttl", "baseline"], "seeds": [1, 2], "wall_s": 1.0,
             "runs": {"s.toml": {str(k): {"talaria": fig(100), "kv-ttl": fig(101), "baseline": fig(500)} for k in (1, 2)}}}
    big = {"reference": "talaria", "policies": ["talaria", "kv-ttl"], "seeds": [1], "wall_s": 2.0,
           "runs": {"b.toml": {"1": {"talaria": fig(100), "kv-ttl": fig(99)}}}}
    m = merge([small, big])
    rows = paired_rows(m)
    assert [(r["setting"], r["policy"], r["seeds"]) for r in rows] == [
        ("s", "kv-ttl", [1, 2]), ("s", "baseline", [1, 2]), ("b", "kv-ttl", [1])]
    assert not rows[2]["met"]  # talaria 1% behind there
    assert "| b | kv-ttl | 1 |" in markdown(m)
    # an interval over so few seeds is said to say little (it printed as if it meant as much as 20 seeds')
    assert "_A row over 1 seed(s): an interval over fewer than 5 says little" in markdown(m)
    wide = {**small, "seeds": list(range(1, 6)),
            "runs": {"s.toml": {str(k): {"talaria": fig(100), "kv-ttl": fig(101), "baseline": fig(500)}
                                for k in range(1, 6)}}}
    assert "says little" not in markdown(wide)


def test_tuning_table_is_the_mean_over_seeds() -> None:
    from talaria.lab.paired import tuning_table

    runs = {"s.toml": {str(k): {"talaria": {"sct_mean_s": 10.0 * k, "sct_p50_s": 1.0, "sct_p95_s": 2.0}} for k in (1, 2)}}
    text = tuning_table({"policies": ["talaria"], "seeds": [1001, 1002], "runs": runs})
    assert "| s | talaria | 15.0 | 1.0 | 2.0 |" in text and "1001-1002" in text


def test_paired_refuses_the_tuning_seeds_unless_asked_for_the_tuning_view(capsys: pytest.CaptureFixture[str]) -> None:
    from talaria.cli import main
    from talaria.workload.scenarios import ROOT

    scenario = str(ROOT / "scenarios" / "1x30x3.toml")
    assert main(["paired", scenario, "--seeds", "1001,5"]) == 2
    assert "tuned the policies" in capsys.readouterr().err
    assert main(["paired", scenario, "--seeds", "5", "--policies", "nosuch"]) == 2


def test_paired_load_and_no_input_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from talaria.cli import main

    assert main(["paired"]) == 2
    assert "give scenario files" in capsys.readouterr().err
    assert main(["paired", "--load", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    for text in ("not json", '{"a": 1}', "[]"):
        (tmp_path / "bad.json").write_text(text)
        assert main(["paired", "--load", str(tmp_path / "bad.json")]) == 2
        assert "is not what `talaria paired --out` writes" in capsys.readouterr().err


@pytest.mark.parametrize("argv,fragment", [
    # a label the reference or a policy already has, or a second variant's, replaced that row silently
    (["--variant", "talaria=talaria:hold_factor=1.0"], "--variant label talaria is already talaria"),
    (["--variant", "baseline=talaria:hold_factor=1.0"], "--variant label baseline is already"),
    (["--variant", "q=talaria:hold_factor=1.0", "--variant", "q=talaria:hold_min_s=0"], "--variant label q is"),
    # nothing to pair: an empty table and exit 0
    (["--policies", "talaria"], "nothing to pair against talaria"),
])
def test_paired_refuses_what_would_replace_or_leave_no_row(argv: list[str], fragment: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from talaria.cli import main
    from talaria.workload.scenarios import ROOT

    assert main(["paired", str(ROOT / "scenarios" / "1x30x3.toml"), "--seeds", "5", "--policies", "baseline",
                 *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("talaria paired: error: ") and fragment in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv,fragment", [
    (["--seeds", "1001"], "seeds [1001] tuned the policies and cannot be scored"),  # as compare and paired
    (["--policies", "baseline,baseline"], "names baseline more than once"),
    (["--policies", ","], "names no policy"),
])
def test_bound_refuses_tuning_seeds_and_repeated_policies(argv: list[str], fragment: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from talaria.cli import main

    assert main(["bound", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("talaria bound: error: ") and fragment in err and err.count("\n") == 1, err


def test_bound_with_one_policy_is_a_whole_table(capsys: pytest.CaptureFixture[str]) -> None:
    from talaria.cli import main

    assert main(["bound", "--seeds", "2", "--policies", "talaria"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head, rule, row = lines[0], lines[1], lines[2]
    assert head.count("|") == rule.count("|") == row.count("|"), lines  # no empty column, no short row
    assert head.endswith("| largest p50 speedup over talaria |")
    assert lines[-1].startswith("_Median over seeds of the largest p50 speedup")


def test_the_capacity_relaxation_alone_is_never_below_zero() -> None:
    # sessions an hour apart with a second of work each: a_1 + W/S - mean(a) was -900 s
    b = sct_lower_bound([0.0, 3600.0], [1.0, 1.0], [1.0, 1.0])
    assert b.mean_capacity_s == 0.0 and b.p50_capacity_s == 0.0
    assert b.mean_s == b.mean_alone_s == 1.0
