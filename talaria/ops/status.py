"""`talaria status`: what a running deployment is doing, from its credentials file.

Every service's health (its `<prefix>.health.<instance>` endpoint, as the
compose health checks ask it; routers are found by a NATS micro ping, as
their ids are free; the HTTP gateway, an agent with no health subject, by its
GET /health when the file names its URL), what the router reports (policy,
time scale, servers, models), and each server's active model from the
admission's mirror in Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import nats
import nats.errors
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.keys import Keys
from shared.redis_client import open_redis
from shared.state import decode_server
from talaria.argtypes import positive_float
from talaria.client import Deployment, TalariaClient, TalariaError
from talaria.ops.healthcheck import connect_once
from talaria.ops.stack import LOCK_FILE, RESTARTS_FILE, STOPPING, log_dir_holder


@dataclass
class Status:
    where: str
    policy: str = ""
    time_scale: float = 0.0
    servers: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    health: dict[str, str] = field(default_factory=dict)  # instance -> "ok" or what went wrong
    active: dict[str, str] = field(default_factory=dict)  # server -> its active model ("" = none yet)
    problems: list[str] = field(default_factory=list)
    restarts: dict[str, dict[str, Any]] = field(default_factory=dict)  # process -> its restarts (`talaria up`'s)

    @property
    def healthy(self) -> bool:
        return not self.problems and bool(self.health) and all(v == "ok" for v in self.health.values())


async def _instances(nc: nats.NATS, wait_s: float, subject_prefix: str) -> list[str]:
    """Service instances of this deployment that answer NATS micro's $SRV.PING: each
    answers with its metadata, the instance name and the subject prefix, so a router's
    replicas, and the services of a deployment whose router does not answer, are found."""
    inbox = nc.new_inbox()
    found: list[str] = []

    async def answer(msg) -> None:  # type: ignore[no-untyped-def]
        try:
            meta = json.loads(msg.data)["metadata"]
            if meta.get("subject_prefix", subject_prefix) == subject_prefix:
                found.append(str(meta["instance"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            pass

    sub = await nc.subscribe(inbox, cb=answer)
    await nc.publish("$SRV.PING", b"", reply=inbox)
    await asyncio.sleep(wait_s)
    await sub.unsubscribe()
    return sorted(set(found))


def gateway_health_url(openai_base_url: str) -> str:
    """The gateway's GET /health, at the root of the OpenAI-style base URL (`<root>/v1`) the file names."""
    return f"{openai_base_url.rstrip('/').removesuffix('/v1')}/health"


