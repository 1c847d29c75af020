"""Policies: every mechanism is one switch; presets name the combinations.

One `PolicyConfig` travels to every service (encoded in the environment) and to
the simulator, so a policy means the same thing everywhere.
"""

from __future__ import annotations

import tomllib
from functools import lru_cache
from pathlib import Path
from typing import Literal

import msgspec

TUNED_PATH = Path(__file__).parent / "data" / "tuned.toml"

Closing = Literal["drain", "preempt"]
NextModel = Literal["round-robin", "oldest-first", "most-waiting"]
Placement = Literal["load", "talaria"]


class PolicyConfig(msgspec.Struct, frozen=True, kw_only=True):
    name: str = "baseline"
    # admission (round scheduler)
    slot_s: float = 30.0                 # the slot's quantum in model seconds
    closing: Closing = "drain"           # what happens to admitted work at the quantum
    next_model: NextModel = "round-robin"
    session_prefill: bool = False        # SP: admit continuations into the open slot
    sp_overrun_s: float = 0.0            # SP budget: estimated finish may pass the quantum by this much
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
    # what a call reserves for its output when admitted (max_tokens is the bound)
    admission_output_estimate: Literal["max_tokens", "history"] = "max_tokens"


BASELINE = PolicyConfig(name="baseline")

TALARIA = PolicyConfig(
    name="talaria",
    session_prefill=True,
    reservations=True,
    host_kv=True,
    staging=True,
    stable_addresses=True,
    placement="talaria",
    next_model="oldest-first",
)

PRESETS: dict[str, PolicyConfig] = {
    "baseline": BASELINE,
    "talaria": TALARIA,
    "talaria-no-sp": msgspec.structs.replace(TALARIA, name="talaria-no-sp", session_prefill=False),
    "talaria-no-hostkv": msgspec.structs.replace(TALARIA, name="talaria-no-hostkv", host_kv=False),
    "talaria-no-staging": msgspec.structs.replace(TALARIA, name="talaria-no-staging", staging=False),
    "talaria-no-stable": msgspec.structs.replace(TALARIA, name="talaria-no-stable", stable_addresses=False),
    "talaria-no-reservations": msgspec.structs.replace(TALARIA, name="talaria-no-reservations", reservations=False),
    "talaria-load-only": msgspec.structs.replace(TALARIA, name="talaria-load-only", placement="load"),
}


class PolicyError(ValueError):
    pass


@lru_cache(maxsize=1)
def tuned_overrides() -> dict[str, dict[str, object]]:
    """Parameters chosen by `talaria study tune` (shared/data/tuned.toml):
    [baseline] applies to the baseline, [talaria] to talaria and every ablation."""
    if not TUNED_PATH.exists():
        return {}
    return tomllib.loads(TUNED_PATH.read_text())


def resolve_policy(name: str, overrides: dict[str, object] | None = None, *, tuned: bool = True) -> PolicyConfig:
    """A preset by name with its tuned parameters, then optional field overrides."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise PolicyError(f"unknown policy {name!r}; choose from {', '.join(PRESETS)}") from None
    merged: dict[str, object] = {}
    if tuned:
        merged |= tuned_overrides().get("baseline" if name == "baseline" else "talaria", {})
    merged |= overrides or {}
    if not merged:
        return base
    unknown = set(merged) - set(PolicyConfig.__struct_fields__)
    if unknown:
        raise PolicyError(f"unknown policy fields {sorted(unknown)}")
    data = msgspec.structs.asdict(base) | merged
    return msgspec.convert(data, PolicyConfig)


def encode_policy(p: PolicyConfig) -> str:
    return msgspec.json.encode(p).decode()


def decode_policy(s: str) -> PolicyConfig:
    return msgspec.json.decode(s, type=PolicyConfig)
