"""The GPU deployment (compose.yaml, deploy/, .env.example) checked without Docker.

No Docker engine runs where these tests run, so:

- compose.yaml is validated against the Compose Specification's JSON schema
  (deploy/compose-spec.json, a verbatim copy) and against our own rules (GPU
  reservations, health checks, restart policies, depends_on conditions);
- deploy/nats/nats.conf and deploy/redis/redis.conf are loaded by the real
  nats-server and redis-server binaries;
- every service of ours is started outside Docker with exactly the command
  and environment compose.yaml gives it (env files, then its `environment:`
  block), with only the NATS and Redis URLs rewritten to a test NATS and
  Redis on free ports, and the GPU engine-workers on the sim backend; each
  must pass its own compose healthcheck command, and an agent call must go
  through them.

What this does not show: that the images build and run (deploy/Dockerfile,
deploy/Dockerfile.vllm), or anything on a GPU. See docs/deploy.md.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

from talaria.ops import healthcheck  # noqa: E402
from shared.net import free_port
from shared.settings import Settings, SettingsError
from talaria.ops.binaries import find_nats_server, find_redis_server
from talaria.ops.nats_server import NatsServer
from talaria.ops.processes import ProcessGroup
from talaria.ops.redis_server import RedisServer# noqa: E402
from talaria.ops.stack import DEFAULT_MODELS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
SCHEMA = ROOT / "deploy" / "compose-spec.json"
ENV_EXAMPLE = ROOT / ".env.example"
SERVICE_KINDS = {"services.router": "router", "services.gateway": "gateway", "services.admission": "admission",
                 "services.substrate": "substrate", "services.engine": "engine"}
SETTING_RE = re.compile(r"^\s*#?\s*(TALARIA_[A-Z0-9_]+)=")

pytestmark = pytest.mark.timeout(180)


# --------------------------------------------------------------------------- helpers


def load_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


WATCHDOG = ["python", "-m", "talaria.ops.watchdog"]


def service_command(cmd: list[str]) -> list[str]:
    """The service's own command: under the container watchdog, what follows its `--`."""
    if cmd[:3] == WATCHDOG and "--" in cmd:
        return cmd[cmd.index("--") + 1:]
    return cmd


def service_module(svc: dict[str, Any]) -> str:
    return service_command(svc["command"])[2]


def ours(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Services that run one of our modules (python -m services.<x>, under the watchdog or not)."""
    out = {}
    for name, svc in compose["services"].items():
        cmd = svc.get("command")
        if isinstance(cmd, list) and len(cmd) >= 3:
            inner = service_command(cmd)
            if len(inner) >= 3 and inner[1] == "-m" and inner[2].startswith("services."):
                out[name] = svc
    return out


def parse_env_file(path: Path) -> dict[str, str]:
    """Compose's env-file rules for the subset we use: KEY=VALUE lines, '#' comments, blanks."""
    env: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not KEY=VALUE: {raw!r}"
        assert key == key.strip() and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), f"bad key {key!r}"
        env[key] = value
    return env


def env_files(svc: dict[str, Any]) -> list[tuple[Path, bool]]:
    spec = svc.get("env_file", [])
    if isinstance(spec, str):
        spec = [spec]
    out = []
    for item in spec:
        if isinstance(item, str):
            out.append((ROOT / item, True))
        else:
            out.append((ROOT / item["path"], bool(item.get("required", True))))
    return out


def service_env(svc: dict[str, Any]) -> dict[str, str]:
    """The environment compose gives the container: env files in order, then `environment:`.

    Optional env files that do not exist are skipped, as compose does; a developer's
    own `.env` is skipped too, so the test sees only what the repository ships.
    """
    env: dict[str, str] = {}
    for path, required in env_files(svc):
        if not required:
            continue
        env.update(parse_env_file(path))
    block = svc.get("environment") or {}
    if isinstance(block, list):
        block = dict(item.split("=", 1) for item in block)
    env.update({k: "" if v is None else str(v) for k, v in block.items()})
    return env


