"""Placement (services/router/placement.py): load-only vs Talaria's residency/locality/pressure score."""

from __future__ import annotations

import dataclasses

import pytest

from services.router.placement import (
    InFlight, InFlightPlacements, ServerView, contention_of, pressure_of, rank, residency_of, with_in_flight,
)
import msgspec

from shared.policy import PRESETS

M = "qwen3-235b-a22b-fp8"
OTHER = "glm-4.5-fp8"
ALL = frozenset({M, OTHER, "glm-4.5-air-fp8"})
LOAD = PRESETS["baseline"]
TALARIA = PRESETS["talaria"]  # weights: residency 4, KV locality 3, pressure 1


def view(sid: str, *, models: frozenset[str] = ALL, active: str | None = None, staged: str | None = None,
         queued: int = 0, running: int = 0, kv: float = 0.0, res: int = 0, session_kv: str = "none",
         live: frozenset[str] = frozenset()) -> ServerView:
    return ServerView(sid, models, active, staged, queued, running, kv, res, session_kv,  # type: ignore[arg-type]
                      live_models=live)


@pytest.mark.parametrize(
    ("v", "pressure"),
    [
        (view("a"), 0.0),
        (view("a", queued=3, running=2), 5.0),
        (view("a", res=3), 1.5),
        (view("a", kv=0.25), 0.25),
        (view("a", queued=1, running=1, res=1, kv=0.5), 3.0),
    ],
)
def test_pressure(v: ServerView, pressure: float) -> None:
    assert pressure_of(v) == pytest.approx(pressure)


@pytest.mark.parametrize(
    ("v", "res"),
    [
        (view("a", active=M), "active"),
        (view("a", active=OTHER, staged=M), "staged"),
        (view("a", active=OTHER), "host"),
        (view("a", models=frozenset({OTHER})), "absent"),
    ],
)
def test_residency(v: ServerView, res: str) -> None:
    assert residency_of(v, M) == res


@pytest.mark.parametrize(
    ("views", "best"),
    [
        ([view("s0", queued=3), view("s1", queued=1), view("s2", queued=2)], "s1"),
        ([view("s0", running=2), view("s1", queued=1, kv=0.5)], "s1"),
        ([view("s0", res=4), view("s1", queued=1)], "s1"),
        # load only: residency and KV locality do not count
        ([view("s0", active=M, session_kv="hbm", queued=1), view("s1")], "s1"),
    ],
)
def test_load_policy_picks_least_pressure(views: list[ServerView], best: str) -> None:
    ranked = rank(M, views, LOAD)
    assert ranked[0].server_id == best
    assert [c.score for c in ranked] == sorted((c.score for c in ranked), reverse=True)
    for c in ranked:
        assert c.score == pytest.approx(-c.pressure)


def test_talaria_prefers_active_model_and_hbm_prefix_over_idle_empty_server() -> None:
    home = view("s1", active=M, session_kv="hbm", running=1, kv=0.4)
    idle = view("s0")
    assert rank(M, [idle, home], LOAD)[0].server_id == "s0"
    ranked = rank(M, [idle, home], TALARIA)
    assert ranked[0].server_id == "s1"
    assert (ranked[0].residency, ranked[0].kv) == ("active", "hbm")
    assert (ranked[1].residency, ranked[1].kv) == ("host", "none")
    # score = w_res * residency + w_kv * locality - w_p * pressure
    assert ranked[0].score == pytest.approx(4.0 * 1.0 + 3.0 * 1.0 - 1.0 * 1.4)
    assert ranked[1].score == pytest.approx(4.0 * 0.2)  # every served model keeps a host copy


@pytest.mark.parametrize(
    ("s1_tier", "s0_tier", "expect"),
    [("hbm", "none", "s1"), ("host", "none", "s1"), ("hbm", "host", "s1"), ("none", "host", "s0"), ("none", "hbm", "s0")],
)
def test_talaria_kv_locality_decides_between_equal_residency(s1_tier: str, s0_tier: str, expect: str) -> None:
    s1 = view("s1", active=OTHER, session_kv=s1_tier)
    s0 = view("s0", active=OTHER, session_kv=s0_tier)
    assert rank(M, [s0, s1], TALARIA)[0].server_id == expect


@pytest.mark.parametrize(
    ("s1", "s0", "expect"),
    [
        (view("s1", active=M), view("s0", active=OTHER, staged=M), "s1"),  # active beats staged
        (view("s1", active=OTHER, staged=M), view("s0", active=OTHER), "s1"),  # staged beats host copy
        # a staged model (2.4) loses to a host copy with the prefix on the host (0.8 + 1.8)
        (view("s1", active=OTHER, staged=M), view("s0", active=OTHER, session_kv="host"), "s0"),
    ],
)
def test_talaria_residency_order(s1: ServerView, s0: ServerView, expect: str) -> None:
    assert rank(M, [s0, s1], TALARIA)[0].server_id == expect


