"""Process plumbing for the embedded stack: spawning, stopping and supervising child processes.

Everything binds to 127.0.0.1 on free ports and keeps its state in temp dirs, so it never
touches a system NATS/Redis. Every process started here is tracked in a module registry
and stopped by an atexit hook, so nothing outlives the Python process on a normal exit,
an uncaught exception or a KeyboardInterrupt. On Linux, children spawned from the main
thread, or for other threads from one spawner thread that lives as long as the process, get
PR_SET_PDEATHSIG=SIGKILL as a last resort if the parent is SIGKILLed.

The blocking API (start/stop/...) is usable from sync code; async callers can use the
``a*`` twins (which run the blocking call in a worker thread) and ``ProcessGroup.supervise``.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import json
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Self, TypeVar

from shared.clock import done_within
from shared.logs import LOG_FILE_ENV
from shared import net
from shared.net import LOOPBACK

log = logging.getLogger("talaria.ops.processes")

_T = TypeVar("_T")
POLL_S = 0.05
SPARE_DELAY_S = 2.0  # wall seconds after a child's (re)start before its next warm spare starts


class InfraError(RuntimeError):
    """A binary is missing or a process failed to start/become ready."""



# --------------------------------------------------------------------------- process plumbing


class _Stoppable(Protocol):
    def _atexit_stop(self) -> None: ...


_registry: set[Any] = set()
_registry_lock = threading.RLock()
_owned_dirs: set[str] = set()


def register(obj: _Stoppable) -> None:
    with _registry_lock:
        _registry.add(obj)


def unregister(obj: _Stoppable) -> None:
    with _registry_lock:
        _registry.discard(obj)


def stop_everything() -> None:
    """Stop every server/process group started by this module (the atexit hook)."""
    with _registry_lock:
        objs = list(_registry)
    for obj in objs:
        try:
            obj._atexit_stop()
        except (KeyboardInterrupt, SystemExit):
            # A second Ctrl-C (or SIGTERM, SIGHUP) during cleanup: stop being polite but still clean up.
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


def set_pdeathsig() -> None:
    """In a child before exec: it gets SIGKILL when its parent (thread) dies."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