def host_argv(cmd: list[str]) -> list[str]:
    """A container command run here: `python` is this interpreter."""
    if cmd and cmd[0] == "CMD":
        cmd = cmd[1:]
    return [sys.executable if c == "python" else c for c in cmd]


def settings_read_by_code() -> set[str]:
    names: set[str] = set()
    for pkg in ("shared", "services", "talaria"):
        for f in (ROOT / pkg).rglob("*.py"):
            names.update(re.findall(r"\b(TALARIA_[A-Z0-9_]*[A-Z0-9])\b", f.read_text()))
    return names


# --------------------------------------------------------------------------- the schema


def test_compose_matches_the_compose_spec_schema() -> None:
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(load_compose()), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_the_schema_does_reject_a_broken_file() -> None:
    """The validator is live: a wrong depends_on condition and an unknown key fail."""
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    doc = load_compose()
    doc["services"]["router"]["depends_on"]["nats"]["condition"] = "service_ready"
    doc["services"]["admission"]["restart_policy"] = "always"
    messages = [e.message for e in validator.iter_errors(doc)]
    assert len(messages) >= 2


# the design notes' copy, where a checkout sits beside them (a sibling `shared/` folder)
SHARED_SCHEMA = ROOT.parent / "shared" / "schemas" / "compose-spec.json"


@pytest.mark.skipif(not SHARED_SCHEMA.exists(), reason="no shared copy here")
def test_repo_schema_is_the_verbatim_copy() -> None:
    assert SCHEMA.read_bytes() == SHARED_SCHEMA.read_bytes()


# --------------------------------------------------------------------------- our rules


def test_every_service_of_ours_runs_a_module_that_exists() -> None:
    compose = load_compose()
    services = ours(compose)
    kinds = set()
    for name, svc in services.items():
        cmd = service_command(svc["command"])
        assert cmd[:2] == ["python", "-m"] and len(cmd) == 3, f"{name}: {cmd}"
        module = cmd[2]
        # every one runs under the container watchdog, watching its own kind
        wrapper = svc["command"]
        assert wrapper[:3] == WATCHDOG and wrapper[wrapper.index("--service") + 1] == module.split(".")[1], name
        assert module in SERVICE_KINDS, f"{name}: unknown module {module}"
        assert importlib.util.find_spec(module) is not None, f"{name}: no module {module}"
        assert importlib.util.find_spec(f"{module}.__main__") is not None, f"{name}: {module} has no __main__"
        kinds.add(SERVICE_KINDS[module])
    assert kinds == set(SERVICE_KINDS.values())
    assert {"router", "admission", "substrate-manager"} <= set(services)


def test_one_gpu_engine_worker_per_default_model() -> None:
    compose = load_compose()
    engines = {n: s for n, s in ours(compose).items() if service_module(s) == "services.engine"}
    models = sorted(service_env(s)["TALARIA_MODEL"] for s in engines.values())
    assert models == sorted(DEFAULT_MODELS)
    catalog_models = service_env(next(iter(engines.values())))["TALARIA_MODELS"].split(",")
    assert sorted(catalog_models) == sorted(DEFAULT_MODELS)
    for name, svc in engines.items():
        env = service_env(svc)
        assert env["TALARIA_SERVER_ID"] and env["TALARIA_ENGINE"] == "vllm", name
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert any(d.get("driver") == "nvidia" and "gpu" in d["capabilities"] for d in devices), name
        mounts = [v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in svc["volumes"]]
        assert any(m.split(":")[0] == "model-weights" for m in mounts), name
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile.vllm"
    assert "model-weights" in compose["volumes"]