def test_heavily_loaded_home_loses_to_lightly_loaded_server() -> None:
    home = view("s1", active=M, session_kv="hbm", queued=12, running=4, kv=0.9)
    light = view("s0", active=OTHER, queued=1)
    assert rank(M, [home, light], TALARIA)[0].server_id == "s0"
    # with pressure weighted lightly the home server wins again
    lenient = msgspec.structs.replace(TALARIA, w_pressure=0.1)
    assert rank(M, [home, light], lenient)[0].server_id == "s1"
    # and with residency/locality weighted heavily too
    sticky = msgspec.structs.replace(TALARIA, w_residency=20.0, w_kv_locality=10.0)
    assert rank(M, [home, light], sticky)[0].server_id == "s1"


def test_servers_not_serving_the_model_are_never_candidates() -> None:
    views = [
        view("s0", models=frozenset({OTHER})),  # idle, but does not serve M
        view("s1", queued=50),
        view("s2", models=frozenset({OTHER}), active=OTHER, session_kv="hbm"),
    ]
    for policy in (LOAD, TALARIA):
        ranked = rank(M, views, policy)
        assert [c.server_id for c in ranked] == ["s1"]
    assert rank(M, [view("s0", models=frozenset({OTHER}))], TALARIA) == []
    assert rank(M, [], LOAD) == []


