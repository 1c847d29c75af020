"""Placement: rank candidate servers for a call (pure; no I/O).

`rank(call, snapshot, policy)` is a pure function of the call and a snapshot
of server state, with its weights in the policy. The baseline places by load
only; Talaria scores model residency, KV locality, pressure and round
contention (the other models with work on the server). The peer
policies' rules (docs/peers.md) live here too, selected by `policy.placement`,
so the router and the simulator run the very same code for them. The router
logs the candidates and scores of every decision on one line.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from shared.policy import PolicyConfig
from shared.state import ServerLoad

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
    load_tokens: int = 0  # prompt tokens of the calls queued or running here (a router's active-sequence count)
    live_models: frozenset[str] = frozenset()  # models with calls queued, running or claimed here
    models_away: frozenset[str] = frozenset()  # models whose engine-worker here is starting or draining


def server_view(server_id: str, models: frozenset[str], load: ServerLoad, staged_model: str | None,
                session_kv: KvTier, reserved_on: str | None,
                models_away: frozenset[str] = frozenset()) -> ServerView:
    """A server as placement sees it for one call: the server's load (admission's
    mirror), the model being staged in, and where the call's session has its KV
    and its reservation. The one constructor the router and the simulator share."""
    mine = reserved_on == server_id
    return ServerView(
        server_id=server_id, models=models, active_model=load.active, staged_model=staged_model,
        queued_calls=load.queued, running_calls=load.running, kv_occupancy=load.kv_occupancy,
        reservations_for_others=load.reservations - mine, session_kv=session_kv, session_reserved=mine,
        load_tokens=load.load_tokens, live_models=load.live_models, models_away=models_away,
    )


@dataclass(frozen=True, slots=True)
class Candidate:
    server_id: str
    score: float
    residency: Residency
    kv: KvTier
    pressure: float
    contention: int  # other models with work on the server (logged; only Talaria's score weighs it)


@dataclass(frozen=True, slots=True)
class InFlight:
    """A call a router placed on a server whose mirror may not count it yet."""

    call_id: str
    model: str
    prompt_tokens: int
    placed_at: float  # wall seconds (time.time()) of the router that placed it

    def encode(self) -> str:
        """The value in the server's shared in-flight hash (keys.in_flight)."""
        return f"{self.model}|{self.prompt_tokens}|{self.placed_at:.6f}"

    @classmethod
    def decode(cls, call_id: str, value: str) -> InFlight | None:
        """None for a value this version cannot read (it is then ignored, not fatal)."""
        try:
            model, tokens, at = value.split("|")
            return cls(call_id, model, int(tokens), float(at))
        except ValueError:
            return None


@dataclass
class InFlightPlacements:
    """The calls placed on each server that its mirror does not count yet.

    Two sources: what every router replica wrote to the server's shared
    in-flight hash (admission deletes an entry in the same transaction as the
    mirror write that counts the call), and this router's own placements,
    which it knows before its write of them has reached Redis. An own placement
    is dropped once a read that began after its write finds it gone from the
    hash: the mirror counts it (for that read and later ones at once; the entry
    itself stays while an earlier read is still open, since that read's mirror
    may not count it, and a ranking on it must). Entries older than `max_age` go either way (a
    router that died between its write and its forward, an admission that
    restarted). The reader fetches the hash before the mirror, so a call is
    counted twice for a moment at worst, never missed."""

    max_age: float
    own: dict[str, dict[str, InFlight]] = dataclasses.field(default_factory=dict)
    written_at_read: dict[str, int] = dataclasses.field(default_factory=dict)  # call id -> reads begun when its write landed
    reads: int = 0
    counted_at_read: dict[str, int] = dataclasses.field(default_factory=dict)  # call id -> first read whose mirror counts it
    open_reads: set[int] = dataclasses.field(default_factory=set)  # snapshots begun and not yet ranked on

    def begin_read(self) -> int:
        """A snapshot of the shared hashes is about to be fetched: its number."""
        self.reads += 1
        self.open_reads.add(self.reads)
        return self.reads

    def end_read(self, read: int) -> None:
        """Snapshot `read` is ranked on (or failed): own placements counted by a read
        no open snapshot precedes are dropped."""
        self.open_reads.discard(read)
        oldest = min(self.open_reads, default=self.reads + 1)
        done = [cid for cid, at in self.counted_at_read.items() if at <= oldest]
        for calls in self.own.values():
            for cid in done:
                calls.pop(cid, None)
        for cid in done:
            self._forget(cid)

    def _forget(self, call_id: str) -> None:
        self.written_at_read.pop(call_id, None)
        self.counted_at_read.pop(call_id, None)

    def placed(self, server_id: str, call: InFlight) -> None:
        self.own.setdefault(server_id, {})[call.call_id] = call

    def written(self, call_id: str) -> None:
        """Its entry is in the shared hash: every read begun from now on sees it or its deletion."""
        self.written_at_read[call_id] = self.reads

    def unsettled(self, read: int) -> list[str]:
        """This router's placements that a snapshot `read` may not hold: still being
        written, or written after that read began (the ranking counts them all)."""
        return [cid for calls in self.own.values() for cid in calls
                if (landed := self.written_at_read.get(cid)) is None or landed >= read]

    def unplaced(self, server_id: str, call_id: str) -> None:
        """The server refused it, or did not answer: it will never show."""
        self.own.get(server_id, {}).pop(call_id, None)
        self._forget(call_id)

    def pending(self, server_id: str, shared: dict[str, InFlight], read: int, now: float) -> list[InFlight]:
        """The server's uncounted calls, given the shared hash as read by snapshot `read`."""
        out = {cid: c for cid, c in shared.items() if now - c.placed_at < self.max_age}
        mine = self.own.get(server_id, {})
        for cid, c in list(mine.items()):
            if now - c.placed_at >= self.max_age:
                del mine[cid]
                self._forget(cid)
                continue
            landed = self.written_at_read.get(cid)
            if landed is not None and read > landed and cid not in shared:
                self.counted_at_read[cid] = min(read, self.counted_at_read.get(cid, read))
            if read >= self.counted_at_read.get(cid, read + 1):
                continue  # this snapshot's mirror counts it
            out.setdefault(cid, c)
        return list(out.values())


