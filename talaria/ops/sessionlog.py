"""`talaria logs SESSION`: one session's path through the services, merged
from their JSON-line logs in wall-clock order.

Every service binds `session_id` and `call_id` on each line of a call's work
(shared/logs.py), so a session's story is spread over the router's,
admission's, the substrate's and the engine-workers' logs. This reads every
`*.log` under a log folder, keeps the lines of one session (or one call),
and prints them as one timeline per run folder (a replay writes one folder per
policy), with a line per call at the end: where it was placed, how long it
waited and why, what it cost.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from shared.logs import read_log_events

# shown in their own columns or implied by the file, not repeated as details
_COLUMNS = {"service", "event", "level", "timestamp", "session_id", "call_id", "at", "instance", "server_id"}


@dataclass(frozen=True, slots=True)
class LogLine:
    source: str  # the log file's stem: router-0, admission-s0, engine-s0-glm-4.5-fp8 ...
    record: dict[str, Any]

    @property
    def timestamp(self) -> str:
        return str(self.record.get("timestamp", ""))


@dataclass(slots=True)
class CallSummary:
    call_id: str
    placed_on: str = ""
    waited_s: float | None = None
    round_wait: bool = False
    switch_wait_s: float | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    restored_tokens: int | None = None  # its prefix's KV restored from host memory (the sim engine says)
    prefill_s: float | None = None
    decode_s: float | None = None
    problems: list[str] = field(default_factory=list)


def session_lines(log_dir: Path, session_id: str | frozenset[str], call_id: str | None = None
                  ) -> dict[Path, list[LogLine]]:
    """The session's (or one call's) log lines per run folder, in wall-clock
    order (ISO-8601 UTC stamps from one machine's clock sort as text); several
    sessions' together where given a set of ids (one agent's, one per model)."""
    wanted = session_id if isinstance(session_id, frozenset) else frozenset({session_id})
    runs: dict[Path, list[LogLine]] = {}
    for path in sorted(log_dir.rglob("*.log")):
        for rec in read_log_events(path):
            if rec.get("session_id") not in wanted:
                continue
            if call_id is not None and rec.get("call_id") != call_id:
                continue
            # a file of one service is named after it; a merged file (docker compose logs) gets the service added
            service = str(rec.get("service", ""))
            source = path.stem if service in path.stem else f"{path.stem}:{service}"
            runs.setdefault(path.parent, []).append(LogLine(source, rec))
    for lines in runs.values():
        lines.sort(key=lambda ln: ln.timestamp)
    return runs


# control characters and bidirectional overrides, as escapes: a client's text in a log field
# (a session header, a path) would otherwise forge lines or drive the reader's terminal
_ESCAPED = {c: f"\\x{c:02x}" if c < 256 else f"\\u{c:04x}"
            for c in (*range(0x20), *range(0x7F, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A))}


def printable(text: str) -> str:
    """`text` with every control character written as its escape."""
    return text.translate(_ESCAPED)


def details(record: dict[str, Any]) -> str:
    """The line's own fields as `key=value`, placement candidates condensed."""
    parts: list[str] = []
    for k, v in record.items():
        if k in _COLUMNS:
            continue
        if k == "candidates" and isinstance(v, list):
            cands = [f"{c.get('server')} {c.get('score')} ({c.get('residency')}/{c.get('kv')})"
                     for c in v if isinstance(c, dict)]
            parts.append("candidates=[" + ", ".join(cands) + "]")
        elif isinstance(v, (dict, list)):
            parts.append(f"{k}={json.dumps(v, separators=(',', ':'))}")
        else:
            parts.append(f"{k}={v}")
    return " ".join(parts)


def summarize_calls(lines: list[LogLine]) -> list[CallSummary]:
    """One summary per call, in the order the calls first appear."""
    calls: dict[str, CallSummary] = {}
    for ln in lines:
        r = ln.record
        cid = r.get("call_id")
        if not cid:
            continue
        s = calls.setdefault(cid, CallSummary(cid))
        ev = r.get("event", "")
        if ev == "router.placed":
            chosen = r.get("candidates") or [{}]
            s.placed_on = str(chosen[0].get("server", "")) if isinstance(chosen[0], dict) else ""
        elif ev == "admission.dispatched":
            s.waited_s = r.get("waited_s")
            s.round_wait = bool(r.get("round_wait"))
            s.switch_wait_s = r.get("switch_wait_s", s.switch_wait_s)
        elif ev == "engine.finished":
            s.output_tokens = r.get("output_tokens")
            s.cached_tokens = r.get("cached_tokens")
            s.restored_tokens = r.get("restored_tokens")
            s.prefill_s = r.get("prefill_s")
            s.decode_s = r.get("decode_s")
        if r.get("level") in ("warning", "error"):
            s.problems.append(ev)
    return list(calls.values())


