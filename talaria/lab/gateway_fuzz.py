"""`talaria fuzz-gateway`: malformed and hostile HTTP requests against the real front door.

An embedded stack (sim engine, authentication on, the gateway) takes `--requests`
seeded requests: bad JSON, bodies over the limit, wrong types, unknown roles and
content blocks, absurd numbers, odd header bytes, bad and missing keys, unknown
paths and methods, clients that send half a body and vanish, and slow clients
that trickle their headers. Then it checks what a front door must hold to:

- every answer is a 4xx in its API's error shape (OpenAI's `{"error": {...}}`,
  Anthropic's `{"type": "error", ...}`), or a success for a request that a
  mutation happened to leave valid; never a 5xx, never a dropped connection
  for a request that was whole;
- every service is healthy afterwards and none was restarted;
- nothing was written to Redis for a rejected request: the keys that appeared
  are those of the sessions the gateway accepted (its own log says which),
  besides the services' periodic soft state.

Figures are counts (no timing); the command exits 1 when any check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.settings import GATEWAY_MAX_BODY
from talaria.argtypes import positive_int

MODEL = "glm-4.5-air-fp8"
CHAT, MESSAGES, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/completions", "/v1/responses"
COUNT_TOKENS, INPUT_TOKENS = "/v1/messages/count_tokens", "/v1/responses/input_tokens"  # token counts: no call
# Redis keys that name a session (`shared/keys.py`): what a request could make the services write
SESSION_KEY_HEADS = ("session:", "kv:", "resv:")
HEADER_LINE_MAX = 8190  # aiohttp's limit on one header line: past it, its parser answers a plain 400


@functools.cache
def _huge_body() -> bytes:
    """A body past the default limit: one object, shared by every huge-body probe."""
    return b"x" * (GATEWAY_MAX_BODY + 1)


@dataclass(frozen=True, slots=True)
class Probe:
    """One hostile request: over HTTP (`method`, `path`, `headers`, `body`), or over a raw
    socket (`raw`, sent as is; `trickle_s` between its pieces, `vanish` closes early)."""

    kind: str
    method: str = "POST"
    path: str = CHAT
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    raw: tuple[bytes, ...] = ()
    trickle_s: float = 0.0
    vanish: bool = False


def _good(path: str, seed: int) -> dict[str, Any]:
    text = f"fuzz {seed}"
    if path == MESSAGES:
        return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
    if path == COMPLETIONS:
        return {"model": MODEL, "max_tokens": 4, "prompt": text}
    if path == RESPONSES:
        return {"model": MODEL, "max_output_tokens": 4, "input": text}
    if path == COUNT_TOKENS:
        return {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    if path == INPUT_TOKENS:
        return {"model": MODEL, "input": text}
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}


# fields set to values that must be refused (the request stays JSON)
BAD_FIELDS: list[tuple[str, Any]] = [
    ("model", None), ("model", 7), ("model", ""), ("model", "x" * 5000), ("model", "no-such-model"),
    ("messages", []), ("messages", "hi"), ("messages", None), ("messages", [7]), ("messages", [[]]),
    ("messages", [{"role": "wizard", "content": "x"}]), ("messages", [{"role": "user", "content": 5}]),
    ("messages", [{"role": "user"}]), ("messages", [{"content": "x"}]),
    ("messages", [{"role": "user", "content": [{"type": "text"}, 3]}]),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}]),
    ("messages", [{"role": "user", "content": [{"type": "no-such-block", "text": "x"}]}]),
    ("max_tokens", -1), ("max_tokens", 0), ("max_tokens", "9"), ("max_tokens", 10 ** 12), ("max_tokens", 1.5),
    ("max_tokens", True), ("max_completion_tokens", -3), ("n", 3), ("n", "two"), ("stream", "yes"),
    ("stream", 1), ("temperature", "hot"), ("temperature", 1e9), ("temperature", -1), ("top_p", 7),
    ("top_p", "all"), ("stop", [1, 2]), ("stop", 5), ("stop", ["x"] * 100), ("seed", "s"), ("seed", 1.5),
    ("logprobs", True), ("stream_options", "yes"), ("prompt", 5), ("prompt", [1, "a"]), ("system", 5),
    ("tools", "all"), ("presence_penalty", 9), ("frequency_penalty", "x"),
    # the Responses API's own fields
    ("input", []), ("input", 5), ("input", [{"type": "item_reference", "id": "x"}]), ("input", [{"role": "user"}]),
    ("input", [{"type": "function_call", "name": 3}]), ("max_output_tokens", 0), ("previous_response_id", "resp_1"),
    ("tools", [{"type": "local_shell"}]), ("tools", [{"type": "namespace", "name": "n", "tools": 5}]), ("text", {"format": {"type": "json_schema"}}), ("instructions", []),
    # structured output: refused where the API reads the field; a hostile schema the engine cannot
    # fill (endless, or with a value too large to make) gets free text, never a failed call
    ("output_config", {"format": {"type": "xml"}}), ("output_format", 5),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {"type": "array", "minItems": 10 ** 9}}}),
    ("output_format", {"type": "json_schema", "schema": {"allOf": [{"$ref": "#"}]}}),
]
BAD_BODIES: list[bytes] = [b"", b"{", b"}", b"[]", b"null", b"true", b'"s"', b"0", b"\xff\xfe\x00", b'{"model": 1}',
                           b"{}" * 1000, b'{"model": "' + b"\xc3\x28" * 10 + b'"}', b"[" * 5000 + b"]" * 5000,
                           b'{"a":' * 3000 + b"1" + b"}" * 3000, b"\x00" * 100]
ODD_HEADERS: list[tuple[str, str]] = [
    ("x-session-id", "a" * 8000), ("x-session-id", "\u00ff\u00fe"), ("x-session-id", ""),
    ("Idempotency-Key", "k" * 9000), ("x-stainless-retry-count", "-5"), ("x-stainless-retry-count", "many"),
    ("x-claude-code-session-id", "\t"), ("X-Dynamo-Session-Final", "maybe"), ("Content-Type", "text/plain"),
    ("Content-Type", "application/json; charset=utf-16"), ("anthropic-version", "\u00e9"),
]


def hostile_requests(n: int, seed: int, key: str) -> list[Probe]:
    """`n` seeded probes (the same seed, the same list)."""
    rng = random.Random(seed)
    auth = (("Authorization", f"Bearer {key}"),)
    out: list[Probe] = []
    for i in range(n):
        path = rng.choice((CHAT, CHAT, CHAT, CHAT, MESSAGES, MESSAGES, COMPLETIONS, COMPLETIONS, RESPONSES, RESPONSES,
                           COUNT_TOKENS, INPUT_TOKENS))
        hdrs: tuple[tuple[str, str], ...] = auth if not path.startswith(MESSAGES) else (("x-api-key", key),)
        good = _good(path, i)
        r = rng.random()
        if r < 0.30:
            name, value = rng.choice(BAD_FIELDS)
            out.append(Probe("bad-field", path=path, headers=hdrs, body=json.dumps({**good, name: value}).encode()))
        elif r < 0.45:
            out.append(Probe("bad-json", path=path, headers=hdrs, body=rng.choice(BAD_BODIES)))
        elif r < 0.65:  # bytes flipped in a valid body (it may stay valid: then it is served)
            b = bytearray(json.dumps(good).encode())
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            out.append(Probe("flipped", path=path, headers=hdrs, body=bytes(b)))
        elif r < 0.72:
            bad_key = rng.choice(("", "Bearer", "Bearer wrong", "Basic " + key, "Bearer " + key[:-1],
                                  "Bearer " + key + " ", "bearer\x7f"))
            out.append(Probe("bad-key", path=path, headers=(("Authorization", bad_key),) if bad_key else (),
                             body=json.dumps(good).encode()))
        elif r < 0.78:
            out.append(Probe("odd-header", path=path, headers=hdrs + (rng.choice(ODD_HEADERS),),
                             body=json.dumps(good).encode()))
        elif r < 0.83:
            method, where = rng.choice((("GET", CHAT), ("PUT", MESSAGES), ("DELETE", "/v1/models"),
                                        ("POST", "/v1/embeddings"), ("POST", "/v1/../etc/passwd"), ("GET", "/v2"),
                                        ("POST", "/v1/chat/completions/x"), ("PATCH", "/health")))
            out.append(Probe("bad-route", method=method, path=where, headers=hdrs, body=b"{}"))
        elif r < 0.86:
            out.append(Probe("huge-body", path=path, headers=hdrs, body=_huge_body()))
        elif r < 0.93:  # raw bytes in the request line and headers, the parser's own refusals
            junk = bytes(rng.randrange(1, 256) for _ in range(rng.randint(1, 40)))
            line = rng.choice((b"POST " + path.encode() + b" HTTP/1.1\r\n", b"POST /" + junk + b" HTTP/1.1\r\n",
                               junk + b"\r\n", b"GET / HTTP/9.9\r\n"))
            head = (b"Host: x\r\nAuthorization: Bearer " + key.encode() + b"\r\nX-Odd: " + junk + b"\r\n"
                    b"Content-Length: 2\r\n\r\n{}")
            out.append(Probe("raw-bytes", raw=(line + head,)))
        elif r < 0.97:  # half a body, then gone
            head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                    f"Content-Length: 1000\r\nContent-Type: application/json\r\n\r\n").encode()
            out.append(Probe("vanishing", raw=(head, b'{"model": "'), vanish=True))
        else:  # a slow client: its headers a few bytes at a time
            req = (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                   f"Content-Length: 2\r\n\r\n{{}}").encode()
            out.append(Probe("slow", raw=tuple(req[i:i + 8] for i in range(0, len(req), 8)), trickle_s=0.05))
    return out


@dataclass
class FuzzReport:
    requests: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)
    by_status: Counter[int] = field(default_factory=Counter)
    served: int = 0                     # a mutation left a valid request: answered as one
    session_keys: int = 0               # session keys that appeared in Redis (all the accepted requests')
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def _shape_ok(path: str, status: int, body: bytes) -> bool:
    try:
        out = json.loads(body)
    except ValueError:
        return False
    if not isinstance(out, dict):
        return False
    if path.startswith(MESSAGES) and status != 404:
        return out.get("type") == "error" and isinstance(out.get("error"), dict) and "message" in out["error"]
    err = out.get("error")
    if isinstance(err, dict):
        return "message" in err
    return out.get("type") == "error"  # (an unknown path under /v1/messages answers in Anthropic's shape)


def _status_of(answer: bytes) -> int:
    """The status of a raw HTTP answer (0: none, the connection closed or timed out)."""
    parts = answer.split(b" ", 2)
    return int(parts[1]) if answer.startswith(b"HTTP/1.") and len(parts) >= 2 and parts[1].isdigit() else 0


async def _raw(host: str, port: int, p: Probe) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        for piece in p.raw:
            writer.write(piece)
            await writer.drain()
            if p.trickle_s:
                await asyncio.sleep(p.trickle_s)
        if p.vanish:
            return b""
        try:
            return await asyncio.wait_for(reader.read(65536), 10)
        except asyncio.TimeoutError:
            return b""
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass


async def fire(base_url: str, probes: list[Probe], concurrency: int = 16) -> FuzzReport:
    """Send every probe (`concurrency` at a time) and check each answer."""
    import aiohttp

    report = FuzzReport(requests=len(probes))
    host, port = base_url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)
    gate = asyncio.Semaphore(concurrency)

    async def one(http: aiohttp.ClientSession, i: int, p: Probe) -> None:
        report.by_kind[p.kind] += 1
        async with gate:
            if p.raw:
                answer = await _raw(host, int(port), p)
                status = _status_of(answer)
                if status:
                    report.by_status[status] += 1
                if status >= 500:
                    report.failures.append(f"#{i} {p.kind}: {status}")
                return
            try:
                async with http.request(p.method, base_url + p.path, data=p.body, headers=list(p.headers),
                                        skip_auto_headers=("Content-Type",) if any(
                                            h[0].lower() == "content-type" for h in p.headers) else ()) as r:
                    body = await r.read()
                    status = r.status
            except aiohttp.ServerDisconnectedError:
                report.failures.append(f"#{i} {p.kind}: the gateway dropped the connection")
                return
            except (aiohttp.ClientError, ValueError, UnicodeError):
                # the client library will not send it (a header it will not encode): as raw bytes, then
                head = "".join(f"{k}: {v}\r\n" for k, v in p.headers).encode("utf-8", "surrogateescape")
                raw = (f"{p.method} {p.path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(p.body)}\r\n".encode()
                       + head + b"\r\n" + p.body)
                answer = await _raw(host, int(port), Probe(p.kind, raw=(raw,)))
                status = _status_of(answer)
                report.by_status[status] += 1
                if status >= 500 or status == 0:
                    report.failures.append(f"#{i} {p.kind} (raw): {answer[:200]!r}")
                return
        report.by_status[status] += 1
        if status < 300 or status in (429, 529):
            report.served += 1  # valid after all (or refused for capacity, as a valid request may be)
            return
        if status >= 500:
            report.failures.append(f"#{i} {p.kind} {p.method} {p.path}: {status} {body[:200]!r}")
        elif status in (400, 431) and any(len(k) + len(v) + 2 > HEADER_LINE_MAX for k, v in p.headers):
            return  # over the HTTP server's header limit: its own plain 400, before any API is known
        elif not _shape_ok(p.path, status, body):
            report.failures.append(f"#{i} {p.kind} {p.method} {p.path}: {status} not in the API's error shape: "
                                   f"{body[:200]!r}")

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await asyncio.gather(*(one(http, i, p) for i, p in enumerate(probes)))
    return report


def _accepted_sessions(log_file: Path) -> set[str]:
    from shared.logs import read_log_events

    return {d["session_id"] for d in read_log_events(log_file) if d.get("event") == "gateway.call"
            and d.get("session_id") and int(d.get("status", 0) or 0) < 300}


async def run_fuzz(requests: int, seed: int, log_dir: Path, progress: bool = True) -> FuzzReport:
    """An embedded stack, the probes, then the checks (health, restarts, Redis)."""
    import redis.asyncio as aioredis

    from shared.policy import resolve_policy
    from talaria.ops.stack import EmbeddedStack, StackSpec

    spec = StackSpec(policy=resolve_policy("talaria"), models=[MODEL], time_scale=1000.0, log_dir=log_dir,
                     gateway=True)
    async with EmbeddedStack(spec) as stack:
        assert stack.openai_base_url is not None and stack.gateway_url is not None and stack.api_key
        r = aioredis.Redis.from_url(stack.redis_url)
        try:
            before = {k.decode() async for k in r.scan_iter(match=f"{stack.key_prefix}*", count=1000)}
            probes = hostile_requests(requests, seed, stack.api_key)
            t0 = time.monotonic()
            report = FuzzReport(requests=0)
            chunk = 1000
            for start in range(0, len(probes), chunk):
                part = await fire(stack.gateway_url, probes[start:start + chunk])
                report.requests += part.requests
                report.by_kind.update(part.by_kind)
                report.by_status.update(part.by_status)
                report.served += part.served
                report.failures += part.failures
                if progress:
                    print(f"  {report.requests}/{len(probes)} requests, {len(report.failures)} failures "
                          f"({time.monotonic() - t0:.0f} s)", flush=True)
            try:
                await stack.wait_healthy(30)
            except RuntimeError as exc:
                report.failures.append(f"unhealthy after the fuzz: {exc}")
            restarted = {n: c.restarts for n, c in stack.group.children.items() if c.restarts}
            if restarted:
                report.failures.append(f"restarted during the fuzz: {restarted}")
            import aiohttp

            async with aiohttp.ClientSession() as http, http.get(stack.gateway_url + "/health") as h:
                if h.status != 200:
                    report.failures.append(f"gateway /health answered {h.status} after the fuzz")
            await asyncio.sleep(0.5)  # (writes of the calls just served land)
            after = {k.decode() async for k in r.scan_iter(match=f"{stack.key_prefix}*", count=1000)}
            accepted = _accepted_sessions(stack.log_dir / "gateway.log")
            heads = tuple(stack.key_prefix + h for h in SESSION_KEY_HEADS)
            new = {k for k in after - before if k.startswith(heads)}
            stray = sorted(k for k in new if not any(sid in k for sid in accepted))
            report.session_keys = len(new)
            if stray:
                report.failures.append(f"{len(stray)} Redis keys written for no accepted request: {stray[:5]}")
        finally:
            await r.aclose()
    return report


def format_report(rep: FuzzReport) -> str:
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(rep.by_kind.items()))
    statuses = ", ".join(f"{s}: {v}" for s, v in sorted(rep.by_status.items()))
    lines = [f"{rep.requests} requests ({kinds})", f"answers: {statuses}",
             f"served (a mutation left them valid): {rep.served}; new session keys in Redis: {rep.session_keys}, "
             "all of sessions the gateway accepted" if rep.ok else "",
             "result: " + ("every service healthy, every refusal typed, nothing written for a rejected request"
                           if rep.ok else f"{len(rep.failures)} FAILURES")]
    lines += [f"  {f}" for f in rep.failures[:20]]
    return "\n".join(lines)


def run(a: argparse.Namespace) -> int:
    rep = asyncio.run(run_fuzz(a.requests, a.seed, Path(a.log_dir)))
    print(format_report(rep))
    return 0 if rep.ok else 1


def configure_parser(p: argparse.ArgumentParser, default_log_dir: Path) -> None:
    p.add_argument("--requests", type=positive_int, default=10_000, help="hostile requests to send (default 10,000)")
    p.add_argument("--seed", type=int, default=0, help="the probes' seed")
    p.add_argument("--log-dir", default=str(default_log_dir), help="the embedded stack's logs")
    p.set_defaults(fn=run)
