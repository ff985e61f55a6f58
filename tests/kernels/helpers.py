"""The kernel tests' subprocess checks: a script under tests/kernels/ run with TRITON_INTERPRET set
(the interpreter's state is per process), which prints ALL OK when every case passed."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


INTERPRETER_SCRIPTS = ("interp_cases.py", "interp_fused_cases.py")


def _start(script: str, interpret: str) -> subprocess.Popen:
    env = dict(os.environ, TRITON_INTERPRET=interpret, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, str(REPO / "tests/kernels" / script)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def _finish(proc: subprocess.Popen, timeout: int) -> tuple[str, str]:
    """The script's (stdout, stderr); a failed test naming the timeout if it ran past it."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"no result after {timeout} s:\n{stdout}\n{stderr}")
    print(stdout)
    return stdout, stderr


def start_under_interpreter(script: str) -> subprocess.Popen:
    return _start(script, "1")


def check_under_interpreter(proc: subprocess.Popen, timeout: int = 600) -> None:
    """The Triton kernels against the torch reference, on CPU under TRITON_INTERPRET=1 (a script
    started by start_under_interpreter)."""
    stdout, stderr = _finish(proc, timeout)
    assert proc.returncode == 0, stdout + stderr
    assert "ALL OK" in stdout and "MISMATCH" not in stdout


def check_compiles_for_sm90(script: str, timeout: int = 300) -> None:
    """The Triton kernels compiled for sm_90 without a GPU (skipped where there is no CUDA backend)."""
    proc = _start(script, "0")
    stdout, stderr = _finish(proc, timeout)
    if stdout.startswith("SKIP"):
        pytest.skip(stdout.strip())
    assert proc.returncode == 0, stdout + stderr
    assert "ALL OK" in stdout
