"""gateway: the agents' HTTP front door, OpenAI- and Anthropic-compatible.

A stateless process (any number of replicas behind one port) that speaks to
Talaria as an agent (its own NATS user and namespace, with an agent's permissions)
through the agent client (`shared/agent_client.py`):

    POST /v1/chat/completions   whole, or SSE `chat.completion.chunk` lines ending `data: [DONE]`
    POST /v1/completions        whole, or SSE `text_completion` lines
    POST /v1/messages           Anthropic Messages, whole or as its named SSE events
    GET  /v1/models             the served models with their context limits
    GET  /health                no key needed: 200 while NATS is connected

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
import json
import signal
import sys
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
from aiohttp import web
from opentelemetry.trace import SpanKind

from services.gateway import translate as tr
from services.gateway.translate import BadRequest, Prompt
from shared.bus import run_loop
from shared.agent_client import Session, TalariaClient, TalariaError
from shared.catalog import Catalog, load_catalog
from shared.logs import configure_logging
from shared.schema import CallReply, CallRunning, CallTokens, Sampling
from shared import tracing
from shared.metrics import Metrics
from shared.settings import Settings
from shared.subjects import GATEWAY_NAMESPACE

DEFAULT_MAX_TOKENS = 4096      # a request naming no bound gets this much, capped by the context left
SESSIONS_KEPT = 50_000         # opened sessions remembered (a forgotten one is just opened again)
MODELS_TTL_S = 5.0             # how long the served-model list is reused
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

OPENAI, ANTHROPIC = "openai", "anthropic"


class HttpError(Exception):
    """An answer in the API's own error shape (`code` is a Talaria error code or `unauthorized`)."""

    def __init__(self, code: str, message: str, param: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s


def error_response(api: str, err: HttpError) -> web.Response:
    if api == ANTHROPIC:
        status, body = tr.anthropic_error(err.code, err.message)
    else:
        status, body = tr.openai_error(err.code, err.message, err.param)
    headers = {}
    if err.code == "no_capacity":
        headers["Retry-After"] = str(max(1, round(err.retry_after_s or 1)))
    return web.json_response(body, status=status, headers=headers)


def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"{head}data: {payload}\n\n".encode()


class Gateway:
    def __init__(self, settings: Settings, client: TalariaClient, catalog: Catalog | None = None) -> None:
        self.settings = settings
        self.client = client
        self.catalog = catalog or load_catalog(settings.catalog_path)
        self.keys = tr.parse_keys(settings.api_keys)
        self.log = structlog.get_logger("gateway")
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self._models: tuple[float, list[str]] | None = None
        self._limits: dict[str, int] = {}
        self.metrics = Metrics()

    # -- the app --------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.gateway_max_body, middlewares=[self._errors])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/messages", self.messages)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        api = ANTHROPIC if request.path.startswith("/v1/messages") else OPENAI
        try:
            return await handler(request)
        except HttpError as err:
            return error_response(api, err)
        except web.HTTPRequestEntityTooLarge:
            return error_response(api, HttpError("too_large", f"request body over {self.settings.gateway_max_body} bytes"))
        except web.HTTPNotFound:
            return error_response(api, HttpError("not_found", f"no such endpoint: {request.method} {request.path}"))
        except web.HTTPMethodNotAllowed:
            return error_response(api, HttpError("malformed", f"{request.method} is not allowed on {request.path}"))

    async def health(self, request: web.Request) -> web.Response:
        ok = self.client.nc.is_connected
        return web.json_response({"status": "ok" if ok else "nats disconnected"}, status=200 if ok else 503)

    # -- shared steps ---------------------------------------------------------------------------
    def _tenant(self, request: web.Request) -> str:
        tenant = tr.tenant_for(request.headers, self.keys)
        if tenant is None:
            why = "no API key" if tr.presented_key(request.headers) is None else "invalid API key"
            raise HttpError("unauthorized", f"{why}: send `Authorization: Bearer <key>` or `x-api-key: <key>`")
        return tenant

    async def _body(self, request: web.Request) -> tuple[bytes, dict[str, Any]]:
        raw = await request.read()
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise HttpError("malformed", f"the body is not JSON: {exc}") from None
        except RecursionError:  # (msgspec's answer to nesting thousands deep)
            raise HttpError("malformed", "the body is nested too deeply") from None
        if not isinstance(body, dict):
            raise HttpError("malformed", "the body must be a JSON object")
        return raw, body

    async def served_models(self) -> list[str]:
        now = time.monotonic()
        if self._models is None or now - self._models[0] > MODELS_TTL_S:
            try:
                info = await self.client.info()
            except TalariaError as exc:
                raise HttpError(exc.code, f"the router did not answer: {exc.message}") from None
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
        if model not in await self.served_models() or model not in self.catalog.models:
            raise HttpError("unknown_model", f"The model `{model[:200]}` does not exist or is not served here", "model")
        return model

    def _max_tokens(self, body: dict[str, Any], names: tuple[str, ...], prompt: Prompt, model: str,
                    required: bool = False) -> int:
        limit = self.context_limit(model)
        if prompt.tokens + 1 > limit:
            raise HttpError("context_limit", f"This model's maximum context length is {limit} tokens; the prompt "
                                             f"has about {prompt.tokens}", "messages")
        for name in names:
            v = body.get(name)
            if v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise HttpError("malformed", f"{name} must be a positive integer", name)
            if prompt.tokens + v > limit:
                raise HttpError("context_limit", f"This model's maximum context length is {limit} tokens; the prompt "
                                                 f"has about {prompt.tokens} and {name} asks for {v}", name)
            return v
        if required:
            raise HttpError("malformed", f"{names[0]} is required", names[0])
        return min(DEFAULT_MAX_TOKENS, limit - prompt.tokens)

    @staticmethod
    def _check_common(body: dict[str, Any]) -> bool:
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise HttpError("malformed", "stream must be a boolean", "stream")
        n = body.get("n", 1)
        if n != 1:
            raise HttpError("malformed", "only n=1 is served", "n")
        return stream

    @staticmethod
    def _sampling(body: dict[str, Any], api: str) -> Sampling:
        try:
            return tr.sampling_of(body, api)
        except BadRequest as exc:
            raise HttpError("malformed", str(exc), exc.param) from None

    async def _session(self, sid: str, model: str) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            s = await self.client.open_session(model, session_id=sid)
            self.sessions[sid] = s
            while len(self.sessions) > SESSIONS_KEPT:
                self.sessions.popitem(last=False)
        else:
            self.sessions.move_to_end(sid)
        return s

    def _ids(self, request: web.Request, tenant: str, raw: bytes, body: dict[str, Any], model: str
             ) -> tuple[str, str, bool]:
        """(session id, call id, one-call session?)"""
        rhash = tr.request_hash(request.path, raw)
        named = tr.session_name(request.headers, body)
        if named is None:
            sid = tr.one_call_session_id(tenant, rhash)
        else:
            sid = tr.talaria_session_id(tenant, named[1], request.headers.get(tr.AGENT_ID_HEADER, ""), model)
        cid = tr.call_id_for(tenant, sid, rhash, request.headers.get(tr.IDEMPOTENCY_HEADER) or None)
        return sid, cid, named is None

    async def _end(self, sid: str) -> None:
        self.sessions.pop(sid, None)
        with contextlib.suppress(TalariaError):
            await self.client.end_session(sid)

    # -- one call, whole or streamed ----------------------------------------------------------------
    async def _call(self, request: web.Request, api: str, tenant: str, raw: bytes, body: dict[str, Any],
                    model: str, prompt: Prompt, max_tokens: int, stream: bool, sampling: Sampling,
                    streamer: "Callable[[web.Request, asyncio.Task[CallReply], asyncio.Queue[Any]], Awaitable[web.StreamResponse]] | None" = None,
                    whole: "Callable[[CallReply], dict[str, Any]] | None" = None) -> web.StreamResponse:
        # (a conversation of any size the body limit lets in: a large one goes by reference, off the bus)
        sid, cid, one_call = self._ids(request, tenant, raw, body, model)
        final = one_call or tr.is_final(request.headers)
        t0 = time.monotonic()
        status = 200
        with structlog.contextvars.bound_contextvars(tenant=tenant, session_id=sid, call_id=cid), tracing.span(
                f"chat {model}", tracing.traceparent_of(request.headers), kind=SpanKind.SERVER,
                attributes=tracing.call_attributes(model, sid, cid, **{"talaria.api": api,
                                                                        "http.route": request.path})):
            try:
                session = await self._session(sid, model)
                events: asyncio.Queue[Any] = asyncio.Queue()
                task = asyncio.ensure_future(session.call(
                    prompt_tokens=prompt.tokens, prefix_tokens=prompt.prefix_tokens, max_tokens=max_tokens,
                    call_id=cid, prompt_text=prompt.text, stream=stream, on_event=events.put_nowait,
                    sampling=sampling))
                try:
                    if stream and streamer is not None:
                        return await streamer(request, task, events)
                    reply = await task
                finally:
                    if not task.done():
                        task.cancel()  # the client went away: the agent client sends CancelCall
                        self.log.info("gateway.cancelled", reason="client disconnected")
                        with contextlib.suppress(BaseException):
                            await task
                assert whole is not None
                return web.Response(body=msgspec.json.encode(whole(reply)), content_type="application/json")
            except TalariaError as exc:
                status = tr.error_status(exc.code, api)
                raise HttpError(exc.code, exc.message, retry_after_s=exc.retry_after_s) from None
            except HttpError as exc:
                status = tr.error_status(exc.code, api)
                raise
            finally:
                self.metrics.http_requests.labels(api=api, status=str(status)).inc()
                self.metrics.http_duration.labels(api=api).observe(time.monotonic() - t0)
                self.log.info("gateway.call", api=api, path=request.path, model=model, stream=stream, status=status,
                              prompt_tokens=prompt.tokens, prefix_tokens=prompt.prefix_tokens,
                              retry=tr.retry_count(request.headers), ms=round((time.monotonic() - t0) * 1000, 2))
                if final:
                    await self._end(sid)

    async def _stream_events(self, request: web.Request, task: "asyncio.Task[CallReply]", events: "asyncio.Queue[Any]",
                             on_start: Callable[[], list[bytes]], on_tokens: Callable[[int], list[bytes]],
                             on_reply: Callable[[CallReply], list[bytes]], on_error: Callable[[TalariaError], list[bytes]]
                             ) -> web.StreamResponse:
        """Relay a streamed call as SSE. The response is committed (200) only when the call
        runs, its first tokens or reply come, or a keep-alive is due: an error before that
        (no capacity, unknown model) still gets its own status and shape."""
        resp = web.StreamResponse(headers=SSE_HEADERS)
        started = False

        async def start() -> None:
            nonlocal started
            if not started:
                started = True
                await resp.prepare(request)
                for chunk in on_start():
                    await resp.write(chunk)

        getter: asyncio.Future[Any] | None = None
        try:
            while True:
                getter = getter or asyncio.ensure_future(events.get())
                done, _ = await asyncio.wait({getter, task}, timeout=self.settings.gateway_keepalive_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    ev = getter.result()
                    getter = None
                    if isinstance(ev, CallTokens):
                        await start()
                        for chunk in on_tokens(len(ev.token_ids)):
                            await resp.write(chunk)
                    elif isinstance(ev, CallRunning):
                        await start()
                    continue  # the reply and errors are read from the task below
                if task in done:
                    while not events.empty():  # tokens that came just before the reply
                        ev = events.get_nowait()
                        if isinstance(ev, CallTokens) and started:
                            for chunk in on_tokens(len(ev.token_ids)):
                                await resp.write(chunk)
                    try:
                        reply = task.result()
                    except TalariaError as exc:
                        if not started:
                            raise
                        for chunk in on_error(exc):
                            await resp.write(chunk)
                        return resp
                    await start()
                    for chunk in on_reply(reply):
                        await resp.write(chunk)
                    await resp.write_eof()
                    return resp
                if not done:  # waiting for the model's round: keep the connection alive
                    await start()
                    await resp.write(b": keep-alive\n\n")
        except (ConnectionResetError, ConnectionError):
            self.log.info("gateway.client_gone")
            return resp
        finally:
            if getter is not None:
                getter.cancel()

    # -- OpenAI -----------------------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant(request)
        raw, body = await self._body(request)
        model = await self._model(body)
        stream = self._check_common(body)
        try:
            prompt = tr.chat_prompt(body.get("messages"))
        except BadRequest as exc:
            raise HttpError("malformed", str(exc), exc.param) from None
        max_tokens = self._max_tokens(body, ("max_completion_tokens", "max_tokens"), prompt, model)
        opts = body.get("stream_options") or {}
        include_usage = isinstance(opts, dict) and opts.get("include_usage") is True
        created = int(time.time())
        cid_box: list[str] = []

        def whole(reply: CallReply) -> dict[str, Any]:
            return tr.chat_completion(reply.call_id, model, reply, max_tokens)

        async def streamer(req: web.Request, task: "asyncio.Task[CallReply]", events: "asyncio.Queue[Any]"
                           ) -> web.StreamResponse:
            cid = cid_box[0] if cid_box else ""

            def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
                return sse(tr.chat_chunk(cid, model, created, delta, finish, None, include_usage))

            def on_reply(reply: CallReply) -> list[bytes]:
                out = [chunk({}, tr.finish_reason(reply, max_tokens))]
                if include_usage:
                    out.append(sse(tr.usage_chunk(cid, model, created, tr.usage_of(reply).openai())))
                return [*out, sse("[DONE]")]

            def on_error(exc: TalariaError) -> list[bytes]:
                _, err = tr.openai_error(exc.code, exc.message)
                return [sse(err), sse("[DONE]")]

            return await self._stream_events(
                req, task, events, on_start=lambda: [chunk({"role": "assistant", "content": ""})],
                on_tokens=lambda n: [chunk({"content": ""})], on_reply=on_reply, on_error=on_error)

        cid_box.append(self._ids(request, tenant, raw, body, model)[1])
        return await self._call(request, OPENAI, tenant, raw, body, model, prompt, max_tokens, stream,
                                self._sampling(body, OPENAI), streamer=streamer, whole=whole)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant(request)
        raw, body = await self._body(request)
        model = await self._model(body)
        stream = self._check_common(body)
        try:
            prompt = tr.text_prompt(body.get("prompt"))
        except BadRequest as exc:
            raise HttpError("malformed", str(exc), exc.param) from None
        max_tokens = self._max_tokens(body, ("max_tokens",), prompt, model)
        created = int(time.time())
        cid = self._ids(request, tenant, raw, body, model)[1]

        def whole(reply: CallReply) -> dict[str, Any]:
            return tr.text_completion(reply.call_id, model, reply, max_tokens)

        async def streamer(req: web.Request, task: "asyncio.Task[CallReply]", events: "asyncio.Queue[Any]"
                           ) -> web.StreamResponse:
            def on_reply(reply: CallReply) -> list[bytes]:
                last = tr.text_chunk(cid, model, created, "", tr.finish_reason(reply, max_tokens))
                last["usage"] = tr.usage_of(reply).openai()
                return [sse(last), sse("[DONE]")]

            def on_error(exc: TalariaError) -> list[bytes]:
                return [sse(tr.openai_error(exc.code, exc.message)[1]), sse("[DONE]")]

            return await self._stream_events(req, task, events, on_start=lambda: [],
                                             on_tokens=lambda n: [sse(tr.text_chunk(cid, model, created, ""))],
                                             on_reply=on_reply, on_error=on_error)

        return await self._call(request, OPENAI, tenant, raw, body, model, prompt, max_tokens, stream,
                                self._sampling(body, OPENAI), streamer=streamer, whole=whole)

    async def models(self, request: web.Request) -> web.Response:
        self._tenant(request)
        served = [m for m in await self.served_models() if m in self.catalog.models]
        return web.json_response(tr.models_list([(m, self.context_limit(m)) for m in served]))

    # -- Anthropic ------------------------------------------------------------------------------------------
    async def messages(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant(request)
        raw, body = await self._body(request)
        model = await self._model(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise HttpError("malformed", "stream must be a boolean", "stream")
        try:
            prompt = tr.chat_prompt(body.get("messages"), body.get("system"), roles=("user", "assistant"))
        except BadRequest as exc:
            raise HttpError("malformed", str(exc), exc.param) from None
        max_tokens = self._max_tokens(body, ("max_tokens",), prompt, model, required=True)
        cid = self._ids(request, tenant, raw, body, model)[1]
        produced = [0]

        def whole(reply: CallReply) -> dict[str, Any]:
            return tr.anthropic_message(reply.call_id, model, reply, max_tokens)

        async def streamer(req: web.Request, task: "asyncio.Task[CallReply]", events: "asyncio.Queue[Any]"
                           ) -> web.StreamResponse:
            def on_start() -> list[bytes]:
                msg = {"id": f"msg_{cid}", "type": "message", "role": "assistant", "model": model, "content": [],
                       "stop_reason": None, "stop_sequence": None,
                       "usage": {"input_tokens": prompt.tokens, "output_tokens": 0}}
                return [sse({"type": "message_start", "message": msg}, "message_start"),
                        sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                            "content_block_start"),
                        sse({"type": "ping"}, "ping")]

            def on_tokens(n: int) -> list[bytes]:
                produced[0] += n
                return [sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": ""}},
                            "content_block_delta")]

            def on_reply(reply: CallReply) -> list[bytes]:
                usage = tr.usage_of(reply).anthropic()
                return [sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
                        sse({"type": "message_delta", "delta": {"stop_reason": tr.anthropic_stop_reason(reply, max_tokens),
                                                                "stop_sequence": None}, "usage": usage}, "message_delta"),
                        sse({"type": "message_stop"}, "message_stop")]

            def on_error(exc: TalariaError) -> list[bytes]:
                return [sse(tr.anthropic_error(exc.code, exc.message)[1], "error")]

            return await self._stream_events(req, task, events, on_start=on_start, on_tokens=on_tokens,
                                             on_reply=on_reply, on_error=on_error)

        return await self._call(request, ANTHROPIC, tenant, raw, body, model, prompt, max_tokens, stream,
                                self._sampling(body, ANTHROPIC), streamer=streamer, whole=whole)


async def start_gateway(settings: Settings, client: TalariaClient) -> tuple[web.AppRunner, int]:
    """Serve the gateway on the settings' address; (runner, the bound port)."""
    gw = Gateway(settings, client)
    gw.metrics.serve(settings.metrics_port, settings.metrics_host)
    if not gw.keys:
        gw.log.warning("gateway.no_keys", reason="TALARIA_API_KEYS is empty: every API request gets 401")
    runner = web.AppRunner(gw.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.gateway_host, settings.gateway_port)
    await site.start()
    port = settings.gateway_port
    server = getattr(site, "_server", None)
    if server is not None and server.sockets:
        port = int(server.sockets[0].getsockname()[1])
    return runner, port


async def serve(settings: Settings) -> None:
    log = configure_logging("gateway", settings.log_format, settings.log_level)
    tracing.configure("gateway", settings.otlp_endpoint)
    client = await TalariaClient.connect(settings.nats_urls, user=settings.nats_user, password=settings.nats_password,
                                         subject_prefix=settings.subject_prefix, connect_timeout_s=30.0,
                                         namespace=GATEWAY_NAMESPACE)
    runner, port = await start_gateway(settings, client)
    log.info("gateway.listening", instance=settings.instance_name("gateway"), host=settings.gateway_host, port=port,
             url=f"http://{settings.gateway_host}:{port}/v1")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("gateway.stopping")
    await runner.cleanup()  # stops taking requests and lets in-flight ones finish
    await client.close()
    tracing.shutdown()


def main(argv: list[str] | None = None) -> None:
    settings = Settings.from_env(argv if argv is not None else sys.argv[1:])
    run_loop(serve(settings))
