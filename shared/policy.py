"""Policies: every mechanism is one switch; presets name the combinations.

One `PolicyConfig` travels to every service (encoded in the environment) and to
the simulator, so a policy means the same thing everywhere.
"""

from __future__ import annotations

import math
import tomllib
from functools import lru_cache
from pathlib import Path
from typing import Literal

import msgspec

TUNED_PATH = Path(__file__).parent / "data" / "tuned.toml"
DECISION_HISTORY = 16  # a session's last tool gaps and outputs that decisions may look back on

Closing = Literal["drain", "preempt"]
NextModel = Literal["round-robin", "oldest-first", "most-waiting"]
# "load" and "talaria" are the baseline's and Talaria's rules; the rest are peer
# systems' placement rules (docs/peers.md), all inside services/router/placement.rank
Placement = Literal["load", "talaria", "least-loaded", "session-affinity", "kv-overlap", "cache-aware"]
# what keeps a finished call's KV for its session's return (docs/peers.md):
# Talaria's soft reservation, or a Continuum-style TTL pin that never holds a slot
Retention = Literal["reservation", "ttl"]
# order of admission within a model's queue: per call (FIFO) or per program (Continuum)
AdmissionOrder = Literal["call", "program", "auto"]  # auto: program-level FCFS only while KV-bound

INF = math.inf
# Allowed range of each numeric field, both ends included; every value must be finite too.
# A quantum far below a call's prefill never lets the clock pass the slot's end (at 0.01 s the
# simulator hangs), so 1 model second at least; weights, holds and budgets are >= 0 (0 turns
# them off); a bounded-load factor or an SGLang relative threshold below 1 puts every server
# out of balance; a ring needs a virtual node per server, and thousands only slow placement.
FIELD_RANGES: dict[str, tuple[float, float]] = {
    "slot_s": (1.0, INF),
    "sp_overrun_s": (0.0, INF),
    "hold_quantile": (0.0, 1.0),
    "hold_factor": (0.0, INF),
    "hold_min_s": (0.0, INF),
    "hold_max_s": (0.0, INF),
    "idle_hold_max_s": (0.0, INF),
    "w_residency": (0.0, INF),
    "w_kv_locality": (0.0, INF),
    "w_pressure": (0.0, INF),
    "w_reservation": (0.0, INF),
    "w_contention": (0.0, INF),
    "ttl_quantile": (0.0, 1.0),
    "ttl_default_s": (0.0, INF),
    "ttl_max_s": (0.0, INF),
    "affinity_load_factor": (1.0, INF),
    "affinity_vnodes": (1, 4096),
    "overlap_weight": (0.0, INF),
    "kv_block_tokens": (1, INF),
    "cache_threshold": (0.0, 1.0),
    "balance_abs_threshold": (0, INF),
    "balance_rel_threshold": (1.0, INF),
}
# (lower, upper): the lower may not pass the upper
FIELD_ORDER: tuple[tuple[str, str], ...] = (("hold_min_s", "hold_max_s"), ("ttl_default_s", "ttl_max_s"))


class PolicyError(ValueError):
    pass


def _range_text(lo: float, hi: float) -> str:
    return f"{lo:g} or more" if hi == INF else f"in {lo:g}..{hi:g}"


