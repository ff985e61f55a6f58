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


INTERPRETER_SCRIPTS = ("interp_cases.py", "interp_fused_cases.py")


def start_under_interpreter(script: str) -> subprocess.Popen:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, str(REPO / "tests/kernels" / script)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def check_under_interpreter(proc: subprocess.Popen, timeout: int = 600) -> None:
    """The Triton kernels against the torch reference, on CPU under TRITON_INTERPRET=1 (a script
    started by start_under_interpreter)."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"no result after {timeout} s:\n{stdout}\n{stderr}")
    print(stdout)
    assert proc.returncode == 0, stdout + stderr
    assert "ALL OK" in stdout and "MISMATCH" not in stdout


def check_compiles_for_sm90(script: str, timeout: int = 300) -> None:
    """The Triton kernels compiled for sm_90 without a GPU (skipped where there is no CUDA backend)."""
    proc = _run(script, "0", timeout)
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ALL OK" in proc.stdout
