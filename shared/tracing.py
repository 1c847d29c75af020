"""OpenTelemetry traces per call, linked by `gen_ai.conversation.id` (the session id).

Off by default: with no endpoint (`TALARIA_OTLP_ENDPOINT`, or OpenTelemetry's own
`OTEL_EXPORTER_OTLP_ENDPOINT`) the API's no-op tracer does nothing and costs
next to nothing. With one, each process exports its spans over OTLP/HTTP
(batched) as `talaria-<service>`.

A call's trace: the root span where the call enters (the gateway's HTTP
request, or the agent client's call for an agent on NATS), then `router.place`,
`admission.wait` (with `admission.switch_wait` inside it when the call waited
for its model's switch), and the engine-worker's generation, named as the
GenAI conventions name a call (`chat <model>`). The W3C `traceparent` rides in
NATS headers and is kept in the stored call (`SubmitCall.traceparent`, which
admission persists), so a call recovered after a crash keeps its trace.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"
_propagator = TraceContextTextMapPropagator()
_tracer = trace.get_tracer("talaria")


def configure(service: str, endpoint: str | None = None) -> bool:
    """Export this process's spans over OTLP/HTTP when an endpoint is set; True if on."""
    endpoint = endpoint or os.environ.get("TALARIA_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"talaria-{service}"}))
    url = endpoint.rstrip("/") + "/v1/traces" if not endpoint.rstrip("/").endswith("/v1/traces") else endpoint
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url), schedule_delay_millis=200))
    trace.set_tracer_provider(provider)
    global _tracer
    _tracer = trace.get_tracer("talaria")
    return True


def shutdown() -> None:
    """Flush what is batched (a process about to exit)."""
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()  # type: ignore[attr-defined]


def call_attributes(model: str, session_id: str, call_id: str, **more: Any) -> dict[str, Any]:
    """The GenAI conventions' attributes of a call (no None values)."""
    out: dict[str, Any] = {"gen_ai.operation.name": "chat", "gen_ai.request.model": model,
                           "gen_ai.conversation.id": session_id, "talaria.call_id": call_id}
    out.update({k: v for k, v in more.items() if v is not None})
    return out


def traceparent_of(headers: Mapping[str, str] | None) -> str | None:
    return (headers or {}).get(TRACEPARENT)


def current_traceparent() -> str | None:
    """The current span's W3C traceparent, to carry to the next hop (None: no span)."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get(TRACEPARENT)


def with_traceparent(headers: dict[str, str] | None, traceparent: str | None = None) -> dict[str, str]:
    """NATS headers with the current (or the given) traceparent added."""
    out = dict(headers or {})
    tp = traceparent or current_traceparent()
    if tp:
        out[TRACEPARENT] = tp
    return out


def wall_ns(at_s: float | None = None) -> int:
    return int((time.time() if at_s is None else at_s) * 1e9)


@contextmanager
def span(name: str, parent: str | None = None, *, kind: SpanKind = SpanKind.INTERNAL,
         attributes: Mapping[str, Any] | None = None, start_s: float | None = None) -> Iterator[Span]:
    """A span under `parent` (a traceparent; None: under the current span, or a new trace),
    current inside the block. `start_s`: its wall start when it began before now."""
    ctx = _propagator.extract({TRACEPARENT: parent}) if parent else None
    s = _tracer.start_span(name, context=ctx, kind=kind, attributes=dict(attributes or {}),
                           start_time=wall_ns(start_s) if start_s is not None else None)
    token = otel_context.attach(trace.set_span_in_context(s))
    try:
        yield s
    finally:
        otel_context.detach(token)
        s.end()


def record_span(name: str, parent: str | None, start_s: float, end_s: float,
                attributes: Mapping[str, Any] | None = None) -> str | None:
    """A span that already happened (a wait, known when it ends); its traceparent."""
    ctx = _propagator.extract({TRACEPARENT: parent}) if parent else None
    s = _tracer.start_span(name, context=ctx, attributes=dict(attributes or {}), start_time=wall_ns(start_s))
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(s))
    s.end(end_time=wall_ns(end_s))
    return carrier.get(TRACEPARENT)
