"""patches/: the patches for users of the full Megatron-LM repository.

- megatron_training_arguments.patch applies cleanly (no offset, no fuzz) to the megatron/training
  sources shipped in the installed megatron-core wheel, and the patched module parses
  ``--moe-token-dispatcher-type hybridep`` (the unpatched one rejects it).
- pretrain_gpt.patch is a well-formed unified diff whose context lines are upstream pretrain_gpt.py's
  lines at the stated positions, at the commit pinned in patches/README.md. The upstream file is not
  stored here, only a fingerprint of it (sha256 per line, tests/data/megatron_lm/); apply.sh is run on
  a Megatron-LM-shaped tree whose pretrain_gpt.py is rebuilt from those verified lines.
- The code pretrain_gpt.patch adds runs: its provider sets up the plan before the model is built.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import with_args

REPO = Path(__file__).resolve().parents[1]
PATCHES = REPO / "patches"
ARGS_PATCH = PATCHES / "megatron_training_arguments.patch"
GPT_PATCH = PATCHES / "pretrain_gpt.patch"
APPLY = PATCHES / "apply.sh"
FINGERPRINT = REPO / "tests" / "data" / "megatron_lm" / "pretrain_gpt.fingerprint.json"

MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
         "--micro-batch-size 1 --num-experts 8 --moe-router-topk 2 --tokenizer-type NullTokenizer "
         "--vocab-size 256 --transformer-impl local").split()

pytestmark = pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")


# ---- unified diffs --------------------------------------------------------------------------------
@dataclass
class Hunk:
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: list[str] = field(default_factory=list)  # with their ' ', '-', '+' prefix and newline

    @property
    def old_lines(self) -> list[str]:
        return [line[1:] for line in self.lines if line[0] in " -"]

    @property
    def new_lines(self) -> list[str]:
        return [line[1:] for line in self.lines if line[0] in " +"]


HUNK_HEADER = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_unified_diff(text: str) -> dict[str, list[Hunk]]:
    """Strict parser: {path without a/ b/: hunks}. A preamble before the first '--- ' is allowed."""
    lines = text.splitlines(keepends=True)
    files: dict[str, list[Hunk]] = {}
    i = 0
    while i < len(lines) and not lines[i].startswith("--- "):
        i += 1
    assert i < len(lines), "no '--- ' file header: not a unified diff"
    while i < len(lines):
        old, new = lines[i], lines[i + 1] if i + 1 < len(lines) else ""
        assert old.startswith("--- a/") and new.startswith("+++ b/"), f"line {i + 1}: bad file header {old!r}"
        path = old[len("--- a/"):].split("\t")[0].strip()
        assert new[len("+++ b/"):].split("\t")[0].strip() == path, f"line {i + 2}: +++ names another file"
        hunks = files.setdefault(path, [])
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            m = HUNK_HEADER.match(lines[i])
            assert m, f"line {i + 1}: bad hunk header {lines[i]!r}"
            hunk = Hunk(int(m[1]), int(m[2] or 1), int(m[3]), int(m[4] or 1))
            i += 1
            while i < len(lines) and (len(hunk.old_lines), len(hunk.new_lines)) != (hunk.old_len, hunk.new_len):
                assert lines[i][:1] in (" ", "-", "+"), f"line {i + 1}: {lines[i]!r} inside a hunk"
                hunk.lines.append(lines[i])
                i += 1
            assert (len(hunk.old_lines), len(hunk.new_lines)) == (hunk.old_len, hunk.new_len), \
                f"{path}: hunk at -{hunk.old_start} ends before its line counts are reached"
            if hunks:
                prev = hunks[-1]
                assert hunk.old_start >= prev.old_start + prev.old_len, f"{path}: overlapping hunks"
                assert hunk.new_start - hunk.old_start == (prev.new_start - prev.old_start
                                                           + prev.new_len - prev.old_len), \
                    f"{path}: hunk at -{hunk.old_start} has an inconsistent +start"
            hunks.append(hunk)
        assert hunks, f"{path}: no hunks"
    return files


def run(cmd: list[str], cwd: Path | None = None, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60, **kw)


# ---- the megatron-core wheel's megatron/training -------------------------------------------------
def wheel_training_dir() -> Path:
    spec = importlib.util.find_spec("megatron.training")  # imports only the 'megatron' namespace
    assert spec is not None and spec.origin, "megatron-core is not installed; run ./scripts/test"
    return Path(spec.origin).parent


@pytest.fixture(scope="module")
def patched_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the wheel's megatron/training with the arguments patch applied (checked first)."""
    root = tmp_path_factory.mktemp("megatron_core_wheel")
    shutil.copytree(wheel_training_dir(), root / "megatron" / "training",
                    ignore=shutil.ignore_patterns("__pycache__"))
    dry = run(["patch", "-p1", "-F0", "--dry-run", "-i", str(ARGS_PATCH)], cwd=root)
    assert dry.returncode == 0, f"the arguments patch does not apply to the installed wheel:\n{dry.stdout}{dry.stderr}"
    assert not re.search(r"offset|fuzz", dry.stdout, re.I), f"applies, but not cleanly:\n{dry.stdout}"
    check = run(["git", "apply", "--check", "-v", str(ARGS_PATCH)], cwd=root)
    assert check.returncode == 0, check.stderr
    applied = run(["patch", "-p1", "-F0", "-i", str(ARGS_PATCH)], cwd=root)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    return root


