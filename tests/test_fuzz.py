"""A hypothesis fuzzer against every subject the services listen on.

One stack (router, admission, substrate and two engine-workers as real processes over the
test NATS and Redis) takes over 10,000 malformed and hostile messages: random bytes, random
JSON, wrong types, unknown tags, payloads near NATS's 1 MiB max, negative / zero / absurd
token counts, NaN / inf / out-of-range floats, replayed and forged call ids, calls for
sessions that were never opened, hostile reply subjects, and valid-looking messages with one
field broken (plus the odd fully valid one, which must get a valid answer). Well-formed forged
control-plane commands (a run, Sleep/Wake, an executable switch, CallFinished) are sent only
broken: see `defuse`.

The corpus is drawn by hypothesis (`@given(st.data())`, `derandomize=True`: the same corpus
on every run), in batches; it is sent as fast as the bus takes it, every request with its
own reply subject under one wildcard inbox subscription. Afterwards:

1. every service process is alive and answers `<prefix>.health.<instance>`;
2. every request to a request-reply subject got exactly one reply, a typed `ApiError` (never
   `internal`) -- or, for a message the services accept, a valid reply of the subject's reply
   type (an accepted call: its event stream, with at most one distinct final reply);
3. no Redis key (`call:*`, `reply:*`, `session:*`, `kv:*`, `resv:*`) appeared for an id that
   only rejected messages carried (only keys the services write on their own, and keys of
   accepted messages, may appear);
4. no service log has a traceback, `handler.failed` or `task.failed` line;
5. the whole run is bounded (every wait has a deadline; the module has a pytest timeout).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import shared.schema as _schema
from shared.catalog import load_catalog
from shared.call_record import CallRecords
from shared.keys import CALL_TTL_S
from shared.schema import (
    ApiError, CallAccepted, CallQueued, CallReply, CallRequest, CallRunning, ControlOk, EndSession, Info,
    InfoRequest, Ok, OpenSession, SessionOpened, StageRequest, Submitted, SwitchRequest, SwitchResult,
    admission_decoder, api_reply_decoder, api_request_decoder, call_event_decoder, control_decoder,
    engine_announce_decoder, finished_decoder, run_decoder, session_released_decoder,
    submit_reply_decoder, substrate_decoder, switch_reply_decoder, MAX_MESSAGE_BYTES,
)
from shared.subjects import Subjects
from talaria.client import TalariaClient
from talaria.ops.nats_server import NatsServer
from talaria.ops.redis_server import RedisServer

try:  # pytest's default (prepend) import mode puts tests/ on sys.path
    from test_services import MODEL_A, MODEL_B, SERVER, Services, health
except ImportError:  # pragma: no cover - importlib mode, run from the repository root
    from tests.test_services import MODEL_A, MODEL_B, SERVER, Services, health

pytestmark = pytest.mark.timeout(240)

BATCH = 25                  # messages per hypothesis example
EXAMPLES = 420              # 420 x 25 = 10,500 messages
NATS_MAX_PAYLOAD = 1024 * 1024
HUGE_MAX = NATS_MAX_PAYLOAD - 16 * 1024   # stay under the server's default max_payload
# near-max-payload messages, for every subject: how they are made -> examples each
HUGE_HOWS = {"idfield": 3, "field": 1, "list": 1, "nest": 1, "bytes": 1}
ID_FIELDS = {"call_id", "session_id", "model", "to_model", "from_model", "reply_to", "server_id"}
SEND_WINDOW = 400           # messages in flight before the sender waits for replies to catch up
REPLY_WAIT_S = 30.0         # after the last message: how long replies may take to arrive
SETTLE_S = 1.5              # then: how long to wait for a (wrong) second reply
INBOX = "_INBOX.talariafuzz"

CATALOG = load_catalog()
SERVED = [MODEL_A, MODEL_B]
NOT_SERVED = "gpt-oss-120b" if "gpt-oss-120b" in CATALOG.models else "qwen3-235b-a22b-fp8"
CONTEXT_LIMIT = {m: CATALOG.model(m).context_limit for m in SERVED}

# ids: the seeded real session/call (for replays), sessions never opened, and ids fuzz may open
FAILURE_EVENTS = frozenset({"handler.failed", "task.failed"})


def _failure_line(line: str) -> bool:
    """A log line that says a handler or task failed, or carries a traceback. Judged by its
    event and exception fields, not its text: a fuzzed model name that reads
    `handler.failed`, echoed in a rejection's reason, is no failure."""
    try:
        event = json.loads(line)
    except ValueError:
        return "Traceback" in line  # (a line the process wrote outside its logger)
    if not isinstance(event, dict):
        return False
    return event.get("event") in FAILURE_EVENTS or "exception" in event


SEED_SESSION = "fz-seed-session"
SEED_CALL = "fz-seed-session#000"
GHOST_SESSIONS = [f"fz-ghost-{i}" for i in range(6)]
OPENABLE_SESSIONS = [f"fz-open-{i}" for i in range(4)]
FORGED_CALLS = [f"{SEED_SESSION}#{i:03d}" for i in (1, 2, 999)] + [f"fz-call-{i}" for i in range(6)]

