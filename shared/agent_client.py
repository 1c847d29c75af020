"""The agent client's core: open a session, make calls, end it, over NATS.

It lives in `shared/` so a service that speaks to Talaria as an agent (the
HTTP gateway) can use it; agents import it as `talaria.client`.

    async with await TalariaClient.connect(["nats://127.0.0.1:4222"]) as client:
        session = await client.open_session("glm-4.5-fp8")
        reply = await session.call(prompt_tokens=8000, max_tokens=1024)
        await session.end()

Against `talaria up` (authentication on, a private subject prefix):
`TalariaClient.from_deployment(Deployment.load(".talaria/logs/up/credentials.json"))`.

A call waiting for its model's slot is alive: the services send `queued` and
`running` heartbeats, and the client only gives up when it has heard nothing
for `silence_s` (wall seconds). Then it retries the same call id (served at
most once) up to `retries` times before raising `CallTimeout`. A call that has
had no answer at all is sent again sooner, after a wait that follows the
latency of this client's first answers (`shared/accept_timer.py`): a router
that took it and then hung or died answers nothing. A client whose connection
came back (a NATS node restarted, or left for another) asks each of its open
calls again at once: what was published to it while it was away, the reply
among it, is lost, and would otherwise be asked for only after the silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, Self

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from opentelemetry.trace import SpanKind

from shared.schema import (
    ApiError, CallAccepted, CallEvent, CallQueued, CallReceived, CallReply, CallRequest, CallRunning, CallTokens, CancelCall, EngineHint,
    EndSession, Info,
    PROMPT_INLINE_MAX_BYTES, InfoRequest, OpenSession, PromptPayload, PromptRef, Sampling, SessionOpened, api_reply_decoder,
    call_event_decoder, encode,
)
from shared import tracing
from shared.net import NATS_KEEPALIVE, no_responders
from shared.accept_timer import AcceptTimer
from shared.prompt_store import (FULL_RETRY_AFTER_S, PromptStore, PromptStoreFull, PromptStoreUnavailable, encode_payload,
                                 object_name)
from shared.subjects import AGENT_NAMESPACE, HEADER_RECEIPT, Subjects, inbox_prefix, is_namespace

NO_ROUTER_RETRY_S = 0.2       # wall seconds between two sends of a call while no router is subscribed
SHARED_INBOX = "call"        # the inboxes named by their call id alone, within a namespace (`shared_inbox`)
RECONNECTED = object()        # put in each open call's inbox queue when the connection came back

log = logging.getLogger("talaria.client")


class TalariaError(Exception):
    """A typed error from the service (code as in `shared.schema.ErrorCode`)."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


class UnknownModel(TalariaError): ...
class UnknownSession(TalariaError): ...
class NoCapacity(TalariaError): ...
class Malformed(TalariaError): ...
class ContextLimit(TalariaError): ...
class CallTimeout(TalariaError): ...
class Unavailable(TalariaError):
    """A store the service needs is away for now (Redis restarting, the bus lost): retry shortly."""
class SessionEnded(TalariaError):
    """A call on a session this client already ended (raised here, nothing is sent)."""


_ERRORS: dict[str, type[TalariaError]] = {
    "unknown_model": UnknownModel, "unknown_session": UnknownSession, "no_capacity": NoCapacity,
    "malformed": Malformed, "too_large": Malformed, "context_limit": ContextLimit, "timeout": CallTimeout,
    "unavailable": Unavailable,
}


def raise_for(err: ApiError) -> None:
    raise _ERRORS.get(err.code, TalariaError)(err.code, err.message, err.retry_after_s)


class LoginRefused(ConnectionError):
    """NATS refused the first connection's login (wrong user or password)."""


class AgentLogin(msgspec.Struct, frozen=True):
    user: str | None = None
    password: str | None = None