def _fmt(v: float | int | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def render(runs: dict[Path, list[LogLine]]) -> str:
    out: list[str] = []
    for run_dir, lines in runs.items():
        sources = sorted({ln.source for ln in lines})
        out.append(f"== {run_dir}  ({len(lines)} lines from {', '.join(sources)})")
        out.append(f"{'model t':>9}  {'source':<30} {'event':<30} {'call':<14} details")
        for ln in lines:
            r = ln.record
            at = r.get("at")
            at_s = f"{at:9.2f}" if isinstance(at, (int, float)) else " " * 9
            cid = str(r.get("call_id", ""))
            out.append(f"{at_s}  {ln.source:<30} {r.get('event', ''):<30} {cid:<14} {details(r)}")
        calls = summarize_calls(lines)
        if calls:
            out.append("")
            out.append(f"{'call':<16} {'server':<7} {'waited s':>9} {'round wait':>10} {'output':>7} "
                       f"{'cached':>8} {'restored':>8} {'prefill s':>10} {'decode s':>9}  problems")
            for c in calls:
                out.append(f"{c.call_id:<16} {c.placed_on or '-':<7} {_fmt(c.waited_s):>9} "
                           f"{'yes' if c.round_wait else 'no':>10} {_fmt(c.output_tokens, 'd'):>7} "
                           f"{_fmt(c.cached_tokens, 'd'):>8} {_fmt(c.restored_tokens, 'd'):>8} "
                           f"{_fmt(c.prefill_s, '.2f'):>10} {_fmt(c.decode_s, '.2f'):>9}  "
                           f"{', '.join(c.problems) or '-'}")
        out.append("")
    return "\n".join(printable(line) for line in out)


def _run_roots(log_dir: Path, run: str) -> list[Path]:
    """The run folders named `run` under `log_dir`, by name or by the path a replay printed."""
    given = Path(run)
    if len(given.parts) > 1 and given.is_dir():  # (the path as printed: `.talaria/logs/<start>-<tag>/talaria`)
        return [given]
    if log_dir.name == run:
        return [log_dir]
    return sorted(d for d in log_dir.rglob(run) if d.is_dir())


class NamedSession(NamedTuple):
    session_id: str
    call_id: str | None  # where the name is a call's id
    tenant: str
    model: str

    @classmethod
    def of(cls, rec: dict[str, Any], session_id: str, call_id: str | None) -> "NamedSession":
        """The session a gateway log line names, with the tenant and model it logged."""
        return cls(session_id, call_id, str(rec.get("tenant") or ""), str(rec.get("model") or ""))


def sessions_named(log_dir: Path, name: str) -> list[NamedSession]:
    """The sessions a gateway call's id or an agent's own session name stands for, from the
    gateway's lines: a call's id names one; a session name may name several (one per model
    it was sent with, as Claude Code sends its main and its small model's calls; and each
    tenant's sessions are its own), sorted by id."""
    found: dict[str, NamedSession] = {}
    for path in sorted(log_dir.rglob("*.log")):
        for rec in read_log_events(path):
            sid = rec.get("session_id")
            if not isinstance(sid, str):
                continue
            if rec.get("call_id") == name:
                return [NamedSession.of(rec, sid, name)]
            if rec.get("event") == "gateway.call" and rec.get("session_name") == name and sid not in found:
                found[sid] = NamedSession.of(rec, sid, None)
    return sorted(found.values(), key=lambda n: n.session_id)


def refusal_named(log_dir: Path, request_id: str) -> dict[str, Any] | None:
    """The gateway's line for a request it refused before any call (`gateway.refused`),
    found by the request id the answer's headers carried."""
    for path in sorted(log_dir.rglob("gateway*.log")):
        for rec in read_log_events(path):
            if rec.get("event") == "gateway.refused" and rec.get("request_id") == request_id:
                return rec
    return None


def renamed_as(log_dir: Path, session_id: str) -> list[str]:
    """Session ids ending in `-<session_id>`: the names a replay against a
    running deployment gave the trace's session (its prefix, then the id)."""
    found: set[str] = set()
    for path in log_dir.rglob("*.log"):
        for rec in read_log_events(path):
            sid = rec.get("session_id")
            if isinstance(sid, str) and sid.endswith(f"-{session_id}") and sid != session_id:
                found.add(sid)
    return sorted(found)


def _prefix_used(log_dir: Path, run: str) -> bool:
    """Whether some session id under `log_dir` starts with `run-` (a replay against a running deployment)."""
    return any(isinstance(sid := rec.get("session_id"), str) and sid.startswith(f"{run}-")
               for path in log_dir.rglob("*.log") for rec in read_log_events(path))


def run_names(log_dir: Path, session_id: str) -> list[str]:
    """What --run can name for a session: the run folders under `log_dir` (its first level holding
    logs) and the prefixes a replay against a running deployment gave this session."""
    folders = {p.relative_to(log_dir).parts[0] for p in log_dir.rglob("*.log") if p.parent != log_dir}
    prefixes = {sid[: -len(session_id) - 1] for sid in renamed_as(log_dir, session_id)}
    return sorted(folders | prefixes)


def _print_lines(text_lines: list[str]) -> None:
    # `talaria logs ... | head` closes the pipe early: stop quietly, as cat does
    try:
        for line in text_lines:
            sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit


def cmd_logs(a: argparse.Namespace) -> int:
    log_dir = Path(a.log_dir)
    if not log_dir.is_dir():
        print(f"talaria: error: no log folder at {log_dir} (a replay or `talaria up` writes one; see --log-dir)",
              file=sys.stderr)
        return 2
    session, call = a.session, a.call
    roots = [log_dir]
    runs: dict[Path, list[LogLine]] = {}
    if a.run:
        run = a.run.rstrip("-")
        # a run folder of the embedded replay, or the session prefix of a replay against `talaria up`
        folders = _run_roots(log_dir, run)
        roots = folders or [log_dir]
        prefixed = session if session.startswith(f"{run}-") else f"{run}-{session}"
        for root in roots:
            runs.update(session_lines(root, prefixed, call if call is None or call.startswith(f"{run}-")
                                      else f"{run}-{call}"))
        if runs:
            session = prefixed
        elif not folders:
            # a run that selects nothing printed every run's timeline, as if no --run were given
            if not _prefix_used(log_dir, run):
                known = run_names(log_dir, session)
                print(f"talaria: error: no run {run} under {log_dir} (runs there: {', '.join(known) or 'none'})",
                      file=sys.stderr)
                return 2
            session = prefixed  # a deployment's run that did not have this session
    if not runs:
        for root in roots:
            runs.update(session_lines(root, session, call))
    if not runs and call is None:
        # what an HTTP agent holds: its own session name (the gateway logs it) or a call's id
        # (a reply's `x-request-id`): the session they name, and with a call id that call alone
        named = {n.session_id: n for root in roots for n in sessions_named(root, session)}
        if len({n.tenant for n in named.values()}) > 1:
            # (two tenants' sessions of one name: the first alone was shown, as if it were the only one)
            which = ", ".join(f"{n.session_id} (tenant {n.tenant or '?'}, model {n.model or '?'})"
                              for n in named.values())
            print(f"talaria: error: {session} names {len(named)} sessions of different tenants: {which}; "
                  "give one of their ids", file=sys.stderr)
            return 2
        if named:  # one agent's: every model's session of the name, together
            call = next(iter(named.values())).call_id if len(named) == 1 else None
            for root in roots:
                runs.update(session_lines(root, frozenset(named), call))
    if not runs and call is None and not a.run:
        # a request refused before it made a call: its request id names no session
        refusal = next((r for root in roots if (r := refusal_named(root, session)) is not None), None)
        if refusal is not None:
            if a.json:
                _print_lines([json.dumps(refusal)])
            else:
                _print_lines([printable(
                    f"{refusal.get('timestamp', '')} gateway refused {refusal.get('method')} "
                    f"{refusal.get('path')} before any call: {refusal.get('status')} {refusal.get('code')}"
                    + (f" ({refusal['param']})" if refusal.get("param") else "") + f": {refusal.get('message')}")])
            return 0
    if not runs:
        what = f"call {call} of session {session}" if call else f"session {session}"
        n = sum(1 for root in roots for _ in root.rglob("*.log"))
        where = ", ".join(str(r) for r in roots)
        hint = ""
        if not a.run and (renamed := renamed_as(log_dir, session)):
            prefixes = sorted({sid[: -len(session) - 1] for sid in renamed})
            hint = (f"; a replay against a running deployment renamed it {', '.join(renamed)}: "
                    f"pass --run {prefixes[0]}")
        print(f"talaria: error: no log line names {what} under {where} ({n} log files){hint}", file=sys.stderr)
        return 1
    if a.json:
        _print_lines([json.dumps({"source": ln.source, **ln.record}) for lines in runs.values() for ln in lines])
    else:
        _print_lines([render(runs)])
    return 0


def configure_parser(p: argparse.ArgumentParser, default_log_dir: Path) -> None:
    p.add_argument("session", help="session id as in the trace, e.g. swe-007; or, for an HTTP agent, its own "
                                   "session name (the x-session-id it sent) or a call's x-request-id")
    p.add_argument("--call", default=None, help="only this call id, e.g. swe-007#003")
    p.add_argument("--log-dir", default=str(default_log_dir),
                   help=f"a log folder of a replay or of `talaria up` (default {default_log_dir}; every *.log below it)")
    p.add_argument("--run", default=None, metavar="RUN",
                   help="one run: the run folder a replay printed (e.g. 20261201-093000-3fa2), or the session "
                        "prefix a replay against a running deployment printed (e.g. r5c397f)")
    p.add_argument("--json", action="store_true", help="the merged lines as JSON, one per line (each with its source)")
    p.set_defaults(fn=cmd_logs)
