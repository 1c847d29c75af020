"""The model catalog and server profiles (shared/data/catalog.toml), loaded once.

Pure data: no I/O beyond reading the TOML file. Every figure keeps its source
in the TOML file; this module only gives it types.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import dataclass, MISSING
from functools import lru_cache
from pathlib import Path

DEFAULT_CATALOG_PATH = Path(__file__).parent / "data" / "catalog.toml"
CATALOG_VAR = "TALARIA_CATALOG"  # another catalog file, for the services and every command alike
# the formats a model may write its tool calls and its reasoning in (shared/tool_calls.py,
# services/gateway/reasoning.py, whose parsers read them)
TOOL_CALL_FORMATS = ("hermes", "glm45", "pythonic", "harmony", "none")
REASONING_FORMATS = ("think", "harmony", "none")
# a model's name is a NATS subject token and a file name (its engine's log): no spaces, no
# wildcards, and two names may not differ only in case
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
GB = 1e9


class CatalogError(ValueError):
    """The catalog file is malformed or names something that does not exist."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    params_b: float
    active_params_b: float
    weights_gb: float
    layers: int
    kv_heads: int
    head_dim: int
    kv_bytes_per_token: int
    kv_bytes_per_seq: int
    context_limit: int
    prefill_tok_s: float
    attn_flops_per_pair: float
    decode_itl_scale: float
    sources: str
    tool_call_format: str = "none"  # how the model writes a tool call (shared/tool_calls.py: hermes, glm45, pythonic, harmony, none)
    reasoning_format: str = "none"  # how it writes its reasoning (services/gateway/reasoning.py: think, harmony, none)

    @property
    def weights_bytes(self) -> float:
        return self.weights_gb * GB

    def kv_bytes(self, tokens: int) -> float:
        """Node-level KV bytes of one sequence holding `tokens` tokens."""
        return tokens * self.kv_bytes_per_token + (self.kv_bytes_per_seq if tokens > 0 else 0)


@dataclass(frozen=True, slots=True)
class ServerProfile:
    name: str
    gpus: int
    hbm_gb_per_gpu: float
    hbm_tb_s_per_gpu: float
    host_dram_gb: float
    h2d_gb_s_per_gpu: float
    d2d_gb_s_per_gpu: float
    usable_pflops: float
    runtime_reserve_frac: float
    wake_residual_s: float
    sleep_residual_s: float
    remap_s: float
    reinit_s: float
    sources: str

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gb_per_gpu * self.gpus * GB

    @property
    def usable_hbm_bytes(self) -> float:
        """HBM left for weights and KV after the runtime reserve."""
        return self.hbm_bytes * (1.0 - self.runtime_reserve_frac)

    @property
    def host_bytes(self) -> float:
        return self.host_dram_gb * GB


@dataclass(frozen=True, slots=True)
class Catalog:
    models: dict[str, ModelSpec]
    servers: dict[str, ServerProfile]
    itl_batch: tuple[int, ...]
    itl_ms: tuple[float, ...]

    def model(self, name: str) -> ModelSpec:
        try:
            return self.models[name]
        except KeyError:
            raise CatalogError(f"unknown model {name!r}; the catalog has {sorted(self.models)}") from None

    def server(self, name: str) -> ServerProfile:
        try:
            return self.servers[name]
        except KeyError:
            raise CatalogError(f"unknown server profile {name!r}; the catalog has {sorted(self.servers)}") from None


# Figures that may be 0 (no such cost or term); every other number must be above 0: a zero rate
# divides by zero in the cost model, a negative size never lets a session finish.
_MAY_BE_ZERO = frozenset({"kv_bytes_per_seq", "attn_flops_per_pair", "runtime_reserve_frac",
                          "wake_residual_s", "sleep_residual_s", "remap_s", "reinit_s"})


def _build(cls: type, name: str, table: object) -> object:
    if not isinstance(table, dict):
        raise CatalogError(f"{cls.__name__} {name!r} must be a table of fields, got {table!r}"[:300])
    fields = [f for f in cls.__dataclass_fields__ if f != "name"]
    missing = [f for f in fields if f not in table and cls.__dataclass_fields__[f].default is MISSING]
    if missing:
        raise CatalogError(f"{cls.__name__} {name!r} lacks {missing}")
    unknown = sorted(set(table) - set(fields))
    if unknown:  # (a misspelt `tool_call_fromat` had left the model quietly with none)
        raise CatalogError(f"{cls.__name__} {name!r} has unknown fields {unknown}; its fields are {fields}")
    for f in fields:
        if f not in table:
            continue
        v, kind = table[f], cls.__dataclass_fields__[f].type
        if kind == "str" and not isinstance(v, str):
            raise CatalogError(f"{cls.__name__} {name!r}: {f} must be a string, got {v!r}"[:300])
        if kind not in ("int", "float"):
            continue
        least = "0 or more" if f in _MAY_BE_ZERO else "above 0"
        what = "a whole number" if kind == "int" else "a finite number"
        if (isinstance(v, bool) or not isinstance(v, int if kind == "int" else (int, float)) or not math.isfinite(v)
                or v < 0 or (v == 0 and f not in _MAY_BE_ZERO)):
            raise CatalogError(f"{cls.__name__} {name!r}: {f} must be {what} {least}, got {v!r}")
    for f, allowed in (("tool_call_format", TOOL_CALL_FORMATS), ("reasoning_format", REASONING_FORMATS)):
        if cls is ModelSpec and table.get(f, "none") not in allowed:
            raise CatalogError(f"ModelSpec {name!r}: {f} must be one of {', '.join(allowed)}, got {table[f]!r}")
    if cls is ServerProfile and not table["runtime_reserve_frac"] < 1:
        raise CatalogError(f"ServerProfile {name!r}: runtime_reserve_frac must be below 1 (the share of HBM "
                           f"kept from weights and KV), got {table['runtime_reserve_frac']!r}")
    return cls(name=name, **{f: table[f] for f in fields if f in table})