def load_module(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


@pytest.fixture(scope="module")
def patched_arguments(patched_tree: Path) -> types.ModuleType:
    # Only arguments.py changed: its absolute imports (megatron.training.*, megatron.core.*) may come
    # from the wheel. Loaded under its own name so the wheel's megatron.training.arguments is untouched.
    return load_module(patched_tree / "megatron" / "training" / "arguments.py", "_patched_megatron_arguments")


def test_arguments_patch_is_a_well_formed_diff_of_one_file():
    files = parse_unified_diff(ARGS_PATCH.read_text())
    assert list(files) == ["megatron/training/arguments.py"]
    wheel_lines = (wheel_training_dir() / "arguments.py").read_text().splitlines(keepends=True)
    for hunk in files["megatron/training/arguments.py"]:  # context at exactly the stated lines
        assert wheel_lines[hunk.old_start - 1: hunk.old_start - 1 + hunk.old_len] == hunk.old_lines


def test_arguments_patch_applies_once_and_reverses(patched_tree: Path):
    again = run(["patch", "-p1", "-F0", "-f", "--dry-run", "-i", str(ARGS_PATCH)], cwd=patched_tree)
    assert again.returncode != 0, "applying twice must not succeed silently"
    back = run(["patch", "-p1", "-F0", "-R", "--dry-run", "-i", str(ARGS_PATCH)], cwd=patched_tree)
    assert back.returncode == 0, back.stdout + back.stderr


def test_patched_arguments_parse_hybridep(patched_arguments: types.ModuleType):
    from megatron.training import arguments as wheel_arguments

    argv = [*MODEL, "--moe-token-dispatcher-type", "hybridep"]
    parser = patched_arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    assert parser.parse_args(argv).moe_token_dispatcher_type == "hybridep"
    for built_in in ("allgather", "alltoall", "flex"):  # Megatron's own choices are kept
        assert parser.parse_args([*MODEL, "--moe-token-dispatcher-type", built_in]).moe_token_dispatcher_type \
            == built_in
    action = next(a for a in parser._actions if a.dest == "moe_token_dispatcher_type")
    assert list(action.choices).count("hybridep") == 1  # listed once (also in --help's choices)

    unpatched = wheel_arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    with pytest.raises(SystemExit):  # argparse: invalid choice; the patch is what makes it parse
        unpatched.parse_args(argv)


def test_patched_validate_args(patched_arguments: types.ModuleType, monkeypatch: pytest.MonkeyPatch):
    def args_for(dispatcher: str) -> argparse.Namespace:
        parser = patched_arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
        a = parser.parse_args([*MODEL, "--moe-token-dispatcher-type", dispatcher])
        a.rank, a.world_size = 0, 1
        return a

    validated = patched_arguments.validate_args(args_for("hybridep"), {})
    assert validated.moe_token_dispatcher_type == "hybridep"

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "megatron_hybridep" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"needs the megatron-hybridep plugin; fix: install it.*pretrain_gpt\.patch"):
        patched_arguments.validate_args(args_for("hybridep"), {})


# ---- pretrain_gpt.py (not in the wheel) ----------------------------------------------------------
def fingerprint() -> dict[str, Any]:
    return json.loads(FINGERPRINT.read_text())


def line_hash(line: str) -> str:
    return hashlib.sha256(line.encode()).hexdigest()[:16]


def gpt_hunks() -> list[Hunk]:
    files = parse_unified_diff(GPT_PATCH.read_text())
    assert list(files) == ["pretrain_gpt.py"]
    return files["pretrain_gpt.py"]


