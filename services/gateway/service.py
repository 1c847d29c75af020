"""gateway: the agents' HTTP front door, OpenAI- and Anthropic-compatible.

A stateless process (any number of replicas behind one port) that speaks to
Talaria as an agent (its own NATS user and namespace, with an agent's permissions)
through the agent client (`shared/agent_client.py`):

    POST /v1/chat/completions   whole, or SSE `chat.completion.chunk` lines ending `data: [DONE]`
    POST /v1/completions        whole, or SSE `text_completion` lines
    POST /v1/messages           Anthropic Messages, whole or as its named SSE events
    POST /v1/responses          OpenAI Responses (Codex), whole or as its named SSE events; stored unless
                                `store: false`, continued with `previous_response_id`
    GET|DELETE /v1/responses/{id}  a stored response read back or deleted
    POST /v1/messages/count_tokens  the prompt's tokens as /v1/messages would send them (Claude Code asks often)
    POST /v1/responses/input_tokens the same for a Responses request (OpenAI's input token count)
    GET  /v1/models             the served models with their context limits (OpenAI's and Anthropic's shape at once)
    GET  /v1/models/{model}     one of them (404 in the API's shape for a model not served)
    GET  /health                no key needed: 200 while NATS is connected (503 `draining` once stopping)

Keys (`TALARIA_API_KEYS`, `tenant:key,...`) come as `Authorization: Bearer` or
`x-api-key`; a request without a valid one is answered 401 before anything
is sent or stored. Sessions come from the agents' own headers and are
namespaced by tenant, agent id and model; the pure rules are in `translate.py`.

The HTTP stack is aiohttp: one well-kept dependency that is both a server and
the client the health check and tests use, with streaming responses and
cancellation of a handler whose client went away (`handler_cancellation`),
which is how a disconnect becomes a `CancelCall`. Starlette would need uvicorn
beside it for the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import signal
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import redis.asyncio as aioredis
import structlog
from aiohttp import web
from opentelemetry.trace import SpanKind

from services.gateway import prefix as px
from services.gateway import reasoning as rs
from services.gateway import tokens as tk
from services.gateway import translate as tr
from services.gateway.limits import GATEWAY_FULL, CallSlots, Waiter
from services.gateway.relay import RerunDiverged, StreamedTokens
from services.gateway.translate import BadRequest, Prompt
from shared import tool_calls as tc
from shared.bus import run_loop
from shared.agent_client import Session, TalariaClient, TalariaError
from shared.catalog import Catalog, load_catalog
from shared.clock import LAG_REPORT_WALL_S, LagMonitor
from shared.keys import CALL_TTL_S, SESSION_TTL_S, Keys
from shared.logs import configure_logging, rotate_logs
from shared.schema import CallReply, CallRunning, CallTokens, Sampling, context_limit_message
from shared import tracing
from shared.metrics import Metrics
from shared.redis_client import RedisUrlError, check_target, open_redis
from shared.settings import GATEWAY_DRAIN_WALL_S, GATEWAY_MAX_CALLS, STREAMS_STOP_WALL_S, Settings, parse_api_keys
from shared.subjects import GATEWAY_NAMESPACE

DEFAULT_MAX_TOKENS = 4096      # a request naming no bound gets this much, capped by the context left
SESSIONS_KEPT = 50_000         # opened sessions remembered (a forgotten one is just opened again)
MODELS_TTL_S = 5.0             # how long the served-model list is reused
MODELS_RETRY_S = 1.0           # ... and, the router not answering, how soon it is asked again
BUSY_TTL_S = 3600.0            # a header-less session's in-flight mark outlives any call (and is deleted after it)
SHED_RETRY_AFTER_S = 1.0       # what a request over the gateway's or its tenant's bound is told to wait
BUS_RETRY_AFTER_S = 2.0        # what a request refused while NATS is away is told to wait (a reconnect takes seconds)
IDLE_CONNECTION_S = 75.0       # an HTTP connection with no request in progress is closed after this (nginx's default)
REDIS_CONNECTIONS = 64         # the gateway's pool: a command waits for one, up to SOFT_STATE_WAIT_S (redis-py's
                               # default pool of 100 refused the 101st at once, and soft state was set aside)
SOFT_STATE_PAUSE_S = 5.0       # how long the gateway does without its soft state after Redis failed to answer
SOFT_STATE_WAIT_S = 1.0        # how long one soft step waits on Redis (a stalled one answers nothing at all)
SOFT_STATE_PROBE_S = 0.5       # while it is set aside: a PING this often (and waited on this long) ends the pause
# a replica says it is up this often, and is taken for gone (its calls no longer asked for by it)
# once not heard of for REPLICA_TTL_WALL_S: a replica killed while it waited for a call had kept
# that call from ever being cancelled by the others
REPLICA_BEAT_WALL_S = 2.0
REPLICA_TTL_WALL_S = 10
IGNORED_FIELDS_LOGGED = 256   # (API, field) pairs a gateway logs as ignored, once each (a client could send any)
RETRY_WINDOW_S = 3600          # how long a first attempt's call id waits for its SDK's retries (timeouts x retries: minutes)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
REQUEST_ID_HEADER, ANTHROPIC_REQUEST_ID_HEADER = "x-request-id", "request-id"
REQUEST_ID_KEY = web.RequestKey("talaria.call_id", str)  # a request's call id, for its answer's headers
TENANT_KEY = web.RequestKey("talaria.tenant", str)  # a request's tenant, once its key was read
CLIENT_GONE_KEY = web.RequestKey("talaria.client_gone", int)  # set when the client left before its answer: 499
# the error code a streamed answer ended in after it had begun (its status already sent: 200)
STREAM_ERROR_KEY = web.RequestKey("talaria.stream_error", str)
SSE_KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: clients skip it; writing it finds a client that has gone

OPENAI, ANTHROPIC = "openai", "anthropic"
T = TypeVar("T")
MODEL_CALL_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"})
OPENAI_PATHS = ("/v1/chat/", "/v1/completions", "/v1/responses")  # OpenAI's own: its shape whatever the headers
RESPONSES = "responses"  # OpenAI's Responses API: OpenAI's error shapes, its own label in metrics and traces


class HttpError(Exception):
    """An answer in the API's own error shape (`code` is a Talaria error code or `unauthorized`)."""

    def __init__(self, code: str, message: str, param: str | None = None, retry_after_s: float | None = None,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.details = details  # (Anthropic's `error.details`, which its SDK reads to recover)


def stopping_refusal() -> HttpError:
    """A request that reached a stopping gateway, told to be sent again (elsewhere)."""
    return HttpError("unavailable", "this gateway is stopping: send the request again", retry_after_s=1.0)


def error_response(api: str, err: HttpError) -> web.Response:
    if api == ANTHROPIC:
        status, body = tr.anthropic_error(err.code, err.message)
        if err.details is not None:
            body["error"]["details"] = err.details
    else:
        status, body = tr.openai_error(err.code, err.message, err.param)
    headers = {}
    if err.code in ("no_capacity", "rate_limited", "unavailable"):
        headers["Retry-After"] = str(max(1, round(err.retry_after_s or 1)))
    return web.json_response(body, status=status, headers=headers)


def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"{head}data: {payload}\n\n".encode()


@dataclass(frozen=True)
class CallIds:
    session_id: str
    call_id: str
    prefix_tokens: int   # what the session's engine holds of this prompt (block-rounded)
    session_name: str = ""  # the agent's own name for it (logged, so `talaria logs NAME` finds it)

    @property
    def named(self) -> bool:
        """The agent named its session (a header); else it was matched by its prefix."""
        return bool(self.session_name)


@dataclass(frozen=True)
class Prepared:
    """A request read and checked, ready to call: what every API's handler hands `_call`."""
    tenant: str
    model: str
    stream: bool
    prompt: Prompt
    max_tokens: int
    sampling: Sampling
    ids: CallIds
    sim_output: int | None = None
    tools: tuple[tc.Tool, ...] = ()
    tool_choice: str | None = None
    tool_format: str = "none"  # the model's tool-call format ("none": no tools asked for)
    tools_json: str | None = None
    tool_rounds: int = 0  # tool results since the user's last message
    one_call: bool = False  # parallel tool calls turned off: the first call only
    reasoning_format: str = "none"  # how the model writes its reasoning (reasoning.py)
    show_reasoning: bool = True  # the reply carries the reasoning (Anthropic: where thinking was asked for)

    def answer(self, reply: CallReply) -> tr.Answer:
        """The reply read as the model wrote it: its reasoning apart, and the tool calls
        this request allows in what it answered (none under `tool_choice: none`)."""
        readable = list(self.tools) if tr.reads_calls(bool(self.tools), self.tool_choice) else []
        return tr.answer_of(reply, self.tool_format, readable, self.one_call, self.reasoning_format)

    def text_stream(self) -> tr.TextStream:
        """How the reply's text is streamed, as this request's tools allow."""
        return tr.TextStream.for_tools(bool(self.tools), self.tool_format, self.tool_choice)


def _cache_scope(tenant: str, model: str) -> str:
    """Whose prompts the chain cache may reuse for one another."""
    return f"{tenant}\0{model}"


@dataclass
class SharedCall:
    """A whole call running here and the requests waiting for its reply: its first
    attempt and any retry that joined it (an SDK whose timeout was shorter than the
    call retries, and the retry takes the reply the call was making rather than
    starting it again). When the last waiter leaves a call whose client retries, the
    call runs on for the retry grace; `cleanup` is what that waiter left undone (the
    session's release or end), done when the call ends unjoined."""

    task: "asyncio.Task[CallReply]"
    tenant: str
    waiters: int = 0
    grace: asyncio.TimerHandle | None = None
    cleanup: Callable[[], Awaitable[None]] | None = None


# delete a header-less session's in-flight mark only if it is this call's
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
# extend a stored conversation's thread only from its last item (ARGV[1]: the length the
# continued response ends at; ARGV[2]: the TTL; then the items), else 0: another response
# continued it first, and this one takes a thread of its own
_APPEND = ("if redis.call('LLEN', KEYS[1]) ~= tonumber(ARGV[1]) then return 0 end "
           "for i = 3, #ARGV do redis.call('RPUSH', KEYS[1], ARGV[i]) end "
           "redis.call('EXPIRE', KEYS[1], ARGV[2]) return 1")


class Gateway:
    def __init__(self, settings: Settings, client: TalariaClient, catalog: Catalog | None = None,
                 redis: aioredis.Redis | None = None) -> None:
        self.settings = settings
        self.client = client
        # where sessions' prefix chains live (shared by every replica); None: not kept,
        # so every prefix is taken as empty and a header-less request is a session of its own
        self.redis = redis
        self.soft_state_away_until = 0.0  # (monotonic) Redis did not answer: done without until then
        # Redis answered the last step tried on it (a failure sets it false until one answers:
        # `talaria_dependency_up`, which a pause that ended read as up while Redis was still away)
        self.redis_answering = True
        self._soft_state_probe: asyncio.Future[None] | None = None  # asks Redis meanwhile, to end it sooner
        self.rkeys = Keys(settings.key_prefix)
        self.chains = px.ChainCache()
        self.catalog = catalog or load_catalog(settings.catalog_path)
        self.keys = parse_api_keys(settings.api_keys)
        # each model's own chat template and tokenizer where the deployment names its folder
        # (loaded now, so a bad folder stops the gateway at start, not a call)
        self.tokenizers = tk.Tokenizers(settings.gateway_tokenizers)
        self.tokenizers.load_all()
        self.tool_parsers = tk.parse_model_map(settings.gateway_tool_parsers, "TALARIA_GATEWAY_TOOL_PARSERS", tc.FORMATS)
        self.reasoning_parsers = tk.parse_model_map(settings.gateway_reasoning_parsers,
                                                    "TALARIA_GATEWAY_REASONING_PARSERS", rs.FORMATS)
        self.log = structlog.get_logger("gateway")
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self.shared_calls: dict[str, SharedCall] = {}  # call id -> a whole call running here
        self._background: set[asyncio.Task[Any]] = set()  # held calls' cleanups (a reference, so none is collected)
        self._models: tuple[float, list[str]] | None = None
        self._limits: dict[str, int] = {}
        self.metrics = Metrics()
        self.draining = False  # SIGTERM: API requests in flight finish, new ones are sent elsewhere
        self.in_flight = 0     # API requests being answered (a stream until its end)
        # as many may wait in line as may be in flight (a waiter costs its connection alone)
        waiting = (settings.gateway_max_calls or GATEWAY_MAX_CALLS) if settings.gateway_queue_wait_s > 0 else 0
        self.slots = CallSlots(settings.gateway_max_calls, settings.gateway_tenant_max_calls, waiting)
        self.metrics.gateway_calls(lambda: self.slots.held, lambda: len(self.slots.waiting), self.slots.most)
        self.streams_stop = asyncio.Event()  # the drain's time is up: streams end with the API's error event
        self.drain_cut_asked = asyncio.Event()  # a second SIGTERM: the drain's time is up now
        self._ignored_said: set[tuple[str, str]] = set()  # (API, field) this process has logged as ignored

    # -- the app --------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.gateway_max_body, middlewares=[self._errors])
        app[GATEWAY_KEY] = self
        app.router.add_get("/health", self.health)
        app.router.add_get("/", self.health)  # (Claude Code checks the base URL with a HEAD / first)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model_info)
        for path, handler in (("/v1/chat/completions", self.chat), ("/v1/completions", self.completions),
                              ("/v1/messages", self.messages), ("/v1/responses", self.responses),
                              ("/v1/messages/count_tokens", self.count_tokens),
                              ("/v1/responses/input_tokens", self.input_tokens),
                              ("/v1/responses/compact", self.compact)):
            app.router.add_post(path, handler, expect_handler=self._expect_continue)
        app.router.add_get("/v1/responses/{response_id}", self.stored_response)
        app.router.add_get("/v1/responses/{response_id}/input_items", self.response_input_items)
        app.router.add_delete("/v1/responses/{response_id}", self.delete_response)
        # the paths served that name no variable part (a 404's hint; a 405 under /v1/responses/)
        self.static_paths = frozenset(r.resource.canonical for r in app.router.routes()
                                      if r.resource is not None and "{" not in r.resource.canonical)
        app.on_response_prepare.append(self._request_id)
        app.cleanup_ctx.append(self._replica_beat)
        app.cleanup_ctx.append(self._watch_lag)
        return app

    async def _watch_lag(self, _app: web.Application) -> AsyncIterator[None]:
        """The event loop's lag, measured and reported as every service's is: a gateway
        relaying many streams lags first, and its lag alert had read 0 for ever."""
        lag = LagMonitor()

        async def report() -> None:
            counted_stalls_s = 0.0
            while True:
                await asyncio.sleep(LAG_REPORT_WALL_S)
                counted_stalls_s = self.metrics.report_lag(lag, counted_stalls_s)

        tasks = [asyncio.ensure_future(lag.run()), asyncio.ensure_future(report())]
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _replica_beat(self, _app: web.Application) -> AsyncIterator[None]:
        """While it serves, the replica says in Redis that it is up (`gw:replica:<id>`), so
        another replica can tell whether it still asks for a call (`_others_ask`)."""
        async def beat() -> None:
            while True:
                await self._soft(lambda: self.redis.set(self._replica_key, b"1", ex=REPLICA_TTL_WALL_S), None)  # type: ignore[union-attr]
                await asyncio.sleep(REPLICA_BEAT_WALL_S)

        task = asyncio.ensure_future(beat()) if self.redis is not None else None
        yield
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            await self._soft(lambda: self.redis.delete(self._replica_key), None)  # type: ignore[union-attr]

    @property
    def _replica_key(self) -> str:
        return self.rkeys.gateway_replica(self.client.client_id)

    @staticmethod
    async def _request_id(request: web.Request, resp: web.StreamResponse) -> None:
        """Every answer names itself as the APIs do (`x-request-id` for OpenAI's SDKs,
        `request-id` for Anthropic's, which show it as the reply's `_request_id`): a call's
        own id, the one the services' logs and traces carry (`talaria logs`), else a fresh
        one for an answer that made no call."""
        rid = request.get(REQUEST_ID_KEY) or "req_" + uuid.uuid4().hex
        resp.headers.setdefault(REQUEST_ID_HEADER, rid)
        resp.headers.setdefault(ANTHROPIC_REQUEST_ID_HEADER, rid)

    @staticmethod
    def _shape(request: web.Request) -> str:
        """The API whose error shape answers a request: Anthropic's for its paths and for any
        request its SDKs sent (they send `anthropic-version` on every call: a base URL set one
        /v1 off gets its 404 in the words it reads), else OpenAI's."""
        anthropic_client = "anthropic-version" in request.headers and not request.path.startswith(OPENAI_PATHS)
        return ANTHROPIC if request.path.startswith("/v1/messages") or anthropic_client else OPENAI

    def _count(self, request: web.Request, shape: str, status: int, t0: float) -> None:
        api = RESPONSES if request.path.startswith("/v1/responses") else shape
        self.metrics.http_requests.labels(api=api, status=str(status)).inc()
        if (code := request.get(STREAM_ERROR_KEY)) is not None:
            self.metrics.http_stream_errors.labels(api=api, code=code).inc()
        self.metrics.http_duration.labels(api=api).observe(time.monotonic() - t0)

    async def _expect_continue(self, request: web.Request) -> web.StreamResponse | None:
        """`Expect: 100-continue` (curl sends it for a large upload, some HTTP clients for
        every POST): the client holds its body back until told to go on. A request refused
        whatever its body says (no valid key, a stopping gateway, a declared length over the
        limit) is refused now, in the API's shape, instead of being told to upload a long
        prompt first; the connection then closes, as its body was never read."""
        if request.headers.get("Expect", "").lower() != "100-continue":
            err = HttpError("expectation_failed", f"unknown Expect: {request.headers.get('Expect', '')[:100]} "
                                                  "(only 100-continue is served)")
        elif self.draining:
            err = stopping_refusal()
        elif (tenant := self._known_tenant(request)) is None:
            err = self._unauthorized(request)
        elif (over := self._declared_too_large(request)) is not None:
            err = over
        elif request.path in MODEL_CALL_PATHS and (limit := self.slots.refusal(tenant)) is not None \
                and self.slots.line_full(tenant):
            err = self._over_limit(limit)  # (its upload would only be read to be refused)
        else:
            if request.version >= (1, 1):
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                request.writer.output_size = 0  # (the interim answer is no part of the response's size)
            return None
        t0 = time.monotonic()
        shape = self._shape(request)
        resp = self._refused(request, shape, err)
        resp.force_close()
        self._count(request, shape, resp.status, t0)
        return resp

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        """Every refusal in the API's own shape, and every API request counted by its API
        and status (refusals before a call as well as calls; a client that went away: 499)."""
        shape = self._shape(request)
        t0, status = time.monotonic(), 500
        api_call = request.path.startswith("/v1/")
        # the tenant whose slot this request would hold: a call of a model with a valid key (a
        # token count, or a read of a stored response or the model list, is quick and streams
        # nothing: Claude Code counts often, and would wait behind its own streams; a keyless
        # request gets its 401)
        tenant = self._known_tenant(request) if request.method == "POST" and request.path in MODEL_CALL_PATHS else None
        holds_slot = False
        self.in_flight += api_call
        try:
            if api_call and self.draining:  # (a load balancer has been told by /health; a client retries)
                resp = self._refused(request, shape, stopping_refusal())
            elif tenant is not None and not await self._slot(tenant):
                # (before its body is read or anything is sent)
                over = stopping_refusal() if self.draining else \
                    self._over_limit(self.slots.refusal(tenant) or GATEWAY_FULL)
                resp = self._refused(request, shape, over)
            else:
                holds_slot = tenant is not None
                resp = await self._answer(request, handler, shape)
            status = 499 if request.get(CLIENT_GONE_KEY) else resp.status
            return resp
        except web.HTTPException as exc:  # aiohttp's own answers (it writes them)
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            self.in_flight -= api_call
            if holds_slot:
                self._admitted(self.slots.give_back(tenant))  # type: ignore[arg-type]
            if api_call:
                self._count(request, shape, status, t0)

    async def _answer(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                      shape: str) -> web.StreamResponse:
        try:
            return await handler(request)
        except HttpError as err:
            return self._refused(request, shape, err)
        except web.HTTPRequestEntityTooLarge:
            return self._refused(request, shape, HttpError(
                "too_large", f"request body over {self.settings.gateway_max_body} bytes"))
        except web.HTTPNotFound:
            return self._refused(request, shape, HttpError(
                "not_found", f"no such endpoint: {request.method} {request.path}{self._path_hint(request)}"))
        except web.HTTPMethodNotAllowed as exc:
            resp = self._refused(request, shape, HttpError(
                "method_not_allowed", f"{request.method} is not allowed on {request.path}"))
            resp.headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
            return resp
        except web.HTTPException:
            raise
        except Exception:
            if request.writer is not None and request.writer.output_size:
                raise  # (a stream's head is out: only the connection's close can end it now)
            # a fault of the gateway's own: still the API's shape (aiohttp's is a text/plain 500), logged
            rid = request[REQUEST_ID_KEY] = request.get(REQUEST_ID_KEY) or "req_" + uuid.uuid4().hex
            self.log.exception("gateway.failed", request_id=rid, method=request.method, path=request.path)
            return error_response(shape, HttpError("internal", f"the gateway failed on this request ({rid} in "
                                                               "its log says why)"))

    def _path_hint(self, request: web.Request) -> str:
        """The endpoint a path not found was likely meant for, said in a 404 (else ""): a base
        URL set one /v1 off is the commonest setup mistake; `//v1/...` and `/V1/...` too."""
        canonical = "/" + "/".join(part for part in request.path.split("/") if part)
        if canonical.lower().startswith("/v1/v1/"):  # (a base URL ending in /v1 where the SDK adds its own)
            return (f" (/v1 twice: {request.method} {canonical[3:]}; the base URL ends in /v1 where the client "
                    "adds it itself: ANTHROPIC_BASE_URL is the gateway's URL without /v1)")
        under_v1 = canonical.lower() == "/v1" or canonical.lower().startswith("/v1/")
        meant = "/v1" + (canonical[3:] if under_v1 else canonical)
        if meant == request.path or meant not in self.static_paths:
            return ""
        return f" (did you mean {request.method} {meant}?)" if under_v1 else \
            f" (the API is under /v1: {request.method} {meant})"

    def _refused(self, request: web.Request, shape: str, err: HttpError) -> web.Response:
        """An error answer. One that made no call is logged too (`gateway.refused`), under
        the request id its headers carry, so `talaria logs <request id>` says why; a
        call's own answer is its `gateway.call` line."""
        resp = error_response(shape, err)
        if err.code in ("body_timeout", "too_large"):
            resp.force_close()  # (the connection holds the unread rest of a body)
        if request.get(REQUEST_ID_KEY) is None:
            rid = request[REQUEST_ID_KEY] = "req_" + uuid.uuid4().hex
            self.log.info("gateway.refused", request_id=rid, method=request.method, path=request.path,
                          api=RESPONSES if request.path.startswith("/v1/responses") else shape, status=resp.status,
                          code=err.code, param=err.param, message=err.message[:300])
        return resp

    async def health(self, request: web.Request) -> web.Response:
        if self.draining:  # alive (a liveness watch must not kill the drain), not ready (a balancer moves away)
            return web.json_response({"status": "draining"}, status=503)
        ok = self.client.nc.is_connected
        return web.json_response({"status": "ok" if ok else "nats disconnected"}, status=200 if ok else 503)

    async def drain(self, within_s: float) -> None:
        """SIGTERM: refuse new API requests (503, to be sent again) while those in flight
        finish, for up to `within_s`; the listener stays open meanwhile, so /health says
        `draining` to a load balancer and to a liveness watch, which a refused connection
        would tell nothing (the embedded stack's watch killed a gateway draining so)."""
        async def settled(within_s: float) -> bool:
            deadline = time.monotonic() + within_s
            while self.in_flight and time.monotonic() < deadline and not self.drain_cut_asked.is_set():
                await asyncio.sleep(0.05)
            return not self.in_flight

        self.draining = True
        for waiter in self.slots.refuse_all():  # (told to go elsewhere, not left to wait out the line)
            if not waiter.handle.done():
                waiter.handle.set_result(False)
        if self.in_flight:
            self.log.info("gateway.draining", in_flight=self.in_flight, within_s=within_s)
        if not await settled(within_s):
            # streams say why they end (else cut by the exit, a bare close: a probe's 50-s one)
            self.log.warning("gateway.drain_cut", in_flight=self.in_flight, asked=self.drain_cut_asked.is_set())
            self.streams_stop.set()
            self.drain_cut_asked.clear()
            await settled(STREAMS_STOP_WALL_S)

    # -- shared steps ---------------------------------------------------------------------------
    def _note_ignored(self, api: str, body: dict[str, Any]) -> None:
        """Log once per process each field of a request that the gateway does not act on:
        an operator sees what the agents send that changes nothing here."""
        for name, why in tr.ignored_fields(body, api).items():
            if (api, name) not in self._ignored_said and len(self._ignored_said) < IGNORED_FIELDS_LOGGED:
                self._ignored_said.add((api, name))
                self.log.info("gateway.field_ignored", api=api, field=name[:100], why=why)

    def _known_tenant(self, request: web.Request) -> str | None:
        """The tenant of the request's key (read once a request), else None."""
        if (tenant := request.get(TENANT_KEY)) is None:
            tenant = tr.tenant_for(request.headers, self.keys)
            if tenant is not None:
                request[TENANT_KEY] = tenant
        return tenant

    def _tenant(self, request: web.Request) -> str:
        tenant = self._known_tenant(request)
        if tenant is None:
            raise self._unauthorized(request)
        return tenant

    async def _slot(self, tenant: str) -> bool:
        """A slot for a request of `tenant` (`limits.CallSlots`): at once, or once one comes
        free while it waits in line, up to TALARIA_GATEWAY_QUEUE_WAIT_S; False: none came,
        the line was full, or the gateway stops."""
        if self.slots.try_take(tenant):
            return True
        waiter = self.slots.wait(tenant, asyncio.get_running_loop().create_future())
        if waiter is None:
            return False
        try:
            await asyncio.wait_for(asyncio.shield(waiter.handle), self.settings.gateway_queue_wait_s)
        except TimeoutError:
            pass
        except asyncio.CancelledError:  # its client left: its place, or the slot it was just given, goes on
            self._admitted(self.slots.leave(waiter))
            raise
        if waiter.granted:  # (granted as its time ran out: it is served)
            return True
        self._admitted(self.slots.leave(waiter))
        return False

    @staticmethod
    def _admitted(waiters: list[Waiter]) -> None:
        """Wake the waiters given a slot."""
        for waiter in waiters:
            if not waiter.handle.done():
                waiter.handle.set_result(True)

    def _over_limit(self, limit: str) -> HttpError:
        """The refusal of a request over the gateway's bound on requests in flight (GATEWAY_FULL)
        or its tenant's (TENANT_FULL), after its wait in line."""
        self.metrics.http_calls_shed.labels(limit=limit).inc()
        if limit == GATEWAY_FULL:
            return HttpError("no_capacity", f"this gateway is answering its most requests at once "
                                            f"({self.slots.most}, TALARIA_GATEWAY_MAX_CALLS): retry shortly",
                             retry_after_s=SHED_RETRY_AFTER_S)
        return HttpError("rate_limited", f"this key's tenant has its most requests in flight at once "
                                         f"({self.slots.most_per_tenant}, TALARIA_GATEWAY_TENANT_MAX_CALLS): "
                                         "retry once one has ended", retry_after_s=SHED_RETRY_AFTER_S)

    @staticmethod
    def _unauthorized(request: web.Request) -> HttpError:
        auth = request.headers.get("authorization", "")
        if tr.presented_keys(request.headers):
            why = "invalid API key"
        elif auth.strip():  # (a key under another scheme, or with none, was answered "no API key")
            why = "the Authorization header is not `Bearer <key>` (Basic, or a key with no scheme, is not read)"
        else:
            why = "no API key"
        return HttpError("unauthorized", f"{why}: send `Authorization: Bearer <key>` or `x-api-key: <key>`")

    def _declared_too_large(self, request: web.Request) -> HttpError | None:
        """The refusal of a body whose declared `Content-Length` is over the limit, else None."""
        if (request.content_length or 0) <= self.settings.gateway_max_body:
            return None
        return HttpError("too_large", f"request body over {self.settings.gateway_max_body} bytes "
                                      f"(Content-Length: {request.content_length})")

    async def _body(self, request: web.Request) -> tuple[bytes, dict[str, Any]]:
        limit_s = self.settings.gateway_body_timeout_s
        if (over := self._declared_too_large(request)) is not None:
            raise over  # said at once, not once the limit's 32 MiB have been read (or the body timeout passed)
        try:
            async with asyncio.timeout(limit_s):
                sent = await request.read()
        except TimeoutError:
            # a body trickled, or shorter than its Content-Length, held its connection (and a file
            # descriptor) for ever: answered, and the connection closed (`_refused`; the rest is unread)
            raise HttpError("body_timeout", f"the request body did not arrive within {limit_s:g} s "
                                            "(TALARIA_GATEWAY_BODY_TIMEOUT_S)") from None
        try:  # (the gateway decodes a compressed body itself: aiohttp's answer to a corrupt one is a 500)
            raw = tr.decode_body(sent, request.headers.get("Content-Encoding"), self.settings.gateway_max_body)
        except tr.BodyEncodingError as exc:
            raise HttpError(exc.code, str(exc)) from None
        try:
            try:
                body = msgspec.json.decode(raw)
            except msgspec.DecodeError:
                body = tr.lenient_json(raw)  # (what JSON allows that msgspec refuses, or the parser's own words)
        except ValueError as exc:
            raise HttpError("malformed", f"the body is not JSON: {exc}"[:500]) from None
        except RecursionError:  # (msgspec's answer to nesting thousands deep)
            raise HttpError("malformed", "the body is nested too deeply") from None
        if not isinstance(body, dict):
            raise HttpError("malformed", "the body must be a JSON object")
        return raw, body

    def _bus_up(self) -> None:
        """A request while the gateway has lost NATS is told so at once, as a 503 to retry,
        rather than after every request of its call has waited out its timeout."""
        if not self.client.nc.is_connected:
            raise HttpError("unavailable", "the gateway has lost its connection to the message bus (NATS) and is "
                                           "reconnecting; retry shortly", retry_after_s=BUS_RETRY_AFTER_S)

    async def served_models(self) -> list[str]:
        self._bus_up()
        now = time.monotonic()
        if self._models is None or now - self._models[0] > MODELS_TTL_S:
            try:
                info = await self.client.info()
            except TalariaError as exc:
                if self._models is not None:
                    # the router is away a moment (a restart): the list it last gave stands, asked again
                    # in a second, and the call goes on (its request is sent again until a router is back)
                    self.log.warning("gateway.models_stale", error=exc.code)
                    self._models = (now - MODELS_TTL_S + MODELS_RETRY_S, self._models[1])
                    return self._models[1]
                raise HttpError("unavailable", f"the router did not answer: {exc.message}; retry shortly",
                                retry_after_s=BUS_RETRY_AFTER_S) from None
            self._models = (now, list(info.models))
            self._limits = dict(info.context_limits)
        return self._models[1]

    def context_limit(self, model: str) -> int:
        """The running engines' limit as the router reports it (a real prompt must fit the
        engine, not the catalog's wish), else the catalog's."""
        return self._limits.get(model) or self.catalog.model(model).context_limit

    async def _model(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise HttpError("malformed", "model must be a non-empty string", "model")
        served = await self.served_models()
        if model not in served or model not in self.catalog.models:
            known = ", ".join(sorted(m for m in served if m in self.catalog.models))
            raise HttpError("unknown_model", f"The model `{model[:200]}` does not exist or is not served here "
                                             f"(served: {known or 'none yet'}; GET /v1/models lists them)", "model")
        return model

    def _max_tokens(self, body: dict[str, Any], names: tuple[str, ...], prompt: Prompt, model: str,
                    required: bool = False, prompt_param: str = "messages") -> int:
        limit = self.context_limit(model)
        if prompt.tokens > limit:
            raise HttpError("context_limit", context_limit_message(limit, prompt.tokens), prompt_param)
        for name in names:
            v = tr.whole(body.get(name))
            if v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise HttpError("malformed", f"{name} must be a positive integer", name)
            if prompt.tokens + v > limit:
                raise HttpError("context_limit", context_limit_message(limit, prompt.tokens, v), name)
            return v
        if required:
            raise HttpError("malformed", f"{names[0]} is required", names[0])
        if prompt.tokens == limit:  # it fits, and leaves no room for the one token a reply needs
            raise HttpError("context_limit", context_limit_message(limit, prompt.tokens, 1), prompt_param)
        return min(DEFAULT_MAX_TOKENS, limit - prompt.tokens)

    @staticmethod
    def _stream(body: dict[str, Any]) -> bool:
        # null is the field left out, as in the APIs' own schemas (clients that
        # serialise every optional field send it)
        stream = body.get("stream")
        if stream is None:
            return False
        if not isinstance(stream, bool):
            raise HttpError("malformed", "stream must be a boolean", "stream")
        return stream

    @staticmethod
    def _check_types(body: dict[str, Any], anthropic: bool) -> None:
        """Fields the APIs type strictly, refused as they refuse them: a string taken as
        `metadata`, `parallel_tool_calls` or `stream_options` was read as no value, and
        Anthropic's `stop_sequences` as a string was read as one sequence."""
        for name, kind, what in (("metadata", dict, "an object"), ("stream_options", dict, "an object"),
                                 ("parallel_tool_calls", bool, "a boolean")):
            if body.get(name) is not None and not isinstance(body[name], kind):
                raise HttpError("malformed", f"{name} must be {what}", name)
        stops = body.get("stop_sequences")
        if anthropic and stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
            raise HttpError("malformed", "stop_sequences must be an array of strings", "stop_sequences")

    @classmethod
    def _check_common(cls, body: dict[str, Any]) -> bool:
        stream = cls._stream(body)
        cls._check_types(body, anthropic=False)
        n = body.get("n")
        if n is not None and (isinstance(n, bool) or n != 1):  # (true == 1 in Python: `n: true` had passed)
            raise HttpError("malformed", "only n=1 is served", "n")
        if body.get("stream_options") is not None and not stream:
            # (as OpenAI and vLLM: options of a stream not asked for are a mistake to say, not to drop)
            raise HttpError("malformed", "stream_options is only allowed when stream is true", "stream_options")
        return stream

    def _tools(self, body: dict[str, Any], api: str, model: str) -> tuple[list[tc.Tool], str | None, str]:
        """The request's tools, its tool choice and the model's tool-call format; a 400
        that names the field for tools that are malformed or that the model has no parser for."""
        try:
            tools, choice = tc.anthropic_tools(body) if api == ANTHROPIC else tc.openai_tools(body)
        except tc.ToolsError as exc:
            raise HttpError("malformed", str(exc), exc.param) from None
        if api == ANTHROPIC and isinstance(body.get("tools"), list):
            left_out = [t.get("name") or t["type"] for t in body["tools"] if tc.anthropic_left_out(t)]
            if left_out:  # Anthropic's own tools: not offered to this model (tool_calls.anthropic_tools)
                self.log.info("gateway.tools_left_out", tools=left_out)
        fmt = tk.for_model(self.tool_parsers, model) or self.catalog.model(model).tool_call_format
        if tools and fmt == "none":
            raise HttpError("malformed", f"tool calls are not served for {model} yet (no parser for its format)", "tools")
        if choice == tc.ANY_TOOL and not tools:
            raise HttpError("malformed", "tool_choice asks for a tool call, and no tools are given", "tool_choice")
        if choice not in (None, "none", tc.ANY_TOOL) and choice not in {t.name for t in tools}:
            raise HttpError("malformed", f"tool_choice names {choice!r}, which is not among the tools", "tool_choice")
        return tools, choice, fmt

    async def _chat_prompt(self, tenant: str, model: str, body: dict[str, Any], api: str, fmt: str,
                           tools: list[tc.Tool], tools_json: str | None) -> Prompt:
        """The conversation as the engine will see it: rendered by the model's own chat
        template and tokenized (only what changed since this replica's last call of it),
        or, for a model without a tokenizer here, in stand-in ids."""
        system = body.get("system") if api == ANTHROPIC else None
        tok = self.tokenizers.get(model)
        try:
            continue_final = tr.continues_final_message(body, api)
            effort = tr.reasoning_effort(body, api)
            if effort == tr.THINKING_DISABLED:
                effort = tok.disabled_thinking_effort() if tok is not None else "none"
            template_kwargs = tr.effort_template_kwargs(effort, tr.chat_template_kwargs(body))
            if tok is None:
                roles = tr.ANTHROPIC_ROLES if api == ANTHROPIC else tr.CHAT_ROLES
                prompt = tr.chat_prompt(body.get("messages"), system, roles=roles, tool_format=fmt, tools_json=tools_json)
            else:
                messages = tr.template_messages(body.get("messages"), system, api=api)
            tr.check_tool_results(body["messages"], api)
            if tok is None:
                return prompt
        except BadRequest as exc:
            raise HttpError("malformed", str(exc), exc.param) from None
        schemas = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                     "parameters": t.parameters}} for t in tools]

        def render_and_encode() -> tuple[str, Any]:
            text = tok.render(messages, schemas, continue_final, template_kwargs)
            return text, tok.encode(_cache_scope(tenant, model), text)

        try:  # (off the event loop: a long conversation's render and encode take milliseconds)
            text, ids = await asyncio.to_thread(render_and_encode)
        except Exception as exc:  # noqa: BLE001 - the template's own refusal (raise_exception), named for the agent
            raise HttpError("malformed", f"the model's chat template refused the conversation: {exc}"[:500],
                            "messages") from None
        return Prompt(text, ids, chat=True, tokenizer=tok)

    async def _prepare_chat(self, request: web.Request, tenant: str, raw: bytes, body: dict[str, Any], dialect: str,
                            max_names: tuple[str, ...], *, original: dict[str, Any] | None = None) -> Prepared:
        """A chat-shaped request (chat completions, Responses read as chat, Messages) checked
        field by field in one order, so every API refuses the same fault the same way:
        model, stream, tools, the prompt, max tokens, sampling, then its session and call
        ids (from `original`, the body as the agent sent it, when it was translated)."""
        model = await self._model(body)
        anthropic = dialect == ANTHROPIC
        stream = self._stream(body) if anthropic else self._check_common(body)
        if original is not None or anthropic:  # (the body as the agent sent it: Responses' own fields)
            self._check_types(original if original is not None else body, anthropic)
        tools, choice, fmt = self._tools(body, dialect, model)
        tools_json = tc.tools_text(tools) if tools else None
        prompt = await self._chat_prompt(tenant, model, body, dialect, fmt, tools, tools_json)
        max_tokens = self._max_tokens(body, max_names, prompt, model, required=anthropic)
        if anthropic:
            try:
                tr.check_thinking(body, max_tokens)
            except BadRequest as exc:
                raise HttpError("malformed", str(exc), exc.param) from None
        sim_output = self._sim_output(body, max_tokens)
        sampling = self._sampling(body, dialect, max_tokens)
        ids = await self._ids(request, tenant, raw, original if original is not None else body, model, prompt)
        return Prepared(tenant, model, stream, prompt, max_tokens, sampling, ids, sim_output, tuple(tools), choice, fmt,
                        tools_json, tc.tool_rounds(body.get("messages")) if tools else 0,
                        tr.one_call_only(body, dialect), self._reasoning_format(model),
                        tr.thinking_asked(body) if anthropic else True)

    def _reasoning_format(self, model: str) -> str:
        return tk.for_model(self.reasoning_parsers, model) or self.catalog.model(model).reasoning_format

    async def _prompt_only(self, tenant: str, body: dict[str, Any], dialect: str) -> Prompt:
        """The prompt a chat-shaped body would send (for the token counts: no call)."""
        model = await self._model(body)
        tools, _, fmt = self._tools(body, dialect, model)
        return await self._chat_prompt(tenant, model, body, dialect, fmt, tools, tc.tools_text(tools) if tools else None)

    async def _referenced_items(self, tenant: str, original: dict[str, Any]) -> dict[str, Any]:
        """The request with its `item_reference`s replaced by the stored output items they
        name (as the Vercel AI SDK sends earlier assistant items where `store` is true)."""
        try:
            refs = tr.item_references(original)
        except BadRequest as exc:
            raise HttpError("malformed", str(exc), exc.param) from None
        found: dict[str, Any] = {}
        if refs and self.redis is not None:
            owners = await self._response_store(
                lambda r: r.mget([self.rkeys.gateway_item(tr.item_digest(tenant, ref)) for ref in refs]))
            for rid in {o.decode() for o in owners if o is not None}:
                stored = await self._read_response(tenant, rid)
                for item in (stored.response.get("output") or ()) if stored is not None else ():
                    if item.get("id") in refs:
                        found[item["id"]] = item
        elif refs:
            raise HttpError("malformed", "item_reference is not served: this gateway has no Redis to store "
                            "responses in; send the item itself", f"input[{min(refs.values())}]")
        try:
            return tr.with_items_resolved(original, found)
        except BadRequest as exc:
            raise HttpError("malformed", str(exc), exc.param) from None

    async def _prepare_responses(self, request: web.Request, tenant: str, raw: bytes, body: dict[str, Any],
                                 original: dict[str, Any]) -> Prepared:
        """A Responses request prepared as chat; with `truncation: "auto"`, one over the context
        is sent with the fewest of its oldest turns left out that make it fit (found by halving:
        each try renders the prompt, and one that does not fit is refused before any call)."""
        prepare = functools.partial(self._prepare_chat, request, tenant, raw, original=original,
                                    dialect=OPENAI, max_names=("max_output_tokens",))
        try:
            return await prepare(body=body)
        except HttpError as err:
            if err.code != "context_limit" or original.get("truncation") != "auto":
                raise
            if (fitted := await self._fewest_turns_left_out(body, prepare)) is None:
                raise err from None  # (its last turn alone is over the context)
            return fitted

    async def _fewest_turns_left_out(self, body: dict[str, Any], attempt: Callable[..., Awaitable[T]]) -> T | None:
        """`truncation: "auto"` for a chat-shaped body over the context: `attempt(body=...)` on
        it with the fewest of its oldest turns left out that `attempt` takes without a context
        refusal (found by halving), else None: its last turn alone is over the context."""
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        droppable = tr.droppable_turns(messages)
        lo, hi, best = 1, droppable, None
        while lo <= hi:
            mid = (lo + hi) // 2
            try:
                best = await attempt(body={**body, "messages": tr.truncated_turns(messages, mid)})
                hi = mid - 1
            except HttpError as again:
                if again.code != "context_limit":
                    raise
                lo = mid + 1
        if best is not None:
            self.log.info("gateway.truncated", turns_left_out=lo, turns=droppable + 1)
        return best

    async def _responses_as_chat(self, tenant: str, original: dict[str, Any]
                                 ) -> tuple[dict[str, Any], list[Any], tr.StoredResponse | None]:
        """A Responses body as the chat request it asks for, after the stored conversation
        it continues (`previous_response_id`); (that request, that conversation, the stored
        response it continues)."""
        try:
            prev = tr.previous_response_id(original)
            continued = await self._stored_conversation(tenant, prev) if prev is not None else None
            previous = continued[0] if continued is not None else []
            return tr.responses_request(original, previous), previous, continued[1] if continued is not None else None
        except BadRequest as exc:
            raise HttpError("malformed", str(exc), exc.param) from None

    def _response_key(self, tenant: str, response_id: str) -> str:
        return self.rkeys.gateway_response(tr.response_digest(tenant, response_id))

    async def _response_store(self, op: Callable[[aioredis.Redis], Awaitable[Any]]) -> Any:
        """`op` on the stored responses (their objects, their items' index); a 503 to retry
        where Redis is away."""
        assert self.redis is not None
        try:
            return await op(self.redis)
        except Exception as exc:  # noqa: BLE001 - the store is away: the agent may retry
            self.log.warning("gateway.response_store_unavailable", error=type(exc).__name__)
            raise HttpError("unavailable", "the response store (Redis) is not answering; retry",
                            retry_after_s=BUS_RETRY_AFTER_S) from None

    async def _read_response(self, tenant: str, response_id: str) -> tr.StoredResponse | None:
        """A stored response of the tenant's (its object; `_read_conversation` reads its conversation too), or None."""
        if self.redis is None:
            return None
        blob = await self._response_store(lambda r: r.get(self._response_key(tenant, response_id)))
        return tr.read_stored_response(blob) if blob is not None else None

    async def _read_conversation(self, tenant: str, response_id: str) -> tuple[list[Any], tr.StoredResponse] | None:
        """A stored response of the tenant's with the conversation it ends, or None (unknown,
        expired, or its thread lost with a Redis that restarted empty)."""
        stored = await self._read_response(tenant, response_id)
        if stored is None:
            return None
        if stored.conversation is not None:  # (stored whole)
            return stored.conversation, stored
        thread = self.rkeys.gateway_thread(stored.thread or "")
        raw = await self._response_store(lambda r: r.lrange(thread, 0, stored.length - 1))
        if len(raw) < stored.length:
            return None
        return [tr.read_thread_item(b) for b in raw], stored

    async def _stored_conversation(self, tenant: str, response_id: str) -> tuple[list[Any], tr.StoredResponse]:
        if self.redis is None:
            raise HttpError("malformed", "previous_response_id is not served: this gateway has no Redis to store "
                            "responses in; send the whole conversation in input", "previous_response_id")
        stored = await self._read_conversation(tenant, response_id)
        if stored is None:
            raise HttpError("previous_response_not_found", f"Previous response with id '{response_id[:256]}' not "
                            "found.", "previous_response_id")
        return stored

    async def _keep_response(self, tenant: str, previous: list[Any], continued: tr.StoredResponse | None,
                             new_items: list[Any], response: dict[str, Any]) -> bool:
        """Store a response to be read back and continued: its conversation (`previous`, the
        stored one it continues, then `new_items`) by appending the new items to the thread
        of the response it continues where that one is the thread's last, else as a thread of
        its own; False where the store is away (the agent is answered all the same, its
        response saying `store: false`)."""
        assert self.redis is not None
        redis, ttl = self.redis, self.settings.gateway_responses_ttl_s
        own = tr.response_digest(tenant, response["id"])  # (a thread of its own is named as it is)

        async def append(thread: str, at: int, items: list[Any]) -> bool:
            return bool(await redis.eval(_APPEND, 1, self.rkeys.gateway_thread(thread), at, ttl,
                                         *(tr.thread_item(it) for it in items)))

        async def store() -> bool:
            if continued is not None and continued.thread is not None \
                    and await append(continued.thread, continued.length, new_items):
                thread = continued.thread
            else:  # a first response, one continuing a response others continued first, or one stored whole
                thread = own  # (refused only where a first store of this very response made it: the same items)
                await append(thread, 0, previous + new_items)
            await redis.set(self._response_key(tenant, response["id"]),
                            tr.stored_response(thread, len(previous) + len(new_items), response), ex=ttl)
            items = [it["id"] for it in response.get("output") or () if isinstance(it.get("id"), str)]
            if items:  # (each output item found by its id, for an item_reference to it)
                async with redis.pipeline(transaction=False) as p:
                    for item in items:
                        p.set(self.rkeys.gateway_item(tr.item_digest(tenant, item)), response["id"], ex=ttl)
                    await p.execute()
            return True

        # a soft step (the reply is held for it; the reply matters more than its copy)
        return await self._soft(store, False, "gateway.response_not_stored", response_id=response["id"])

    def _soft_state_aside(self) -> None:
        """Do without the soft state for SOFT_STATE_PAUSE_S, or until Redis answers a PING
        again (asked each SOFT_STATE_PROBE_S meanwhile): a blind pause gave every call in the
        seconds after a stall ended no prefix (its engine still held its KV) and no store."""
        self.soft_state_away_until = time.monotonic() + SOFT_STATE_PAUSE_S
        self.redis_answering = False
        if self._soft_state_probe is None or self._soft_state_probe.done():
            self._soft_state_probe = asyncio.ensure_future(self._probe_soft_state())

    async def _probe_soft_state(self) -> None:
        assert self.redis is not None
        while time.monotonic() < self.soft_state_away_until:
            await asyncio.sleep(SOFT_STATE_PROBE_S)
            try:
                async with asyncio.timeout(SOFT_STATE_PROBE_S):
                    await self.redis.ping()
            except Exception:  # noqa: BLE001 - still away: asked again
                continue
            self.redis_answering = True
            if time.monotonic() < self.soft_state_away_until:
                self.soft_state_away_until = 0.0
                self.log.info("gateway.prefix_state_back")
            return

    async def _text_prompt(self, tenant: str, model: str, body: dict[str, Any]) -> Prompt:
        try:
            prompt = tr.text_prompt(body.get("prompt"))
        except BadRequest as exc:
            raise HttpError("malformed", str(exc), exc.param) from None
        tok = self.tokenizers.get(model)
        if tok is None:
            return prompt
        ids = await asyncio.to_thread(tok.encode, _cache_scope(tenant, model), prompt.text)
        return Prompt(prompt.text, ids, chat=False, tokenizer=tok)

    @staticmethod
    def _sim_output(body: dict[str, Any], max_tokens: int) -> int | None:
        try:
            return tr.sim_output_tokens(body, max_tokens)
        except BadRequest as exc:
            raise HttpError("malformed", str(exc), exc.param) from None

    @staticmethod
    def _sampling(body: dict[str, Any], api: str, max_tokens: int) -> Sampling:
        try:
            return tr.sampling_of(body, api, max_tokens)
        except BadRequest as exc:
            raise HttpError("malformed", str(exc), exc.param) from None

    async def _session(self, sid: str, model: str, tenant: str) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            s = await self.client.open_session(model, session_id=sid, tenant=tenant)
            self.sessions[sid] = s
            while len(self.sessions) > SESSIONS_KEPT:
                self.sessions.popitem(last=False)
        else:
            self.sessions.move_to_end(sid)
        return s

    async def _ids(self, request: web.Request, tenant: str, raw: bytes, body: dict[str, Any], model: str,
                   prompt: Prompt) -> CallIds:
        """The call's session and id, and how much of its prompt the session holds: the
        longest run of blocks it shares with what the session's last call sent and got
        back. A request that names no session joins the open one of its tenant and model
        whose chain it extends and that has no call in flight, or starts a new one."""
        rhash = tr.request_hash(request.path, raw)
        idem = request.headers.get(tr.IDEMPOTENCY_HEADER) or None
        chain = self.chains.chain(_cache_scope(tenant, model), prompt.ids)  # (hashes only what was appended)
        retry = tr.retry_count(request.headers)
        named = tr.session_name(request.headers, body)
        # the call id comes before a header-less call's session, so an HTTP retry is the
        # same call wherever it lands
        scope = (tr.talaria_session_id(tenant, named[1], request.headers.get(tr.AGENT_ID_HEADER, ""), model)
                 if named is not None else tr.headerless_scope(tenant, model))
        cid = (await self._idempotent_call_id(tenant, idem, rhash) if idem is not None else
               await self._soft(lambda: self._attempt_call_id(scope, rhash, retry), tr.fresh_call_id()))
        if named is not None:
            held = await self._soft(lambda: self._held_blocks(scope, chain), 0)
            return CallIds(scope, cid, self._prefix_tokens(held, prompt), named[1][:200])
        sid, held = await self._soft(lambda: self._join_or_fork(tenant, model, cid, chain),
                                     (tr.forked_session_id(tenant, model, cid), 0))
        return CallIds(sid, cid, self._prefix_tokens(held, prompt))

    async def _idempotent_call_id(self, tenant: str, key: str, rhash: str) -> str:
        """The call an `Idempotency-Key` names, bound to the request it was first sent
        with (path and body): sent again with another request it is refused (422), as
        the IETF Idempotency-Key draft asks, where it had been answered with the first
        request's reply. Without Redis the two are two calls (the id hashes the request)."""
        first = await self._soft(lambda: self._bind_idempotency_key(tenant, key, rhash), rhash)
        if first != rhash:
            raise HttpError("idempotency_key_reused", "this Idempotency-Key was already sent with another request "
                            "(another path or body); a retry sends the same request, a new call a new key")
        return tr.idempotent_call_id(tenant, key, rhash)

    async def _bind_idempotency_key(self, tenant: str, key: str, rhash: str) -> str:
        """The request the key was first sent with (this one, if it is the first)."""
        assert self.redis is not None
        name = self.rkeys.gateway_idempotency(tr.idempotency_key_digest(tenant, key))
        if await self.redis.set(name, rhash, nx=True, ex=CALL_TTL_S):
            return rhash
        known = await self.redis.get(name)
        return known.decode() if known is not None else rhash

    async def _attempt_call_id(self, scope: str, rhash: str, retry: int | None) -> str:
        """A first attempt is a new call, so an identical request is a second sample as
        the APIs make it (a regenerate, parallel samples of one conversation, two runs of
        one task sending the same first request); an SDK's retry
        (`x-stainless-retry-count` > 0) is the latest first attempt of the same request in
        the same session (or, header-less, tenant and model). A client that retries
        without saying so gets a second call: generated twice, each delivered once. Only
        a client that counts its attempts (`retry` not None) can come back marked, so
        only its first attempts are written down, for as long as a retry may follow."""
        assert self.redis is not None
        key = self.rkeys.gateway_request(scope, rhash)
        if retry:
            known = await self.redis.get(key)
            if known is not None:
                return known.decode()
        cid = tr.fresh_call_id()
        if retry is not None:
            await self.redis.set(key, cid, ex=RETRY_WINDOW_S)
        return cid

    @staticmethod
    def _prefix_tokens(blocks: int, prompt: Prompt) -> int:
        return min(blocks * px.BLOCK_TOKENS, prompt.tokens - 1)

    async def _soft(self, op: Callable[[], Awaitable[Any]], fallback: Any,
                    failed: str = "gateway.prefix_state_unavailable", **fields: Any) -> Any:
        """A step on the gateway's soft state: without Redis (or with it away) the call
        goes on as if nothing were known (its engine's own cache still reuses what it holds).
        One that fails, or takes SOFT_STATE_WAIT_S, sets the state aside for SOFT_STATE_PAUSE_S:
        a stalled Redis answers each command only with its timeout, and a request makes several.
        `failed`, `fields`: the warning logged then."""
        if self.redis is None or time.monotonic() < self.soft_state_away_until:
            return fallback
        try:
            # (not the commands' own retry budget: the call goes on without what it would have known)
            async with asyncio.timeout(SOFT_STATE_WAIT_S):
                done = await op()
            self.redis_answering = True
            return done
        except Exception as exc:  # noqa: BLE001 - soft state: log, do without
            self._soft_state_aside()
            self.log.warning(failed, error=type(exc).__name__, paused_s=SOFT_STATE_PAUSE_S, **fields)
            return fallback

    async def _held_blocks(self, sid: str, chain: list[bytes]) -> int:
        assert self.redis is not None
        return px.held_blocks(px.unpack_branches(await self.redis.get(self.rkeys.gateway_chain(sid))), chain)

    async def _join_or_fork(self, tenant: str, model: str, cid: str, chain: list[bytes]) -> tuple[str, int]:
        assert self.redis is not None
        r, k = self.redis, self.rkeys
        known = await r.get(k.gateway_call(cid))
        if known is not None:  # a retry of a call already given a session
            sid = known.decode()
            return sid, await self._held_blocks(sid, chain)
        now = time.time()
        idle_wall_s = self.settings.session_idle_s / max(self.settings.time_scale, 1e-9)
        entries = await r.hgetall(k.gateway_open(tenant, model))
        opens = [o for f, v in entries.items() if (o := px.OpenChain.decode(f.decode(), v.decode())) is not None]
        stale = [o.session_id for o in opens if now - o.updated_at > idle_wall_s]
        if stale:
            await r.hdel(k.gateway_open(tenant, model), *stale)
        sid, held = tr.forked_session_id(tenant, model, cid), 0
        for o in px.extended_by(chain, opens, now, idle_wall_s):
            if await r.set(k.gateway_busy(o.session_id), cid, nx=True, ex=int(BUSY_TTL_S)):
                sid, held = o.session_id, o.blocks
                break
        else:
            await r.set(k.gateway_busy(sid), cid, ex=int(BUSY_TTL_S))
        if not await r.set(k.gateway_call(cid), sid, nx=True, ex=SESSION_TTL_S):
            # another replica gave this very call a session first: take that one
            await r.eval(_RELEASE, 1, k.gateway_busy(sid), cid)
            sid = (await r.get(k.gateway_call(cid)) or sid.encode()).decode()
            held = await self._held_blocks(sid, chain)
        return sid, held

    async def _remember(self, tenant: str, model: str, ids: CallIds, prompt: Prompt, reply: CallReply) -> None:
        """After a reply: the session's engine now holds the prompt and what it returned."""
        assert self.redis is not None
        # (from the cache, which holds this prompt's chain: only what the reply added is hashed)
        out_ids = list(reply.token_ids) if reply.token_ids and reply.engine != "sim" else None  # a real engine's own
        chain = self.chains.chain(_cache_scope(tenant, model),
                                  prompt.continued(reply.text or "", out_ids, reply.output_tokens))
        # a named session's other branches are kept (a header-less one's call only ever extends its chain)
        branches = (px.unpack_branches(await self.redis.get(self.rkeys.gateway_chain(ids.session_id)))
                    if ids.named else [])
        async with self.redis.pipeline(transaction=False) as p:
            p.set(self.rkeys.gateway_chain(ids.session_id), px.pack_branches(px.with_branch(branches, chain)),
                  ex=SESSION_TTL_S)
            p.srem(self.rkeys.gateway_askers(ids.call_id), self.client.client_id)  # (answered: asks no more)
            if not ids.named and chain:
                p.hset(self.rkeys.gateway_open(tenant, model), ids.session_id,
                       px.OpenChain(ids.session_id, len(chain), chain[-1], time.time()).encode())
                p.expire(self.rkeys.gateway_open(tenant, model), SESSION_TTL_S)
            await p.execute()

    async def _ask(self, cid: str) -> None:
        assert self.redis is not None
        async with self.redis.pipeline(transaction=False) as p:
            p.sadd(self.rkeys.gateway_askers(cid), self.client.client_id)
            p.expire(self.rkeys.gateway_askers(cid), CALL_TTL_S)
            await p.execute()

    async def _others_ask(self, cid: str) -> bool:
        """This replica no longer asks for the call: whether another replica that is up
        still does (one gone without a word, killed, is dropped from the askers)."""
        assert self.redis is not None
        key = self.rkeys.gateway_askers(cid)
        async with self.redis.pipeline(transaction=True) as p:
            p.srem(key, self.client.client_id)
            p.smembers(key)
            _, members = await p.execute()
        others = sorted(m.decode() for m in members)
        if not others:
            return False
        async with self.redis.pipeline(transaction=False) as p:
            for other in others:
                p.exists(self.rkeys.gateway_replica(other))
            up = await p.execute()
        gone = [o for o, alive in zip(others, up) if not alive]
        if gone:
            await self.redis.srem(key, *gone)
        if len(gone) < len(others):
            self.log.info("gateway.left_to_another_replica", call_id=cid,
                          reason="another replica still asks for the call: not cancelled")
            return True
        return False

    async def _forget(self, sid: str) -> None:
        assert self.redis is not None
        await self.redis.delete(self.rkeys.gateway_chain(sid))

    async def _release(self, ids: CallIds) -> None:
        assert self.redis is not None
        await self.redis.eval(_RELEASE, 1, self.rkeys.gateway_busy(ids.session_id), ids.call_id)

    async def _after_call(self, ids: CallIds, final: bool) -> None:
        """A call's request is done with its session: a header-less session is free for
        its next call, and a session its agent said was finished ends."""
        if not ids.named:
            await self._soft(lambda: self._release(ids), None)
        if final:
            await self._end(ids.session_id)

    # -- a whole call shared by its attempts --------------------------------------------------------
    def _share(self, cid: str, tenant: str, task: "asyncio.Task[CallReply]") -> SharedCall:
        shared = self.shared_calls[cid] = SharedCall(task, tenant)
        task.add_done_callback(lambda t: self._settled(cid, shared, t))
        return shared

    def _join(self, shared: SharedCall) -> None:
        """A retry joins the call its first attempt left running: the grace ends, and the
        cleanup the leaver left is now the retry's own (its request does it)."""
        if shared.grace is not None:
            shared.grace.cancel()
            shared.grace = None
        shared.cleanup = None
        self.log.info("gateway.joined", reason="a retry of a call still running")

    def _left(self, cid: str, shared: SharedCall, retries: bool) -> bool:
        """The last waiter of a running call left (its client went away). A client that
        retries (an SDK counting its attempts, or an Idempotency-Key) comes back for the
        same call after its backoff: the call runs on for the grace, for the retry to
        join. Any other is cancelled now. True when the call was held."""
        grace = self.settings.gateway_retry_grace_s
        if retries and grace > 0 and not self._holds_most_for_retries(shared.tenant):
            shared.grace = asyncio.get_running_loop().call_later(grace, self._expire, cid, shared)
            self.log.info("gateway.held_for_retry", grace_s=grace)
            return True
        shared.task.cancel()  # the agent client sends CancelCall
        self.log.info("gateway.cancelled", reason="client disconnected")
        return False

    def _holds_most_for_retries(self, tenant: str) -> bool:
        """Whether `tenant` has as many calls held for their retries as its bound on calls in
        flight (the gateway's, with none of its own): a held call holds no slot (its retry's
        request takes one to join it), so without this bound clients leaving at once ran
        calls past both bounds (a probe's 18 of one tenant against its 3)."""
        most = self.slots.most_per_tenant or self.slots.most
        return bool(most) and sum(sc.tenant == tenant and sc.grace is not None
                                  for sc in self.shared_calls.values()) >= most

    def _expire(self, cid: str, shared: SharedCall) -> None:
        shared.grace = None
        if shared.waiters == 0 and not shared.task.done():
            shared.task.cancel()
            with structlog.contextvars.bound_contextvars(call_id=cid):
                self.log.info("gateway.cancelled", reason="client disconnected; no retry within the grace")

    def _settled(self, cid: str, shared: SharedCall, task: "asyncio.Task[CallReply]") -> None:
        """The call ended (a reply, an error, or cancelled): a later retry is answered
        from the router's call record; what a held call's leaver left undone is done."""
        if self.shared_calls.get(cid) is shared:
            del self.shared_calls[cid]
        if shared.grace is not None:
            shared.grace.cancel()
        if not task.cancelled():
            task.exception()  # (retrieved: a held call's error has no one else to read it)
        if shared.cleanup is not None:
            cleanup = asyncio.ensure_future(shared.cleanup())
            self._background.add(cleanup)
            cleanup.add_done_callback(self._background.discard)

    async def _end(self, sid: str) -> None:
        self.sessions.pop(sid, None)
        with contextlib.suppress(TalariaError):
            await self.client.end_session(sid)
        await self._soft(lambda: self._forget(sid), None)

    # -- one call, whole or streamed ----------------------------------------------------------------
    async def _call(self, request: web.Request, api: str, p: Prepared,
                    streamer: "Callable[[web.Request, asyncio.Task[CallReply], asyncio.Queue[Any]], Awaitable[web.StreamResponse]]",
                    whole: "Callable[[CallReply], dict[str, Any]]",
                    after_reply: "Callable[[CallReply], Awaitable[None]] | None" = None) -> web.StreamResponse:
        """`after_reply`: what is done with a reply before the agent hears it (a stored response)."""
        # (a conversation of any size the body limit lets in: a large one goes by reference, off the bus)
        t0 = time.monotonic()
        self._bus_up()
        tenant, ids, model, prompt, stream = p.tenant, p.ids, p.model, p.prompt, p.stream
        sid, cid = ids.session_id, ids.call_id
        request[REQUEST_ID_KEY] = cid
        final = tr.is_final(request.headers)
        status, deferred, error, streamed_whole = 200, False, None, False
        with structlog.contextvars.bound_contextvars(tenant=tenant, session_id=sid, call_id=cid), tracing.span(
                f"chat {model}", tracing.traceparent_of(request.headers), kind=SpanKind.SERVER,
                attributes=tracing.call_attributes(model, sid, cid, **{"talaria.api": api, "http.route": request.path,
                                                                        "talaria.session_name": ids.session_name or None})):
            try:
                session = await self._session(sid, model, tenant)
                events: asyncio.Queue[Any] = asyncio.Queue()

                async def call_and_remember() -> CallReply:
                    # every replica asks for a call from the call's own inbox, and says it asks:
                    # the one a client leaves cancels it only where no other replica still asks
                    await self._soft(lambda: self._ask(cid), None)
                    reply = await session.call(
                        prompt_tokens=prompt.tokens, prefix_tokens=ids.prefix_tokens, max_tokens=p.max_tokens,
                        call_id=cid, stream=stream, on_event=events.put_nowait,
                        # the model's own ids where the gateway has its tokenizer, else the text
                        prompt_token_ids=list(prompt.ids) if prompt.real else None,
                        prompt_text=None if prompt.real else prompt.text,
                        sampling=p.sampling, tools_json=p.tools_json, tool_choice=p.tool_choice,
                        tool_call_format=p.tool_format, tool_rounds=p.tool_rounds, sim_output_tokens=p.sim_output,
                        shared_inbox=True, still_asked=lambda: self._soft(lambda: self._others_ask(cid), False))
                    # before the agent hears the reply, so its next call finds what the engine holds
                    await self._soft(lambda: self._remember(tenant, model, ids, prompt, reply), None)
                    if after_reply is not None:
                        await after_reply(reply)
                    return reply

                if stream:
                    task = asyncio.ensure_future(call_and_remember())
                    try:
                        resp = await streamer(request, task, events)
                        streamed_whole = task.done()
                        return resp
                    finally:
                        if not task.done():
                            status = request[CLIENT_GONE_KEY] = 499  # (nginx's "client closed request")
                            task.cancel()  # the client went away: the agent client sends CancelCall
                            self.log.info("gateway.cancelled", reason="client disconnected")
                            with contextlib.suppress(BaseException):
                                await task
                shared = self.shared_calls.get(cid)
                if shared is not None and shared.tenant == tenant and not shared.task.done():
                    # a retry of a call still running here: it waits for that call's reply
                    self._join(shared)
                else:
                    shared = self._share(cid, tenant, asyncio.ensure_future(call_and_remember()))
                shared.waiters += 1
                try:
                    # (the client leaving cancels this wait, not the call: what happens to the call is decided below)
                    reply = await asyncio.shield(shared.task)
                finally:
                    shared.waiters -= 1
                    if not shared.task.done():
                        status = request[CLIENT_GONE_KEY] = 499  # (nginx's "client closed request")
                        if shared.waiters == 0:
                            held = self._left(cid, shared, retries=tr.retry_count(request.headers) is not None
                                              or request.headers.get(tr.IDEMPOTENCY_HEADER) is not None)
                            if held:  # the session's release or end waits for the call's end
                                shared.cleanup = lambda: self._after_call(ids, final)
                                deferred = True
                return web.Response(body=msgspec.json.encode(whole(reply)), content_type="application/json")
            except TalariaError as exc:
                status, error = tr.error_status(exc.code, api), exc.code
                raise HttpError(exc.code, exc.message, retry_after_s=exc.retry_after_s) from None
            except HttpError as exc:
                status, error = tr.error_status(exc.code, api), exc.code
                raise
            finally:
                error = error or request.get(STREAM_ERROR_KEY)
                # (a failure on the server's side, or a stream that ended in one, where an operator looks)
                log = self.log.warning if status >= 500 or (error is not None and status == 200) else self.log.info
                log("gateway.call", api=api, path=request.path, model=model, stream=stream, status=status, error=error,
                    prompt_tokens=prompt.tokens, prefix_tokens=ids.prefix_tokens, named_session=ids.named,
                    session_name=ids.session_name, retry=tr.retry_count(request.headers),
                    ms=round((time.monotonic() - t0) * 1000, 2))
                if not deferred:
                    await self._clean_up_after(ids, final, streamed_whole)

    async def _clean_up_after(self, ids: CallIds, final: bool, answered: bool) -> None:
        """The session's release or end after a call, which the client's leaving does not cut
        short: a one-shot client closes as soon as its stream's last byte lands, and the
        handler's cancellation had cut the cleanup there (a named final session's chain left
        in Redis for hours, a header-less one's busy mark at risk) and counted the whole
        answer as a 499. The cleanup runs on; a stream whole when its client left is a 200."""
        cleanup = asyncio.ensure_future(self._after_call(ids, final))
        self._background.add(cleanup)
        cleanup.add_done_callback(self._background.discard)
        try:
            await asyncio.shield(cleanup)
        except asyncio.CancelledError:
            if not answered:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # (the answer is whole: this request ends as it would have)

    async def _stream_events(self, request: web.Request, task: "asyncio.Task[CallReply]", events: "asyncio.Queue[Any]",
                             on_start: Callable[[], list[bytes]], on_tokens: Callable[[CallTokens], list[bytes]],
                             on_reply: Callable[[CallReply], list[bytes]], on_error: Callable[[TalariaError], list[bytes]]
                             ) -> web.StreamResponse:
        """Relay a streamed call as SSE. The response is committed (200) only when the call
        runs, its first tokens or reply come, or a keep-alive is due: an error before that
        (no capacity, unknown model) still gets its own status and shape."""
        resp = web.StreamResponse(headers=SSE_HEADERS)
        started = False
        relayed = StreamedTokens()  # (an engine's re-run after a restart repeats what was sent: relay.py)

        send_limit_s = self.settings.gateway_send_timeout_s

        async def send(chunk: bytes | None) -> None:
            """One write (None: the stream's end), given up once the client has taken nothing
            for `send_limit_s` (a client that stopped reading: its connection is closed, as if
            it had left)."""
            try:
                async with asyncio.timeout(send_limit_s):
                    await (resp.write(chunk) if chunk is not None else resp.write_eof())
            except TimeoutError:
                if request.transport is not None:
                    request.transport.abort()
                self.log.info("gateway.client_stalled", request_id=request.get(REQUEST_ID_KEY),
                              send_timeout_s=send_limit_s)
                raise ConnectionResetError(f"the client took nothing for {send_limit_s:g} s") from None

        def relay(ev: CallTokens) -> list[bytes]:
            past = relayed.accept(ev)
            return on_tokens(past) if past is not None else []

        async def stop_run() -> None:  # (ended by the gateway, not by a client that left: its run is stopped)
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

        async def failed(exc: TalariaError) -> web.StreamResponse:
            """The call ended in `exc`: its own status and shape before the 200 is sent, else
            the API's error event as the stream's last (the log and a counter say it failed)."""
            if not started:
                raise exc
            request[STREAM_ERROR_KEY] = exc.code
            for chunk in on_error(exc):
                await send(chunk)
            return resp

        async def start() -> None:
            nonlocal started
            if not started:
                started = True
                await resp.prepare(request)
                for chunk in on_start():
                    await send(chunk)

        getter: asyncio.Future[Any] | None = None
        stopping = asyncio.ensure_future(self.streams_stop.wait())
        quiet_since = time.monotonic()  # tokens that show nothing (text held for the tool parser) write nothing
        try:
            while True:
                getter = getter or asyncio.ensure_future(events.get())
                done, _ = await asyncio.wait({getter, task, stopping}, timeout=self.settings.gateway_keepalive_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if stopping in done:  # the gateway's drain is over: said in the stream, the run stopped
                    await stop_run()
                    return await failed(TalariaError("unavailable", "the gateway is stopping: send the request "
                                                                    "again", retry_after_s=1.0))
                if getter in done:
                    ev = getter.result()
                    getter = None
                    if isinstance(ev, CallTokens):
                        await start()
                        chunks = relay(ev)
                        if not chunks and time.monotonic() - quiet_since >= self.settings.gateway_keepalive_s:
                            chunks = [SSE_KEEPALIVE]
                        for chunk in chunks:
                            await send(chunk)
                        if chunks:
                            quiet_since = time.monotonic()
                    elif isinstance(ev, CallRunning):
                        await start()
                    continue  # the reply and errors are read from the task below
                if task in done:
                    while not events.empty():  # tokens that came just before the reply
                        ev = events.get_nowait()
                        if isinstance(ev, CallTokens) and started:
                            for chunk in relay(ev):
                                await send(chunk)
                    try:
                        reply = task.result()
                    except TalariaError as exc:
                        return await failed(exc)
                    await start()
                    for chunk in on_reply(reply):
                        await send(chunk)
                    await send(None)
                    return resp
                if not done:  # waiting for the model's round: keep the connection alive
                    await start()
                    await send(SSE_KEEPALIVE)
                    quiet_since = time.monotonic()
        except RerunDiverged as exc:  # (the 200 is sent: say so in the stream, and stop the run)
            await stop_run()
            self.log.warning("gateway.rerun_diverged", error=str(exc))
            with contextlib.suppress(ConnectionError):
                return await failed(TalariaError("unavailable", "the engine running this call restarted and its "
                                                                "re-run differs from the text already streamed; "
                                                                "send the request again", retry_after_s=1.0))
            return resp
        except (ConnectionResetError, ConnectionError):
            self.log.info("gateway.client_gone")
            return resp
        finally:
            stopping.cancel()
            if getter is not None:
                getter.cancel()

    # -- OpenAI -----------------------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant(request)
        raw, body = await self._body(request)
        self._note_ignored("chat", body)
        p = await self._prepare_chat(request, tenant, raw, body, OPENAI, ("max_completion_tokens", "max_tokens"))
        model, max_tokens, tools, cid = p.model, p.max_tokens, list(p.tools), p.ids.call_id
        include_usage = tr.include_usage(body)
        created = int(time.time())

        def whole(reply: CallReply) -> dict[str, Any]:
            return tr.chat_completion(reply.call_id, model, reply, max_tokens, p.answer(reply))

        async def streamer(req: web.Request, task: "asyncio.Task[CallReply]", events: "asyncio.Queue[Any]"
                           ) -> web.StreamResponse:
            text, thought = p.text_stream(), rs.Splitter(p.reasoning_format)

            def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
                return sse(tr.chat_chunk(cid, model, created, delta, finish, None, include_usage))

            def on_tokens(ev: CallTokens) -> list[bytes]:
                reasoning, answer = thought.feed(ev.text)
                out = [chunk({"reasoning": reasoning})] if reasoning else []
                return out + ([chunk({"content": piece})] if (piece := text.delta(answer)) else [])

            def on_reply(reply: CallReply) -> list[bytes]:
                answer = p.answer(reply)
                reasoning, rest = thought.reasoning_rest(answer.reasoning), text.rest(answer.content)
                out = [chunk({"reasoning": reasoning})] if reasoning else []
                out += [chunk({"content": rest})] if rest else []
                if answer.calls:
                    out.append(chunk({"tool_calls": [c.openai(i) for i, c in enumerate(answer.calls)]}))
                out.append(chunk({}, tr.finish_reason(reply, max_tokens, answer)))
                if include_usage:
                    out.append(sse(tr.usage_chunk(cid, model, created, tr.usage_of(reply).openai())))
                return [*out, sse("[DONE]")]

            def on_error(exc: TalariaError) -> list[bytes]:
                _, err = tr.openai_error(exc.code, exc.message)
                return [sse(err), sse("[DONE]")]

            return await self._stream_events(
                # (with tools offered the reply may be calls alone: no text yet, as a whole reply's content is null)
                req, task, events, on_start=lambda: [chunk({"role": "assistant", "content": None if tools else ""})],
                on_tokens=on_tokens, on_reply=on_reply, on_error=on_error)

        return await self._call(request, OPENAI, p, streamer, whole)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant(request)
        raw, body = await self._body(request)
        self._note_ignored("completions", body)
        model = await self._model(body)
        stream = self._check_common(body)
        prompt = await self._text_prompt(tenant, model, body)
        max_tokens = self._max_tokens(body, ("max_tokens",), prompt, model, prompt_param="prompt")
        sim_output = self._sim_output(body, max_tokens)
        created = int(time.time())
        sampling = self._sampling(body, OPENAI, max_tokens)
        ids = await self._ids(request, tenant, raw, body, model, prompt)
        p = Prepared(tenant, model, stream, prompt, max_tokens, sampling, ids, sim_output)
        cid = ids.call_id
        include_usage = tr.include_usage(body)

        def whole(reply: CallReply) -> dict[str, Any]:
            return tr.text_completion(reply.call_id, model, reply, max_tokens)

        async def streamer(req: web.Request, task: "asyncio.Task[CallReply]", events: "asyncio.Queue[Any]"
                           ) -> web.StreamResponse:
            text = tr.TextStream(held=False)

            def on_reply(reply: CallReply) -> list[bytes]:
                out = [sse(tr.text_chunk(cid, model, created, text.rest(reply.text or ""),
                                         tr.finish_reason(reply, max_tokens)))]
                if include_usage:  # (as chat: only when asked, in a chunk of its own with no choices)
                    out.append(sse({**tr.text_chunk(cid, model, created, ""), "choices": [],
                                    "usage": tr.usage_of(reply).openai()}))
                return [*out, sse("[DONE]")]

            def on_error(exc: TalariaError) -> list[bytes]:
                return [sse(tr.openai_error(exc.code, exc.message)[1]), sse("[DONE]")]

            return await self._stream_events(req, task, events, on_start=lambda: [],
                                             on_tokens=lambda ev: [sse(tr.text_chunk(cid, model, created,
                                                                                     text.delta(ev.text)))],
                                             on_reply=on_reply, on_error=on_error)

        return await self._call(request, OPENAI, p, streamer, whole)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """The Responses API as the chat path serves it: the request read as the chat
        request it asks for (`translate.responses_request`), the reply written as a
        `response` object or its stream of named events."""
        tenant = self._tenant(request)
        raw, original = await self._body(request)
        self._note_ignored("responses", original)
        try:
            store = tr.responses_store_asked(original)
        except BadRequest as exc:
            raise HttpError("malformed", str(exc), exc.param) from None
        original = await self._referenced_items(tenant, original)
        body, previous, continued = await self._responses_as_chat(tenant, original)
        try:
            p = await self._prepare_responses(request, tenant, raw, body, original)
        except HttpError as err:
            if err.param is not None and err.param.startswith("messages"):
                err.param = "input"  # (read as chat's messages; a Responses body's conversation is its input)
            elif err.param is not None and err.param.startswith("tools[") and ".function." in err.param:
                # (a Responses function tool is flat: its name and parameters beside its type)
                err.param = err.param.replace(".function.", ".", 1)
                err.message = err.message.replace(".function.", ".", 1)
            raise
        model, max_tokens = p.model, p.max_tokens
        cid, created = p.ids.call_id, int(time.time())
        kept = [store and self.redis is not None and self.settings.gateway_responses_ttl_s > 0]
        offered = tr.responses_offered(original.get("tools"))
        if left_out := tr.responses_left_out(original.get("tools")):  # hosted tools: not offered to this model
            self.log.info("gateway.tools_left_out", tools=left_out)

        def response(reply: CallReply) -> dict[str, Any]:
            answer = p.answer(reply)
            status = tr.response_status(reply, max_tokens, answer)
            return tr.response_object(cid, model, created, original, status=status, store=kept[0],
                                      output=tr.response_output(cid, answer, status, offered),
                                      usage=tr.response_usage(reply))

        async def keep(reply: CallReply) -> None:
            """The response stored before the agent hears it, so its next request finds it."""
            if kept[0]:
                done = response(reply)
                kept[0] = await self._keep_response(
                    tenant, previous, continued, tr.responses_input_items(original) + done["output"], done)

        async def streamer(req: web.Request, task: "asyncio.Task[CallReply]", events: "asyncio.Queue[Any]"
                           ) -> web.StreamResponse:
            out = tr.ResponseEvents(cid, model, created, original, p.text_stream(), reasoning_format=p.reasoning_format,
                                    store=kept[0])

            def written(evs: list[tuple[str, dict[str, Any]]]) -> list[bytes]:
                return [sse(data, kind) for kind, data in evs]

            def finished(reply: CallReply) -> list[bytes]:
                out.store = kept[0]
                return written(out.finish(reply, max_tokens, p.answer(reply)))

            return await self._stream_events(
                req, task, events, on_start=lambda: written(out.start()),
                on_tokens=lambda ev: written(out.tokens(ev.text)), on_reply=finished,
                on_error=lambda exc: written(out.failed(exc.code, exc.message)))

        return await self._call(request, RESPONSES, p, streamer, response, after_reply=keep)

    async def compact(self, request: web.Request) -> web.Response:
        """OpenAI's server-side compaction (an opaque `compaction` item for later input) is
        not served: said by name, where the route of a stored response's id answered 405."""
        self._tenant(request)
        raise HttpError("not_found", "POST /v1/responses/compact is not served here: compact the conversation in "
                        "the client (Codex does, with a /v1/responses call of its own) or send it whole")

    def _response_id(self, request: web.Request) -> str:
        """The stored response a path names; a POST endpoint's own name under /v1/responses/
        (`input_tokens`, `compact`) is a 405, not a response that is not found."""
        rid = request.match_info["response_id"]
        if f"/v1/responses/{rid}" in self.static_paths:
            raise web.HTTPMethodNotAllowed(request.method, ["POST"])
        return rid

    async def stored_response(self, request: web.Request) -> web.Response:
        """A stored response read back (`GET /v1/responses/{id}`), as it was answered. Its
        stream again (`?stream=true`, OpenAI's resumption of a background response) is
        refused by name: answered with the whole object, the SDK's stream yielded nothing."""
        tenant = self._tenant(request)
        rid = self._response_id(request)
        if request.query.get("stream", "false").lower() not in ("false", "0", ""):
            raise HttpError("malformed", "stream is not served for a stored response: it is read back whole "
                            "(GET without stream); only POST /v1/responses streams", "stream")
        stored = await self._read_response(tenant, rid)
        if stored is None:
            raise HttpError("not_found", f"Response with id '{rid[:256]}' not found.")
        return web.json_response(stored.response)

    async def response_input_items(self, request: web.Request) -> web.Response:
        """The items a stored response was generated from (`GET /v1/responses/{id}/input_items`),
        a page at a time."""
        tenant = self._tenant(request)
        rid = self._response_id(request)
        stored = await self._read_conversation(tenant, rid)
        if stored is None:
            raise HttpError("not_found", f"Response with id '{rid[:256]}' not found.")
        try:
            return web.json_response(tr.input_items_page(stored[0], stored[1].response, request.query))
        except BadRequest as exc:
            raise HttpError("malformed", str(exc), exc.param) from None

    async def delete_response(self, request: web.Request) -> web.Response:
        """A stored response deleted (`DELETE /v1/responses/{id}`): it can no longer be read
        back or continued; the responses continuing it keep their own conversations."""
        tenant = self._tenant(request)
        rid = self._response_id(request)
        deleted = self.redis is not None and await self._response_store(lambda r: r.delete(self._response_key(tenant, rid)))
        if not deleted:
            raise HttpError("not_found", f"Response with id '{rid[:256]}' not found.")
        return web.json_response({"id": rid, "object": "response", "deleted": True})

    async def models(self, request: web.Request) -> web.Response:
        self._tenant(request)
        served = [m for m in await self.served_models() if m in self.catalog.models]
        try:
            page = tr.models_list([(m, self.context_limit(m)) for m in served], request.query)
        except BadRequest as exc:
            raise HttpError("malformed", str(exc), exc.param) from None
        return web.json_response(page)

    async def model_info(self, request: web.Request) -> web.Response:
        self._tenant(request)
        model = await self._model({"model": request.match_info["model"]})
        return web.json_response(tr.model_entry(model, self.context_limit(model)))

    # -- Anthropic ------------------------------------------------------------------------------------------
    async def messages(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant(request)
        raw, body = await self._body(request)
        self._note_ignored("messages", body)
        if body.get("thread") is not None:
            # a server-held conversation (the threads beta) is not kept here: the SDK reads this refusal
            # and sends the whole conversation again, unthreaded (answering it would drop the history)
            raise HttpError("malformed", "thread is not served: conversations are not held here; send the whole "
                            "conversation in messages", "thread",
                            details={"error_code": "thread_unsupported_request", "unsupported": ["thread"]})
        p = await self._prepare_chat(request, tenant, raw, body, ANTHROPIC, ("max_tokens",))
        model, max_tokens, prompt = p.model, p.max_tokens, p.prompt
        cid = p.ids.call_id

        def whole(reply: CallReply) -> dict[str, Any]:
            return tr.anthropic_message(reply.call_id, model, reply, max_tokens, p.answer(reply), p.show_reasoning)

        async def streamer(req: web.Request, task: "asyncio.Task[CallReply]", events: "asyncio.Queue[Any]"
                           ) -> web.StreamResponse:
            def on_start() -> list[bytes]:
                msg = {"id": f"msg_{cid}", "type": "message", "role": "assistant", "model": model, "content": [],
                       "stop_reason": None, "stop_sequence": None,
                       "usage": {"input_tokens": prompt.tokens, "output_tokens": 0}}
                return [sse({"type": "message_start", "message": msg}, "message_start"), sse({"type": "ping"}, "ping")]

            text, thought = p.text_stream(), rs.Splitter(p.reasoning_format)
            # each block opens with its first piece, as the whole reply's blocks are: the
            # thinking (where asked for), the text, then each call
            index: dict[str, int] = {}  # block kind -> its index, once opened
            closed: set[str] = set()

            def block(kind: str, start: dict[str, Any], delta: dict[str, Any]) -> list[bytes]:
                out = []
                if kind not in index:
                    index[kind] = len(index)
                    out.append(sse({"type": "content_block_start", "index": index[kind], "content_block": start},
                                   "content_block_start"))
                return out + [sse({"type": "content_block_delta", "index": index[kind], "delta": delta},
                                  "content_block_delta")]

            def stop(kind: str) -> list[bytes]:
                if kind not in index or kind in closed:
                    return []
                closed.add(kind)
                return [sse({"type": "content_block_stop", "index": index[kind]}, "content_block_stop")]

            def thinking_delta(piece: str) -> list[bytes]:
                return block("thinking", tr.thinking_block(""), {"type": "thinking_delta", "thinking": piece})

            def text_delta(piece: str) -> list[bytes]:
                return stop("thinking") + block("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": piece})

            def on_tokens(ev: CallTokens) -> list[bytes]:
                reasoning, answer = thought.feed(ev.text)
                out = thinking_delta(reasoning) if reasoning and p.show_reasoning else []
                piece = text.delta(answer)
                return out + (text_delta(piece) if piece else [])

            def on_reply(reply: CallReply) -> list[bytes]:
                usage = tr.usage_of(reply).anthropic()
                answer = p.answer(reply)
                out = []
                if p.show_reasoning and answer.reasoning:
                    rest_thought = thought.reasoning_rest(answer.reasoning) if "thinking" in index else answer.reasoning
                    out += thinking_delta(rest_thought) if rest_thought else []
                out += stop("thinking")
                rest = text.rest(answer.content)
                if rest or ("text" not in index and not answer.calls):  # (a reply of no text and no call: one empty block)
                    out += text_delta(rest)
                out += stop("text")
                for i, c in enumerate(answer.calls, start=len(index)):  # each call a block of its own, its input as JSON deltas
                    out += [sse({"type": "content_block_start", "index": i,
                                 "content_block": {"type": "tool_use", "id": c.anthropic_id, "name": c.name, "input": {}}},
                                "content_block_start"),
                            sse({"type": "content_block_delta", "index": i,
                                 "delta": {"type": "input_json_delta", "partial_json": json.dumps(c.arguments)}},
                                "content_block_delta"),
                            sse({"type": "content_block_stop", "index": i}, "content_block_stop")]
                return [*out,
                        sse({"type": "message_delta", "delta": {"stop_reason": tr.anthropic_stop_reason(reply, max_tokens, answer),
                                                                "stop_sequence": tr.anthropic_stop_sequence(reply, answer)},
                                     "usage": usage}, "message_delta"),
                        sse({"type": "message_stop"}, "message_stop")]

            def on_error(exc: TalariaError) -> list[bytes]:
                return [sse(tr.anthropic_error(exc.code, exc.message)[1], "error")]

            return await self._stream_events(req, task, events, on_start=on_start, on_tokens=on_tokens,
                                             on_reply=on_reply, on_error=on_error)

        return await self._call(request, ANTHROPIC, p, streamer, whole)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's token count: the prompt `/v1/messages` would send for this body
        (system, messages and tools, rendered and tokenized the same way), with no call.
        Claude Code asks for it to keep its context accounting; without it, it guesses."""
        tenant = self._tenant(request)
        _, body = await self._body(request)
        prompt = await self._prompt_only(tenant, body, ANTHROPIC)
        return web.json_response({"input_tokens": prompt.tokens})

    async def input_tokens(self, request: web.Request) -> web.Response:
        """OpenAI's input token count for a Responses request: the prompt `/v1/responses`
        would send for the body (instructions, input items and tools), with no call."""
        tenant = self._tenant(request)
        _, original = await self._body(request)
        original = await self._referenced_items(tenant, original)
        body = (await self._responses_as_chat(tenant, original))[0]

        async def fitting(body: dict[str, Any], prompt: Prompt | None = None) -> Prompt:
            """The body's prompt (rendered unless given), or the context refusal its call would get."""
            if prompt is None:
                prompt = await self._prompt_only(tenant, body, OPENAI)
            self._max_tokens(body, ("max_output_tokens",), prompt, await self._model(body))
            return prompt

        prompt = await self._prompt_only(tenant, body, OPENAI)
        if original.get("truncation") == "auto":  # (counted as it would be sent: truncated to fit)
            try:
                await fitting(body, prompt)
            except HttpError as err:
                if err.code != "context_limit":
                    raise
                prompt = await self._fewest_turns_left_out(body, fitting) or prompt  # (None: counted whole)
        return web.json_response({"object": "response.input_tokens", "input_tokens": prompt.tokens})


GATEWAY_KEY = web.AppKey("talaria.gateway", Gateway)


async def start_gateway(settings: Settings, client: TalariaClient, redis: aioredis.Redis | None = None
                        ) -> tuple[web.AppRunner, int]:
    """Serve the gateway on the settings' address; (runner, the bound port). `redis`:
    where sessions' prefix chains are kept (None: not kept, see `Gateway`)."""
    gw = Gateway(settings, client, redis=redis)
    up = gw.metrics.dependency_up  # (as each scrape finds it; Redis as the gateway's own use of it last found)
    up.labels("nats").set_function(lambda: float(client.nc.is_connected))
    if redis is not None:
        up.labels("redis").set_function(lambda: float(gw.redis_answering))
    gw.metrics.serve(settings.metrics_port, settings.metrics_host)
    if not gw.keys:
        gw.log.warning("gateway.no_keys", reason="TALARIA_API_KEYS is empty: every API request gets 401")
    # auto_decompress off: `Gateway._body` decodes a compressed body, bounded, and refuses a corrupt one by name
    # keepalive_timeout: a connection idle that long is closed, whether it sent nothing yet, part of a
    # request's head, or nothing since its last answer (aiohttp's hour let held connections use up the
    # process's file descriptors: a probe's 20,000 held ones took the gateway down, with every stream)
    runner = web.AppRunner(gw.app(), handler_cancellation=True, access_log=None, auto_decompress=False,
                           keepalive_timeout=IDLE_CONNECTION_S,
                           shutdown_timeout=1.0)  # (Gateway.drain has let the calls in flight finish)
    await runner.setup()
    site = web.TCPSite(runner, settings.gateway_host, settings.gateway_port)
    await site.start()
    port = settings.gateway_port
    server = getattr(site, "_server", None)
    if server is not None and server.sockets:
        port = int(server.sockets[0].getsockname()[1])
    return runner, port


class MalformedHttpAsInfo(logging.Filter):
    """aiohttp logs a request it cannot parse (a `Content-Length` beside chunked encoding, a
    header line too long) at `error` with its traceback: a client's fault, which anyone could
    fill the error log with. It is said at `info`, in one line, as the gateway's own
    refusals are."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args = "malformed HTTP request from %s: %s", (remote, " ".join(str(exc).split())[:300])
            record.exc_info, record.exc_text = None, None
        return True


def gateway_redis(settings: Settings) -> aioredis.Redis:
    """The gateway's Redis client. Soft state: it fails fast rather than wait out a Redis
    restart as the services' pools do, and a burst of calls waits for one of its pool's
    connections rather than being refused one."""
    return open_redis(settings.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0,
                      max_connections=REDIS_CONNECTIONS, pool_wait_s=SOFT_STATE_WAIT_S,
                      **settings.redis_credentials())


async def serve(settings: Settings) -> None:
    log = configure_logging("gateway", settings.log_format, settings.log_level)
    logging.getLogger("aiohttp.server").addFilter(MalformedHttpAsInfo())
    tracing.configure("gateway", settings.otlp_endpoint)
    client = await TalariaClient.connect(settings.nats_urls, user=settings.nats_user, password=settings.nats_password,
                                         subject_prefix=settings.subject_prefix, connect_timeout_s=30.0,
                                         namespace=GATEWAY_NAMESPACE)
    redis = gateway_redis(settings)
    try:
        await check_target(redis, settings.redis_url)
        runner, port = await start_gateway(settings, client, redis)
    except (tk.TokenizerError, RedisUrlError) as exc:  # a deployment error: say which, and stay down
        log.error("gateway.bad_tokenizer" if isinstance(exc, tk.TokenizerError) else "gateway.redis_unsupported",
                  error=str(exc))
        await client.close()
        await redis.aclose()
        raise SystemExit(78) from None
    except OSError as exc:  # the port is taken (or the address not this host's): one line, and a restart may mend it
        log.error("gateway.port_unavailable", host=settings.gateway_host, port=settings.gateway_port,
                  error=exc.strerror or str(exc))
        await client.close()
        await redis.aclose()
        raise SystemExit(1) from None
    log.info("gateway.listening", instance=settings.instance_name("gateway"), host=settings.gateway_host, port=port,
             url=f"http://{settings.gateway_host}:{port}/v1")
    rotating = asyncio.ensure_future(rotate_logs(settings.log_max_bytes, settings.log_keep))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("gateway.stopping")
    rotating.cancel()
    gw = runner.app[GATEWAY_KEY]
    for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal: stop waiting, streams end with their error event
        loop.add_signal_handler(sig, gw.drain_cut_asked.set)
    await gw.drain(GATEWAY_DRAIN_WALL_S)
    await runner.cleanup()  # stops taking requests (and cuts what the drain left)
    await client.close()
    await redis.aclose()
    tracing.shutdown()


def main(argv: list[str] | None = None) -> None:
    settings = Settings.from_env_or_exit(argv if argv is not None else sys.argv[1:])
    run_loop(serve(settings))
