"""The `sim` engine backend: one model's engine on one server, as a state machine.

Driven by `submit(call, now)`, `advance(now)` and `next_event_at()`; it never
sleeps. Between events the batch is stepped analytically: while a prefill is
running the decoders wait (prefill-first scheduling, as vLLM without chunking);
otherwise every running call decodes one token per ITL(batch, context). So a
960-call trace needs a few thousand events, not one per token.

The engine keeps its own KV table like a prefix cache: idle sessions' KV stays
in HBM (LRU) until room is needed; `host_kv` is the restorable view the
substrate hands over at wake-up. With `spill_to_host` (host-KV restore on), KV
pushed out of HBM for room goes to host DRAM instead of being dropped: it joins
`host_kv` at once (restorable) and waits in `spilled` until the driver hands it
to the substrate, which owns host memory and may refuse some (`forget_host`). It never over-commits: running calls' KV must
fit `kv_capacity_tokens` (the admission scheduler checks before dispatch, and
`submit` refuses otherwise).
"""

from __future__ import annotations

import math

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from shared.costmodel import CostModel
from shared.catalog import ModelSpec

EPS = 1e-9


def _after(t: float, dt: float) -> float:
    """t + dt, but never t itself: at a model time near Unix time (clock epoch 0, as compose
    runs) a last sliver of work can be below one float step of t, and an event at t would
    advance nothing and wake the timer again forever."""
    out = t + dt
    return out if out > t else math.nextafter(t, math.inf)


class EngineError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class EngineCall:
    """What an engine receives. `stop_tokens` is the model's own stopping point:
    it reaches only the engine (a real model decides it by emitting EOS)."""

    call_id: str
    session_id: str
    model: str
    prompt_tokens: int
    prefix_tokens: int
    max_tokens: int
    stop_tokens: int
    reserved_tokens: int  # KV the admission scheduler set aside for it


@dataclass(frozen=True, slots=True)
class CallResult:
    call_id: str
    session_id: str
    model: str
    prompt_tokens: int
    cached_tokens: int      # prefix found in HBM
    restored_tokens: int    # prefix restored from host DRAM
    reprefill_tokens: int   # prefix that had to be computed again
    output_tokens: int
    submitted_at: float
    first_token_at: float
    finished_at: float
    restore_s: float        # KV moved for this call: its prefix from host, and what it pushed to host for room
    prefill_s: float
    decode_s: float


@dataclass(slots=True)
class _Running:
    call: EngineCall
    submitted_at: float
    cached: int
    restored: int
    restore_s: float
    prefill_s: float
    prefill_left: float
    tokens_left: float
    produced: float = 0.0
    first_token_at: float | None = None