def test_pretrain_gpt_patch_context_is_the_pinned_upstream_file():
    fp = fingerprint()
    readme = (PATCHES / "README.md").read_text()
    assert fp["commit"] in readme, "patches/README.md must name the pinned upstream commit"
    hashes = fp["line_sha256_16"]
    for hunk in gpt_hunks():
        stated = hashes[hunk.old_start - 1: hunk.old_start - 1 + hunk.old_len]
        got = [line_hash(line) for line in hunk.old_lines]
        assert got == stated, (f"hunk at line {hunk.old_start}: its context is not upstream pretrain_gpt.py @ "
                               f"{fp['commit'][:12]} at those lines")
        assert any(line[0] != " " for line in hunk.lines), "a hunk without changes"


def rebuilt_pretrain_gpt(hunks: list[Hunk]) -> str:
    """Upstream's line count, with the hunks' (hash-verified) pre-images in place and a distinct
    placeholder comment on every other line: what patch and apply.sh see around the hunks."""
    out = [f"# upstream line {n + 1} ({h})\n" for n, h in enumerate(fingerprint()["line_sha256_16"])]
    for hunk in hunks:
        out[hunk.old_start - 1: hunk.old_start - 1 + hunk.old_len] = hunk.old_lines
    return "".join(out)


@pytest.fixture
def megatron_lm_tree(tmp_path: Path) -> Path:
    """A Megatron-LM-shaped checkout: the wheel's megatron/training and a rebuilt pretrain_gpt.py."""
    shutil.copytree(wheel_training_dir(), tmp_path / "megatron" / "training",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "pretrain_gpt.py").write_text(rebuilt_pretrain_gpt(gpt_hunks()))
    return tmp_path


def snapshot(tree: Path) -> dict[str, str]:
    return {str(p.relative_to(tree)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(tree.rglob("*")) if p.is_file()}


def test_apply_sh_checks_applies_and_reverses(megatron_lm_tree: Path):
    before = snapshot(megatron_lm_tree)
    check = run(["bash", str(APPLY), "--check", str(megatron_lm_tree)])
    assert check.returncode == 0, check.stdout + check.stderr
    assert re.search(r"megatron_training_arguments\.patch\s+pending", check.stdout)
    assert re.search(r"pretrain_gpt\.patch\s+pending", check.stdout)
    assert snapshot(megatron_lm_tree) == before

    applied = run(["bash", str(APPLY), str(megatron_lm_tree)])
    assert applied.returncode == 0, applied.stdout + applied.stderr
    text = (megatron_lm_tree / "pretrain_gpt.py").read_text()
    assert "partial(hybridep_model_provider, gpt_builder)" in text
    assert "extra_args_provider=hybridep_extra_args_provider" in text
    assert "'hybridep'" in (megatron_lm_tree / "megatron" / "training" / "arguments.py").read_text()
    changed = {k for k, v in snapshot(megatron_lm_tree).items() if before.get(k) != v}
    assert changed == {"pretrain_gpt.py", "megatron/training/arguments.py"}  # no .orig / .rej left behind

    twice = run(["bash", str(APPLY), str(megatron_lm_tree)])
    assert twice.returncode == 0 and twice.stdout.count("applied") == 2, twice.stdout + twice.stderr

    back = run(["bash", str(APPLY), "--reverse", str(megatron_lm_tree)])
    assert back.returncode == 0, back.stdout + back.stderr
    assert snapshot(megatron_lm_tree) == before


def test_apply_sh_changes_nothing_when_a_patch_does_not_apply(megatron_lm_tree: Path):
    gpt = megatron_lm_tree / "pretrain_gpt.py"
    gpt.write_text(gpt.read_text().replace("partial(model_provider, gpt_builder)", "model_provider"))
    before = snapshot(megatron_lm_tree)
    result = run(["bash", str(APPLY), str(megatron_lm_tree)])
    assert result.returncode == 1
    assert re.search(r"pretrain_gpt\.patch\s+conflict", result.stdout)
    assert "nothing changed" in result.stderr and "fix:" in result.stderr
    assert snapshot(megatron_lm_tree) == before  # the arguments patch, which would apply, was not applied

    not_a_checkout = run(["bash", str(APPLY), str(megatron_lm_tree / "megatron")])
    assert not_a_checkout.returncode == 1 and "fix: pass the root of a Megatron-LM checkout" in not_a_checkout.stderr


# ---- the code pretrain_gpt.patch adds ------------------------------------------------------------
def added_block() -> str:
    """The top-level code the first hunk adds (imports and the two functions)."""
    first = gpt_hunks()[0]
    added = [line[1:] for line in first.lines if line[0] == "+"]
    assert all(line[0] != " " for line in first.lines if line[0] == "-"), "the first hunk only adds code"
    return "".join(added)


@dataclass
class PretrainGptNamespace:
    """pretrain_gpt.py's globals that the added block uses, with recording stand-ins."""

    args: argparse.Namespace
    world_size: int = 4
    calls: list[tuple[str, tuple, dict]] = field(default_factory=list)
    has_modelopt: bool = False

    def globals(self) -> dict[str, Any]:
        torch_stub = types.SimpleNamespace(distributed=types.SimpleNamespace(get_world_size=lambda: self.world_size))

        def model_provider(*a: Any, **kw: Any) -> str:
            self.calls.append(("model_provider", a, kw))
            return "model"

        def add_modelopt_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
            parser.add_argument("--modelopt-stand-in", action="store_true")
            return parser

        return {"__name__": "pretrain_gpt", "torch": torch_stub, "get_args": lambda: self.args,
                "parallel_state": types.SimpleNamespace(get_expert_model_parallel_group=lambda: "EP-GROUP"),
                "model_provider": model_provider, "has_nvidia_modelopt": self.has_modelopt,
                "add_modelopt_args": add_modelopt_args}


@pytest.fixture(scope="module")
def base_args() -> argparse.Namespace:
    from megatron_hybridep.megatron.arguments import parse

    return parse([*MODEL, "--moe-token-dispatcher-type", "hybridep", "--expert-model-parallel-size", "4"])


def exec_block(ns: PretrainGptNamespace) -> dict[str, Any]:
    g = ns.globals()
    exec(compile(added_block(), str(GPT_PATCH), "exec"), g)  # the code the patch adds
    g["get_hybridep_runtime"] = lambda: None  # no runtime from other tests
    return g


@pytest.fixture
def record_setup(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple, dict]]:
    import megatron_hybridep.megatron as hep

    calls: list[tuple[tuple, dict]] = []
    monkeypatch.setattr(hep, "register", lambda: calls.append(("register",)))
    monkeypatch.setattr(hep, "setup", lambda *a, **kw: calls.append((a, kw)))
    return calls


