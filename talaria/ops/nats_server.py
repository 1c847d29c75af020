"""A nats-server on 127.0.0.1 (one node or a cluster), driven by a generated config file."""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from shared import net
from shared.net import LOOPBACK
from talaria.ops.binaries import find_nats_server
from talaria.ops.processes import (
    BIND_ATTEMPTS,
    POLL_S,
    InfraError,
    ServerBase,
    log_tail,
    lost_bind_race,
    own_tempdir,
    wait_tcp,
)



def _q(value: str) -> str:
    # NATS config accepts JSON-style quoted strings.
    return json.dumps(value)


class NatsServer(ServerBase):
    """A nats-server on 127.0.0.1 driven by a generated config file."""

    _what = "nats"

    def __init__(
        self,
        port: int | None = None,
        *,
        jetstream: bool = True,
        store_dir: str | Path | None = None,
        users: list[tuple[str, str]] | None = None,
        cluster_name: str | None = None,
        cluster_port: int | None = None,
        routes: list[str] | None = None,
        server_name: str | None = None,
        log_file: str | Path | None = None,
        binary: str | None = None,
        permissions: dict[str, dict[str, list[str]]] | None = None,
        max_payload: int | None = None,
    ) -> None:
        workdir = own_tempdir("talaria-nats-")
        super().__init__(port, log_file, workdir)
        self.binary = binary or find_nats_server()
        self.jetstream = jetstream
        # the other nodes of its cluster while start_cluster starts it: one that exits then is
        # never a quorum (later a peer may be down on purpose: fault injection)
        self.peers: list[NatsServer] = []
        self.store_dir = Path(store_dir) if store_dir else workdir / "jetstream"
        self.users = list(users or [])
        # per-user allow-lists: {user: {"publish": [...], "subscribe": [...]}}
        self.permissions = dict(permissions or {})
        self.max_payload = max_payload
        self.cluster_name = cluster_name
        # A cluster needs a route listener even if the caller didn't choose the port.
        self.cluster_port = cluster_port if cluster_port is not None or not cluster_name \
            else net.free_port()
        self.routes = list(routes or [])
        # Clustered JetStream requires a unique, stable server name.
        self.server_name = server_name or (f"n{self.port}" if cluster_name else None)
        self.http_port = net.free_port()  # monitoring endpoint, for /healthz readiness
        self.config_file = workdir / "nats.conf"

    def _repick_ports(self) -> bool:
        if self.cluster_name or not super()._repick_ports():
            return False  # (a cluster's routes name our ports: start_cluster starts it again instead)
        self.http_port = net.free_port()
        return True

    @property
    def url(self) -> str:
        """Client URL; carries the first user's credentials when users are configured.

        Not percent-encoded: nats-py passes URL credentials through verbatim. For passwords
        containing '/', '?' or '#', connect with plain_url and user=/password= instead.
        """
        if self.users:
            user, password = self.users[0]
            return f"nats://{user}:{password}@{LOOPBACK}:{self.port}"
        return f"nats://{LOOPBACK}:{self.port}"

    @property
    def plain_url(self) -> str:
        """Client URL without credentials."""
        return f"nats://{LOOPBACK}:{self.port}"

    def render_config(self) -> str:
        lines = [
            f"listen: {_q(f'{LOOPBACK}:{self.port}')}",
            f"http: {_q(f'{LOOPBACK}:{self.http_port}')}",
        ]
        if self.server_name:
            lines.append(f"server_name: {_q(self.server_name)}")
        if self.jetstream:
            lines.append(f"jetstream {{ store_dir: {_q(str(self.store_dir))} }}")
        if self.max_payload:
            lines.append(f"max_payload: {int(self.max_payload)}")
        if self.users:
            entries = []
            for u, p in self.users:
                perm = self.permissions.get(u)
                if perm:
                    pub = ", ".join(_q(x) for x in perm.get("publish", []))
                    sub = ", ".join(_q(x) for x in perm.get("subscribe", []))
                    entries.append(f"{{user: {_q(u)}, password: {_q(p)}, permissions: {{publish: {{allow: [{pub}]}}, subscribe: {{allow: [{sub}]}}}}}}")
                else:
                    entries.append(f"{{user: {_q(u)}, password: {_q(p)}}}")
            lines.append(f"authorization {{ users: [{', '.join(entries)}] }}")
        if self.cluster_name or self.cluster_port:
            routes = ", ".join(_q(r) for r in self.routes)
            lines.append("cluster {")
            if self.cluster_name:
                lines.append(f"  name: {_q(self.cluster_name)}")
            lines.append(f"  listen: {_q(f'{LOOPBACK}:{self.cluster_port}')}")
            lines.append(f"  routes: [{routes}]")
            lines.append("}")
        return "\n".join(lines) + "\n"

    def _argv(self) -> list[str]:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(self.render_config())
        return [self.binary, "-c", str(self.config_file)]

    def healthz(self, query: str = "") -> bool:
        """True when the monitoring /healthz answers 200 (JetStream ready, if enabled)."""
        url = f"http://{LOOPBACK}:{self.http_port}/healthz{query}"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _wait_ready(self, deadline: float) -> None:
        assert self._proc is not None
        wait_tcp(self.port, self._proc, deadline, "nats-server", self.log_file)
        # /healthz is only 200 once JetStream is up and, when clustered, has a meta leader.
        while not self.healthz():
            for node in (self, *self.peers):
                # a peer too (e.g. its route port taken between picking and binding it): the whole
                # cluster starts again on fresh ports instead of waiting out the deadline for a quorum
                if node._proc is not None and node._proc.poll() is not None:
                    which = "" if node is self else f" on port {node.port}, a node of this one's cluster,"
                    raise InfraError(f"nats-server{which} exited with code {node._proc.returncode}; "
                                     f"log tail:\n{log_tail(node.log_file)}")
            if time.monotonic() > deadline:
                raise InfraError(f"nats-server on port {self.port} not healthy in time; "
                                 f"log tail:\n{log_tail(self.log_file)}")
            time.sleep(POLL_S * 2)


