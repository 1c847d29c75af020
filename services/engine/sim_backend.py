"""The `sim` backend (TALARIA_ENGINE=sim): the SimEngine state machine on the scaled clock.

A timer task sleeps until the engine's next event, advances it and finishes
what ended (through the worker, which owns the call protocol). A call that
asked to stream gets its tokens at the cost model's decode pace, so streaming
and cancel behave as on a real engine; the token ids are placeholders (the
sim has no vocabulary). A replayed trace's call gets no text. A call from the
front door (it carries sampling fields) gets labelled synthetic filler
(`SYNTHETIC_LABEL`) of the published median output, 200 tokens, or less where
`max_tokens` is less, or where one of its stop strings ends it; with structured output, a made-up JSON value of the
requested schema, as long as that value is. In the synthetic tool mode, a call
whose hint carries tools (and a tool choice other than "none") answers one
well-formed call of one of them, written in the model's own format
(`shared/tool_calls.py`), as short as such a call is, so an agent's loop runs
on tool calls and the gateway's parsers read them; after
`ANSWER_AFTER_TOOL_ROUNDS` tool results since the user's last message it
answers in text, so the agent's task ends.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

import structlog

from services.engine.sim_engine import CallResult, EngineCall, SimEngine
from services.engine.worker import EngineBackend, EngineWorker
from shared import state, synthetic_json, tool_calls
from shared.bus import REDIS_AWAY
from shared.clock import drive_timer
from shared.costmodel import MEDIAN_OUTPUT_TOKENS, CostModel
from shared.schema import CallReply, CallRunning, KvSpilled, RunCall, Wake, encode

STREAM_WALL_S = 0.05  # wall seconds between two token batches of a streamed call
ANSWER_AFTER_TOOL_ROUNDS = 4  # the synthetic model answers in text once its agent has run this many tools


def synthetic_tool_text(rc: RunCall, fmt: str) -> str | None:
    """The synthetic tool mode's reply: one call of the hint's tools, in the model's format;
    None (text) once the agent has run `ANSWER_AFTER_TOOL_ROUNDS` tools since the user last
    spoke and the model may choose (no tool named or required), so an agent's loop ends."""
    hint = rc.engine.hint
    if hint is None or not hint.tools_json:
        return None
    if hint.tool_choice is None and (hint.tool_rounds or 0) >= ANSWER_AFTER_TOOL_ROUNDS:
        return None
    fmt = hint.tool_call_format or fmt  # the front door's parser, where it names one
    if fmt not in tool_calls.FORMATS or fmt == "none":
        return None
    return _tool_reply(hint.tools_json, hint.tool_choice, fmt, rc.call.call_id)


# (a streamed call asks for its text at every token batch: each reply is made once)
@functools.lru_cache(maxsize=64)
def _tool_reply(tools_json: str, choice: str | None, fmt: str, seed: str) -> str | None:
    try:
        tools = tool_calls.tools_from_json(tools_json)
    except ValueError:
        return None
    call = tool_calls.synthetic_call(tools, choice, seed)
    return tool_calls.render([call], fmt) if call is not None else None


def synthetic_json_text(rc: RunCall) -> str | None:
    """Structured output's reply: a made-up JSON value of the requested schema, compact, as
    a real engine's structured output would parse (`shared/synthetic_json.py`)."""
    sampling = rc.engine.sampling
    if sampling is None or sampling.json_schema is None:
        return None
    return _json_reply(sampling.json_schema, rc.call.call_id)


@functools.lru_cache(maxsize=256)
def _json_reply(schema: str, seed: str) -> str | None:
    try:
        value = synthetic_json.example(json.loads(schema), seed)
    except ValueError:  # not JSON, or a schema too large or malformed to fill: free text
        return None
    return json.dumps(value, separators=(",", ":"))


def shaped_text(rc: RunCall, fmt: str) -> str | None:
    """A reply whose shape the request fixes, as long as that shape is: its synthetic tool
    call, else its structured output; None when the reply is free text."""
    tool = synthetic_tool_text(rc, fmt)
    return tool if tool is not None else synthetic_json_text(rc)


