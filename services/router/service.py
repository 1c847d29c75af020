"""router: the agent API's front door (a NATS queue group; stateless but for
a moment's memory of its own placements, which a restart may lose at no cost).

Validates each request (typed errors for anything wrong), deduplicates call
ids, reads the session and the servers' state from Redis, adds the calls that
any router replica placed and a server's mirror does not count yet (the
server's shared in-flight hash, and this router's own placements until that
hash holds them), ranks placements with the pure `placement.rank`, logs the
candidates and scores on one line, records the placement in the shared hash
and forwards the call to the chosen server's admission.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from redis.exceptions import NoScriptError, RedisError

from services.router.placement import InFlight, InFlightPlacements, ServerView, rank, server_view, with_in_flight
from shared import state, tracing
from shared.bus import AGENT_REQUEST_REDIS_WAIT_S, ServiceProcess, run_service, trace_headers
from shared.keys import CALL_TTL_S, SESSION_TTL_S
from shared.policy import DECISION_HISTORY
from shared.prompt_store import PromptStore
from shared.subjects import AGENT_FACING_NAMESPACES, GATEWAY_NAMESPACE
from shared.schema import (
    MAX_MESSAGE_BYTES, AdmissionCall, ApiError, CallAccepted, CallReceived, CallRecord, CallRequest, EndSession, Info, InfoRequest, Ok,
    EnginePayload, MoveCall, OpenSession, PromptRef, SessionOpened, SessionReleased, SubmitCall, Submitted, api_request_decoder,
    encode, move_decoder, reply_decoder, submit_reply_decoder,
)

# wall seconds a submit may go unanswered: admission answers within its durable write's
# 0.5-s bound, so more means the process is gone (a submit delivered to an admission that
# was just killed waited out 5 s, and its agent's call 6 s, in a 200x chaos run); the
# agent is told no_capacity and asks again, which the call record makes safe
SUBMIT_TIMEOUT_WALL_S = 1.5
ADMISSION_RESTART_WAIT_WALL_S = 4.0  # how long servers whose admission does not answer are asked again
ADMISSION_RETRY_EVERY_WALL_S = 0.25
KV_HOME_WAIT_WALL_S = 1.0  # how long a continuation waits for the admission of the server holding its KV before moving
NO_CAPACITY_RETRY_AFTER_S = 1.0  # wall seconds an agent should wait before asking again
# a handed-back call whose record moved on meanwhile stays where it is (router.move's answer)
_RECORD_MOVED_ON = ApiError(code="no_capacity", message="its call record moved on (claimed, answered or placed again)")
PLACEMENT_ATTEMPTS = 4  # snapshots a placement may take when other replicas keep placing; the last one lands anyway
# KEYS: the placement sequence, the chosen server's in-flight hash, the placement log;
# ARGV: the sequence the ranking read ('' = unconditionally), call id, InFlight value,
# TTL, this placement's token, then the tokens of this router's placements the ranking
# counted but its snapshot may not hold. Writes the placement only if every placement
# since that read is one of those (no other replica's: its calls would be uncounted);
# every write advances the sequence and logs its token.
PLACEMENT_LOG_LEN = 256  # placements the log keeps: a snapshot older than that reads again
PLACE_SCRIPT = (
    "local cur = tonumber(redis.call('GET', KEYS[1]) or '0') "
    "if ARGV[1] ~= '' then "
    "  local n = cur - tonumber(ARGV[1]) "
    "  if n < 0 or n > #ARGV - 5 then return 0 end "
    "  if n > 0 then "
    "    local own = {} for i = 6, #ARGV do own[ARGV[i]] = true end "
    "    local log = redis.call('LRANGE', KEYS[3], -n, -1) "
    "    if #log < n then return 0 end "
    "    for _, t in ipairs(log) do if not own[t] then return 0 end end "
    "  end "
    "end "
    "redis.call('INCR', KEYS[1]) redis.call('RPUSH', KEYS[3], ARGV[5]) "
    f"redis.call('LTRIM', KEYS[3], -{PLACEMENT_LOG_LEN}, -1) "
    "redis.call('HSET', KEYS[2], ARGV[2], ARGV[3]) redis.call('EXPIRE', KEYS[2], ARGV[4]) return 1")

# The servers' snapshot in one command: the placement sequence, then per server its
# in-flight hash and the fields of its mirror that placement reads (KEYS: the sequence,
# then each server's in-flight hash and mirror; ARGV: state.PLACEMENT_FIELDS). As a
# pipeline it was 1 + 2 per server commands a call, each packed and parsed by the
# router (33 at 16 servers). Read atomically, so no call moves from a server's
# in-flight hash to its mirror between the two reads.
SNAPSHOT_SCRIPT = (
    "local out = {redis.call('GET', KEYS[1])} "
    "for i = 2, #KEYS, 2 do "
    "  out[i] = redis.call('HGETALL', KEYS[i]) "
    "  out[i + 1] = redis.call('HMGET', KEYS[i + 1], unpack(ARGV)) "
    "end "
    "return out")


@dataclass(frozen=True, slots=True)
class PendingPlacement:
    """A placement ranked and counted by this router whose write has not landed yet."""

    server_id: str
    call: InFlight
    expect_seq: str | None
    counted: tuple[str, ...]
    landed: asyncio.Future[bool]


IN_FLIGHT_MAX_WALL_S = 2.0  # forget an in-flight placement the mirror never counted (e.g. admission restarted)
ENGINE_STATES_TTL_WALL_S = 2.0  # how long what the engine-workers wrote (context limits, starting or draining) is reused
ENGINE_STATES_READ_WALL_S = 1.0  # ... and how long a fresh read may take (Redis away: the last known ones serve)
CALL_RECORD_WATCH_WALL_S = 10.0  # how often the router reads the call record bucket's size for the metrics
ENGINE_AWAY_STATES = frozenset({"starting", "draining"})  # an engine hash's states with no engine to run a call


class Router(ServiceProcess):
    name = "router"
    # agents wait 5 s for an answer: past this a Redis outage is `unavailable` with a time to retry
    redis_outage_wait_s = AGENT_REQUEST_REDIS_WAIT_S
    uses_call_records = True
    per_server = False

    async def setup(self) -> None:
        self.served = set(self.settings.models)
        # calls placed on each server that its mirror may not count yet (shared and own)
        self.in_flight = InFlightPlacements(max_age=IN_FLIGHT_MAX_WALL_S)
        self._placing = asyncio.Lock()  # this router's placements, one at a time (_place_and_submit)
        self.start_placement_writes()
        # loaded before the first call: otherwise the first calls' snapshots each pay a
        # refused EVALSHA and a load (a Redis that restarts empty later is still handled)
        try:
            for script in (PLACE_SCRIPT, SNAPSHOT_SCRIPT):
                await self.redis.script_load(script)
        except Exception as exc:  # Redis away at start: the router still starts, and loads them on first use
            self.log.warning("router.scripts_not_loaded", error=str(exc))
        self._engine_states: tuple[float, dict[str, int], dict[str, frozenset[str]]] = (float("-inf"), {}, {})
        # every agent-facing namespace's store of prompts sent by reference (the router creates them)
        await PromptStore(self.nc, self.settings.subject_prefix).create(
            list(AGENT_FACING_NAMESPACES), replicas=self.settings.call_record_replicas, ttl_s=CALL_TTL_S,
            max_bytes=self.settings.prompt_store_max_bytes)
        self.metrics.call_record_max_bytes.labels(self.call_records.bucket).set(self.settings.call_record_max_bytes)
        self.spawn(self.call_record_watch(), "call-record-watch")
        received = encode(CallReceived())
        for subject in self.subjects.api_requests:
            # each request in its own task: one waiting on a dead admission must not hold up the rest;
            # a call is acknowledged as it is taken (its agent sends it again when nothing comes)
            receipt = received if subject == self.subjects.api_call("*") else None
            await self.nc.subscribe(subject, queue="router", cb=self.concurrent_handler(self.on_api, "api", receipt=receipt))
        await self.nc.subscribe(self.subjects.call_move, queue="router", cb=self.concurrent_handler(self.on_move, "move"))

    async def call_record_watch(self) -> None:
        """The call record bucket's bytes and its oldest record's age on the metrics, every
        CALL_RECORD_WATCH_WALL_S: a bucket at its bound drops its oldest records early."""
        while True:
            try:
                size, oldest = await self.call_records.usage()
                self.metrics.call_record_bytes.labels(self.call_records.bucket).set(size)
                if oldest is not None:  # (unread: the last reading stands, not a 0 that reads as dropping)
                    self.metrics.call_record_oldest_age.labels(self.call_records.bucket).set(oldest)
            except Exception as exc:  # noqa: BLE001 - NATS away: the next look
                self.log.debug("router.call_record_unread", error=type(exc).__name__)
            await asyncio.sleep(CALL_RECORD_WATCH_WALL_S)

    async def on_api(self, msg: Msg) -> None:
        if len(msg.data) > MAX_MESSAGE_BYTES:
            await self.reply_error(msg.reply, "too_large", f"message of {len(msg.data)} bytes exceeds {MAX_MESSAGE_BYTES}")
            return
        # the namespace is the subject's: in an authenticated deployment only its user can publish there
        ns = self.subjects.api_namespace(msg.subject)
        try:
            req = api_request_decoder.decode(msg.data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            await self._answer_malformed(msg, exc, ns)
            return
        if ns is None and not isinstance(req, InfoRequest):
            await self.reply_error(msg.reply, "malformed", f"{msg.subject}: not an agent API subject")
            return
        match req:
            case CallRequest():
                with tracing.span("router.place", tracing.traceparent_of(msg.headers),
                                  attributes=tracing.call_attributes(req.model, req.session_id, req.call_id)):
                    await self.on_call(req, msg, ns)
            case OpenSession(session_id=sid, model=model):
                # only the gateway speaks for tenants; any other agent's tenant is its namespace
                await self.on_open(sid, model, msg.reply, ns,
                                   tenant=req.tenant if ns == GATEWAY_NAMESPACE and req.tenant else ns)
            case EndSession(session_id=sid):
                await self.on_end(sid, msg.reply, ns)
            case InfoRequest():
                if msg.reply:
                    s = self.settings
                    limits = {m: await self.prompt_limit(m) for m in s.models if m in self.catalog.models}
                    await self.nc.publish(msg.reply, encode(Info(time_scale=s.time_scale, clock_epoch=s.clock_epoch,
                                                                 policy=s.policy.name, servers=s.servers, models=s.models,
                                                                 context_limits=limits)))

    async def _answer_malformed(self, msg: Msg, exc: Exception, namespace: str | None) -> None:
        """A request that does not validate: answer on its request-reply subject, or,
        for a call, on the reply subject it names, so the agent hears it at once."""
        reply = msg.reply
        call_id: str | None = None
        if not reply:
            try:  # read leniently: the fields that failed may be any others
                raw = msgspec.json.decode(msg.data)
            except msgspec.DecodeError:
                raw = None
            to = raw.get("reply_to") if isinstance(raw, dict) else None
            if (isinstance(to, str) and len(to) <= 1024 and namespace is not None
                    and self.subjects.is_reply_inbox(to, namespace)):
                reply = to
                cid = raw.get("call_id")  # type: ignore[union-attr]
                call_id = cid if isinstance(cid, str) else None
        what = "api" if isinstance(exc, msgspec.ValidationError) else "api: not a valid message"
        await self.reply_error(reply, "malformed", f"{what}: {exc}", call_id)

    async def engine_limits(self) -> dict[str, int]:
        """Per served model, the smallest context limit its running engines report (the vLLM
        engine-worker writes it; a model whose engines report none is absent)."""
        return (await self.engine_states())[0]

    async def engines_away(self, fresh: bool = False) -> dict[str, frozenset[str]]:
        """Per server, the models whose engine-worker there says it is starting or draining
        (a rolling restart: under vLLM, minutes without an engine to run the call)."""
        return (await self.engine_states(fresh))[1]

    async def engine_states(self, fresh: bool = False) -> tuple[dict[str, int], dict[str, frozenset[str]]]:
        """What the engine-workers write in their hashes, read at most every
        ENGINE_STATES_TTL_WALL_S (`fresh`: now): the context limits and the engines away."""
        at, limits, away = self._engine_states
        if not fresh and time.monotonic() - at < ENGINE_STATES_TTL_WALL_S:
            return limits, away
        pairs = [(srv, m) for srv in self.settings.servers for m in sorted(self.served)]
        pipe = self.redis.pipeline(transaction=False)
        for srv, m in pairs:
            pipe.hmget(self.keys.engine(srv, m), ["context_limit", "state"])
        try:
            # (Redis away: its commands retry for seconds, and `api.info` would not be answered)
            raws = await asyncio.wait_for(pipe.execute(), ENGINE_STATES_READ_WALL_S)
        except (asyncio.TimeoutError, RedisError) as exc:
            self.log.warning("router.engine_limits_unread", error=type(exc).__name__, using="the last known")
            # reused as if read: each request would otherwise wait the read out again, and log it
            self._engine_states = (time.monotonic(), limits, away)
            return limits, away
        limits, away_pairs = {}, {}
        for (srv, m), (raw_limit, raw_state) in zip(pairs, raws):
            if raw_limit is not None and int(raw_limit) > 0:
                limits[m] = min(limits.get(m, int(raw_limit)), int(raw_limit))
            if raw_state is not None and raw_state.decode() in ENGINE_AWAY_STATES:
                away_pairs.setdefault(srv, set()).add(m)
        away = {srv: frozenset(ms) for srv, ms in away_pairs.items()}
        if away != self._engine_states[2]:
            self.log.info("router.engines_away", engines={srv: sorted(ms) for srv, ms in away.items()})
        self._engine_states = (time.monotonic(), limits, away)
        return limits, away

    async def prompt_limit(self, model: str) -> int:
        """What a call carrying its real prompt may use: the engines' limit, else the catalog's."""
        return (await self.engine_limits()).get(model, self.catalog.model(model).context_limit)

    def _model_error(self, model: str) -> str | None:
        if model not in self.catalog.models:
            # (the served ones: a catalog model this deployment does not serve would be refused next)
            return f"unknown model {model!r}; this deployment serves {sorted(self.served)}"
        if model not in self.served:
            return f"model {model!r} is not served by this deployment (serving {sorted(self.served)})"
        return None

    async def _owner(self, sid: str) -> tuple[str | None, str | None]:
        """The session's (model, owner) from Redis, else from the durable record."""
        model, owner = await self.redis.hmget(self.keys.session(sid), ["model", "owner"])
        if model is not None:
            return model.decode(), owner.decode() if owner is not None else None
        record = await self.call_records.open_session_record(sid)
        return (record.model, record.owner) if record is not None else (None, None)

    async def on_open(self, sid: str, model: str, reply: str | None, ns: str, tenant: str) -> None:
        if (err := self._model_error(model)) is not None:
            await self.reply_error(reply, "unknown_model", err)
            return
        existing, owner = await self._owner(sid)
        if owner is not None and owner != ns:
            # another namespace's session: an id is not a way in (and two tenants never share one)
            self.log.warning("session.refused", session_id=sid, reason="another namespace's", namespace=ns)
            await self.reply_error(reply, "malformed", f"session id {sid} is taken: choose another")
            return
        if existing is not None and existing != model:
            await self.reply_error(reply, "malformed", f"session {sid} is open for {existing}, not {model}")
            return
        pipe = self.redis.pipeline(transaction=False)
        state.open_session(pipe, self.keys, sid, model, ns, tenant)
        await pipe.execute()
        await self.call_records.open_session(sid, model, ns, tenant)
        self.log.info("session.opened", session_id=sid, model=model, namespace=ns)
        if reply:
            await self.nc.publish(reply, encode(SessionOpened(
                session_id=sid, model=model, context_limit=self.catalog.model(model).context_limit,
                engine_context_limit=(await self.engine_limits()).get(model))))

    async def on_end(self, sid: str, reply: str | None, ns: str) -> None:
        model, owner = await self._owner(sid)
        if owner is not None and owner != ns:
            self.log.warning("session.refused", session_id=sid, reason="another namespace's", namespace=ns)
            await self.reply_error(reply, "unknown_session", f"session {sid} is not open")
            return
        started = await self.redis.hget(self.keys.session(sid), "started_at")
        if model is not None and started is not None:
            self.metrics.session_duration.labels(model=model).observe(max(0.0, self.clock.now() - float(started)))
        await self.nc.publish(self.subjects.session_released, encode(SessionReleased(
            session_id=sid, reason="ended", model=model)))
        await self.call_records.end_session(sid)
        self.log.info("session.ended", session_id=sid)
        if reply:
            await self.nc.publish(reply, encode(Ok()))

    async def on_call(self, req: CallRequest, msg: Msg, ns: str) -> None:
        reply_to = req.reply_to or msg.reply
        with structlog.contextvars.bound_contextvars(session_id=req.session_id, call_id=req.call_id):
            if not reply_to:
                self.log.warning("call.rejected", reason="no reply subject")
                return
            if req.reply_to and not self.subjects.is_reply_inbox(req.reply_to, ns):
                # replies go to the caller's own namespace only (never into another agent's inbox)
                self.log.warning("call.rejected", reason="reply subject outside its namespace", namespace=ns)
                await self.reply_error(msg.reply, "malformed",
                                       f"reply_to must be under {self.subjects.reply_namespace(ns)}.", req.call_id)
                return
            if (err := self._model_error(req.model)) is not None:
                await self.reply_error(reply_to, "unknown_model", err, req.call_id)
                return
            spec = self.catalog.model(req.model)
            if req.prefix_tokens >= req.prompt_tokens:
                await self.reply_error(reply_to, "malformed", "prefix_tokens must be smaller than prompt_tokens", req.call_id)
                return
            # a real prompt must fit the engines that run it; a trace's counts, the catalog's model
            inline = req.prompt_text is not None or req.prompt_token_ids is not None
            if inline and req.prompt_ref is not None:
                await self.reply_error(reply_to, "malformed", "send the prompt inline or by prompt_ref, not both",
                                       req.call_id)
                return
            real = inline or req.prompt_ref is not None
            limit = await self.prompt_limit(req.model) if real else spec.context_limit
            if req.prompt_tokens + 1 > limit:
                await self.reply_error(reply_to, "context_limit",
                                       f"prompt of {req.prompt_tokens} tokens exceeds {req.model}'s context limit of {limit}",
                                       req.call_id)
                return
            session = state.decode_session(await self.redis.hgetall(self.keys.session(req.session_id)))
            if session.model is None and (opened := await self.call_records.open_session_record(req.session_id)):
                # open, but the store restarted empty: its hash again from the durable record
                pipe = self.redis.pipeline(transaction=False)
                state.open_session(pipe, self.keys, req.session_id, opened.model, opened.owner,
                                   opened.tenant or opened.owner)
                pipe.hgetall(self.keys.session(req.session_id))
                session = state.decode_session((await pipe.execute())[-1])
                self.log.warning("session.restored", model=opened.model, source="call record")
            if session.model is not None and session.owner is not None and session.owner != ns:
                self.log.warning("session.refused", reason="another namespace's", namespace=ns)
                session = msgspec.structs.replace(session, model=None)  # answered as any unknown session
            if session.model is None:
                # (a hash with no model: the store restarted empty and an engine wrote to it since)
                await self.reply_error(reply_to, "unknown_session", f"session {req.session_id} is not open (open it first)", req.call_id)
                return
            if session.model != req.model:
                await self.reply_error(reply_to, "malformed", f"session {req.session_id} is open for another model", req.call_id)
                return
            # at most once per call_id: the first placement wins, a retry gets the reply or a fresh ack
            revision = await self.call_records.create(req.session_id, req.call_id, CallRecord(state="placing"))
            if revision is None:
                await self._place_known(req, reply_to, session, ns)
                return
            await self._place_and_submit(req, reply_to, session, ns, revision=revision)

    async def _place_known(self, req: CallRequest, reply_to: str, session: state.SessionRecord, ns: str) -> None:
        """A call id the call record holds already: its stored reply, or submitted again."""
        record, current = await self.call_records.get(req.session_id, req.call_id)
        if record is not None and record.state == "answered" and record.reply is not None:
            dup = msgspec.structs.replace(reply_decoder.decode(record.reply), duplicate=True)
            await self.nc.publish(reply_to, encode(dup))
            self.log.info("call.duplicate", served_from="call-record")
            return
        # in flight, or lost with a process that held it: submit again under the same id,
        # to the server that took it (another server's engine would run it a second time)
        pinned = record.server_id if record is not None else None
        self.log.info("call.duplicate", served_from="resubmitted", pinned_to=pinned)
        # (a placement that never finished, by a router that died: this one records it)
        unplaced = current if record is not None and record.state == "placing" else 0
        await self._place_and_submit(req, reply_to, session, ns, retry=True, pinned=pinned, revision=unplaced)

    async def _place_and_submit(self, req: CallRequest, reply_to: str, session: state.SessionRecord, ns: str,
                                retry: bool = False, pinned: str | None = None, revision: int = 0) -> None:
        """Place and submit a call. `retry`: the same call id again, with no reply
        yet (e.g. the admission that held it restarted): submit it again without
        counting it twice in the session's history; admission and the engine
        both deduplicate by call id. `pinned`: the server that took it, the only
        one it may go to (if that one cannot take it now, the agent retries later).
        `revision`: the call record this placement created (a first placement)."""
        now = self.clock.now()
        last_finish = session.last_finish
        calls_before = session.calls - (1 if retry else 0)
        new_session = calls_before <= 0 and not retry
        pipe = self.redis.pipeline(transaction=False)
        if last_finish is not None and calls_before > 0 and not retry:
            pipe.rpush(self.keys.session_gaps(req.session_id), f"{max(0.0, now - last_finish):.4f}")
            pipe.ltrim(self.keys.session_gaps(req.session_id), -DECISION_HISTORY, -1)  # (all a decision reads)
        if not retry:
            state.count_call(pipe, self.keys, req.session_id)
        if calls_before == 0 and not retry:
            state.mark_started(pipe, self.keys, req.session_id, now)
        pipe.lrange(self.keys.session_gaps(req.session_id), -DECISION_HISTORY, -1)
        pipe.lrange(self.keys.session_outputs(req.session_id), -DECISION_HISTORY, -1)
        pipe.hgetall(self.keys.kv_locality(req.session_id))
        pipe.get(self.keys.reservation(req.session_id))
        pipe.expire(self.keys.session_gaps(req.session_id), SESSION_TTL_S)
        # every server's mirrored state in the same round trip: fewer hops, less
        # wall latency, which a scaled clock multiplies
        n = self._queue_server_reads(pipe)
        read_wall = time.time()
        read, results = await self._execute_read(pipe)
        server_raw = results[len(results) - n:]
        results = results[: len(results) - n]
        gaps_raw, outputs_raw, kv_raw, resv_raw = results[-5], results[-4], results[-3], results[-2]
        reserved_on = resv_raw.decode().split("|", 1)[0] if resv_raw else None
        kv = {k.decode(): v.decode() for k, v in kv_raw.items()}
        # optimistic concurrency between router replicas: the placement lands only if
        # no other replica placed a call since this snapshot; else read again and rank again.
        # This router's own placements are ranked one at a time, each knowing every one
        # before it, and written in that order (one pipeline for all that queued meanwhile),
        # so they never refuse each other (under load they did, three times in
        # four); a snapshot read again is read under the lock, so only another replica's
        # placement (or one this router has forgotten, from a snapshot that waited over
        # IN_FLIGHT_MAX_WALL_S) refuses it; a first snapshot that old is read again before
        # ranking (past saturation nearly every call waited that long, and its write was refused)
        attempt, raw = 0, server_raw
        ranked: list[Any] = []
        away = await self.engines_away()  # (cached: a read every few seconds at most)
        # the call record names the first choice while its placement's write lands (two
        # waits side by side, not one after the other: the call is counted in flight meanwhile)
        recording: tuple[str, asyncio.Task[int | None]] | None = None
        try:
            for attempt in range(1, PLACEMENT_ATTEMPTS + 1):
                landed: asyncio.Future[bool] | None = None
                async with self._placing:
                    reread = attempt > 1
                    if not reread and time.time() - read_wall >= IN_FLIGHT_MAX_WALL_S:
                        self.in_flight.end_read(read)  # (that snapshot is never ranked on)
                        reread = True
                    if reread:
                        pipe = self.redis.pipeline(transaction=False)
                        self._queue_server_reads(pipe)  # the only reads in this pipeline: no count needed
                        read, raw = await self._execute_read(pipe)
                    seq, views, counted = self._server_views(raw, read, kv, reserved_on, away)
                    # placed now (its age is the in-flight entry's: one that waited for the lock is not stale)
                    placement = InFlight(req.call_id, req.model, req.prompt_tokens, time.time())
                    ranked = rank(req.model, views, self.settings.policy, session_id=req.session_id,
                                  call_id=req.call_id, prompt_tokens=req.prompt_tokens, prefix_tokens=req.prefix_tokens)
                    if pinned is not None:
                        ranked = [c for c in ranked if c.server_id == pinned]
                    if ranked:
                        # counted here at once, so the next ranking counts it; written after the lock
                        last = attempt == PLACEMENT_ATTEMPTS or pinned is not None
                        landed = self._queue_placement(ranked[0].server_id, placement,
                                                       expect_seq=None if last else seq, counted=counted)
                if ranked and revision and recording is None:
                    recording = (ranked[0].server_id, asyncio.ensure_future(self.call_records.update(
                        req.session_id, req.call_id, CallRecord(state="placed", server_id=ranked[0].server_id), revision)))
                if landed is None or await landed or pinned is not None:
                    break
        finally:  # (a call cancelled while it waited for the lock leaves no snapshot open)
            self.in_flight.end_read(read)
        self.log.info("router.placed", model=req.model, at=round(now, 3), attempts=attempt,
                      candidates=[{"server": c.server_id, "score": round(c.score, 3), "residency": c.residency,
                                   "kv": c.kv, "pressure": round(c.pressure, 2), "contention": c.contention}
                                  for c in ranked])
        call = AdmissionCall(
            call_id=req.call_id, session_id=req.session_id, model=req.model, prompt_tokens=req.prompt_tokens,
            prefix_tokens=req.prefix_tokens, max_tokens=req.max_tokens, arrived_at=now,
            continuation=calls_before > 0, gap_history=tuple(float(x) for x in gaps_raw),
            output_history=tuple(int(x) for x in outputs_raw),
            session_started_at=session.started_at if session.started_at is not None else now,
            tenant=session.tenant or session.owner or "",
        )
        sub = SubmitCall(call=call, reply_to=reply_to, traceparent=tracing.current_traceparent(), engine=EnginePayload(
            prompt_text=req.prompt_text, prompt_token_ids=req.prompt_token_ids, hint=req.engine_hint, stream=req.stream,
            sampling=req.sampling,
            # the prompt store read is the caller's own namespace's, whatever the caller says
            prompt_ref=PromptRef(namespace=ns, name=req.prompt_ref) if req.prompt_ref is not None else None))
        # an admission that does not answer is restarting (its liveness watch replaces a dead one
        # within a couple of seconds): those servers are asked again for a while, so a call, a
        # continuation above all, is not refused as if every server were full
        candidates, passes = list(ranked), 0
        refused: ApiError | None = None
        restart_deadline = time.monotonic() + ADMISSION_RESTART_WAIT_WALL_S
        # a continuation whose first choice holds its KV asks that server alone for a moment
        # before the others: a restarting admission is back within it (a chaos probe saw
        # 43 calls moved by restarts of 0.1-0.4 s, re-prefilling up to 82k tokens elsewhere
        # and switching the model there in 8 of them)
        home_until = (time.monotonic() + KV_HOME_WAIT_WALL_S
                      if calls_before > 0 and ranked and ranked[0].kv != "none" else 0.0)
        while True:
            home_only = len(candidates) > 1 and time.monotonic() < home_until
            trying = candidates[:1] if home_only else candidates
            unreachable = await self._submit_to(trying, passes, req, reply_to, session, ns, sub, placement,
                                                revision, recording, retry)
            if unreachable is None:
                return  # taken (or answered as a retry)
            away, revision, recording, was_refused = unreachable
            if refused is None or (was_refused is not None and was_refused.code == "malformed"):
                refused = was_refused
            if home_only:
                if away and time.monotonic() < home_until:
                    candidates = away + candidates[1:]  # asked again after the pause below
                else:  # it refused, or is not back in time: the others at once, it last
                    candidates, home_until = candidates[1:] + away, 0.0
                    passes += 1
                    continue
            else:
                candidates = away
            if not candidates or time.monotonic() >= restart_deadline:
                break
            passes += 1
            await asyncio.sleep(ADMISSION_RETRY_EVERY_WALL_S)
        if candidates and refused is None:
            # every server that could take it is away, not full: the agent retries as for a store away
            down = ", ".join(c.server_id for c in candidates)
            if pinned is None:  # (a call a server holds stays pinned there)
                await self._give_up(req, reply_to, revision, recording, new_session)
            await self.reply_error(reply_to, "unavailable", f"the admission of {down} does not answer (restarting); "
                                   f"retry shortly", req.call_id, retry_after_s=NO_CAPACITY_RETRY_AFTER_S)
            return
        if pinned is not None:  # still held there: the agent retries, to that server again
            await self.reply_error(reply_to, "no_capacity", f"{pinned}, which holds call {req.call_id}, cannot take it now",
                                   req.call_id, retry_after_s=NO_CAPACITY_RETRY_AFTER_S)
            return
        await self._give_up(req, reply_to, revision, recording, new_session)
        if refused is not None and refused.code == "malformed":  # the call itself (its id in flight for another
            await self.reply_error(reply_to, refused.code, refused.message, req.call_id)  # session): no retry helps
            return
        await self.reply_error(reply_to, "no_capacity", f"no server could take a {req.model} call now", req.call_id, retry_after_s=NO_CAPACITY_RETRY_AFTER_S)

    async def _give_up(self, req: CallRequest, reply_to: str, revision: int,
                       recording: tuple[str, asyncio.Task[int | None]] | None, new_session: bool) -> None:
        """Nothing took the call: its record and the session's count as if it never came,
        so the agent's retry is placed afresh (and is the session's first call again)."""
        if recording is not None:  # (no candidate was tried after it began)
            revision = await recording[1] or revision
        if revision:  # nothing took it: a retry may place it again
            await self.call_records.release(req.session_id, req.call_id, revision)
        if new_session:  # so the retry is the session's first call again
            pipe = self.redis.pipeline(transaction=False)
            state.count_call(pipe, self.keys, req.session_id, -1)
            await pipe.execute()

    async def _submit_to(self, candidates: list[Any], passes: int, req: CallRequest, reply_to: str,
                         session: state.SessionRecord, ns: str, sub: SubmitCall, placement: InFlight, revision: int,
                         recording: tuple[str, asyncio.Task[int | None]] | None, retry: bool
                         ) -> tuple[list[Any], int, tuple[str, asyncio.Task[int | None]] | None, ApiError | None] | None:
        """Submit to each candidate in turn until one takes it (None: taken, or answered as a
        retry); else (the candidates whose admission did not answer, the record's revision,
        its write still under way, an admission's refusal of it, the one of the call itself
        first)."""
        unreachable: list[Any] = []
        refused: ApiError | None = None
        for i, cand in enumerate(candidates):
            if i > 0 or passes > 0:  # the first choice did not take it: the next one counts it now
                await self.mark_in_flight(cand.server_id, placement)
            if revision:
                # the server it goes to, recorded before the submit (after it, the engine's claim
                # raced this write and read again): a retry is pinned there, and the engine
                # claims on this revision without reading the record
                placed = await self._record_server(req, cand.server_id, revision, recording)
                recording = None
                if placed is None:
                    # moved on: a retry of it placed it meanwhile, or a server this one gave up on
                    # took it after all; answered as a retry (the stored reply, or that server again)
                    await self.unmark_in_flight(cand.server_id, req.call_id)
                    await self._place_known(req, reply_to, session, ns)
                    return None
                revision = placed
            try:
                resp = await self.nc.request(self.subjects.admission_submit(cand.server_id),
                                             encode(msgspec.structs.replace(sub, record_revision=revision)),
                                             timeout=SUBMIT_TIMEOUT_WALL_S, headers=trace_headers(req.session_id, req.call_id))
            except (NoRespondersError, NatsTimeout) as exc:
                await self.unmark_in_flight(cand.server_id, req.call_id)
                self.log.warning("router.admission_unavailable", server_id=cand.server_id, error=type(exc).__name__,
                                 attempt=passes + 1)
                unreachable.append(cand)
                continue
            out = submit_reply_decoder.decode(resp.data)
            if isinstance(out, ApiError):
                await self.unmark_in_flight(cand.server_id, req.call_id)
                # e.g. no_capacity: that server's queue is at its bound (TALARIA_MAX_QUEUED) and this is a
                # new session's first call; admission decides on its own exact count, not a mirrored one
                self.log.warning("router.admission_refused", server_id=cand.server_id, reason=out.message, code=out.code)
                if refused is None or out.code == "malformed":
                    refused = out
                continue
            if not retry:  # first accepted: counted once, a retry of it is not a new call
                self.metrics.calls_accepted.labels(model=req.model).inc()
                self.metrics.placements.labels(server=cand.server_id, model=req.model, residency=cand.residency,
                                               kv=cand.kv).inc()
            await self.nc.publish(reply_to, encode(CallAccepted(call_id=req.call_id, server_id=cand.server_id)))
            return None
        return unreachable, revision, recording, refused

    async def on_move(self, msg: Msg) -> None:
        """An admission hands back a call it holds but cannot run soon (`MoveCall`: its
        model's engine-worker there drains, and its successor may take minutes): placed
        again among the other servers whose engine for the model is ready, in placement's
        order, the call record moved with it by compare-and-set (a retry, a claim or an
        answer meanwhile wins, and the call stays). Answered `Submitted` with the server
        that took it, or an error: nothing else could, it stays where it was."""
        mv = move_decoder.decode(msg.data)
        call = mv.submit.call
        with structlog.contextvars.bound_contextvars(session_id=call.session_id, call_id=call.call_id):
            out = await self._move(mv)
            if isinstance(out, Submitted):
                self.log.info("router.moved", model=call.model, from_server=mv.from_server, to_server=out.server_id,
                              reason="its engine-worker drains")
            else:
                self.log.info("router.move_declined", model=call.model, from_server=mv.from_server, reason=out.message)
            if msg.reply:
                await self.nc.publish(msg.reply, encode(out))

    async def _move(self, mv: MoveCall) -> Submitted | ApiError:
        call = mv.submit.call
        record, revision = await self.call_records.get(call.session_id, call.call_id)
        if record is None or record.state != "placed" or record.server_id != mv.from_server:
            return _RECORD_MOVED_ON
        away = await self.engines_away(fresh=True)  # (a move is rare, and every server's engine may be draining)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.kv_locality(call.session_id))
        pipe.get(self.keys.reservation(call.session_id))
        self._queue_server_reads(pipe)
        read, results = await self._execute_read(pipe)
        kv = {k.decode(): v.decode() for k, v in results[0].items()}
        reserved_on = results[1].decode().split("|", 1)[0] if results[1] else None
        _, views, _ = self._server_views(results[2:], read, kv, reserved_on, away)
        ranked = [c for c in rank(call.model, views, self.settings.policy, session_id=call.session_id,
                                  call_id=call.call_id, prompt_tokens=call.prompt_tokens, prefix_tokens=call.prefix_tokens)
                  if c.server_id != mv.from_server and call.model not in away.get(c.server_id, frozenset())]
        placement = InFlight(call.call_id, call.model, call.prompt_tokens, time.time())
        for cand in ranked:
            await self.mark_in_flight(cand.server_id, placement)
            moved = await self.call_records.update(call.session_id, call.call_id,
                                                   CallRecord(state="placed", server_id=cand.server_id), revision)
            if moved is None:
                await self.unmark_in_flight(cand.server_id, call.call_id)
                return _RECORD_MOVED_ON
            try:
                resp = await self.nc.request(self.subjects.admission_submit(cand.server_id),
                                             encode(msgspec.structs.replace(mv.submit, record_revision=moved,
                                                                            moves=mv.submit.moves + 1)),
                                             timeout=SUBMIT_TIMEOUT_WALL_S, headers=trace_headers(call.session_id, call.call_id))
                out: Submitted | ApiError = submit_reply_decoder.decode(resp.data)
            except (NoRespondersError, NatsTimeout) as exc:
                out = ApiError(code="unavailable", message=type(exc).__name__)
            if isinstance(out, Submitted):
                return out
            await self.unmark_in_flight(cand.server_id, call.call_id)
            # back where it was, so the next candidate (or its server again) claims on the record
            back = await self.call_records.update(call.session_id, call.call_id,
                                                  CallRecord(state="placed", server_id=mv.from_server), moved)
            if back is None:  # (the candidate took it after all, and its engine claimed it)
                return ApiError(code="no_capacity", message=f"{cand.server_id} did not answer in time")
            revision = back
        return ApiError(code="no_capacity", message=f"no other server with its engine ready could take a {call.model} call")

    async def _record_server(self, req: CallRequest, server_id: str, revision: int,
                             recording: tuple[str, asyncio.Task[int | None]] | None) -> int | None:
        """Name `server_id` in the call record; its new revision, or None when the record
        moved on. `recording`: a write of the first choice already under way, awaited first."""
        if recording is not None:
            recorded_on, write = recording
            rev = await write
            if rev is None or recorded_on == server_id:
                return rev
            revision = rev
        return await self.call_records.update(req.session_id, req.call_id,
                                              CallRecord(state="placed", server_id=server_id), revision)

    def _snapshot_keys(self) -> list[str]:
        """KEYS of SNAPSHOT_SCRIPT: the placement sequence, then per server its in-flight
        hash and its mirror."""
        keys = [self.keys.placements()]
        for server_id in self.settings.servers:
            keys += [self.keys.in_flight(server_id), self.keys.server(server_id)]
        return keys

    def _queue_server_reads(self, pipe: Any) -> int:
        """Queue the servers' snapshot, last in the pipeline; returns how many results it
        adds once `_execute_read` spreads it (the sequence and two hashes per server)."""
        keys = self._snapshot_keys()
        pipe.evalsha(self._snapshot_script.sha, len(keys), *keys, *state.PLACEMENT_FIELDS)
        return len(keys)

    async def _execute_read(self, pipe: Any) -> tuple[int, list[Any]]:
        """Run a pipeline whose last command is the servers' snapshot: its read number and
        results, the snapshot spread out as [sequence, in-flight hash, mirror fields, ...] per
        server (`_server_views` closes the read; a failed one is closed here)."""
        read = self.in_flight.begin_read()
        try:
            results = await pipe.execute(raise_on_error=False)
            *others, snapshot = results
            for r in others:
                if isinstance(r, Exception):
                    raise r
            if isinstance(snapshot, NoScriptError):  # a Redis that restarted empty: loads it again
                snapshot = await self._snapshot_script(keys=self._snapshot_keys(), args=state.PLACEMENT_FIELDS)
            elif isinstance(snapshot, Exception):
                raise snapshot
            return read, [*others, *spread_snapshot(snapshot)]
        except BaseException:
            self.in_flight.end_read(read)
            raise

    def _server_views(self, raw: list[Any], read: int, kv: dict[str, str], reserved_on: str | None,
                      away: dict[str, frozenset[str]]) -> tuple[str, list[ServerView], list[str]]:
        """The placement sequence, every server's view (uncounted placements included) and
        this router's placements the views count that the snapshot may not hold.
        `away`: per server, the models whose engine-worker there is starting or draining."""
        seq = raw[0].decode() if raw[0] is not None else "0"
        views = []
        wall = time.time()
        for i, server_id in enumerate(self.settings.servers):
            fh, mirror = raw[1 + 2 * i], state.decode_server(raw[2 + 2 * i])
            load = mirror.load
            entries = {k.decode(): v.decode() for k, v in fh.items()}
            shared = {cid: c for cid, v in entries.items() if (c := InFlight.decode(cid, v)) is not None}
            stale = [cid for cid in entries if cid not in shared or wall - shared[cid].placed_at >= IN_FLIGHT_MAX_WALL_S]
            if stale:  # a replica that died between its write and its forward, an admission that restarted
                self.spawn(self.redis.hdel(self.keys.in_flight(server_id), *stale), "in-flight-prune")
            models = load.models if load.models is not None else frozenset(self.settings.models)
            view = server_view(server_id, models, load, mirror.substrate.staged,
                               kv.get(server_id, "none"), reserved_on,  # type: ignore[arg-type]
                               models_away=away.get(server_id, frozenset()))
            views.append(with_in_flight(view, self.in_flight.pending(server_id, shared, read, wall)))
        counted = self.in_flight.unsettled(read)  # (before the read closes: it may drop some)
        self.in_flight.end_read(read)
        return seq, views, counted

    def start_placement_writes(self) -> None:
        """The placement and snapshot scripts, and the queue of placements ranked and counted
        here that wait for their write (in ranking order, one pipeline per batch: _write_placements)."""
        self._place_script = self.redis.register_script(PLACE_SCRIPT)
        self._snapshot_script = self.redis.register_script(SNAPSHOT_SCRIPT)
        self._unwritten: list[PendingPlacement] = []
        self._placement_writer: asyncio.Task | None = None

    async def mark_in_flight(self, server_id: str, call: InFlight, expect_seq: str | None = None,
                             counted: Sequence[str] = ()) -> bool:
        """Count the call on the server, for this router at once and, before it is
        forwarded (so admission's deletion always comes after), for every replica.
        With `expect_seq`, only if no other replica placed a call since the snapshot
        that read that sequence (`counted`: this router's placements its ranking
        counted, which may be in the log since; False: read again). Redis down:
        counted here only."""
        return await self._queue_placement(server_id, call, expect_seq, counted)

    def _queue_placement(self, server_id: str, call: InFlight, expect_seq: str | None = None,
                         counted: Sequence[str] = ()) -> asyncio.Future[bool]:
        """Count the call here now (the rankings of this router's other calls count it)
        and queue its write; the future says whether it landed. Writes go in the order
        they were queued, so a placement that counted an earlier one of this router's
        finds it in the log before it, as its script expects."""
        self.in_flight.placed(server_id, call)
        landed: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._unwritten.append(PendingPlacement(server_id, call, expect_seq, tuple(counted), landed))
        if self._placement_writer is None or self._placement_writer.done():
            self._placement_writer = self.spawn(self._write_placements(), "placement writes")
        return landed

    async def _write_placements(self) -> None:
        """Write the queued placements, all that queued meanwhile in one pipeline (one round
        trip a batch, not a call: under load the router's placements were a queue behind
        one Redis round trip each), until none is left."""
        while self._unwritten:
            batch, self._unwritten = self._unwritten, []
            results: list[Any] = [True] * len(batch)
            try:
                pipe = self.redis.pipeline(transaction=False)
                for p in batch:
                    pipe.evalsha(self._place_script.sha, 3, *self._placement_script_args(p))
                results = await pipe.execute(raise_on_error=False)
                for i, (p, r) in enumerate(zip(batch, results)):
                    if isinstance(r, NoScriptError):  # a Redis that restarted empty: loads it again
                        keys_and_args = self._placement_script_args(p)
                        results[i] = await self._place_script(keys=keys_and_args[:3], args=keys_and_args[3:])
            except Exception as exc:  # the other replicas miss them for a moment; this one still counts them
                self.log.warning("router.in_flight_write_failed", placements=len(batch), error=str(exc))
                results = [True] * len(batch)
            finally:
                for p, r in zip(batch, results):
                    if isinstance(r, Exception):
                        self.log.warning("router.in_flight_write_failed", server_id=p.server_id, error=str(r))
                        r = True
                    if not r:
                        self.in_flight.unplaced(p.server_id, p.call.call_id)
                    else:
                        self.in_flight.written(p.call.call_id)
                    if not p.landed.done():
                        p.landed.set_result(bool(r))

    def _placement_script_args(self, p: PendingPlacement) -> list[Any]:
        """KEYS then ARGV of PLACE_SCRIPT for one placement."""
        return [self.keys.placements(), self.keys.in_flight(p.server_id), self.keys.placement_log(),
                p.expect_seq or "", p.call.call_id, p.call.encode(), CALL_TTL_S, self._token(p.call.call_id),
                *(self._token(c) for c in p.counted)]

    def _token(self, call_id: str) -> str:
        """A placement's entry in the shared log: this replica's and the call's."""
        return f"{self.instance} {call_id}"

    async def unmark_in_flight(self, server_id: str, call_id: str) -> None:
        """The server did not take it: it will never be counted there."""
        self.in_flight.unplaced(server_id, call_id)
        try:
            await self.redis.hdel(self.keys.in_flight(server_id), call_id)
        except Exception as exc:  # the entry ages out (IN_FLIGHT_MAX_WALL_S)
            self.log.warning("router.in_flight_clear_failed", server_id=server_id, error=str(exc))


def spread_snapshot(reply: list[Any]) -> list[Any]:
    """SNAPSHOT_SCRIPT's reply as dicts: the sequence, then per server its in-flight
    hash (a script returns a hash as a flat list) and its mirror's placement fields
    that are set (HMGET answers nil for the others)."""
    seq, *hashes = reply
    out = [seq]
    for in_flight, mirror in zip(hashes[::2], hashes[1::2]):
        out.append({in_flight[i]: in_flight[i + 1] for i in range(0, len(in_flight), 2)})
        out.append({f: v for f, v in zip(state.PLACEMENT_FIELDS, mirror) if v is not None})
    return out


def main() -> None:
    run_service(Router)