# placeholders filled in once the subject prefix and the message's index are known
P_PREFIX = "@P@"
P_INBOX = "@INBOX@"
P_SINK = "@SINK@"

# subject key -> (family, request-reply?)
SUBJECTS: dict[str, tuple[str, bool]] = {
    "api.call": ("api", True),
    "api.session.open": ("api", True),
    "api.session.end": ("api", True),
    "api.info": ("api", True),
    "admission.submit": ("submit", True),
    "events.finished": ("finished", False),
    "events.session_released": ("session_released", False),
    "events.engine": ("announce", False),
    "substrate.switch": ("substrate", True),
    "substrate.stage": ("substrate", False),
    "engine.A.run": ("run", False),
    "engine.B.run": ("run", False),
    "engine.A.control": ("control", True),
    "engine.B.control": ("control", True),
}


if hasattr(Subjects, "substrate_announce"):  # a restarted substrate-manager's announcement (admission listens)
    SUBJECTS["events.substrate"] = ("substrate_announce", False)


def subject_of(key: str, prefix: str) -> str:
    s = Subjects(prefix)
    return {
        "api.call": s.api_call(),
        "api.session.open": s.api_session_open(),
        "api.session.end": s.api_session_end(),
        "api.info": s.api_info,
        "admission.submit": s.admission_submit(SERVER),
        "events.finished": s.call_finished(SERVER),
        "events.session_released": s.session_released,
        "events.engine": s.engine_announce(SERVER),
        "events.substrate": getattr(s, "substrate_announce", lambda _: "")(SERVER),
        "substrate.switch": s.substrate_switch(SERVER),
        "substrate.stage": s.substrate_stage(SERVER),
        "engine.A.run": s.engine_run(SERVER, MODEL_A),
        "engine.B.run": s.engine_run(SERVER, MODEL_B),
        "engine.A.control": s.engine_control(SERVER, MODEL_A),
        "engine.B.control": s.engine_control(SERVER, MODEL_B),
    }[key]


# -- hostile values ----------------------------------------------------------------------------------
class Raw:
    """A JSON token written verbatim (NaN, 1e999, a lone surrogate...)."""

    def __init__(self, text: str) -> None:
        self.text = text


RAW_TOKENS = ["NaN", "-NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e308", "-0.0", "5e-324", "0e0",
              "18446744073709551616", "-9223372036854775809", "1" + "0" * 400, "-" + "9" * 400,
              '"\\ud800"', '"\\udfff x"', '"\\u0000"', "01", "+1", ".5", "1.", "0x10", "true1", "nul"]
ABSURD_INTS = [0, -1, -2, -100, -2**31, -2**63, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1,
               10_000_000, 10_000_001, 10**12, 10**30]
HOSTILE_STRINGS = ["", " ", "a b", "x\r\nPUB evil 0\r\n\r\n", "\r\n", "\t", "*", ">", "a.*", "a.>", "a..b", ".", "..",
                   "a.", ".a", "\x00", "\x7f", "💥" * 3, "x" * 201, "é" * 150, "../../etc/passwd", "%s%n%x",
                   "${jndi:ldap://x}", "__proto__", "'; DROP TABLE x; --", "{\"type\":\"call\"}", "talaria:call:x",
                   "*:*", "NaN", "null", "0", "-1", "\u202eevil", "a" * 5000]
WRONG_TYPES: list[Any] = [None, True, False, [], {}, [1, "a"], {"a": 1}, {"type": "call"}, 1.5, -0.0, 0, "1", "x",
                          [None], [[[]]]]

st_raw = st.sampled_from(RAW_TOKENS).map(Raw)
st_absurd_int = st.sampled_from(ABSURD_INTS) | st.integers(min_value=-2**70, max_value=2**70)
st_hostile_float = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [float("nan"), float("inf"), float("-inf"), -1.0, -1e300, 1e300, 0.0, -0.0, 5e-324])
st_hostile_str = st.sampled_from(HOSTILE_STRINGS) | st.text(max_size=40) | st.binary(max_size=20).map(
    lambda b: b.decode("latin-1"))
st_hostile = st.one_of(st_raw, st_absurd_int, st_hostile_float, st_hostile_str, st.sampled_from(WRONG_TYPES))

# JSON of any shape (with NaN/inf floats, which msgspec refuses as JSON)
st_json = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats() | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=10), kids, max_size=5),
    max_leaves=20,
)

st_call_id = st.sampled_from([SEED_CALL, *FORGED_CALLS]) | st.text(min_size=1, max_size=30)
st_ghost_session = st.sampled_from([SEED_SESSION, *GHOST_SESSIONS])
st_session = st_ghost_session | st.sampled_from(OPENABLE_SESSIONS) | st.text(min_size=1, max_size=30)
st_model = st.sampled_from([*SERVED, *SERVED, NOT_SERVED, "no-such-model", "GLM-4.5-AIR-FP8", ""]) | st.text(max_size=20)
st_served = st.sampled_from(SERVED)
st_tokens = st.integers(min_value=1, max_value=4000) | st.integers(min_value=1, max_value=10_000_000)
st_small_tokens = st.integers(min_value=1, max_value=64)
st_reply_to = st.sampled_from([P_SINK, P_SINK, f"{P_PREFIX}.api.call", f"{P_PREFIX}.admission.{SERVER}.submit",
                               f"{P_PREFIX}.events.session_released"]) | st.sampled_from(HOSTILE_STRINGS)
