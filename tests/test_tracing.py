"""OpenTelemetry traces per call across the services, exported over OTLP/HTTP to a
receiver in this test (the real exporter, the real wire format): one trace per call,
rooted at the gateway, with the right parents hop by hop."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from shared.logs import read_log_events
from shared.net import free_port
from shared.policy import resolve_policy
from talaria.ops.stack import EmbeddedStack, StackSpec

MODEL = "glm-4.5-air-fp8"


class Receiver:
    """An OTLP/HTTP trace receiver: every span it is sent, with its service."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.port = free_port()

    async def handle(self, request: web.Request) -> web.Response:
        req = ExportTraceServiceRequest()
        req.ParseFromString(await request.read())
        for rs in req.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    attrs = {a.key: (a.value.string_value or a.value.int_value or a.value.bool_value)
                             for a in sp.attributes}
                    self.spans.append({"service": service, "name": sp.name, "trace": sp.trace_id.hex(),
                                       "id": sp.span_id.hex(), "parent": sp.parent_span_id.hex(), "kind": sp.kind,
                                       "attrs": attrs})
        return web.Response(status=200, content_type="application/x-protobuf", body=b"")

    async def start(self) -> web.AppRunner:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        return runner


@pytest.mark.timeout(180)
async def test_one_trace_per_call_with_its_parents_across_the_services(tmp_path: Path) -> None:
    rx = Receiver()
    runner = await rx.start()
    spec = StackSpec(policy=resolve_policy("talaria"), models=[MODEL], time_scale=100.0, log_dir=tmp_path / "logs",
                     gateway=True, extra_env={"TALARIA_OTLP_ENDPOINT": f"http://127.0.0.1:{rx.port}"})
    try:
        async with EmbeddedStack(spec) as stack:
            headers = {"Authorization": f"Bearer {stack.api_key}", "x-session-id": "traced-1"}
            async with aiohttp.ClientSession() as http:
                for i in range(2):
                    body = {"model": MODEL, "max_tokens": 4,
                            "messages": [{"role": "user", "content": f"turn {i} " + "x" * 400}]}
                    async with http.post(f"{stack.openai_base_url}/chat/completions", json=body, headers=headers) as r:
                        assert r.status == 200, await r.text()
            for _ in range(100):  # the batch exporters flush every 200 ms
                if sum(1 for s in rx.spans if s["name"] == f"chat {MODEL}" and "engine" in s["service"]) >= 2:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
    finally:
        await runner.cleanup()
    traces: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in rx.spans:
        traces[s["trace"]].append(s)
    assert len(traces) == 2, {t: [(s["service"], s["name"]) for s in v] for t, v in traces.items()}
    sessions = set()
    for spans in traces.values():
        by = {(s["service"], s["name"], s["kind"]): s for s in spans}
        root = by[("talaria-gateway", f"chat {MODEL}", 2)]        # SERVER: the HTTP request
        client = by[("talaria-gateway", f"chat {MODEL}", 3)]      # CLIENT: the gateway's call on the bus
        place = by[("talaria-router", "router.place", 1)]
        wait = by[("talaria-admission", "admission.wait", 1)]
        gen = next(s for s in spans if s["service"] == "talaria-engine")
        assert root["parent"] == ""
        assert client["parent"] == root["id"] and place["parent"] == client["id"]
        assert wait["parent"] == place["id"] and gen["parent"] == wait["id"]
        assert gen["name"] == f"chat {MODEL}" and gen["attrs"]["gen_ai.usage.output_tokens"] > 0
        for s in spans:  # every span of the call names it (a switch's wait too, where there was one)
            assert s["attrs"]["gen_ai.conversation.id"] == root["attrs"]["gen_ai.conversation.id"], s
            assert s["attrs"]["gen_ai.request.model"] == MODEL, s
            assert s["attrs"]["talaria.call_id"] == root["attrs"]["talaria.call_id"], s
        # found by the agent's own name for its session, as `talaria logs` finds it
        assert root["attrs"]["talaria.session_name"] == "traced-1"
        sessions.add(root["attrs"]["gen_ai.conversation.id"])
    assert len(sessions) == 1  # both calls of the session, linked by its id


def _chain_to_root(spans: list[dict[str, Any]], leaf: dict[str, Any]) -> list[str]:
    """The names from `leaf` up to its trace's root (an assertion error if a parent is missing)."""
    by_id = {s["id"]: s for s in spans}
    out, s = [leaf["name"]], leaf
    while s["parent"]:
        assert s["parent"] in by_id, (s["name"], "has a parent that is not in its trace")
        s = by_id[s["parent"]]
        out.append(f'{s["service"]}:{s["name"]}')
    return out


@pytest.mark.timeout(240)
async def test_a_call_recovered_after_an_admission_kill_keeps_its_trace(tmp_path: Path) -> None:
    """A call queued in an admission that is killed is recovered by its successor from the
    persisted call, traceparent included: its wait and generation spans stay in the trace
    its HTTP request began, under an unbroken chain of parents."""
    rx = Receiver()
    runner = await rx.start()
    busy, queued = "glm-4.5-air-fp8", "glm-4.5-fp8"
    spec = StackSpec(policy=resolve_policy("baseline"), models=[busy, queued], time_scale=50.0,
                     log_dir=tmp_path / "logs", gateway=True,
                     extra_env={"TALARIA_OTLP_ENDPOINT": f"http://127.0.0.1:{rx.port}"})
    try:
        async with EmbeddedStack(spec) as stack:
            headers = {"Authorization": f"Bearer {stack.api_key}"}
            url = f"{stack.openai_base_url}/chat/completions"
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
                async def call(model: str, max_tokens: int, sid: str) -> dict[str, Any]:
                    body = {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": sid}]}
                    async with http.post(url, json=body, headers={**headers, "x-session-id": sid}) as r:
                        assert r.status == 200, await r.text()
                        return await r.json()

                long_call = asyncio.ensure_future(call(busy, 6000, "long"))  # holds the server (baseline: drain)
                await asyncio.sleep(1.0)
                waiting = asyncio.ensure_future(call(queued, 8, "waits"))
                adm = next(n for n in stack.group.children if n.startswith("admission-"))
                log = stack.log_dir / f"{adm}.log"
                for _ in range(200):  # queued behind the long call
                    if any(d.get("event") == "admission.queued" and d.get("model") == queued
                           for d in read_log_events(log)):
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("the second call never queued")
                stack.group.children[adm].proc.kill()  # the supervisor restarts it; it recovers both calls
                await asyncio.wait_for(asyncio.gather(long_call, waiting), 150)
                recovered = [d for d in read_log_events(log) if d.get("event") == "admission.recovered"]
                assert recovered and recovered[-1].get("requeued", 1), recovered
            for _ in range(100):
                if sum(1 for s in rx.spans if s["service"] == "talaria-engine") >= 2:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
    finally:
        await runner.cleanup()
    gen = [s for s in rx.spans if s["service"] == "talaria-engine" and s["name"] == f"chat {queued}"]
    assert len(gen) == 1, [(s["service"], s["name"]) for s in rx.spans]
    trace_spans = [s for s in rx.spans if s["trace"] == gen[0]["trace"]]
    chain = _chain_to_root(trace_spans, gen[0])
    assert chain[1:] and chain[-1] == f"talaria-gateway:chat {queued}", chain
    assert "talaria-admission:admission.wait" in chain and "talaria-router:router.place" in chain, chain
    roots = [s for s in trace_spans if not s["parent"]]
    assert len(roots) == 1  # one trace for the call, across the kill