def start_cluster(
    n: int = 3,
    *,
    cluster_name: str | None = None,
    jetstream: bool = True,
    users: list[tuple[str, str]] | None = None,
    base_dir: str | Path | None = None,
    timeout: float = 30.0,
    permissions: dict[str, dict[str, list[str]]] | None = None,
    max_payload: int | None = None,
) -> list[NatsServer]:
    """Start an n-node NATS cluster on loopback, fully routed, with clustered JetStream.
    A node that loses a bind race (a picked port taken before it bound it) makes
    the whole cluster start again on fresh ports, since routes name every port."""
    def start_once() -> list[NatsServer]:
        name = cluster_name or f"talaria-{os.getpid()}-{net.free_port()}"
        cluster_ports = [net.free_port() for _ in range(n)]
        routes = [f"nats-route://{LOOPBACK}:{p}" for p in cluster_ports]
        nodes: list[NatsServer] = []
        for i, cport in enumerate(cluster_ports):
            store = Path(base_dir) / f"n{i}" if base_dir else None
            nodes.append(NatsServer(
                jetstream=jetstream,
                store_dir=store,
                users=users,
                cluster_name=name,
                cluster_port=cport,
                routes=routes,  # a route to itself is ignored by nats-server
                server_name=f"{name}-n{i}",
                log_file=(Path(base_dir) / f"n{i}.log") if base_dir else None,
                permissions=permissions,
                max_payload=max_payload,
            ))
        for node in nodes:
            node.peers = [peer for peer in nodes if peer is not node]
        try:
            # Spawn all first: clustered JetStream only becomes healthy once a quorum is up.
            for node in nodes:
                node.spawn()
            deadline = time.monotonic() + timeout
            for node in nodes:
                node.wait_ready(max(deadline - time.monotonic(), 1.0))
        except BaseException:
            for node in nodes:
                node.kill()
            raise
        finally:
            for node in nodes:
                node.peers = []
        return nodes

    for attempt in range(1, BIND_ATTEMPTS + 1):
        try:
            return start_once()
        except InfraError as exc:
            if attempt == BIND_ATTEMPTS or not lost_bind_race(exc):
                raise
            if base_dir:  # the failed attempt's JetStream state names nodes that no longer exist
                for i in range(n):
                    shutil.rmtree(Path(base_dir) / f"n{i}", ignore_errors=True)
    raise AssertionError("unreachable")


def cluster_urls(nodes: Sequence[NatsServer]) -> list[str]:
    return [node.url for node in nodes]