class _Spawner:
    """One daemon thread, alive as long as the process, that starts the children asked for
    from other threads. PDEATHSIG fires when the *spawning thread* exits: a child started
    from a pool's worker thread (the async callers' `asyncio.to_thread`: NATS and Redis)
    got none, since that thread may end while the child should run on, so a SIGKILLed
    `talaria up` or replay left its NATS and Redis running. This thread ends only with the
    process, so its children get PDEATHSIG as the main thread's do."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = 0  # the process that started the thread (a forked child has none running)
        self._lock = threading.Lock()

    def run(self, job: Callable[[], _T]) -> _T:
        with self._lock:
            if self._thread is None or self._pid != os.getpid():
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._serve, args=(self._jobs,), name="talaria-spawner",
                                                daemon=True)
                self._pid = os.getpid()
                self._thread.start()
        done: concurrent.futures.Future[_T] = concurrent.futures.Future()
        self._jobs.put((job, done))
        return done.result()

    @staticmethod
    def _serve(jobs: "queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]") -> None:
        while True:
            job, done = jobs.get()
            try:
                done.set_result(job())
            except BaseException as exc:  # noqa: BLE001 - the asking thread raises it
                done.set_exception(exc)


_SPAWNER = _Spawner()


def with_log_file(env: Mapping[str, str] | None, log_path: Path) -> dict[str, str]:
    """A child's environment (this process's where `env` is None) naming the file its
    output is appended to, which a service rotates by size (shared/logs.py)."""
    return {**(os.environ if env is None else env), LOG_FILE_ENV: str(log_path.resolve())}


def spawn(
    argv: Sequence[str],
    *,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    stdin: int = subprocess.DEVNULL,
) -> subprocess.Popen[bytes]:
    """Start argv in its own session (so killpg reaches grandchildren), output appended to
    log; it gets SIGKILL if this process dies without stopping it (PDEATHSIG, Linux)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)

    child_env = with_log_file(env, log_path)

    def start() -> subprocess.Popen[bytes]:
        with open(log_path, "ab", buffering=0) as logf:
            return subprocess.Popen(
                list(argv),
                stdin=stdin,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=child_env,
                cwd=cwd,
                start_new_session=True,
                preexec_fn=set_pdeathsig,
            )

    # (from the main thread, whose exit is the process's, directly; else by the spawner thread)
    return start() if threading.current_thread() is threading.main_thread() else _SPAWNER.run(start)


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
        time.sleep(POLL_S)
    if _group_alive(proc.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode


def _kill(proc: subprocess.Popen[bytes]) -> None:
    _signal_group(proc, signal.SIGKILL)
    proc.wait()


def log_tail(path: Path | None, n: int = 30) -> str:
    if path is None:
        return ""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def wait_tcp(port: int, proc: subprocess.Popen[bytes], deadline: float, what: str,
              log_path: Path | None) -> None:
    while True:
        if proc.poll() is not None:
            raise InfraError(
                f"{what} exited with code {proc.returncode} during start-up; log tail:\n"
                f"{log_tail(log_path)}"
            )
        with contextlib.suppress(OSError):
            with socket.create_connection((LOOPBACK, port), timeout=0.5):
                return
        if time.monotonic() > deadline:
            raise InfraError(f"{what} did not accept connections on port {port}; log tail:\n"
                             f"{log_tail(log_path)}")
        time.sleep(POLL_S)


def own_tempdir(prefix: str) -> Path:
    """A temporary folder removed at exit, named by this process's pid, so the next one
    removes it if this process was killed before its exit hook ran (`talaria up` under
    SIGKILL left its NATS store's and Redis's folders in the temp folder for good)."""
    sweep_orphaned_tempdirs(prefix)
    d = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
    _owned_dirs.add(d)
    return Path(d)


def sweep_orphaned_tempdirs(prefix: str) -> list[str]:
    """Remove the temporary folders `own_tempdir(prefix)` made in processes that no longer run."""
    root = tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            pid = name[len(prefix):].split("-", 1)[0] if name.startswith(prefix) else ""
            if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                removed.append(name)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's: alive)
        return True
    return True


BIND_ATTEMPTS = 3  # a free port can be taken between picking it and the server binding it


def lost_bind_race(exc: InfraError) -> bool:
    return "address already in use" in str(exc).lower()


class ServerBase:
    """Shared lifecycle of a single server process."""

    _what = "server"

    def __init__(self, port: int | None, log_file: str | Path | None, workdir: Path) -> None:
        # Pick the port once so .url stays valid across restart(); it stays open to a
        # new pick only until the first start (and never when the caller chose it).
        self._port_fixed = port is not None
        self.port: int = port if port is not None else net.free_port()
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
            self._proc = spawn(self._argv(), log_path=self.log_file, cwd=self.workdir)
            register(self)

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
        self.port = net.free_port()
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
                if attempt < BIND_ATTEMPTS and lost_bind_race(exc) and self._repick_ports():
                    continue
                raise
            self._port_fixed = True
            return

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds."""
        with self._lock:
            if self._proc is not None:
                _terminate(self._proc, timeout)
            unregister(self)

    def kill(self) -> None:
        """SIGKILL with no grace (fault injection)."""
        with self._lock:
            if self._proc is not None:
                _kill(self._proc)
            unregister(self)

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
    last_exit_at: float | None = None  # wall time (epoch s) of its last unexpected exit
    on_launch: Callable[["Child"], None] | None = None  # called before every (re)start, e.g. to pick a port
    spare: subprocess.Popen[bytes] | None = None  # its warm spare, imports done, waiting on stdin (talaria/ops/spare.py)
    spare_due: float | None = None  # when to start the next spare (monotonic)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _spare_argv(argv: Sequence[str]) -> list[str] | None:
    """`python -m <module> args` as a warm spare of itself; None for anything else."""
    if len(argv) >= 3 and argv[1] == "-m" and argv[2] != "talaria.ops.spare":
        return [argv[0], "-m", "talaria.ops.spare", *argv[2:]]
    return None


CONFIG_EXIT_CODE = 78  # EX_CONFIG: a service refused its settings, or could not start with them


def _config_reason(log_path: Path, code: int) -> str:
    """For a child that exited refusing its settings, the reason its log ends with (else
    it stays in the log while the terminal shows restart after restart)."""
    if code != CONFIG_EXIT_CODE:
        return ""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines()]
    except OSError:
        return ""
    said = [ln for ln in lines if ln and not ln.startswith("--- [infra")]
    return f" (its settings refused: {said[-1][:300]})" if said else ""


class ProcessGroup:
    """Starts, stops and supervises named child processes (one session/pgroup each)."""

    def __init__(
        self,
        *,
        backoff_initial: float = 0.5,
        backoff_max: float = 10.0,
        stable_after: float = 10.0,
        poll_interval: float = 0.1,
        spares: bool = False,
    ) -> None:
        self.children: dict[str, Child] = {}
        # Keep a warm spare of each `python -m <module>` child, so a restart skips
        # Python's start-up and the service's imports (talaria/ops/spare.py).
        self.spares = spares
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        # A child that ran this long before dying is considered healthy: reset its back-off.
        self.stable_after = stable_after
        self.poll_interval = poll_interval
        # where every supervised restart is written down (`talaria status` shows them to an operator)
        self.restarts_file: Path | None = None
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
        path = Path(log_path) if log_path else own_tempdir("talaria-logs-") / f"{name}.log"
        child = Child(name=name, argv=list(argv), env=full_env, log_path=path)
        self.children[name] = child
        return child

    def __getitem__(self, name: str) -> Child:
        return self.children[name]

    def restart_counts(self) -> dict[str, dict[str, float | int | None]]:
        """Each child restarted after an unexpected exit: how often, its last exit code and when."""
        return {c.name: {"restarts": c.restarts, "last_exit_code": c.exit_codes[-1] if c.exit_codes else None,
                         "last_exit_at": c.last_exit_at}
                for c in self.children.values() if c.restarts}

    def _write_restarts(self) -> None:
        if self.restarts_file is None:
            return
        with contextlib.suppress(OSError):  # (a report: the supervision goes on without it)
            tmp = self.restarts_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.restart_counts(), indent=1))
            os.replace(tmp, self.restarts_file)

    def _note(self, child: Child, message: str) -> None:
        # Mirror lifecycle events into the child's own log, which is where people look.
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with contextlib.suppress(OSError):
            child.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(child.log_path, "a", encoding="utf-8") as f:
                f.write(f"--- [infra {stamp}] {message}\n")

    def _launch(self, child: Child) -> None:
        if child.on_launch is not None:
            child.on_launch(child)
        child.proc = self._activate_spare(child) or spawn(child.argv, log_path=child.log_path, env=child.env)
        child.started_at = time.monotonic()
        child.stopping = False
        child.next_start = None
        if self.spares and _spare_argv(child.argv) is not None:
            # not at once: the new spare's imports would compete for the CPU with the
            # child just (re)started, whose recovery is what the spare is for
            child.spare_due = child.started_at + SPARE_DELAY_S
        register(self)

    def _activate_spare(self, child: Child) -> subprocess.Popen[bytes] | None:
        """The child's spare, told to run with the child's environment now; None if it has none alive."""
        spare, child.spare = child.spare, None
        if spare is None:
            return None
        if spare.poll() is None and spare.stdin is not None:
            try:
                spare.stdin.write(json.dumps({"env": with_log_file(child.env, child.log_path)}).encode() + b"\n")
                spare.stdin.close()
                return spare
            except OSError:  # it died just now: start a fresh one
                pass
        _kill(spare)
        return None

    def _start_spares(self, now: float) -> None:
        for child in self.children.values():
            if child.spare_due is None or now < child.spare_due or child.stopping:
                continue
            child.spare_due = None
            argv = _spare_argv(child.argv)
            if argv is not None and (child.spare is None or child.spare.poll() is not None):
                child.spare = spawn(argv, log_path=child.log_path, env=child.env, stdin=subprocess.PIPE)

    def _stop_spare(self, child: Child) -> None:
        child.spare_due = None
        spare, child.spare = child.spare, None
        if spare is not None:
            _kill(spare)

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
            self._stop_spare(child)
            if child.proc is not None:
                _terminate(child.proc, timeout)

    def stop_all(self, timeout: float = 10.0) -> None:
        """SIGTERM every child's process group, wait up to timeout overall, SIGKILL the rest."""
        with self._lock:
            live = [c for c in self.children.values() if c.proc is not None]
            for c in self.children.values():
                c.stopping = True
                c.next_start = None
                self._stop_spare(c)
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
                unregister(self)

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

    def kill_hung(self, name: str) -> None:
        """SIGKILL a child its liveness watch judged hung, to be restarted at once: not
        a crash loop's back-off, since the watch's own judgment (missed rounds, or its
        startup window for a child that never answered) already paces such restarts.
        (A child hung just after a restart, before the watch heard it, waited out a
        crash-loop back-off on top: a chaos run's router hang took 3.3 s that way.)"""
        with self._lock:
            child = self.children[name]
            child.failures = 0
            if child.proc is not None:
                _kill(child.proc)

    def running(self, name: str) -> bool:
        return self.children[name].running

    def pids(self) -> dict[str, int | None]:
        return {name: c.pid if c.running else None for name, c in self.children.items()}

    def mark_healthy(self, name: str) -> None:
        """The child answered its health check: it serves, so its next death is not part
        of a crash loop (its restart back-off starts over). A child killed again and again
        after serving each time (a chaos run) is restarted at once each time."""
        with self._lock:
            child = self.children.get(name)
            if child is not None and child.next_start is None:
                child.failures = 0

    def _backoff(self, child: Child) -> float:
        # The first death of a child that was serving is restarted at once: waiting
        # only delays recovery. A crash loop (it dies again before serving) backs off.
        if child.failures <= 1:
            return 0.0
        return min(self.backoff_initial * (2 ** (child.failures - 2)), self.backoff_max)

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
                    child.last_exit_at = time.time()
                    delay = self._backoff(child)
                    child.next_start = now + delay
                    log.warning("infra: %s (pid %s) exited with code %s%s; restarting in %.1fs",
                                child.name, child.proc.pid, code, _config_reason(child.log_path, code), delay)
                    self._note(child, f"exited with code {code}; restart in {delay:.1f}s")
                if now >= child.next_start:  # a restart due now is done in this step, not the next poll
                    # Leftover grandchildren of the dead leader must not linger.
                    if _group_alive(child.proc.pid):
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.killpg(child.proc.pid, signal.SIGKILL)
                    child.restarts += 1
                    self._launch(child)
                    log.warning("infra: restarted %s (restart #%d, pid %s)",
                                child.name, child.restarts, child.proc.pid)
                    self._note(child, f"restart #{child.restarts}, pid {child.proc.pid}")
                    self._write_restarts()
            if self.spares:
                self._start_spares(now)

    async def supervise(self, stop_event: asyncio.Event) -> None:
        """Restart children that exit unexpectedly until stop_event is set.

        Does not stop the children on return: call stop_all()/astop_all() for that.
        """
        while not stop_event.is_set():
            self.check()
            await done_within(stop_event.wait(), self.poll_interval)

    def _procs(self) -> list[subprocess.Popen[bytes]]:
        return [p for c in self.children.values() for p in (c.proc, c.spare) if p is not None]

    def _atexit_stop(self) -> None:
        self.stop_all(timeout=3.0)

    def __enter__(self) -> ProcessGroup:
        self.start_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def __repr__(self) -> str:
        return f"<ProcessGroup {self.pids()}>"

