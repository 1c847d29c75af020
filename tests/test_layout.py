"""The layout's rules, checked on the import graph (every import, those inside
functions included): services and the shared core never import the tooling
package, no service folder imports another, and no two modules import each
other, directly or around a loop. docs/architecture.md describes the layout."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("services", "shared", "talaria")


def project_modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = project_modules()


def imports_of(module: str, path: Path) -> set[str]:
    """The project modules `module` imports anywhere in its body."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def resolve(name: str) -> str | None:
        while name:
            if name in MODULES:
                return name
            name = name.rpartition(".")[0]
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (m := resolve(alias.name)) is not None:
                    found.add(m)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package upwards
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            for alias in node.names:
                if (m := resolve(f"{base}.{alias.name}")) is not None:
                    found.add(m)
    found.discard(module)
    return found


GRAPH = {m: imports_of(m, p) for m, p in MODULES.items()}


def test_the_walk_sees_imports_inside_functions() -> None:
    # the engine-worker's entry point picks its backend with an import inside main()
    assert "services.engine.vllm_backend" in GRAPH["services.engine.__main__"]
    assert "talaria.lab.experiments" in GRAPH["talaria.cli"]


@pytest.mark.parametrize("top", ["services", "shared"])
def test_no_service_or_shared_module_imports_the_tooling_package(top: str) -> None:
    bad = {m: sorted(i for i in deps if i.split(".")[0] == "talaria")
           for m, deps in GRAPH.items() if m.split(".")[0] == top}
    assert {m: d for m, d in bad.items() if d} == {}


def test_no_service_folder_imports_another() -> None:
    def service(m: str) -> str | None:
        parts = m.split(".")
        return parts[1] if parts[0] == "services" and len(parts) > 1 else None

    bad = sorted((m, i) for m, deps in GRAPH.items() for i in deps
                 if service(m) and service(i) and service(m) != service(i))
    assert bad == []


def test_no_import_cycle() -> None:
    # Tarjan's strongly connected components: any component of more than one module is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert cycles == []
