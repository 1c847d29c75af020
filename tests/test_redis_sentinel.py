"""A Sentinel-watched Redis (`redis+sentinel://` in TALARIA_REDIS_URL): the URL's parsing,
a client that follows a failover within the services' outage budget, and the whole
stack replaying a trace while its Redis master is killed and a replica promoted."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from redis.backoff import ExponentialBackoff

from shared.bus import REDIS_AWAY, REDIS_OUTAGE_WAIT_S, BoundedRetry
from shared.policy import resolve_policy
from shared.redis_client import RedisUrlError, check_target, open_redis, parse_redis_url, redacted
from shared.settings import Settings, SettingsError
from talaria.ops.nats_server import NatsServer
from talaria.ops.redis_server import RedisServer, RedisSentinel
from talaria.ops.stack import EmbeddedStack, StackSpec, StackStartError
from talaria.workload.trace import load_trace

from replaying import replay_with_a_fault

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "traces" / "smoke-4.jsonl"


def test_a_sentinel_url_names_its_sentinels_master_and_database() -> None:
    t = parse_redis_url("redis+sentinel://talaria:s%40cret@10.0.0.1:26379,10.0.0.2,[::1]:26380/main/2"
                        "?sentinel_password=x")
    assert t.kind == "sentinel"
    assert t.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26379), ("::1", 26380))
    assert (t.service, t.db, t.username, t.password, t.sentinel_password) == ("main", 2, "talaria", "s@cret", "x")
    assert parse_redis_url("redis://h:6379/0").kind == "node"
    assert parse_redis_url("unix:///run/redis.sock").kind == "node"
    assert redacted("redis+sentinel://u:secret@h1,h2/main") == "redis+sentinel://u:***@h1,h2/main"


@pytest.mark.parametrize("url, says", [
    ("redis+sentinel://h1:26379/", "master name"),
    ("redis+sentinel://h1:26379/main/zero", "must be a number"),
    ("redis+sentinel:///main", "at least one sentinel"),
    ("redis+sentinel://h1:99999/main", "host[:port]"),
    ("redis+sentinel://h1/main?master=x", "unknown option"),
    ("http://h1:6379/0", "scheme"),
    ("redis://u:pw@h1:26379,h2:26379/main", "several sentinels"),
])
def test_a_bad_redis_url_is_refused_at_start_saying_why(url: str, says: str) -> None:
    with pytest.raises(RedisUrlError, match=says.replace("[", r"\[").replace("]", r"\]")):
        parse_redis_url(url)
    with pytest.raises(SettingsError, match="TALARIA_REDIS_URL"):
        Settings.from_env([], env={"TALARIA_REDIS_URL": url})
    assert "pw" not in str(pytest.raises(RedisUrlError, parse_redis_url, url).value)


def test_a_password_in_a_refused_url_is_not_repeated() -> None:
    with pytest.raises(RedisUrlError) as err:
        parse_redis_url("redis+sentinel://u:hunter2@h1/")
    assert "hunter2" not in str(err.value)


class SentinelRedis:
    """A master, its replica and one sentinel (quorum 1, the master down after 1 s), with an
    ACL user as compose's Redis has (the replica and the sentinel log in as it)."""

    def __init__(self, tmp_path: Path) -> None:
        users = {"talaria": "pw-with-@-and-:"}
        self.master = RedisServer(acl_users=users, log_file=tmp_path / "redis-master.log")
        self.master.start()
        self.replica = RedisServer(acl_users=users, replica_of=self.master.port,
                                   log_file=tmp_path / "redis-replica.log")
        self.replica.start()
        self.sentinel = RedisSentinel(self.master, "talaria", log_file=tmp_path / "redis-sentinel.log")
        self.sentinel.start()

    def wait_replicated(self, timeout_s: float = 15.0) -> None:
        """Until the sentinel knows the replica (it finds replicas through the master every few
        seconds; a failover before that has nobody to promote)."""
        import redis

        deadline = time.monotonic() + timeout_s
        def good(replica: dict) -> bool:  # (what SENTINEL FAILOVER asks of a replica it promotes)
            return replica.get("is_slave") and not replica.get("is_sdown") and not replica.get("is_disconnected") \
                and replica.get("master-link-status") == "ok"

        with redis.Redis(port=self.sentinel.port, socket_timeout=2) as s:
            while not any(good(r) for r in s.sentinel_slaves("talaria")):
                assert time.monotonic() < deadline, f"the sentinel never saw the replica: {s.sentinel_slaves('talaria')}"
                time.sleep(0.2)

    def kill_master(self) -> None:
        assert self.master.pid is not None
        os.kill(self.master.pid, signal.SIGKILL)

    def stop(self) -> None:
        for server in (self.sentinel, self.replica, self.master):
            try:
                server.stop()
            except Exception:  # noqa: BLE001 - the killed master: nothing left to stop
                pass


