"""A container's liveness watch: run a service as a child and kill it when it
stops answering its health checks, so that the container exits and its restart
policy replaces it.

    python -m talaria.ops.watchdog --service router -- python -m services.router

Docker marks a container whose health check fails *unhealthy* and leaves it
running; only an exited container is restarted. A service whose event loop is
stuck ends itself (`TALARIA_LOOP_STALL_EXIT_S`), but a process that is stopped
outright (SIGSTOP, a stuck driver call, a full disk under a blocking write)
cannot. This wrapper is the container's first process: it starts the service,
pings its health endpoint (NATS; the gateway's `GET /health`) on the same rounds
and rule as the embedded stack's watch (`talaria/ops/liveness.py`: judged only
once it has answered since its start and its grace has passed, then after
`LIVENESS_MISSES` missed rounds in a row), SIGKILLs the service's process group
when it is judged hung, and exits with `HUNG_EXIT_CODE`. A service that exits on
its own is passed through (its exit code is the container's). SIGTERM and
SIGINT are forwarded, so `docker compose stop` drains the service as before; from
then on nobody is judged (a draining service's health is not `ok` on purpose: the
gateway's says `draining`, a service's endpoints go as it exits) and the watchdog
waits for the child, Docker's own SIGKILL at the stop's grace period being the limit.
While NATS itself is unreachable nobody is judged: the bus is away, not the
service.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

from shared.net import NATS_KEEPALIVE
from shared.subjects import Subjects
from talaria.argtypes import positive_float
from talaria.ops.healthcheck import SERVICES, http_check, instance_name, service_settings
from talaria.argtypes import positive_int
from talaria.ops.processes import set_pdeathsig
from talaria.ops.liveness import (GATEWAY_LIVENESS_TIMEOUT_S, LIVENESS_INTERVAL_S, LIVENESS_MISSES, LIVENESS_TIMEOUT_S,
                                  LivenessWatch, PingRounds, BusProbe)

HUNG_EXIT_CODE = 75  # EX_TEMPFAIL: the watched service was hung and killed; restart the container
DEFAULT_GRACE_S = 30.0  # wall seconds after the start before a hang is judged (engines: set more, weights load)


def note(event: str, level: str = "info", **fields: object) -> None:
    """One JSON line on stderr, in the services' own log shape."""
    sys.stderr.write(json.dumps({"event": event, "service": "watchdog", "level": level, **fields}) + "\n")
    sys.stderr.flush()


