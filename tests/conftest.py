"""Shared pytest fixtures: an embedded NATS (JetStream) and Redis on free loopback ports.

Never the system NATS/Redis on 4222/6379: every server here is started by talaria.ops.processes.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
import redis.asyncio as aioredis
from nats.aio.client import Client as NATS

from talaria.ops.nats_server import NatsServer
from talaria.ops.redis_server import RedisServer


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    d = tmp_path_factory.mktemp("nats")
    server = NatsServer(jetstream=True, store_dir=d / "js", log_file=d / "nats.log")
    server.start(timeout=30)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    d = tmp_path_factory.mktemp("redis")
    server = RedisServer(dir=d, log_file=d / "redis.log")
    server.start(timeout=30)
    yield server
    server.stop()


@pytest.fixture
def key_prefix() -> str:
    """A per-test Redis key namespace, so tests sharing the server never collide."""
    return f"t-{uuid.uuid4().hex[:8]}:"


@pytest.fixture
def subject_prefix() -> str:
    """A per-test NATS subject token (no dots/wildcards, valid as a subject or stream name)."""
    return f"t{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[NATS]:
    client = await nats.connect(nats_server.url, connect_timeout=5)
    yield client
    await client.close()


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture
def service_logging() -> Iterator[None]:
    """For a test that configures a service's logging in this process (`configure_logging`,
    or a service object built in the test): structlog's configuration and the root
    logger's handlers as they were afterwards, since a logger left writing to this test's
    captured output fails every later test that logs (the file is closed by then)."""
    import logging

    import structlog

    saved, root = structlog.get_config(), logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        structlog.configure(**saved)
        root.handlers[:] = handlers
        root.setLevel(level)
