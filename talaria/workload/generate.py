"""Seeded generator of SWE-bench-like agent sessions (figures: docs/calibration.md).

Every distribution is a knob of `GeneratorSettings` (read from a TOML file), so
the headline trace is reproducible from `traces/swebench-30.toml` alone:

    talaria generate --settings traces/swebench-30.toml --out traces/swebench-30.jsonl --stats

Randomness: one `random.Random` per concern, seeded from a string derived from
the seed (str seeds hash with SHA-512, so they are stable across runs and
PYTHONHASHSEED). Changing e.g. the model list therefore leaves the token and
tool-time draws of every session unchanged.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from shared.catalog import Catalog, CatalogError, load_catalog
from talaria.argtypes import MAX_SERVERS
from talaria.workload.trace import MAX_MODEL_S, TraceCall, TraceSession, encode_trace, session_prompts
from talaria.workload.tomlfile import load_toml_struct

__all__ = [
    "GeneratorSettings",
    "SettingsError",
    "load_settings",
    "generate",
    "call_counts",
    "trace_stats",
    "configure_parser",
    "run",
]

Pos = Annotated[int, msgspec.Meta(ge=1)]
NonNeg = Annotated[float, msgspec.Meta(ge=0.0)]
PosF = Annotated[float, msgspec.Meta(gt=0.0)]
Frac = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
# Bounds no real workload reaches but that keep the draws finite: a lognormal's σ of 5 already
# spans e^±15 around its median (at 1000 a draw overflows), and a Zipf exponent of 50 already
# gives every model but the first its one guaranteed session (at 1e300 the weights overflow).
Sigma = Annotated[float, msgspec.Meta(ge=0.0, le=5.0)]
Skew = Annotated[float, msgspec.Meta(ge=0.0, le=50.0)]
# Sessions per second: below one in about 12 days a handful of arrivals nears the trace format's
# MAX_MODEL_S (1e-300 put them at ~1e300 s); inf is allowed (every session at 0).
Rate = Annotated[float, msgspec.Meta(ge=1e-6)]


class SettingsError(ValueError):
    """The generator settings file is unreadable or inconsistent."""


ServerCount = Annotated[int, msgspec.Meta(ge=1, le=MAX_SERVERS)]  # (a scenario's `servers` too)


class GeneratorSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Knobs of the generator; defaults are the figures of docs/calibration.md. Unknown keys are errors (typos)."""

    seed: int = 0  # base seed; `generate(seed=...)` and `--seed` override it
    sessions: Pos = 30  # sessions in the trace (Talaria's replay: 30)
    calls_total: Pos = 960  # calls over all sessions, hit exactly (Talaria's replay: 960)
    # Per-session call counts: lognormal with median calls_total/sessions and this σ, then rescaled
    # to sum to calls_total. 0.4 matches the spread of nilenso's SWE-agent runs (p10/p50/p90 29/52/77).
    calls_sigma: Sigma = 0.4
    min_calls: Annotated[int, msgspec.Meta(ge=2)] = 2  # fewest calls per session
    models: list[str] = msgspec.field(
        default_factory=lambda: ["glm-4.5-fp8", "qwen3-235b-a22b-fp8", "glm-4.5-air-fp8"]
    )  # catalog names; order is popularity rank
    popularity_skew: Skew = 0.5  # Zipf exponent over `models` (0 = uniform); every model gets >= 1 session
    arrival: Literal["poisson"] = "poisson"  # inter-arrival process; the first session arrives at 0
    arrival_rate_per_s: Rate = 0.1  # Poisson rate (sessions per second)
    initial_prompt_min: Pos = 4000  # first call's prompt ~ uniform[min, max] (assumption: system prompt + issue)
    initial_prompt_max: Pos = 12000
    # Appended tokens per later call (TraceLab fit): mixture of two lognormals.
    append_median: PosF = 700.0
    append_sigma: Sigma = 0.6
    append_large_share: Frac = 0.1
    append_large_median: PosF = 10000.0
    append_large_sigma: Sigma = 1.0
    append_max: Pos = 65536  # clip: a single tool output beyond this is truncated by any agent
    # Output tokens per call (TraceLab, nilenso): lognormal, clipped to [1, output_max].
    output_median: PosF = 200.0
    output_sigma: Sigma = 1.0
    output_max: Pos = 4096
    # Tool gap between calls. swe-agent: 97% LN(0.5 s, 1.0) + 3% LN(60 s, 1.0), cap 600 s (nilenso fit);
    # claude-code: LN(0.3 s, 2.9), cap 3600 s (TraceLab fit).
    tool_gap_style: Literal["swe-agent", "claude-code"] = "swe-agent"
    # Compaction: when the next prompt plus its output would pass this share of the model's
    # context limit, that call compacts (context restarts from a summary of summary_min..max tokens).
    compact_at_fraction: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.8
    compact_summary_min: Pos = 8000
    compact_summary_max: Pos = 16000
    round_digits: Annotated[int, msgspec.Meta(ge=0, le=9)] = 3  # floats rounded so the JSONL is stable
    # Defaults recorded for the replay (not used by the generator itself).
    server: str = "h100x8"  # catalog server profile
    servers: ServerCount = 1  # number of such servers