async def _gateway_health(url: str, timeout_s: float) -> str:
    """`ok`, or what went wrong, worded as the NATS rows are."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
            async with http.get(url) as r:
                if r.status == 200:
                    return "ok"
                try:  # the gateway says why ({"status": "nats disconnected"})
                    why = str((await r.json(content_type=None))["status"])
                except (ValueError, KeyError, TypeError, aiohttp.ClientError):
                    why = r.reason or ""
                return f"HTTP {r.status}" + (f" ({why})" if why else "")
    except asyncio.TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except aiohttp.ClientError:
        return f"unreachable at {url}"


async def gather(dep: Deployment, timeout_s: float = 3.0) -> Status:
    st = Status(where=",".join(dep.nats_urls))
    try:
        client = await TalariaClient.from_deployment(dep, connect_timeout_s=timeout_s, retries=0)
    except OSError as exc:  # ConnectionError and LoginRefused
        st.problems.append(str(exc))
        return st
    try:
        info = await client.info()
        st.policy, st.time_scale, st.servers, st.models = info.policy, info.time_scale, list(info.servers), list(info.models)
    except TalariaError as exc:
        st.problems.append(f"no router answers under subject prefix {dep.subject_prefix!r}: {exc}")
    finally:
        await client.close()

    login = dep.operator
    if login is None:
        st.problems.append("health not checked: the credentials file has no operator login")
    else:
        # (bounded: nats-py's own connect may retry a server that went away meanwhile for long)
        nc = await connect_once(dep.nats_urls, timeout_s, "talaria-status", login.user, login.password)
        try:
            found = await _instances(nc, min(1.0, timeout_s), dep.subject_prefix)
            routers = [i for i in found if i.startswith("router-")]
            if not routers:
                st.health["router-*"] = "no router answers its ping"
            # what the router says should run, and what answered (all of it, when no router answers)
            others = [f"{kind}-{sid}" for sid in st.servers for kind in ("admission", "substrate")]
            others += [f"engine-{sid}-{m}" for sid in st.servers for m in st.models]
            others += [i for i in found if i not in routers and i not in others]

            async def health(instance: str) -> None:
                try:
                    await nc.request(f"{dep.subject_prefix}.health.{instance}", b"", timeout=timeout_s)
                    st.health[instance] = "ok"
                except nats.errors.NoRespondersError:
                    st.health[instance] = "down (no responder)"
                except nats.errors.TimeoutError:
                    st.health[instance] = f"no answer within {timeout_s:g} s"

            await asyncio.gather(*(health(i) for i in routers + others))
        finally:
            await nc.close()
    if dep.openai_base_url:  # the gateway has no health subject (an agent of Talaria): its HTTP /health, no login
        st.health["gateway"] = await _gateway_health(gateway_health_url(dep.openai_base_url), timeout_s)

    if dep.redis_url and st.servers:
        # bounded as the health checks are: a stopped Redis accepts connections and answers nothing
        r = open_redis(dep.redis_url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                       retry=Retry(NoBackoff(), 0))
        try:
            keys = Keys(dep.key_prefix)
            for sid in st.servers:
                st.active[sid] = decode_server(await r.hgetall(keys.server(sid))).load.active or ""
                for m in st.models:  # an engine-worker starting (loading weights) or draining (a rolling restart)
                    engine_state = await r.hget(keys.engine(sid, m), "state")
                    instance = f"engine-{sid}-{m}"
                    if engine_state is not None and engine_state.decode() != "ready" and instance in st.health:
                        st.health[instance] += f" ({engine_state.decode()})"
            st.health["redis"] = "ok"
        except Exception as exc:  # an operator's extra: the health table stands without it
            st.health["redis"] = (f"no answer within {timeout_s:g} s" if isinstance(exc, RedisTimeoutError)
                                  else f"down ({type(exc).__name__})")
            st.problems.append(f"could not read the deployment's Redis: {exc}")
        finally:
            await r.aclose()
    elif st.servers:
        st.problems.append("active models not read: the credentials file names no Redis")
    return st


def render(st: Status) -> str:
    out = [f"deployment at {st.where}"]
    if st.policy:
        out.append(f"  policy {st.policy}, time scale {st.time_scale:g}x, servers {', '.join(st.servers)}, "
                   f"models {', '.join(st.models)}")
    if st.health:
        width = max(len(k) for k in st.health)
        out.append("")
        out.append(f"{'service':<{width}}  health")
        out.extend(f"{k:<{width}}  {v}" for k, v in sorted(st.health.items()))
    if st.active:
        out.append("")
        out.append("server  active model")
        out.extend(f"{sid:<6}  {m or '(none yet)'}" for sid, m in st.active.items())
    if st.restarts:
        out.append("")
        out.append("restarted after an unexpected exit (this `talaria up`; its log says why):")
        for name, r in sorted(st.restarts.items()):
            at = r.get("last_exit_at")
            when = time.strftime(" at %H:%M:%S", time.localtime(at)) if isinstance(at, (int, float)) else ""
            out.append(f"  {name}: {r.get('restarts')} time(s), last exit code {r.get('last_exit_code')}{when}")
    for p in st.problems:
        out.append(f"  ! {p}")
    return "\n".join(out)


def cmd_status(a: argparse.Namespace) -> int:
    folder = Path(a.credentials).parent
    holder = log_dir_holder(folder)  # the pid of the `talaria up` that runs from it, and whether it stops
    if holder is not None and holder.endswith(STOPPING):
        print(f"talaria up (pid {holder.split()[0]}) is stopping: not ready; its logs are in {folder}", file=sys.stderr)
        return 1
    try:
        dep = Deployment.load(a.credentials)
    except ValueError as exc:
        if holder is not None and not Path(a.credentials).exists():  # (written once every service answers)
            print(f"talaria up (pid {holder}) is still starting: not ready; its logs are in {folder}", file=sys.stderr)
            return 1
        if holder is None and not Path(a.credentials).exists():
            print(f"talaria: error: no `talaria up` runs from {folder} ({Path(a.credentials).name} is written "
                  "there while one runs; see --credentials for another)", file=sys.stderr)
            return 2
        print(f"talaria: error: {exc} (`talaria up` writes it; see --credentials)", file=sys.stderr)
        return 2
    if holder is None and (folder / LOCK_FILE).exists():
        # a `talaria up` wrote it and no longer runs: killed before it could remove it
        print(f"talaria: error: no talaria up runs from {folder}: {a.credentials} was left by one that ended "
              "without stopping (killed); start it again", file=sys.stderr)
        return 2
    st = asyncio.run(gather(dep, a.timeout))
    if holder is not None:  # (a `talaria up` here: its supervisor writes down what it restarted)
        st.restarts = read_restarts(folder / RESTARTS_FILE)
    print(render(st))
    return 0 if st.healthy else 1


def read_restarts(path: Path) -> dict[str, dict[str, Any]]:
    """The restarts a running `talaria up` wrote down (none where it restarted nothing)."""
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in got.items() if isinstance(v, dict)} if isinstance(got, dict) else {}


def configure_parser(p: argparse.ArgumentParser, default_credentials: Path) -> None:
    p.add_argument("--credentials", metavar="FILE", default=str(default_credentials),
                   help=f"the credentials file `talaria up` writes (default {default_credentials})")
    p.add_argument("--timeout", type=positive_float, default=3.0, help="seconds to wait for each answer (default 3)")
    p.set_defaults(fn=cmd_status)