def check_fit(server: ServerProfile, models: list[ModelSpec]) -> None:
    """That `models` can be served together on `server`: the largest model's weights leave HBM for
    one full context of every model (else a long call is never admitted), and host DRAM holds a
    copy of every model's weights (where a switch puts them)."""
    largest = max(models, key=lambda m: m.weights_bytes)
    kv_room = server.usable_hbm_bytes - largest.weights_bytes
    for m in models:
        need = m.kv_bytes(m.context_limit)
        if kv_room < need:
            raise CatalogError(f"server profile {server.name!r}: {largest.name}'s weights ({largest.weights_gb:g} GB) "
                               f"leave {max(0.0, kv_room) / GB:.3g} GB of the {server.usable_hbm_bytes / GB:.3g} GB "
                               f"usable HBM for KV; {m.name}'s context of {m.context_limit} tokens needs "
                               f"{need / GB:.3g} GB")
    weights = sum(m.weights_bytes for m in models)
    if weights > server.host_bytes:
        raise CatalogError(f"server profile {server.name!r}: host DRAM ({server.host_dram_gb:g} GB) cannot hold "
                           f"every model's weights ({weights / GB:g} GB)")


def load_catalog(path: str | Path | None = None) -> Catalog:
    """The catalog at `path`; none given, the one TALARIA_CATALOG names (as the services
    read it: `talaria up` and `sim` had read the shipped one whatever it said), else the
    shipped one."""
    return _load_catalog(Path(path or os.environ.get(CATALOG_VAR, "").strip() or DEFAULT_CATALOG_PATH))


def _table(raw: dict, key: str, p: Path) -> dict:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise CatalogError(f"catalog {p}: [{key}] must hold one table per entry ([{key}.NAME]), got {value!r}"[:300])
    return value


@lru_cache(maxsize=8)
def _load_catalog(p: Path) -> Catalog:
    try:
        raw = tomllib.loads(p.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CatalogError(f"cannot read catalog {p}: {exc}") from exc
    try:
        models = {n: _build(ModelSpec, n, t) for n, t in _table(raw, "models", p).items()}
        servers = {n: _build(ServerProfile, n, t) for n, t in _table(raw, "servers", p).items()}
    except CatalogError as exc:
        raise CatalogError(f"catalog {p}: {exc}") from None
    bad = [n for n in models if not MODEL_NAME.fullmatch(n)]
    if bad:
        raise CatalogError(f"catalog {p}: model names must be 1-128 letters, digits, '.', '_' or '-', beginning "
                           f"with a letter or digit (each is a NATS subject token and a log file's name): {bad}"[:400])
    folded: dict[str, str] = {}
    for n in models:
        if (other := folded.setdefault(n.lower(), n)) != n:
            raise CatalogError(f"catalog {p}: models {other!r} and {n!r} differ only in case (their log files "
                               "would be one file where names are not case-sensitive)")
    itl = raw.get("decode_itl_ms", {})
    if not models or not servers or len(itl.get("batch", [])) != len(itl.get("ms", [])) or not itl.get("batch"):
        raise CatalogError(f"catalog {p} needs [models.*], [servers.*] and [decode_itl_ms] with batch and ms of equal length")
    batch, ms = itl["batch"], itl["ms"]
    # the cost model interpolates between the points (bisect): batches must rise, latencies be real
    if (any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in batch) or sorted(set(batch)) != batch
            or any(not isinstance(x, (int, float)) or isinstance(x, bool) or not 0 < x < math.inf for x in ms)):
        raise CatalogError(f"catalog {p}: [decode_itl_ms] needs rising whole batch sizes >= 1 and finite "
                           f"latencies above 0, got batch {batch} and ms {ms}")
    return Catalog(models=models, servers=servers, itl_batch=tuple(itl["batch"]), itl_ms=tuple(itl["ms"]))  # type: ignore[arg-type]