st_time = st.floats(min_value=0, max_value=1e6, allow_nan=False) | st_hostile_float


CONTROL_KINDS = ["sleep", "wake", "abort", "protect"] + [
    tag for tag, name in (("list_calls", "ListCalls"), ("release_session", "ReleaseSession"))
    if hasattr(__import__("shared.schema", fromlist=["x"]), name)]


def _api_templates(draw: Any) -> dict[str, Any]:
    kind = draw(st.sampled_from(["call", "call", "call", "call", "open_session", "end_session", "info"]))
    if kind == "open_session":
        return {"type": "open_session", "session_id": draw(st.sampled_from(OPENABLE_SESSIONS) | st_session),
                "model": draw(st_model)}
    if kind == "end_session":
        return {"type": "end_session", "session_id": draw(st_session)}
    if kind == "info":
        return {"type": "info"}
    prompt = draw(st.integers(min_value=2, max_value=3000))
    c: dict[str, Any] = {"type": "call", "call_id": draw(st_call_id), "session_id": draw(st_session),
                         "model": draw(st_model), "prompt_tokens": prompt,
                         "prefix_tokens": draw(st.integers(min_value=0, max_value=prompt - 1))}
    if draw(st.booleans()):
        c["max_tokens"] = draw(st_small_tokens)
    c["engine_hint"] = {"sim_output_tokens": draw(st_small_tokens)}
    r = draw(st.sampled_from(["none", "none", "inbox", "sink", "hostile"]))
    if r == "inbox":
        c["reply_to"] = P_INBOX
    elif r == "sink":
        c["reply_to"] = P_SINK
    elif r == "hostile":
        c["reply_to"] = draw(st_reply_to)
    if draw(st.integers(0, 9)) == 0:
        c["prompt_text"] = draw(st.text(max_size=200))
    if draw(st.integers(0, 9)) == 0:
        c["prompt_token_ids"] = draw(st.lists(st_absurd_int, max_size=20))
    return c


def _admission_call(draw: Any) -> dict[str, Any]:
    prompt = draw(st.integers(min_value=2, max_value=3000))
    return {"call_id": draw(st_call_id), "session_id": draw(st_session), "model": draw(st_model),
            "prompt_tokens": prompt, "prefix_tokens": draw(st.integers(min_value=0, max_value=prompt - 1)),
            "max_tokens": draw(st_small_tokens), "arrived_at": draw(st.floats(min_value=0, max_value=1e4)),
            "continuation": draw(st.booleans()),
            "gap_history": draw(st.lists(st.floats(min_value=0, max_value=1e4), max_size=4)),
            "output_history": draw(st.lists(st_small_tokens, max_size=4)),
            "session_started_at": draw(st.none() | st.floats(min_value=0, max_value=1e4))}


def _template(draw: Any, family: str) -> dict[str, Any]:
    if family == "api":
        return _api_templates(draw)
    if family == "submit":
        t = {"type": "submit", "call": _admission_call(draw), "reply_to": draw(st_reply_to)}
        if draw(st.booleans()):
            t["engine"] = {"hint": {"sim_output_tokens": draw(st_small_tokens)}}
        return t
    if family == "finished":
        return {"type": "finished", "call_id": draw(st_call_id), "session_id": draw(st_session),
                "context_tokens": draw(st_tokens)}
    if family == "session_released":
        t = {"type": "session_released", "session_id": draw(st_session)}
        if draw(st.booleans()):
            t["reason"], t["server_id"] = "idle", draw(st.sampled_from([SERVER, "s9"]))
        return t
    if family == "announce":
        return {"type": "engine_announce", "server_id": draw(st.sampled_from([SERVER, "s9"]) | st.text(max_size=8)),
                "model": draw(st_model), "awake": draw(st.booleans())}
    if family == "substrate_announce":
        return {"type": "substrate_announce", "server_id": draw(st.sampled_from([SERVER, "s9"]) | st.text(max_size=8))}
    if family == "substrate":
        if draw(st.booleans()):
            return {"type": "stage", "model": draw(st_model)}
        return {"type": "switch", "from_model": draw(st.none() | st_model), "to_model": draw(st_model)}
    if family == "run":
        return {"type": "run", "call": _admission_call(draw),
                "engine": {"hint": {"sim_output_tokens": draw(st_small_tokens)}},
                "reserved_tokens": draw(st.integers(min_value=0, max_value=10_000)), "reply_to": draw(st_reply_to),
                "waited_s": draw(st.floats(min_value=0, max_value=100)),
                "switch_wait_s": draw(st.floats(min_value=0, max_value=100)), "round_wait": draw(st.booleans())}
    if family == "control":
        kind = draw(st.sampled_from(CONTROL_KINDS))
        if kind in ("sleep", "list_calls"):
            return {"type": kind}
        if kind == "release_session":
            return {"type": kind, "session_id": draw(st_session)}
        if kind == "wake":
            return {"type": "wake", "kv_capacity_tokens": draw(st.integers(min_value=0, max_value=10**9)),
                    "host_kv": draw(st.dictionaries(st_session, st.integers(min_value=0, max_value=10**6), max_size=3))}
        if kind == "abort":
            return {"type": "abort", "call_id": draw(st_call_id)}
        return {"type": "protect", "session_id": draw(st_session), "on": draw(st.booleans())}
    raise AssertionError(family)