@pytest.fixture
def sentinel_redis(tmp_path: Path):  # type: ignore[no-untyped-def]
    ha = SentinelRedis(tmp_path)
    try:
        ha.wait_replicated()
        yield ha
    finally:
        ha.stop()


@pytest.mark.timeout(90)
async def test_a_services_client_follows_a_failover_within_its_outage_budget(sentinel_redis: SentinelRedis) -> None:
    """The services' pool and retry (shared/bus.py) over a Sentinel URL: a command made
    just after the master dies is answered by the promoted replica, within the budget a
    command waits out a Redis restart. redis-py's own sentinel connection retried the
    dead master's address for the whole budget and failed."""
    client = open_redis(sentinel_redis.sentinel.url, max_connections=8, pool_wait_s=5.0, socket_timeout=2.0,
                        retry=BoundedRetry(ExponentialBackoff(cap=0.5, base=0.05), retries=30,
                                           budget_s=REDIS_OUTAGE_WAIT_S),
                        retry_on_error=list(REDIS_AWAY))
    try:
        assert await client.incr("count") == 1
        sentinel_redis.kill_master()
        began = time.monotonic()
        assert await client.incr("count") >= 1  # (what the dead master had not replicated may be lost)
        took = time.monotonic() - began
        assert took < REDIS_OUTAGE_WAIT_S, took
        assert sentinel_redis.sentinel.master_port() == sentinel_redis.replica.port
        for _ in range(20):  # the pool's other connections go to the new master too
            await asyncio.gather(*(client.incr("count") for _ in range(8)))
    finally:
        await client.aclose()


@pytest.mark.timeout(240)
async def test_the_stack_replays_a_trace_through_a_redis_failover(tmp_path: Path, sentinel_redis: SentinelRedis) -> None:
    """Every service on `redis+sentinel://`; the master SIGKILLed mid-replay: every call
    answered once, the replica serving the rest."""
    sessions = load_trace(SMOKE)
    models = sorted({s.model for s in sessions})
    spec = StackSpec(policy=resolve_policy("talaria"), models=models, time_scale=10.0, log_dir=tmp_path,
                     redis_url=sentinel_redis.sentinel.url)
    async with EmbeddedStack(spec) as stack:
        out = await replay_with_a_fault(stack, sessions, sentinel_redis.kill_master, after_calls=6, timeout_s=180)
    assert sentinel_redis.sentinel.master_port() == sentinel_redis.replica.port
    total = sum(len(s.calls) for s in sessions)
    assert not out.failures, out.failures
    assert len(out.records) == total
    assert len({r.call_id for r in out.records}) == total


@pytest.fixture
def cluster_node(tmp_path: Path):  # type: ignore[no-untyped-def]
    node = RedisServer(extra_config=("cluster-enabled yes", f"cluster-config-file nodes-{os.getpid()}.conf"),
                       log_file=tmp_path / "redis-cluster-node.log")
    node.start()
    try:
        yield node
    finally:
        node.stop()


async def test_a_redis_cluster_node_is_refused_at_start_by_name(tmp_path: Path, cluster_node: RedisServer) -> None:
    """Talaria's transactions span slots, and its client follows no MOVED: a cluster node is
    refused once, by name, by the stack's check and by each service, instead of every
    write failing (a probe saw admission crash-loop on MOVED, and with a cluster client
    every engine finish dropped as a cross-slot transaction)."""
    client = open_redis(cluster_node.url)
    try:
        with pytest.raises(RedisUrlError, match="Redis Cluster node"):
            await check_target(client, cluster_node.url)
    finally:
        await client.aclose()
    spec = StackSpec(policy=resolve_policy("talaria"), models=["glm-4.5"], time_scale=10.0, log_dir=tmp_path,
                     redis_url=cluster_node.url)
    with pytest.raises(StackStartError, match="Redis Cluster node"):
        async with EmbeddedStack(spec):
            pass
    plain = RedisServer(log_file=tmp_path / "redis-plain.log")  # one node: let through
    plain.start()
    try:
        ok = open_redis(plain.url)
        await check_target(ok, plain.url)
        await ok.aclose()
    finally:
        plain.stop()


@pytest.mark.timeout(60)
def test_a_service_pointed_at_a_redis_cluster_stays_down_saying_why(nats_server: NatsServer,
                                                                    cluster_node: RedisServer) -> None:
    env = {**os.environ, "TALARIA_NATS_URL": nats_server.url, "TALARIA_REDIS_URL": cluster_node.url,
           "TALARIA_SERVERS": "s0", "TALARIA_SERVER_ID": "s0", "TALARIA_METRICS_PORT": "0",
           "TALARIA_SUBJECT_PREFIX": f"t{os.getpid()}"}
    done = subprocess.run([sys.executable, "-m", "services.router"], env=env, capture_output=True, text=True,
                          timeout=45, cwd=ROOT)
    assert done.returncode == 78, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert "service.redis_unsupported" in done.stdout + done.stderr
    assert "Redis Cluster node" in done.stdout + done.stderr


