"""`talaria --version` and `talaria status` (against an embedded stack)."""

from __future__ import annotations

import tomllib
import os
import signal
import time
from pathlib import Path

import msgspec
import pytest

from shared.keys import Keys
from shared.net import LOOPBACK, free_port
from shared.redis_client import open_redis
from shared.policy import resolve_policy
from talaria.cli import main
from talaria.client import AgentLogin, TalariaClient
from talaria.ops import status
from talaria.ops.stack import EmbeddedStack, StackSpec

from polling import until

ROOT = Path(__file__).resolve().parents[1]


def test_version_comes_from_the_package_metadata(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out == f"talaria {version}\n"


@pytest.mark.e2e
@pytest.mark.timeout(180)
async def test_status_names_every_service_and_each_servers_active_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    models = ["glm-4.5-fp8", "glm-4.5-air-fp8"]
    # with the HTTP gateway, as `talaria up` starts it
    spec = StackSpec(policy=resolve_policy("talaria"), models=models, time_scale=50.0, log_dir=tmp_path / "logs",
                     gateway=True)
    async with EmbeddedStack(spec) as stack:
        dep = msgspec.structs.replace(stack.deployment(), operator=AgentLogin(**stack.nats_auth("operator")))
        creds = tmp_path / "credentials.json"
        dep.write(creds)
        before = await status.gather(dep)
        assert before.healthy, status.render(before)
        assert set(before.health) == {"router-0", "admission-s0", "substrate-s0", "gateway",
                                      "engine-s0-glm-4.5-fp8", "engine-s0-glm-4.5-air-fp8", "redis"}
        assert before.policy == "talaria" and before.time_scale == 50.0 and before.active == {"s0": ""}

        # the gateway is asked over HTTP (it has no health subject): one nobody serves is a failing row
        port = free_port()
        no_gateway = await status.gather(msgspec.structs.replace(dep, openai_base_url=f"http://{LOOPBACK}:{port}/v1"),
                                         timeout_s=1.0)
        assert not no_gateway.healthy
        assert no_gateway.health["gateway"] == f"unreachable at http://{LOOPBACK}:{port}/health"
        assert all(v == "ok" for k, v in no_gateway.health.items() if k != "gateway"), status.render(no_gateway)
        # a file that names no gateway: no row for one
        without = await status.gather(msgspec.structs.replace(dep, openai_base_url=None))
        assert without.healthy and "gateway" not in without.health, status.render(without)

        # one call makes a model active on s0
        client = await TalariaClient.from_deployment(stack.deployment())
        try:
            session = await client.open_session("glm-4.5-air-fp8")
            await session.call(prompt_tokens=500, max_tokens=16, sim_output_tokens=4)
            await session.end()
        finally:
            await client.close()
        after = await status.gather(dep)
        assert after.active == {"s0": "glm-4.5-air-fp8"}, status.render(after)
        text = status.render(after)
        assert "engine-s0-glm-4.5-fp8" in text and "glm-4.5-air-fp8" in text

        # an engine-worker that says it drains (a rolling restart) answers, and is not ready
        assert dep.redis_url is not None
        r = open_redis(dep.redis_url)
        engine_key = Keys(dep.key_prefix).engine("s0", "glm-4.5-fp8")
        try:
            assert await r.hget(engine_key, "state") == b"ready"  # (every engine-worker says so as it starts)
            # the embedded Redis is capped and evicts as compose's does, so a stack left up for days is bounded
            conf = dict(line.split(None, 1) for line in (ROOT / "deploy/redis/redis.conf").read_text().splitlines()
                        if line.startswith("maxmemory"))
            assert conf == {"maxmemory": "4gb", "maxmemory-policy": "volatile-lru"}
            assert (await r.config_get("maxmemory"))["maxmemory"] == str(4 * 1024 ** 3)
            assert (await r.config_get("maxmemory-policy"))["maxmemory-policy"] == "volatile-lru"
            await r.hset(engine_key, "state", "draining")
            draining = await status.gather(dep)
            await r.hset(engine_key, "state", "ready")
        finally:
            await r.aclose()
        assert draining.health["engine-s0-glm-4.5-fp8"] == "ok (draining)" and not draining.healthy, \
            status.render(draining)

        # a stopped Redis (it accepts connections and answers nothing) is a failing row, within the timeout
        assert stack.redis is not None and stack.redis.pid is not None
        os.kill(stack.redis.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            stalled = await status.gather(dep, timeout_s=1.0)
            took = time.monotonic() - t0
        finally:
            os.kill(stack.redis.pid, signal.SIGCONT)
        assert not stalled.healthy and stalled.health["redis"] == "no answer within 1 s", status.render(stalled)
        assert took < 10.0, took  # (bounded: it had waited on the stopped Redis)
        assert any(line.split() == ["gateway", "ok"] for line in text.splitlines()), text

        # the command itself: exit 0 when everything answers
        assert await _cli(["status", "--credentials", str(creds)]) == 0

        # a router that does not answer (stopped): every other service is still listed, found by its ping
        router = stack.group.pids()["router-0"]
        assert router is not None
        os.kill(router, signal.SIGSTOP)
        try:
            hung = await status.gather(dep, timeout_s=1.0)
        finally:
            os.kill(router, signal.SIGCONT)
        assert not hung.healthy and hung.health["router-*"] == "no router answers its ping", status.render(hung)
        assert {k for k, v in hung.health.items() if v == "ok"} == {
            "admission-s0", "substrate-s0", "gateway", "engine-s0-glm-4.5-fp8", "engine-s0-glm-4.5-air-fp8"}, \
            status.render(hung)

        # a service killed and restarted by the stack's supervisor: the status from the stack's own
        # folder (where `talaria up` writes its credentials) names it, how often and its exit code;
        # it had said `ok` alone, and a crash loop between two looks went unseen
        in_folder = stack.log_dir / "credentials.json"
        dep.write(in_folder)
        capsys.readouterr()
        assert await _cli(["status", "--credentials", str(in_folder)]) == 0
        assert "restarted" not in capsys.readouterr().out
        admission = stack.group.pids()["admission-s0"]
        assert admission is not None
        os.kill(admission, signal.SIGKILL)
        await until(lambda: stack.group.children["admission-s0"].restarts == 1, 10)
        await stack.wait_healthy(30)
        assert await _cli(["status", "--credentials", str(in_folder)]) == 0
        out = capsys.readouterr().out
        assert "admission-s0: 1 time(s), last exit code -9 at " in out, out
    # the stack is gone: the status is a clean failure, not a traceback
    down = await status.gather(dep, timeout_s=1.0)
    assert not down.healthy and down.problems


async def _cli(argv: list[str]) -> int:
    import asyncio

    return await asyncio.to_thread(main, argv)


@pytest.mark.e2e
@pytest.mark.timeout(180)
async def test_the_agent_example_runs_against_a_stack(tmp_path: Path) -> None:
    import asyncio
    import sys

    spec = StackSpec(policy=resolve_policy("talaria"), models=["glm-4.5-air-fp8"], time_scale=50.0,
                     log_dir=tmp_path / "logs")
    async with EmbeddedStack(spec) as stack:
        creds = tmp_path / "credentials.json"
        stack.deployment().write(creds)
        for extra in ([], ["--tokens"]):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, str(ROOT / "examples" / "agent.py"), "--credentials", str(creds), "--calls", "2", *extra,
                cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 120)
            assert proc.returncode == 0, err.decode()[-2000:]
            lines = out.decode().splitlines()
            assert [ln.split(":")[0] for ln in lines] == ["call 0", "call 1"], lines
            if not extra:
                assert "text=None" in lines[0]  # the sim engine says how long, not what


def test_status_says_a_stack_is_still_starting_until_it_writes_its_credentials(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`talaria up` writes its credentials once every service answers (a real engine: after
    loading its weights); before, status said only that it could not read the file."""
    from talaria.ops.stack import lock_log_dir

    creds = tmp_path / "up" / "credentials.json"
    assert main(["status", "--credentials", str(creds)]) == 2  # nothing runs there: a usage error
    assert f"no `talaria up` runs from {creds.parent}" in capsys.readouterr().err  # (not "cannot read the file")
    fd = lock_log_dir(tmp_path / "up")  # (a stack starting from that folder holds it)
    try:
        assert main(["status", "--credentials", str(creds)]) == 1  # not ready yet: a script waits on it
        assert f"talaria up (pid {os.getpid()}) is still starting: not ready" in capsys.readouterr().err
    finally:
        os.close(fd)
    assert main(["status", "--credentials", str(creds)]) == 2
    creds.write_text("{not json")  # a file there that is no credentials file: named as such
    assert main(["status", "--credentials", str(creds)]) == 2
    assert "credentials" in capsys.readouterr().err


def test_status_says_a_stack_is_stopping_and_that_a_killed_ones_credentials_are_stale(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """While `talaria up` stops, status said "still starting" (its credentials are gone
    first); after a SIGKILL, its credentials stay behind and status tried to connect."""
    from talaria.client import Deployment
    from talaria.ops.stack import EmbeddedStack, StackSpec

    folder = tmp_path / "up"
    creds = folder / "credentials.json"
    stack = EmbeddedStack(StackSpec(policy=resolve_policy("talaria"), log_dir=folder))
    stack.claim_log_dir()
    try:
        stack.mark_stopping()
        assert main(["status", "--credentials", str(creds)]) == 1
        assert f"talaria up (pid {os.getpid()}) is stopping: not ready" in capsys.readouterr().err
    finally:
        os.close(stack._lock_fd)  # type: ignore[arg-type]
    # a stack killed where it stood: its lock let go, its credentials file left
    Deployment(nats_urls=[f"nats://{LOOPBACK}:{free_port()}"], subject_prefix="t", key_prefix="t").write(creds)
    t0 = time.monotonic()
    assert main(["status", "--credentials", str(creds)]) == 2
    assert "no talaria up runs from" in capsys.readouterr().err and time.monotonic() - t0 < 1.0
