"""Container health check for a Talaria service: exit 0 when it answers, 1 when not.

    python -m talaria.ops.healthcheck --service engine        # instance name from the env
    python -m talaria.ops.healthcheck --instance admission-s0
    python -m talaria.ops.healthcheck --srv-ping talaria-router  # any instance answers $SRV.PING

Every service answers a request on `<TALARIA_SUBJECT_PREFIX>.health.<instance>`
(a NATS micro endpoint, `shared/bus.py`). With `--service` the instance name is
derived from the same environment the service itself reads, so a compose
healthcheck needs no per-service arguments beyond the kind:

    router     router-<TALARIA_INSTANCE_ID>
    admission  admission-<TALARIA_SERVER_ID>
    substrate  substrate-<TALARIA_SERVER_ID>
    engine     engine-<TALARIA_SERVER_ID>-<TALARIA_MODEL>
    gateway    (HTTP) GET http://127.0.0.1:<TALARIA_GATEWAY_PORT>/health: the
               gateway is an agent of Talaria, with no health subject of its own

NATS URLs, the subject prefix and NATS credentials come from TALARIA_NATS_URL,
TALARIA_SUBJECT_PREFIX, TALARIA_NATS_USER and TALARIA_NATS_PASSWORD (or
--nats / --subject-prefix / --user / --password). Where NATS enforces
per-role permissions (shared/auth.py), the user must be allowed to publish on
`<prefix>.health.>` (the `operator` role is). No retries here: the
container runtime retries (healthcheck `retries`, `interval`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from shared.schema import HEALTH_STARTING
from shared.settings import Settings
from shared.subjects import Subjects
from talaria.argtypes import positive_float

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

SERVICES = ("router", "admission", "substrate", "engine", "gateway")


def instance_name(service: str, env: Mapping[str, str] | None = None) -> str:
    """The health-endpoint instance of a service kind, from the settings its environment gives it."""
    if service not in SERVICES:
        raise ValueError(f"unknown service kind {service!r} (one of {', '.join(SERVICES)})")
    settings = service_settings(env)
    if service == "router" and not settings.instance_id:
        raise ValueError("router: set TALARIA_INSTANCE_ID (the router's instance name otherwise is its pid)")
    if service == "engine" and not settings.model:
        raise ValueError("engine: TALARIA_MODEL is not set")
    return settings.instance_name(service)


def service_settings(env: Mapping[str, str] | None = None) -> Settings:
    """The settings a service would read from this environment (shared/settings.py)."""
    try:
        return Settings.from_env([], env)
    except SystemExit as exc:  # argparse's own exit on a bad setting (it printed why)
        raise ValueError(f"the service's settings do not parse (exit {exc.code})") from None


async def _quiet(_exc: Exception) -> None:
    pass  # (a failed connection is raised to its caller; nats-py would also log each try)


async def connect_once(nats_urls: list[str], timeout_s: float, name: str,
                       user: str | None = None, password: str | None = None) -> "NATS":
    """A NATS connection tried once per server and given up within about twice
    `timeout_s` (NoServersError, OSError or asyncio.TimeoutError; a refused login raises
    nats-py's own error): a check, not a client that waits for NATS to come back."""
    import nats

    # max_reconnect_attempts=0 means "forever" in nats-py; 1 = one more try per server.
    return await asyncio.wait_for(
        nats.connect(servers=nats_urls, connect_timeout=timeout_s, max_reconnect_attempts=1,
                     reconnect_time_wait=0.1, allow_reconnect=False, error_cb=_quiet,
                     user=user or None, password=password or None, name=name),
        timeout=timeout_s * 2 + 1)


async def check(nats_urls: list[str], subject: str, timeout_s: float,
                user: str | None = None, password: str | None = None) -> tuple[bool, str]:
    from nats.errors import NoRespondersError, NoServersError
    from nats.errors import TimeoutError as NatsTimeout

    try:
        nc = await connect_once(nats_urls, timeout_s, "talaria-healthcheck", user, password)
    except (NoServersError, OSError, asyncio.TimeoutError) as exc:
        return False, f"cannot reach NATS at {','.join(nats_urls)}: {type(exc).__name__}: {exc}"
    try:
        msg = await nc.request(subject, b"", timeout=timeout_s)
        if msg.data == HEALTH_STARTING:  # alive, still setting up (e.g. a restarted admission recovering)
            return False, "starting"
        return True, msg.data.decode(errors="replace") or "ok"
    except NoRespondersError:
        return False, f"no responder on {subject}"
    except (NatsTimeout, asyncio.TimeoutError):
        return False, f"no answer on {subject} within {timeout_s:g} s"
    finally:
        await nc.close()


def http_check(url: str, timeout_s: float) -> tuple[bool, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 (a loopback URL of our own)
            return r.status == 200, r.read(200).decode(errors="replace") or "ok"
    except urllib.error.HTTPError as exc:
        return False, f"{url}: HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return False, f"{url}: {type(exc).__name__}: {exc}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m talaria.ops.healthcheck", description=__doc__.split("\n\n")[0])
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--service", choices=SERVICES, help="service kind; instance name derived from the env")
    who.add_argument("--instance", help="instance name, e.g. admission-s0 or engine-s0-glm-4.5-fp8")
    who.add_argument("--srv-ping", metavar="NAME", help="send $SRV.PING.<NAME> (NATS micro; any instance of NAME)")
    try:
        s: Settings | None = service_settings()
    except ValueError:
        s = None  # reported below, once the flags are read
    p.add_argument("--nats", default=",".join(s.nats_urls) if s else "nats://127.0.0.1:4222",
                   help="comma-separated NATS URLs (default: the service's TALARIA_NATS_URL)")
    p.add_argument("--subject-prefix", default=s.subject_prefix if s else "talaria",
                   help="the deployment's subject prefix (default: TALARIA_SUBJECT_PREFIX)")
    p.add_argument("--user", default=s.nats_user if s else None, help="NATS user (default: TALARIA_NATS_USER)")
    p.add_argument("--password", default=s.nats_password if s else None,
                   help="NATS password (prefer the environment variable, as the service reads it)")
    p.add_argument("--timeout", type=positive_float, default=3.0, help="seconds for connect and for the answer")
    p.add_argument("-q", "--quiet", action="store_true")
    a = p.parse_args(argv)
    if a.service == "gateway":
        port = s.gateway_port if s else 8080
        url = f"http://127.0.0.1:{port}/health"
        ok, detail = http_check(url, a.timeout)
        if not a.quiet:
            print(f"{'healthy' if ok else 'unhealthy'}: {url}: {detail}", file=sys.stdout if ok else sys.stderr)
        return 0 if ok else 1
    try:
        if a.srv_ping:
            subject = f"$SRV.PING.{a.srv_ping}"
        else:
            inst = a.instance or instance_name(a.service)
            subject = Subjects(a.subject_prefix).health(inst)
    except ValueError as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    urls = [u.strip() for u in a.nats.split(",") if u.strip()]
    ok, detail = asyncio.run(check(urls, subject, a.timeout, a.user, a.password))
    if not a.quiet:
        print(f"{'healthy' if ok else 'unhealthy'}: {subject}: {detail}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
