"""Every Prometheus metric Talaria exposes, in one place (prometheus_client).

Each service process serves its own registry on its own port
(`TALARIA_METRICS_PORT`; 0 = off) from prometheus_client's WSGI app, in
Prometheus's text format, on a thread of its own, so a scrape still answers
while the event loop is busy. prometheus_client rather than OpenTelemetry's Prometheus exporter: it is what
the field's servers expose with (vLLM's `vllm:*` among them), it needs no SDK
pipeline, and its exposition is Prometheus's own.

Rules (docs/observability.md has the table):

- Labels are `server`, `model` (`to_model` for a switch's target) and a few
  bounded enums (`code`, `kind`, `reason`, `source`, `residency`, `kv`,
  `outcome`, `api`, `status`): never a session or call id (cardinality), and
  never `instance` or `job` (Prometheus sets those from the target).
- Counted where it cannot double: a call's outcome at its durable transition
  (accepted when the router creates its call record, completed when an
  engine-worker stores its first answer), never inside a state machine that
  a restarted process steps through again. A counter restarts at zero with its
  process; a new incarnation is a new target (a new port), so totals over
  every incarnation are `sum(max_over_time(m[range]))`.
- Two clocks, never mixed: `*_model_seconds` are the stack clock's (the sim
  engine's model time, buckets up to hours: a baseline round wait is
  minutes), `*_seconds` are wall time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import structlog
from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics,
                               make_wsgi_app)
from prometheus_client.exposition import ThreadingWSGIServer

from shared.clock import LagMonitor

WSGIApp = Callable[[dict[str, Any], Any], Iterable[bytes]]

disable_created_metrics()  # no `_created` series beside each counter

# model seconds: a round wait under the baseline is minutes, a session's duration hours
MODEL_SECONDS_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0,
                         7200.0, 14400.0)
# model seconds per output token: a decode step is milliseconds to tens of them, more in a large batch
TOKEN_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)
WALL_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """One process's metrics. Every service kind builds the same set (one schema of
    names); each updates only its own, and a labelled metric nobody updates
    exposes no sample."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        # the process's own figures (process_start_time_seconds, resident memory, CPU, open fds):
        # restarts and growth over a long run show here, not only in the logs
        ProcessCollector(registry=r)
        # -- calls (router: accepted, refused; engine-worker: generated, completed) -----------
        self.calls_accepted = Counter(
            "talaria_calls_accepted", "Calls taken for the first time (the router created their call record).",
            ["model"], registry=r)
        self.calls_failed = Counter(
            "talaria_calls_failed", "Calls answered with an error, by error code (router, admission and engine-worker).",
            ["code"], registry=r)
        self.calls_completed = Counter(
            "talaria_calls_completed", "Calls answered to the agent, once each: an engine-worker stored its "
            "first reply in the call record.", ["server", "model"], registry=r)
        self.generations = Counter(
            "talaria_generations", "Generations run to their end (a second generation of a call counts "
            "again: minus talaria_calls_completed, the duplicate generations).", ["server", "model"], registry=r)
        self.prefix_tokens = Counter(
            "talaria_prefix_tokens", "Prompt tokens of completed calls by where they came from: reused "
            "(in HBM), restored (from host memory), reprefilled (recomputed though the session had them), "
            "new.", ["server", "model", "source"], registry=r)
        self.admission_wait = Histogram(
            "talaria_admission_wait_model_seconds", "Model seconds a completed call waited for admission: "
            "`round` (it missed its model's open slot and waited for the next one) or `in_slot`.",
            ["server", "model", "kind"], buckets=MODEL_SECONDS_BUCKETS, registry=r)
        self.switch_wait = Histogram(
            "talaria_switch_wait_model_seconds", "Model seconds a completed call waited for its model's switch.",
            ["server", "model"], buckets=MODEL_SECONDS_BUCKETS, registry=r)
        # the latencies and tokens operators read off vLLM (e2e_request_latency, time_to_first_token,
        # inter_token_latency, generation_tokens), per completed call, on the stack's clock: under
        # round scheduling a call's wait for its model's turn is most of them, and is in them
        self.call_duration = Histogram(
            "talaria_call_duration_model_seconds", "Model seconds from a completed call's arrival at the router "
            "to its last token: its waits, switch, restore, prefill and decode (vLLM's e2e request latency).",
            ["server", "model"], buckets=MODEL_SECONDS_BUCKETS, registry=r)
        self.time_to_first_token = Histogram(
            "talaria_time_to_first_token_model_seconds", "Model seconds from a completed call's arrival at the "
            "router to its first output token: its waits, switch, restore and prefill.", ["server", "model"],
            buckets=MODEL_SECONDS_BUCKETS, registry=r)
        self.time_per_output_token = Histogram(
            "talaria_time_per_output_token_model_seconds", "Model seconds per output token after the first, per "
            "completed call of two or more tokens (its decode over its tokens; vLLM's inter-token latency).",
            ["server", "model"], buckets=TOKEN_SECONDS_BUCKETS, registry=r)
        self.generation_tokens = Counter(
            "talaria_generation_tokens", "Output tokens of completed calls (prompt tokens: "
            "talaria_prefix_tokens_total over its sources).", ["server", "model"], registry=r)
        self.session_duration = Histogram(
            "talaria_session_duration_model_seconds", "Model seconds from a session's first call to its end "
            "(an agent's end), per model.", ["model"], buckets=MODEL_SECONDS_BUCKETS, registry=r)
        # -- placement (router) -----------------------------------------------------------------
        self.placements = Counter(
            "talaria_placements", "Placement decisions by the chosen server's residency for the call's model "
            "and where the session's KV was there.", ["server", "model", "residency", "kv"], registry=r)
        # the call record bucket (the router reads its state): how full, and how far back retries are
        # deduplicated. Labelled by the bucket so that only a router exposes them: an unlabelled gauge is
        # exposed as 0 by every other process, and an alert's min() over them read 0 for ever
        self.call_record_bytes = Gauge("talaria_call_record_bytes", "Bytes the call record bucket holds (on each "
                                       "NATS node).", ["bucket"], registry=r)
        self.call_record_max_bytes = Gauge("talaria_call_record_max_bytes", "The call record bucket's bound "
                                           "(TALARIA_CALL_RECORD_MAX_BYTES); past it the oldest records are dropped.",
                                           ["bucket"], registry=r)
        self.call_record_oldest_age = Gauge("talaria_call_record_oldest_age_seconds", "Wall seconds since the oldest "
                                            "call record was written: how far back a retried call id is still "
                                            "deduplicated (6 hours while the bucket is under its bound).", ["bucket"],
                                            registry=r)
        # -- admission ---------------------------------------------------------------------------
        self.queued = Gauge("talaria_queued_calls", "Calls waiting for admission.", ["server", "model"], registry=r)
        self.running = Gauge("talaria_running_calls", "Calls admitted and running.", ["server", "model"], registry=r)
        self.slots = Counter("talaria_slots", "Slots opened (`reason=opened`) and closed (by why).",
                             ["server", "model", "reason"], registry=r)
        self.calls_moved = Counter(
            "talaria_calls_moved", "Calls this server's admission handed back to the routers because its "
            "engine-worker for their model drains (a rolling restart), by `outcome`: `moved` (another server "
            "took it) or `stayed` (none could; queued here again).", ["server", "model", "outcome"], registry=r)
        self.sp_admissions = Counter(
            "talaria_sp_admissions", "Completed calls that session-prefill admitted into their model's open slot "
            "(counted at completion, once per call).", ["server", "model"], registry=r)
        self.reservations = Counter(
            "talaria_reservations", "Soft reservations by outcome: `made`, `returned` (the session came back "
            "within the hold), `expired` (its hold ran out), `yielded` (its model's slot closed for another).",
            ["server", "outcome"], registry=r)
        self.reserved_idle = Counter(
            "talaria_reserved_idle_model_seconds", "Model seconds a server sat idle holding its slot open for "
            "reservations (capacity held idle).", ["server"], registry=r)
        # the llm-d model-server contract, per (server, model), from the service that knows it: under
        # round scheduling a model's waiting calls are in admission, not in its engine; the model
        # labelled `model_name`, as vLLM labels these and its other series (a vLLM dashboard's filter)
        self.contract_waiting = Gauge("vllm:num_requests_waiting", "Calls waiting for this model on this server "
                                      "(llm-d's model-server contract; admission's queue).", ["server", "model_name"],
                                      registry=r)
        self.contract_running = Gauge("vllm:num_requests_running", "Calls of this model running on this server "
                                      "(llm-d's model-server contract).", ["server", "model_name"], registry=r)
        self.contract_kv_usage = Gauge("vllm:kv_cache_usage_perc", "Share of the active model's KV budget the "
                                       "running calls reserve, 0-1 (0 for a model not active; llm-d's contract).",
                                       ["server", "model_name"], registry=r)
        self.reservations_held = Gauge("talaria_reservations_held", "Soft reservations held now.", ["server"],
                                       registry=r)
        # -- substrate ----------------------------------------------------------------------------
        self.switches = Counter("talaria_model_switches", "Model switches done, by kind: `staged` (weights "
                                "staged in host memory ahead) or `host` (loaded from host memory).",
                                ["server", "to_model", "kind"], registry=r)
        self.switch_duration = Histogram(
            "talaria_model_switch_duration_model_seconds", "Model seconds a switch took, by kind.",
            ["server", "kind"], buckets=MODEL_SECONDS_BUCKETS, registry=r)
        self.host_kv_bytes = Gauge("talaria_host_kv_bytes", "Bytes of KV held in host memory (the substrate's "
                                   "ledger).", ["server"], registry=r)
        self.hbm_weights_bytes = Gauge("talaria_hbm_weights_bytes", "Bytes of model weights in HBM: the active "
                                       "model's and what is being staged in (the substrate's ledger).", ["server"],
                                       registry=r)
        self.host_kv_capacity_bytes = Gauge("talaria_host_kv_capacity_bytes", "Bytes of host memory the ledger "
                                            "keeps for KV (host DRAM less every model's weights).", ["server"],
                                            registry=r)
        self.active_model = Gauge("talaria_active_model", "1 for the model a server holds now (0 for the others).",
                                  ["server", "model"], registry=r)
        # -- gateway ------------------------------------------------------------------------------
        self.http_requests = Counter("talaria_http_requests", "HTTP calls at the gateway by API and status.",
                                     ["api", "status"], registry=r)
        self.http_stream_errors = Counter("talaria_http_stream_errors", "Streamed HTTP calls that began (status "
                                          "200) and ended in an error event, by API and error code.", ["api", "code"],
                                          registry=r)
        self.http_duration = Histogram("talaria_http_request_duration_seconds", "Wall seconds of an HTTP call at "
                                       "the gateway (a streamed one: until its last event).", ["api"],
                                       buckets=WALL_SECONDS_BUCKETS + (60.0, 300.0, 600.0), registry=r)
        self.http_calls_shed = Counter("talaria_http_calls_shed", "API requests refused at once for a bound on "
                                       "requests in flight: the gateway's (`gateway`: 429, Anthropic 529) or the "
                                       "tenant's (`tenant`: 429).", ["limit"], registry=r)
        # -- every process ------------------------------------------------------------------------
        self.loop_lag = Gauge("talaria_event_loop_lag_seconds", "Worst event-loop lag since the process "
                              "started (wall seconds).", registry=r)
        self.loop_lag_recent = Gauge("talaria_event_loop_lag_recent_seconds", "Worst event-loop lag of the last "
                                     "30-60 wall seconds (0 after a minute without one).", registry=r)
        self.loop_stalled = Counter("talaria_event_loop_stalled_seconds", "Wall seconds the event loop was "
                                    "stalled: its lags of 10 ms or more, summed (the rate is the share of time "
                                    "stalled).", registry=r)
        self.dependency_up = Gauge("talaria_dependency_up", "1 while this process reaches the dependency (nats, "
                                   "redis) as its own use of it last found, 0 while it does not.", ["dependency"],
                                   registry=r)

    def report_lag(self, lag: LagMonitor, counted_stalls_s: float) -> float:
        """The loop-lag gauges and stall counter from `lag` (every second); the stalls
        counted so far, to pass next time."""
        self.loop_lag.set(lag.worst_s)
        self.loop_lag_recent.set(lag.recent_worst_s(time.monotonic()))
        self.loop_stalled.inc(lag.stalled_s - counted_stalls_s)
        return lag.stalled_s

    def gateway_calls(self, held: Callable[[], float], waiting: Callable[[], float], most: int) -> None:
        """The gateway's API requests in flight, those waiting in line for a slot, and its bound;
        called by the gateway alone (an unlabelled gauge is exposed, as 0, by every process that
        defines it)."""
        Gauge("talaria_http_calls_in_flight", "Calls of a model the gateway is answering now (a stream until its "
              "last event).", registry=self.registry).set_function(held)
        Gauge("talaria_http_calls_waiting", "Calls of a model waiting in line for a slot (over the gateway's or "
              "their tenant's bound).", registry=self.registry).set_function(waiting)
        Gauge("talaria_http_calls_max", "The gateway's bound on API requests in flight "
              "(TALARIA_GATEWAY_MAX_CALLS; 0: none).", registry=self.registry).set(most)

    def reexport(self, source: CollectorRegistry, prefix: str, skip: frozenset[str]) -> None:
        """Expose another registry's metrics named `prefix*` here too (a real engine's own
        `vllm:*`), but for `skip`: names this process's metrics define, so none is exposed twice."""
        self.registry.register(_Reexport(source, prefix, skip))

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve the registry on `port` (0: nothing is served); the port actually bound."""
        if port <= 0:
            return 0
        log = structlog.get_logger("metrics")
        try:
            server = make_server(host, port, _text_exposition(make_wsgi_app(self.registry)), ThreadingWSGIServer,
                                 handler_class=_QuietHandler)
        except OSError as exc:  # the service still serves calls: metrics are not worth an outage
            log.error("metrics.unavailable", port=port, error=str(exc))
            return 0
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
        bound = int(server.server_address[1])
        log.info("metrics.listening", port=bound)
        return bound


METRICS_PATHS = frozenset({"/metrics", "/"})


def _text_exposition(app: WSGIApp) -> WSGIApp:
    """Always Prometheus's text format (0.0.4), whatever the scraper asks for. Asked for
    OpenMetrics (every Prometheus 2.x scrape is), prometheus_client writes a name with a
    colon as `vllm_...` in its samples but `vllm:...` in its TYPE line, so Prometheus
    stored no series under the `vllm:*` names llm-d's contract and dashboards query
    (prometheus/client_python#1177); the text format keeps the names as they are."""

    def app_text(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "/") not in METRICS_PATHS:
            # this thread answers while the service's event loop is stuck: a health check
            # pointed here by mistake must fail, not report a hung service well
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found: this port serves the metrics at /metrics; health is the service's own port\n"]
        environ["HTTP_ACCEPT"] = "text/plain; version=0.0.4"
        return app(environ, start_response)

    return app_text


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - (the base class's name)
        """Scrapes are not logged (one a second per target)."""


CONTRACT_NAMES = frozenset({"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"})


class _Reexport:
    """A collector that yields another registry's metrics of one prefix."""

    def __init__(self, source: CollectorRegistry, prefix: str, skip: frozenset[str]) -> None:
        self.source, self.prefix, self.skip = source, prefix, skip

    def describe(self) -> list[object]:
        return []  # (unchecked: what the source registers changes as the engine starts)

    def collect(self):  # type: ignore[no-untyped-def]
        for family in self.source.collect():
            if family.name.startswith(self.prefix) and family.name not in self.skip:
                yield family
