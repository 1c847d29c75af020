"""`talaria paired` and `talaria bound`: paired comparisons over seeds, and the SCT lower bound.

    talaria paired scenarios/1x30x3.toml scenarios/4x120x5.toml --seeds 2001-2020 --out paired.json
    talaria bound --seeds 1-10

`paired` runs every policy on the same trace per seed (the scenario's
generator, servers and profile; the seeds given here, never the tuning
seeds), and prints, per setting and policy, the median over seeds of
(Talaria - policy) / policy for p50 and p95 SCT with a 95% bootstrap
interval (talaria/results/paired.py). `bound` prints the lower bound on mean
and p50 SCT (talaria/results/bound.py) beside Talaria's and the baseline's
figures. Model seconds from the sim engine's cost model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from shared.catalog import load_catalog
from shared.policy import PolicyError, policy_overrides, resolve_policy
from talaria.argtypes import output_file, positive_int, seed_list, write_output
from talaria.results.bound import trace_bound
from talaria.results.paired import Paired, meets, paired
from talaria.workload.scenarios import (
    ROOT, TUNE_SEEDS, ScenarioError, _catalog_path, load_scenario, run_policy, trace_of,
)

REFERENCE = "talaria"
PEER_POLICIES = ("baseline", "least-loaded", "session-affinity", "kv-overlap", "cache-aware", "kv-ttl")
METRICS = ("sct_p50_s", "sct_p95_s")
DEFAULT_SETTINGS_SCENARIO = ROOT / "scenarios" / "1x30x3.toml"


Variants = dict[str, tuple[str, dict[str, Any]]]  # label -> (preset, field overrides)


def variant(text: str) -> tuple[str, tuple[str, dict[str, Any]]]:
    """`LABEL=PRESET:field=value,field=value`: a preset with its tuned parameters and these changed."""
    label, _, rest = text.partition("=")
    base, _, fields = rest.partition(":")
    try:
        overrides: dict[str, Any] = policy_overrides(fields)
        resolve_policy(base, overrides)
    except (PolicyError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"bad variant {text!r}: {exc}") from None
    if not label or not base:
        raise argparse.ArgumentTypeError(f"bad variant {text!r}: want LABEL=PRESET:field=value,...")
    return label, (base, overrides)


def _resolve(name: str, variants: Variants) -> Any:
    if name in variants:
        base, overrides = variants[name]
        return msgspec.structs.replace(resolve_policy(base, overrides), name=name)
    return resolve_policy(name)


def _seed_job(args: tuple[str, int, tuple[str, ...], Variants]) -> tuple[str, int, dict[str, dict[str, float]]]:
    path, seed, policies, variants = args
    sc = load_scenario(path)
    sessions = trace_of(sc, seed)
    figures = {}
    for name in policies:
        run = run_policy(sc, sessions, _resolve(name, variants))
        if run["calls_completed"] != run["calls_total"]:
            raise RuntimeError(f"{sc.name} seed {seed} {name}: {run['calls_completed']}/{run['calls_total']} calls completed")
        figures[name] = {k: run[k] for k in (*METRICS, "sct_mean_s")}
    return path, seed, figures


def run_paired(paths: list[str], seeds: tuple[int, ...], policies: tuple[str, ...], *, jobs: int = 1,
               variants: Variants | None = None, progress: bool = True) -> dict[str, Any]:
    """Every policy on every (setting, seed): the raw figures the table is computed from."""
    work = [(p, s, policies, variants or {}) for p in paths for s in seeds]
    runs: dict[str, dict[str, dict[str, dict[str, float]]]] = {p: {} for p in paths}
    t0 = time.perf_counter()

    def keep(path: str, seed: int, figures: dict[str, dict[str, float]]) -> None:
        runs[path][str(seed)] = figures
        if progress:
            ref = figures.get(REFERENCE, {})
            print(f"  [{Path(path).stem}] seed {seed}: talaria p50 {ref.get('sct_p50_s', float('nan')):.0f} s "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as ex:
            for item in ex.map(_seed_job, work):
                keep(*item)
    else:
        for w in work:
            keep(*_seed_job(w))
    return {"seeds": list(seeds), "policies": list(policies), "reference": REFERENCE,
            "variants": {k: {"preset": b, "overrides": o} for k, (b, o) in (variants or {}).items()},
            "runs": runs, "wall_s": time.perf_counter() - t0}


def paired_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per setting and policy, the paired figures against the reference."""
    rows = []
    ref = result["reference"]
    for path, by_seed in result["runs"].items():
        seeds = sorted(by_seed, key=int)
        for name in result["policies"]:
            if name == ref or any(name not in by_seed[s] for s in seeds):
                continue  # a merged table: not every setting ran every policy
            row: dict[str, Any] = {"setting": Path(path).stem, "policy": name, "seeds": [int(s) for s in seeds]}
            for m in METRICS:
                row[m] = paired([by_seed[s][ref][m] for s in seeds], [by_seed[s][name][m] for s in seeds])
            row["met"] = all(meets(row[m]) for m in METRICS)
            rows.append(row)
    return rows


