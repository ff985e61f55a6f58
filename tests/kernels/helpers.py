"""The kernel tests' subprocess checks: a script under tests/kernels/ run with TRITON_INTERPRET set
(the interpreter's state is per process), which prints ALL OK when every case passed."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _run(script: str, interpret: str, timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET=interpret, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "tests/kernels" / script)], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)
    print(proc.stdout)
    return proc


def check_under_interpreter(script: str, timeout: int = 300) -> None:
    """The Triton kernels against the torch reference, on CPU under TRITON_INTERPRET=1."""
    proc = _run(script, "1", timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ALL OK" in proc.stdout and "MISMATCH" not in proc.stdout


def check_compiles_for_sm90(script: str, timeout: int = 300) -> None:
    """The Triton kernels compiled for sm_90 without a GPU (skipped where there is no CUDA backend)."""
    proc = _run(script, "0", timeout)
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ALL OK" in proc.stdout