def test_each_gpu_engine_worker_resolves_to_its_own_model_and_context_length() -> None:
    # Without TALARIA_VLLM_MODEL a worker would serve some default model under its
    # model's name; each must name its own folder on the weights volume and the
    # catalog's context length for that model.
    from shared.catalog import load_catalog
    from shared.settings import VllmSettings

    catalog = load_catalog()
    compose = load_compose()
    vllm_workers = {n: s for n, s in ours(compose).items()
                    if service_module(s) == "services.engine" and service_env(s).get("TALARIA_ENGINE") == "vllm"}
    assert vllm_workers
    targets = set()
    for name, svc in vllm_workers.items():
        env = service_env(svc)
        model = env["TALARIA_MODEL"]
        vs = VllmSettings.from_env(env, check_model_dir=False)
        assert Path(vs.model_dir).name == model, (name, vs.model_dir)
        assert vs.max_model_len == catalog.models[model].context_limit, name
        mounts = [v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in svc["volumes"]]
        weights = next(m.split(":")[1] for m in mounts if m.split(":")[0] == "model-weights")
        assert Path(vs.model_dir).parent == Path(weights), (name, vs.model_dir, weights)
        targets.add(vs.model_dir)
    assert len(targets) == len(vllm_workers)  # no two workers share a folder


@pytest.mark.parametrize("module,env", [
    ("services.router", {"TALARIA_TIME_SCALE": "fast"}),
    ("services.admission", {"TALARIA_METRICS_PORT": "9464x"}),
    ("services.gateway", {"TALARIA_GATEWAY_KEEPALIVE_S": "ten"}),
    ("services.engine", {"TALARIA_HEARTBEAT_WALL_S": "1s"}),
])
def test_a_bad_setting_stops_a_service_in_one_line_naming_it(module: str, env: dict[str, str]) -> None:
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", module], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 78, out  # a configuration error: a restart would not mend it
    name = next(iter(env))
    assert out.stderr.startswith("talaria: error: ") and name in out.stderr and "Traceback" not in out.stderr, out


@pytest.mark.parametrize("name,value,said", [
    ("TALARIA_HEARTBEAT_WALL_S", "0", "must be above 0, not 0"),  # admission busy-looped into restarts
    ("TALARIA_HEARTBEAT_WALL_S", "-1", "must be above 0"),
    ("TALARIA_MAX_QUEUED", "-1", "must be at least 0, not -1"),  # read as no bound at all
    ("TALARIA_LOG_MAX_BYTES", "-5", "must be at least 0"),       # read as never rotate
    ("TALARIA_SESSION_IDLE_S", "-1", "must be above 0"),
    ("TALARIA_SWITCH_COST_SCALE", "-1", "must be at least 0"),
    ("TALARIA_SESSION_IDLE_S", "nan", "not nan"),
    ("TALARIA_METRICS_PORT", "70000", "at most 65535"),
    ("TALARIA_CALL_RECORD_REPLICAS", "7", "at most 5"),
    ("TALARIA_LOG_LEVEL", "LOUD", "must be one of DEBUG, INFO, WARNING, ERROR, not 'LOUD'"),  # quietly INFO
    ("TALARIA_LOG_FORMAT", "xml", "must be one of json, console"),                             # quietly JSON
])
def test_a_setting_out_of_its_range_is_refused_naming_it_not_read_as_another(name: str, value: str, said: str) -> None:
    with pytest.raises(SettingsError) as e:
        Settings.from_env([], {name: value})
    assert str(e.value).startswith(name) and said in str(e.value), e.value
    # the ends of the ranges that mean something are taken
    s = Settings.from_env([], {"TALARIA_MAX_QUEUED": "0", "TALARIA_LOG_MAX_BYTES": "0", "TALARIA_SWITCH_COST_SCALE": "0",
                               "TALARIA_METRICS_PORT": "65535", "TALARIA_LOG_LEVEL": "debug"})
    assert (s.max_queued, s.log_max_bytes, s.switch_cost_scale, s.metrics_port, s.log_level) == (0, 0, 0.0, 65535, "DEBUG")


