"""Typed views of the Redis hashes that several services share: the one place
that encodes and decodes them.

Each field group has exactly one writer, and every write is field-level
(`HSET` of that group's fields, never a whole hash as one blob), so two writers
of one hash never overwrite each other:

| hash | field group | writer |
| --- | --- | --- |
| server | `ServerLoad` (active, phase, queued, running, ...) | admission of that server |
| server | `SubstrateView` (resident, staged, host KV, ...) | substrate-manager of that server |
| server | `stat_*` counters (scheduler counters, `busy_s_<model>`) | admission; each sim engine-worker its own `busy_s_<model>` |
| session | identity and call count (model, calls, started_at) | router |
| session | last finish (last_finish, last_server) and the outputs list | engine-worker (the base that finishes calls) |

Counters are increments (`HINCRBY`/`HINCRBYFLOAT` of what this process added
since its last write), so a restarted writer adds to the total instead of
resetting it. Which keys are soft and which must survive: `shared/keys.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from shared.keys import SESSION_TTL_S, Keys
from shared.policy import DECISION_HISTORY

COUNTER_PREFIX = "stat_"
BUSY_PREFIX = "busy_s_"  # a counter per engine: model seconds with a call running


def _text(raw: Mapping[bytes, bytes] | Mapping[str, str]) -> dict[str, str]:
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v) for k, v in raw.items()}


def _names(value: str) -> frozenset[str]:
    return frozenset(filter(None, value.split(",")))


# -- the server hash -------------------------------------------------------------------------
class ServerLoad(msgspec.Struct, frozen=True, kw_only=True):
    """Admission's mirror of its round scheduler, for the router's placement."""

    active: str | None = None
    phase: str = ""
    queued: int = 0
    running: int = 0
    kv_occupancy: float = 0.0
    load_tokens: int = 0
    reservations: int = 0
    live_models: frozenset[str] = frozenset()
    models: frozenset[str] | None = None  # None: not mirrored yet (the deployment's models apply)

    def fields(self) -> dict[str, str | int]:
        return {
            "active": self.active or "",
            "phase": self.phase,
            "queued": self.queued,
            "running": self.running,
            "kv_occupancy": f"{self.kv_occupancy:.4f}",
            "load_tokens": self.load_tokens,
            "reservations": self.reservations,
            "live_models": ",".join(sorted(self.live_models)),
            "models": ",".join(sorted(self.models or ())),
        }


class SubstrateView(msgspec.Struct, frozen=True, kw_only=True):
    """The substrate-manager's mirror of its memory ledger."""

    resident: str | None = None
    staged: str | None = None
    host_kv_gb: float = 0.0
    region_reservations: int = 0
    switches: int = 0

    def fields(self) -> dict[str, str | int]:
        return {
            "resident": self.resident or "",
            "staged": self.staged or "",
            "host_kv_gb": f"{self.host_kv_gb:.1f}",
            "region_reservations": self.region_reservations,
            "switches": self.switches,
        }


# What placement reads of a server's hash: the load and the substrate's view, not the
# counters (the router's snapshot fetches only these; decode_server reads them alike)
PLACEMENT_FIELDS: tuple[str, ...] = (*ServerLoad.__struct_fields__, *SubstrateView.__struct_fields__)