def with_in_flight(view: ServerView, calls: list[InFlight]) -> ServerView:
    """The view as it will be once the server has these calls: queued, their
    models live there, their prompts in its load. A router's own recent
    placements, so that two calls arriving closer together than the mirror's
    latency do not both see the server as it was before either."""
    if not calls:
        return view
    return dataclasses.replace(view, queued_calls=view.queued_calls + len(calls),
                               live_models=view.live_models | {c.model for c in calls},
                               load_tokens=view.load_tokens + sum(c.prompt_tokens for c in calls))


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


def contention_of(view: ServerView, model: str) -> int:
    """Round contention: the other models with work on the server. One model
    runs at a time, so each of them takes a turn of the server's rounds
    before this call's model comes back; a call placed where its model is
    alone never waits for a round."""
    return len(view.live_models - {model})


def outstanding(view: ServerView) -> int:
    """Requests sent to a server and not finished: what an LLM router tracks as load."""
    return view.queued_calls + view.running_calls


def _stable_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


@lru_cache(maxsize=256)
def _ring(server_ids: tuple[str, ...], vnodes: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    points = sorted((_stable_hash(f"{sid}#{v}"), sid) for sid in server_ids for v in range(vnodes))
    return tuple(p for p, _ in points), tuple(sid for _, sid in points)


@lru_cache(maxsize=65536)
def affinity_server(session_id: str, server_ids: tuple[str, ...], vnodes: int = 64) -> str:
    """The server a session hashes to on a consistent-hash ring (blake2b; stable
    across processes, unlike Python's hash). Adding a server moves ~1/n sessions."""
    hashes, owners = _ring(tuple(sorted(server_ids)), vnodes)
    i = bisect.bisect_left(hashes, _stable_hash(session_id))
    return owners[i % len(owners)]


def _least_loaded_score(v: ServerView) -> float:
    # fewest outstanding requests, then the emptiest KV budget (a fraction < 1)
    return -(outstanding(v) + 0.5 * v.kv_occupancy)


def _peer_scores(model: str, views: list[ServerView], policy: PolicyConfig, session_id: str,
                 prompt_tokens: int, prefix_tokens: int) -> list[float]:
    """Scores (higher is better) of the peer placement rules, one per view."""
    rule = policy.placement
    if rule == "least-loaded":
        return [_least_loaded_score(v) for v in views]
    if rule == "session-affinity":
        # consistent hashing with bounded loads: the hashed server unless its
        # load would pass c x the mean; then least-loaded
        home = affinity_server(session_id, tuple(v.server_id for v in views), policy.affinity_vnodes)
        total = sum(outstanding(v) for v in views) + 1
        bound = policy.affinity_load_factor * total / len(views)
        scores = [_least_loaded_score(v) for v in views]
        for i, v in enumerate(views):
            if v.server_id == home and outstanding(v) + 1 <= max(1.0, bound):
                scores[i] = 1.0  # above every least-loaded score (those are <= 0)
        return scores
    if rule == "kv-overlap":
        # Dynamo's KV router: cost = w * prefill blocks not covered by this
        # worker's cached prefix + the worker's active blocks (decode load)
        # including this request; the minimum cost wins
        b = max(1, policy.kv_block_tokens)
        out = []
        for v in views:
            cached = prefix_tokens if v.session_kv == "hbm" else 0
            prefill_blocks = -(-max(0, prompt_tokens - cached) // b)
            active_blocks = -(-(v.load_tokens + prompt_tokens) // b)
            out.append(-(policy.overlap_weight * prefill_blocks + active_blocks))
        return out
    if rule == "cache-aware":
        # SGLang router: when load is imbalanced, the shortest queue; otherwise
        # the best prefix match if its match rate passes the threshold, else the
        # worker holding the least (its smallest tree)
        loads = [outstanding(v) for v in views]
        hi, lo = max(loads), min(loads)
        if hi - lo > policy.balance_abs_threshold and hi > lo * policy.balance_rel_threshold:
            return [-float(x) for x in loads]
        rate = prefix_tokens / prompt_tokens if prompt_tokens > 0 else 0.0
        match = [rate if v.session_kv != "none" else 0.0 for v in views]
        best = max(match)
        if best > policy.cache_threshold:
            return [1.0 + m for m in match]  # ties on the match rate: by server id
        return [-float(v.load_tokens) for v in views]
    raise ValueError(f"unknown placement rule {rule!r}")


def rank(model: str, views: list[ServerView], policy: PolicyConfig, *, session_id: str = "", call_id: str = "",
         prompt_tokens: int = 0, prefix_tokens: int = 0) -> list[Candidate]:
    """Best first. Servers that do not serve `model` are never candidates.

    `session_id`, `call_id`, `prompt_tokens` and `prefix_tokens` are the call's
    own (what the router sees in the request); only the peer rules read them.

    Under every rule, a server whose engine-worker for `model` is starting or draining
    comes after every server with one ready (a rolling restart: the call would wait
    for the next worker there, minutes under vLLM), in the rule's order among them."""
    away = {v.server_id for v in views if model in v.models_away}
    ranked = _rank(model, views, policy, session_id, call_id, prompt_tokens, prefix_tokens)
    return [c for c in ranked if c.server_id not in away] + [c for c in ranked if c.server_id in away]


def _rank(model: str, views: list[ServerView], policy: PolicyConfig, session_id: str, call_id: str,
          prompt_tokens: int, prefix_tokens: int) -> list[Candidate]:
    if policy.placement in ("load", "talaria"):
        return _rank_talaria(model, views, policy)
    serving = [v for v in views if model in v.models]
    if not serving:
        return []
    scores = _peer_scores(model, serving, policy, session_id, prompt_tokens, prefix_tokens)
    out = [Candidate(v.server_id, sc, residency_of(v, model), v.session_kv, pressure_of(v), contention_of(v, model))
           for v, sc in zip(serving, scores)]
    if policy.placement in ("least-loaded", "session-affinity") and call_id:
        # a load-only rule has no reason to prefer one of two equally loaded
        # servers: spread ties by the call (round-robin in effect, stateless and
        # reproducible); by server id, light load would send every call to the
        # first server and hand the rule a session affinity it does not have
        out.sort(key=lambda c: (-c.score, _stable_hash(f"{call_id}@{c.server_id}")))
    else:
        out.sort(key=lambda c: (-c.score, c.server_id))
    return out


def _rank_talaria(model: str, views: list[ServerView], policy: PolicyConfig) -> list[Candidate]:
    out: list[Candidate] = []
    for v in views:
        if model not in v.models:
            continue
        res = residency_of(v, model)
        p = pressure_of(v)
        k = contention_of(v, model)
        if policy.placement == "load":
            score = -p
        else:
            score = (
                policy.w_residency * RESIDENCY_SCORE[res]
                + policy.w_kv_locality * KV_SCORE[v.session_kv]
                - policy.w_pressure * p
                + (policy.w_reservation if v.session_reserved else 0.0)
                - policy.w_contention * k
            )
        out.append(Candidate(v.server_id, score, res, v.session_kv, p, k))
    out.sort(key=lambda c: (-c.score, c.server_id))
    return out
