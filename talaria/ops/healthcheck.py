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
import os
import sys

from shared.auth import nats_password_from_env
from shared.subjects import Subjects
from talaria.argtypes import positive_float

SERVICES = ("router", "admission", "substrate", "engine")


def instance_name(service: str, env: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The health-endpoint instance of a service kind, from its environment."""
    server = env.get("TALARIA_SERVER_ID", "s0")
    if service == "router":
        iid = env.get("TALARIA_INSTANCE_ID")
        if not iid:
            raise ValueError("router: set TALARIA_INSTANCE_ID (the router's instance name otherwise is its pid)")
        return f"router-{iid}"
    if service in ("admission", "substrate"):
        return f"{service}-{server}"
    if service == "engine":
        model = env.get("TALARIA_MODEL", "")
        if not model:
            raise ValueError("engine: TALARIA_MODEL is not set")
        return f"engine-{server}-{model}"
    raise ValueError(f"unknown service kind {service!r} (one of {', '.join(SERVICES)})")


async def check(nats_urls: list[str], subject: str, timeout_s: float,
                user: str | None = None, password: str | None = None) -> tuple[bool, str]:
    import nats
    from nats.errors import NoRespondersError, NoServersError
    from nats.errors import TimeoutError as NatsTimeout

    async def quiet(_exc: Exception) -> None:
        pass

    try:
        # max_reconnect_attempts=0 means "forever" in nats-py; 1 = one more try per server.
        nc = await asyncio.wait_for(
            nats.connect(servers=nats_urls, connect_timeout=timeout_s, max_reconnect_attempts=1,
                         reconnect_time_wait=0.1, allow_reconnect=False, error_cb=quiet,
                         user=user or None, password=password or None,
                         name="talaria-healthcheck"),
            timeout=timeout_s * 2 + 1)
    except (NoServersError, OSError, asyncio.TimeoutError) as exc:
        return False, f"cannot reach NATS at {','.join(nats_urls)}: {type(exc).__name__}: {exc}"
    try:
        msg = await nc.request(subject, b"", timeout=timeout_s)
        return True, msg.data.decode(errors="replace") or "ok"
    except NoRespondersError:
        return False, f"no responder on {subject}"
    except (NatsTimeout, asyncio.TimeoutError):
        return False, f"no answer on {subject} within {timeout_s:g} s"
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m talaria.ops.healthcheck", description=__doc__.split("\n\n")[0])
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--service", choices=SERVICES, help="service kind; instance name derived from the env")
    who.add_argument("--instance", help="instance name, e.g. admission-s0 or engine-s0-glm-4.5-fp8")
    who.add_argument("--srv-ping", metavar="NAME", help="send $SRV.PING.<NAME> (NATS micro; any instance of NAME)")
    p.add_argument("--nats", default=os.environ.get("TALARIA_NATS_URL", "nats://127.0.0.1:4222"),
                   help="comma-separated NATS URLs")
    p.add_argument("--subject-prefix", default=os.environ.get("TALARIA_SUBJECT_PREFIX", "talaria"))
    p.add_argument("--user", default=os.environ.get("TALARIA_NATS_USER"))
    p.add_argument("--password", default=nats_password_from_env(os.environ.get("TALARIA_NATS_USER"), dict(os.environ)),
                   help="prefer the environment variable")
    p.add_argument("--timeout", type=positive_float, default=3.0, help="seconds for connect and for the answer")
    p.add_argument("-q", "--quiet", action="store_true")
    a = p.parse_args(argv)
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
