"""Where Redis is and how to reach it: one node, or a master found through Sentinel.

`TALARIA_REDIS_URL` names either

- one node: `redis://[user:password@]host:port[/db]` (also `rediss://`, `unix://`), or
- a Sentinel-watched master: `redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]`,
  the hosts being the sentinels and `service` the master's name in their
  `sentinel monitor` line. The credentials are the master's (as `TALARIA_REDIS_USER`
  and `TALARIA_REDIS_PASSWORD` are); sentinels that ask for their own take
  `?sentinel_username=...&sentinel_password=...`.

With Sentinel a client asks the sentinels for the master at every connect and, while
busy, once a second, and a connection to a master that was demoted fails (redis-py's
`SentinelManagedConnection`), so after a failover the next retry of a command reaches the
promoted replica: the services' bounded retries (`shared/bus.py`) wait a failover out as
they wait out a restart. `check_target` refuses at start what Talaria cannot use (a
Redis Cluster node, a sentinel named as a Redis, a database the server lacks).
Redis holds soft state only (`shared/keys.py`), so the writes a failover loses (Redis
replicates asynchronously) are rebuilt like any lost soft state.
"""

from __future__ import annotations

import contextlib
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Literal

import redis.asyncio as aioredis
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.exceptions import AuthenticationError, ResponseError

SENTINEL_SCHEME = "redis+sentinel"
NODE_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_PORT = 26379
# how often a busy pool asks the sentinels whether the master moved: after a clean failover
# (SENTINEL FAILOVER) the old master answers writes until the sentinels demote it, about 10 s,
# and its resync then drops them (a probe lost stored responses so)
MASTER_RECHECK_S = 1.0


class RedisUrlError(ValueError):
    """A `TALARIA_REDIS_URL` that names no Redis this module can reach; the message says why."""


@dataclass(frozen=True, slots=True)
class RedisTarget:
    kind: Literal["node", "sentinel"]
    url: str                                   # as given (a node's is handed to redis-py as is)
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str = ""                          # the master's name at the sentinels
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None


def login(username: str | None, password: str | None) -> dict[str, str]:
    """redis-py's `username`/`password` keywords, those that are set."""
    return {k: v for k, v in (("username", username), ("password", password)) if v}


