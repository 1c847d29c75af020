"""The control plane's delay on a live replay's returns, from its logs
(talaria/results/hops.py: what `talaria fidelity --call-latency measured` gives the simulator)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from talaria.results.hops import delay_summary, return_delays
from talaria.workload.trace import TraceCall, TraceSession


def _write(path: Path, *lines: dict | str) -> None:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def _session(sid: str, *tools: float) -> TraceSession:
    return TraceSession(session_id=sid, model="m", arrival_s=0.0,
                        calls=[TraceCall(new_input_tokens=10, output_tokens=5, tool_s=t) for t in tools])


def test_a_return_delay_is_the_next_arrival_at_admission_less_the_finish_and_the_tool_gap(tmp_path: Path) -> None:
    sessions = [_session("a", 2.0, 3.0, 0.0), _session("b", 1.0, 0.0)]
    _write(tmp_path / "engine-s0-m.log",
           {"event": "engine.finished", "call_id": "a#000", "at": 10.0},
           {"event": "engine.finished", "call_id": "a#000", "at": 99.0},  # handled again after a restart: first stamp kept
           {"event": "engine.finished", "call_id": "a#001", "at": 20.0},
           "--- [infra] exited with code 1; restart in 1.0s")
    _write(tmp_path / "engine-s1-m.log", {"event": "engine.finished", "call_id": "b#000", "at": 5.0})
    _write(tmp_path / "admission-s0.log",
           {"event": "admission.queued", "call_id": "a#000", "at": 1.0},  # a first call: no return
           {"event": "admission.queued", "call_id": "a#001", "at": 12.25},
           {"event": "admission.queued", "call_id": "a#002", "at": 23.5},
           {"event": "admission.dispatched", "call_id": "a#002", "at": 40.0},
           "{not json")
    # b#001 never reached admission (the run stopped): no figure rather than a wrong one
    delays = return_delays(tmp_path, sessions)
    assert delays == pytest.approx([0.25, 0.5])
    assert return_delays(tmp_path, sessions, run_tag="other-") == []


def test_the_summary_of_return_delays() -> None:
    s = delay_summary([0.4, 0.1, 0.2, 0.3, 5.0])
    assert s == {"returns": 5, "p50_s": 0.3, "p90_s": 5.0, "max_s": 5.0}
    assert delay_summary([]) == {"returns": 0, "p50_s": 0.0, "p90_s": 0.0, "max_s": 0.0}


def test_an_event_is_taken_at_its_source_time_back_by_a_hop_never_by_a_stall() -> None:
    """`ScaledClock.at_source`: a hop's latency is taken out (the event at its source's
    model time), a stall's is not: nothing further back than SOURCE_LAG_MAX_WALL_S of
    wall time, never in the future, never before the receiver's last step."""
    import time

    from shared.clock import SOURCE_LAG_MAX_WALL_S, ScaledClock, at_source

    clock = ScaledClock(scale=50.0, epoch=time.time() - 1000.0)  # now: about 50,000 model s
    now = clock.now()
    assert clock.at_source(now - 10.0, 0.0) == pytest.approx(now - 10.0)  # 0.2 wall s back: a hop
    assert clock.at_source(now - 30 * 50.0, 0.0) == pytest.approx(now - SOURCE_LAG_MAX_WALL_S * 50.0, abs=1.0)
    assert clock.at_source(now + 100.0, 0.0) == pytest.approx(now, abs=1.0)
    assert clock.at_source(None, 0.0) == pytest.approx(now, abs=1.0)
    assert clock.at_source(now - 10.0, now - 5.0) == pytest.approx(now - 5.0)
    assert at_source(1.0, 100.0, 0.0) == 1.0  # (no bound unless asked)