SYNTHETIC_LABEL = "[synthetic text from Talaria's sim engine] "


def synthetic_text(output_tokens: int) -> str:
    """A front-door call's reply on the sim engine, which has no model: labelled filler of
    the reply's length (four bytes a token, the gateway's stand-in count)."""
    size = 4 * max(1, output_tokens)
    return (SYNTHETIC_LABEL + "lorem ipsum dolor sit amet " * (size // 27 + 1))[:size]


def reply_text(rc: RunCall, fmt: str, output_tokens: int) -> str | None:
    """The sim reply's text: its synthetic tool call or structured output, else labelled
    filler for a call from the front door (it carries sampling fields), ended before the
    first of the request's stop strings it holds, else none (a replayed trace's call)."""
    shaped = shaped_text(rc, fmt)
    if shaped is not None:
        if output_tokens < _tokens_of(shaped):
            # cut off by max_tokens before its end: cut as a real engine's would be (a call
            # cut off stays text at the front door; a cut JSON value does not parse)
            return shaped.encode()[:4 * max(1, output_tokens)].decode(errors="ignore")
        return shaped
    if rc.engine.sampling is None:
        return None
    text = synthetic_text(output_tokens)
    hit = _first_stop(rc, text)
    return text if hit is None else text[:hit[0]]


def _first_stop(rc: RunCall, text: str) -> tuple[int, str] | None:
    """Where the first of the call's stop strings begins in the filler, and which: a real
    engine stops there and leaves the string out of its text, as vLLM does."""
    stops = rc.engine.sampling.stop if rc.engine.sampling is not None else None
    found = [(i, s) for s in stops or () if s and (i := text.find(s)) >= 0]
    return min(found, key=lambda f: f[0] + len(f[1])) if found else None  # (the one completed first)


def stop_sequence(rc: RunCall, fmt: str, output_tokens: int) -> str | None:
    """The stop string that ended the sim reply (Messages' `stop_sequence`), if one did."""
    if shaped_text(rc, fmt) is not None or rc.engine.sampling is None:
        return None
    hit = _first_stop(rc, synthetic_text(output_tokens))
    return hit[1] if hit is not None else None


def _tokens_of(text: str) -> int:
    """A synthetic reply's length in output tokens: four bytes a token, at least one."""
    return max(1, len(text.encode()) // 4)


def stop_tokens(rc: RunCall, fmt: str = "none") -> int:
    """Where the sim engine stops: the hint's true output length, else the length of its
    synthetic tool call or structured output, else for a front-door call the published
    median output (as a model that has said its piece; not an agent's whole budget, which
    may be tens of thousands of tokens), else the call's bound (a replayed trace's)."""
    if rc.engine.sim_output_tokens:
        return rc.engine.sim_output_tokens
    text = shaped_text(rc, fmt)
    if text is not None:
        return _tokens_of(text)
    if rc.engine.sampling is None:
        return rc.call.max_tokens
    # a stop string in the filler it would write ends it there, its own tokens generated
    hit = _first_stop(rc, synthetic_text(min(MEDIAN_OUTPUT_TOKENS, rc.call.max_tokens)))
    return MEDIAN_OUTPUT_TOKENS if hit is None else max(1, -(-(hit[0] + len(hit[1])) // 4))


def text_between(rc: RunCall, fmt: str, start: int, stop: int) -> str | None:
    """The reply text's share of output positions [start, stop), so a streamed sim call's
    text comes at the cost model's decode pace (its slices add up to the reply's text)."""
    total = max(1, min(stop_tokens(rc, fmt), rc.call.max_tokens))
    text = reply_text(rc, fmt, total)
    if text is None:
        return None
    return text[len(text) * start // total:len(text) * min(stop, total) // total]


def placeholder_tokens(start: int, stop: int) -> list[int]:
    """Token ids for a sim call's output positions [start, stop): the same at the same position."""
    return [3 + i % 997 for i in range(start, stop)]


class SimBackend(EngineBackend):
    name = "sim"

    def __init__(self, worker: EngineWorker) -> None:
        super().__init__(worker)
        s = worker.settings
        cat = worker.catalog
        cost = CostModel(cat, cat.server(s.server_profile), s.switch_cost_scale, s.prefill_speed_scale)
        self.engine = SimEngine(cat.model(s.model), cost, spill_to_host=s.policy.host_kv)
        self.tool_format = cat.model(s.model).tool_call_format  # how the model writes a tool call
        self.calls: dict[str, RunCall] = {}
        self.streamed: dict[str, int] = {}  # streamed call -> tokens sent so far
        self.busy = state.CounterMirror()
        self.wakeup = asyncio.Event()
        self.stream_due = asyncio.Event()
        self.undelivered: list[CallResult] = []  # finished in the engine, not yet told (a write failed): sent first next time

    async def start(self) -> None:
        await self.worker.write_engine_state("ready")  # (a predecessor's drain may have said draining)
        self.worker.spawn(self.timer(), "engine-timer", essential=True)
        self.worker.spawn(self.streamer(), "engine-streamer", essential=True)

    @property
    def can_run(self) -> bool:
        return self.engine.active

    @property
    def awake(self) -> bool:
        return self.engine.active

    @property
    def kv_capacity_tokens(self) -> int:
        return self.engine.kv_capacity_tokens

    def running(self) -> list[RunCall]:
        return [rc for cid, rc in self.calls.items() if cid in self.engine.running]

    def holds(self, call_id: str) -> bool:
        return call_id in self.calls  # running, or finished and not yet delivered

    async def run(self, rc: RunCall) -> None:
        w, c = self.worker, rc.call
        with structlog.contextvars.bound_contextvars(session_id=c.session_id, call_id=c.call_id):
            # start at the dispatch's own model time (not when the message landed), never
            # before the engine's clock: message latency stays out of the model's answer
            now = w.clock.at_source(rc.dispatched_at, self.engine.t)
            self.engine.submit(
                EngineCall(c.call_id, c.session_id, c.model, c.prompt_tokens, c.prefix_tokens,
                           c.max_tokens, stop_tokens(rc, self.tool_format), rc.reserved_tokens),
                now,
            )
            self.calls[c.call_id] = rc
            if rc.engine.stream:
                self.streamed[c.call_id] = 0
                self.stream_due.set()
            w.log.info("engine.started", at=round(now, 3), prompt_tokens=c.prompt_tokens, prefix_tokens=c.prefix_tokens)
            await self._report_spills()
            await w.nc.publish(rc.reply_to, encode(CallRunning(call_id=c.call_id, server_id=w.settings.server_id)))
            self.wakeup.set()

    async def sleep(self) -> dict[str, int]:
        now = self.worker.clock.now()
        await self._finish(self.engine.advance(now))
        kv = self.engine.sleep(now)
        self.worker.log.info("engine.sleep", kv_sessions=len(kv), at=round(now, 3))
        return kv

    async def wake(self, cmd: Wake) -> None:
        now = self.worker.clock.now()
        if self.engine.active:  # a repeated wake only refreshes the budget
            self.engine.kv_capacity_tokens = cmd.kv_capacity_tokens
        else:
            # awake from the switch's end in model time, not from when the message landed
            self.engine.wake(self.worker.clock.at_source(cmd.at, self.engine.t), cmd.kv_capacity_tokens, cmd.host_kv)
        self.worker.log.info("engine.wake", kv_capacity_tokens=cmd.kv_capacity_tokens, host_kv_sessions=len(cmd.host_kv),
                             at=round(now, 3))

    async def abort(self, call_id: str, at: float | None) -> None:
        # preempted at admission's decision time, not when the message landed
        self.engine.abort(call_id, self.worker.clock.at_source(at, self.engine.t))
        self.calls.pop(call_id, None)
        self.streamed.pop(call_id, None)

    async def cancel(self, call_id: str) -> None:
        rc = self.calls.get(call_id)
        if rc is None:
            return
        now = self.worker.clock.now()
        await self._finish(self.engine.advance(now))
        if call_id not in self.engine.running:  # it ended before the cancel landed: answered already
            return
        produced = self.engine.produced_tokens(call_id)
        self.worker.log.info("engine.cancel", call_id=call_id, session_id=rc.session_id, reason="agent gave up",
                             generating=True, output_tokens=produced)
        self.engine.abort(call_id, now)
        self.engine.preempted_tokens.pop(call_id, None)  # it will not resume
        self.calls.pop(call_id, None)
        self.streamed.pop(call_id, None)
        c = rc.call
        s = self.worker.settings
        await self.worker.finish(rc, CallReply(
            call_id=c.call_id, session_id=c.session_id, server_id=s.server_id, model=c.model,
            prompt_tokens=c.prompt_tokens, cached_tokens=0, restored_tokens=0, reprefill_tokens=0,
            output_tokens=produced, arrived_at=c.arrived_at, finished_at=self.engine.t, waited_s=rc.waited_s,
            switch_wait_s=rc.switch_wait_s, round_wait=rc.round_wait, restore_s=0.0, prefill_s=0.0, decode_s=0.0,
            aborted=True), c.prompt_tokens + produced)
        self.wakeup.set()

    async def protect(self, session_id: str, on: bool) -> None:
        (self.engine.protected.add if on else self.engine.protected.discard)(session_id)

    async def release_session(self, session_id: str) -> None:
        dropped = self.engine.release_session(session_id)
        self.worker.log.info("engine.session_released", session_id=session_id, kv_tokens=dropped)

    async def forget_host_kv(self, session_ids: list[str]) -> None:
        self.engine.forget_host(session_ids)
        self.worker.log.info("engine.host_kv_forgotten", sessions=len(session_ids))

    async def before_report(self) -> None:
        await self._finish(self.engine.advance(self.worker.clock.now()))

    async def after_control(self) -> None:
        await self._report_spills()
        self.wakeup.set()

    # -- the clock -----------------------------------------------------------------------
    async def timer(self) -> None:
        # advance to now, not just to the due time: it computes every finish up to now in one go
        w = self.worker

        def next_due() -> float | None:
            # finishes a failed write left undelivered are due at once
            return w.clock.now() if self.undelivered else self.engine.next_event_at()

        async def on_due(_due: float) -> None:
            await self._finish_now()

        await drive_timer(w.clock, next_due, self.wakeup, on_due)

    async def _finish_now(self) -> None:
        """Deliver every call finished by now; one that cannot be delivered yet (the bus
        away longer than its retries) stays for the next try, and the loop that asked
        goes on: the clock and the streamer must outlive any outage."""
        w = self.worker
        try:
            await self._finish(self.engine.advance(w.clock.now()))
        except Exception as exc:
            # (the call that failed first, so a search by call id finds the wait)
            first = self.undelivered[0] if self.undelivered else None
            fields = dict(undelivered=len(self.undelivered), call_id=first.call_id if first else None,
                          session_id=first.session_id if first else None)
            if isinstance(exc, REDIS_AWAY):  # foreseen: no traceback
                w.log.warning("engine.finish_deferred", error=type(exc).__name__, **fields)
            else:
                w.log.exception("engine.finish_failed", **fields)
            await asyncio.sleep(0.2)

    async def streamer(self) -> None:
        """Send each streamed call the tokens it produced since the last batch."""
        while True:
            if not self.streamed:
                await self.stream_due.wait()
                self.stream_due.clear()
            await asyncio.sleep(STREAM_WALL_S)
            await self._finish_now()
            try:
                await self._stream_batch()
            except Exception:  # (a publish the bus refused: the streamer goes on, the reply carries it all)
                self.worker.log.exception("engine.stream_failed")

    async def _stream_batch(self) -> None:
        for cid, sent in list(self.streamed.items()):
            rc = self.calls.get(cid)
            if rc is None or cid not in self.engine.running:
                continue
            now_at = self.engine.produced_tokens(cid)
            if now_at > sent:
                self.streamed[cid] = now_at  # (before the send: a finish meanwhile sends what follows)
                await self.worker.stream_tokens(rc, sent, placeholder_tokens(sent, now_at),
                                                text_between(rc, self.tool_format, sent, now_at))

    async def _report_spills(self) -> None:
        """KV pushed out of HBM to host for room: the locality view says `host`
        and the substrate books it (it owns host memory and may refuse some)."""
        spilled = self.engine.take_spilled()
        if not spilled:
            return
        w = self.worker
        s = w.settings

        def locality(pipe: Any) -> None:
            for sid in spilled:
                state.note_kv_locality(pipe, w.keys, sid, s.server_id, "host")

        w.state_writes.write(locality)  # (in order with the finishes; not waited on)
        await w.nc.publish(w.subjects.kv_spilled(s.server_id),
                           encode(KvSpilled(server_id=s.server_id, model=s.model, sessions=spilled, at=self.engine.t)))
        w.log.info("engine.kv_spilled", sessions=len(spilled), tokens=sum(spilled.values()), at=round(self.engine.t, 3))

    async def _finish(self, done: list[CallResult]) -> None:
        """Tell the worker every call that finished. A result whose delivery fails
        stays (with those after it) for the next tick: none is ever dropped."""
        queue, self.undelivered = self.undelivered + done, []
        for i, r in enumerate(queue):
            try:
                await self._deliver(r)
            except BaseException:
                self.undelivered = queue[i:]
                raise
        await self._report_spills()

    async def _deliver(self, r: CallResult) -> None:
        w = self.worker
        s = w.settings
        await self._report_spills()
        rc = self.calls.get(r.call_id)
        if rc is None:
            return
        sent = self.streamed.pop(r.call_id, None)
        if sent is not None and r.output_tokens > sent:
            await w.stream_tokens(rc, sent, placeholder_tokens(sent, r.output_tokens),
                                  text_between(rc, self.tool_format, sent, r.output_tokens))
        c = rc.call
        reply = CallReply(
            call_id=r.call_id, session_id=r.session_id, server_id=s.server_id, model=r.model,
            prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens, restored_tokens=r.restored_tokens,
            reprefill_tokens=r.reprefill_tokens, output_tokens=r.output_tokens, arrived_at=c.arrived_at,
            finished_at=r.finished_at, waited_s=rc.waited_s, switch_wait_s=rc.switch_wait_s,
            round_wait=rc.round_wait, restore_s=r.restore_s, prefill_s=r.prefill_s, decode_s=r.decode_s,
            text=reply_text(rc, self.tool_format, r.output_tokens),
            # cut where its own end lies past the bound (a reply as long as max_tokens may end there)
            finish_reason="length" if stop_tokens(rc, self.tool_format) > c.max_tokens else "stop",
            stop_sequence=stop_sequence(rc, self.tool_format, r.output_tokens),
        )
        busy = self.busy.pending({state.BUSY_PREFIX + s.model: round(self.engine.busy_s, 3)})

        def writes(pipe: Any, session_id: str = r.session_id, busy: dict[str, float] = busy) -> None:
            state.note_kv_locality(pipe, w.keys, session_id, s.server_id, "hbm")
            # model seconds with a call running, for the replay's utilisation (a counter per engine)
            state.add_counters(pipe, w.keys, s.server_id, busy)

        await w.finish(rc, reply, r.prompt_tokens + r.output_tokens, writes)
        self.calls.pop(r.call_id, None)
        self.busy.written(busy)
        w.log.info("engine.finished", session_id=r.session_id, call_id=r.call_id, at=round(r.finished_at, 3),
                   cached_tokens=r.cached_tokens, restored_tokens=r.restored_tokens,
                   reprefill_tokens=r.reprefill_tokens, output_tokens=r.output_tokens,
                   prefill_s=round(r.prefill_s, 3), decode_s=round(r.decode_s, 3), sp_admit=rc.sp_admit)