def _paths(obj: dict[str, Any]) -> list[tuple[str, ...]]:
    out = [(k,) for k in obj]
    for k, v in obj.items():
        if isinstance(v, dict) and k != "host_kv":
            out += [(k, kk) for kk in v]
    return out


def _set(obj: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


def _delete(obj: dict[str, Any], path: tuple[str, ...]) -> None:
    for k in path[:-1]:
        obj = obj[k]
    obj.pop(path[-1], None)


def _raw_marker(i: int) -> str:
    return f"\u0001RAW{i}\u0001"


def dumps(obj: Any) -> bytes:
    """JSON with Python's NaN/Infinity and verbatim `Raw` tokens (hostile on purpose)."""
    raws: list[str] = []

    def sub(o: Any) -> Any:
        if isinstance(o, Raw):
            raws.append(o.text)
            return _raw_marker(len(raws) - 1)
        if isinstance(o, dict):
            return {str(k): sub(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [sub(v) for v in o]
        return o

    text = json.dumps(sub(obj), allow_nan=True, ensure_ascii=False)
    for i, r in enumerate(raws):
        text = text.replace(json.dumps(_raw_marker(i), ensure_ascii=False), r)
    return text.encode("utf-8", "surrogatepass")


def _ids(obj: Any) -> set[str]:
    """Every call/session id a template carries (its keys would be named after them)."""
    out: set[str] = set()
    if isinstance(obj, dict):
        for k in ("call_id", "session_id"):
            if isinstance(obj.get(k), str):
                out.add(obj[k])
        if isinstance(obj.get("call"), dict):
            out |= _ids(obj["call"])
        if isinstance(obj.get("host_kv"), dict):
            out |= {k for k in obj["host_kv"] if isinstance(k, str)}
    return out


@dataclass
class Msg:
    key: str                    # subject key (SUBJECTS)
    payload: bytes              # with placeholders until finalised
    kind: str                   # how it was made (for the summary)
    ids: set[str] = field(default_factory=set)
    headers: dict[str, str] | None = None
    # filled in by `finalise`
    reply: str | None = None    # our inbox subject, for request-reply subjects
    verdict: str = ""           # "rejected" (exactly one ApiError) or how an accepted one is answered
    accepted: bool = False


@st.composite
def messages(draw: Any, key: str | None = None, kind: str | None = None, how: str = "", nth: int = 0) -> Msg:
    return defuse(draw(_messages(key, kind, how, nth)))


# Well-formed *forged* control-plane commands -- a run, Sleep/Wake, an executable switch, a CallFinished --
# are obeyed (these subjects trust their peers; NATS permissions keep agents off them, shared/auth.py),
# and obeying them puts the engines and the scheduler in states their peers never create (an engine
# asleep under running calls, a call finished twice...). That is peer trust, not input validation, so
# the fuzzer sends those commands only broken: `defuse` gives such a message an unknown tag (its one
# broken field). Everything else well-formed on those subjects (Abort, ProtectKv, ListCalls, a switch to
# an unknown model, staging...) and every well-formed message on the other subjects is sent as drawn.
def _forged_command(key: str, payload: bytes) -> bool:
    family = SUBJECTS[key][0]
    try:
        if family == "run":
            run_decoder.decode(payload)
            return True
        if family == "finished":
            finished_decoder.decode(payload)
            return True
        if family == "control":
            return isinstance(control_decoder.decode(payload), (_schema.Sleep, _schema.Wake))
        if family == "substrate":
            req = substrate_decoder.decode(payload)
            return (isinstance(req, SwitchRequest) and req.to_model in SERVED
                    and (req.from_model is None or req.from_model in SERVED))
    except (msgspec.MsgspecError, UnicodeDecodeError):
        return False
    return False


def defuse(m: Msg) -> Msg:
    if not _forged_command(m.key, m.payload):
        return m
    obj = msgspec.json.decode(m.payload)  # it decoded as a command, so it is a JSON object
    obj["type"] = str(obj.get("type", "")).upper() or "FORGED"
    m.payload = json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")
    m.kind += "+defused"
    assert not _forged_command(m.key, m.payload)
    return m


@st.composite
def _messages(draw: Any, key: str | None = None, kind: str | None = None, how: str = "", nth: int = 0) -> Msg:
    key = key or draw(st.sampled_from(list(SUBJECTS)))
    family = SUBJECTS[key][0]
    kind = kind or draw(st.sampled_from(
        ["bytes", "json", "unknown_tag", "foreign", "truncated", "valid", "broken", "broken", "broken", "broken",
         "broken", "broken", "missing", "replay"]))
    headers = None
    if draw(st.integers(0, 19)) == 0:
        headers = {"Talaria-Session": draw(st.sampled_from(HOSTILE_STRINGS[5:12]) | st.text(
            alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=":"), min_size=1, max_size=30)),
            "Talaria-Call": draw(st_call_id.filter(lambda s: s.isprintable() and ":" not in s and s.strip() == s and s))}
    if kind == "bytes":
        return Msg(key, draw(st.binary(max_size=300)), kind, headers=headers)
    if kind == "json":
        return Msg(key, dumps(draw(st_json)), kind, headers=headers)
    if kind == "huge":
        # near the 1 MiB max payload: one field (an id, a model, a subject...), a list, deep nesting, random bytes
        size = draw(st.integers(min_value=HUGE_MAX * 3 // 4, max_value=HUGE_MAX))
        t = _template(draw, family)
        if how == "idfield":  # the nth example pads the nth id-like field (the ones echoed in errors and logs)
            paths = [p for p in _paths(t) if p[-1] in ID_FIELDS] or _paths(t)
            _set(t, paths[nth % len(paths)], "A" * (size - 600))
            data = dumps(t)
        elif how == "field":
            _set(t, draw(st.sampled_from(_paths(t))), "A" * (size - 600))
            data = dumps(t)
        elif how == "list":  # a valid message with a huge unknown field (ignored, so accepted)
            _set(t, ("padding",), [1] * ((size - 600) // 3))
            data = dumps(t)
        elif how == "nest":
            depth = min(size // 2 - 10, 200_000)
            data = b"[" * depth + b"]" * depth
        elif how == "tokens" and family == "api":
            t = {"type": "call", "call_id": "fz-huge", "session_id": SEED_SESSION, "model": MODEL_A,
                 "prompt_tokens": 100, "prompt_token_ids": [7] * ((size - 600) // 3)}
            data = dumps(t)
        else:
            data = random.Random(draw(st.integers(min_value=0, max_value=2**32))).randbytes(size)
        return Msg(key, data[:HUGE_MAX], kind, ids=_ids(t), headers=headers)
    if kind == "unknown_tag":
        t = _template(draw, family)
        t["type"] = draw(st.sampled_from(["", "CALL", "call ", "error", "reply", "submitted", "switch_result",
                                          "control_ok", "evil"]) | st.text(max_size=15) | st_hostile)
        return Msg(key, dumps(t), kind, ids=_ids(t), headers=headers)
    if kind == "foreign":
        other = draw(st.sampled_from(sorted({f for f, _ in SUBJECTS.values()} - {family})))
        t = _template(draw, other)
        return Msg(key, dumps(t), kind, ids=_ids(t), headers=headers)
    if kind == "truncated":
        t = _template(draw, family)
        data = dumps(t)
        return Msg(key, data[:draw(st.integers(min_value=0, max_value=max(0, len(data) - 1)))], kind,
                   ids=_ids(t), headers=headers)
    if kind == "replay":
        # the seeded call's id again: as it was, on another session, for another model, or one field off
        t = {"type": "call", "call_id": SEED_CALL, "session_id": draw(st.sampled_from([SEED_SESSION, SEED_SESSION,
             *GHOST_SESSIONS])), "model": draw(st.sampled_from([MODEL_A, MODEL_A, MODEL_B, NOT_SERVED])),
             "prompt_tokens": 1200, "max_tokens": 64, "engine_hint": {"sim_output_tokens": 5}}
        if draw(st.booleans()):
            t["call_id"] = draw(st.sampled_from(FORGED_CALLS))
        if draw(st.booleans()):
            _set(t, draw(st.sampled_from(_paths(t))), draw(st_hostile))
        return Msg(key if family == "api" else "api.call", dumps(t), kind, ids=_ids(t), headers=headers)
    t = _template(draw, family)
    ids = _ids(t)
    if kind == "broken":
        path = draw(st.sampled_from(_paths(t)))
        _set(t, path, draw(st_hostile))
    elif kind == "missing":
        paths = [p for p in _paths(t) if p != ("type",)] or [("type",)]
        _delete(t, draw(st.sampled_from(paths)))
    elif draw(st.booleans()):  # valid, maybe with fields a newer peer would send
        t[draw(st.text(min_size=1, max_size=10).filter(lambda k: k != "type"))] = draw(st_json)
    return Msg(key, dumps(t), kind, ids=ids, headers=headers)


def draw_corpus() -> list[Msg]:
    corpus: list[Msg] = []
    common = settings(deadline=None, derandomize=True, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))

    @settings(common, max_examples=EXAMPLES)
    @given(st.data())
    def batch(data: st.DataObject) -> None:
        got = [data.draw(messages()) for _ in range(BATCH)]
        corpus.extend(got)  # only a whole batch (a draw that overruns never gets here)

    batch()
    # near the max payload: a few for every subject and every way of making one
    for key in SUBJECTS:
        hows = dict(HUGE_HOWS, tokens=1) if SUBJECTS[key][0] == "api" else HUGE_HOWS
        for how, n in hows.items():
            _huge_runner(common, n, key, how, corpus)()
    return corpus


def _huge_runner(common: settings, n: int, key: str, how: str, corpus: list[Msg]) -> Any:
    done: list[Msg] = []

    @settings(common, max_examples=n)
    @given(st.data())
    def huge(data: st.DataObject) -> None:
        done.append(data.draw(messages(key=key, kind="huge", how=how, nth=len(done))))
        corpus.append(done[-1])

    return huge


# -- the oracle: what the services must do with each message -------------------------------------------
def _served_call_ok(req: CallRequest, open_sessions: set[str]) -> bool:
    return (req.model in SERVED and req.prefix_tokens < req.prompt_tokens
            and req.prompt_tokens + 1 <= CONTEXT_LIMIT[req.model] and req.session_id in open_sessions)


def finalise(corpus: list[Msg], prefix: str) -> None:
    """Fill the placeholders, give each request its reply subject and decide what must come back."""
    for n, m in enumerate(corpus):
        if SUBJECTS[m.key][1]:
            m.reply = f"{INBOX}.{n}"
        m.payload = (m.payload.replace(P_PREFIX.encode(), prefix.encode())
                     .replace(P_SINK.encode(), f"{INBOX}.sink.{n}".encode())
                     .replace(P_INBOX.encode(), (m.reply or f"{INBOX}.sink.{n}").encode()))
        assert len(m.payload) < NATS_MAX_PAYLOAD - 4096, (m.key, m.kind, len(m.payload))
    # sessions a fuzzed message may have opened (conservative: whatever order they are handled in)
    open_sessions = {SEED_SESSION}
    for m in corpus:
        if SUBJECTS[m.key][0] == "api":
            try:
                req = api_request_decoder.decode(m.payload)
            except msgspec.MsgspecError:
                continue
            if isinstance(req, OpenSession) and req.model in SERVED:
                open_sessions.add(req.session_id)
    for m in corpus:
        family, rr = SUBJECTS[m.key]
        m.verdict, m.accepted = "rejected", False
        try:
            if family == "api":
                if len(m.payload) > MAX_MESSAGE_BYTES:
                    continue
                req = api_request_decoder.decode(m.payload)
                if isinstance(req, OpenSession):
                    m.accepted = req.model in SERVED
                    m.verdict = "one" if m.accepted else "rejected"
                elif isinstance(req, (EndSession, InfoRequest)):
                    m.accepted, m.verdict = True, "one"
                elif isinstance(req, CallRequest):
                    m.accepted = _served_call_ok(req, open_sessions)
                    if req.reply_to and req.reply_to != m.reply:
                        m.verdict = "elsewhere"  # answered on the body's reply_to, not our inbox
                    elif m.accepted:
                        m.verdict = "stream"     # accepted, heartbeats, reply (or a typed error)
            elif family == "submit":
                sub = admission_decoder.decode(m.payload)
                m.accepted = sub.call.model in SERVED
                m.verdict = "one" if m.accepted else "rejected"
            elif family == "substrate":
                req = substrate_decoder.decode(m.payload)
                if isinstance(req, StageRequest):
                    m.accepted, m.verdict = True, "none"   # staging is a hint: never answered
                else:
                    m.accepted = req.to_model in SERVED and (req.from_model is None or req.from_model in SERVED)
                    m.verdict = "one" if m.accepted else "rejected"
            elif family == "control":
                control_decoder.decode(m.payload)
                m.accepted, m.verdict = True, "one"
            else:
                if family != "substrate_announce":  # admission acts on any message there (no body)
                    {"finished": finished_decoder, "session_released": session_released_decoder,
                     "announce": engine_announce_decoder, "run": run_decoder}[family].decode(m.payload)
                m.accepted, m.verdict = True, "none"
        except (msgspec.MsgspecError, UnicodeDecodeError):
            m.accepted, m.verdict = False, "rejected"
        if not rr:
            m.verdict = "none"



# control replies: ControlOk, or an engine's state for ListCalls where the schema has it
CONTROL_OK = tuple(t for t in (ControlOk, getattr(_schema, "EngineState", None)) if t is not None)
control_any_decoder = msgspec.json.Decoder(CONTROL_OK[0] | CONTROL_OK[-1] | ApiError)
REPLY_DECODERS = {"api": api_reply_decoder, "submit": submit_reply_decoder, "substrate": switch_reply_decoder,
                  "control": control_any_decoder}


def check_replies(m: Msg, got: list[bytes]) -> str | None:
    """None if what came back on m's inbox is right, else why not."""
    family = SUBJECTS[m.key][0]
    if m.verdict in ("none", "elsewhere"):
        if m.verdict == "elsewhere" or not got:
            return None
        return f"expected no reply, got {len(got)}"
    if not got:
        return "no reply"
    decoder = call_event_decoder if m.verdict == "stream" else REPLY_DECODERS[family]
    try:
        out = [decoder.decode(d) for d in got]
    except msgspec.MsgspecError as exc:
        return f"undecodable reply {got[0][:200]!r}: {exc}"
    if m.verdict == "rejected":
        if len(out) != 1:
            return f"{len(out)} replies to a rejected message: {out[:3]}"
        if not isinstance(out[0], ApiError):
            return f"a rejected message was answered {out[0]!r}"
        if out[0].code == "internal":
            return f"internal error: {out[0].message}"
        return None
    if any(isinstance(o, ApiError) for o in out):
        if len(out) != 1:
            return f"an ApiError among {len(out)} replies: {out[:3]}"
        return f"internal error: {out[0].message}" if out[0].code == "internal" else None
    if m.verdict == "one":
        if len(out) != 1:
            return f"{len(out)} replies: {out[:3]}"
        ok = {"api": (SessionOpened, Ok, Info), "submit": (Submitted,), "substrate": (SwitchResult,),
              "control": CONTROL_OK}[family]
        return None if isinstance(out[0], ok) else f"answered {out[0]!r}"
    # a stream: accepted (or a duplicate served from the reply cache), then heartbeats and one reply
    if not isinstance(out[0], (CallAccepted, CallReply, CallQueued, CallRunning)):
        return f"call answered {out[0]!r}"
    finals = {msgspec.json.encode(msgspec.structs.replace(o, duplicate=False)) for o in out if isinstance(o, CallReply)}
    if len(finals) > 1:  # the same reply again (re-sent from the reply cache) is allowed, a second one is not
        return f"two different replies to one call: {finals}"
    return None


# -- the test --------------------------------------------------------------------------------------------
# keys a service writes under its own name (server/engine/model), never named after a call or session
SERVICE_OWN = ("lag:", "{placement}:", "servers", "adm:", "engine:", "kvblocks:")
ID_KEYS = ("call:", "reply:", "session:", "kv:", "resv:")


def key_id(rest: str) -> list[str]:
    """The ids a key (without the deployment prefix) may be named after."""
    for kind in ID_KEYS:
        if rest.startswith(kind):
            ident = rest[len(kind):]
            out = [ident]
            for suffix in (":gaps", ":outputs"):
                if kind == "session:" and ident.endswith(suffix):
                    out.append(ident[: -len(suffix)])
            if kind == "kv:" and ":blocks:" in ident:
                out.append(ident.rsplit(":blocks:", 1)[0])
            if kind in ("call:", "reply:"):  # "<session>:<call>": either may hold a ':' of its own
                out += [part for i, ch in enumerate(ident) if ch == ":" for part in (ident[:i], ident[i + 1:])]
            return out
    return []


async def _keys(r: aioredis.Redis, prefix: str) -> set[str]:
    return {k.decode("utf-8", "surrogateescape") async for k in r.scan_iter(match=f"{prefix}*", count=1000)}


async def test_fuzz_every_subject(nats_server: NatsServer, redis_server: RedisServer, tmp_path: Path) -> None:
    t_start = time.monotonic()
    prefix, key_prefix = f"tfz{uuid.uuid4().hex[:6]}", f"tfz-{uuid.uuid4().hex[:6]}:"
    svc = Services(nats_server.url, redis_server.url, prefix, key_prefix, tmp_path / "logs")
    svc.group.start_all()  # the services import while hypothesis draws the corpus
    try:
        t0 = time.monotonic()
        corpus = draw_corpus()
        finalise(corpus, prefix)
        t_draw = time.monotonic() - t0
        await svc.wait_healthy()
        r = aioredis.Redis.from_url(redis_server.url)
        nc = await nats.connect(nats_server.url, connect_timeout=5, pending_size=256 * 1024 * 1024)
        try:
            # a real session and call, so replays of its id hit a live session and a cached reply
            async with await TalariaClient.connect(nats_server.url, subject_prefix=prefix, silence_s=10.0,
                                                   retries=1) as client:
                sess = await client.open_session(MODEL_A, session_id=SEED_SESSION)
                seed = await asyncio.wait_for(sess.call(prompt_tokens=1200, max_tokens=64, sim_output_tokens=5,
                                                        call_id=SEED_CALL), timeout=30)
                assert seed.output_tokens == 5
            before = await _keys(r, key_prefix)
            records = await CallRecords.open(nc, prefix, replicas=1, ttl_s=CALL_TTL_S)
            seed_reply = await records.answered_reply(SEED_SESSION, SEED_CALL)
            assert seed_reply is not None

            # -- send ------------------------------------------------------------------------
            replies: dict[int, list[bytes]] = defaultdict(list)
            strays: list[str] = []

            async def on_reply(msg: Any) -> None:
                tail = msg.subject[len(INBOX) + 1:]
                if tail.isdigit():
                    replies[int(tail)].append(msg.data)
                elif not tail.startswith("sink."):
                    strays.append(msg.subject)

            sub = await nc.subscribe(f"{INBOX}.>", cb=on_reply, pending_msgs_limit=-1, pending_bytes_limit=-1)
            expected = [n for n, m in enumerate(corpus) if m.verdict in ("rejected", "one", "stream")]
            t1 = time.monotonic()
            sent = Counter()
            for n, m in enumerate(corpus):
                await nc.publish(subject_of(m.key, prefix), m.payload, reply=m.reply or "", headers=m.headers)
                sent[m.key] += 1
                if n % SEND_WINDOW == SEND_WINDOW - 1:
                    # let the services catch up: wait (bounded) for the window's replies
                    await nc.flush(timeout=10)
                    window = [i for i in expected if n - 2 * SEND_WINDOW < i <= n - SEND_WINDOW]
                    deadline = time.monotonic() + 10
                    while any(i not in replies for i in window) and time.monotonic() < deadline:
                        await asyncio.sleep(0.01)
            await nc.flush(timeout=10)
            t_sent = time.monotonic() - t1
            deadline = time.monotonic() + REPLY_WAIT_S
            while any(i not in replies for i in expected) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(SETTLE_S)  # room for a (wrong) second reply
            t_replies = time.monotonic() - t1

            # -- (1) alive and healthy -------------------------------------------------------------
            for name in svc.names:
                assert svc.group.running(name), f"{name} died:\n{svc.log_tail(name, 40)}"
                await health(nc, prefix, name, 10.0, svc)

            # -- (2) exactly one typed reply per request ---------------------------------------------
            failures = []
            for n, m in enumerate(corpus):
                why = check_replies(m, replies.get(n, []))
                if why:
                    failures.append(f"#{n} {m.key} [{m.kind}/{m.verdict}] {m.payload[:160]!r}: {why}")
            assert not strays, strays[:10]
            assert not failures, f"{len(failures)} bad replies:\n" + "\n".join(failures[:25])

            # -- (3) nothing written for a rejected request ------------------------------------------
            after = await _keys(r, key_prefix)
            accepted_ids = {SEED_SESSION, SEED_CALL}
            rejected_ids: set[str] = set()
            for m in corpus:
                (accepted_ids if m.accepted else rejected_ids).update(m.ids)
                if m.accepted:  # ids as the services decoded them (a template's ids may have been mutated)
                    with_ids = _decoded_ids(m)
                    accepted_ids |= with_ids
            bad_keys = []
            new_keys = sorted(after - before)
            own_keys = 0
            for k in new_keys:
                rest = k[len(key_prefix):]
                if rest.startswith(SERVICE_OWN):
                    own_keys += 1
                    continue
                ids = key_id(rest)
                if not ids or not any(i in accepted_ids for i in ids):
                    origin = "rejected" if any(i in rejected_ids for i in ids) else "unknown"
                    bad_keys.append(f"{k} ({origin})")
            assert not bad_keys, f"keys written for rejected requests: {bad_keys[:20]}"
            assert await records.answered_reply(SEED_SESSION, SEED_CALL) == seed_reply  # the stored reply is untouched

            # -- (4) clean logs -------------------------------------------------------------------------
            for name in svc.names:
                text = (svc.log_dir / f"{name}.log").read_text(errors="replace")
                bad = [ln for ln in text.split("\n") if _failure_line(ln)]
                assert not bad, f"{name}: {len(bad)} failure lines, e.g.\n" + "\n".join(b[:1500] for b in bad[:5])

            await sub.unsubscribe()
        finally:
            await nc.close()
            await r.aclose()
        # -- summary ----------------------------------------------------------------------------------
        kinds = Counter(m.kind for m in corpus)
        verdicts = Counter(m.verdict for m in corpus)
        accepted = sum(m.accepted for m in corpus)
        total_bytes = sum(len(m.payload) for m in corpus)
        print(f"\nfuzz: {len(corpus)} messages, {total_bytes / 1e6:.1f} MB, "
              f"{sum(len(v) for v in replies.values())} replies; drew the corpus in {t_draw:.1f} s, "
              f"sent in {t_sent:.1f} s, replies settled in {t_replies:.1f} s, "
              f"total {time.monotonic() - t_start:.1f} s")
        for k in SUBJECTS:
            print(f"  {subject_of(k, prefix):<48} {sent[k]:>6}")
        print(f"  kinds: {dict(sorted(kinds.items()))}")
        print(f"  verdicts: {dict(sorted(verdicts.items()))}, accepted (valid) messages: {accepted}")
        print(f"  redis: {len(new_keys)} new keys ({own_keys} the services' own, {len(new_keys) - own_keys} "
              f"named after ids of accepted messages), none for a rejected one")
        assert len(corpus) >= 10_000
        assert all(sent[k] > 0 for k in SUBJECTS)
    finally:
        await svc.stop()


def _decoded_ids(m: Msg) -> set[str]:
    try:
        obj = msgspec.json.decode(m.payload)
    except (msgspec.MsgspecError, RecursionError):  # untyped: deep nesting recurses (typed decoders stop at once)
        return set()
    return _ids(obj)
