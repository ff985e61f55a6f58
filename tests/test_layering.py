"""The package's layers (docs/architecture.md), checked from the code's own imports:

    plan/  <-  sim/                     torch-free (the planner, the simulator)
    testbed/                            torch-free network emulation, imports nothing else here
    runtime/  <-  megatron/  <-  train/  <-  bench/

An arrow points from a package to one it may import. Megatron internals (private names, module
attributes rebound) appear only in megatron/, the integration layer; no module imports itself back
through a circle. Every import counts, top-level or inside a function.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "megatron_hybridep")

# package -> the packages of megatron_hybridep it may import (besides itself)
ALLOWED = {
    "plan": set(),
    "sim": {"plan"},
    "testbed": set(),
    "data": set(),
    "kernels": set(),
    "runtime": {"plan", "kernels"},
    "megatron": {"plan", "runtime", "kernels"},
    "testing": {"plan", "runtime", "megatron", "train", "data"},
    "train": {"plan", "runtime", "megatron", "data", "testbed"},
    "bench": {"plan", "runtime", "megatron", "train", "data", "testbed", "sim"},
}
TOP_LEVEL = {"__init__", "__main__", "cli"}  # megatron_hybridep/*.py: the entry points


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return out


MODULES = _modules()


def _imports(path: str, module: str) -> Iterator[tuple[str, list[str], ast.AST]]:
    """(imported module, names imported from it, node) for every import in the file."""
    is_pkg = path.endswith("__init__.py")
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(parts + ([base] if base else []))
            yield base, [a.name for a in node.names], node


def _internal_targets(path: str, module: str) -> set[str]:
    """Modules of this package a file imports (``from pkg import submodule`` resolved)."""
    out = set()
    for base, names, _ in _imports(path, module):
        if not base.startswith("megatron_hybridep"):
            continue
        out.add(base)
        out.update(f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES)
    return {m for m in out if m in MODULES}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] not in TOP_LEVEL) else "<top>"


def test_every_package_imports_only_the_layers_below_it():
    bad = []
    for module, path in MODULES.items():
        pkg = _package(module)
        if pkg == "<top>":
            continue
        assert pkg in ALLOWED, f"new package {pkg!r}: give it a place in ALLOWED (and docs/architecture.md)"
        for target in _internal_targets(path, module):
            tpkg = _package(target)
            if tpkg not in (pkg, "<top>") and tpkg not in ALLOWED[pkg]:
                bad.append(f"{module} imports {target} ({pkg}/ may import {sorted(ALLOWED[pkg]) or 'nothing'})")
            if tpkg == "<top>" and target != "megatron_hybridep":
                bad.append(f"{module} imports the entry point {target}")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles_between_modules():
    graph = {m: {t for t in _internal_targets(p, m) if t != m} for m, p in MODULES.items()}
    # a package's __init__ re-exporting its own submodules is not a cycle through them
    for m in graph:
        if os.path.basename(MODULES[m]) == "__init__.py":
            graph[m] = {t for t in graph[m] if not t.startswith(m + ".")}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _outside_integration() -> list[str]:
    files = [p for m, p in MODULES.items() if _package(m) != "megatron"]
    files.append(os.path.join(ROOT, "pretrain_moe.py"))
    files += [os.path.join(ROOT, "benchmarks", f) for f in os.listdir(os.path.join(ROOT, "benchmarks"))
              if f.endswith(".py")]
    return sorted(files)


def test_megatron_internals_stay_in_the_integration_layer():
    """Outside megatron/: no private Megatron name imported, no Megatron module attribute rebound."""
    bad = []
    for path in _outside_integration():
        rel = os.path.relpath(path, ROOT)
        megatron_modules = set()  # local names bound to Megatron modules
        for base, names, node in _imports(path, rel):
            if base.split(".")[0] != "megatron":
                continue
            bad += [f"{rel}:{node.lineno}: imports private {base}.{n}" for n in names if n.startswith("_")]
            if isinstance(node, ast.Import):
                megatron_modules.update(a.asname or a.name.split(".")[0] for a in node.names)
            else:
                megatron_modules.update(a.asname or a.name for a in node.names)
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                root = t
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(t, ast.Attribute) and isinstance(root, ast.Name) and root.id in megatron_modules \
                        and t.value is root and root.id[0].islower():
                    bad.append(f"{rel}:{node.lineno}: rebinds {root.id}.{t.attr} (a Megatron module)")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                    and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in megatron_modules:
                bad.append(f"{rel}:{node.lineno}: setattr on {node.args[0].id} (a Megatron module)")
    assert not bad, "\n".join(bad)


TORCH_FREE = """
import importlib, sys
names = sys.argv[1:]
for name in names:
    importlib.import_module(name)
bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'transformer_engine', 'triton'))
print(len(names), bad[:5])
sys.exit(1 if bad else 0)
"""


@pytest.mark.parametrize("package", ["plan", "sim", "testbed"])
def test_torch_free_packages_import_without_torch(package):
    names = sorted(m for m in MODULES if _package(m) == package)
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", TORCH_FREE, *names], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
