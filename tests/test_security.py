"""Authentication and authorisation against a real NATS and Redis: nobody
unauthenticated gets on the bus or into the store, and an agent cannot use a
service's subjects."""

from __future__ import annotations

import asyncio

import nats
import nats.js.errors
import pytest
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, ResponseError

from shared.auth import ROLES, generate_credentials, nats_permissions
from shared.subjects import AGENT_NAMESPACE, GATEWAY_NAMESPACE, Subjects, inbox_prefix
from talaria.ops.nats_server import NatsServer
from talaria.ops.redis_server import RedisServer

PREFIX = "sec"


@pytest.fixture(scope="module")
def creds():
    return generate_credentials()


@pytest.fixture(scope="module")
def secure_nats(creds, tmp_path_factory):
    srv = NatsServer(users=creds.nats_users(), permissions=nats_permissions(PREFIX),
                     store_dir=tmp_path_factory.mktemp("natssec"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def secure_redis(creds, tmp_path_factory):
    srv = RedisServer(acl_users={creds.redis_user: creds.redis_password}, password="not-for-clients",
                      dir=tmp_path_factory.mktemp("redissec"))
    srv.start()
    yield srv
    srv.stop()


async def connect(server: NatsServer, role: str | None, creds, errors: list | None = None):
    async def on_error(e: Exception) -> None:
        if errors is not None:
            errors.append(e)

    kw: dict = {"user": role, "password": creds.nats[role]} if role else {}
    if role in (AGENT_NAMESPACE, GATEWAY_NAMESPACE):  # agent-facing users hear requests' answers in their own inboxes
        kw["inbox_prefix"] = inbox_prefix(role)
    return await nats.connect(server.plain_url, allow_reconnect=False, connect_timeout=3, error_cb=on_error, **kw)


async def test_unauthenticated_client_is_refused(secure_nats: NatsServer, creds) -> None:
    with pytest.raises(Exception) as exc:
        await connect(secure_nats, None, creds)
    assert "authorization" in str(exc.value).lower() or isinstance(exc.value, (nats.errors.NoServersError,))


async def test_wrong_password_is_refused(secure_nats: NatsServer, creds) -> None:
    with pytest.raises(Exception):
        await nats.connect(secure_nats.plain_url, user="agent", password="guess", allow_reconnect=False, connect_timeout=3)


@pytest.mark.parametrize("subject", [f"{PREFIX}.admission.s0.submit", f"{PREFIX}.engine.s0.m.run",
                                     f"{PREFIX}.substrate.s0.switch", f"{PREFIX}.events.s0.finished"])
async def test_agent_cannot_publish_to_service_subjects(secure_nats: NatsServer, creds, subject: str) -> None:
    role_for = {"admission": "admission", "engine": "engine", "substrate": "substrate", "events": "admission"}
    listener = await connect(secure_nats, role_for[subject.split(".")[1]], creds)
    got: list = []

    async def record(msg) -> None:
        got.append(msg)

    sub = await listener.subscribe(subject, cb=record)
    await listener.flush()
    errors: list = []
    agent = await connect(secure_nats, "agent", creds, errors)
    try:
        await agent.publish(subject, b'{"type":"submit"}')
        await agent.flush()
        await asyncio.sleep(0.3)
        assert got == []  # never delivered
        assert any("permissions violation" in str(e).lower() for e in errors), errors
    finally:
        await sub.unsubscribe()
        await agent.close()
        await listener.close()


async def test_agent_cannot_read_other_replies_or_service_traffic(secure_nats: NatsServer, creds) -> None:
    errors: list = []
    agent = await connect(secure_nats, "agent", creds, errors)
    try:
        await agent.subscribe(f"{PREFIX}.engine.>")
        await agent.subscribe(f"{PREFIX}.reply.other-tenant.>")
        await agent.flush()
        await asyncio.sleep(0.3)
        assert sum("permissions violation" in str(e).lower() for e in errors) >= 2, errors
    finally:
        await agent.close()


async def test_agent_may_call_the_api_and_hear_its_replies(secure_nats: NatsServer, creds) -> None:
    router = await connect(secure_nats, "router", creds)
    errors: list = []
    agent = await connect(secure_nats, "agent", creds, errors)
    try:
        async def answer(msg) -> None:
            await router.publish(f"{PREFIX}.reply.agent.c1.x", b"done")
            await msg.respond(b"ok")

        await router.subscribe(Subjects(PREFIX).api_call("*"), cb=answer)
        await router.flush()
        inbox = await agent.subscribe(f"{PREFIX}.reply.agent.c1.>")
        await agent.flush()
        for _ in range(20):  # the router's interest may take a moment to register on a busy machine
            try:
                resp = await agent.request(Subjects(PREFIX).api_call(AGENT_NAMESPACE), b"{}", timeout=3)
                break
            except nats.errors.NoRespondersError:
                await asyncio.sleep(0.1)
        else:
            raise AssertionError("the router's subscription never became visible to the agent")
        assert resp.data == b"ok"
        msg = await inbox.next_msg(timeout=3)
        assert msg.data == b"done" and errors == []
    finally:
        await agent.close()
        await router.close()


def test_every_role_has_an_allow_list() -> None:
    perms = nats_permissions("p")
    assert set(perms) == set(ROLES)
    for role, p in perms.items():
        assert p["publish"] and p["subscribe"], role
        assert ">" not in p["publish"] and ">" not in p["subscribe"], role  # no wildcard-everything
    # agents and the gateway: requests only under their own namespace (and the shared info),
    # the rest is their own prompt store
    for ns in (AGENT_NAMESPACE, GATEWAY_NAMESPACE):
        assert perms[ns]["publish"][:2] == [f"p.api.{ns}.>", "p.api.info"]
        assert all(f"p_prompts_{ns}" in x for x in perms[ns]["publish"][2:]), perms[ns]["publish"]


async def test_prompts_by_reference_each_namespace_writes_its_own_and_only_engines_read(
        secure_nats: NatsServer, creds) -> None:
    """The router creates the prompt stores; an agent puts a prompt in its own namespace's
    and not in the gateway's; the engine reads and deletes it."""
    from shared.prompt_store import PromptStore, PromptStoreUnavailable, encode_payload
    from shared.schema import PromptPayload, PromptRef

    router = await connect(secure_nats, "router", creds)
    agent = await connect(secure_nats, "agent", creds)
    engine = await connect(secure_nats, "engine", creds)
    try:
        await PromptStore(router, PREFIX).create([AGENT_NAMESPACE, GATEWAY_NAMESPACE], replicas=1, ttl_s=60,
                                                 max_bytes=64 * 1024 * 1024)
        data = encode_payload(PromptPayload(prompt_text="x" * 300_000, prompt_token_ids=list(range(1000))))
        mine = PromptStore(agent, PREFIX, deadline_s=2.0)
        await mine.put(AGENT_NAMESPACE, "obj1", data)
        with pytest.raises((PromptStoreUnavailable, nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError)):
            await mine.put(GATEWAY_NAMESPACE, "obj2", data)  # another namespace's store: refused
        reader = PromptStore(engine, PREFIX, deadline_s=5.0)
        got = await reader.get(PromptRef(namespace=AGENT_NAMESPACE, name="obj1"))
        assert got is not None and got.prompt_token_ids == list(range(1000)) and len(got.prompt_text or "") == 300_000
        await reader.delete(PromptRef(namespace=AGENT_NAMESPACE, name="obj1"))
        assert await reader.get(PromptRef(namespace=AGENT_NAMESPACE, name="obj1")) is None
        assert await reader.get(PromptRef(namespace=GATEWAY_NAMESPACE, name="obj2")) is None
    finally:
        for nc in (agent, engine, router):
            await nc.close()


async def test_an_agent_cannot_act_or_listen_in_the_gateways_namespace(secure_nats: NatsServer, creds) -> None:
    """The NATS agent and the HTTP gateway (all HTTP tenants) are apart: the agent can neither
    publish a call, an end or a cancel under the gateway's namespace, nor hear its replies or
    its inboxes; the gateway, likewise, not the agent's."""
    s = Subjects(PREFIX)
    router = await connect(secure_nats, "router", creds)
    got: list = []

    async def record(msg) -> None:
        got.append(msg.subject)

    for subject in s.api_requests + [s.call_cancel_any]:
        await router.subscribe(subject, cb=record)
    await router.flush()
    for me, other in ((AGENT_NAMESPACE, GATEWAY_NAMESPACE), (GATEWAY_NAMESPACE, AGENT_NAMESPACE)):
        errors: list = []
        nc = await connect(secure_nats, me, creds, errors)
        try:
            for subject in (s.api_call(other), s.api_session_end(other), s.call_cancel(other)):
                await nc.publish(subject, b"{}")
            await nc.subscribe(f"{s.reply_namespace(other)}.>")
            await nc.subscribe(f"{inbox_prefix(other)}.>")
            await nc.subscribe("_INBOX.>")
            await nc.publish(s.api_call(me), b"{}")  # its own: allowed
            await nc.flush()
            await asyncio.sleep(0.3)
            violations = [e for e in errors if "permissions violation" in str(e).lower()]
            assert len(violations) >= 6, errors
            assert got == [s.api_call(me)], got
            got.clear()
        finally:
            await nc.close()
    await router.close()


async def test_redis_refuses_unauthenticated_and_wrong_password(secure_redis: RedisServer, creds) -> None:
    anon = aioredis.Redis(host="127.0.0.1", port=secure_redis.port)
    with pytest.raises((AuthenticationError, ResponseError)):
        await anon.set("k", "v")
    await anon.aclose()
    bad = aioredis.Redis(host="127.0.0.1", port=secure_redis.port, username=creds.redis_user, password="guess")
    with pytest.raises((AuthenticationError, ResponseError)):
        await bad.ping()
    await bad.aclose()
    good = aioredis.Redis.from_url(secure_redis.url)
    assert await good.set("k", "v") and await good.get("k") == b"v"
    await good.aclose()


async def test_agent_client_fails_fast_on_a_refused_login(secure_nats: NatsServer, creds) -> None:
    """The agent client retries a lost connection forever, but not a first
    connection whose login is refused: that is a ConnectionError at once."""
    from talaria.client import TalariaClient

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(ConnectionError, match="login refused"):
        await TalariaClient.connect(secure_nats.plain_url, user="agent", password="guess", connect_timeout_s=30)
    assert loop.time() - t0 < 10
    ok = await TalariaClient.connect(secure_nats.plain_url, user="agent", password=creds.nats["agent"])
    await ok.close()