class Watchdog:
    def __init__(self, argv: list[str], service: str, grace_s: float, misses: int = LIVENESS_MISSES,
                 startup_s: float | None = None) -> None:
        self.argv = argv
        self.service = service
        self.grace_s = grace_s
        self.startup_s = grace_s if startup_s is None else startup_s
        self.misses = misses
        self.settings = service_settings()
        self.child: subprocess.Popen[bytes] | None = None
        self.stopping = False  # a stop was forwarded: the child drains, and is no longer judged

    def start(self) -> subprocess.Popen[bytes]:
        # its own process group, so a kill takes whatever the service started with it (vLLM's
        # engine core); and it dies with us, should we be killed first (PR_SET_PDEATHSIG)
        self.child = subprocess.Popen(self.argv, start_new_session=True, preexec_fn=set_pdeathsig)
        note("watchdog.started", child_pid=self.child.pid, argv=self.argv)
        return self.child

    def forward(self, sig: int) -> None:
        if self.child is not None and self.child.poll() is None:
            if not self.stopping:
                note("watchdog.stopping", child_pid=self.child.pid, signal=signal.Signals(sig).name)
            self.stopping = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child.pid, sig)

    def kill(self) -> None:
        assert self.child is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.child.pid, signal.SIGKILL)
        self.child.wait()

    async def ping(self, nc: object | None) -> bool:
        if self.service == "gateway":
            url = f"http://127.0.0.1:{self.settings.gateway_port}/health"
            ok, _ = await asyncio.to_thread(http_check, url, GATEWAY_LIVENESS_TIMEOUT_S)
            return ok
        try:
            await nc.request(Subjects(self.settings.subject_prefix).health(instance_name(self.service)),  # type: ignore[attr-defined]
                             b"", timeout=LIVENESS_TIMEOUT_S)
            return True
        except Exception:
            return False

    async def run(self) -> int:
        import nats

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.forward, sig)
        child = self.start()
        watch = LivenessWatch(misses=self.misses, grace_s=self.grace_s, startup_s=self.startup_s)
        name = self.service
        watch.started(name, time.monotonic())
        nc = None
        s = self.settings

        async def quiet(_exc: Exception) -> None:
            pass

        async def connect() -> object | None:
            with contextlib.suppress(Exception):  # no bus yet: tried again on a later round
                return await nats.connect(servers=s.nats_urls, name=f"talaria-watchdog-{name}", error_cb=quiet,
                                          max_reconnect_attempts=-1, connect_timeout=2,
                                          **NATS_KEEPALIVE,
                                          user=s.nats_user or None, password=s.nats_password or None)
            return None

        rounds = PingRounds()  # (as in the stack's watch)
        probe: BusProbe | None = None
        try:
            while child.poll() is None:
                await asyncio.sleep(LIVENESS_INTERVAL_S)
                if self.stopping:  # (a probe: the gateway's drain of a 19-s stream was killed after 3 s)
                    rounds.drop()
                    continue
                if self.service != "gateway":
                    if nc is None:
                        nc = await connect()
                    if nc is None or not nc.is_connected:  # type: ignore[attr-defined]
                        rounds.drop()
                        rounds.bus_away()
                        continue  # the bus is away, not the service: judge nobody
                for answers in rounds.finished():
                    if child.poll() is None and watch.round(answers, time.monotonic()):
                        note("watchdog.hung", "warning", child_pid=child.pid, instance=name,
                             exit_code=HUNG_EXIT_CODE, reason="stopped answering its health checks")
                        self.kill()
                        return HUNG_EXIT_CODE
                # (a NATS node that stops answering keeps the connection open: the probe tells
                # the watchdog's own node away from its service, which it must not kill for that)
                if probe is None and nc is not None:
                    probe = BusProbe(nc)
                rounds.begin([name], lambda _name: self.ping(nc),
                             None if self.service == "gateway" or probe is None else probe.answers)
            return child.returncode if child.returncode >= 0 else 128 - child.returncode
        finally:
            rounds.drop()
            if probe is not None:
                probe.close()
            if nc is not None:
                with contextlib.suppress(Exception):
                    await nc.close()  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m talaria.ops.watchdog --service KIND [--grace S] [--startup-s S] [--misses N] "
              "-- COMMAND ...", file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m talaria.ops.watchdog", description=__doc__.split("\n\n")[0])
    p.add_argument("--service", choices=SERVICES, required=True, help="the service kind (its health endpoint)")
    p.add_argument("--grace", type=positive_float, default=DEFAULT_GRACE_S,
                   help=f"seconds after the start before a hang is judged (default {DEFAULT_GRACE_S:g})")
    p.add_argument("--startup-s", type=positive_float, default=None,
                   help="seconds a service that has never answered may take to start (its imports and set-up; "
                        "default: the grace)")
    p.add_argument("--misses", type=positive_int, default=LIVENESS_MISSES,
                   help=f"health rounds ({LIVENESS_INTERVAL_S:g} s apart, {LIVENESS_TIMEOUT_S:g}-s pings) missed in a row "
                        f"before a kill (default {LIVENESS_MISSES}); an engine whose loop blocks for seconds needs more")
    a = p.parse_args(argv[:cut])
    command = argv[cut + 1:]
    if not command:
        p.error("no command after --")
    try:
        dog = Watchdog(command, a.service, a.grace, a.misses, a.startup_s)
        if a.service != "gateway":
            instance_name(a.service)  # (the settings name the instance, or say why not, before we start)
    except ValueError as exc:
        print(f"watchdog: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(dog.run())


if __name__ == "__main__":
    sys.exit(main())