class PolicyConfig(msgspec.Struct, frozen=True, kw_only=True):
    name: str = "baseline"
    # admission (round scheduler)
    slot_s: float = 30.0                 # the slot's quantum in model seconds
    closing: Closing = "drain"           # what happens to admitted work at the quantum
    next_model: NextModel = "round-robin"
    session_prefill: bool = False        # SP: admit continuations into the open slot
    sp_overrun_s: float = 0.0            # SP budget: estimated finish may pass the quantum by this much
    sp_new_sessions: bool = False        # the SP budget rule also admits a new session's first call
    reservations: bool = False           # soft reservations for sessions off at a tool
    hold_quantile: float = 0.9           # hold = this quantile of the session's observed gaps ...
    hold_factor: float = 1.5             # ... times this factor,
    hold_min_s: float = 2.0              # clamped to [hold_min_s, hold_max_s]
    hold_max_s: float = 30.0
    idle_hold_max_s: float = 2.0         # an idle slot waits for reserved returns at most this long while others wait
    # substrate
    host_kv: bool = False                # host-KV restore
    staging: bool = False                # weight staging (D2D)
    stable_addresses: bool = True        # fixed HBM regions; off = re-create engine memory on each switch
    # router
    placement: Placement = "load"
    w_residency: float = 4.0             # placement weights (see docs/mechanisms.md)
    w_kv_locality: float = 3.0
    w_pressure: float = 1.0
    w_reservation: float = 2.0
    w_contention: float = 4.0            # per other model with work on the server (its turns of the round)
    # -- peer policies' rules (docs/peers.md); defaults are the peers' published defaults
    retention: Retention = "reservation"   # with reservations on: soft reservation or TTL pin
    admission_order: AdmissionOrder = "call"
    ttl_quantile: float = 0.9              # kv-ttl: TTL = this quantile of the session's past tool gaps,
    ttl_default_s: float = 2.0             # ... this before any history,
    ttl_max_s: float = 120.0               # ... at most this
    affinity_load_factor: float = 1.25     # session-affinity: bounded-load consistent hashing (c)
    affinity_vnodes: int = 64              # session-affinity: virtual nodes per server on the ring
    overlap_weight: float = 1.0            # kv-overlap: Dynamo's kv_overlap_score_weight
    kv_block_tokens: int = 16              # kv-overlap: tokens per KV block
    cache_threshold: float = 0.5           # cache-aware: SGLang router's cache_threshold
    balance_abs_threshold: int = 32        # cache-aware: SGLang router's balance_abs_threshold
    balance_rel_threshold: float = 1.0001  # cache-aware: SGLang router's balance_rel_threshold

    def __post_init__(self) -> None:
        # every way a policy is built (presets, tuned.toml, variants, the services' environment) passes here
        for name, (lo, hi) in FIELD_RANGES.items():
            v = getattr(self, name)
            if not (math.isfinite(v) and lo <= v <= hi):
                raise PolicyError(f"{name} must be finite and {_range_text(lo, hi)}, got {v}")
        for low, high in FIELD_ORDER:
            if getattr(self, low) > getattr(self, high):
                raise PolicyError(f"{low} ({getattr(self, low)}) must not exceed {high} ({getattr(self, high)})")


BASELINE = PolicyConfig(name="baseline")

TALARIA = PolicyConfig(
    name="talaria",
    session_prefill=True,
    sp_new_sessions=True,
    reservations=True,
    host_kv=True,
    staging=True,
    stable_addresses=True,
    placement="talaria",
    next_model="most-waiting",  # as tuned (shared/data/tuned.toml, applied over every preset)
    # program-level FCFS while KV-bound: chosen on the multi-server scenarios'
    # tuning seeds (never scored), where kv-ttl had beaten Talaria (docs/results.md);
    # a longer KV hold (120 s) was tried there too and lost on mean SCT
    admission_order="auto",
)

PRESETS: dict[str, PolicyConfig] = {
    "baseline": BASELINE,
    "talaria": TALARIA,
    "talaria-no-sp": msgspec.structs.replace(TALARIA, name="talaria-no-sp", session_prefill=False),
    "talaria-no-sp-new": msgspec.structs.replace(TALARIA, name="talaria-no-sp-new", sp_new_sessions=False),
    "talaria-no-hostkv": msgspec.structs.replace(TALARIA, name="talaria-no-hostkv", host_kv=False),
    "talaria-no-staging": msgspec.structs.replace(TALARIA, name="talaria-no-staging", staging=False),
    "talaria-no-stable": msgspec.structs.replace(TALARIA, name="talaria-no-stable", stable_addresses=False),
    "talaria-no-reservations": msgspec.structs.replace(TALARIA, name="talaria-no-reservations", reservations=False),
    "talaria-load-only": msgspec.structs.replace(TALARIA, name="talaria-load-only", placement="load"),
}

# Peer policies (docs/peers.md): each runs on Talaria's admission and substrate
# (SP, host-KV restore, staging, reservations) and changes only what its system
# changes: its placement rule, or its KV-retention rule. `NAME@baseline` runs the
# same rule on the baseline scheduler instead (see resolve_policy).
PEER_RULES: dict[str, dict[str, object]] = {
    "least-loaded": {"placement": "least-loaded"},
    "session-affinity": {"placement": "session-affinity"},
    "kv-overlap": {"placement": "kv-overlap"},
    "cache-aware": {"placement": "cache-aware"},
    # Continuum keeps the engine's own placement (Talaria's here, load on the
    # baseline) and changes retention and admission order
    "kv-ttl": {"reservations": True, "retention": "ttl", "admission_order": "program"},
}
PEERS: tuple[str, ...] = tuple(PEER_RULES)
for _peer, _rule in PEER_RULES.items():
    PRESETS[_peer] = msgspec.structs.replace(TALARIA, name=_peer, **_rule)  # type: ignore[arg-type]