def check_settings(s: GeneratorSettings, catalog: Catalog | None = None) -> GeneratorSettings:
    """Cross-field checks msgspec cannot express; also that names exist in the catalog
    (`catalog`, a scenario's own; else shared/data/catalog.toml) and that a fresh
    context fits each model's."""
    problems: list[str] = []
    if not s.models:
        problems.append("models must name at least one model")
    if len(set(s.models)) != len(s.models):
        problems.append(f"models has duplicates: {s.models}")
    if s.sessions < len(s.models):
        problems.append(f"sessions ({s.sessions}) must be >= the number of models ({len(s.models)})")
    if s.calls_total < s.sessions * s.min_calls:
        problems.append(f"calls_total ({s.calls_total}) must be >= sessions * min_calls ({s.sessions * s.min_calls})")
    if s.initial_prompt_min > s.initial_prompt_max:
        problems.append("initial_prompt_min must be <= initial_prompt_max")
    if s.compact_summary_min > s.compact_summary_max:
        problems.append("compact_summary_min must be <= compact_summary_max")
    # a few sessions over a span near the format's cap could draw an arrival past it
    if s.sessions > 1 and (s.sessions - 1) / s.arrival_rate_per_s > MAX_MODEL_S / 10:
        problems.append(f"arrival_rate_per_s ({s.arrival_rate_per_s:g}) spreads {s.sessions} sessions over "
                        f"~{(s.sessions - 1) / s.arrival_rate_per_s:.3g} s; at most {MAX_MODEL_S / 10:.3g} s "
                        f"keeps every arrival within a trace's limit")
    try:
        cat = catalog if catalog is not None else load_catalog()
        # a median past every context would only be clipped (and an infinite one breaks the rounding)
        longest = max(m.context_limit for m in cat.models.values())
        for name in ("append_median", "append_large_median", "output_median"):
            if not getattr(s, name) <= longest:
                problems.append(f"{name} must be at most {longest} tokens (the catalog's longest context), "
                                f"got {getattr(s, name):g}")
        for m in s.models:
            limit = cat.model(m).context_limit
            budget = int(s.compact_at_fraction * limit)
            # A fresh context (first prompt or summary) plus one output must fit under the threshold.
            if max(s.initial_prompt_max, s.compact_summary_max) + s.output_max > budget:
                problems.append(
                    f"model {m}: initial_prompt_max/compact_summary_max + output_max exceed "
                    f"compact_at_fraction * context_limit ({budget})"
                )
        cat.server(s.server)
    except CatalogError as exc:
        problems.append(str(exc))
    if problems:
        raise SettingsError("; ".join(problems))
    return s


class _ScenarioFile(msgspec.Struct):
    """Just enough of a scenario file (talaria/workload/scenarios.py, which imports this
    module) to tell one given as generator settings."""

    name: str


def load_settings(path: str | Path) -> GeneratorSettings:
    p = Path(path)
    settings = load_toml_struct(p, GeneratorSettings, SettingsError, "settings",
                                other=(_ScenarioFile, "a scenario (talaria sim, compare, paired; its [trace] table "
                                                      "holds generator settings)"))
    try:
        return check_settings(settings)
    except SettingsError as exc:
        raise SettingsError(f"{p}: {exc}") from None