@dataclass
class SimEngine:
    model: ModelSpec
    cost: CostModel
    active: bool = False
    kv_capacity_tokens: int = 0
    hbm_kv: OrderedDict[str, int] = field(default_factory=OrderedDict)
    host_kv: dict[str, int] = field(default_factory=dict)
    protected: set[str] = field(default_factory=set)
    spill_to_host: bool = False
    spilled: dict[str, int] = field(default_factory=dict)  # spilled to host, not yet reported to the substrate
    running: dict[str, _Running] = field(default_factory=dict)
    prefill_queue: deque[str] = field(default_factory=deque)
    t: float = 0.0
    # calls that finished during an advance made inside submit/sleep/abort,
    # handed out by the next public advance() so none is ever lost
    completed: list[CallResult] = field(default_factory=list)
    busy_s: float = 0.0  # model seconds with at least one call running (utilisation)
    # tokens a preempted call had produced: it resumes from there (as vLLM's
    # recompute preemption keeps the generated tokens), so preemption cannot livelock
    preempted_tokens: dict[str, int] = field(default_factory=dict)
    # ITL of the current decode batch, fixed at the last batch change (submit,
    # prefill done, finish, abort), so that where `advance` is observed never
    # changes the answer
    _batch_itl: float | None = None
    _reserved_total: int = 0  # sum of running calls' reserved KV, kept in step with `running` (speed)
    _running_in_session: dict[str, int] = field(default_factory=dict)  # running calls per session, in step too

    # -- lifecycle -------------------------------------------------------------
    def wake(self, now: float, kv_capacity_tokens: int, host_kv: dict[str, int], hbm_kv: dict[str, int] | None = None) -> None:
        self.t = now
        self.active = True
        self.kv_capacity_tokens = kv_capacity_tokens
        self.host_kv = dict(host_kv)
        self.hbm_kv = OrderedDict(hbm_kv or {})
        self._evict_to_fit(0)

    def sleep(self, now: float) -> dict[str, int]:
        """Stop; return the idle KV table that was in HBM (the substrate decides
        whether it goes to host DRAM or is dropped)."""
        self._advance_to(now)
        if self.running:
            raise EngineError(f"{self.model.name}: sleep with {len(self.running)} calls running")
        out = dict(self.hbm_kv)
        self.hbm_kv.clear()
        self.host_kv.clear()
        self.active = False
        return out

    # -- KV accounting -----------------------------------------------------------
    def reserved_kv_tokens(self) -> int:
        return self._reserved_total

    def idle_kv_tokens(self) -> int:
        return sum(self.hbm_kv.values())

    def _evict_to_fit(self, extra: int) -> int:
        """Push idle cached KV out of HBM (unprotected first, then protected, LRU
        order) until reserved running KV + idle cache + extra fits: to host DRAM
        with `spill_to_host`, else dropped. Returns the tokens copied to host."""
        budget = self.kv_capacity_tokens - self.reserved_kv_tokens() - extra
        idle = self.idle_kv_tokens()
        copied = 0
        if idle <= budget:
            return copied
        for protected_pass in (False, True):
            for sid in list(self.hbm_kv):
                if idle <= budget:
                    return copied
                if (sid in self.protected) == protected_pass:
                    tokens = self.hbm_kv.pop(sid)
                    idle -= tokens
                    if self.spill_to_host:
                        already = self.host_kv.get(sid, 0)
                        if tokens > already:  # only the part not already in host DRAM is copied
                            copied += tokens - already
                            self.host_kv[sid] = tokens
                            self.spilled[sid] = tokens
        return copied

    def take_spilled(self) -> dict[str, int]:
        """KV spilled to host since the last call, for the substrate's ledger."""
        out, self.spilled = self.spilled, {}
        return out

    def release_session(self, session_id: str) -> int:
        """The session is over: its cached KV (HBM and the host view) and its
        protection go. Returns the KV tokens dropped."""
        self.protected.discard(session_id)
        self.spilled.pop(session_id, None)
        return self.hbm_kv.pop(session_id, 0) + self.host_kv.pop(session_id, 0)

    def forget_host(self, session_ids: list[str]) -> None:
        """The substrate could not keep these sessions' KV in host DRAM."""
        for sid in session_ids:
            self.host_kv.pop(sid, None)
            self.spilled.pop(sid, None)

    # -- events ------------------------------------------------------------------
    def submit(self, call: EngineCall, now: float) -> None:
        if not self.active:
            raise EngineError(f"{self.model.name}: call {call.call_id} submitted to a sleeping engine")
        if call.call_id in self.running:
            return  # at most once
        self._advance_to(now)
        if self.reserved_kv_tokens() + call.reserved_tokens > self.kv_capacity_tokens:
            raise EngineError(
                f"{self.model.name}: call {call.call_id} needs {call.reserved_tokens} KV tokens, "
                f"{self.kv_capacity_tokens - self.reserved_kv_tokens()} free"
            )
        prefix = call.prefix_tokens
        held = self.hbm_kv.pop(call.session_id, 0)
        if self._running_in_session.get(call.session_id):
            # another call of the session runs (two sub-agents under one session id, say): what it
            # has prefilled is in HBM and found by this one too, as a prefix cache finds blocks in use
            held = max([held] + [r.call.prompt_tokens if r.prefill_left <= 0 else r.cached + r.restored
                                 for r in self.running.values() if r.call.session_id == call.session_id])
        cached = min(prefix, held)
        restored = 0
        restore_s = 0.0
        # the host copy stays valid after a restore (a prefix's KV never changes),
        # as the substrate's ledger keeps it: a later spill copies only what is new
        host = self.host_kv.get(call.session_id, 0)
        if cached < prefix and host > cached:
            restored = min(prefix, host) - cached
            restore_s = self.cost.kv_restore_s(self.model, restored)
        # the room this call needs is free once what was in it has been copied to host
        restore_s += self.cost.d2h_s(self.model.kv_bytes(self._evict_to_fit(call.reserved_tokens)))
        reused = cached + restored
        prefill_s = self.cost.prefill_s(self.model, call.prompt_tokens - reused, reused)
        self.running[call.call_id] = _Running(
            call=call,
            submitted_at=now,
            cached=cached,
            restored=restored,
            restore_s=restore_s,
            prefill_s=prefill_s,
            prefill_left=restore_s + prefill_s,
            tokens_left=float(max(1, min(call.stop_tokens, call.max_tokens) - self.preempted_tokens.get(call.call_id, 0))),
        )
        self.prefill_queue.append(call.call_id)
        self._reserved_total += call.reserved_tokens
        self._running_in_session[call.session_id] = self._running_in_session.get(call.session_id, 0) + 1
        self._batch_itl = None

    def next_event_at(self) -> float | None:
        if not self.running:
            return None
        if self.prefill_queue:
            return _after(self.t, self.running[self.prefill_queue[0]].prefill_left)
        step = self._itl()
        return _after(self.t, min(r.tokens_left for r in self.running.values()) * step)

    def _itl(self) -> float:
        if self._batch_itl is None:
            ctx = sum(r.call.prompt_tokens + int(r.produced) for r in self.running.values())
            self._batch_itl = self.cost.itl_s(self.model, len(self.running), ctx)
        return self._batch_itl

    def advance(self, now: float) -> list[CallResult]:
        """Move the batch forward to `now`; return every call that finished
        since the last call to advance (including inside submit/abort)."""
        self._advance_to(now)
        done, self.completed = self.completed, []
        return done

    def _advance_to(self, now: float) -> None:
        done = self.completed
        while self.running and self.t < now - EPS:
            nxt = self.next_event_at()
            assert nxt is not None
            target = min(now, nxt)
            dt = target - self.t
            self.busy_s += dt
            if self.prefill_queue:
                head = self.running[self.prefill_queue[0]]
                head.prefill_left -= dt
                if head.prefill_left <= EPS:
                    self.prefill_queue.popleft()
                    head.prefill_left = 0.0
                    self._batch_itl = None
            else:
                tokens = dt / self._itl()
                for r in self.running.values():
                    if r.first_token_at is None:
                        r.first_token_at = self.t
                    r.tokens_left -= tokens
                    r.produced += tokens
            self.t = target
            for cid in [c for c, r in self.running.items() if not self.prefill_queue or c != self.prefill_queue[0]]:
                r = self.running[cid]
                if r.prefill_left <= 0 and r.tokens_left <= 1e-6:
                    done.append(self._finish(cid))
        if not self.running:
            self.t = max(self.t, now)

    def produced_tokens(self, call_id: str) -> int:
        """Output tokens a running call has produced as of the engine's clock
        (a preempted call's earlier tokens included), for streaming."""
        r = self.running.get(call_id)
        if r is None:
            return 0
        total = max(1, min(r.call.stop_tokens, r.call.max_tokens))
        return min(total, total - int(r.tokens_left + 0.999999))

    def abort(self, call_id: str, now: float) -> None:
        """Preempted: the call's progress is lost; what it had prefilled stays cached."""
        self._advance_to(now)
        r = self.running.pop(call_id, None)
        if r is None:
            return
        self._reserved_total -= r.call.reserved_tokens
        self._left_session(r.call.session_id)
        if call_id in self.prefill_queue:
            self.prefill_queue.remove(call_id)
        self._batch_itl = None
        kept = r.call.prompt_tokens if r.prefill_left <= 0 else r.cached + r.restored
        total = min(r.call.stop_tokens, r.call.max_tokens)
        self.preempted_tokens[call_id] = min(total - 1, total - int(r.tokens_left + 0.999999))  # cumulative
        if kept:
            self.hbm_kv[r.call.session_id] = kept
        self._evict_to_fit(0)

    def _left_session(self, session_id: str) -> None:
        n = self._running_in_session.pop(session_id, 0) - 1
        if n > 0:
            self._running_in_session[session_id] = n

    def _finish(self, call_id: str) -> CallResult:
        r = self.running.pop(call_id)
        self._reserved_total -= r.call.reserved_tokens
        self._left_session(r.call.session_id)
        self._batch_itl = None
        self.preempted_tokens.pop(call_id, None)
        c = r.call
        output = max(1, min(c.stop_tokens, c.max_tokens))
        first = r.first_token_at if r.first_token_at is not None else self.t
        # the session's whole context stays cached (LRU, most recent last)
        self.hbm_kv[c.session_id] = c.prompt_tokens + output
        self.hbm_kv.move_to_end(c.session_id)
        self._evict_to_fit(0)
        return CallResult(
            call_id=c.call_id,
            session_id=c.session_id,
            model=c.model,
            prompt_tokens=c.prompt_tokens,
            cached_tokens=r.cached,
            restored_tokens=r.restored,
            reprefill_tokens=max(0, c.prefix_tokens - r.cached - r.restored),
            output_tokens=output,
            submitted_at=r.submitted_at,
            first_token_at=first,
            finished_at=self.t,
            restore_s=r.restore_s,
            prefill_s=r.prefill_s,
            decode_s=self.t - first,
        )