def redacted(url: str) -> str:
    """`url` with any password hidden, for logs and error messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def parse_redis_url(url: str) -> RedisTarget:
    """What `url` names, or RedisUrlError saying what is wrong with it."""
    parts = urllib.parse.urlsplit(url.strip())
    scheme = parts.scheme.lower()
    if scheme in NODE_SCHEMES:
        try:
            parts.port  # (redis-py's own parse fails later, with a traceback)
        except ValueError as exc:
            hint = (f" (several sentinels: {SENTINEL_SCHEME}://host:port,host:port/<master name>)"
                    if "," in parts.netloc else "")
            raise RedisUrlError(f"Redis URL {redacted(url)!r}: {exc}{hint}") from None
        return RedisTarget(kind="node", url=url.strip())
    if scheme != SENTINEL_SCHEME:
        raise RedisUrlError(f"Redis URL {redacted(url)!r}: the scheme must be one of "
                            f"{', '.join(NODE_SCHEMES + (SENTINEL_SCHEME,))}, not {parts.scheme or 'none'!r}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    sentinels: list[tuple[str, int]] = []
    for item in filter(None, (h.strip() for h in hosts.split(","))):
        try:
            node = urllib.parse.urlsplit("//" + item)
            host, port = node.hostname, node.port or SENTINEL_PORT
        except ValueError:
            host = None
        if not host:
            raise RedisUrlError(f"Redis URL {redacted(url)!r}: {item!r} is not a sentinel's host[:port]")
        sentinels.append((host, port))
    if not sentinels:
        raise RedisUrlError(f"Redis URL {redacted(url)!r}: name at least one sentinel (host:port)")
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise RedisUrlError(f"Redis URL {redacted(url)!r}: the path must be /<master name>[/<db>], "
                            f"the name the sentinels monitor the master by")
    if len(path) == 2 and not path[1].isdigit():
        raise RedisUrlError(f"Redis URL {redacted(url)!r}: the database must be a number, not {path[1]!r}")
    user, _, password = userinfo.partition(":")
    query = urllib.parse.parse_qs(parts.query)

    def one(name: str) -> str | None:
        values = query.get(name)
        return values[-1] if values else None

    unknown = set(query) - {"sentinel_username", "sentinel_password"}
    if unknown:
        raise RedisUrlError(f"Redis URL {redacted(url)!r}: unknown option(s) {', '.join(sorted(unknown))} "
                            f"(known: sentinel_username, sentinel_password)")
    return RedisTarget(
        kind="sentinel", url=url.strip(), sentinels=tuple(sentinels), service=urllib.parse.unquote(path[0]),
        db=int(path[1]) if len(path) == 2 else 0,
        username=urllib.parse.unquote(user) or None, password=urllib.parse.unquote(password) or None,
        sentinel_username=one("sentinel_username"), sentinel_password=one("sentinel_password"))


class SentinelMasterConnection(SentinelManagedConnection):
    """A connection that asks the sentinels for the master at every connect, its retries'
    included. redis-py's asks only at a connection's first connect, and a command's
    retries reconnect the same connection to the address it had: after a failover they
    knocked on the dead master until their budget ran out (30 s here; redis-py's open
    upstream issue "SentinelConnectionPool does not retrieve updated master address
    from Sentinel on connection retries")."""

    async def _connect(self) -> None:
        if self.connection_pool.is_master:
            self.host, self.port = await self.connection_pool.get_master_address()
        await super()._connect()


class BlockingSentinelConnectionPool(SentinelConnectionPool, BlockingConnectionPool):
    """Sentinel's master-finding pool that waits for a free connection when all are in use
    (as the services' one-node pool does), instead of refusing the command; and that asks
    the sentinels every MASTER_RECHECK_S whether the master moved, handing out no
    connection still open to the one before (redis-py asks only when a connection opens)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recheck_at = 0.0

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        if self.is_master and time.monotonic() >= self.recheck_at:
            self.recheck_at = time.monotonic() + MASTER_RECHECK_S
            with contextlib.suppress(Exception):  # (sentinels away or electing: keep what we have)
                await self.get_master_address()  # (on a change it closes the idle connections)
        conn = await super().get_connection(*args, **kwargs)
        if (self.is_master and self.master_address is not None and conn.is_connected
                and (conn.host, conn.port) != self.master_address):
            await conn.disconnect()  # (it was in use at the change: it reconnects to the new master)
        return conn


def open_redis(url: str, *, username: str | None = None, password: str | None = None,
               max_connections: int | None = None, pool_wait_s: float | None = None,
               **options: Any) -> aioredis.Redis:
    """A client of the Redis `url` names. `username`/`password` (the settings' credentials)
    apply where the URL carries none; `max_connections` with `pool_wait_s` bound the pool,
    a command waiting up to that long for a free connection; `options` are redis-py's
    connection keywords (timeouts, retry)."""
    target = parse_redis_url(url)
    creds = login(username, password)
    pooled = max_connections is not None
    if target.kind == "node":
        if pooled:
            pool = BlockingConnectionPool.from_url(target.url, max_connections=max_connections,
                                                   timeout=pool_wait_s, **creds, **options)
            return aioredis.Redis.from_pool(pool)  # (closing the client closes its pool)
        return aioredis.Redis.from_url(target.url, **creds, **options)
    creds = login(target.username, target.password) or creds  # (the URL's login first, as redis-py's own)
    sentinel_kwargs: dict[str, Any] = {k: v for k, v in options.items() if k.startswith("socket_")}
    sentinel_kwargs.update(login(target.sentinel_username, target.sentinel_password))
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=sentinel_kwargs)
    pool: dict[str, Any] = dict(connection_pool_class=BlockingSentinelConnectionPool, max_connections=max_connections,
                                timeout=pool_wait_s) if pooled else {}
    return sentinel.master_for(target.service, connection_class=SentinelMasterConnection, db=target.db,
                               **pool, **creds, **options)


async def check_target(client: aioredis.Redis, url: str) -> None:
    """RedisUrlError where `url` leads somewhere Talaria cannot keep its state, said once
    at start, by name, instead of a service failing on every write or crash-looping:
    a Redis Cluster node (Talaria's transactions put one session's keys beside the
    server's in one MULTI, which a cluster refuses across slots; a probe saw MOVED
    crash loops), a sentinel named as a Redis (every command unknown to it), or a
    database the server does not have. A Redis that does not answer or does not
    allow INFO is let through (the commands that follow say what is wrong)."""
    try:
        info = await client.info()
    except ResponseError as exc:
        if "DB index" in str(exc):
            raise RedisUrlError(f"Redis at {redacted(url)}: {exc} (its `databases` setting bounds the "
                                f"index in the URL's path)") from None
        return
    except Exception:  # noqa: BLE001 - away, or INFO not allowed to this user: not this check's business
        return
    if info.get("redis_mode") == "sentinel":
        raise RedisUrlError(f"Redis at {redacted(url)} is a Sentinel, not a Redis: name it as "
                            f"{SENTINEL_SCHEME}://host:port/<master name> (docs/deploy.md)")
    if info.get("cluster_enabled"):
        raise RedisUrlError(f"Redis at {redacted(url)} is a Redis Cluster node; Talaria needs one Redis "
                            f"or a Sentinel-watched master ({SENTINEL_SCHEME}://, docs/deploy.md)")


async def sentinels_say(url: str, timeout_s: float = 2.0) -> str:
    """Why the sentinels of `url` name no master, one short clause per sentinel (refused,
    login refused, does not watch the name), for a start error that reads at a glance
    (redis-py's MasterNotFoundError prints each sentinel client's whole repr)."""
    target = parse_redis_url(url)
    said = []
    sentinel_login = login(target.sentinel_username, target.sentinel_password)
    for host, port in target.sentinels:
        s = aioredis.Redis(host=host, port=port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                           **sentinel_login)
        try:
            addr = await s.sentinel_get_master_addr_by_name(target.service)
            said.append(f"{host}:{port} " + (f"names {addr[0]}:{addr[1]}" if addr else
                                             f"does not watch a master named {target.service!r}"))
        except AuthenticationError:
            said.append(f"{host}:{port} refused the login (its password: ?sentinel_password=...)")
        except ResponseError as exc:
            said.append(f"{host}:{port} answered {str(exc)[:80]!r}"
                        + (" (its password: ?sentinel_password=...)" if "auth" in str(exc).lower() else ""))
        except Exception as exc:  # noqa: BLE001 - refused, unreachable, timed out: said by name
            said.append(f"{host}:{port} {type(exc).__name__}: {str(exc)[:80]}")
        finally:
            await s.aclose()
    return "; ".join(said)
