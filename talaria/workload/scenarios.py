"""Scenarios, `talaria compare` and `talaria bench-sim`.

A scenario file (TOML, `scenarios/*.toml`) makes a comparison reproducible from
one file: the trace generator's settings (`[trace]`, every knob of
`talaria.workload.generate.GeneratorSettings`), the catalog and server profile, the
number of servers, the policies and the seeds. `talaria compare SCENARIO` runs
every policy over every seed on the simulator (the services' own policy code on
a virtual clock) and prints one table: p50 and p95 SCT (median [min, max] over
seeds), the ratio to the oracle and the speedup over the baseline.

    talaria compare scenarios/4x120x5.toml --out results.json --markdown table.md
    talaria bench-sim

All figures are model seconds from the sim engine's cost model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from shared.catalog import Catalog, CatalogError, check_fit, load_catalog
from shared.policy import PolicyConfig, PolicyError, resolve_policy
from talaria.workload.trace import TraceSession
from talaria.workload.tomlfile import load_toml_struct
from talaria.workload.agent import DEFAULT_MAX_TOKENS
from talaria.argtypes import output_file, positive_float, positive_int, seed_list, write_output
from talaria.workload.generate import GeneratorSettings, ServerCount, SettingsError, check_settings, generate
from talaria.results.report import oracle_sct, summarize

if TYPE_CHECKING:
    from talaria.sim.simulator import SimResult

ROOT = Path(__file__).resolve().parents[2]  # the checkout: traces/, scenarios/
TUNE_SEEDS = (1001, 1002, 1003)  # the seeds `talaria study tune` tunes on (talaria/lab/experiments.py): never scored
BENCH_SCENARIO = ROOT / "scenarios" / "bench-16x3000x5.toml"
DEFAULT_TRACE = ROOT / "traces" / "swebench-30.jsonl"

Pos = Annotated[int, msgspec.Meta(ge=1)]


class ScenarioError(ValueError):
    """A scenario file is unreadable or inconsistent (the message names the file and the field)."""


class Scenario(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: str
    description: str = ""
    servers: ServerCount = 1
    server_profile: str = "h100x8"
    catalog: str = ""  # path to a catalog TOML (relative to the scenario's folder); "" = shared/data/catalog.toml
    policies: list[str] = msgspec.field(default_factory=lambda: ["baseline", "talaria"])
    seeds: list[int] = msgspec.field(default_factory=lambda: [0])
    max_tokens: Pos = DEFAULT_MAX_TOKENS
    trace: GeneratorSettings = msgspec.field(default_factory=GeneratorSettings)


def _catalog_path(sc: Scenario) -> Path | None:
    return Path(sc.catalog) if sc.catalog else None  # (made absolute by load_scenario)


def _resolve_catalog(catalog: str, scenario: Path) -> str:
    """A relative `catalog` from the scenario's own folder, as a file names its neighbours (it
    was read from the repository's, so a scenario beside its catalog could not find it), else
    from the repository's where only that holds it (files written when that was the rule)."""
    p = Path(catalog)
    if p.is_absolute():
        return catalog
    beside = scenario.resolve().parent / p
    return str(ROOT / p if not beside.exists() and (ROOT / p).exists() else beside)


def scenario_catalog(sc: Scenario) -> Catalog:
    """The catalog a scenario runs on: its own `catalog`, or shared/data/catalog.toml."""
    return load_catalog(_catalog_path(sc))


def tuned_on(seeds: list[int]) -> str | None:
    """What is wrong with scoring `seeds`, where some were used to tune the policies (else None)."""
    tuned = sorted(set(seeds) & set(TUNE_SEEDS))
    return f"{tuned} were used to tune the policies and cannot be scored" if tuned else None


