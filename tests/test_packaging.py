"""pyproject's dependencies and extras against what the code imports (CPU, no install needed).

The `gpu` extra once named `apex`, which on the package index is an unrelated project: every
third-party module the package imports must come from a declared dependency or extra, every
extra must be imported somewhere, and nothing imports NVIDIA Apex."""

import ast
import functools
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("megatron_hybridep", "kernels")
# Import name -> distribution for optional modules that need not be installed here.
OPTIONAL_MODULES = {"transformer_engine": "transformer-engine"}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(reqs: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in reqs}


@functools.cache  # one parse of the tree per session; callers only read it
def _imports() -> dict[str, set[str]]:
    """Top-level third-party module -> files importing it (module level or lazily, in functions)."""
    found: dict[str, set[str]] = {}
    files = [p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py")] + [ROOT / "pretrain_moe.py"]
    local = {"megatron_hybridep"}  # kernels/ is imported as megatron_hybridep.kernels
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            for mod in mods:
                top = mod.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


@functools.cache
def _installed() -> dict[str, list[str]]:
    """Module -> distributions, scanned once: each scan reads every installed package's metadata."""
    return packages_distributions()


def _distributions(module: str) -> set[str]:
    if module in OPTIONAL_MODULES:
        return {OPTIONAL_MODULES[module]}
    return {canonicalize_name(d) for d in _installed().get(module, [])}


def _provided_by_torch() -> set[str]:
    """Distributions torch itself requires (triton on Linux): importable wherever torch is."""
    return {canonicalize_name(Requirement(r).name) for r in _requires("torch")}


def _requires(dist: str) -> list[str]:
    try:
        return requires(dist) or []
    except PackageNotFoundError:  # an optional dependency not installed here
        return []


def test_apex_is_neither_declared_nor_imported():
    project = _project()
    declared = _names(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        declared |= _names(extra)
    assert "apex" not in declared, "'apex' on the package index is not NVIDIA Apex (see docs/gpu.md)"
    assert "apex" not in _imports(), f"code imports apex: {_imports()['apex']}"


def test_gpu_extra_is_transformer_engine_for_the_locked_cuda():
    (req,) = [Requirement(r) for r in _project()["optional-dependencies"]["gpu"]]
    assert canonicalize_name(req.name) == "transformer-engine"
    # torch in the lock is +cu130: TE's core library must be the CUDA 13 build, and the torch
    # bindings (the `pytorch` extra) are what Megatron's TE layers import.
    assert {"core-cu13", "pytorch"} <= {canonicalize_name(e) for e in req.extras}
    lock = (ROOT / "requirements.lock").read_text()
    assert "nvidia-cuda-runtime==13." in lock, "torch's CUDA major changed: change core_cu13 in the gpu extra"


def test_every_extra_is_imported_by_the_code():
    imports = _imports()
    imported = {d for mod in imports for d in _distributions(mod)}
    extra = _names(_project()["optional-dependencies"]["gpu"])
    missing = extra - imported
    assert not missing, f"gpu extra names {missing}, which no module under {PACKAGE_DIRS} imports"


def test_every_third_party_import_is_declared():
    project = _project()
    declared = _names(project["dependencies"]) | _names(project["optional-dependencies"]["gpu"])
    declared |= _provided_by_torch()
    undeclared = {}
    for mod, files in _imports().items():
        dists = _distributions(mod)
        if not dists:
            undeclared[mod] = files  # not installed here and not a known optional module
        elif not dists & declared:
            undeclared[mod] = files
    assert not undeclared, f"imports without a declared distribution: {undeclared}"



def test_every_dependency_is_imported_by_the_code():
    """A declared dependency nothing imports (pydantic once) only costs installs."""
    imported = {d for mod in _imports() for d in _distributions(mod)}
    unused = _names(_project()["dependencies"]) - imported
    assert not unused, f"dependencies {unused} are declared in pyproject.toml but no module imports them"


def test_kernels_import_as_megatron_hybridep_kernels():
    """kernels/ is not a top-level import (another project's name on the index) but a subpackage."""
    assert "kernels" not in _imports(), f"files import a top-level 'kernels': {_imports().get('kernels')}"
    from megatron_hybridep.kernels import codec

    assert Path(codec.__file__).resolve() == ROOT / "kernels" / "codec.py"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert pyproject["package-dir"] == {"megatron_hybridep.kernels": "kernels"}  # how a wheel ships it