FEW_SEEDS = 5  # below this many seeds a row's bootstrap interval is flagged as saying little


def _pct(p: Paired) -> str:
    return f"{100 * p.median:+.1f}% [{100 * p.low:+.1f}, {100 * p.high:+.1f}]"


def markdown(result: dict[str, Any]) -> str:
    head = ["setting", f"{result['reference']} against", "seeds", "p50 difference", "p95 difference", "target met"]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- | ---: | ---: | ---: | --- |"]
    for r in paired_rows(result):
        lines.append(f"| {r['setting']} | {r['policy']} | {_seeds_text(r['seeds'])} | {_pct(r['sct_p50_s'])} | "
                     f"{_pct(r['sct_p95_s'])} | {'yes' if r['met'] else 'no'} |")
    lines.append("")
    lines.append(f"_Median over the row's seeds of ({result['reference']} - policy) / policy "
                 f"per seed, [95% percentile-bootstrap interval over seeds]; negative: {result['reference']} faster. "
                 f"Target: median <= 0 and upper end <= +1%. Model seconds from the sim engine's cost model; "
                 f"{result['wall_s']:.0f} s of wall time._")
    few = min((len(r["seeds"]) for r in paired_rows(result)), default=FEW_SEEDS)
    if few < FEW_SEEDS:
        lines.append(f"_A row over {few} seed(s): an interval over fewer than {FEW_SEEDS} says little "
                     "(the tables in docs/results.md use 20 or more)._")
    return "\n".join(lines)


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' JSON as one table (e.g. a big setting run on fewer seeds apart)."""
    if len({r["reference"] for r in results}) != 1:
        raise ValueError("the results pair against different references")
    out: dict[str, Any] = {"reference": results[0]["reference"], "policies": [], "seeds": [], "runs": {},
                           "variants": {}, "wall_s": sum(r["wall_s"] for r in results)}
    for r in results:
        out["policies"] = list(dict.fromkeys([*out["policies"], *r["policies"]]))
        out["seeds"] = sorted(set(out["seeds"]) | set(r["seeds"]))
        out["variants"] |= r.get("variants", {})
        for path, by_seed in r["runs"].items():
            for seed, figures in by_seed.items():
                out["runs"].setdefault(path, {}).setdefault(seed, {}).update(figures)
    return out


def _seeds_text(seeds: list[int]) -> str:
    s = sorted(seeds)
    if len(s) > 1 and s == list(range(s[0], s[-1] + 1)):
        return f"{s[0]}-{s[-1]}"
    return ",".join(map(str, s))