def load_scenario(path: str | Path) -> Scenario:
    p = Path(path)
    sc = load_toml_struct(p, Scenario, ScenarioError, "scenario",
                          other=(GeneratorSettings, "a trace generator's settings (talaria generate --settings)"))
    if sc.catalog:
        sc = msgspec.structs.replace(sc, catalog=_resolve_catalog(sc.catalog, p))
    problems: list[str] = []
    try:
        cat: Catalog | None = load_catalog(_catalog_path(sc))
    except (CatalogError, OSError) as exc:
        cat = None
        problems.append(f"catalog: {exc}")
    if cat is not None:
        # the generator's checks on the scenario's own catalog: its models' names and contexts
        try:
            check_settings(sc.trace, cat)
        except SettingsError as exc:
            problems.append(f"trace: {exc}")
        try:
            server = cat.server(sc.server_profile)
            if sc.trace.models:  # (none is the trace's problem, said above)
                check_fit(server, [cat.model(m) for m in sc.trace.models])
        except CatalogError as exc:
            problems.append(f"catalog: {exc}")
    if not sc.policies:
        problems.append("policies must name at least one policy")
    if len(set(sc.policies)) != len(sc.policies):
        problems.append(f"policies has duplicates: {sc.policies}")
    for name in sc.policies:
        try:
            resolve_policy(name)
        except PolicyError as exc:
            problems.append(f"policies: {exc}")
    if not sc.seeds:
        problems.append("seeds must name at least one seed")
    if any(seed < 0 for seed in sc.seeds):  # (as --seeds takes them)
        problems.append(f"seeds must be 0 or more: {sc.seeds}")
    if len(set(sc.seeds)) != len(sc.seeds):
        problems.append(f"seeds has duplicates: {sc.seeds}")
    if (tuned := tuned_on(sc.seeds)) is not None:
        problems.append(f"seeds {tuned}")
    if problems:
        raise ScenarioError(f"{p}: " + "; ".join(problems))
    return sc


# -- running -----------------------------------------------------------------------
def trace_of(sc: Scenario, seed: int) -> list[TraceSession]:
    return generate(sc.trace, seed=seed, catalog=scenario_catalog(sc))


def simulate_run(sessions: list[TraceSession], catalog: Catalog, policy: PolicyConfig, *,
                 server_profile: str = "h100x8", **kw: Any) -> dict:
    """Simulate one policy on a trace and summarise it as a run of the results
    JSON (the replay's shape, plus the simulator's own figures)."""
    from talaria.sim.simulator import simulate

    r = simulate(sessions, catalog, policy, server_profile=server_profile, **kw)
    oracle = oracle_sct(sessions, catalog, server_profile, kw.get("max_tokens", DEFAULT_MAX_TOKENS))  # as the run caps
    return sim_summary(policy.name, sessions, r, oracle)


def sim_summary(name: str, sessions: list[TraceSession], r: SimResult, oracle: dict[str, float]) -> dict:
    """A simulated run as a run of the results JSON: the replay's shape plus the simulator's own figures."""
    return summarize(name, sessions, r.sct, r.records, oracle, extra={
        "wall_s": r.wall_s, "switches": r.stats["switches"], "sp_admits": r.stats["sp_admits"],
        # the share of the run (until its last session ends) each server had a call running
        "utilisation": sum(s["busy_s"] for s in r.servers) / (r.horizon_s * len(r.servers)) if r.horizon_s else 0.0,
        "reservations": {k: r.stats[k] for k in ("reservations_made", "reservations_hit", "reservations_expired", "reserved_idle_s")},
        "kv_bytes_to_host": r.stats["kv_bytes_to_host"], "region_reservations": r.stats["region_reservations"],
    })


def run_policy(sc: Scenario, sessions: list[TraceSession], policy: str | PolicyConfig, *, check: bool = False) -> dict:
    """One policy (a name, with its tuned parameters, or a configuration) on one of the scenario's traces."""
    pol = resolve_policy(policy) if isinstance(policy, str) else policy
    run = simulate_run(sessions, scenario_catalog(sc), pol, servers=sc.servers,
                       server_profile=sc.server_profile, max_tokens=sc.max_tokens, check_invariants=check)
    run.pop("sessions")  # per-session SCTs: large for big scenarios and not needed by the table
    return run


def _job(args: tuple[str, int, str, bool]) -> tuple[int, str, dict]:
    path, seed, policy_name, check = args
    sc = load_scenario(path)
    return seed, policy_name, run_policy(sc, trace_of(sc, seed), policy_name, check=check)


