"""The control plane's delay on a live replay's returns, read from its services' logs.

A session's next call reaches admission, live, later than its tool gap says: the reply
travels engine -> agent, the agent's timer fires, and the call travels agent -> router
-> admission, the router reading Redis and writing its placement on the way. The
simulator models all of that as one figure, `talaria sim --call-latency S`: model
seconds added to every return. This measures that figure on a live run, from the two
stamps that bound it, both in the stack's model time: the engine-worker's
`engine.finished` of a session's call and admission's `admission.queued` of the
session's next call, less the trace's tool gap between them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from pathlib import Path

from shared.logs import read_log_events
from talaria.workload.agent import call_id_for
from talaria.workload.trace import TraceSession


def first_stamps(paths: Iterable[Path], event: str) -> dict[str, float]:
    """call id -> model time (`at`) of the first `event` line for it (a call handled
    again after a restart keeps its first stamp)."""
    out: dict[str, float] = {}
    for path in paths:
        for rec in read_log_events(path):
            if rec.get("event") == event and "call_id" in rec and "at" in rec:
                out.setdefault(str(rec["call_id"]), float(rec["at"]))
    return out


def return_delays(log_dir: Path, sessions: list[TraceSession], run_tag: str = "") -> list[float]:
    """Model seconds, per return (every call but a session's first) whose two stamps
    are in the logs under `log_dir`, between the engine's finish of the previous call
    plus the tool gap and this call's arrival at admission. A call's ids carry the
    replay's `run_tag` (a replay against a running deployment prefixes them)."""
    finished = first_stamps(sorted(log_dir.glob("engine-*.log")), "engine.finished")
    queued = first_stamps(sorted(log_dir.glob("admission-*.log")), "admission.queued")
    delays: list[float] = []
    for s in sessions:
        sid = f"{run_tag}{s.session_id}"
        for i in range(1, len(s.calls)):
            prev, cur = call_id_for(sid, i - 1), call_id_for(sid, i)
            if prev in finished and cur in queued:
                delays.append(queued[cur] - finished[prev] - s.calls[i - 1].tool_s)
    return delays


def delay_summary(delays: list[float]) -> dict[str, float]:
    """p50, p90 and max of the delays (model s), and how many; all 0 when there are none."""
    if not delays:
        return {"returns": 0, "p50_s": 0.0, "p90_s": 0.0, "max_s": 0.0}
    ordered = sorted(delays)
    return {"returns": len(ordered), "p50_s": statistics.median(ordered),
            "p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], "max_s": ordered[-1]}