@pytest.mark.parametrize("policy", [LOAD, TALARIA], ids=["load", "talaria"])
def test_ties_broken_by_server_id(policy) -> None:
    views = [view(s, queued=1) for s in ("s3", "s10", "s1", "s2")]
    assert [c.server_id for c in rank(M, views, policy)] == ["s1", "s10", "s2", "s3"]
    views = [view("b", running=1), view("a", running=1), view("c")]
    assert [c.server_id for c in rank(M, views, policy)] == ["c", "a", "b"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_server_whose_engine_for_the_model_is_away_comes_after_every_ready_one(name: str) -> None:
    """Starting or draining (a rolling restart): last, whatever the rule's score says, and in
    the rule's order among the others; an engine away for another model changes nothing."""
    views = [view("s0", active=M, session_kv="hbm"), view("s1", queued=2), view("s2", queued=1, running=1),
             view("s3", active=M, session_kv="host")]
    as_scored = [c.server_id for c in rank(M, views, PRESETS[name], session_id="sess-1", call_id="c-1")]
    away = [dataclasses.replace(v, models_away=frozenset({M})) if v.server_id in ("s0", "s3") else v for v in views]
    got = [c.server_id for c in rank(M, away, PRESETS[name], session_id="sess-1", call_id="c-1")]
    assert got == [s for s in as_scored if s not in ("s0", "s3")] + [s for s in as_scored if s in ("s0", "s3")]
    other_away = [dataclasses.replace(v, models_away=frozenset({OTHER})) for v in views]
    assert [c.server_id for c in rank(M, other_away, PRESETS[name], session_id="sess-1", call_id="c-1")] == as_scored
    every_away = [dataclasses.replace(v, models_away=frozenset({M})) for v in views]
    assert [c.server_id for c in rank(M, every_away, PRESETS[name], session_id="sess-1", call_id="c-1")] == as_scored


def test_rank_is_pure() -> None:
    views = [view("s1", active=M, queued=2), view("s0", session_kv="host")]
    snapshot = list(views)
    first = rank(M, views, TALARIA)
    assert views == snapshot
    assert rank(M, list(reversed(views)), TALARIA) == first


def test_round_contention_counts_the_other_models_with_work() -> None:
    assert contention_of(view("a"), M) == 0
    assert contention_of(view("a", live=frozenset({M})), M) == 0
    assert contention_of(view("a", live=ALL), M) == 2


def test_talaria_prefers_the_server_where_its_model_does_not_contend_for_rounds() -> None:
    # equal residency, KV and pressure: the server whose rounds also serve two
    # other models loses to the one serving this model alone
    mixed = view("s0", active=M, running=2, live=ALL)
    alone = view("s1", active=M, running=2, live=frozenset({M}))
    ranked = rank(M, [mixed, alone], TALARIA)
    assert ranked[0].server_id == "s1"
    assert ranked[0].score - ranked[1].score == pytest.approx(2 * TALARIA.w_contention)
    # weight 0 leaves residency, locality and pressure alone (ties by server id)
    plain = msgspec.structs.replace(TALARIA, w_contention=0.0)
    assert rank(M, [mixed, alone], plain)[0].server_id == "s0"
    # load-only placement never reads it
    assert rank(M, [mixed, alone], LOAD)[0].server_id == "s0"


def test_contention_can_outweigh_a_warm_prefix() -> None:
    """A session whose server also serves other busy models moves to a server
    where its model runs alone once the contention outweighs its prefix and
    residency: it pays a prefill, not a turn of every other model."""
    home = view("s0", active=M, session_kv="hbm", live=ALL)
    alone = view("s1", active=M, live=frozenset({M}))
    heavy = msgspec.structs.replace(TALARIA, w_contention=8.0)
    assert rank(M, [home, alone], heavy)[0].server_id == "s1"
    light = msgspec.structs.replace(TALARIA, w_contention=0.5)
    assert rank(M, [home, alone], light)[0].server_id == "s0"


def test_own_placements_count_until_the_shared_hash_is_seen_without_them() -> None:
    inf = InFlightPlacements(max_age=2.0)
    a, b = InFlight("c1", M, 1_000, 0.0), InFlight("c2", OTHER, 2_000, 0.001)
    read = inf.begin_read()  # a snapshot fetched before either write landed
    inf.placed("s0", a)
    inf.placed("s0", b)
    assert inf.pending("s0", {}, read, now=0.002) == [a, b]  # known here before Redis has them
    inf.written("c1")
    inf.written("c2")
    read = inf.begin_read()
    assert inf.pending("s0", {"c2": b}, read, now=0.003) == [b]  # c1 gone from the hash: the mirror counts it
    read = inf.begin_read()
    assert inf.pending("s0", {}, read, now=0.004) == []
    assert inf.pending("s1", {}, read, now=0.0) == []


def test_a_read_that_began_before_the_write_landed_does_not_drop_the_placement() -> None:
    inf = InFlightPlacements(max_age=2.0)
    early = inf.begin_read()
    a = InFlight("c1", M, 1_000, 0.0)
    inf.placed("s0", a)
    inf.written("c1")
    # that snapshot could not hold it: absent there says nothing about the mirror
    assert inf.pending("s0", {}, early, now=0.001) == [a]
    assert inf.pending("s0", {"c1": a}, inf.begin_read(), now=0.002) == [a]


def test_other_replicas_placements_count_from_the_shared_hash_until_they_age_out() -> None:
    inf = InFlightPlacements(max_age=2.0)
    theirs = {"x1": InFlight("x1", M, 700, 10.0), "x2": InFlight("x2", OTHER, 800, 7.0)}
    read = inf.begin_read()
    # x2 is older than max_age (its router died between write and forward): ignored
    assert inf.pending("s0", theirs, read, now=10.5) == [theirs["x1"]]
    # an own placement the hash never drops (e.g. the admission restarted) goes after max_age
    c = InFlight("c9", M, 500, 20.0)
    inf.placed("s0", c)
    inf.written("c9")
    assert inf.pending("s0", {"c9": c}, inf.begin_read(), now=21.0) == [c]
    assert inf.pending("s0", {"c9": c}, inf.begin_read(), now=22.5) == []
    # refused or unanswered: it never shows
    d = InFlight("c10", M, 500, 30.0)
    inf.placed("s1", d)
    inf.unplaced("s1", "c10")
    assert inf.pending("s1", {}, inf.begin_read(), now=30.0) == []


def test_in_flight_values_round_trip_and_unreadable_ones_are_ignored() -> None:
    a = InFlight("s-1#003", M, 12_345, 1_700_000_000.25)
    assert InFlight.decode(a.call_id, a.encode()) == a
    assert InFlight.decode("x", "garbage") is None
    assert InFlight.decode("x", "m|notanint|1.0") is None


def test_two_calls_closer_than_the_mirror_do_not_both_take_the_idle_server() -> None:
    """The second call sees the first one's placement before the mirror does:
    it is queued there and its model is live there."""
    idle = view("s0")
    busy = view("s1", queued=1, live=frozenset({OTHER}))
    first = rank(M, [idle, busy], TALARIA)[0].server_id
    assert first == "s0"
    inf = InFlightPlacements(max_age=2.0)
    read = inf.begin_read()
    inf.placed("s0", InFlight("c1", M, 1_000, 0.0))
    seen = with_in_flight(idle, inf.pending("s0", {}, read, now=0.001))
    assert (seen.queued_calls, seen.live_models, seen.load_tokens) == (1, frozenset({M}), 1_000)
    # the next call of M joins its own model there; a call of OTHER goes where OTHER is live, not
    # to the server that now also has M's work
    assert rank(M, [seen, busy], TALARIA)[0].server_id == "s0"
    assert rank(OTHER, [seen, busy], TALARIA)[0].server_id == "s1"
    assert with_in_flight(idle, []) is idle


def test_an_older_snapshot_still_counts_a_placement_a_newer_one_found_counted() -> None:
    """Snapshots can come back out of order: one begun earlier, ranked on later, has a
    mirror that may not count a placement a newer snapshot's mirror already does."""
    inf = InFlightPlacements(max_age=2.0)
    a = InFlight("c1", M, 1_000, 0.0)
    inf.placed("s0", a)
    assert inf.unsettled(inf.reads + 1) == ["c1"]  # being written: any snapshot may miss it
    older = inf.begin_read()
    inf.written("c1")
    newer = inf.begin_read()
    assert inf.unsettled(older) == ["c1"] and inf.unsettled(newer) == []
    assert inf.pending("s0", {}, newer, now=0.001) == []  # gone from the hash: counted there
    inf.end_read(newer)
    assert inf.pending("s0", {}, older, now=0.002) == [a]  # not in that snapshot's mirror
    inf.end_read(older)
    assert inf.own["s0"] == {} and not inf.counted_at_read and not inf.written_at_read
