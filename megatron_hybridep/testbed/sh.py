"""One way to run a system command: with a timeout, captured output and a readable error.

Every `ip` / `tc` call of the testbed goes through `sh()`, so no call can hang a run and every
failure names the command that failed and what it printed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

DEFAULT_TIMEOUT_S = 10.0


class TestbedError(RuntimeError):
    """A testbed operation failed or cannot run here; the message says what and how to fix it."""

    __test__ = False  # pytest: not a test class despite the name


def sh(
    argv: Sequence[str],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    check: bool = True,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run argv (no shell), capture stdout/stderr as text, raise TestbedError on failure/timeout."""
    argv = [str(a) for a in argv]
    cmd = " ".join(argv)
    try:
        proc = subprocess.run(
            argv, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError as exc:
        raise TestbedError(f"`{cmd}`: {argv[0]} not found ({exc})") from exc
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"`{cmd}` did not finish within {timeout:g} s") from exc
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip() or "no output"
        raise TestbedError(f"`{cmd}` failed (exit {proc.returncode}): {detail}")
    return proc


# tool -> package that ships it (Debian/Ubuntu names; the same on most distros)
REQUIRED_TOOLS = {"ip": "iproute2", "tc": "iproute2", "timeout": "coreutils"}


def preflight() -> None:
    """Refuse early, naming what is missing and the fix: root, ip/tc, and permission for netns."""
    if os.geteuid() != 0:
        raise TestbedError(
            "the testbed must run as root: network namespaces, veth links and tc qdiscs need "
            "CAP_NET_ADMIN and CAP_SYS_ADMIN. Fix: run with sudo (e.g. `sudo -E hybridep testbed "
            "up ...`) or in a container started with --privileged."
        )
    missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing:
        pkgs = sorted({REQUIRED_TOOLS[t] for t in missing})
        raise TestbedError(
            f"missing command(s) {', '.join(repr(t) for t in missing)} needed by the testbed. "
            f"Fix: install {' '.join(pkgs)} (e.g. `apt-get install {' '.join(pkgs)}`) and make "
            "sure they are on PATH."
        )
