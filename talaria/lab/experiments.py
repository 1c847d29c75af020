"""`talaria study`: tuning, seed spread, ablations and sensitivity on the simulator.

Fairness rules (docs/results.md states them):
- every policy is tuned by the same criterion (mean SCT) over the same number
  of configurations (the tuning budget), on the fleet of checked-in settings
  (the default generator settings on one server and the multi-server
  scenarios, TUNING_SCENARIOS) with seeds that are never scored (TUNE_SEEDS);
  one configuration per policy must serve them all;
- scored: the default trace (seed 0) and ten further seeds (SCORE_SEEDS);
- ablations start from tuned Talaria and remove one mechanism each.
All figures are model seconds from the sim engine's cost model.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from shared.catalog import load_catalog
from shared.policy import PRESETS, TUNED_PATH, PolicyConfig, resolve_policy
from talaria.workload.trace import TraceSession, load_trace
from talaria.argtypes import output_file, positive_float, positive_int, seed_list, write_output
from talaria.workload.generate import generate, load_settings
from talaria.results.report import summarize
from talaria.workload.scenarios import (  # scenarios define the tuning seeds: they refuse to score them
    DEFAULT_TRACE, ROOT, TUNE_SEEDS, load_scenario, run_policy, simulate_run, trace_of,
)

# paths from the checkout's root, so the commands work from any directory
DEFAULT_SETTINGS = str(ROOT / "traces" / "swebench-30.toml")
SCORE_SEEDS = tuple(range(1, 11))

# The same budget for each policy: 32 configurations.
GRIDS: dict[str, dict[str, list[Any]]] = {
    # under the drain rule the baseline's slot length has no effect (docs/scheduler.md): one point;
    # the preempt rule at 31 slot lengths from 10 s to 3,600 s
    "baseline": {"closing_slot": [("drain", 60.0)] + [("preempt", s) for s in (
        10.0, 12.0, 15.0, 18.0, 20.0, 24.0, 27.0, 30.0, 33.0, 36.0, 40.0, 45.0, 50.0, 60.0, 75.0, 90.0,
        105.0, 120.0, 150.0, 180.0, 240.0, 300.0, 360.0, 480.0, 600.0, 720.0, 960.0, 1200.0, 1440.0, 1920.0, 3600.0)]},
    # hold rule (hold_factor, hold_min_s, hold_max_s): 1.5 x the 0.9-quantile of the session's
    # gaps within [2, 30] s, or the 0.9-quantile itself within [0, 120] s; placement's weight of
    # round contention (per other model with work on a server). Idle holds for reservations
    # (idle_hold_max_s 2 s) lost on every setting in every earlier sweep (docs/results.md): fixed
    # at 0, their place in the budget taken by the contention weight
    "talaria": {"slot_s": [240.0, 480.0, 960.0, 1920.0], "idle_hold_max_s": [0.0], "w_contention": [4.0, 8.0],
                "next_model": ["round-robin", "most-waiting"], "hold": [(1.5, 2.0, 30.0), (1.0, 0.0, 120.0)]},
}
# Where a configuration is scored while tuning: the default settings on one server, and the
# multi-server scenarios (their generator settings, servers and profile), each on TUNE_SEEDS.
TUNING_SCENARIOS = ("scenarios/4x120x5.toml", "scenarios/16x1000x5.toml")


def traces_for(seeds: tuple[int, ...], settings_path: str = DEFAULT_SETTINGS, **overrides: Any) -> list[list[TraceSession]]:
    settings = load_settings(settings_path)
    if overrides:
        settings = msgspec.structs.replace(settings, **overrides)
    return [generate(settings, seed=s) for s in seeds]


def run_one(sessions: list[TraceSession], policy: PolicyConfig, **kw: Any) -> dict:
    """One policy on one trace of the default settings (one h100x8 server unless `kw` says otherwise)."""
    return simulate_run(sessions, load_catalog(), policy, **kw)


def _expand(ov: dict[str, Any]) -> dict[str, Any]:
    """Compound grid keys into policy fields."""
    ov = dict(ov)
    if "closing_slot" in ov:
        ov["closing"], ov["slot_s"] = ov.pop("closing_slot")
    if "hold" in ov:
        ov["hold_factor"], ov["hold_min_s"], ov["hold_max_s"] = ov.pop("hold")
    return ov


def _score_config(args: tuple[str, dict[str, Any], str]) -> dict[str, Any]:
    """One configuration on every tuning set: {set: mean criterion over its seeds}."""
    name, ov, criterion = args
    pol = resolve_policy(name, ov, tuned=False)
    per_set = {"1x30x3 (default settings)": statistics.fmean(run_one(t, pol)[criterion] for t in traces_for(TUNE_SEEDS))}
    for path in TUNING_SCENARIOS:
        sc = load_scenario(ROOT / path)
        per_set[sc.name] = statistics.fmean(run_policy(sc, trace_of(sc, seed), pol)[criterion] for seed in TUNE_SEEDS)
    return per_set


def tune(criterion: str = "sct_mean_s", progress: bool = True, jobs: int = 1) -> dict:
    """Grid search per policy; returns {policy: {"best": overrides, "sweep": [...]}}.
    A configuration's score is the mean over the tuning sets of its mean
    `criterion` there: each setting counts the same, whatever its size."""
    out: dict[str, dict] = {}
    for name, grid in GRIDS.items():
        keys = list(grid)
        configs = [_expand(dict(zip(keys, values))) for values in itertools.product(*(grid[k] for k in keys))]
        sweep = []
        with (multiprocessing.get_context("spawn").Pool(jobs) if jobs > 1 else contextlib.nullcontext()) as pool:
            args = [(name, ov, criterion) for ov in configs]
            results = pool.imap(_score_config, args) if pool is not None else map(_score_config, args)
            for ov, per_set in zip(configs, results):
                score = statistics.fmean(per_set.values())
                sweep.append({"overrides": ov, criterion: score, "per_set": per_set})
                if progress:
                    print(f"  tune {name} {ov}: {criterion} {score:.1f} "
                          f"({', '.join(f'{k} {v:.0f}' for k, v in per_set.items())})", file=sys.stderr)
        best = min(sweep, key=lambda x: x[criterion])
        out[name] = {"best": best["overrides"], "criterion": criterion, "budget": len(sweep), "sweep": sweep}
    return out


def write_tuned(result: dict, path: Path = TUNED_PATH) -> None:
    lines = ["# Tuned policy parameters, written by `talaria study tune` (see docs/results.md).",
             f"# Criterion: mean SCT over seeds {list(TUNE_SEEDS)} (never scored) of the default settings on one server and of",
             f"# {', '.join(TUNING_SCENARIOS)}, each setting weighted the same; the same budget of configurations per policy.", ""]
    for name, r in result.items():
        lines.append(f"[{name}]")
        for k, v in r["best"].items():
            lines.append(f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v}")
        lines.append("")
    path.write_text("\n".join(lines))


def spread(policies: list[str], seeds: tuple[int, ...] = SCORE_SEEDS, **kw: Any) -> dict[str, dict]:
    traces = traces_for(seeds)
    out = {}
    for name in policies:
        pol = resolve_policy(name)
        runs = [run_one(t, pol, **kw) for t in traces]
        out[name] = {k: [r[k] for r in runs] for k in ("sct_p50_s", "sct_p95_s", "sct_mean_s")}
    base = out.get("baseline")
    if base:
        for name, v in out.items():
            v["speedup_p50"] = [b / x for b, x in zip(base["sct_p50_s"], v["sct_p50_s"])]
            v["speedup_p95"] = [b / x for b, x in zip(base["sct_p95_s"], v["sct_p95_s"])]
    return out


def _med_range(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}, {max(xs):.2f}]" if max(xs) < 20 else f"{statistics.median(xs):.0f} [{min(xs):.0f}, {max(xs):.0f}]"


def table(runs: list[dict], base: dict | None = None) -> str:
    rows = ["| policy | p50 s | p95 s | mean s | speedup p50 | speedup p95 | p50 / oracle | utilisation | re-prefilled calls | switches | round waits | wait for round s | switch s | restore s |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = base or next((r for r in runs if r["policy"] == "baseline"), runs[0])
    for r in runs:
        b = r["time_breakdown_s"]
        n = len(r["sessions"])
        rows.append(f"| {r['policy']} | {r['sct_p50_s']:.0f} | {r['sct_p95_s']:.0f} | {r['sct_mean_s']:.0f} | "
                    f"{base['sct_p50_s'] / r['sct_p50_s']:.2f} | {base['sct_p95_s'] / r['sct_p95_s']:.2f} | "
                    f"{r['ratio_to_oracle_p50']:.2f} | {r['utilisation']:.2f} | {r['calls_reprefilled']} | {r['switches']} | "
                    f"{r['round_waits']} | {b['queue_for_round_s'] / n:.0f} | {b['model_switch_s'] / n:.0f} | {b['kv_restore_s'] / n:.1f} |")
    return "\n".join(rows)


# `study latency`: how the live control plane's delay moves Talaria, and whether an idle hold
# (the tuned policy has none) would make it steadier. Seeds 1001-1012 are one-server
# tuning seeds: a decision about the policy is taken on them, never on scored seeds.
LATENCIES_S = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3)
IDLE_HOLDS_S = (0.0, 0.3, 0.6, 1.0)
ROBUSTNESS_SEEDS = tuple(range(1001, 1013))


def latency_study() -> tuple[dict[str, Any], list[str]]:
    sessions = load_trace(DEFAULT_TRACE)
    tuning = traces_for(ROBUSTNESS_SEEDS)
    report: dict[str, Any] = {"latencies_s": LATENCIES_S, "idle_holds_s": IDLE_HOLDS_S, "default_trace": {}, "tuning_seeds": {}}
    header = ["| idle hold s | " + " | ".join(f"latency {x:g} s" for x in LATENCIES_S) + " |",
              "| ---: |" + " ---: |" * len(LATENCIES_S)]
    default_rows, tuning_rows = [], []
    n = len(IDLE_HOLDS_S) * len(LATENCIES_S) * (1 + len(tuning))
    print(f"study latency: {n} simulations ({len(IDLE_HOLDS_S)} idle holds x {len(LATENCIES_S)} latencies "
          f"x the default trace and {len(tuning)} tuning seeds) ...", file=sys.stderr, flush=True)
    for i, hold in enumerate(IDLE_HOLDS_S, 1):
        print(f"study latency: idle hold {hold:g} s ({i}/{len(IDLE_HOLDS_S)})", file=sys.stderr, flush=True)
        pol = resolve_policy("talaria", {"idle_hold_max_s": hold})
        runs = [run_one(sessions, pol, call_latency_s=lat) for lat in LATENCIES_S]
        means = [statistics.fmean(run_one(t, pol, call_latency_s=lat)["sct_mean_s"] for t in tuning) for lat in LATENCIES_S]
        report["default_trace"][str(hold)] = [{k: r[k] for k in ("sct_p50_s", "sct_p95_s", "sct_mean_s")} for r in runs]
        report["tuning_seeds"][str(hold)] = means
        default_rows.append(f"| {hold:g} | " + " | ".join(
            f"{r['sct_p50_s']:.0f} / {r['sct_p95_s']:.0f} / {r['sct_mean_s']:.0f}" for r in runs) + " |")
        tuning_rows.append(f"| {hold:g} | " + " | ".join(f"{m:.1f}" for m in means) + " |")
    md = ["### Talaria under the control plane's latency (`talaria sim --call-latency S`)\n",
          "Default trace, p50 / p95 / mean SCT (model s), by idle hold (the tuned policy: 0):\n",
          *header, *default_rows, "",
          f"Mean SCT (model s) over the one-server tuning seeds {ROBUSTNESS_SEEDS[0]}-{ROBUSTNESS_SEEDS[-1]}:\n",
          *header, *tuning_rows, ""]
    return report, md


def sharing_study() -> tuple[dict[str, Any], list[str]]:
    """What if the three models did not take turns? Each model's sessions on a
    share of the server of their own for the whole run, at 1/k of its prefill
    and decode speed: k = 1 is a server per model (three servers' capacity);
    k = 3 is the three models co-running on one server at a fair third each
    (a layout whose weights would not fit in HBM). Nobody waits for a round
    there: the time goes to sharing instead. A what-if on the cost model's
    figures, not a mechanism."""
    from talaria.results.report import percentile
    from talaria.sim.simulator import simulate

    sessions = load_trace(DEFAULT_TRACE)
    catalog = load_catalog()
    talaria = resolve_policy("talaria")
    rows: list[tuple[str, dict[str, float]]] = []
    turns = run_one(sessions, talaria)
    rows.append(("Talaria: the three models take turns on one server", turns))
    for k, label in ((1, "each model on a server of its own (three servers)"),
                     (3, "each model on a third of one server for the whole run (co-running, fair shares)")):
        sct: dict[str, float] = {}
        decode_s = 0.0
        for model in sorted({s.model for s in sessions}):
            mine = [s for s in sessions if s.model == model]
            res = simulate(mine, catalog, talaria, prefill_speed_scale=1 / k, decode_speed_scale=1 / k)
            sct.update(res.sct)
            decode_s += sum(r.decode_s for r in res.records)
        v = list(sct.values())
        rows.append((label, {"sct_p50_s": percentile(v, 50), "sct_p95_s": percentile(v, 95),
                             "sct_mean_s": statistics.fmean(v), "decode_per_session_s": decode_s / len(v)}))
    turns["decode_per_session_s"] = turns["time_breakdown_s"]["decode_s"] / len(sessions)
    md = ["### Taking turns against sharing the server (default trace, `talaria study sharing`)\n",
          "| layout | p50 s | p95 s | mean s | decode per session s |", "| --- | ---: | ---: | ---: | ---: |"]
    md += [f"| {label} | {r['sct_p50_s']:.0f} | {r['sct_p95_s']:.0f} | {r['sct_mean_s']:.0f} | {r['decode_per_session_s']:.0f} |"
           for label, r in rows]
    md.append("")
    report = {label: {k: r[k] for k in ("sct_p50_s", "sct_p95_s", "sct_mean_s", "decode_per_session_s")} for label, r in rows}
    return report, md


def cmd_study(a: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    report: dict[str, Any] = {}
    md: list[str] = []
    if a.what in ("tune", "all"):
        res = tune(a.criterion, jobs=a.jobs)
        report["tuning"] = res
        if a.criterion == "sct_mean_s" and a.write_tuned:
            write_tuned(res)
            print(f"tuned parameters written to {TUNED_PATH}", file=sys.stderr)
        md.append(f"### Tuning sweeps (criterion {a.criterion}, seeds {list(TUNE_SEEDS)})\n")
        for name, r in res.items():
            sets = list(r["sweep"][0]["per_set"])
            md.append(f"{name}: best {r['best']} (budget {r['budget']} configurations)\n")
            md.append("| " + " | ".join(list(r["best"]) + [f"{s} {a.criterion}" for s in sets] + [a.criterion]) + " |")
            md.append("|" + " --- |" * (len(r["best"]) + len(sets) + 1))
            for row in r["sweep"]:
                md.append("| " + " | ".join(str(v) for v in row["overrides"].values()) + " | "
                          + " | ".join(f"{row['per_set'][s]:.1f}" for s in sets) + f" | **{row[a.criterion]:.1f}** |")
            md.append("")
    if a.what in ("headline", "all"):
        sessions = load_trace(DEFAULT_TRACE)
        names = ["baseline", "talaria"] + [p for p in PRESETS if p.startswith("talaria-")]
        runs = [run_one(sessions, resolve_policy(n)) for n in names]
        report["headline"] = runs
        md.append("### Headline and ablations on the default trace\n")
        md.append(table(runs))
        md.append("")
        sp = spread(["baseline", "talaria"])
        report["seed_spread"] = sp
        md.append(f"### Seed spread (seeds {SCORE_SEEDS[0]}..{SCORE_SEEDS[-1]}): median [min, max]\n")
        md.append("| policy | p50 s | p95 s | mean s | speedup p50 | speedup p95 |")
        md.append("| --- | ---: | ---: | ---: | ---: | ---: |")
        for n, v in sp.items():
            md.append(f"| {n} | {_med_range(v['sct_p50_s'])} | {_med_range(v['sct_p95_s'])} | {_med_range(v['sct_mean_s'])} | "
                      f"{_med_range(v['speedup_p50'])} | {_med_range(v['speedup_p95'])} |")
        md.append("")
        md.append("### Sensitivity (default trace; speedup of talaria over baseline)\n")
        md.append("| case | baseline p50 s | talaria p50 s | speedup p50 | speedup p95 |")
        md.append("| --- | ---: | ---: | ---: | ---: |")
        cases: list[tuple[str, dict, dict]] = [
            ("as calibrated", {}, {}),
            ("model-switch cost x0.5", {"switch_cost_scale": 0.5}, {}),
            ("model-switch cost x2", {"switch_cost_scale": 2.0}, {}),
            ("prefill speed x0.5", {"prefill_speed_scale": 0.5}, {}),
            ("prefill speed x2", {"prefill_speed_scale": 2.0}, {}),
            ("arrival rate x0.5", {}, {"arrival_rate_per_s": 0.05}),
            ("arrival rate x2", {}, {"arrival_rate_per_s": 0.2}),
        ]
        sens = []
        for label, kw, gen_kw in cases:
            tr = traces_for((0,), **gen_kw)[0] if gen_kw else sessions
            b = run_one(tr, resolve_policy("baseline"), **kw)
            t = run_one(tr, resolve_policy("talaria"), **kw)
            sens.append({"case": label, "baseline": b, "talaria": t})
            md.append(f"| {label} | {b['sct_p50_s']:.0f} | {t['sct_p50_s']:.0f} | {b['sct_p50_s'] / t['sct_p50_s']:.2f} | {b['sct_p95_s'] / t['sct_p95_s']:.2f} |")
        report["sensitivity"] = [{"case": s["case"], "baseline_p50": s["baseline"]["sct_p50_s"], "talaria_p50": s["talaria"]["sct_p50_s"],
                                  "baseline_p95": s["baseline"]["sct_p95_s"], "talaria_p95": s["talaria"]["sct_p95_s"]} for s in sens]
        md.append("")
        md.append("### The other slot-closing rule, default trace (speedups against the tuned baseline)\n")
        # each policy under the closing rule it was *not* tuned with
        alt = []
        for n in ("baseline", "talaria"):
            other = "drain" if resolve_policy(n).closing == "preempt" else "preempt"
            r = run_one(sessions, resolve_policy(n, {"closing": other}))
            r["policy"] += f" ({other})"
            alt.append(r)
        md.append(table(alt, base=runs[0]))
        report["preempt_rule"] = alt
        md.append("")
    if a.what == "latency":
        report["latency"], lines = latency_study()
        md += lines
    if a.what == "sharing":
        report["sharing"], lines = sharing_study()
        md += lines
    md.append(f"_{time.perf_counter() - t0:.1f} s of wall time on this machine; every SCT in model seconds from the sim engine's cost model._")
    text = "\n".join(md)
    print(text)
    if a.out:
        write_output(a.out, json.dumps(report, indent=1, default=float))
    if a.markdown:
        write_output(a.markdown, text + "\n")
    return 0


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", choices=["tune", "headline", "all", "latency", "sharing"],
                   help="tune: sweep and pick parameters; headline: score the tuned policies; latency: Talaria under "
                        "the control plane's delay, with and without idle holds; sharing: taking turns against "
                        "each model on a share of the server (neither part of all)")
    p.add_argument("--criterion", default="sct_mean_s", choices=["sct_mean_s", "sct_p50_s", "sct_p95_s"],
                   help="what tuning minimises (default sct_mean_s, the mean session completion time)")
    p.add_argument("--write-tuned", action="store_true", help=f"write the tuned parameters to {TUNED_PATH}")
    p.add_argument("--out", type=output_file, help="JSON with every figure")
    p.add_argument("--markdown", type=output_file, help="write the tables as markdown here")
    p.add_argument("--jobs", type=positive_int, default=1, help="configurations scored in parallel while tuning (processes)")
    p.set_defaults(fn=cmd_study)



def fidelity_latency(arg: str) -> float | str:
    """`--call-latency`: model seconds (0 or more), or `measured`."""
    if arg == "measured":
        return arg
    try:
        v = float(arg)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of model seconds or 'measured': {arg!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of model seconds, 0 or more: {arg!r}")
    return v


FIGURES = ("sct_p50_s", "sct_p95_s", "sct_mean_s")


def cmd_fidelity(a: argparse.Namespace) -> int:
    """Live replay against the simulator on generated traces: per seed and policy,
    the median over `--runs` live runs of p50, p95 and mean SCT against the
    simulator's (given the control plane's delay on returns, `--call-latency`),
    and the median differences over seeds. The table's header is printed first and
    each row as its seed and policy finish (runs take minutes)."""
    import asyncio

    from talaria.replay import replay_embedded, write_json
    from talaria.results.hops import delay_summary, return_delays
    from talaria.sim.simulator import simulate
    from talaria.ops.stack import StackSpec

    if a.scenario:
        from talaria.workload.scenarios import ScenarioError

        try:
            sc = load_scenario(a.scenario)
        except ScenarioError as exc:
            print(f"talaria fidelity: {exc}", file=sys.stderr)
            return 2
        seeds = a.seeds or (sc.seeds[0],)
        traces = [trace_of(sc, seed) for seed in seeds]
        servers, profile = sc.servers, sc.server_profile
    else:
        seeds = a.seeds or (1, 2, 3, 4, 5)
        traces = traces_for(seeds)
        servers, profile = 1, "h100x8"
    rows = ["| seed | policy | live runs | return delay p50 / p90 s | worst loop lag s | sim call latency s | "
            "sim p50 s | live p50 s | sim p95 s | live p95 s | sim mean s | live mean s | diff p50 | diff p95 | diff mean |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    print("\n".join(rows), flush=True)
    diffs: dict[str, dict[str, list[float]]] = {}
    results: list[dict[str, Any]] = []
    for seed, sessions in zip(seeds, traces):
        for name in a.policy.split(","):
            pol = resolve_policy(name)
            lives: list[dict[str, Any]] = []
            delays: list[float] = []
            for run in range(a.runs):
                spec = StackSpec(policy=pol, models=sorted({x.model for x in sessions}), time_scale=a.time_scale,
                                 servers=servers, server_profile=profile,
                                 log_dir=Path(a.log_dir) / f"seed{seed}-{name}" / f"run{run + 1}")
                out = asyncio.run(replay_embedded(sessions, pol, spec))
                if out.failures:
                    print(f"seed {seed} {name}: {len(out.failures)} sessions failed", file=sys.stderr)
                    return 1
                run_delays = return_delays(Path(out.log_dir), sessions) if out.log_dir else []
                delays += run_delays
                live_run = summarize(name, sessions, out.sct, out.records)
                lives.append({**{k: live_run[k] for k in FIGURES}, "wall_s": out.wall_s,
                              "worst_loop_lag_model_s": out.worst_lag_model_s,
                              "worst_loop_lag_service": out.worst_lag_service, "loop_stalled_share": out.stalled_share,
                              "return_delay_model_s": delay_summary(run_delays), "log_dir": out.log_dir})
            hops = delay_summary(delays)
            latency = hops["p50_s"] if a.call_latency == "measured" else float(a.call_latency)
            simulated = simulate(sessions, load_catalog(), pol, servers=servers, server_profile=profile,
                                 call_latency_s=latency)
            sim = summarize(name, sessions, simulated.sct, simulated.records)
            live = {k: statistics.median(r[k] for r in lives) for k in FIGURES}
            d = {k: live[k] / sim[k] - 1 for k in FIGURES}
            for k, v in d.items():
                diffs.setdefault(name, {}).setdefault(k, []).append(v)
            lag = max(r["worst_loop_lag_model_s"] for r in lives)
            results.append({"seed": seed, "policy": name, "sim_call_latency_s": latency, "return_delay_model_s": hops,
                            "sim": {k: sim[k] for k in FIGURES}, "live_median": live, "live_runs": lives,
                            "difference": d})
            rows.append(f"| {seed} | {name} | {len(lives)} | {hops['p50_s']:.2f} / {hops['p90_s']:.2f} | {lag:.2f} | "
                        f"{latency:.2f} | {sim['sct_p50_s']:.0f} | {live['sct_p50_s']:.0f} | {sim['sct_p95_s']:.0f} | "
                        f"{live['sct_p95_s']:.0f} | {sim['sct_mean_s']:.0f} | {live['sct_mean_s']:.0f} | "
                        f"{d['sct_p50_s']:+.1%} | {d['sct_p95_s']:+.1%} | {d['sct_mean_s']:+.1%} |")
            print(rows[-1], flush=True)
    where = f"{a.scenario} ({servers} x {profile})" if a.scenario else "the default generator settings (1 x h100x8)"
    summary = ["", f"_Live: median of {a.runs} run(s) per seed and policy at {a.time_scale:g}x; return delay: model s "
               "between a reply at the engine and the next call at admission beyond the tool gap, over every return of "
               f"those runs; {where}; model seconds from the sim engine's cost model._", ""]
    for name, dd in diffs.items():
        summary.append(f"- {name}: median difference over seeds {list(seeds)}: p50 {statistics.median(dd['sct_p50_s']):+.1%}, "
                       f"p95 {statistics.median(dd['sct_p95_s']):+.1%}, mean {statistics.median(dd['sct_mean_s']):+.1%}")
    print("\n".join(summary))  # the rows are out already: once each
    text = "\n".join(rows + summary)
    if a.markdown:
        write_output(a.markdown, text + "\n")
    if a.out:
        write_json(a.out, {"scenario": a.scenario, "servers": servers, "server_profile": profile,
                           "time_scale": a.time_scale, "runs": a.runs, "results": results})
    return 0


def configure_fidelity(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", type=seed_list, default=None,
                   help="generator seeds (1-5, 1,2,3 or both; default 1,2,3,4,5, or a scenario's first seed)")
    p.add_argument("--scenario", help="a scenario file (scenarios/*.toml): its generator settings, servers and "
                                      "server profile instead of the default settings on one server")
    p.add_argument("--policy", default="baseline,talaria", help="comma-separated policies (default baseline,talaria)")
    p.add_argument("--runs", type=positive_int, default=1,
                   help="live runs per seed and policy; the table's live figures are their median (default 1)")
    p.add_argument("--call-latency", type=fidelity_latency, default=0.0, metavar="S|measured",
                   help="the simulator's call latency in model s (talaria sim --call-latency), or `measured`: the "
                        "median return delay of the seed and policy's live runs (default 0)")
    p.add_argument("--time-scale", type=positive_float, default=50.0, help="model seconds per wall second of the live replays (default 50)")
    p.add_argument("--log-dir", default=".talaria/fidelity", help="log folder, one sub-folder per seed, policy and run")
    p.add_argument("--markdown", type=output_file, help="write the table here")
    p.add_argument("--out", type=output_file, help="write every run's figures as JSON here")
    p.set_defaults(fn=cmd_fidelity)
