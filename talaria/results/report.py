"""Summaries, the oracle bound and the comparison table (pure; no I/O but printing).

The results JSON shape every command writes with --out (the tests check these keys):
{"runs": [{"policy", "calls_total", "calls_completed", "sct_p50_s", "sct_p95_s",
           "sct_mean_s", "sessions": [{"session_id", "sct_s"}]} ...]}
with more fields beside them. Every figure is in model seconds.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable

from shared.costmodel import CostModel
from shared.catalog import Catalog
from talaria.workload.agent import DEFAULT_MAX_TOKENS, plan_session
from talaria.workload.trace import TraceSession
from talaria.results.records import CallRecord


def percentile(values: Iterable[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100), as numpy's default."""
    v = sorted(values)
    if not v:
        return math.nan
    k = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def oracle_sct(sessions: list[TraceSession], catalog: Catalog, server_profile: str = "h100x8",
               max_tokens: int = DEFAULT_MAX_TOKENS) -> dict[str, float]:
    """Each session alone on a server with its model active and its prefix in
    HBM: prefill of new tokens + decode + tool gaps. Outputs stop at the calls'
    `max_tokens`, as the run's engines stop them (a trace's 100,000-token output
    made an oracle of hours beside a run of minutes)."""
    cost = CostModel(catalog, catalog.server(server_profile))
    out: dict[str, float] = {}
    for s in sessions:
        spec = catalog.model(s.model)
        total = 0.0
        for c in plan_session(s, max_tokens, context_limit=spec.context_limit):
            total += cost.prefill_s(spec, c.prompt_tokens - c.prefix_tokens, c.prefix_tokens)
            total += cost.decode_alone_s(spec, c.prompt_tokens, max(1, min(c.sim_stop_tokens, c.max_tokens)))
            total += c.tool_s  # (0 after the last call)
        out[s.session_id] = total
    return out


def summarize(
    policy: str,
    sessions: list[TraceSession],
    sct: dict[str, float],
    records: list[CallRecord],
    oracle: dict[str, float] | None = None,
    extra: dict | None = None,
) -> dict:
    calls_total = sum(len(s.calls) for s in sessions)
    done = [r for r in records if r.finished_at > 0]
    values = [sct[s.session_id] for s in sessions if s.session_id in sct]
    run: dict = {
        "policy": policy,
        "calls_total": calls_total,
        "calls_completed": len(done),
        "sessions_completed": len(values),
        "sct_p50_s": percentile(values, 50),
        "sct_p95_s": percentile(values, 95),
        "sct_mean_s": statistics.fmean(values) if values else math.nan,
        "sessions": [{"session_id": sid, "sct_s": sct[sid]} for sid in sorted(sct)],
    }
    by_model: dict[str, list[float]] = defaultdict(list)
    model_of = {s.session_id: s.model for s in sessions}
    for sid, v in sct.items():
        by_model[model_of.get(sid, "?")].append(v)
    run["sct_by_model"] = {m: {"p50_s": percentile(v, 50), "p95_s": percentile(v, 95), "sessions": len(v)} for m, v in sorted(by_model.items())}
    wait_by_model: dict[str, float] = defaultdict(float)
    for r in done:
        wait_by_model[r.model] = max(wait_by_model[r.model], r.waited_s)
    run["max_wait_s_by_model"] = dict(sorted(wait_by_model.items()))
    run["calls_reprefilled"] = sum(1 for r in done if r.reprefill_tokens > 0)
    run["reprefill_tokens"] = sum(r.reprefill_tokens for r in done)
    run["round_waits"] = sum(1 for r in done if r.round_wait)
    run["kv_tokens_restored"] = sum(r.restored_tokens for r in done)
    # where the time goes: sum over calls, split by cause (model seconds)
    run["time_breakdown_s"] = breakdown(done)
    if oracle:
        o = [oracle[s.session_id] for s in sessions]
        run["oracle_p50_s"] = percentile(o, 50)
        run["oracle_p95_s"] = percentile(o, 95)
        run["ratio_to_oracle_p50"] = run["sct_p50_s"] / run["oracle_p50_s"]
        run["ratio_to_oracle_p95"] = run["sct_p95_s"] / run["oracle_p95_s"]
    if extra:
        run.update(extra)
    return run


def breakdown(records: list[CallRecord]) -> dict[str, float]:
    switch = sum(r.switch_wait_s for r in records)
    round_wait = sum(max(0.0, r.waited_s - r.switch_wait_s) for r in records)
    restore = sum(r.restore_s for r in records)
    prefill = sum(r.prefill_s for r in records)
    decode = sum(r.decode_s for r in records)
    return {"queue_for_round_s": round_wait, "model_switch_s": switch, "kv_restore_s": restore,
            "prefill_s": prefill, "decode_s": decode}


def add_speedups(runs: list[dict]) -> None:
    base = next((r for r in runs if r["policy"] == "baseline"), None)
    for r in runs:
        if base is not None and r["sct_p50_s"] > 0:
            r["speedup_p50"] = base["sct_p50_s"] / r["sct_p50_s"]
            r["speedup_p95"] = base["sct_p95_s"] / r["sct_p95_s"]
            r["speedup_mean"] = base["sct_mean_s"] / r["sct_mean_s"]


def _num(v: float | None, width: int, spec: str = ".2f") -> str:
    """A figure, or "-" where there is none (no baseline run to compare with, or a figure a
    replay through the gateway cannot measure)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return f"{'-':>{width}}"
    return f" {v:>{width - 1}{spec}}"  # a space ahead: a figure wider than its column still stands apart


def format_table(runs: list[dict]) -> str:
    head = (f"{'policy':<26}{'calls':>10}{'p50 s':>9}{'p95 s':>9}{'mean s':>9}{'x p50':>7}{'x p95':>7}"
            f"{'p50/oracle':>11}{'reprefill':>10}{'switches':>9}{'round waits':>12}")
    lines = [head, "-" * len(head)]
    for r in runs:
        lines.append(
            f"{r['policy']:<25} {r['calls_completed']:>5}/{r['calls_total']:<4}{_num(r['sct_p50_s'], 9, '.1f')}"
            f"{_num(r['sct_p95_s'], 9, '.1f')}{_num(r['sct_mean_s'], 9, '.1f')}{_num(r.get('speedup_p50'), 7)}"
            f"{_num(r.get('speedup_p95'), 7)}{_num(r.get('ratio_to_oracle_p50'), 11)}"
            f"{_num(r['calls_reprefilled'], 10, 'd')}{_num(r.get('switches', 0), 9, 'd')}{_num(r['round_waits'], 12, 'd')}"
        )
    no_base = not any(r["policy"] == "baseline" for r in runs)
    lines.append("(model seconds from the sim engine's cost model. x p50, x p95: speedup over baseline"
                 + (" (- : no baseline in this run; add baseline to --policy)"
                    if no_base else "") + ";\n"
                 " p50/oracle: p50 SCT over the oracle's (each session alone, its model active, its prefix cached); reprefill: calls\n"
                 " whose cached prefix had to be computed again; switches: model switches; round waits: calls that\n"
                 " waited for their model's next turn on the server)")
    if any(r["calls_reprefilled"] is None for r in runs):
        lines.append("(reprefill, round waits -: not measured; a replay through the gateway sees only HTTP replies)")
    return "\n".join(lines)


def slowest_sessions(run: dict, n: int = 5) -> list[tuple[str, float]]:
    return sorted(((s["session_id"], s["sct_s"]) for s in run["sessions"]), key=lambda x: -x[1])[:n]