def test_vllm_settings_refuse_a_missing_or_unreadable_model_folder(tmp_path: Path) -> None:
    from shared.settings import SettingsError, VllmSettings

    with pytest.raises(SettingsError, match="TALARIA_VLLM_MODEL"):
        VllmSettings.from_env({})
    with pytest.raises(SettingsError, match="TALARIA_VLLM_MODEL"):
        VllmSettings.from_env({"TALARIA_VLLM_MODEL": "  "}, check_model_dir=False)
    with pytest.raises(SettingsError, match="TALARIA_VLLM_MODEL"):
        VllmSettings.from_env({"TALARIA_VLLM_MODEL": str(tmp_path / "absent")})
    (tmp_path / "file").write_text("")
    with pytest.raises(SettingsError, match="TALARIA_VLLM_MODEL"):
        VllmSettings.from_env({"TALARIA_VLLM_MODEL": str(tmp_path / "file")})
    with pytest.raises(SettingsError, match="config.json"):  # a folder, but not a model's
        VllmSettings.from_env({"TALARIA_VLLM_MODEL": str(tmp_path)})
    (tmp_path / "config.json").write_text("{}")
    vs = VllmSettings.from_env({"TALARIA_VLLM_MODEL": str(tmp_path), "TALARIA_VLLM_SLEEP_LEVEL": "1",
                                "TALARIA_VLLM_HOST_KV": "1", "TALARIA_VLLM_ENGINE_ARGS": '{"tensor_parallel_size": 8}'})
    assert vs.model_dir == str(tmp_path) and vs.max_model_len == 2048 and vs.block_size == 32
    assert vs.eager and vs.kv_port == 0 and vs.sleep_level == 1 and vs.host_kv
    assert vs.engine_args == {"tensor_parallel_size": 8}
    assert VllmSettings.from_env({"TALARIA_VLLM_MODEL": str(tmp_path)}).sleep_level is None
    for bad in ({"TALARIA_VLLM_SLEEP_LEVEL": "2"}, {"TALARIA_VLLM_ENGINE_ARGS": "[1]"},
                {"TALARIA_VLLM_ENGINE_ARGS": "{"}, {"TALARIA_VLLM_MAX_MODEL_LEN": "lots"}):
        with pytest.raises(SettingsError, match=next(iter(bad))):
            VllmSettings.from_env({"TALARIA_VLLM_MODEL": str(tmp_path), **bad})


def test_deploy_doc_lists_every_vllm_setting() -> None:
    code = (ROOT / "services/engine/vllm_backend.py").read_text() + (ROOT / "shared/settings.py").read_text()
    used = set(re.findall(r"TALARIA_VLLM_[A-Z0-9_]+", code))
    assert {"TALARIA_VLLM_MODEL", "TALARIA_VLLM_MAX_MODEL_LEN"} <= used
    table = {m for line in (ROOT / "docs/deploy.md").read_text().splitlines() if line.startswith("| `TALARIA_VLLM_")
             for m in re.findall(r"`(TALARIA_VLLM_[A-Z0-9_]+)`", line.split("|")[1])}
    assert used <= table, f"docs/deploy.md's settings table lacks {sorted(used - table)}"


