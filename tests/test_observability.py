"""Metrics scraped by a real Prometheus (Debian's `prometheus` package; CI installs it)
from the embedded stack during a short replay with an admission restart in the middle:
PromQL totals over every process incarnation (`max_over_time` per series, summed) equal
independent sources — the client's own records, the engines' and substrate's log events.

A missing Prometheus fails here: it does not skip (the checks are the point)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
import pytest

from shared.clock import ScaledClock
from shared.logs import read_log_events
from shared.net import free_port
from shared.policy import resolve_policy
from talaria.client import TalariaClient, UnknownSession
from talaria.ops.nats_server import NatsServer
from talaria.ops.prometheus import CONFIG_FILE, TARGETS_FILE
from talaria.ops.stack import EmbeddedStack, StackSpec
from talaria.replay import drive
from talaria.workload.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "traces" / "smoke-4.jsonl"


def _prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        pytest.fail("no `prometheus` on PATH: install Debian's package (apt-get install prometheus); "
                    ".ci/run does", pytrace=False)
    return found


class Prometheus:
    def __init__(self, config: Path, data: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (data / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [_prometheus_binary(), f"--config.file={config}", f"--storage.tsdb.path={data / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def get(self, path: str, **params: str) -> dict:
        q = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(self.url + path + q, timeout=10) as r:
            return json.loads(r.read())

    def ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "prometheus exited at start-up"
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError("prometheus did not become ready")

    def value(self, query: str) -> float:
        out = self.get("/api/v1/query", query=query)
        assert out["status"] == "success", out
        result = out["data"]["result"]
        return float(result[0]["value"][1]) if result else 0.0

    def scraped(self, port: int, timeout_s: float = 30) -> None:
        """Wait until the target on `port` has been scraped (Prometheus's discovery hands new
        targets to the scraper in batches, every 5 s)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for t in self.get("/api/v1/targets")["data"]["activeTargets"]:
                if t["scrapeUrl"].endswith(f":{port}/metrics") and t["health"] == "up":
                    return
            time.sleep(0.2)
        raise AssertionError(f"the target on port {port} was never scraped")

    def scraped_since(self, wall: float, timeout_s: float = 30) -> None:
        """Wait until every live target has been scraped, successfully, after wall time
        `wall` (a busy machine can miss a second's scrape: a fixed sleep read stale totals)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.value("min(timestamp(up))") > wall and self.value("min(up)") == 1.0:
                return
            time.sleep(0.2)
        raise AssertionError(f"not every target was scraped in the {timeout_s:.0f} s after the last call")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _events(log_dir: Path, prefix: str, event: str) -> list[dict]:
    return [d for f in sorted(log_dir.glob(f"{prefix}*.log")) for d in read_log_events(f) if d.get("event") == event]


def total(metric: str, where: str = "") -> str:
    """A counter's total over every incarnation of every process: each series' highest value."""
    return f"sum(max_over_time({metric}{{{where}}}[1h]))"


@pytest.mark.timeout(300)
async def test_prometheus_totals_equal_the_clients_records_and_the_logs(tmp_path: Path) -> None:
    sessions = load_trace(SMOKE)
    models = sorted({s.model for s in sessions})
    spec = StackSpec(policy=resolve_policy("talaria"), models=models, time_scale=20.0, log_dir=tmp_path / "logs",
                     gateway=True)
    async with EmbeddedStack(spec) as stack:
        config = stack.prometheus_config
        assert config == stack.log_dir / CONFIG_FILE and (stack.log_dir / TARGETS_FILE).exists()
        targets = json.loads((stack.log_dir / TARGETS_FILE).read_text())
        assert {g["labels"]["service"] for g in targets} == {"router", "admission", "substrate", "engine", "gateway"}
        prom = Prometheus(config, tmp_path)
        try:
            await asyncio.to_thread(prom.ready)
            for port in list(stack.metrics_ports.values()):  # every process is a scraped target
                await asyncio.to_thread(prom.scraped, port)
            # before any call, admission's per-model gauges are there, at 0 (llm-d's contract reads an
            # idle server as 0 waiting, not as no series)
            admission = next(n for n in stack.group.children if n.startswith("admission-"))
            async with aiohttp.ClientSession() as http, \
                    http.get(f"http://127.0.0.1:{stack.metrics_ports[admission]}/metrics") as m:
                # (llm-d's contract gauges name their model as vLLM does, `model_name`)
                idle = {(f.name, sm.labels.get("model_name" if f.name.startswith("vllm:") else "model")): sm.value
                        for f in text_string_to_metric_families(await m.text()) for sm in f.samples}
            for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                         "talaria_queued_calls", "talaria_running_calls"):
                assert all(idle.get((name, model)) == 0.0 for model in models), (name, idle)
            client = await TalariaClient.connect(stack.nats_urls, subject_prefix=stack.subject_prefix, silence_s=5.0,
                                                 retries=20, **stack.nats_auth("agent"))
            done: list[str] = []
            try:
                clock = ScaledClock(spec.time_scale, stack.clock_epoch)
                replay = asyncio.ensure_future(drive(client, clock, sessions, "talaria",
                                                     on_reply=lambda r: done.append(r.call_id), error_retries=10))
                total_calls = sum(len(s.calls) for s in sessions)
                while len(done) < total_calls // 3:
                    assert not replay.done(), replay
                    await asyncio.sleep(0.05)
                first_port = stack.metrics_ports[admission]
                killed_at = datetime.now(timezone.utc)
                stack.group.children[admission].proc.kill()  # the supervisor restarts it, on a new port
                while stack.metrics_ports[admission] == first_port:
                    await asyncio.sleep(0.05)
                await asyncio.to_thread(prom.scraped, stack.metrics_ports[admission])
                out = await asyncio.wait_for(replay, timeout=200)
                # an error and an HTTP call, for the dashboard's panels of them
                with pytest.raises(UnknownSession):
                    await client.call("never-opened", models[0], prompt_tokens=10, max_tokens=2, call_id="x#0")
                async with aiohttp.ClientSession() as http:
                    body = {"model": models[0], "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
                    async with http.post(f"{stack.openai_base_url}/chat/completions", json=body,
                                         headers={"Authorization": f"Bearer {stack.api_key}"}) as r:
                        assert r.status == 200, await r.text()
                        http_tokens = (await r.json())["usage"]["completion_tokens"]
            finally:
                await client.close()
            # the last scrapes (every second), two of each target after the last call: a rate() over
            # a series the last calls began needs two samples
            for _ in range(2):
                await asyncio.to_thread(prom.scraped_since, time.time())
            # both admission incarnations were scraped: two targets, one process
            incarnations = prom.value(
                f'count(count by (instance) (last_over_time(talaria_event_loop_lag_seconds{{process="{admission}"}}[1h])))')
            assert incarnations == 2, incarnations

            completed = {r.call_id for r in out.records}
            assert not out.failures and len(completed) == total_calls
            answered = total_calls + 1  # the replay's calls and the HTTP one
            assert prom.value(total("talaria_calls_completed_total")) == answered
            assert prom.value(total("talaria_calls_accepted_total")) == answered
            assert prom.value(total("talaria_calls_failed_total", 'code="unknown_session"')) == 1
            generations = [d for d in _events(stack.log_dir, "engine-", "engine.finished")]
            assert prom.value(total("talaria_generations_total")) == len(generations) >= answered
            switches = _events(stack.log_dir, "substrate-", "substrate.switch")
            assert switches and prom.value(total("talaria_model_switches_total")) == len(switches)
            # slots, counted by the admission that opened them: the restarted one's all scraped; of the
            # killed one, what a scrape saw (a crash loses the counts since its last scrape)
            opened = _events(stack.log_dir, "admission-", "admission.slot_opened")
            after = [d for d in opened if datetime.fromisoformat(d["timestamp"].replace("Z", "+00:00")) > killed_at]
            assert after, "the restarted admission opened no slot"
            port_now = stack.metrics_ports[admission]
            assert prom.value(total("talaria_slots_total", f'reason="opened",instance="127.0.0.1:{port_now}"')) \
                == len(after)
            assert prom.value(total("talaria_slots_total", 'reason="opened"')) <= len(opened)
            # session-prefill admissions, counted by the engine-worker at completion
            sp = [d for d in generations if d.get("sp_admit")]
            assert prom.value(total("talaria_sp_admissions_total")) == len(sp)
            made = prom.value(total("talaria_reservations_total", 'outcome="made"'))
            ended = sum(prom.value(total("talaria_reservations_total", f'outcome="{o}"'))
                        for o in ("returned", "expired", "yielded"))
            assert made > 0 and ended <= made  # (the killed admission's own were lost with it)
            # a histogram of model seconds counts each completed call once
            assert prom.value(total("talaria_admission_wait_model_seconds_count")) == answered
            # the latencies and tokens operators read off vLLM, once per completed call
            for latency in ("talaria_call_duration_model_seconds", "talaria_time_to_first_token_model_seconds"):
                assert prom.value(total(f"{latency}_count")) == answered, latency
            assert prom.value(total("talaria_time_to_first_token_model_seconds_sum")) \
                < prom.value(total("talaria_call_duration_model_seconds_sum"))
            assert prom.value(total("talaria_generation_tokens_total")) \
                == sum(r.output_tokens for r in out.records) + http_tokens
            # llm-d's model-server contract is stored under its own names (with their colon), one
            # series per (server, model), not as `vllm_*`, the model labelled `model_name` as vLLM labels it
            for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
                assert prom.value(f"count(count by (server, model_name) (last_over_time({name}[1h])))") == len(models), name
            # the call record bucket, as the router reads it (at its start, then every 10 s): its bound,
            # and what it holds under it
            assert prom.value("max(last_over_time(talaria_call_record_max_bytes[1h]))") == 1024 ** 3
            held = prom.get("/api/v1/query", query="max(last_over_time(talaria_call_record_bytes[1h]))")
            assert held["data"]["result"] and float(held["data"]["result"][0]["value"][1]) < 1024 ** 3, held
            # ... from the router alone: every other process exposed these gauges as 0, and the
            # full-bucket alert's min() over the oldest age read 0 ("under an hour") for ever
            for name in ("talaria_call_record_bytes", "talaria_call_record_max_bytes",
                         "talaria_call_record_oldest_age_seconds"):
                exposed = prom.get("/api/v1/series", **{"match[]": name})["data"]
                assert exposed and {s["service"] for s in exposed} == {"router"}, (name, exposed)
            stored = prom.get("/api/v1/label/__name__/values")["data"]
            assert not [n for n in stored if n.startswith("vllm_")], stored
            # no session or call label anywhere, and no `instance` label of ours
            names = prom.get("/api/v1/labels")["data"]
            assert not {"session_id", "call_id", "session", "call"} & set(names), names
            series = prom.get("/api/v1/series", **{"match[]": '{__name__=~"talaria_.+"}'})["data"]
            assert series and all(s["instance"].startswith("127.0.0.1:") for s in series)
            # every panel of the Grafana dashboard: its PromQL returns data from this Prometheus
            dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "talaria.json").read_text())
            empty = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]
                     if not prom.get("/api/v1/query", query=t["expr"])["data"]["result"]]
            assert not empty, empty
            # the alerting rules (deploy/prometheus/alerts.yml) are loaded and evaluate without error
            rules = [r for g in prom.get("/api/v1/rules")["data"]["groups"] for r in g["rules"]]
            assert len(rules) >= 8 and all(r["type"] == "alerting" for r in rules), rules
            assert all(r["health"] == "ok" and not r.get("lastError") for r in rules), rules
        finally:
            prom.stop()
    # stopped, the stack has no targets: a Prometheus still scraping its old ports paged every process down
    assert json.loads((config.parent / TARGETS_FILE).read_text()) == []


def test_the_alerting_rules_are_valid_and_fire_as_their_unit_tests_say() -> None:
    """`promtool` (with Debian's prometheus) checks deploy/prometheus/alerts.yml and runs its unit
    tests: each alert fires on a series that should page, and not on its quiet twin."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("no `promtool` on PATH: install Debian's package (apt-get install prometheus); .ci/run does")
    folder = ROOT / "deploy" / "prometheus"
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts-test.yml"]):
        out = subprocess.run([promtool, *args], cwd=folder, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


def test_the_libraries_own_log_lines_are_json_lines_of_the_service(capsys: pytest.CaptureFixture[str],
                                                                   service_logging: None) -> None:
    """nats-py's, aiohttp's, asyncio's and the agent client's stdlib lines (a gateway's
    "NATS error: ..." during an outage) came out as bare text among the JSON lines."""
    import json
    import logging

    from shared.logs import configure_logging

    configure_logging("gateway")
    logging.getLogger("talaria.client").warning("NATS error: %s", "nats: unexpected EOF")
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["event"] == "NATS error: nats: unexpected EOF" and line["service"] == "gateway"
    assert line["level"] == "warning" and line["logger"] == "talaria.client"
    # and structlog's own lines from a logger made without the bound one (the gateway's
    # `gateway.call`, every process's `metrics.listening`): named too, for merged logs
    import structlog

    structlog.get_logger("metrics").info("metrics.listening", port=9464)
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["event"] == "metrics.listening" and line["service"] == "gateway"


def test_vllms_logging_is_routed_into_the_engine_log_unless_an_operator_configured_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The configuration handed to vLLM (as its processes read it from `VLLM_LOGGING_CONFIG_PATH`)
    writes its records as the engine's JSON lines, naming the process; an operator's own
    configuration, vLLM's logging turned off, or console lines are left alone."""
    import json
    import logging.config

    from shared import logs

    for env, fmt in (({"VLLM_LOGGING_CONFIG_PATH": "/etc/mine.json"}, "json"), ({"VLLM_CONFIGURE_LOGGING": "0"}, "json"),
                     ({}, "console")):
        monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
        monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert logs.route_vllm_logs("engine", fmt) is None
        assert os.environ.get("VLLM_LOGGING_CONFIG_PATH") == env.get("VLLM_LOGGING_CONFIG_PATH")
    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    path = logs.route_vllm_logs("engine", "json")
    assert path is not None and os.environ["VLLM_LOGGING_CONFIG_PATH"] == str(path)
    logging.config.dictConfig(json.loads(path.read_text()))
    log = logging.getLogger("vllm.v1.engine.core")
    log.info("not at WARNING")
    log.warning("KV cache %s", "full")
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [(d["event"], d["service"], d["level"], d["logger"], d["vllm_process"]) for d in lines] == [
        ("KV cache full", "engine", "warning", "vllm.v1.engine.core", "MainProcess")]
    logging.getLogger("vllm").handlers.clear()  # (the next tests' logging as it was)
    path.unlink()


async def test_a_clean_stop_is_not_logged_as_a_lost_connection(nats_server: NatsServer) -> None:
    """Every clean stop logged `nats.disconnected` at warning (nats-py calls the
    disconnect callback on close too), so a fault-free run could not be told by its
    warnings; a connection lost to the server still is one."""
    import structlog

    from shared.bus import connect_nats

    with structlog.testing.capture_logs() as seen:
        nc = await connect_nats([nats_server.url], "t", structlog.get_logger())
        await nc.close()
    assert [e["event"] for e in seen] == ["nats.closed"] and seen[0]["log_level"] == "info"


def test_the_metrics_port_serves_the_metrics_and_nothing_else() -> None:
    """Its thread answers while the service's event loop is stuck, so a health check
    pointed at it by mistake (it answered every path with 200) would call a hung
    service healthy."""
    from shared.metrics import Metrics

    port = Metrics().serve(free_port(), "127.0.0.1")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.status == 200 and b"talaria_event_loop_lag_seconds" in r.read()
    for path in ("/health", "/healthz", "/metrics/x"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5)
        assert refused.value.code == 404 and b"/metrics" in refused.value.read()