# ---------------------------------------------------------------- sampling


def _ln(rng: random.Random, median: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(median), sigma)


def _tokens(x: float, hi: int) -> int:
    return max(1, min(hi, round(x)))


def call_counts(s: GeneratorSettings, rng: random.Random) -> list[int]:
    """Per-session call counts: lognormal draws scaled to sum exactly to calls_total, each >= min_calls.

    Largest-remainder rounding, then any excess from the min_calls floor is
    taken off the largest sessions (ties: lowest index), so it is deterministic.
    """
    mean = s.calls_total / s.sessions
    raw = [_ln(rng, mean, s.calls_sigma) for _ in range(s.sessions)]
    scale = s.calls_total / sum(raw)
    exact = [x * scale for x in raw]
    counts = [max(s.min_calls, math.floor(x)) for x in exact]
    short = s.calls_total - sum(counts)
    by_frac = sorted(range(s.sessions), key=lambda i: (-(exact[i] - math.floor(exact[i])), i))
    for i in by_frac[: max(0, short)]:
        counts[i] += 1
    while sum(counts) > s.calls_total:  # only when the floor lifted small sessions
        i = max(range(s.sessions), key=lambda j: (counts[j], -j))
        counts[i] -= 1
    return counts


def _assign_models(s: GeneratorSettings, rng: random.Random) -> list[str]:
    """Zipf popularity over the models list; one guaranteed session each, the rest drawn, then shuffled."""
    weights = [1.0 / (rank + 1) ** s.popularity_skew for rank in range(len(s.models))]
    out = list(s.models) + rng.choices(s.models, weights=weights, k=s.sessions - len(s.models))
    rng.shuffle(out)
    return out


def _tool_gap(s: GeneratorSettings, rng: random.Random) -> float:
    if s.tool_gap_style == "swe-agent":
        if rng.random() < 0.03:
            return min(600.0, _ln(rng, 60.0, 1.0))
        return min(600.0, _ln(rng, 0.5, 1.0))
    return min(3600.0, _ln(rng, 0.3, 2.9))


def _appended(s: GeneratorSettings, rng: random.Random) -> int:
    if rng.random() < s.append_large_share:
        return _tokens(_ln(rng, s.append_large_median, s.append_large_sigma), s.append_max)
    return _tokens(_ln(rng, s.append_median, s.append_sigma), s.append_max)


def _session_calls(s: GeneratorSettings, n: int, context_limit: int, rng: random.Random) -> list[TraceCall]:
    budget = s.compact_at_fraction * context_limit
    calls: list[TraceCall] = []
    context = 0  # tokens since the last compaction (earlier inputs + outputs)
    for i in range(n):
        new = rng.randint(s.initial_prompt_min, s.initial_prompt_max) if i == 0 else _appended(s, rng)
        out = _tokens(_ln(rng, s.output_median, s.output_sigma), s.output_max)
        gap = 0.0 if i == n - 1 else round(_tool_gap(s, rng), s.round_digits)
        compact = i > 0 and context + new + out > budget
        if compact:  # the agent summarises its history; the summary is the whole new prompt
            new = rng.randint(s.compact_summary_min, s.compact_summary_max)
            context = 0
        context += new + out
        calls.append(TraceCall(new_input_tokens=new, output_tokens=out, tool_s=gap, compact=compact))
    return calls


def generate(settings: GeneratorSettings, seed: int | None = None, catalog: Catalog | None = None
             ) -> list[TraceSession]:
    """Sessions `swe-000`, `swe-001`, ... in arrival order; the same settings and seed give the same trace.
    Each session compacts its history within its model's context in `catalog` (a scenario's
    own; else shared/data/catalog.toml)."""
    s = settings
    base = s.seed if seed is None else seed
    cat = catalog if catalog is not None else load_catalog()
    counts = call_counts(s, random.Random(f"talaria-gen:{base}:counts"))
    models = _assign_models(s, random.Random(f"talaria-gen:{base}:models"))
    arr_rng = random.Random(f"talaria-gen:{base}:arrivals")
    sessions: list[TraceSession] = []
    t = 0.0
    for i in range(s.sessions):
        if i > 0:
            t += arr_rng.expovariate(s.arrival_rate_per_s)
        rng = random.Random(f"talaria-gen:{base}:session:{i}")
        calls = _session_calls(s, counts[i], cat.model(models[i]).context_limit, rng)
        sessions.append(
            TraceSession(session_id=f"swe-{i:03d}", model=models[i], arrival_s=round(t, s.round_digits), calls=calls)
        )
    return sessions