def test_added_provider_sets_up_the_plan_before_building_the_model(base_args, record_setup):
    ns = PretrainGptNamespace(with_args(base_args, hybridep_plan="ep"))
    g = exec_block(ns)
    provider: Callable[..., Any] = g["hybridep_model_provider"]
    assert provider("GPT-BUILDER", True, False, vp_stage=None) == "model"
    assert len(record_setup) == 2 and record_setup[0] == ("register",)  # before the spec is built
    (plans,), kw = record_setup[1]
    assert kw == {"ep_group": "EP-GROUP", "num_experts": 8}
    assert [p.label for p in plans] == ["ep (S=1)"] and plans[0].ep_size == 4
    assert ns.calls == [("model_provider", ("GPT-BUILDER", True, False), {"vp_stage": None})]


def test_added_provider_leaves_other_dispatchers_alone(base_args, record_setup):
    ns = PretrainGptNamespace(with_args(base_args, moe_token_dispatcher_type="alltoall"))
    assert exec_block(ns)["hybridep_model_provider"]("GPT-BUILDER") == "model"
    assert record_setup == [] and len(ns.calls) == 1


def test_added_provider_errors_name_the_fix(base_args, record_setup):
    ns = PretrainGptNamespace(with_args(base_args, hybridep_plan="replicated"))
    with pytest.raises(SystemExit, match=r"--moe-token-dispatcher-type alltoall --expert-model-parallel-size 2"):
        exec_block(ns)["hybridep_model_provider"]("GPT-BUILDER")
    ns = PretrainGptNamespace(with_args(base_args, config="preset.yaml"))
    with pytest.raises(SystemExit, match=r"--config presets are read by .*pretrain_moe\.py"):
        exec_block(ns)["hybridep_model_provider"]("GPT-BUILDER")
    assert record_setup == [] and ns.calls == []


@pytest.mark.parametrize("modelopt", [False, True])
def test_added_extra_args_provider(modelopt: bool):
    from megatron.training.arguments import add_megatron_arguments

    g = exec_block(PretrainGptNamespace(argparse.Namespace(), has_modelopt=modelopt))
    parser = g["hybridep_extra_args_provider"](add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    a = parser.parse_args([*MODEL, "--moe-token-dispatcher-type", "hybridep", "--hybridep-topology", "slurm",
                           "--hybridep-dc-map", "dc.yaml", "--hybridep-plan", "ep"])
    assert (a.moe_token_dispatcher_type, a.hybridep_topology, a.hybridep_dc_map) == ("hybridep", "slurm", "dc.yaml")
    assert hasattr(a, "modelopt_stand_in") == modelopt
