"""All of a process's mutable runtime state lives in one object (runtime/context.py ProcessContext):
no module of the package binds a non-constant name to a mutable container or a lock at import."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "megatron_hybridep"
MUTABLE_CALLS = {"list", "dict", "set", "defaultdict", "deque", "OrderedDict", "Counter", "Lock", "RLock"}
ALLOWED = {("runtime/context.py", "_CONTEXT")}  # the one context object


def _mutable(value: ast.expr) -> bool:
    if isinstance(value, ast.List | ast.Dict | ast.Set | ast.ListComp | ast.DictComp | ast.SetComp):
        return True
    if isinstance(value, ast.Call):
        fn = value.func
        name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
        return name in MUTABLE_CALLS or name == "ProcessContext"
    return False


def test_no_module_level_mutable_state_outside_the_process_context():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) and node.value is not None else []
            for t in targets:
                name = getattr(t, "id", None)
                # UPPER_CASE names are constants by convention (tables the code reads, never writes); dunders
                # (__all__, __path__) are the module's own
                if (name and not name.startswith("__") and not name.lstrip("_").isupper() and _mutable(node.value)
                        and (rel, name) not in ALLOWED):
                    found.append(f"{rel}: {name}")
    assert found == [], f"module-level mutable state outside ProcessContext: {found}"


def test_the_scan_sees_what_it_forbids(tmp_path):
    tree = ast.parse("_cache = {}\n_lock = threading.Lock()\nTABLE = {1: 2}\n_created = [0]\n")
    flagged = [n.targets[0].id for n in tree.body if _mutable(n.value) and not n.targets[0].id.lstrip("_").isupper()]
    assert flagged == ["_cache", "_lock", "_created"]