class ServerMirror(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a reader (router, replay, CLI) finds in a server's hash."""

    load: ServerLoad
    substrate: SubstrateView
    counters: dict[str, float]  # without the `stat_` prefix: switches, sp_admits, busy_s_<model>, ...


def decode_server(raw: Mapping[bytes, bytes] | Mapping[str, str]) -> ServerMirror:
    g = _text(raw)
    models = g.get("models")
    load = ServerLoad(
        active=g.get("active") or None,
        phase=g.get("phase", ""),
        queued=int(g.get("queued", 0)),
        running=int(g.get("running", 0)),
        kv_occupancy=float(g.get("kv_occupancy", 0.0)),
        load_tokens=int(g.get("load_tokens", 0)),
        reservations=int(g.get("reservations", 0)),
        live_models=_names(g.get("live_models", "")),
        models=_names(models) if models else None,
    )
    substrate = SubstrateView(
        resident=g.get("resident") or None,
        staged=g.get("staged") or None,
        host_kv_gb=float(g.get("host_kv_gb", 0.0)),
        region_reservations=int(g.get("region_reservations", 0)),
        switches=int(g.get("switches", 0)),
    )
    counters = {k[len(COUNTER_PREFIX):]: float(v) for k, v in g.items() if k.startswith(COUNTER_PREFIX)}
    return ServerMirror(load=load, substrate=substrate, counters=counters)


def write_server_load(pipe: Any, keys: Keys, server_id: str, load: ServerLoad) -> None:
    pipe.hset(keys.server(server_id), mapping=load.fields())


def write_substrate_view(pipe: Any, keys: Keys, server_id: str, view: SubstrateView) -> None:
    pipe.hset(keys.server(server_id), mapping=view.fields())


class CounterMirror:
    """This process's counters as increments of the shared totals: `pending`
    says what to add since the last successful write, `written` records it."""

    def __init__(self) -> None:
        self._written: dict[str, float] = {}

    def pending(self, current: Mapping[str, float]) -> dict[str, float]:
        return {k: v - self._written.get(k, 0.0) for k, v in current.items() if v != self._written.get(k, 0.0)}

    def written(self, added: Mapping[str, float]) -> None:
        for k, v in added.items():
            self._written[k] = self._written.get(k, 0.0) + v


def is_seconds(name: str) -> bool:
    """A counter of seconds (a float in Redis) rather than of events (an integer)."""
    return name.endswith("_s") or name.startswith(BUSY_PREFIX)


def add_counters(pipe: Any, keys: Keys, server_id: str, added: Mapping[str, float]) -> None:
    key = keys.server(server_id)
    for name, delta in added.items():
        field = COUNTER_PREFIX + name
        # by the counter's kind, never by this delta's value: HINCRBY fails on a field HINCRBYFLOAT wrote
        if is_seconds(name):
            pipe.hincrbyfloat(key, field, float(delta))
        else:
            pipe.hincrby(key, field, int(delta))


# -- the session hash ------------------------------------------------------------------------
class SessionRecord(msgspec.Struct, frozen=True, kw_only=True):
    model: str | None = None
    calls: int = 0
    started_at: float | None = None
    last_finish: float | None = None
    last_server: str | None = None
    owner: str | None = None  # the namespace that opened it (a hash from before namespaces: anyone's)
    tenant: str | None = None  # whose it is (the gateway's tenant; else its namespace)


def decode_session(raw: Mapping[bytes, bytes] | Mapping[str, str]) -> SessionRecord:
    g = _text(raw)
    return SessionRecord(
        model=g.get("model"),
        calls=int(g.get("calls", 0)),
        started_at=float(g["started_at"]) if "started_at" in g else None,
        last_finish=float(g["last_finish"]) if "last_finish" in g else None,
        last_server=g.get("last_server"),
        owner=g.get("owner"),
        tenant=g.get("tenant"),
    )


def open_session(pipe: Any, keys: Keys, session_id: str, model: str, owner: str, tenant: str) -> None:
    """The router's group: the session's model, the namespace that opened it and its tenant."""
    pipe.hset(keys.session(session_id), mapping={"model": model, "owner": owner, "tenant": tenant})
    pipe.expire(keys.session(session_id), SESSION_TTL_S)


def count_call(pipe: Any, keys: Keys, session_id: str, by: int = 1) -> None:
    """The router's group: one more (or, undone, one fewer) call placed for the session."""
    pipe.hincrby(keys.session(session_id), "calls", by)


def mark_started(pipe: Any, keys: Keys, session_id: str, at: float) -> None:
    """The router's group: the model time of the session's first call (set once)."""
    pipe.hsetnx(keys.session(session_id), "started_at", repr(at))


def note_kv_locality(pipe: Any, keys: Keys, session_id: str, server_id: str, tier: str) -> None:
    """The engine-worker's group: where the session's KV lives on this server (`hbm` or
    `host`); soft state that expires with the session's other keys even where no release
    reaches it (an admission restarted while the session was idle)."""
    pipe.hset(keys.kv_locality(session_id), server_id, tier)
    pipe.expire(keys.kv_locality(session_id), SESSION_TTL_S)


def record_finish(pipe: Any, keys: Keys, session_id: str, server_id: str, finished_at: float, output_tokens: int) -> None:
    """The engine-worker's group: where and when the session's last call ended, and its output length."""
    skey = keys.session(session_id)
    pipe.hset(skey, mapping={"last_finish": repr(finished_at), "last_server": server_id})
    pipe.rpush(keys.session_outputs(session_id), output_tokens)
    pipe.ltrim(keys.session_outputs(session_id), -DECISION_HISTORY, -1)  # (all a decision reads)
    pipe.expire(skey, SESSION_TTL_S)
    pipe.expire(keys.session_outputs(session_id), SESSION_TTL_S)
