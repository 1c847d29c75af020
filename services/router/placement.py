"""Placement: rank candidate servers for a call (pure; no I/O).

`rank(call, snapshot, policy)` is a pure function of the call and a snapshot
of server state, with its weights in the policy. The baseline places by load
only; Talaria scores model residency, KV locality and pressure. The router
logs the candidates and scores of every decision on one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.policy import PolicyConfig

Residency = Literal["active", "resident", "staged", "host", "absent"]
KvTier = Literal["hbm", "host", "none"]

RESIDENCY_SCORE: dict[str, float] = {"active": 1.0, "resident": 0.8, "staged": 0.6, "host": 0.2, "absent": 0.0}
KV_SCORE: dict[str, float] = {"hbm": 1.0, "host": 0.6, "none": 0.0}


@dataclass(frozen=True, slots=True)
class ServerView:
    """What the router can know about one server (from Redis, mirrored by the services)."""

    server_id: str
    models: frozenset[str]
    active_model: str | None
    staged_model: str | None
    queued_calls: int
    running_calls: int
    kv_occupancy: float  # 0..1 of the active model's KV budget
    reservations_for_others: int
    session_kv: KvTier = "none"  # where this call's session prefix lives on this server
    session_reserved: bool = False  # this server holds a soft reservation for the session


@dataclass(frozen=True, slots=True)
class Candidate:
    server_id: str
    score: float
    residency: Residency
    kv: KvTier
    pressure: float


def residency_of(view: ServerView, model: str) -> Residency:
    if model not in view.models:
        return "absent"
    if view.active_model == model:
        return "active"
    if view.staged_model == model:
        return "staged"
    return "host"  # every served model keeps a host copy of its weights


def pressure_of(view: ServerView) -> float:
    return view.queued_calls + view.running_calls + 0.5 * view.reservations_for_others + view.kv_occupancy


def rank(model: str, views: list[ServerView], policy: PolicyConfig) -> list[Candidate]:
    """Best first. Servers that do not serve `model` are never candidates."""
    out: list[Candidate] = []
    for v in views:
        if model not in v.models:
            continue
        res = residency_of(v, model)
        p = pressure_of(v)
        if policy.placement == "load":
            score = -p
        else:
            score = (
                policy.w_residency * RESIDENCY_SCORE[res]
                + policy.w_kv_locality * KV_SCORE[v.session_kv]
                - policy.w_pressure * p
                + (policy.w_reservation if v.session_reserved else 0.0)
            )
        out.append(Candidate(v.server_id, score, res, v.session_kv, p))
    out.sort(key=lambda c: (-c.score, c.server_id))
    return out
