"""Imports run one way (docs/architecture.md, "Import direction").

Every ``import`` in ``daemon/pkgd`` and ``kernels/pkgd_kernels`` counts: top-level, inside a
function, and under ``TYPE_CHECKING`` (a typing-only edge is still a dependency of the design).
A module may import its own package, and packages in a lower layer; packages in the same layer
are independent of each other. The seam modules import only each other, and `pkgd_kernels`
imports nothing of pkgd. The package root `pkgd/__init__.py` is the public facade (lazy
names) and sits above everything; any module may read ``pkgd.__version__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Top first. Each entry is one layer: a set of packages (or top-level modules) of pkgd.
LAYERS: list[set[str]] = [
    {"cli"},
    {"supervisor", "benchmarks"},
    {"api", "offline"},
    {"frontend", "engine"},
    {"runner"},
    {"ipc", "model_files"},
    {"phases"},
    {"log"},
    {"config"},
    {"parsers"},
    # Seam types: what crosses a seam between packages or processes.
    {
        "sampling_params",
        "pooling_params",
        "outputs",
        "scheduler_output",
        "runner_output",
        "logprobs",
        "host",
        "lora_request",
    },  # fmt: skip
]
SEAMS = LAYERS[-1]
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for base in (ROOT / "daemon", ROOT / "kernels"):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _resolve(name: str) -> str:
    """The longest known module that ``name`` names or lies inside."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(_resolve(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if not is_pkg:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for alias in node.names:
                full = f"{prefix}.{alias.name}"
                found.add(_resolve(full) if full in MODULES else _resolve(prefix))
    found.discard("")
    found.discard(module)
    return {m for m in found if m.split(".")[0] in ("pkgd", "pkgd_kernels")}


GRAPH = {mod: _imports(mod, path) for mod, path in MODULES.items()}


def _unit(module: str) -> str:
    """The layer unit of a pkgd module: ``pkgd.engine.core`` -> ``engine``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _violations() -> list[str]:
    bad = []
    for mod, targets in sorted(GRAPH.items()):
        top = mod.split(".")[0]
        for target in sorted(targets):
            if top == "pkgd_kernels":
                if target.split(".")[0] == "pkgd":
                    bad.append(f"{mod} -> {target}: pkgd_kernels imports nothing of pkgd")
                continue
            src, dst = _unit(mod), _unit(target)
            if target == "pkgd" or src == "" or target.startswith("pkgd_kernels"):
                # The facade, pkgd.__version__, and the kernels package (below runner).
                if target.startswith("pkgd_kernels") and src not in ("runner", "benchmarks", "cli"):
                    bad.append(f"{mod} -> {target}: only the runner (and benchmarks) use kernels")
                continue
            if src == dst:
                continue
            if src in SEAMS and dst not in SEAMS:
                bad.append(f"{mod} -> {target}: a seam module imports only other seam modules")
            elif src not in SEAMS and LAYER_OF[dst] <= LAYER_OF[src]:
                bad.append(
                    f"{mod} -> {target}: {src} (layer {LAYER_OF[src]}) may not import {dst} (layer {LAYER_OF[dst]})"
                )
    return bad


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, 1972)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w == "pkgd":
                continue
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
                found.append(sorted(comp))

    for mod in sorted(GRAPH):
        if mod not in index:
            visit(mod)
    return found


def test_every_pkgd_package_has_a_layer():
    units = {_unit(m) for m in MODULES if m.startswith("pkgd.")} - {""}
    assert not units - set(LAYER_OF), f"add these to LAYERS: {sorted(units - set(LAYER_OF))}"


def test_imports_run_one_way():
    assert _violations() == []


def test_no_import_cycle_between_files():
    assert _cycles() == []


@pytest.mark.parametrize(
    "src, dst",
    [("pkgd.runner.sampler", "pkgd.engine.request"), ("pkgd.sampling_params", "pkgd.config")],
)
def test_the_checker_sees_an_upward_import(monkeypatch, src, dst):
    monkeypatch.setitem(GRAPH, src, GRAPH[src] | {dst})
    assert any(line.startswith(f"{src} -> {dst}") for line in _violations())