def tuning_table(result: dict[str, Any]) -> str:
    """The tuning view (for choosing a rule, never for scoring it): per setting and
    policy, the mean over seeds of mean, p50 and p95 SCT."""
    lines = ["| setting | policy | mean SCT s | p50 SCT s | p95 SCT s |", "| --- | --- | ---: | ---: | ---: |"]
    for path, by_seed in result["runs"].items():
        for name in result["policies"]:
            cells = [statistics.fmean(by_seed[s][name][k] for s in by_seed) for k in ("sct_mean_s", *METRICS)]
            lines.append(f"| {Path(path).stem} | {name} | " + " | ".join(f"{v:.1f}" for v in cells) + " |")
    lines.append("")
    lines.append(f"_Tuning seeds {_seeds_text(result['seeds'])} (never scored): mean over seeds; "
                 f"model seconds from the sim engine's cost model._")
    return "\n".join(lines)


def cmd_paired(a: argparse.Namespace) -> int:
    if a.tuning:
        a.seeds = TUNE_SEEDS
    if a.load:
        try:
            result = merge([json.loads(Path(f).read_text()) for f in a.load])
            text = tuning_table(result) if a.tuning else markdown(result)
        except OSError as exc:
            print(f"talaria paired: error: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
            return 2
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            print(f"talaria paired: error: {' '.join(a.load)} is not what `talaria paired --out` writes "
                  f"({type(exc).__name__}: {exc})", file=sys.stderr)
            return 2
    elif not a.scenarios:
        print("talaria paired: error: give scenario files to run, or --load JSONs written by --out", file=sys.stderr)
        return 2
    else:
        tuned_on = sorted(set(a.seeds) & set(TUNE_SEEDS))
        if tuned_on and not a.tuning:
            print(f"talaria paired: error: seeds {tuned_on} tuned the policies and cannot be scored", file=sys.stderr)
            return 2
        named = [n.strip() for n in a.policies.split(",") if n.strip()]
        labels = [label for label, _ in a.variant or []]
        # a label that is the reference, a policy or another label replaced that one's row
        clash = sorted({x for x in labels if x == REFERENCE or x in named or labels.count(x) > 1})
        if clash:
            print(f"talaria paired: error: --variant label {', '.join(clash)} is already {REFERENCE} (the reference), "
                  f"a policy of --policies or another variant's label: give each variant a label of its own",
                  file=sys.stderr)
            return 2
        variants = dict(a.variant or [])
        policies = tuple(dict.fromkeys([REFERENCE, *named, *variants]))
        if len(policies) == 1 and not a.tuning:  # (the tuning view lists the reference's own figures)
            print(f"talaria paired: error: nothing to pair against {REFERENCE}: name another policy in --policies "
                  f"or add a --variant", file=sys.stderr)
            return 2
        try:
            for name in policies:
                _resolve(name, variants)
            for path in a.scenarios:
                load_scenario(path)
        except (PolicyError, ScenarioError) as exc:
            print(f"talaria paired: error: {exc}", file=sys.stderr)
            return 2
        result = run_paired(a.scenarios, a.seeds, policies, jobs=a.jobs, variants=variants)
        text = tuning_table(result) if a.tuning else markdown(result)
    print(text)
    if a.out:
        write_output(a.out, json.dumps(result, indent=1))
        print(f"results written to {a.out}")
    return 0


def configure_paired(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenarios", nargs="*", help="scenario files (TOML): their generator, servers and profile")
    p.add_argument("--seeds", type=seed_list, default=seed_list("2001-2020"),
                   help="seeds to score, e.g. 2001-2020 (default; never the tuning seeds)")
    p.add_argument("--policies", default=",".join(PEER_POLICIES),
                   help=f"comma-separated policies to pair against {REFERENCE} (default: {','.join(PEER_POLICIES)})")
    p.add_argument("--variant", type=variant, action="append",
                   help="also pair a variant: LABEL=PRESET:field=value,... (repeatable), e.g. "
                        "short-hold=talaria:hold_factor=1.0,hold_min_s=0")
    p.add_argument("--tuning", action="store_true",
                   help=f"run on the tuning seeds {','.join(map(str, TUNE_SEEDS))} and print each policy's mean, "
                        "p50 and p95 there (for choosing a rule, never for scoring it)")
    p.add_argument("--jobs", type=positive_int, default=1, help="seeds in parallel (processes; default 1)")
    p.add_argument("--out", type=output_file, help="write every run's figures as JSON (re-print with --load)")
    p.add_argument("--load", nargs="+", help="print the table from JSONs written by --out (merged) instead of running")
    p.set_defaults(fn=cmd_paired)


# -- bound -------------------------------------------------------------------------
def bound_table(path: str, seeds: tuple[int, ...], policies: tuple[str, ...]) -> str:
    sc = load_scenario(path)
    catalog = load_catalog(_catalog_path(sc))
    head = ["seed", "bound mean s", "bound p50 s", "(alone / capacity: mean, p50)"]
    for name in policies:
        head += [f"{name} mean s", f"{name} p50 s"]
    head.append(f"largest p50 speedup over {policies[0]}")
    lines = ["| " + " | ".join(head) + " |", "| ---: " * len(head) + "|"]
    best: list[float] = []
    speedups: dict[str, list[float]] = {name: [] for name in policies[1:]}
    for seed in seeds:
        sessions = trace_of(sc, seed)
        b = trace_bound(sessions, catalog, servers=sc.servers, server_profile=sc.server_profile, max_tokens=sc.max_tokens)
        cells = [str(seed), f"{b.mean_s:.0f}", f"{b.p50_s:.0f}",
                 f"{b.mean_alone_s:.0f} / {b.mean_capacity_s:.0f}, {b.p50_alone_s:.0f} / {b.p50_capacity_s:.0f}"]
        runs = [run_policy(sc, sessions, name) for name in policies]
        for r in runs:
            cells += [f"{r['sct_mean_s']:.0f}", f"{r['sct_p50_s']:.0f}"]
        for name, r in zip(policies[1:], runs[1:]):
            speedups[name].append(runs[0]["sct_p50_s"] / r["sct_p50_s"])
        # (with one policy too: its own p50 against the bound; the column was left empty)
        best.append(runs[0]["sct_p50_s"] / b.p50_s)
        cells.append(f"{best[-1]:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    measured = ("; measured: " + ", ".join(f"{n} {statistics.median(v):.2f}x" for n, v in speedups.items())
                if speedups else "")
    lines.append(f"_Median over seeds of the largest p50 speedup any policy could have over {policies[0]} "
                 f"(its p50 / the bound): {statistics.median(best):.2f}x{measured}. "
                 f"{sc.name}: {sc.servers} x {sc.server_profile}; alone / capacity: each relaxation on its own "
                 f"(capacity at least 0); model seconds from the sim engine's cost model._")
    return "\n".join(lines)


def cmd_bound(a: argparse.Namespace) -> int:
    tuned_on = sorted(set(a.seeds) & set(TUNE_SEEDS))
    if tuned_on:  # as `compare` and `paired` refuse them
        print(f"talaria bound: error: seeds {tuned_on} tuned the policies and cannot be scored", file=sys.stderr)
        return 2
    policies = tuple(n.strip() for n in a.policies.split(",") if n.strip())
    twice = sorted({n for n in policies if policies.count(n) > 1})
    if not policies or twice:
        what = f"names {', '.join(twice)} more than once" if twice else "names no policy"
        print(f"talaria bound: error: --policies {a.policies!r} {what}", file=sys.stderr)
        return 2
    try:
        for name in policies:
            resolve_policy(name)
        text = bound_table(a.scenario, a.seeds, policies)
    except (PolicyError, ScenarioError) as exc:
        print(f"talaria bound: error: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


def configure_bound(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", nargs="?", default=str(DEFAULT_SETTINGS_SCENARIO),
                   help="scenario file (default: the default settings, scenarios/1x30x3.toml)")
    p.add_argument("--seeds", type=seed_list, default=seed_list("1-10"), help="seeds (default 1-10)")
    p.add_argument("--policies", default="baseline,talaria", help="policies shown beside the bound (default baseline,talaria)")
    p.set_defaults(fn=cmd_bound)