def compare(path: str | Path, *, jobs: int = 1, check: bool = False, progress: bool = True,
            seeds: list[int] | None = None) -> dict:
    """`seeds`: run these instead of the scenario's own."""
    sc = load_scenario(path)
    if seeds is not None:
        if (tuned := tuned_on(seeds)) is not None:  # (as a scenario's own seeds are refused)
            raise ScenarioError(f"--seeds: {tuned}")
        sc = msgspec.structs.replace(sc, seeds=list(seeds))
    work = [(str(path), seed, name, check) for seed in sc.seeds for name in sc.policies]
    results: dict[tuple[int, str], dict] = {}
    t0 = time.perf_counter()
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as ex:
            for seed, name, run in ex.map(_job, work):
                results[(seed, name)] = run
                if progress:
                    print(f"  [{sc.name}] seed {seed} {name}: p50 {run['sct_p50_s']:.0f} s, "
                          f"p95 {run['sct_p95_s']:.0f} s ({run['wall_s']:.1f} s wall)", file=sys.stderr)
    else:
        for seed in sc.seeds:
            sessions = trace_of(sc, seed)
            for name in sc.policies:
                run = run_policy(sc, sessions, name, check=check)
                results[(seed, name)] = run
                if progress:
                    print(f"  [{sc.name}] seed {seed} {name}: p50 {run['sct_p50_s']:.0f} s, "
                          f"p95 {run['sct_p95_s']:.0f} s ({run['wall_s']:.1f} s wall)", file=sys.stderr)
    policies: dict[str, dict] = {}
    for name in sc.policies:
        runs = [results[(seed, name)] for seed in sc.seeds]
        v: dict[str, Any] = {k: [r[k] for r in runs] for k in (
            "sct_p50_s", "sct_p95_s", "sct_mean_s", "ratio_to_oracle_p50", "ratio_to_oracle_p95",
            "calls_completed", "calls_total", "switches", "wall_s")}
        if "baseline" in sc.policies:
            base = [results[(seed, "baseline")] for seed in sc.seeds]
            v["speedup_p50"] = [b["sct_p50_s"] / r["sct_p50_s"] for b, r in zip(base, runs)]
            v["speedup_p95"] = [b["sct_p95_s"] / r["sct_p95_s"] for b, r in zip(base, runs)]
        policies[name] = v
    return {"scenario": msgspec.to_builtins(sc), "path": str(path), "wall_s": time.perf_counter() - t0,
            "policies": policies,
            "runs": [{"seed": seed, **results[(seed, name)]} for seed in sc.seeds for name in sc.policies]}


def _mr(xs: list[float], digits: int = 0) -> str:
    med = statistics.median(xs)
    if len(xs) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{min(xs):.{digits}f}, {max(xs):.{digits}f}]"


def markdown_table(result: dict) -> str:
    sc = result["scenario"]
    pols = result["policies"]
    has_base = "baseline" in pols
    head = ["policy", "p50 SCT s", "p95 SCT s", "p50 / oracle", "p95 / oracle"]
    if has_base:
        head += ["speedup p50", "speedup p95"]
    head += ["calls completed"]
    rows = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for name, v in pols.items():
        cells = [name, _mr(v["sct_p50_s"]), _mr(v["sct_p95_s"]), _mr(v["ratio_to_oracle_p50"], 2),
                 _mr(v["ratio_to_oracle_p95"], 2)]
        if has_base:
            cells += [_mr(v["speedup_p50"], 2), _mr(v["speedup_p95"], 2)]
        done, total = sum(v["calls_completed"]), sum(v["calls_total"])
        cells.append(f"{done}/{total}")
        rows.append("| " + " | ".join(cells) + " |")
    calls = result["runs"][0]["calls_total"] if result["runs"] else 0
    rows.append("")
    rows.append(f"_{sc['name']}: {sc['servers']} x {sc['server_profile']}, {sc['trace']['sessions']} sessions "
                f"({calls} calls per seed), {len(sc['trace']['models'])} models, gaps {sc['trace']['tool_gap_style']}; "
                f"seeds {sc['seeds']}; median [min, max] over seeds; model seconds; "
                f"{result['wall_s']:.0f} s of wall time._")
    return "\n".join(rows)


