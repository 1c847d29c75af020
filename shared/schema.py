"""Every message on the bus, as msgspec structs: one module, tagged unions per
subject family, one reused encoder and one decoder per family.

Schema evolution: new fields get defaults and go at the end; unknown fields
are ignored; an unknown tag or a wrong type raises `msgspec.ValidationError`,
which every handler turns into a typed `ApiError` reply and a log line.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

Tokens = Annotated[int, Meta(ge=1, le=10_000_000)]
TokensOrZero = Annotated[int, Meta(ge=0, le=10_000_000)]
ID_MAX_CHARS = 200  # a session or call id; trace files are held to it too (talaria/workload/trace.py)
Id = Annotated[str, Meta(min_length=1, max_length=ID_MAX_CHARS)]
Count = Annotated[int, Meta(ge=0)]  # a size with no front-door cap (e.g. a KV budget in tokens)
# a subject a service publishes to (reply_to): no whitespace (the NATS client refuses it) and short
# enough for the server's 4 KiB protocol line (a longer one makes the server drop the publisher)
Subject = Annotated[str, Meta(min_length=1, max_length=1024, pattern=r"^\S+\Z")]

MAX_MESSAGE_BYTES = 1024 * 1024  # refused at the front door above this (the embedded NATS carries up to 2 MiB)
# a real prompt (text or token ids) larger than this, encoded, goes by reference (the prompt
# store, `shared/prompt_store.py`) instead of riding the bus through router and admission
PROMPT_INLINE_MAX_BYTES = 64 * 1024
JSON_SCHEMA_MAX_BYTES = 64 * 1024  # a structured-output schema (`Sampling.json_schema`) at most this long


class Base(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", forbid_unknown_fields=False):
    pass


# -- health (a service's `<prefix>.health.<instance>` answer) -------------------------
HEALTH_OK = b'{"status":"ok"}'              # set up and serving
HEALTH_STARTING = b'{"status":"starting"}'  # alive (the liveness watch is satisfied), still setting up


# -- errors (every family) ---------------------------------------------------------
ErrorCode = Literal[
    "malformed", "unknown_model", "unknown_session", "context_limit", "no_capacity",
    "timeout", "too_large", "internal",
    "unavailable",  # a store the service needs (Redis) is away: retry after `retry_after_s`
    "superseded",  # (between services: an engine refuses an admission older than the newest it heard from)
]


def context_limit_message(limit: int, prompt_tokens: int, max_tokens: int | None = None) -> str:
    """A `context_limit` refusal in OpenAI's and vLLM's words, which clients match on (the
    gateway rewords it in Anthropic's for its Messages API)."""
    if max_tokens is None:
        return (f"This model's maximum context length is {limit} tokens. However, your messages resulted in "
                f"{prompt_tokens} tokens. Please reduce the length of the messages.")
    return (f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion.")


class ApiError(Base, tag="error"):
    code: ErrorCode
    message: str
    call_id: str | None = None
    retry_after_s: float | None = None


# -- agent API (agent -> router) -----------------------------------------------------
class OpenSession(Base, tag="open_session"):
    session_id: Id
    model: Id
    # whose session it is, for admission's fair order between tenants: the gateway's tenant
    # (read from the gateway's namespace only; any other agent's tenant is its namespace)
    tenant: Annotated[str, Meta(max_length=256)] | None = None


class EndSession(Base, tag="end_session"):
    session_id: Id


class InfoRequest(Base, tag="info"):
    pass


class EngineHint(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    """What a client may tell the engine and nothing else. `sim_output_tokens`:
    where the sim engine stops (a replayed trace's true output length; a real
    model decides by itself). It travels nested in the engine payload, so no
    decision (placement, admission) can read it. `tools_json` (a JSON list of
    {name, description, parameters}) and `tool_choice` (None: the model decides;
    "none"; or a tool's name): the request's tools, already rendered in a real
    prompt, and what the sim engine's synthetic tool calls are made of
    (shared/tool_calls.py); `tool_rounds`: tool results since the user last spoke."""

    sim_output_tokens: Tokens | None = None
    tools_json: Annotated[str, Meta(max_length=1_000_000)] | None = None
    tool_choice: Annotated[str, Meta(max_length=256)] | None = None
    # the format the front door parses calls in (its tool-call parser), so the sim engine's
    # synthetic calls are written in it; None: the catalog's for the model
    tool_call_format: Annotated[str, Meta(max_length=32)] | None = None
    # tool results since the user's last message (the agent's rounds of tools on its request):
    # where the sim engine's synthetic model stops calling tools and answers
    tool_rounds: Annotated[int, Meta(ge=0)] | None = None


class Sampling(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    """How a real engine samples a call's output (the HTTP front door's fields). None
    of a field = the engine's default. The sim engine has no tokens to sample and
    reads none of it. A call with no `Sampling` at all is a replayed trace's:
    greedy to its bound (the vllm backend ignores end of sequence there)."""

    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None  # (vLLM's is an int32)
    stop: Annotated[list[Annotated[str, Meta(min_length=1, max_length=200)]], Meta(max_length=4)] = []
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None  # (OpenAI's int64)
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    # vLLM's own sampling fields beside OpenAI's, which agents written for vLLM send
    repetition_penalty: Annotated[float, Meta(gt=0)] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] | None = None
    ignore_eos: bool | None = None
    # the tokens the model may think before its thought is closed for it: Messages'
    # `thinking.budget_tokens`, vLLM's own `thinking_token_budget` (the vllm backend enforces
    # it for a model that thinks in tags; docs/front-door.md)
    thinking_token_budget: Annotated[int, Meta(ge=0)] | None = None
    # the JSON Schema (as JSON text) the output must match: OpenAI's `response_format`
    # (json_object: any object); the vllm backend enforces it by structured output
    json_schema: Annotated[str, Meta(max_length=JSON_SCHEMA_MAX_BYTES)] | None = None


class CallRequest(Base, tag="call"):
    call_id: Id
    session_id: Id
    model: Id
    prompt_tokens: Tokens
    prefix_tokens: TokensOrZero = 0   # leading tokens shared with the session's previous context
    max_tokens: Tokens = 4096
    reply_to: Subject = ""            # subject the call's events and reply go to
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    engine_hint: EngineHint | None = None
    stream: bool = False              # send CallTokens as tokens are generated (the vllm backend always does)
    sampling: Sampling | None = None  # how a real engine samples (the engine payload carries it; no decision reads it)
    # the real prompt by reference: an object in the caller's namespace's prompt store
    # (`PromptPayload`), in place of prompt_text / prompt_token_ids
    prompt_ref: Annotated[str, Meta(min_length=1, max_length=1024, pattern=r"^[A-Za-z0-9_=-]+$")] | None = None


class PromptPayload(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A real prompt stored by reference (msgpack in the prompt store)."""

    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None


class PromptRef(msgspec.Struct, frozen=True, kw_only=True):
    """Where an engine reads a call's prompt: an object of one namespace's prompt store
    (the router sets the namespace from the call's subject, never from the caller)."""

    namespace: str
    name: str


ApiRequest = OpenSession | EndSession | InfoRequest | CallRequest


class SessionOpened(Base, tag="session_opened"):
    session_id: str
    model: str
    context_limit: int  # the catalog's: what a call's token counts are checked against
    # the running engines' own limit (the smallest), for a call that carries its real prompt;
    # None while no engine has reported one (the sim engine: the catalog's holds)
    engine_context_limit: int | None = None


class Ok(Base, tag="ok"):
    pass


class Info(Base, tag="info_reply"):
    time_scale: float
    clock_epoch: float
    policy: str
    servers: list[str]
    models: list[str]
    # per model, the context a real prompt may use: the running engines' limit, else the catalog's
    context_limits: dict[str, int] = {}


# -- call events (to the agent's reply subject) -------------------------------------
class CallReceived(Base, tag="received"):
    """A router took the call: sent on receipt, before placement. An agent that hears
    nothing at all after sending a call sends it again soon (`shared/accept_timer.py`):
    the router that took it hung or died."""


class CallAccepted(Base, tag="accepted"):
    call_id: str
    server_id: str


class CallQueued(Base, tag="queued"):
    call_id: str
    server_id: str
    waited_s: float


class CallRunning(Base, tag="running"):
    call_id: str
    server_id: str


class CallReply(Base, tag="reply"):
    call_id: str
    session_id: str
    server_id: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    restored_tokens: int
    reprefill_tokens: int
    output_tokens: int
    arrived_at: float          # model seconds (the stack's clock)
    finished_at: float
    waited_s: float
    switch_wait_s: float
    round_wait: bool
    restore_s: float
    prefill_s: float
    decode_s: float
    duplicate: bool = False    # the stored reply (call record) for a retried call_id
    text: str | None = None
    token_ids: list[int] | None = None
    # the real engine's own figures (backend `vllm`): CPU/GPU **wall seconds**, never
    # mixed with the model-second fields above (those stay the stack clock's / cost model's)
    engine: str = "sim"
    wall_ttft_s: float | None = None
    wall_decode_s: float | None = None
    wall_total_s: float | None = None
    aborted: bool = False
    stop_sequence: str | None = None  # the stop string that ended the output (the sim engine: in its filler)
    # why the output ended, as the engine says: `stop` (its end, a stop string or token) or
    # `length` (max_tokens); None where not said (an aborted call, an older engine)
    finish_reason: Literal["stop", "length"] | None = None


class CallTokens(Base, tag="tokens"):
    """Tokens streamed by an engine before the final reply (the `vllm` backend always, the
    sim engine when asked); `index` is the position of the first one in the call's output,
    `text` what they read as where the engine knows (the gateway streams it on)."""

    call_id: str
    index: int
    token_ids: list[int]
    text: str | None = None


CallEvent = CallReceived | CallAccepted | CallQueued | CallRunning | CallTokens | CallReply | ApiError


class CancelCall(Base, tag="cancel"):
    """The agent gave up on a call: an engine that runs it aborts it."""

    call_id: Id


# -- router -> admission -> engine -------------------------------------------------------
class AdmissionCall(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """A call as every decision sees it, from the router's placement through
    admission's round scheduler: its prompt, its bound and the session's
    history. No output length, no next tool gap and no engine payload, by
    construction. One struct from the router to the engine."""

    call_id: str
    session_id: str
    model: str
    prompt_tokens: Tokens
    prefix_tokens: TokensOrZero
    max_tokens: Tokens
    arrived_at: float
    continuation: bool
    gap_history: tuple[float, ...] = ()
    output_history: tuple[int, ...] = ()
    session_started_at: float | None = None  # the session's first call (program-level FCFS, docs/peers.md)
    tenant: str = ""  # whose call (admission orders tenants fairly where not every queued call fits)


class EnginePayload(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    """What only the engine reads, carried beside the call and never handed to
    a decision: the real prompt, the engine hint, whether to stream tokens."""

    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    prompt_ref: PromptRef | None = None  # the prompt in the prompt store (fetched by the engine, deleted after the reply)
    hint: EngineHint | None = None
    stream: bool = False
    sampling: Sampling | None = None
    @property
    def sim_output_tokens(self) -> int | None:
        return self.hint.sim_output_tokens if self.hint is not None else None


class SubmitCall(Base, tag="submit"):
    call: AdmissionCall
    reply_to: Subject
    engine: EnginePayload = EnginePayload()
    traceparent: str | None = None  # the call's trace (W3C), kept with the stored call across restarts
    # the call record's revision that placed it on this server (0: unknown): the engine
    # claims on it without reading the record first (shared/call_record.py)
    record_revision: int = 0
    moves: int = 0  # times an admission handed it back to the routers (its engine drained): once at most


class Submitted(Base, tag="submitted"):
    call_id: str
    server_id: str


AdmissionRequest = SubmitCall


class MoveCall(Base, tag="move"):
    """Admission -> routers: a call this server holds but cannot run soon (its model's
    engine-worker here drains for a restart), to be placed again on another server.
    Answered `Submitted` (the server that took it) or an `ApiError` (no other server
    could: it stays where it was)."""

    submit: SubmitCall
    from_server: str


class EngineDraining(Base, tag="engine_draining"):
    """An engine-worker stopping (SIGTERM): it takes no new run until its successor
    announces itself (`EngineAnnounce`); admission moves the calls waiting for it."""

    server_id: str
    model: str


# -- admission -> engine ---------------------------------------------------------------
class RunCall(Base, tag="run"):
    """Admission's dispatch: the call, its engine payload and how admission admitted it."""

    call: AdmissionCall
    engine: EnginePayload
    reply_to: Subject
    reserved_tokens: TokensOrZero
    waited_s: float
    switch_wait_s: float
    round_wait: bool
    dispatched_at: float | None = None      # admission's model time of the dispatch
    sp_admit: bool = False                  # admitted into its model's open slot by session-prefill
    traceparent: str | None = None          # the call's trace (W3C): the engine's span goes under it
    admission_epoch: int = 0                # the sending admission's epoch (0: unfenced); an older one is refused
    record_revision: int = 0                # the call record's placement revision, from the submit (0: read it)

    @property
    def call_id(self) -> str:
        return self.call.call_id

    @property
    def session_id(self) -> str:
        return self.call.session_id

    @property
    def model(self) -> str:
        return self.call.model

    def submitted(self) -> SubmitCall:
        """The submission this dispatch came from (a restarted admission adopts it)."""
        return SubmitCall(call=self.call, reply_to=self.reply_to, engine=self.engine, traceparent=self.traceparent,
                          record_revision=self.record_revision)


class RunAccepted(Base, tag="run_accepted"):
    """An engine-worker holds this run (started, waiting for its wake-up, or already
    answered): admission stops sending it and heartbeats it as running."""

    call_id: str


class CallRecord(Base, tag="call_record"):
    """The durable at-most-once record of one call id in one session (the call
    record bucket, `shared/call_record.py`), stepped forward only by
    compare-and-set: `placing` (a router took the id) -> `placed` (a server's
    admission accepted it) -> `claimed` (that server's engine-worker is
    generating it; `epoch` names the process) -> `answered` (`reply` is the
    encoded final reply, written before it is published)."""

    state: Literal["placing", "placed", "claimed", "answered"]
    server_id: str | None = None
    owner: str | None = None   # the engine-worker instance that claimed it
    epoch: str | None = None   # that process's start (a restarted worker is a new epoch)
    reply: bytes | None = None


class OpenSessionRecord(Base, tag="session_record"):
    """A session open in the call record bucket: its model, and the namespace (agent-facing
    NATS user) that opened it, the only one that may call on it or end it."""

    model: str
    owner: str
    tenant: str | None = None  # whose (the gateway's tenant; None: its owner namespace)


class Sleep(Base, tag="sleep"):
    # where the engine-worker says it has the command, on receipt (ControlAccepted):
    # the substrate asks again when it hears nothing (a command lost on the bus)
    ack_to: str | None = None


class Wake(Base, tag="wake"):
    kv_capacity_tokens: Count
    host_kv: dict[str, Count] = {}
    at: float | None = None  # model time the switch completes (the message may land later)
    ack_to: str | None = None  # (as Sleep's)


class ControlAccepted(Base, tag="control_accepted"):
    """An engine-worker has a Sleep or Wake (sent to its `ack_to` on receipt). Asking
    again is safe: a repeated Wake refreshes the budget, a repeated Sleep answers
    the first one's KV report."""


class Abort(Base, tag="abort"):
    call_id: str
    at: float | None = None  # model time of the preemption at admission (it may land later)
    admission_epoch: int = 0


class ProtectKv(Base, tag="protect"):
    session_id: str
    on: bool


class ListCalls(Base, tag="list_calls"):
    """A restarted admission asks an engine-worker what it runs (docs/reliability.md);
    its epoch tells the engine to refuse its predecessors from now on."""

    admission_epoch: int = 0


class ForgetHostKv(Base, tag="forget_host_kv"):
    """The substrate's host KV tier could not keep these sessions' spilled KV:
    the engine must not count on restoring it."""

    session_ids: list[Id]


EngineControl = Sleep | Wake | Abort | ProtectKv | ListCalls | ForgetHostKv


class ControlOk(Base, tag="control_ok"):
    kv_out: dict[str, int] = {}


class EngineState(Base, tag="engine_state"):
    """An engine-worker's answer to ListCalls: whether it is awake, its KV
    budget, the calls it runs and those it holds until it is woken."""

    awake: bool
    kv_capacity_tokens: int = 0
    running: list[RunCall] = []
    pending: list[RunCall] = []


class SubstrateAnnounce(Base, tag="substrate_announce"):
    """A substrate-manager (re)started: a switch admission waits for is lost; ask again."""

    server_id: str


class CallFinished(Base, tag="finished"):
    call_id: str
    session_id: str
    context_tokens: Count
    finished_at: float | None = None  # the engine's model time of the finish (events carry their source time)


class EngineAnnounce(Base, tag="engine_announce"):
    """An engine-worker (re)started: the substrate re-wakes it if its model is
    active, and admission re-sends the calls it had dispatched to it."""

    server_id: str
    model: str
    awake: bool


class KvSpilled(Base, tag="kv_spilled"):
    """The active engine pushed idle sessions' KV out of HBM to host DRAM for
    room (host-KV restore on): tokens per session, for the substrate's ledger,
    which owns host memory."""

    server_id: str
    model: str
    sessions: dict[str, Count]
    at: float | None = None  # the engine's model time of the spill


class SessionReleased(Base, tag="session_released"):
    """A session is over here: its agent ended it (`server_id` None: on every
    server), or it was idle past TALARIA_SESSION_IDLE_S on one server. Admission
    drops its reservation, the substrate its host KV, the engines its cached KV
    and protection; the simulator applies the same."""

    session_id: Id
    reason: Literal["ended", "idle"] = "ended"
    server_id: str | None = None
    model: str | None = None  # the session's model, where known (only its engines hold anything of it)

    def applies_to(self, server_id: str, model: str | None = None) -> bool:
        return ((self.server_id is None or self.server_id == server_id)
                and (model is None or self.model is None or self.model == model))


# -- KV-cache events (engine -> bus), from vLLM's ZMQ publisher -----------------------------
class KvBlocksStored(Base, tag="kv_stored"):
    server_id: str
    model: str
    block_hashes: list[str]             # vLLM's block hashes, as decimal (int) or hex (bytes) strings
    parent_block_hash: str | None = None
    block_size: int = 0
    session_id: str | None = None       # the session whose tokens these blocks hold (matched by the worker)
    medium: str | None = None           # vLLM's medium; "GPU" even on the CPU backend (= the engine's own cache)


class KvBlocksRemoved(Base, tag="kv_removed"):
    server_id: str
    model: str
    block_hashes: list[str]
    medium: str | None = None


class KvAllCleared(Base, tag="kv_cleared"):
    server_id: str
    model: str


KvEvent = KvBlocksStored | KvBlocksRemoved | KvAllCleared


# -- admission -> substrate --------------------------------------------------------------
class SwitchRequest(Base, tag="switch"):
    from_model: str | None
    to_model: str
    requested_at: float | None = None  # model time of the decision at admission (it may land later)
    ack_to: Subject | None = None      # where the substrate says it has the request (SwitchAccepted)


class SwitchAccepted(Base, tag="switch_accepted"):
    """The substrate holds a switch request: once on receipt (`done_at` None), again
    once the switch is planned, with the model time it will be done. A requester
    that hears neither soon, or no result soon after `done_at`, asks again (a request
    or a result lost on the bus); asking again is safe: a switch to the active model
    is a wake."""

    to_model: str
    done_at: float | None = None


class SwitchResult(Base, tag="switch_result"):
    to_model: str
    kv_capacity_tokens: int
    duration_s: float
    staged_bytes: float = 0.0
    kv_to_host_tokens: int = 0
    kv_dropped_tokens: int = 0
    done_at: float | None = None  # model time the switch completed (its planned end)


class StageRequest(Base, tag="stage"):
    model: str
    requested_at: float | None = None  # model time of the hint at admission


SubstrateRequest = SwitchRequest | StageRequest


# -- codecs: one encoder, one decoder per family ------------------------------------------
encoder = msgspec.json.Encoder()
api_request_decoder = msgspec.json.Decoder(ApiRequest)
call_event_decoder = msgspec.json.Decoder(CallEvent)
admission_decoder = msgspec.json.Decoder(AdmissionRequest)
submit_reply_decoder = msgspec.json.Decoder(Submitted | ApiError)
move_decoder = msgspec.json.Decoder(MoveCall)
engine_draining_decoder = msgspec.json.Decoder(EngineDraining)
run_decoder = msgspec.json.Decoder(RunCall)
dispatch_ack_decoder = msgspec.json.Decoder(RunAccepted | ApiError)
control_decoder = msgspec.json.Decoder(EngineControl)
control_reply_decoder = msgspec.json.Decoder(ControlOk | ApiError)
finished_decoder = msgspec.json.Decoder(CallFinished)
session_released_decoder = msgspec.json.Decoder(SessionReleased)
engine_announce_decoder = msgspec.json.Decoder(EngineAnnounce)
engine_state_decoder = msgspec.json.Decoder(EngineState | ApiError)
stored_submit_decoder = msgspec.json.Decoder(SubmitCall)
substrate_decoder = msgspec.json.Decoder(SubstrateRequest)
switch_reply_decoder = msgspec.json.Decoder(SwitchResult | ApiError)
switch_accepted_decoder = msgspec.json.Decoder(SwitchAccepted)
api_reply_decoder = msgspec.json.Decoder(SessionOpened | Ok | Info | ApiError)
reply_decoder = msgspec.json.Decoder(CallReply)
kv_event_decoder = msgspec.json.Decoder(KvEvent)
kv_spilled_decoder = msgspec.json.Decoder(KvSpilled)
cancel_decoder = msgspec.json.Decoder(CancelCall)
call_record_decoder = msgspec.json.Decoder(CallRecord)
open_session_record_decoder = msgspec.json.Decoder(OpenSessionRecord)


def encode(msg: msgspec.Struct) -> bytes:
    return encoder.encode(msg)
