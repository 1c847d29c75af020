"""A redis-server on 127.0.0.1 with persistence off (redis 6.2 and 7.x)."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from shared.net import LOOPBACK
from talaria.ops.binaries import find_redis_server
from talaria.ops.processes import (
    POLL_S,
    InfraError,
    ServerBase,
    log_tail,
    own_tempdir,
)



def _redis_q(value: str) -> str:
    # redis.conf tokens are split by sdssplitargs, which understands "..." with \-escapes.
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class RedisServer(ServerBase):
    """A redis-server on 127.0.0.1 with persistence off; works with redis 6.2 and 7.x."""

    _what = "redis"

    def __init__(
        self,
        port: int | None = None,
        *,
        password: str | None = None,
        acl_users: dict[str, str] | None = None,
        dir: str | Path | None = None,  # noqa: A002 - mirrors redis' own option name
        log_file: str | Path | None = None,
        binary: str | None = None,
        replica_of: int | None = None,
        extra_config: tuple[str, ...] = (),
    ) -> None:
        workdir = Path(dir) if dir else own_tempdir("talaria-redis-")
        workdir.mkdir(parents=True, exist_ok=True)
        super().__init__(port, log_file, workdir)
        self.binary = binary or find_redis_server()
        self.password = password
        self.acl_users = dict(acl_users or {})
        self.replica_of = replica_of  # the port of the master this one replicates (on 127.0.0.1)
        self.extra_config = extra_config  # more redis.conf lines (a test's `cluster-enabled yes`)
        self.config_file = workdir / f"redis-{self.port}.conf"

    @property
    def url(self) -> str:
        """redis://[user:pass@]127.0.0.1:P/0 — the first ACL user if any, else the default user."""
        cred = ""
        if self.acl_users:
            user, pw = next(iter(self.acl_users.items()))
            cred = f"{urllib.parse.quote(user, safe='')}:{urllib.parse.quote(pw, safe='')}@"
        elif self.password is not None:
            cred = f":{urllib.parse.quote(self.password, safe='')}@"
        return f"redis://{cred}{LOOPBACK}:{self.port}/0"

    def render_config(self) -> str:
        lines = [
            f"port {self.port}",
            f"bind {LOOPBACK}",
            'save ""',
            "appendonly no",
            f"dir {_redis_q(str(self.workdir))}",
            "daemonize no",
            'logfile ""',  # stdout, which spawn sends to log_file
        ]
        if self.password is not None:
            lines.append(f"requirepass {_redis_q(self.password)}")
        for user, pw in self.acl_users.items():
            # &* (all pub/sub channels) exists since 6.2 and is needed on 7.x, whose
            # default for new users is no channels.
            lines.append(f"user {_redis_q(user)} on {_redis_q('>' + pw)} ~* &* +@all")
        if self.replica_of is not None:
            lines.append(f"replicaof {LOOPBACK} {self.replica_of}")
            user, pw = _login(self)  # (the master's users are the replica's: one deployment)
            lines += [f"masteruser {_redis_q(user)}"] if user else []
            lines += [f"masterauth {_redis_q(pw)}"] if pw else []
        lines += self.extra_config
        return "\n".join(lines) + "\n"

    def _repick_ports(self) -> bool:
        if not super()._repick_ports():
            return False
        self.config_file = self.workdir / f"redis-{self.port}.conf"
        return True

    def _argv(self) -> list[str]:
        self.config_file.write_text(self.render_config())
        return [self.binary, str(self.config_file)]

    def ping(self) -> bool:
        """True once the server speaks RESP (a NOAUTH error also proves it is serving)."""
        try:
            with socket.create_connection((LOOPBACK, self.port), timeout=1) as s:
                s.sendall(b"*1\r\n$4\r\nPING\r\n")
                reply = s.recv(64)
        except OSError:
            return False
        return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")

    def _wait_ready(self, deadline: float) -> None:
        assert self._proc is not None
        while not self.ping():
            if self._proc.poll() is not None:
                raise InfraError(f"redis-server exited with code {self._proc.returncode}; "
                                 f"log tail:\n{log_tail(self.log_file)}")
            if time.monotonic() > deadline:
                raise InfraError(f"redis-server on port {self.port} not ready in time; "
                                 f"log tail:\n{log_tail(self.log_file)}")
            time.sleep(POLL_S)


def _login(server: RedisServer) -> tuple[str | None, str | None]:
    """The user and password another Redis process (a replica, a sentinel) logs in to
    `server` with: its first ACL user, else its password."""
    if server.acl_users:
        return next(iter(server.acl_users.items()))
    return None, server.password


class RedisSentinel(RedisServer):
    """A Redis Sentinel on 127.0.0.1 watching one master (a RedisServer on this host) as
    `service`; with `quorum` 1 it alone decides a failover, `down_after_s` after the master
    stops answering. For tests and local trials of a Sentinel-watched Redis."""

    _what = "redis-sentinel"

    def __init__(self, master: RedisServer, service: str = "talaria", *, quorum: int = 1,
                 down_after_s: float = 1.0, failover_timeout_s: float = 5.0,
                 log_file: str | Path | None = None) -> None:
        super().__init__(dir=own_tempdir("talaria-sentinel-"), log_file=log_file, binary=master.binary)
        self.master, self.service, self.quorum = master, service, quorum
        self.down_after_ms, self.failover_timeout_ms = int(down_after_s * 1000), int(failover_timeout_s * 1000)

    @property
    def url(self) -> str:
        """This sentinel as a `redis+sentinel://` URL of its service, with the master's credentials."""
        master = urllib.parse.urlsplit(self.master.url)
        cred = master.netloc.rpartition("@")[0]
        return f"redis+sentinel://{cred + '@' if cred else ''}{LOOPBACK}:{self.port}/{self.service}"

    def render_config(self) -> str:
        name = self.service
        lines = [
            f"port {self.port}",
            f"bind {LOOPBACK}",
            f"dir {_redis_q(str(self.workdir))}",
            "daemonize no",
            'logfile ""',
            f"sentinel monitor {name} {LOOPBACK} {self.master.port} {self.quorum}",
            f"sentinel down-after-milliseconds {name} {self.down_after_ms}",
            f"sentinel failover-timeout {name} {self.failover_timeout_ms}",
        ]
        user, pw = _login(self.master)
        lines += [f"sentinel auth-user {name} {_redis_q(user)}"] if user else []
        lines += [f"sentinel auth-pass {name} {_redis_q(pw)}"] if pw else []
        return "\n".join(lines) + "\n"

    def _argv(self) -> list[str]:
        return [*super()._argv(), "--sentinel"]  # (a sentinel rewrites its own config file: it is in workdir)

    def master_port(self) -> int:
        """The port of the master the sentinel names now (after a failover, the promoted replica's)."""
        import redis

        with redis.Redis(host=LOOPBACK, port=self.port, socket_timeout=2) as r:
            _, port = r.sentinel_get_master_addr_by_name(self.service)
        return int(port)