def cmd_compare(a: argparse.Namespace) -> int:
    try:
        result = compare(a.scenario, jobs=a.jobs, check=a.check, seeds=a.seeds)
    except ScenarioError as exc:
        print(f"talaria compare: error: {exc}", file=sys.stderr)
        return 2
    text = markdown_table(result)
    print(text)
    if a.out:
        write_output(a.out, json.dumps(result, indent=1, default=float))
        print(f"results written to {a.out}")
    if a.markdown:
        write_output(a.markdown, text + "\n")
        print(f"table written to {a.markdown}")
    incomplete = [n for n, v in result["policies"].items() if sum(v["calls_completed"]) != sum(v["calls_total"])]
    if incomplete:
        print(f"talaria compare: error: calls did not complete under {incomplete}", file=sys.stderr)
        return 1
    return 0


def configure_compare(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", help="scenario file (TOML), e.g. scenarios/4x120x5.toml")
    p.add_argument("--out", type=output_file, help="JSON with every run's figures")
    p.add_argument("--markdown", type=output_file, help="write the table as markdown here")
    p.add_argument("--jobs", type=positive_int, default=1, help="simulations in parallel (processes; default 1)")
    p.add_argument("--check", action="store_true", help="check memory and KV bounds at every event")
    p.add_argument("--seeds", type=seed_list, default=None,
                   help="trace seeds to run instead of the scenario's own, e.g. 1,2,3 or 2001-2020")
    p.set_defaults(fn=cmd_compare)


# -- bench-sim ---------------------------------------------------------------------
def cmd_bench(a: argparse.Namespace) -> int:
    ok = True
    exe = Path(sys.executable).with_name("talaria")
    cmd = [str(exe), "sim", str(DEFAULT_TRACE), "--policy", a.policy]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=os.environ | {"PYTHONHASHSEED": "0"})
    default_wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print(proc.stderr, file=sys.stderr)
        return 1
    inner = next((line.split()[1] for line in proc.stdout.splitlines() if line.startswith("wall_s ")), "?")
    good = default_wall < a.default_limit_s
    ok &= good
    print(f"talaria sim {DEFAULT_TRACE.relative_to(ROOT)} --policy {a.policy}: {default_wall:.2f} s wall for the "
          f"whole command (simulation alone {inner} s); limit {a.default_limit_s:.0f} s: {'ok' if good else 'OVER'}")
    try:
        sc = load_scenario(a.scenario)
    except ScenarioError as exc:
        print(f"talaria bench-sim: error: {exc}", file=sys.stderr)
        return 2
    from talaria.sim.simulator import simulate

    t0 = time.perf_counter()
    sessions = trace_of(sc, sc.seeds[0])
    gen_s = time.perf_counter() - t0
    calls = sum(len(s.calls) for s in sessions)
    catalog = load_catalog(_catalog_path(sc))
    for name in a.big_policy.split(","):
        t1 = time.perf_counter()
        r = simulate(sessions, catalog, resolve_policy(name), servers=sc.servers, server_profile=sc.server_profile,
                     max_tokens=sc.max_tokens)
        sim_s = time.perf_counter() - t1
        done = sum(1 for x in r.records if x.finished_at > 0)
        total = gen_s + sim_s
        good = total < a.big_limit_s and done == calls
        ok &= good
        print(f"{sc.name} ({len(sessions)} sessions, {calls} calls, {sc.servers} servers) --policy {name}: "
              f"{total:.1f} s wall (generate {gen_s:.1f} s + simulate {sim_s:.1f} s), {done}/{calls} calls completed; "
              f"limit {a.big_limit_s:.0f} s: {'ok' if good else 'OVER'}")
    return 0 if ok else 1


def configure_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="talaria", help="policy for the default-trace run (default talaria)")
    p.add_argument("--scenario", default=str(BENCH_SCENARIO), help="the ~100,000-call scenario")
    p.add_argument("--big-policy", default="talaria", help="comma-separated policies for the big run (default talaria)")
    p.add_argument("--default-limit-s", type=positive_float, default=5.0, help="fail when the default trace takes longer (wall s, default 5)")
    p.add_argument("--big-limit-s", type=positive_float, default=120.0, help="fail when the ~100,000-call run takes longer (wall s, default 120)")
    p.set_defaults(fn=cmd_bench)