# ---------------------------------------------------------------- statistics


def _pct(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100])."""
    v = sorted(xs)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def trace_stats(sessions: Sequence[TraceSession]) -> dict[str, Any]:
    """Summary figures to compare with docs/calibration.md (appended = non-first, non-compact calls)."""
    n_calls = [len(s.calls) for s in sessions]
    appended = [c.new_input_tokens for s in sessions for c in s.calls[1:] if not c.compact]
    prompts = [p for s in sessions for p in session_prompts(s)]
    outputs = [c.output_tokens for s in sessions for c in s.calls]
    gaps = [c.tool_s for s in sessions for c in s.calls[:-1]]
    later = [p for s in sessions for p in session_prompts(s)[1:]]
    r = lambda x, d=1: round(x, d)  # noqa: E731 - keep the report readable
    return {
        "sessions": len(sessions),
        "calls": sum(n_calls),
        "calls_per_session": {
            "p10": r(_pct(n_calls, 10)),
            "p50": r(_pct(n_calls, 50)),
            "p90": r(_pct(n_calls, 90)),
            "mean": r(_mean(n_calls)),
        },
        "appended_tokens": {
            "median": r(_pct(appended, 50)),
            "share_below_1k": r(sum(a < 1000 for a in appended) / max(1, len(appended)), 3),
            "token_share_from_calls_ge_10k": r(sum(a for a in appended if a >= 10000) / max(1, sum(appended)), 3),
        },
        "mean_context_per_call": r(_mean([p for p, _ in prompts])),
        "prefix_reuse_share": r(sum(c for _, c in later) / max(1, sum(p for p, _ in later)), 3),
        "output_tokens_median": r(_pct(outputs, 50)),
        "tool_gap_s": {"mean": r(_mean(gaps), 2), "p50": r(_pct(gaps, 50), 2), "p90": r(_pct(gaps, 90), 2)},
        "tool_s_per_session_mean": r(_mean([sum(c.tool_s for c in s.calls[:-1]) for s in sessions])),
        "sessions_compacted_share": r(sum(any(c.compact for c in s.calls) for s in sessions) / max(1, len(sessions)), 3),
        "last_arrival_s": r(max((s.arrival_s for s in sessions), default=0.0)),
        "sessions_per_model": dict(sorted(Counter(s.model for s in sessions).items())),
    }


# ---------------------------------------------------------------- CLI


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--settings", required=True, type=Path, help="generator settings (TOML), e.g. traces/swebench-30.toml")
    p.add_argument("--seed", type=int, default=None, help="override the settings file's seed")
    p.add_argument("--out", type=Path, default=None, help="write the JSONL trace here (default: stdout)")
    p.add_argument("--stats", action="store_true", help="print the trace's statistics as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    """`talaria generate`: exit 0 on success, 2 on a bad settings file or unwritable output."""
    try:
        settings = load_settings(args.settings)
    except SettingsError as exc:
        print(f"talaria generate: error: {exc}", file=sys.stderr)
        return 2
    sessions = generate(settings, seed=args.seed)
    data = encode_trace(sessions)
    if args.out is None:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        try:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_bytes(data)
        except OSError as exc:
            print(f"talaria generate: error: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    if args.stats:
        # With the trace on stdout, keep stdout pure JSONL and put the stats on stderr.
        print(json.dumps(trace_stats(sessions), indent=2), file=sys.stderr if args.out is None else sys.stdout)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m talaria.workload.generate`) until the lead wires the subcommand into the CLI."""
    return run(configure_parser(argparse.ArgumentParser(prog="talaria generate")).parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