BASELINE_SUFFIX = "@baseline"


@lru_cache(maxsize=1)
def tuned_overrides() -> dict[str, dict[str, object]]:
    """Parameters chosen by `talaria study tune` (shared/data/tuned.toml):
    [baseline] applies to the baseline, [talaria] to talaria and every ablation."""
    if not TUNED_PATH.exists():
        return {}
    return tomllib.loads(TUNED_PATH.read_text())


def resolve_policy(name: str, overrides: dict[str, object] | None = None, *, tuned: bool = True) -> PolicyConfig:
    """A preset by name with its tuned parameters, then optional field overrides."""
    on_baseline = name.endswith(BASELINE_SUFFIX)
    rule = name.removesuffix(BASELINE_SUFFIX) if on_baseline else name
    try:
        base = PRESETS[rule]
    except KeyError:
        raise PolicyError(f"unknown policy {name!r}; choose from {', '.join(PRESETS)} "
                          f"(or a peer with {BASELINE_SUFFIX}: {', '.join(PEERS)})") from None
    if on_baseline:
        # NAME@baseline: the peer's rule on the baseline scheduler and substrate
        if rule not in PEER_RULES:
            raise PolicyError(f"{BASELINE_SUFFIX} applies to peer policies only ({', '.join(PEERS)}), not {rule!r}")
        base = msgspec.structs.replace(BASELINE, name=name, **PEER_RULES[rule])  # type: ignore[arg-type]
    merged: dict[str, object] = {}
    if tuned:
        merged |= tuned_overrides().get("baseline" if name == "baseline" or on_baseline else "talaria", {})
    merged |= overrides or {}
    if not merged:
        return base
    unknown = set(merged) - set(PolicyConfig.__struct_fields__)
    if unknown:
        raise PolicyError(f"unknown policy fields {sorted(unknown)}")
    data = msgspec.structs.asdict(base) | merged
    try:
        return msgspec.convert(data, PolicyConfig)
    except msgspec.ValidationError as exc:  # a field's type or range (PolicyConfig.__post_init__)
        raise PolicyError(f"policy {name!r}: {exc}") from None


def policy_overrides(fields: str) -> dict[str, object]:
    """`field=value,field=value` as PolicyConfig overrides: each value as JSON where it
    reads as JSON (300, 1.5, true), else as the bare word it is (a string field such as
    `retention=ttl`)."""
    out: dict[str, object] = {}
    for item in filter(None, (f.strip() for f in fields.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise PolicyError(f"{item!r} is not field=value")
        try:
            out[key.strip()] = msgspec.json.decode(value.strip())
        except msgspec.DecodeError:
            out[key.strip()] = value.strip()
    return out


def parse_policy(text: str) -> PolicyConfig:
    """A policy as an operator writes it (`TALARIA_POLICY`, `--policy`): a preset's name
    (`talaria`), a preset with some of its tuned parameters changed
    (`talaria:slot_s=300,hold_max_s=60`), or a whole PolicyConfig as JSON."""
    text = text.strip()
    if text.startswith("{"):
        return decode_policy(text)
    name, colon, fields = text.partition(":")
    if not colon:
        return resolve_policy(name.strip())
    overrides = policy_overrides(fields)
    policy = resolve_policy(name.strip(), overrides)
    # named as written, so what a service logs and `talaria status` shows is not taken for the preset
    changed = ",".join(f"{k}={msgspec.json.encode(v).decode() if not isinstance(v, str) else v}"
                       for k, v in overrides.items())
    return msgspec.structs.replace(policy, name=f"{name.strip()}:{changed}" if changed else name.strip())


def encode_policy(p: PolicyConfig) -> str:
    return msgspec.json.encode(p).decode()


def decode_policy(s: str) -> PolicyConfig:
    return msgspec.json.decode(s, type=PolicyConfig)