def test_health_checks_restarts_and_start_order() -> None:
    compose = load_compose()
    svcs = compose["services"]
    assert "/healthz" in " ".join(svcs["nats"]["healthcheck"]["test"])
    redis_hc = " ".join(svcs["redis"]["healthcheck"]["test"])
    assert "redis-cli" in redis_hc and "ping" in redis_hc and "TALARIA_REDIS_PASSWORD" in redis_hc
    for name, svc in svcs.items():
        assert svc.get("restart") in ("always", "unless-stopped", "on-failure"), name
        assert svc.get("healthcheck", {}).get("test"), f"{name}: no healthcheck"
    for name, svc in ours(compose).items():
        test = svc["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "talaria.ops.healthcheck"], name
        deps = svc["depends_on"]
        for infra in ("nats", "redis"):
            assert deps[infra]["condition"] == "service_healthy", f"{name} -> {infra}"
        for dep, spec in deps.items():
            # (the gateway's on the services behind it orders the stop, not the start)
            started_only = name == "gateway" and dep not in ("nats", "redis", "router")
            assert dep in svcs and spec["condition"] == ("service_started" if started_only else "service_healthy"), \
                f"{name} -> {dep}"


def test_the_gateway_stops_before_the_services_that_serve_its_calls() -> None:
    """Compose stops a service before those it depends on: the gateway's drain lets its
    calls in flight finish only while admission, the substrate and the engines still run."""
    svcs = load_compose()["services"]
    behind = {n for n in ours(load_compose()) if n != "gateway" and n != "router"}
    assert behind and behind <= set(svcs["gateway"]["depends_on"]), behind - set(svcs["gateway"]["depends_on"])


def test_dockerfiles_and_config_files_exist() -> None:
    compose = load_compose()
    for svc in compose["services"].values():
        if "build" in svc:
            assert (ROOT / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0] if isinstance(vol, str) else vol["source"]
            if src.startswith("."):
                assert (ROOT / src).exists(), src  # a config file or a config folder
    base = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", base, re.M) and "pip install ." in base
    gpu = (ROOT / "deploy" / "Dockerfile.vllm").read_text()
    pinned = re.search(r"^ARG VLLM_VERSION=(\d+\.\d+\.\d+)$", gpu, re.M)
    assert pinned and "FROM vllm/vllm-openai:v${VLLM_VERSION}" in gpu
    assert all(s["build"]["args"]["VLLM_VERSION"] == pinned.group(1)
               for s in compose["services"].values() if s.get("build", {}).get("dockerfile") == "deploy/Dockerfile.vllm")


# --------------------------------------------------------------------------- settings


def test_env_example_names_every_setting_with_a_comment() -> None:
    lines = ENV_EXAMPLE.read_text().splitlines()
    named: dict[str, int] = {}
    for i, line in enumerate(lines):
        m = SETTING_RE.match(line)
        if m:
            named.setdefault(m.group(1), i)
            prev = lines[i - 1].strip() if i else ""
            assert prev.startswith("#") and not SETTING_RE.match(prev), f"{m.group(1)}: no comment line above it"
    missing = settings_read_by_code() - set(named)
    assert not missing, f".env.example does not name {sorted(missing)}"
    active = parse_env_file(ENV_EXAMPLE)
    assert all(k.startswith("TALARIA_") for k in active)
    # the deployment's defaults: real time, services reach NATS and Redis by their compose names
    assert active["TALARIA_TIME_SCALE"] == "1"
    assert active["TALARIA_NATS_URL"] == "nats://nats:4222"
    assert active["TALARIA_REDIS_URL"] == "redis://redis:6379/0"
    for name, svc in ours(load_compose()).items():
        assert (ENV_EXAMPLE, True) in env_files(svc), name


def test_env_example_values_are_accepted_by_the_settings_parser() -> None:
    from shared.settings import Settings

    env = parse_env_file(ENV_EXAMPLE)
    old = {k: v for k, v in os.environ.items() if k.startswith("TALARIA_")}
    try:
        for k in old:
            del os.environ[k]
        os.environ.update(env)
        s = Settings.from_env([])
    finally:
        for k in env:
            os.environ.pop(k, None)
        os.environ.update(old)
    assert s.nats_urls == ["nats://nats:4222"] and s.policy.name == "talaria"
    assert s.models == DEFAULT_MODELS


# --------------------------------------------------------------------------- NATS and Redis configs


def test_nats_conf_loads_with_jetstream(tmp_path: Path) -> None:
    port, mon = free_port(), free_port()
    # The file as shipped, but JetStream's store in a temp dir instead of the container's volume
    # (nats-server refuses -sd beside a store_dir in the file).
    conf = (ROOT / "deploy/nats/nats.conf").read_text()
    assert conf.count('store_dir: "/data/jetstream"') == 1
    local = tmp_path / "nats.conf"
    local.write_text(conf.replace('store_dir: "/data/jetstream"', f'store_dir: "{tmp_path / "js"}"'))
    (tmp_path / "auth.conf").write_text((ROOT / "deploy/nats/auth.conf").read_text())
    argv = [find_nats_server(), "-c", str(local), "-a", "127.0.0.1", "-p", str(port), "-m", str(mon)]
    group = ProcessGroup()
    # the role passwords auth.conf reads as $VARIABLES, from the env file as compose hands them over
    group.add("nats-conf", argv, env=parse_env_file(ENV_EXAMPLE), log_path=tmp_path / "nats.log")
    group.start_all()
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{mon}/healthz?js-enabled-only=true", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert group.running("nats-conf"), (tmp_path / "nats.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "nats.log").read_text()
            time.sleep(0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{mon}/jsz", timeout=2) as r:
            jsz = json.loads(r.read())
        assert jsz["config"]["store_dir"].startswith(str(tmp_path / "js"))
        with urllib.request.urlopen(f"http://127.0.0.1:{mon}/varz", timeout=2) as r:
            varz = json.loads(r.read())
        assert varz["server_name"] == "talaria-nats-0" and varz["max_payload"] == 8 * 1024 * 1024
    finally:
        group.stop_all()


def test_nats_auth_conf_is_generated_from_shared_auth() -> None:
    from talaria.ops.deploy_auth import auth_conf

    assert (ROOT / "deploy/nats/auth.conf").read_text() == auth_conf(parse_env_file(ENV_EXAMPLE)["TALARIA_SUBJECT_PREFIX"])


async def test_shipped_nats_config_refuses_anonymous_and_admits_roles(tmp_path: Path) -> None:
    import nats as nats_py

    port, mon = free_port(), free_port()
    conf = (ROOT / "deploy/nats/nats.conf").read_text().replace('store_dir: "/data/jetstream"', f'store_dir: "{tmp_path / "js"}"')
    (tmp_path / "nats.conf").write_text(conf)
    (tmp_path / "auth.conf").write_text((ROOT / "deploy/nats/auth.conf").read_text())
    env = parse_env_file(ENV_EXAMPLE)
    group = ProcessGroup()
    group.add("nats-auth", [find_nats_server(), "-c", str(tmp_path / "nats.conf"), "-a", "127.0.0.1", "-p", str(port),
                            "-m", str(mon)], env=env, log_path=tmp_path / "nats.log")
    group.start_all()
    try:
        url = f"nats://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                nc = await nats_py.connect(url, user="agent", password=env["TALARIA_NATS_PASSWORD_AGENT"],
                                           allow_reconnect=False, connect_timeout=1)
                break
            except Exception:
                assert group.running("nats-auth"), (tmp_path / "nats.log").read_text()
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
        await nc.close()
        with pytest.raises(Exception):
            await nats_py.connect(url, allow_reconnect=False, connect_timeout=1)
        with pytest.raises(Exception):
            await nats_py.connect(url, user="router", password="wrong", allow_reconnect=False, connect_timeout=1)
    finally:
        group.stop_all()


