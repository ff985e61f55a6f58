"""Helpers shared by the testbed tests (a unique module name: safe to import from any test)."""

from __future__ import annotations

import os
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

from megatron_hybridep.testbed import netns

REPO = Path(__file__).resolve().parents[2]


def why_not_root_capable() -> str | None:
    if os.geteuid() != 0:
        return "testbed tests need root (network namespaces, tc)"
    for tool in ("ip", "tc", "timeout"):
        if shutil.which(tool) is None:
            return f"testbed tests need {tool!r}"
    return None


def leftovers(p: str) -> list[str]:
    """Namespaces and state files still there for prefix p."""
    found = netns.testbed_netns(p)
    if netns.state_path(p).exists():
        found.append(str(netns.state_path(p)))
    return found


def pid_alive(pid: int) -> bool:
    """True if pid runs (zombies count as dead: PID 1 here may not reap orphans)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def root_links() -> set[str]:
    """Interface names in the root namespace (the testbed must never add any)."""
    out = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0].split("@")[0] for line in out.splitlines() if line.strip()}


def spawn_python(code: str) -> subprocess.Popen[str]:
    """Run `code` in a fresh interpreter of this venv with the repo importable."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def read_until(proc: subprocess.Popen[str], pattern: str, timeout_s: float = 30.0) -> re.Match[str]:
    """Read proc's stdout lines until one matches (select with a deadline: never hangs)."""
    regex = re.compile(pattern)
    deadline = time.monotonic() + timeout_s
    seen = []
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if m := regex.search(line):
            return m
    proc.kill()
    err = proc.stderr.read() if proc.stderr else ""
    raise AssertionError(f"no line matching {pattern!r}; stdout={seen!r}; stderr={err[-3000:]}")


def run_to_end(args: list[str], limit_s: float, what: str) -> tuple[subprocess.Popen[str], str]:
    """Run a command of this repo (PYTHONPATH set) to its end; past limit_s, SIGTERM it (our tools
    tear their testbed down on it) and fail with its output. Returns (process, stdout+stderr)."""
    import pytest

    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=REPO)
    try:
        stdout, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        stdout, _ = proc.communicate(timeout=30)
        pytest.fail(f"{what} took more than {limit_s} s:\n{stdout[-4000:]}")
    return proc, stdout


def reanalysed_row(run: Path, tmp: Path, system: str, point: int) -> tuple[dict[str, str], dict[str, str]]:
    """A recorded bench run's bench.csv row for ``system`` at ``point``, as recorded and as `bench
    --reanalyse` writes it with today's model (on a copy of the run in ``tmp``)."""
    import csv

    from megatron_hybridep.bench.reanalyse import reanalyse

    copy = tmp / "run"
    shutil.copytree(run, copy)

    def row() -> dict[str, str]:
        with open(copy / "bench.csv", newline="") as f:
            return next(r for r in csv.DictReader(f) if r["system"] == system and r["point"] == str(point))

    before = row()
    reanalyse(copy)
    return before, row()
