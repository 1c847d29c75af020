"""engine-worker: one (server, model) engine behind NATS.

`EngineWorker` owns the call protocol, written once for every backend:

- a run (admission's `RunCall`) is claimed in the durable call record
  (`shared/call_record.py`) before it generates; one already answered is
  answered from the record again, with its `CallFinished` re-sent (admission
  may have missed the first one while it restarted); one claimed by another
  worker is not run here; a run already generating is ignored; a run that
  lands while the engine sleeps or starts waits in `pending` until it wakes;
- the finish of a call stores its reply in the record on its claim before
  publishing it (a second generation of one call id never becomes a second
  answer, and a process whose claim was taken over answers nothing), records
  the session's finish, answers the agent and tells admission (`CallFinished`);
- an agent's cancel (`CancelCall`) of a pending call drops it and tells
  admission; of a running call, the backend stops generating and the call ends
  as aborted (no reply, a `CallFinished`); of a call not here yet, it is
  remembered, and a run dispatched before it is dropped when it comes;
- streamed tokens go to the agent as `CallTokens` through `stream_tokens`.

A backend (`EngineBackend`: `sim_backend.SimBackend`, `vllm_backend.VllmBackend`)
only generates. It is chosen at start (`services/engine/__main__.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
from nats.aio.msg import Msg

from shared import state, tracing
from shared.bus import OrderedWrites, ServiceProcess, trace_headers
from shared.call_record import Claim
from shared.clock import done_within
from shared.prompt_store import PromptStore
from shared.schema import (
    Abort, CallFinished, CallReply, CallTokens, ControlAccepted, ControlOk, EngineAnnounce, EngineDraining, EngineState,
    ForgetHostKv, ListCalls, ProtectKv, RunAccepted, RunCall, Sleep, Wake, cancel_decoder, control_decoder, encode,
    reply_decoder, run_decoder, session_released_decoder,
)
from shared.settings import Settings

# how long a reply waits for its session's state write (read-your-writes for the agent's next
# call) before it goes without: Redis stalled, the write follows once Redis takes it
FINISH_STATE_WAIT_S = 1.0
FinishWrites = Callable[[Any], None]  # a backend's own writes in the finish transaction (a Redis pipeline)
# how long a stopped worker lets its running calls finish (SIGTERM; compose gives engine-workers
# 60 s before its SIGKILL): a call longer than that is cut and generated again by the next worker
ENGINE_DRAIN_WALL_S = 45.0
DRAIN_POLL_WALL_S = 0.05
ENGINE_STATE_WRITE_WALL_S = 1.0  # how long a drain or a start waits to write the engine hash's state
ANSWERED_KEPT = 4096  # call ids a worker remembers answering (a late resend's stale claim is checked again)
EARLY_CANCELS_KEPT = 4096  # cancels heard before their run (every worker hears every cancel; few runs come)


FINISH_RETRY_WALL_S = (0.2, 0.5, 1.0, 2.0, 5.0)  # waits between a failed finish's tries, the last repeated


async def finish_until_told(finish: Callable[[], Awaitable[None]], log: Any, call_id: str) -> None:
    """Finish a generated call, trying again while the finish fails (the call record past its
    deadline while NATS is down, a refused write): the reply is generated and is not thrown
    away, and until it is told, the call stays held here, so a resend of it waits for this
    answer instead of generating again. The sim backend keeps such finishes queued instead."""
    for attempt in itertools.count():
        try:
            await finish()
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            wait_s = FINISH_RETRY_WALL_S[min(attempt, len(FINISH_RETRY_WALL_S) - 1)]
            log.exception("engine.finish_failed", call_id=call_id, attempt=attempt + 1, retry_in_wall_s=wait_s)
            await asyncio.sleep(wait_s)


class EngineBackend(ABC):
    """One engine's generation. It starts runs, stops them, sleeps and wakes;
    for each run it started it calls `worker.finish` exactly once."""

    name = "backend"

    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker

    async def start(self) -> None:
        """Bring the engine up (the worker's subscriptions are already in place)."""

    @property
    @abstractmethod
    def can_run(self) -> bool:
        """A run may start now (awake and ready); else it waits in `pending`."""

    @property
    @abstractmethod
    def awake(self) -> bool:
        """What a restarted admission is told (ListCalls)."""

    @property
    def kv_capacity_tokens(self) -> int:
        return 0

    @property
    def context_limit(self) -> int | None:
        """The engine's own context limit for a real prompt (None: it takes the catalog's)."""
        return None

    reads_prompt = False  # the engine generates from the real prompt (a prompt sent by reference is fetched)

    @abstractmethod
    def running(self) -> list[RunCall]:
        """The runs generating now."""

    def holds(self, call_id: str) -> bool:
        """The call is generating here or finishing (a second run of it must not start)."""
        return any(r.call_id == call_id for r in self.running())

    @abstractmethod
    async def run(self, rc: RunCall) -> None:
        """Start generating `rc` (returns once it is started)."""

    @abstractmethod
    async def sleep(self) -> dict[str, int]:
        """The substrate switches the model out; returns the KV tokens per session it gave up."""

    @abstractmethod
    async def wake(self, cmd: Wake) -> None:
        """The substrate switched the model in."""

    @abstractmethod
    async def abort(self, call_id: str, at: float | None) -> None:
        """Admission preempted the call: stop it; admission has moved on (no reply, no CallFinished)."""

    @abstractmethod
    async def cancel(self, call_id: str) -> None:
        """The agent gave up: stop generating and end the call as aborted (`worker.finish`)."""

    async def protect(self, session_id: str, on: bool) -> None:
        """A soft reservation holds the session's KV (or lets it go)."""

    async def release_session(self, session_id: str) -> None:
        """The session was released: drop what the engine keeps for it."""

    async def forget_host_kv(self, session_ids: list[str]) -> None:
        """The substrate's host tier could not keep these sessions' spilled KV."""

    async def before_report(self) -> None:
        """Bring the engine's state up to now before it is reported (ListCalls)."""

    async def after_control(self) -> None:
        """After any control message (e.g. report what moved, wake the timer)."""

    async def reset_prefix_cache(self) -> bool:
        """Clear the engine's prefix cache (an operator's and the tests' hook)."""
        return False


class EngineWorker(ServiceProcess):
    name = "engine"
    uses_call_records = True

    def __init__(self, settings: Settings, backend: type[EngineBackend]) -> None:
        super().__init__(settings)
        self.backend = backend(self)
        self.pending: dict[str, RunCall] = {}  # runs that arrived while the engine slept or started
        self.claims: dict[str, Claim] = {}     # the call record's claim of each run taken (answered on it)
        # runs whose generation has ended and whose answer is being stored and published: a
        # resend now is that answer's (its claim is this process's, so it would run again)
        self.finishing: set[str] = set()
        # runs this process answered lately: a resend whose claim was read before the answer
        # was stored (a claim held up by a NATS outage) must not run again (bounded, oldest out)
        self.answered_here: OrderedDict[str, None] = OrderedDict()
        self.slept_kv: dict[str, int] | None = None  # the last Sleep's KV report (a repeated Sleep answers it)
        self.asked_by: dict[str, str] = {}     # each run taken -> its reply subject (whose cancel counts)
        self.started_wall: dict[str, float] = {}  # each run started -> its wall start (its span)
        self.epoch = uuid.uuid4().hex          # this process: a restarted worker takes its old claims over
        # the sessions' finishes and the KV view, written in order and never waited on for long
        self.state_writes = OrderedWrites(lambda: self.redis, lambda: self.log, "engine")
        self.draining = False  # SIGTERM: no new run taken (drain)
        # call id -> (namespace, model time) of a cancel heard before its run came
        self.early_cancels: OrderedDict[str, tuple[str, float]] = OrderedDict()

    async def setup(self) -> None:
        s = self.settings
        if s.model not in self.catalog.models:
            raise SystemExit(f"engine-worker: unknown model {s.model!r}")
        self.log = self.log.bind(model=s.model, engine=self.backend.name)
        self.spawn(self.state_writes.run(), "state-writes", essential=True)
        self.prompts = PromptStore(self.nc, s.subject_prefix)
        # the newest admission epoch of this server (durable): a restarted worker fences too
        self.admission_epoch = 0
        with contextlib.suppress(Exception):
            self.admission_epoch, _ = await self.call_records.current_epoch("admission", s.server_id)
        await self.backend.start()
        self.runs_sub = await self.nc.subscribe(self.subjects.engine_run(s.server_id, s.model), queue="engine",
                                                cb=self.guarded_handler(self.on_run, "run"))
        # one command at a time, in order; each acknowledged as it arrives, not when the
        # ones before it are done (a Sleep of a real engine takes seconds)
        await self.nc.subscribe(self.subjects.engine_control(s.server_id, s.model), queue="engine",
                                cb=self.concurrent_handler(self.on_control, "control", limit=1,
                                                           on_taken=self.acknowledge_control))
        await self.nc.subscribe(self.subjects.call_cancel_any, cb=self.guarded_handler(self.on_cancel, "cancel"))
        await self.nc.subscribe(self.subjects.session_released,
                                cb=self.guarded_handler(self.on_session_released, "session_released"))
        await self.nc.subscribe(self.subjects.engine_reset_kv(s.server_id, s.model),
                                cb=self.guarded_handler(self.on_reset_kv, "reset_kv"))
        # announce (re)start: a restarted worker comes back asleep and empty
        await self.nc.publish(self.subjects.engine_announce(s.server_id),
                              encode(EngineAnnounce(server_id=s.server_id, model=s.model, awake=False)))

    async def drain(self) -> None:
        """SIGTERM (a rolling restart, `docker compose stop`): take no new run, and let
        those running finish, for up to ENGINE_DRAIN_WALL_S, with their state written.
        A dispatch meanwhile is heard by nobody and admission sends it again until this
        server's next worker takes it. Before, a stop cut every run, and each was
        generated again from its first token by the next worker (a probe: 6 calls in a
        rolling restart, 2.4-3 s late; under vLLM the new worker loads its weights first)."""
        await self.runs_sub.unsubscribe()
        self.draining = True
        # routers rank this server last for the model meanwhile (and until the next worker is ready)
        await self.write_engine_state("draining")
        # admission moves the calls waiting for this engine to another server's (a successor may
        # take minutes: a vLLM engine loads its weights first), and gives the model no turn until
        # its successor is ready; best effort, as the state above (written first: admission reads
        # it to find the model back should the successor's announcement be lost)
        with contextlib.suppress(Exception):
            await self.nc.publish(self.subjects.engine_draining(self.settings.server_id),
                                  encode(EngineDraining(server_id=self.settings.server_id, model=self.settings.model)))
        deadline = time.monotonic() + ENGINE_DRAIN_WALL_S

        def running() -> int:  # (a run waiting for a wake is not running: it goes to the next worker)
            return len((self.claims.keys() - self.pending.keys()) | self.finishing)

        if running():
            self.log.info("engine.draining", running=running(), within_s=ENGINE_DRAIN_WALL_S)
        while (running() or self.state_writes.queue) and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_WALL_S)
        if running():
            self.log.warning("engine.drain_cut", running=running())

    async def write_engine_state(self, engine_state: str) -> None:
        """The engine hash's `state` (starting, ready, draining), which routers read to rank a
        server whose engine cannot run the model's calls now after those that can. Best effort:
        Redis away, placement goes by the mirrors alone, as before any state was written."""
        try:
            await asyncio.wait_for(self.redis.hset(self.keys.engine(self.settings.server_id, self.settings.model),
                                                   mapping={"backend": self.backend.name, "state": engine_state}),
                                   ENGINE_STATE_WRITE_WALL_S)
        except Exception as exc:  # noqa: BLE001 - best effort, see above
            self.log.warning("engine.state_unwritten", state=engine_state, error=type(exc).__name__)

    # -- runs --------------------------------------------------------------------------
    def stale_admission(self, epoch: int) -> bool:
        """A message from an admission older than the newest one this worker has heard
        from (it was stopped, replaced, and resumed): refused, so it cannot dispatch or
        abort a second time. 0: unfenced (a sender that names no epoch)."""
        if epoch and epoch < self.admission_epoch:
            self.log.warning("engine.stale_admission", epoch=epoch, newest=self.admission_epoch)
            return True
        self.admission_epoch = max(self.admission_epoch, epoch)
        return False

    async def on_run(self, msg: Msg) -> None:
        rc = run_decoder.decode(msg.data)
        if self.stale_admission(rc.admission_epoch):
            await self.reply_error(msg.reply, "superseded", f"admission epoch {rc.admission_epoch} is older than "
                                   f"{self.admission_epoch}: a newer admission holds {self.settings.server_id}", rc.call_id,
                                   to_agent=False)
            return
        try:
            await self._take_run(rc)
        except Exception as exc:  # say which call could not be taken: admission backs off and sends it again
            self.log.exception("handler.failed", handler="run", call_id=rc.call_id, session_id=rc.session_id)
            await self.reply_error(msg.reply, "internal", f"run: {type(exc).__name__}: {exc}", rc.call_id,
                                   to_agent=False)
            return
        if msg.reply:  # admission sends a dispatch until it hears this
            await self.nc.publish(msg.reply, encode(RunAccepted(call_id=rc.call_id)))

    def _cancelled_before(self, rc: RunCall) -> bool:
        """Its agent's cancel was heard before this run came, and the run was dispatched
        before that (a retry under the same id, dispatched after, is the agent's new ask)."""
        early = self.early_cancels.pop(rc.call_id, None)
        return (early is not None and rc.dispatched_at is not None and rc.dispatched_at <= early[1]
                and self.subjects.is_reply_inbox(rc.reply_to, early[0]))

    def _taken(self, call_id: str) -> bool:
        """Whether a run of `call_id` is already this process's: waiting, running or finishing."""
        return call_id in self.pending or call_id in self.finishing or self.backend.holds(call_id)

    async def _take_run(self, rc: RunCall) -> None:
        with structlog.contextvars.bound_contextvars(session_id=rc.session_id, call_id=rc.call_id):
            if self._taken(rc.call_id):
                return
            if self._cancelled_before(rc):
                self.log.info("engine.cancelled_before_start", reason="the agent gave up before the run came")
                await self._forget_prompt(rc)
                await self._tell_admission(rc.call_id, rc.session_id, 0)
                return
            # claimed in the durable record before anything is generated
            claim = await self.call_records.claim(rc.session_id, rc.call_id, server_id=self.settings.server_id,
                                                  owner=self.instance, epoch=self.epoch,
                                                  placed_revision=rc.record_revision)
            if claim.outcome == "run" and rc.call_id in self.answered_here:
                # claimed on a read from before this process stored its answer: that answer is its
                claim = await self.call_records.claim(rc.session_id, rc.call_id, server_id=self.settings.server_id,
                                                      owner=self.instance, epoch=self.epoch)
            if claim.outcome == "answered":  # the same reply again, never a second generation
                stored = claim.record.reply or b""
                await self.nc.publish(rc.reply_to, stored)
                self.log.info("engine.duplicate_run", served_from="call-record")
                with contextlib.suppress(Exception):
                    done = reply_decoder.decode(stored)
                    await self._tell_admission(rc.call_id, rc.session_id, done.prompt_tokens + done.output_tokens)
                return
            if claim.outcome == "held_elsewhere":  # another worker generates it: it is not this server's to run
                self.log.warning("engine.held_elsewhere", owner=claim.record.owner)
                await self._tell_admission(rc.call_id, rc.session_id, 0)
                return
            if self._taken(rc.call_id):
                return  # (a resend of it was taken while this one claimed)
            if rc.engine.prompt_ref is not None and self.backend.reads_prompt:
                payload = await self.prompts.get(rc.engine.prompt_ref)
                if payload is None:
                    await self.refuse(rc, "malformed", "the prompt sent by reference (prompt_ref) is not in the prompt "
                                                       "store: it expired, or was never stored")
                    return
                rc = msgspec.structs.replace(rc, engine=msgspec.structs.replace(
                    rc.engine, prompt_text=payload.prompt_text, prompt_token_ids=payload.prompt_token_ids))
                if self._taken(rc.call_id):
                    return  # (a resend of it was taken while this one read its prompt)
            self.claims[rc.call_id] = claim
            self.asked_by[rc.call_id] = rc.reply_to
            if not self.backend.can_run:
                self.pending[rc.call_id] = rc
                self.log.info("engine.run_deferred", reason="asleep or starting")
                return
            await self._start(rc)

    async def _start(self, rc: RunCall) -> None:
        """Hand a claimed run to the backend. One the backend raised on without taking it
        is refused (`internal`, naming the error): it is this call's own (its content),
        which a resend would raise on again, and admission, told to send it again, had
        held its model's slot open for ever with it (a tool schema the sim engine could
        not read, in a probe). One the backend holds is its to finish."""
        self.started_wall[rc.call_id] = time.time()
        try:
            await self.backend.run(rc)
        except Exception as exc:
            if self.backend.holds(rc.call_id):
                raise
            self.started_wall.pop(rc.call_id, None)
            self.log.exception("engine.run_failed", call_id=rc.call_id, session_id=rc.session_id)
            await self.refuse(rc, "internal", f"the engine could not run this call: {type(exc).__name__}: "
                                              f"{str(exc)[:200]}")

    async def start_pending(self) -> None:
        """The engine can run again: start what waited, in arrival order."""
        while self.pending and self.backend.can_run:
            _, rc = next(iter(self.pending.items()))
            del self.pending[rc.call_id]
            await self._start(rc)

    async def stream_tokens(self, rc: RunCall, index: int, token_ids: list[int], text: str | None = None) -> None:
        """Tokens of `rc` from position `index` of its output (and their text), to the agent."""
        await self.nc.publish(rc.reply_to, encode(CallTokens(call_id=rc.call_id, index=index, token_ids=token_ids,
                                                             text=text)))

    async def finish(self, rc: RunCall, reply: CallReply, context_tokens: int,
                     writes: FinishWrites | None = None) -> None:
        """`rc` ended (`reply.aborted`: stopped before its end; nobody is answered)."""
        self.finishing.add(rc.call_id)
        try:
            await self._finish(rc, reply, context_tokens, writes)
        finally:
            self.finishing.discard(rc.call_id)

    async def _finish(self, rc: RunCall, reply: CallReply, context_tokens: int, writes: FinishWrites | None) -> None:
        s = self.settings
        data = encode(reply)
        self._generation_span(rc, reply)
        # the claim is let go once the answer is stored, not before: a finish tried again after
        # a failed write answers on the same claim, so it finds its own earlier answer landed
        # or another process's, and never writes over the stored one
        claim = self.claims.get(rc.call_id)
        self.asked_by.pop(rc.call_id, None)
        hdrs = trace_headers(reply.session_id, reply.call_id)
        first = True
        if reply.aborted:
            self.claims.pop(rc.call_id, None)
        else:
            if claim is None:  # (never: a run starts only after its claim)
                claim = await self.call_records.claim(rc.session_id, rc.call_id, server_id=s.server_id,
                                                      owner=self.instance, epoch=self.epoch)
            # stored before it is published, on this process's claim: the first stored reply is the answer
            published, first = await self.call_records.answer(reply.session_id, reply.call_id, data, claim)
            self.claims.pop(rc.call_id, None)
            if published is None:
                self.log.error("engine.fenced", reason="another process of this worker took the call over",
                               call_id=rc.call_id, session_id=rc.session_id)
                return
            if not first:
                self.log.warning("engine.second_generation", answered_with="the first stored reply")
                data = published
        if first:
            # the session's finish, once per call id (a second generation would count it twice)
            def finish_state(pipe: Any) -> None:
                state.record_finish(pipe, self.keys, reply.session_id, s.server_id, reply.finished_at,
                                    max(1, reply.output_tokens))
                if writes is not None:
                    writes(pipe)

            await self._before_reply(self.state_writes.write(finish_state))
        if not reply.aborted:
            self.answered_here[rc.call_id] = None
            while len(self.answered_here) > ANSWERED_KEPT:
                self.answered_here.popitem(last=False)
            await self.nc.publish(rc.reply_to, data, headers=hdrs)
            self._count(rc, reply, first)
        await self._forget_prompt(rc)  # (a cancelled call's too: a retry sends its prompt again)
        # admission's state machine advances on this, whatever the backend
        await self._tell_admission(reply.call_id, reply.session_id, context_tokens, reply.finished_at, hdrs)

    async def _before_reply(self, written: "asyncio.Future[None]") -> None:
        """Wait for a state write the agent's next call reads, for a moment: where Redis
        is stalled (the writes ahead of it already waiting that long, or this one not done
        in FINISH_STATE_WAIT_S) the agent is answered without it, not held for as long as
        the stall lasts, and the calls finishing behind it are not held a second each."""
        if not self.state_writes.behind(FINISH_STATE_WAIT_S):
            await done_within(asyncio.shield(written), FINISH_STATE_WAIT_S)
        if not written.done():
            self.log.warning("engine.reply_before_state", pending=len(self.state_writes.queue))

    def _generation_span(self, rc: RunCall, reply: CallReply) -> None:
        """The generation as the GenAI conventions name a call, under admission's wait span."""
        start = self.started_wall.pop(rc.call_id, None)
        if rc.traceparent is None or start is None:
            return
        c = rc.call
        tracing.record_span(f"chat {c.model}", rc.traceparent, start, time.time(), tracing.call_attributes(
            c.model, c.session_id, c.call_id, **{
                "gen_ai.usage.input_tokens": reply.prompt_tokens, "gen_ai.usage.output_tokens": reply.output_tokens,
                "gen_ai.usage.cache_read.input_tokens": reply.cached_tokens, "talaria.server_id": reply.server_id,
                "talaria.engine": reply.engine, "talaria.aborted": reply.aborted}))

    def _count(self, rc: RunCall, reply: CallReply, first: bool) -> None:
        """A generation ran to its end; the first stored answer of a call is its completion
        (counted once per call id, whatever process or retry runs it again)."""
        m, labels = self.metrics, {"server": self.settings.server_id, "model": rc.call.model}
        m.generations.labels(**labels).inc()
        if not first:
            return
        m.calls_completed.labels(**labels).inc()
        m.admission_wait.labels(**labels, kind="round" if rc.round_wait else "in_slot").observe(rc.waited_s)
        m.switch_wait.labels(**labels).observe(rc.switch_wait_s)
        took = max(0.0, reply.finished_at - reply.arrived_at)
        # the decode on the stack's clock: the cost model's, or a real engine's wall time scaled as the clock is
        decode = reply.decode_s if reply.wall_decode_s is None else reply.wall_decode_s * self.settings.time_scale
        decode = min(took, decode)
        m.call_duration.labels(**labels).observe(took)
        m.time_to_first_token.labels(**labels).observe(took - decode)
        if reply.output_tokens > 1:
            m.time_per_output_token.labels(**labels).observe(decode / (reply.output_tokens - 1))
        m.generation_tokens.labels(**labels).inc(reply.output_tokens)
        if rc.sp_admit:
            m.sp_admissions.labels(**labels).inc()
        new = max(0, reply.prompt_tokens - reply.cached_tokens - reply.restored_tokens - reply.reprefill_tokens)
        for source, n in (("reused", reply.cached_tokens), ("restored", reply.restored_tokens),
                          ("reprefilled", reply.reprefill_tokens), ("new", new)):
            if n:
                m.prefix_tokens.labels(**labels, source=source).inc(n)

    async def refuse(self, rc: RunCall, code: str, message: str) -> None:
        """`rc` cannot run here (its real prompt does not fit the engine, say): the agent hears
        the typed error and admission frees its slot. A retry is refused the same way."""
        self.claims.pop(rc.call_id, None)
        self.asked_by.pop(rc.call_id, None)
        await self.reply_error(rc.reply_to, code, message, rc.call_id)
        await self._forget_prompt(rc)
        await self._tell_admission(rc.call_id, rc.session_id, 0)

    async def _forget_prompt(self, rc: RunCall) -> None:
        """A prompt sent by reference is deleted once its call is answered or refused (a
        retry after that is answered from the call record, or sends the prompt again)."""
        if rc.engine.prompt_ref is None:
            return
        try:
            await self.prompts.delete(rc.engine.prompt_ref)
        except Exception as exc:  # it ages out with the store's TTL
            self.log.warning("engine.prompt_not_deleted", error=f"{type(exc).__name__}: {exc}")

    async def _tell_admission(self, call_id: str, session_id: str, context_tokens: int,
                              finished_at: float | None = None, headers: dict[str, str] | None = None) -> None:
        await self.nc.publish(self.subjects.call_finished(self.settings.server_id),
                              encode(CallFinished(call_id=call_id, session_id=session_id, context_tokens=context_tokens,
                                                  finished_at=finished_at)),
                              headers=headers or trace_headers(session_id, call_id))

    # -- the agent gives up --------------------------------------------------------------
    async def on_cancel(self, msg: Msg) -> None:
        c = cancel_decoder.decode(msg.data)
        ns = self.subjects.api_namespace(msg.subject)
        if ns is None:
            return
        asked_by = self.asked_by.get(c.call_id)
        if asked_by is None:
            # not here (yet): a run that admission sent before the cancel reached it may still
            # come (the two cross on the bus; admission drops a call still queued): remembered
            self.early_cancels[c.call_id] = (ns, self.clock.now())
            while len(self.early_cancels) > EARLY_CANCELS_KEPT:
                self.early_cancels.popitem(last=False)
            return
        if not self.subjects.is_reply_inbox(asked_by, ns):
            return  # another namespace's call: only its caller may cancel it
        pending = self.pending.pop(c.call_id, None)
        if pending is not None:
            self.claims.pop(c.call_id, None)
            self.asked_by.pop(c.call_id, None)
            self.log.info("engine.cancelled_before_start", call_id=c.call_id, session_id=pending.session_id)
            await self._forget_prompt(pending)
            await self._tell_admission(c.call_id, pending.session_id, 0)
            return
        if self.backend.holds(c.call_id):
            await self.backend.cancel(c.call_id)  # the backend logs `engine.cancel`

    # -- the substrate's and admission's control -----------------------------------------
    async def acknowledge_control(self, msg: Msg) -> None:
        """A Sleep or Wake says it is here on receipt: the substrate sends one it never
        heard of again after a second (a message lost with a NATS node)."""
        cmd = control_decoder.decode(msg.data)
        if isinstance(cmd, Sleep | Wake) and cmd.ack_to:
            await self.nc.publish(cmd.ack_to, encode(ControlAccepted()))

    async def on_control(self, msg: Msg) -> None:
        cmd = control_decoder.decode(msg.data)
        out = ControlOk()
        match cmd:
            case Sleep():
                # asked again (its answer was lost): asleep already, the first one's report
                if self.backend.awake or self.slept_kv is None:
                    if running := self.backend.running():
                        # the switch's preemptions are still on their way (they come from admission,
                        # the sleep from the substrate): refused by name, and the substrate asks again
                        self.log.warning("engine.sleep_refused", running=[r.call_id for r in running][:20])
                        await self.reply_error(msg.reply, "unavailable", f"{self.settings.model}: {len(running)} "
                                               "calls still running; sleep once they are stopped", retry_after_s=0.5)
                        return
                    self.slept_kv = await self.backend.sleep()
                out = ControlOk(kv_out=self.slept_kv)
            case Wake():
                await self.backend.wake(cmd)
                await self.start_pending()
            case Abort(call_id=cid, at=at):
                if self.stale_admission(cmd.admission_epoch):
                    await self.reply_error(msg.reply, "superseded", "an older admission's abort")
                    return
                self.pending.pop(cid, None)
                self.claims.pop(cid, None)  # it stays claimed by this process: a re-dispatch runs it here
                self.asked_by.pop(cid, None)
                self.started_wall.pop(cid, None)
                await self.backend.abort(cid, at)
            case ProtectKv(session_id=sid, on=on):
                await self.backend.protect(sid, on)
            case ListCalls():
                self.stale_admission(cmd.admission_epoch)  # (a newer admission recovering: its predecessors are fenced)
                await self.backend.before_report()
                report = EngineState(awake=self.backend.awake, kv_capacity_tokens=self.backend.kv_capacity_tokens,
                                     running=self.backend.running(), pending=list(self.pending.values()))
                if msg.reply:
                    await self.nc.publish(msg.reply, encode(report))
                return
            case ForgetHostKv(session_ids=sids):
                await self.backend.forget_host_kv(sids)
        await self.backend.after_control()
        if msg.reply:
            await self.nc.publish(msg.reply, encode(out))

    async def on_session_released(self, msg: Msg) -> None:
        ev = session_released_decoder.decode(msg.data)
        if ev.applies_to(self.settings.server_id, self.settings.model):
            await self.backend.release_session(ev.session_id)
            await self.backend.after_control()

    async def on_reset_kv(self, msg: Msg) -> None:
        ok = await self.backend.reset_prefix_cache()
        self.log.info("engine.prefix_cache_reset", ok=ok)
        if msg.reply:
            await self.nc.publish(msg.reply, b'{"ok":%s}' % (b"true" if ok else b"false"))