def test_redis_conf_loads(tmp_path: Path) -> None:
    import redis

    port = free_port()
    argv = [find_redis_server(), str(ROOT / "deploy/redis/redis.conf"), "--port", str(port),
            "--bind", "127.0.0.1", "--dir", str(tmp_path)]
    group = ProcessGroup()
    group.add("redis-conf", argv, log_path=tmp_path / "redis.log")
    group.start_all()
    try:
        r = redis.Redis(port=port, socket_connect_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                if r.ping():
                    break
            except redis.ConnectionError:
                pass
            assert group.running("redis-conf"), (tmp_path / "redis.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert r.config_get("maxmemory-policy")["maxmemory-policy"] == "volatile-lru"
        assert r.config_get("save")["save"] == "" and r.config_get("appendonly")["appendonly"] == "no"
        r.close()
    finally:
        group.stop_all()


# --------------------------------------------------------------------------- the healthcheck module


def test_healthcheck_instance_names() -> None:
    env = {"TALARIA_SERVER_ID": "s3", "TALARIA_MODEL": "glm-4.5-fp8", "TALARIA_INSTANCE_ID": "2"}
    assert healthcheck.instance_name("router", env) == "router-2"
    assert healthcheck.instance_name("admission", env) == "admission-s3"
    assert healthcheck.instance_name("substrate", env) == "substrate-s3"
    assert healthcheck.instance_name("engine", env) == "engine-s3-glm-4.5-fp8"
    with pytest.raises(ValueError):
        healthcheck.instance_name("engine", {"TALARIA_SERVER_ID": "s0"})


def test_healthcheck_fails_without_nats_or_responder(nats_server: NatsServer) -> None:
    dead = f"nats://127.0.0.1:{free_port()}"
    assert healthcheck.main(["--instance", "admission-s0", "--nats", dead, "--timeout", "1", "-q"]) == 1
    assert healthcheck.main(["--instance", "nobody", "--nats", nats_server.url, "--timeout", "1", "-q"]) == 1


# --------------------------------------------------------------------------- end to end


@pytest.mark.e2e
@pytest.mark.timeout(300)
async def test_compose_services_start_outside_docker_and_serve_a_call(tmp_path: Path) -> None:
    from talaria.client import TalariaClient

    from shared.auth import ROLES, nats_permissions, role_password_var

    # NATS and Redis with authentication as compose configures them: per-role users
    # with the env file's passwords and allow-lists, and the Redis ACL user
    defaults = parse_env_file(ENV_EXAMPLE)
    nats = NatsServer(jetstream=True, store_dir=tmp_path / "js", log_file=tmp_path / "nats.log",
                      users=[(r, defaults[role_password_var(r)]) for r in ROLES],
                      permissions=nats_permissions(defaults["TALARIA_SUBJECT_PREFIX"]))
    redis = RedisServer(dir=tmp_path / "redis", log_file=tmp_path / "redis.log",
                        acl_users={defaults["TALARIA_REDIS_USER"]: defaults["TALARIA_REDIS_PASSWORD"]},
                        password="not-for-services")
    await nats.astart()
    await redis.astart()
    group = ProcessGroup()
    try:
        # Containers do not inherit the host's environment; keep only what a process
        # needs to run here (PATH, locale, HOME), never a TALARIA_* from the caller.
        host = {k: v for k, v in os.environ.items()
                if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV", "SYSTEMROOT")}
        host["PYTHONPATH"] = str(ROOT)  # the image installs the package; here, the checkout
        plan: list[tuple[str, list[str], list[str], dict[str, str]]] = []
        for name, svc in ours(load_compose()).items():
            env = service_env(svc)
            env["TALARIA_NATS_URL"] = nats.plain_url  # credentials: the service's role, from the env file
            env["TALARIA_REDIS_URL"] = f"redis://127.0.0.1:{redis.port}/0"  # user and password from the env file
            if env.get("TALARIA_ENGINE") == "vllm":
                env["TALARIA_ENGINE"] = "sim"  # no GPU here: the sim backend in the GPU worker's place
            # no weights volume here either: the gateway keeps stand-in ids, as for the sim engine
            env.pop("TALARIA_GATEWAY_TOKENIZERS", None)
            if service_module(svc) == "services.gateway":
                env["TALARIA_GATEWAY_PORT"] = str(free_port())  # the host's 8080 may be taken; the health check reads the same
            env["TALARIA_METRICS_PORT"] = str(free_port())  # each container has its own 9464; here, one host
            full = {**host, **env}
            plan.append((name, host_argv(svc["command"]), host_argv(svc["healthcheck"]["test"]), full))
            group.add(name, host_argv(svc["command"]), env=full, log_path=tmp_path / f"{name}.log", inherit_env=False)
        group.start_all()

        async def healthy(name: str, argv: list[str], env: dict[str, str]) -> None:
            deadline = time.monotonic() + 90
            while True:
                proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=subprocess.DEVNULL,
                                                            stderr=subprocess.DEVNULL, cwd=tmp_path)
                if await proc.wait() == 0:
                    return
                if not group.running(name) or time.monotonic() > deadline:
                    log = (tmp_path / f"{name}.log").read_text()[-3000:]
                    raise AssertionError(f"{name} not healthy (running={group.running(name)}):\n{log}")
                await asyncio.sleep(0.5)

        await asyncio.gather(*(healthy(name, hc, env) for name, _, hc, env in plan))

        prefix = plan[0][3]["TALARIA_SUBJECT_PREFIX"]
        client = await TalariaClient.connect([nats.plain_url], subject_prefix=prefix, silence_s=30.0,
                                             user="agent", password=defaults[role_password_var("agent")])
        try:
            session = await client.open_session("glm-4.5-air-fp8")
            reply = await asyncio.wait_for(
                session.call(prompt_tokens=512, max_tokens=16, sim_output_tokens=8, call_id=f"{session.session_id}#0"),
                timeout=150)
            await session.end()
        finally:
            await client.close()
        assert reply.output_tokens == 8 and reply.prompt_tokens == 512
        assert reply.server_id == "s0" and reply.model == "glm-4.5-air-fp8"
        # and over HTTP through the gateway, with the env file's API key
        import openai

        gw_port = next(env for name, _, _, env in plan if name == "gateway")["TALARIA_GATEWAY_PORT"]
        key = defaults["TALARIA_API_KEYS"].split(",")[0].split(":", 1)[1]
        http = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gw_port}/v1", api_key=key, max_retries=0)
        done = await asyncio.wait_for(http.chat.completions.create(
            model="glm-4.5-air-fp8", max_tokens=8, messages=[{"role": "user", "content": "hello"}]), timeout=150)
        assert done.usage.completion_tokens == 8
        for name in group.children:
            assert group.running(name) and not group[name].exit_codes, name
    finally:
        await group.astop_all(timeout=10)
        await redis.astop()
        await nats.astop()


def test_the_observability_profile_scrapes_every_service_and_provisions_grafana() -> None:
    """Prometheus and Grafana run only under `--profile observability`; Prometheus's config
    has every service of ours as a target on the metrics port of .env.example, labelled as
    the embedded stack labels its own; Grafana gets the data source and the dashboard."""
    import shutil
    import subprocess

    compose = load_compose()
    for name in ("prometheus", "grafana"):
        assert compose["services"][name]["profiles"] == ["observability"], name
    port = parse_env_file(ENV_EXAMPLE)["TALARIA_METRICS_PORT"]
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    groups = config["scrape_configs"][0]["static_configs"]
    targets = {g["targets"][0]: g["labels"]["service"] for g in groups}
    for name, svc in ours(compose).items():
        kind = service_module(svc).split(".")[1]
        assert targets.get(f"{name}:{port}") == kind, (name, targets)
    assert config["rule_files"] == ["alerts.yml"]  # beside the config, where compose mounts it
    assert "./deploy/prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in compose["services"]["prometheus"]["volumes"]
    mounted = {v.split(":")[0] for s in ("grafana", "prometheus") for v in compose["services"][s]["volumes"]}
    for path in mounted:
        assert path.startswith("prometheus-data") or (ROOT / path).exists(), path
    assert (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").exists()
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/talaria.json").read_text())
    assert dashboard["uid"] == "talaria" and len(dashboard["panels"]) >= 12
    if shutil.which("promtool"):  # (Debian's prometheus package ships it)
        out = subprocess.run(["promtool", "check", "config", str(ROOT / "deploy/prometheus/prometheus.yml")],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
