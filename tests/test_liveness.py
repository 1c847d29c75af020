"""Hung processes (talaria/ops/liveness.py): the decision, and a SIGSTOPped
service of a live embedded stack killed and restarted by its supervisor."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import textwrap
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shared.policy import resolve_policy
from talaria.client import TalariaClient
from talaria.ops.liveness import BusProbe, LivenessWatch, PingRounds
from talaria.ops.nats_server import NatsServer
from talaria.ops.redis_server import RedisServer
from talaria.ops.stack import EmbeddedStack, StackSpec
from polling import until

AIR = "glm-4.5-air-fp8"


def test_a_child_is_judged_only_after_it_answered_and_its_grace() -> None:
    w = LivenessWatch(misses=3, grace_s=10.0)
    w.started("a", 0.0)
    assert w.round({"a": False}, 20.0) == []            # never answered: still starting, not hung
    w.round({"a": True}, 1.0)
    assert [w.round({"a": False}, 2.0 + i) for i in range(5)] == [[]] * 5  # within its grace
    assert w.round({"a": False}, 11.0) == [] and w.round({"a": False}, 11.5) == []
    assert w.round({"a": False}, 12.0) == ["a"]         # three misses in a row after the grace
    assert w.round({"a": False}, 30.0) == []            # re-armed: the restarted one must answer first


def test_a_child_that_never_answers_is_judged_after_its_start_up_allowance() -> None:
    """Hung before its first answer (stopped right after a restart): caught once its
    start-up allowance is over, not left alone for ever."""
    w = LivenessWatch(misses=2, grace_s=1.0, startup_s=5.0)
    w.started("a", 0.0)
    assert [w.round({"a": False}, t) for t in (1.0, 2.0, 4.0)] == [[]] * 3  # still starting
    assert w.round({"a": False}, 5.0) == [] and w.round({"a": False}, 5.5) == ["a"]


def test_a_real_engine_keeps_its_weight_load_allowance_while_quick_services_are_judged_soon() -> None:
    w = LivenessWatch(misses=2, grace_s=2.0, startup_s=10.0)
    w.allow("engine", 300.0, 300.0)
    for name in ("router", "engine"):
        w.started(name, 0.0)
        w.round({name: True}, 0.5)
    assert w.round({"router": False, "engine": False}, 3.0) == []
    assert w.round({"router": False, "engine": False}, 3.5) == ["router"]  # a quick service: judged after 2 s
    assert [w.round({"engine": False}, t) for t in (100.0, 200.0, 299.0)] == [[]] * 3  # still loading
    assert w.round({"engine": False}, 300.0) == [] and w.round({"engine": False}, 300.5) == ["engine"]


def test_a_child_nobody_listens_for_is_starting_or_stopping_not_hung() -> None:
    """None: no subscriber on its health subject (NATS's "no responders") or nothing on
    its port. A drained service tearing down lets go of its subscriptions, and was killed
    as hung 1 s later (a rolling-restart probe: an engine-worker's clean exit turned -9);
    a hung one keeps them, and its pings go unanswered."""
    w = LivenessWatch(misses=2, grace_s=1.0)
    w.started("a", 0.0)
    w.round({"a": True}, 0.5)
    assert [w.round({"a": None}, t) for t in (2.0, 3.0, 4.0, 60.0)] == [[]] * 4
    assert w.round({"a": False}, 61.0) == [] and w.round({"a": None}, 61.5) == []
    assert w.round({"a": False}, 62.0) == ["a"]  # (misses need not be adjacent rounds: absences count for nothing)


def test_a_child_of_its_own_patience_is_judged_after_its_own_misses() -> None:
    """The gateway under `talaria up` (its kill cuts every agent's stream): compose's 12
    rounds, where the services are judged after 3."""
    w = LivenessWatch(misses=3, grace_s=0.0)
    w.allow("gateway", 0.0, 0.0, misses=12)
    for name in ("router", "gateway"):
        w.started(name, 0.0)
        w.round({name: True}, 0.1)
    kills = [w.round({"router": False, "gateway": False}, 1.0 + i) for i in range(12)]
    assert kills[2] == ["router"] and kills[11] == ["gateway"]
    assert all("gateway" not in k for k in kills[:11])


def test_an_answer_resets_the_count() -> None:
    w = LivenessWatch(misses=2, grace_s=0.0)
    w.started("a", 0.0)
    w.round({"a": True}, 1.0)
    assert w.round({"a": False}, 2.0) == []
    assert w.round({"a": True}, 3.0) == []
    assert w.round({"a": False}, 4.0) == []
    assert w.round({"a": False}, 5.0) == ["a"]


async def test_a_round_whose_probe_of_the_watchers_own_path_failed_judges_nobody() -> None:
    """Every ping of a round goes unanswered when the watcher's own NATS node is stopped:
    that round is dropped, not counted as a miss for each child."""
    async def ping(name: str) -> bool:
        return name == "up"

    async def probe(ok: bool) -> bool:
        return ok

    rounds = PingRounds(settle_s=0.2)
    rounds.begin(["up", "down"], ping, lambda: probe(False))
    await asyncio.sleep(0.01)
    assert rounds.finished() == [] and rounds.dropped == 1
    await asyncio.sleep(0.25)  # (the bus back and settled)
    rounds.begin(["up", "down"], ping, lambda: probe(True))
    rounds.begin(["up", "down"], ping)
    await asyncio.sleep(0.01)
    assert rounds.finished() == [{"up": True, "down": False}] * 2
    assert rounds.dropped == 1


async def test_rounds_just_after_the_bus_was_away_or_with_every_child_silent_judge_nobody() -> None:
    """A NATS node stopped for seconds and back: the watcher's probe is answered at once,
    while every service is still reconnecting or working off what queued, so its pings
    time out; those rounds had every service killed at once (a 6-s stop of `talaria up`'s
    NATS: all 15). A round in which every one of two or more children missed is the
    bus's, and the rounds begun in the settling time after the bus was away are dropped;
    a lone silent child among answering ones is still judged."""
    answering: set[str] = set()

    async def ping(name: str) -> bool | None:
        return name in answering if name != "gone" else None

    async def probe(ok: bool) -> bool:
        return ok

    rounds = PingRounds(settle_s=0.2)
    rounds.begin(["a", "b", "gone"], ping, lambda: probe(True))  # every child silent at once: the bus's
    await asyncio.sleep(0.01)
    answering.add("a")
    rounds.begin(["a", "b"], ping, lambda: probe(True))  # one silent, yet within the settling time
    await asyncio.sleep(0.01)
    assert rounds.finished() == [] and rounds.dropped == 2
    await asyncio.sleep(0.25)
    rounds.begin(["a", "b"], ping, lambda: probe(True))
    await asyncio.sleep(0.01)
    assert rounds.finished() == [{"a": True, "b": False}]
    rounds.begin(["b"], ping, lambda: probe(True))  # a lone child (a container's watchdog) is judged
    await asyncio.sleep(0.01)
    assert rounds.finished() == [{"b": False}]
    rounds.bus_away()  # the watcher's own client reconnecting
    rounds.begin(["a", "b"], ping, lambda: probe(True))
    await asyncio.sleep(0.01)
    assert rounds.finished() == [] and rounds.dropped == 3


async def _a_call_is_served(stack: EmbeddedStack) -> None:
    client = await TalariaClient.from_deployment(stack.deployment())
    try:
        sess = await client.open_session(AIR)
        assert (await asyncio.wait_for(sess.call(prompt_tokens=800, max_tokens=16, sim_output_tokens=4),
                                       30)).output_tokens == 4
    finally:
        await client.close()


@pytest.mark.e2e
@pytest.mark.timeout(150)
async def test_a_stopped_nats_node_of_the_watch_itself_kills_no_service(tmp_path: Path) -> None:
    """The liveness watch's own NATS node stopped (SIGSTOP: its connections stay open and
    nothing answers): no health ping gets through, for the node's sake, not the services'.
    None of them is killed (every one was, over and over, while the watch judged them by
    pings through the stopped node), and a call is served once the node is back."""
    spec = StackSpec(policy=resolve_policy("talaria"), models=[AIR], time_scale=20.0, log_dir=tmp_path / "logs",
                     liveness=True, liveness_grace_s=1.0, nats_cluster=3)
    async with EmbeddedStack(spec) as stack:
        def connections(node: NatsServer) -> set[str]:
            with urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}/connz?limit=1000", timeout=5) as r:
                return {c.get("name", "") for c in json.load(r).get("connections", [])}

        await asyncio.sleep(1.5)  # past the grace
        node = next(n for n in stack.nats_nodes if "talaria-liveness" in connections(n))
        # (a service on the stopped node is out of reach itself until it leaves it, as the watch
        # does: it may be restarted; every other one answers throughout and must be left alone).
        # Each process connects to a node at random, so every service may be on the watch's (a CI
        # run drew that): one of them is restarted, to draw again, until one is elsewhere
        for _ in range(8):
            before = dict(stack.group.pids())
            on_node = connections(node)
            elsewhere = [name for name in before if name not in on_node]
            if elsewhere:
                break
            redraw = next(name for name in sorted(before) if name.startswith("engine-"))
            os.kill(before[redraw], signal.SIGKILL)
            await until(lambda: stack.group.pids().get(redraw) not in (None, before[redraw]), 30, "not restarted")
            await asyncio.sleep(2.0)  # (connected, and past its grace)
        assert node.pid is not None and elsewhere, (on_node, before)
        os.kill(node.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(15.0)  # longer than the watch takes to leave the node (about 10 s)
        finally:
            os.kill(node.pid, signal.SIGCONT)
        await asyncio.sleep(2.0)
        replaced = sorted(name for name in elsewhere if stack.group.pids().get(name) != before[name])
        assert replaced == [], f"killed for the watch's NATS node's stop: {replaced} (on the node: {sorted(on_node)})"
        await _a_call_is_served(stack)


async def test_the_bus_probe_is_not_fooled_by_a_stall_that_kills_nats_pys_read_loop(tmp_path: Path) -> None:
    """A NATS node stopped for 2 s: a probe by `flush(timeout)` left nats-py a cancelled
    PONG future, whose late PONG killed the client's read loop while it still read as
    connected, and the probe said the bus was back while nothing reached the client.
    The probe is away while the node is stopped, back once it resumes, and the client
    still hears (a request through the node is answered)."""
    import nats as nats_mod

    server = NatsServer(log_file=tmp_path / "nats.log")
    server.start(timeout=30)
    nc = other = None
    try:
        nc = await nats_mod.connect(server.url, ping_interval=3, max_outstanding_pings=3)
        other = await nats_mod.connect(server.url)

        async def echo(msg) -> None:  # type: ignore[no-untyped-def]
            await other.publish(msg.reply, b"ok")

        await other.subscribe("echo", cb=echo)
        await other.flush()
        probe = BusProbe(nc)
        assert await probe.answers()
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)
        try:
            assert [await probe.answers(0.3) for _ in range(6)] == [False] * 6
        finally:
            os.kill(server.pid, signal.SIGCONT)
        deadline = time.monotonic() + 5
        while not await probe.answers(0.3):
            assert time.monotonic() < deadline, "the probe never saw the node back"
        assert (await nc.request("echo", b"", timeout=2)).data == b"ok"
        probe.close()
    finally:
        for c in (nc, other):
            if c is not None:
                await c.close()
        server.stop()


@pytest.mark.e2e
@pytest.mark.timeout(150)
async def test_a_nats_stopped_for_seconds_kills_no_service_as_it_comes_back(tmp_path: Path) -> None:
    """`talaria up`'s one NATS node stopped for 3 s, then for 6 s (SIGSTOP), and resumed:
    every service was killed as hung at once as it came back (the watch's probe answered,
    while their pings, sent through the backlog, timed out; after the shorter stop the
    watch's own client could not hear at all), and under vLLM each engine would have
    loaded its weights again. None is now, and a call is served after."""
    spec = StackSpec(policy=resolve_policy("talaria"), models=[AIR], time_scale=20.0, log_dir=tmp_path / "logs",
                     liveness=True, liveness_grace_s=1.0, gateway=True)
    async with EmbeddedStack(spec) as stack:
        await asyncio.sleep(1.5)  # past the grace
        before = dict(stack.group.pids())
        node = stack.nats_nodes[0]
        assert node.pid is not None
        for stop_s in (3.0, 6.0):
            os.kill(node.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(stop_s)
            finally:
                os.kill(node.pid, signal.SIGCONT)
            await asyncio.sleep(8.0)  # (the kills came about 6 s after the node resumed)
            replaced = sorted(name for name in before if stack.group.pids().get(name) != before[name])
            assert replaced == [], f"killed as the NATS stopped {stop_s:g} s came back: {replaced}"
        await _a_call_is_served(stack)


@pytest.mark.e2e
@pytest.mark.timeout(120)
async def test_a_stopped_service_is_killed_and_restarted(tmp_path: Path) -> None:
    spec = StackSpec(policy=resolve_policy("talaria"), models=[AIR], time_scale=20.0, log_dir=tmp_path / "logs",
                     liveness=True, liveness_grace_s=1.0)
    async with EmbeddedStack(spec) as stack:
        client = await TalariaClient.connect(stack.nats_urls, subject_prefix=stack.subject_prefix, silence_s=20.0,
                                             **stack.nats_auth("agent"))
        try:
            sess = await client.open_session(AIR)
            assert (await sess.call(prompt_tokens=800, max_tokens=16, sim_output_tokens=4)).output_tokens == 4
            await asyncio.sleep(1.5)  # past the grace
            name = "admission-s0"
            pid = stack.group.pids()[name]
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)  # hung, not crashed: its process runs on
            t0 = time.monotonic()
            while stack.group.pids()[name] in (pid, None):
                assert time.monotonic() - t0 < 30, "the hung admission was never replaced"
                await asyncio.sleep(0.1)
            detected = time.monotonic() - t0
            await stack.wait_healthy(30)
            r = await asyncio.wait_for(sess.call(prompt_tokens=900, prefix_tokens=820, max_tokens=16,
                                                 sim_output_tokens=5), 30)
            assert r.output_tokens == 5
            assert detected < 10, f"detected after {detected:.1f} s"
        finally:
            await client.close()
            try:
                os.kill(pid, signal.SIGCONT)  # in case it was not killed
            except OSError:
                pass


@contextlib.asynccontextmanager
async def watched_gateway(tmp_path: Path) -> AsyncIterator[tuple[EmbeddedStack, int]]:
    """A stack with its gateway under the liveness watch, past its grace: (the stack, the gateway's pid)."""
    spec = StackSpec(policy=resolve_policy("talaria"), models=[AIR], time_scale=20.0, log_dir=tmp_path / "logs",
                     liveness=True, liveness_grace_s=1.0, gateway=True)
    async with EmbeddedStack(spec) as stack:
        await asyncio.sleep(1.5)  # past the grace
        pid = stack.group.pids()["gateway"]
        assert pid is not None
        yield stack, pid


@pytest.mark.e2e
@pytest.mark.timeout(120)
async def test_a_stopped_gateway_is_killed_and_restarted(tmp_path: Path) -> None:
    """The gateway has no NATS health endpoint: the liveness watch judges it by its HTTP
    /health, and a SIGSTOPped one is replaced like any service."""
    import aiohttp

    async with watched_gateway(tmp_path) as (stack, pid):
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            while stack.group.pids()["gateway"] in (pid, None):
                assert time.monotonic() - t0 < 30, "the hung gateway was never replaced"
                await asyncio.sleep(0.1)
            detected = time.monotonic() - t0
            await stack.wait_gateway(30)
            body = {"model": AIR, "max_tokens": 4, "messages": [{"role": "user", "content": "back?"}]}
            async with aiohttp.ClientSession() as http, http.post(
                    f"{stack.openai_base_url}/chat/completions", json=body,
                    headers={"Authorization": f"Bearer {stack.api_key}"}) as r:
                assert r.status == 200, await r.text()
            assert detected < 10, f"detected after {detected:.1f} s"
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass


@pytest.mark.e2e
@pytest.mark.timeout(120)
async def test_a_gateway_slow_to_answer_is_left_alone(tmp_path: Path) -> None:
    """A gateway whose loop is busy (a burst of a thousand streams answered /health in about
    half a second) answers late, not never: it is not killed, which had cut every stream it
    relayed. Stalls of 4 s at a time (SIGSTOP, then SIGCONT for 0.5 s) stand for it: each
    ping waits for the loop to come back, as under load."""
    async with watched_gateway(tmp_path) as (stack, pid):
        try:
            for _ in range(3):
                os.kill(pid, signal.SIGSTOP)
                await asyncio.sleep(4.0)
                assert stack.group.pids()["gateway"] == pid, "a gateway slow to answer was killed as hung"
                os.kill(pid, signal.SIGCONT)
                await asyncio.sleep(0.5)
            await asyncio.sleep(2.0)
            assert stack.group.pids()["gateway"] == pid, "a gateway slow to answer was killed as hung"
        finally:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)


@pytest.mark.timeout(120)
async def test_the_container_watchdog_kills_a_stopped_service_and_exits(
        nats_server: NatsServer, redis_server: RedisServer, subject_prefix: str, key_prefix: str,
        tmp_path: Path) -> None:
    """In compose nothing replaces a stopped (SIGSTOP) service: Docker restarts only a
    container that exited. `talaria.ops.watchdog` is the container's first process:
    it kills the hung service and exits, so the restart policy replaces it."""
    import json
    import subprocess
    import sys

    import nats

    from shared.subjects import Subjects
    from talaria.ops.watchdog import HUNG_EXIT_CODE
    from test_services import ROOT, SERVER

    env = {**os.environ, "TALARIA_NATS_URL": nats_server.url, "TALARIA_REDIS_URL": redis_server.url,
           "TALARIA_SUBJECT_PREFIX": subject_prefix, "TALARIA_KEY_PREFIX": key_prefix, "TALARIA_SERVERS": SERVER,
           "TALARIA_SERVER_ID": SERVER, "TALARIA_MODELS": AIR, "TALARIA_LOG_FORMAT": "json",
           "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    err = tmp_path / "watchdog.err"
    with open(err, "wb") as f:
        # a short grace to judge the stop quickly, but the start-up its imports take (1.4 s with
        # redis-py 8's imports; the grace alone once killed it before it first answered)
        dog = subprocess.Popen([sys.executable, "-m", "talaria.ops.watchdog", "--service", "substrate", "--grace", "0.5",
                                "--startup-s", "30", "--", sys.executable, "-m", "services.substrate"],
                               env=env, stderr=f, stdout=f)
    child_pid = None
    try:
        nc = await nats.connect(nats_server.url)
        try:
            t0 = time.monotonic()
            while True:  # serving
                try:
                    await nc.request(Subjects(subject_prefix).health(f"substrate-{SERVER}"), b"", timeout=0.5)
                    break
                except Exception:
                    assert time.monotonic() - t0 < 30, err.read_text()
                    await asyncio.sleep(0.2)
        finally:
            await nc.close()
        started = [json.loads(line) for line in err.read_text().splitlines() if '"watchdog.started"' in line]
        child_pid = started[0]["child_pid"]
        await asyncio.sleep(1.0)  # past the grace, answered once
        assert dog.poll() is None
        os.kill(child_pid, signal.SIGSTOP)
        t0 = time.monotonic()
        code = await asyncio.to_thread(dog.wait, 20)
        took = time.monotonic() - t0
        assert code == HUNG_EXIT_CODE, err.read_text()
        assert took < 5, f"judged hung after {took:.1f} s"
        assert not os.path.exists(f"/proc/{child_pid}") or open(f"/proc/{child_pid}/stat").read().split()[2] == "Z"
        assert '"watchdog.hung"' in err.read_text()
    finally:
        if dog.poll() is None:
            dog.kill()
        if child_pid is not None:
            with contextlib.suppress(OSError):
                os.kill(child_pid, signal.SIGKILL)


async def test_the_watchdog_passes_a_services_own_exit_through(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = await asyncio.to_thread(subprocess.call, [sys.executable, "-m", "talaria.ops.watchdog", "--service", "gateway",
                                                    "--", sys.executable, "-c", "raise SystemExit(3)"])
    assert code == 3


@pytest.mark.e2e
@pytest.mark.timeout(180)
async def test_a_killed_redis_and_nats_are_started_again_and_calls_go_on(tmp_path: Path) -> None:
    """`talaria up` supervises its own NATS and Redis as it does the services: each comes
    back on its port (Redis empty, NATS with its JetStream store) and the services
    reconnect, where a killed one had left every call failing."""
    spec = StackSpec(policy=resolve_policy("talaria"), models=[AIR], time_scale=20.0, log_dir=tmp_path / "logs",
                     supervise_stores=True)
    async with EmbeddedStack(spec) as stack:
        client = await TalariaClient.connect(stack.nats_urls, subject_prefix=stack.subject_prefix, silence_s=10.0,
                                             retries=6, **stack.nats_auth("agent"))
        try:
            sess = await client.open_session(AIR)
            assert (await sess.call(prompt_tokens=800, max_tokens=16, sim_output_tokens=4)).output_tokens == 4
            for store in (stack.redis, stack.nats):
                assert store is not None
                pid = store.pid
                store.kill()
                t0 = time.monotonic()
                while not store.running or store.pid == pid:
                    assert time.monotonic() - t0 < 30, f"{store.log_file} was never started again"
                    await asyncio.sleep(0.1)
                await stack.wait_healthy(60)
                # (a session's state in Redis went with it: the next call opens a new one)
                fresh = await client.open_session(AIR)
                r = await asyncio.wait_for(fresh.call(prompt_tokens=900, max_tokens=16, sim_output_tokens=5), 60)
                assert r.output_tokens == 5
        finally:
            await client.close()


@pytest.mark.timeout(60)
async def test_the_watchdog_lets_a_stopped_service_drain_instead_of_judging_it_hung(tmp_path: Path) -> None:
    """`docker compose stop`: SIGTERM reaches the watchdog, which forwards it; the service
    stops answering its health checks on purpose while it drains (the gateway closes its
    listener and finishes its streams). Before, the watchdog judged that silence a hang
    and SIGKILLed the drain (a probe's 19-s stream cut after 3 s, exit 75)."""
    import subprocess
    import sys

    from shared.net import free_port

    port = free_port()
    # a stand-in gateway: answers /health until SIGTERM, then closes its listener and drains for 3 s
    child = textwrap.dedent(f"""
        import signal, sys, threading, time
        from http.server import BaseHTTPRequestHandler, HTTPServer
        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
            def log_message(self, *a): pass
        srv = HTTPServer(("127.0.0.1", {port}), H)
        def stop(*_):
            threading.Thread(target=srv.shutdown).start()
        signal.signal(signal.SIGTERM, stop)
        srv.serve_forever()
        srv.server_close()
        time.sleep(3.0)
        sys.exit(0)
    """)
    err = tmp_path / "watchdog.err"
    with open(err, "wb") as f:
        dog = subprocess.Popen([sys.executable, "-m", "talaria.ops.watchdog", "--service", "gateway", "--grace", "0.5",
                                "--startup-s", "30", "--", sys.executable, "-c", child],
                               env={**os.environ, "TALARIA_GATEWAY_PORT": str(port)}, stderr=f, stdout=f)
    try:
        from talaria.ops.healthcheck import http_check

        t0 = time.monotonic()
        while not http_check(f"http://127.0.0.1:{port}/health", 0.5)[0]:
            assert time.monotonic() - t0 < 30, err.read_text()
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.5)  # answered, past its grace: judged from here on
        assert dog.poll() is None
        dog.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        code = await asyncio.to_thread(dog.wait, 30)
        took = time.monotonic() - t0
        assert code == 0, err.read_text()
        assert took >= 2.5, took  # it waited for the drain
        assert '"watchdog.hung"' not in err.read_text()
        assert '"watchdog.stopping"' in err.read_text()
    finally:
        if dog.poll() is None:
            dog.kill()