@pytest.mark.timeout(90)
async def test_a_clean_failover_moves_every_write_to_the_new_master_within_seconds(
        sentinel_redis: SentinelRedis) -> None:
    """`SENTINEL FAILOVER`: the old master answers writes until the sentinel demotes it
    (about 10 s), and its resync then drops them (a probe lost stored responses so). The
    services' pool asks the sentinels every MASTER_RECHECK_S, so writes made 2 s after the
    switch land on the new master."""
    import redis

    client = open_redis(sentinel_redis.sentinel.url, max_connections=8, pool_wait_s=5.0, socket_timeout=2.0,
                        retry=BoundedRetry(ExponentialBackoff(cap=0.5, base=0.05), retries=30,
                                           budget_s=REDIS_OUTAGE_WAIT_S),
                        retry_on_error=list(REDIS_AWAY))
    user, pw = next(iter(sentinel_redis.master.acl_users.items()))
    try:
        await asyncio.gather(*(client.set(f"warm{i}", 1) for i in range(8)))  # (the pool's connections open)
        with redis.Redis(port=sentinel_redis.sentinel.port, socket_timeout=5) as s:
            for _ in range(50):  # (a replica is promotable once the sentinel has its INFO since its link came up)
                try:
                    s.execute_command("SENTINEL", "FAILOVER", "talaria")
                    break
                except redis.ResponseError as exc:
                    assert "NOGOODSLAVE" in str(exc), exc
                    await asyncio.sleep(0.2)
        t0 = time.monotonic()
        while sentinel_redis.sentinel.master_port() != sentinel_redis.replica.port:
            assert time.monotonic() - t0 < 20, "no failover"
            await asyncio.sleep(0.1)
        switched = time.monotonic()
        written = []
        while time.monotonic() - switched < 3.0:
            key = f"after{len(written)}"
            await asyncio.gather(*(client.set(f"{key}-{j}", 1) for j in range(4)))
            written.append((time.monotonic() - switched, key))
            await asyncio.sleep(0.1)
        with redis.Redis(port=sentinel_redis.replica.port, username=user, password=pw, socket_timeout=5) as new:
            late = [key for at, key in written if at >= 2.0]
            assert late and all(new.exists(f"{key}-{j}") for key in late for j in range(4)), late
    finally:
        await client.aclose()


@pytest.mark.timeout(60)
async def test_a_sentinel_or_a_missing_database_named_as_redis_is_refused_by_name(
        tmp_path: Path, sentinel_redis: SentinelRedis) -> None:
    user, pw = next(iter(sentinel_redis.master.acl_users.items()))
    for url, says in ((f"redis://127.0.0.1:{sentinel_redis.sentinel.port}/0", "is a Sentinel"),
                      (f"redis://{user}:{pw}@127.0.0.1:{sentinel_redis.master.port}/99", "DB index")):
        client = open_redis(url)
        try:
            with pytest.raises(RedisUrlError, match=says):
                await check_target(client, url)
        finally:
            await client.aclose()
    # the sentinels asked one by one: which of them said what, in a line
    wrong_name = sentinel_redis.sentinel.url.replace("/talaria", "/nosuchname")
    spec = StackSpec(policy=resolve_policy("talaria"), models=["glm-4.5-air-fp8"], time_scale=10.0,
                     log_dir=tmp_path / "wrong-name", redis_url=wrong_name)
    with pytest.raises(StackStartError, match="does not watch a master named 'nosuchname'") as err:
        async with EmbeddedStack(spec):
            pass
    assert len(str(err.value)) < 300 and pw not in str(err.value)


@pytest.mark.timeout(120)
async def test_an_external_redis_leaves_the_embedded_nats_authenticated(tmp_path: Path) -> None:
    """`talaria up --redis URL` had started its own NATS open to anyone (no credentials
    were made unless both stores were its own)."""
    import nats

    plain = RedisServer(log_file=tmp_path / "redis.log")
    plain.start()
    try:
        spec = StackSpec(policy=resolve_policy("talaria"), models=["glm-4.5-air-fp8"], time_scale=10.0,
                         log_dir=tmp_path / "logs", redis_url=plain.url)
        async with EmbeddedStack(spec) as stack:
            assert stack.creds is not None
            with pytest.raises(Exception):
                await nats.connect(stack.nats_urls, connect_timeout=2, max_reconnect_attempts=0,
                                   allow_reconnect=False)
            nc = await nats.connect(stack.nats_urls, **stack.nats_auth("agent"))
            await nc.close()
    finally:
        plain.stop()
