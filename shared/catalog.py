"""The model catalog and server profiles (shared/data/catalog.toml), loaded once.

Pure data: no I/O beyond reading the TOML file. Every figure keeps its source
in the TOML file; this module only gives it types.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, MISSING
from functools import lru_cache
from pathlib import Path

DEFAULT_CATALOG_PATH = Path(__file__).parent / "data" / "catalog.toml"
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
    tool_call_format: str = "none"  # how the model writes a tool call (shared/tool_calls.py: hermes, glm45, none)
    reasoning_format: str = "none"  # how it writes its reasoning (services/gateway/reasoning.py: think, none)

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


def _build(cls: type, name: str, table: dict) -> object:
    fields = [f for f in cls.__dataclass_fields__ if f != "name"]
    missing = [f for f in fields if f not in table and cls.__dataclass_fields__[f].default is MISSING]
    if missing:
        raise CatalogError(f"{cls.__name__} {name!r} lacks {missing}")
    return cls(name=name, **{f: table[f] for f in fields if f in table})


@lru_cache(maxsize=8)
def load_catalog(path: str | Path | None = None) -> Catalog:
    p = Path(path) if path else DEFAULT_CATALOG_PATH
    try:
        raw = tomllib.loads(p.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CatalogError(f"cannot read catalog {p}: {exc}") from exc
    models = {n: _build(ModelSpec, n, t) for n, t in raw.get("models", {}).items()}
    servers = {n: _build(ServerProfile, n, t) for n, t in raw.get("servers", {}).items()}
    itl = raw.get("decode_itl_ms", {})
    if not models or not servers or len(itl.get("batch", [])) != len(itl.get("ms", [])) or not itl.get("batch"):
        raise CatalogError(f"catalog {p} needs [models.*], [servers.*] and [decode_itl_ms] with batch and ms of equal length")
    return Catalog(models=models, servers=servers, itl_batch=tuple(itl["batch"]), itl_ms=tuple(itl["ms"]))  # type: ignore[arg-type]