class Deployment(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """Where a running Talaria listens and how an agent logs in: the file
    `talaria up` writes to `<log dir>/credentials.json` (mode 600)."""

    nats_urls: list[str]
    subject_prefix: str = "talaria"
    agent: AgentLogin = AgentLogin()
    redis_url: str | None = None  # the stack's Redis (operators: loop-lag reports), not for agents
    key_prefix: str = "talaria:"
    # the operator role (health endpoints, $SRV pings, api.info), for `talaria status`; not for agents
    operator: AgentLogin | None = None
    # the HTTP front door (services/gateway): OpenAI-style base URL (ends in /v1) and a bearer key
    openai_base_url: str | None = None
    api_key: str | None = None
    # operators: the Prometheus scrape config of an embedded stack (docs/observability.md)
    prometheus_config: str | None = None

    @classmethod
    def load(cls, path: str | Path) -> "Deployment":
        """Read a credentials file; a `ValueError` that names the file and the problem."""
        try:
            dep = msgspec.json.decode(Path(path).read_bytes(), type=cls)
        except OSError as exc:
            raise ValueError(f"{path}: cannot read the credentials file: {exc.strerror or exc}") from None
        except msgspec.ValidationError as exc:
            raise ValueError(f"{path}: not a Talaria credentials file: {exc}") from None
        except msgspec.DecodeError as exc:
            raise ValueError(f"{path}: not JSON: {exc}") from None
        if not dep.nats_urls:
            raise ValueError(f"{path}: not a Talaria credentials file: `nats_urls` is empty")
        return dep

    def write(self, path: str | Path) -> None:
        p = Path(path)
        p.write_bytes(msgspec.json.format(msgspec.json.encode(self), indent=1))
        p.chmod(0o600)


class TalariaClient:
    def __init__(self, nc: nats.NATS, subject_prefix: str = "talaria", silence_s: float = 15.0,
                 retries: int = 3, request_timeout_s: float = 5.0, namespace: str = AGENT_NAMESPACE) -> None:
        if not is_namespace(namespace):
            raise ValueError(f"namespace {namespace!r}: letters, digits, '-' and '_' only")
        self.nc = nc
        self.namespace = namespace
        self.subjects = Subjects(subject_prefix)
        self.silence_s = silence_s
        self.retries = retries
        self.request_timeout_s = request_timeout_s
        # requests go under <prefix>.api.<namespace>, replies come under
        # <prefix>.reply.<namespace>.<client>.<call>: an agent's NATS user may use only its own
        self.client_id = f"{namespace}.{uuid.uuid4().hex[:12]}"
        self.prompt_inline_max_bytes = PROMPT_INLINE_MAX_BYTES  # larger real prompts go by reference
        self._prompts: PromptStore | None = None
        self._background: set[asyncio.Task[None]] = set()  # best-effort steps after a call (held from the GC)
        # a call nobody answers at all (taken by a router that hung or died) is sent again after this
        self.accept_timer = AcceptTimer(ceiling_s=silence_s)
        self._open_calls: set[asyncio.Queue[Any]] = set()  # each open call's inbox queue

    def reconnected(self) -> None:
        """The connection came back: every open call asks again (what came meanwhile is lost)."""
        for inbox in self._open_calls:
            inbox.put_nowait(RECONNECTED)

    @classmethod
    async def connect(cls, urls: list[str] | str, *, user: str | None = None, password: str | None = None,
                      connect_timeout_s: float = 10.0, namespace: str = AGENT_NAMESPACE, **kw: object) -> Self:
        """Connect to NATS. Once connected the client reconnects forever; the
        first connection fails fast instead (nats-py would retry it forever):
        a refused login at once (`LoginRefused`), an unreachable server after
        `connect_timeout_s` (`ConnectionError`), naming the servers and the last error.
        `namespace` is the agent-facing user's (its NATS user name in a deployment)."""
        urls = [urls] if isinstance(urls, str) else list(urls)
        errors: list[Exception] = []
        refused = asyncio.Event()
        connected = False

        async def on_error(e: Exception) -> None:
            errors.append(e)
            # during the handshake nats-py raises a plain Error carrying the server's text
            if isinstance(e, nats.errors.AuthorizationError) or "authorization violation" in str(e).lower():
                refused.set()
            # before the first connection, the ConnectionError raised below names the last
            # error (one line, not one per retry); after it, say once what went wrong
            if connected and (len(errors) < 2 or str(errors[-2]) != str(e)):
                log.warning("NATS error: %s", e)

        made: list[TalariaClient] = []

        async def on_reconnected() -> None:  # (nats-py has subscribed our inboxes again by now)
            for client in made:
                client.reconnected()

        nc = nats.NATS()
        connecting = asyncio.ensure_future(nc.connect(
            servers=urls, max_reconnect_attempts=-1, reconnect_time_wait=0.5, name="talaria-agent",
            **NATS_KEEPALIVE, reconnected_cb=on_reconnected,
            user=user, password=password, error_cb=on_error, inbox_prefix=inbox_prefix(namespace)))
        refusal = asyncio.ensure_future(refused.wait())
        done, _ = await asyncio.wait({connecting, refusal}, timeout=connect_timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        refusal.cancel()
        if connecting not in done or refused.is_set():
            connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await connecting
            with contextlib.suppress(Exception):
                await nc.close()
            where = ", ".join(urls)
            if refused.is_set():
                raise LoginRefused(f"cannot connect to NATS at {where}: login refused (Authorization Violation)")
            why = f"{errors[-1]!s} (after {connect_timeout_s:g} s)" if errors else f"no answer in {connect_timeout_s:g} s"
            raise ConnectionError(f"cannot connect to NATS at {where}: {why}")
        connecting.result()  # a connect that failed outright raises here
        connected = True
        made.append(cls(nc, namespace=namespace, **kw))  # type: ignore[arg-type]
        return made[0]

    @classmethod
    async def from_deployment(cls, deployment: Deployment, **kw: object) -> Self:
        """Connect as the deployment's agent user (`Deployment.load(credentials file)`)."""
        kw.setdefault("subject_prefix", deployment.subject_prefix)
        kw.setdefault("namespace", deployment.agent.user or AGENT_NAMESPACE)
        return await cls.connect(deployment.nats_urls, user=deployment.agent.user, password=deployment.agent.password, **kw)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self.nc.is_closed:
            return
        if self.nc.is_connected:
            await self.nc.drain()
        else:  # (the bus is away: there is nothing to drain, and nats-py refuses to while reconnecting)
            await self.nc.close()

    async def _request(self, subject: str, msg: msgspec.Struct) -> object:
        last: Exception | None = None
        for _ in range(self.retries + 1):
            try:
                resp = await self.nc.request(subject, encode(msg), timeout=self.request_timeout_s)
            except NoRespondersError as exc:
                last = exc
                await asyncio.sleep(0.5)
                continue
            except NatsTimeout as exc:
                last = exc
                continue
            out = api_reply_decoder.decode(resp.data)
            if isinstance(out, ApiError):
                raise_for(out)
            return out
        raise CallTimeout("timeout", f"no router answered on {subject} ({type(last).__name__})")

    async def _forget_prompt(self, name: str) -> None:
        """Delete a prompt this client put for a call it gave up on (a retry puts it again)."""
        if self._prompts is not None:
            await self._prompts.delete(PromptRef(namespace=self.namespace, name=name))

    def _spawn_quietly(self, coro: Coroutine[Any, Any, None]) -> None:
        """A best-effort step after the call is over (a NATS away: its entry ages out)."""
        async def quietly() -> None:
            with contextlib.suppress(Exception):
                await coro
        task = asyncio.ensure_future(quietly())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _put_prompt(self, name: str, data: bytes) -> None:
        if self._prompts is None:
            self._prompts = PromptStore(self.nc, self.subjects.prefix)
        try:
            await self._prompts.put(self.namespace, name, data)
        except PromptStoreFull:
            # (the store empties as the calls in it end: sent again shortly, it is taken)
            raise NoCapacity("no_capacity", "the store of prompts sent by reference is full "
                             "(TALARIA_PROMPT_STORE_MAX_BYTES): send the request again shortly",
                             FULL_RETRY_AFTER_S) from None
        except PromptStoreUnavailable:  # (what it waited out is in the log: store.unavailable)
            raise Unavailable("unavailable", "the store of prompts sent by reference did not answer: "
                              "send the request again shortly", 1.0) from None
        except nats.js.errors.APIError as exc:  # another refusal: the request's, not the store's state
            raise TalariaError("too_large", f"the prompt store refused the prompt: {exc.description or exc}") from None

    async def info(self) -> Info:
        out = await self._request(self.subjects.api_info, InfoRequest())
        assert isinstance(out, Info)
        return out

    async def open_session(self, model: str, session_id: str | None = None, tenant: str | None = None) -> "Session":
        """`tenant`: whose session it is (heard from the gateway's namespace only)."""
        sid = session_id or f"sess-{uuid.uuid4().hex[:12]}"
        out = await self._request(self.subjects.api_session_open(self.namespace),
                                  OpenSession(session_id=sid, model=model, tenant=tenant))
        assert isinstance(out, SessionOpened)
        return Session(self, sid, model, out.context_limit, out.engine_context_limit, tenant)

    async def end_session(self, session_id: str) -> None:
        await self._request(self.subjects.api_session_end(self.namespace), EndSession(session_id=session_id))

    async def call(
        self,
        session_id: str,
        model: str,
        *,
        prompt_tokens: int,
        prefix_tokens: int = 0,
        max_tokens: int = 4096,
        call_id: str | None = None,
        sim_output_tokens: int | None = None,
        on_event: Callable[[CallEvent], None] | None = None,
        prompt_token_ids: list[int] | None = None,
        prompt_text: str | None = None,
        stream: bool = False,
        sampling: Sampling | None = None,
        tools_json: str | None = None,
        tool_choice: str | None = None,
        tool_call_format: str | None = None,
        tool_rounds: int | None = None,
        shared_inbox: bool = False,
        still_asked: Callable[[], Awaitable[bool]] | None = None,
    ) -> CallReply:
        """`prompt_token_ids` / `prompt_text`: the real prompt, for a real engine
        (`vllm` backend; the sim reads only the counts). `sim_output_tokens`: the
        sim engine's stopping point (an engine hint no decision sees). `stream`:
        ask for `CallTokens` as they are generated (`on_event` sees them; the vllm
        backend always streams). Streamed tokens are collected; a reply without
        `token_ids` gets them filled in, where none were missed.

        `shared_inbox`: the call's inbox is named by its call id within this client's
        namespace, not by this client, so every process of the namespace that asks for
        the call (gateway replicas behind one load balancer, a retry landing on another)
        hears its news and its reply there. Each asking from an inbox of its own, they
        took the call's news from each other in turn: each heard nothing for a silence,
        asked again, and gave up after its attempts. `still_asked`: called when this
        client gives up on the call; True where another asker still waits for it, so it
        is not cancelled."""
        cid = call_id or uuid.uuid4().hex
        inbox = self.subjects.reply_inbox(f"{self.namespace}.{SHARED_INBOX}" if shared_inbox else self.client_id, cid)
        hint = (EngineHint(sim_output_tokens=sim_output_tokens, tools_json=tools_json, tool_choice=tool_choice,
                           tool_call_format=tool_call_format if tools_json else None,
                           tool_rounds=tool_rounds if tools_json else None)
                if (sim_output_tokens, tools_json, tool_choice) != (None, None, None) else None)
        # a large real prompt goes by reference: put in the prompt store, read by the engine alone
        by_ref: bytes | None = None
        prompt_ref: str | None = None
        if prompt_text is not None or prompt_token_ids is not None:
            payload = PromptPayload(prompt_text=prompt_text, prompt_token_ids=prompt_token_ids)
            if len(msgspec.json.encode(payload)) > self.prompt_inline_max_bytes:
                by_ref, prompt_ref = encode_payload(payload), object_name(session_id, cid)
                prompt_text = prompt_token_ids = None
        req = CallRequest(call_id=cid, session_id=session_id, model=model, prompt_tokens=prompt_tokens,
                          prefix_tokens=prefix_tokens, max_tokens=max_tokens, reply_to=inbox,
                          prompt_text=prompt_text, prompt_token_ids=prompt_token_ids, engine_hint=hint, stream=stream,
                          sampling=sampling, prompt_ref=prompt_ref)
        data = encode(req)
        # Our own queue read under `asyncio.timeout`, not `sub.next_msg`: nats-py's next_msg wraps
        # `asyncio.wait_for`, which on Python 3.11 can swallow a cancellation that races a message,
        # so an agent giving up on a streaming call would silently keep waiting for the reply.
        inbox_msgs: asyncio.Queue[Any] = asyncio.Queue()  # (a Msg, or RECONNECTED)

        async def deliver(msg: Msg) -> None:
            inbox_msgs.put_nowait(msg)

        sub = await self.nc.subscribe(inbox, cb=deliver)
        self._open_calls.add(inbox_msgs)
        streamed: list[int] = []
        missed = False
        done = False
        # the call's span (a root for an agent on NATS; under the gateway's request span there)
        call_span = tracing.span(f"chat {model}", kind=SpanKind.CLIENT,
                                 attributes=tracing.call_attributes(model, session_id, cid, **{
                                     "gen_ai.request.max_tokens": max_tokens}))
        span_ = call_span.__enter__()
        # (a receipt asked for: a call nobody answers at all is sent again soon)
        headers = {**(tracing.with_traceparent(None) or {}), HEADER_RECEIPT: "1"}
        try:
            attempts = 0
            # with our inbox as its reply subject, NATS tells us at once when no router is
            # subscribed (a 503 status there): sent again shortly, not after a silence
            send = functools.partial(self.nc.publish, self.subjects.api_call(self.namespace), data,
                                     headers=headers, reply=inbox)
            # the longest we wait: every attempt's silence (a router away meanwhile included)
            give_up_at = time.monotonic() + self.silence_s * (self.retries + 1)
            while attempts <= self.retries:
                attempts += 1
                if by_ref is not None and prompt_ref is not None:  # (again on a retry: the engine deletes it when done)
                    await self._put_prompt(prompt_ref, by_ref)
                await send()
                sent_at = time.monotonic()
                silent_until = sent_at + self.silence_s  # this attempt's end while nothing is heard
                resends = 0
                answered = False  # anything heard of the call since this attempt's send
                resend_at = sent_at + self.accept_timer.wait_s()
                while True:
                    now = time.monotonic()
                    wait = self.silence_s if answered else max(0.0, min(resend_at, silent_until) - now)
                    try:
                        async with asyncio.timeout(wait):
                            msg = await inbox_msgs.get()
                    except TimeoutError:
                        if answered or time.monotonic() >= silent_until:
                            break  # silence: retry under the same call id
                        # no answer at all yet: the router that took it may have hung or died
                        resends += 1
                        await send()
                        resend_at = time.monotonic() + self.accept_timer.wait_s(resends)
                        continue
                    if msg is RECONNECTED:
                        # asked again under its id (served once): a reply published while we were
                        # away is served again from the call record, a running call heard of again
                        resends += 1
                        await send()
                        answered = False
                        silent_until = time.monotonic() + self.silence_s
                        resend_at = time.monotonic() + self.accept_timer.wait_s(resends)
                        continue
                    if no_responders(msg):
                        if time.monotonic() > give_up_at:
                            break
                        await asyncio.sleep(NO_ROUTER_RETRY_S)  # a router restarting: not an attempt
                        await send()
                        resends += 1  # (which send an answer is for is unknown now: not sampled)
                        resend_at = time.monotonic() + self.accept_timer.wait_s()
                        continue
                    try:
                        ev = call_event_decoder.decode(msg.data)
                    except msgspec.ValidationError:
                        continue
                    if not answered:
                        answered = True
                        if resends == 0:  # Karn's rule: only a call sent once tells the latency
                            self.accept_timer.observe(time.monotonic() - sent_at)
                    if on_event is not None:
                        on_event(ev)
                    match ev:
                        case CallReply():
                            done = True
                            span_.set_attributes({"gen_ai.usage.input_tokens": ev.prompt_tokens,
                                                  "gen_ai.usage.output_tokens": ev.output_tokens,
                                                  "gen_ai.usage.cache_read.input_tokens": ev.cached_tokens,
                                                  "talaria.server_id": ev.server_id})
                            if ev.token_ids is None and streamed and not missed:
                                ev = msgspec.structs.replace(ev, token_ids=streamed)
                            return ev
                        case ApiError():
                            done = True
                            span_.set_attribute("error.type", ev.code)
                            raise_for(ev)
                        case CallTokens(index=i, token_ids=t):
                            if i > len(streamed):  # (tokens sent before this client asked: not ours to fill)
                                missed = True
                                continue
                            del streamed[i:]
                            streamed.extend(t)
                            continue
                        case CallReceived() | CallAccepted() | CallQueued() | CallRunning():
                            continue
            raise CallTimeout("timeout", f"call {cid}: no answer for {self.silence_s:.0f} s, {attempts} attempts")
        finally:
            if not done and not self.nc.is_closed:
                # we give up (timeout or the caller cancelled us): a real engine running it aborts
                # it, unless another asker still waits for it
                try:
                    if still_asked is None or not await still_asked():
                        await self.nc.publish(self.subjects.call_cancel(self.namespace), encode(CancelCall(call_id=cid)))
                except Exception:
                    pass
                if prompt_ref is not None:  # no engine answers it now to delete it: not kept for the store's age
                    self._spawn_quietly(self._forget_prompt(prompt_ref))
            self._open_calls.discard(inbox_msgs)
            await sub.unsubscribe()
            call_span.__exit__(None, None, None)


class Session:
    def __init__(self, client: TalariaClient, session_id: str, model: str, context_limit: int,
                 engine_context_limit: int | None = None, tenant: str | None = None) -> None:
        self.client = client
        self.tenant = tenant
        self.session_id = session_id
        self.model = model
        self.context_limit = context_limit  # the catalog's (a call of token counts only)
        self.engine_context_limit = engine_context_limit  # the engines' (a call with its real prompt), if reported
        self.ended = False

    async def call(
        self,
        *,
        prompt_tokens: int,
        prefix_tokens: int = 0,
        max_tokens: int = 4096,
        call_id: str | None = None,
        sim_output_tokens: int | None = None,
        on_event: Callable[[CallEvent], None] | None = None,
        prompt_token_ids: list[int] | None = None,
        prompt_text: str | None = None,
        stream: bool = False,
        sampling: Sampling | None = None,
        tools_json: str | None = None,
        tool_choice: str | None = None,
        tool_call_format: str | None = None,
        tool_rounds: int | None = None,
        shared_inbox: bool = False,
        still_asked: Callable[[], Awaitable[bool]] | None = None,
    ) -> CallReply:
        """One call of this session (see `TalariaClient.call`). Refused here,
        before anything is sent, when the session has ended or when the prompt
        plus `max_tokens` would not fit in the model's context (the engines' own, for a
        call that carries its real prompt)."""
        if self.ended:
            # the store would answer unknown_session and the retry below would quietly reopen it
            raise SessionEnded("session_ended", f"session {self.session_id} has ended; open a new one")
        real = prompt_token_ids is not None or prompt_text is not None
        limit = self.engine_context_limit if real and self.engine_context_limit else self.context_limit
        if prompt_tokens + max_tokens > limit:
            raise ContextLimit("context_limit",
                               f"prompt of {prompt_tokens} tokens + max_tokens {max_tokens} = "
                               f"{prompt_tokens + max_tokens} passes {self.model}'s context limit of "
                               f"{limit}; lower max_tokens or compact the context")
        kw = dict(prompt_tokens=prompt_tokens, prefix_tokens=prefix_tokens, max_tokens=max_tokens, call_id=call_id,
                  sim_output_tokens=sim_output_tokens, on_event=on_event, prompt_token_ids=prompt_token_ids,
                  prompt_text=prompt_text, stream=stream, sampling=sampling, tools_json=tools_json,
                  tool_choice=tool_choice, tool_call_format=tool_call_format, tool_rounds=tool_rounds,
                  shared_inbox=shared_inbox, still_asked=still_asked)
        try:
            return await self.client.call(self.session_id, self.model, **kw)  # type: ignore[arg-type]
        except UnknownSession:
            # the store lost its soft state (Redis restarted or flushed): the
            # session is ours, so open it again under its id and retry once
            await self.client.open_session(self.model, session_id=self.session_id, tenant=self.tenant)
            return await self.client.call(self.session_id, self.model, **kw)  # type: ignore[arg-type]

    async def end(self) -> None:
        self.ended = True
        await self.client.end_session(self.session_id)


class TokenSession:
    """A session on a real engine whose context is kept as token ids: each next
    prompt is the previous prompt's ids + the ids the model returned + the new
    input's ids, never re-tokenized text, so the engine sees the same prefix."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.context: list[int] = []
        self.calls = 0

    async def call(self, new_input_ids: list[int], *, max_tokens: int, call_id: str | None = None,
                   **kw: object) -> CallReply:
        prompt = self.context + list(new_input_ids)
        prefix = len(self.context) if self.calls else 0
        reply = await self.session.call(prompt_tokens=len(prompt), prefix_tokens=min(prefix, len(prompt) - 1),
                                        max_tokens=max_tokens, prompt_token_ids=prompt,
                                        call_id=call_id or f"{self.session.session_id}#{self.calls:03d}", **kw)
        self.context = prompt + list(reply.token_ids or [])
        self.calls += 1
        return reply
