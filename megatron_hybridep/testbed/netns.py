"""Network namespaces: create, list, enter (per thread), kill what runs inside, delete.

Naming: every namespace of one testbed is "<prefix>-dc<i>" or "<prefix>-sw"; the prefix is
"hep-<owner pid>" by default so parallel runs never collide and leftovers of a dead owner can be
found and removed. Nothing here touches the root namespace's interfaces or routes.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from megatron_hybridep.testbed.sh import TestbedError, sh

NETNS_DIR = Path("/run/netns")  # where `ip netns` keeps its named namespaces
PREFIX_RE = re.compile(r"^hep-[a-z0-9][a-z0-9-]{0,40}$")
# the namespaces of one testbed: <prefix>-sw and <prefix>-dc<i>
MEMBER_RE = re.compile(r"^(?P<prefix>hep-[a-z0-9-]+?)-(?:sw|dc\d+)$")
OWNER_RE = re.compile(r"^hep-(?P<pid>\d+)(?:-|$)")

def state_dir() -> Path:
    """Where testbed state files live: /run (tmpfs, gone on reboot like the namespaces) or /tmp."""
    for base in (Path("/run"), Path("/tmp")):
        d = base / "hybridep-testbed"
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise TestbedError("neither /run nor /tmp is writable for the testbed state")


def validate_prefix(prefix: str) -> str:
    if not PREFIX_RE.match(prefix):
        raise TestbedError(
            f"bad testbed prefix {prefix!r}: use 'hep-' followed by lower-case letters, digits and "
            "dashes (at most 44 characters), e.g. 'hep-1234' or 'hep-up'"
        )
    return prefix


# ---------------------------------------------------------------------------------------- state


def state_path(prefix: str) -> Path:
    return state_dir() / f"{prefix}.json"


def write_state(prefix: str, state: dict) -> None:
    path = state_path(prefix)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
    tmp.replace(path)  # atomic: a reader never sees half a file


def read_state(prefix: str) -> dict | None:
    try:
        return json.loads(state_path(prefix).read_text())
    except (OSError, ValueError):
        return None


def remove_state(prefix: str) -> None:
    state_path(prefix).unlink(missing_ok=True)


def recorded_prefixes() -> list[str]:
    return sorted(p.stem for p in state_dir().glob("hep-*.json"))


# ----------------------------------------------------------------------------------- namespaces


def list_netns() -> list[str]:
    """Names of all named network namespaces (ours and others')."""
    out = sh(["ip", "netns", "list"]).stdout
    # lines look like "hep-12-dc0 (id: 3)" or just "hep-12-dc0"
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def testbed_netns(prefix: str) -> list[str]:
    """The namespaces that belong to the testbed with this exact prefix."""
    return [ns for ns in list_netns() if (m := MEMBER_RE.match(ns)) and m["prefix"] == prefix]


def all_prefixes() -> list[str]:
    """Prefixes of every testbed present: from namespaces and from state files."""
    found = {m["prefix"] for ns in list_netns() if (m := MEMBER_RE.match(ns))}
    return sorted(found | set(recorded_prefixes()))


def create_netns(name: str) -> None:
    try:
        sh(["ip", "netns", "add", name])
    except TestbedError as exc:
        if "File exists" in str(exc):
            prefix = m["prefix"] if (m := MEMBER_RE.match(name)) else name
            raise TestbedError(
                f"network namespace {name} already exists: a testbed with prefix {prefix} is up "
                f"or was left behind. Fix: `hybridep testbed down --prefix {prefix}`"
            ) from exc
        raise TestbedError(
            f"cannot create network namespace {name} ({exc}). Network namespaces are not "
            "permitted here. Fix: run as root on a host, or in a container with CAP_SYS_ADMIN "
            "and CAP_NET_ADMIN (docker run --privileged), with /run/netns writable."
        ) from exc
    sh(["ip", "-n", name, "link", "set", "lo", "up"])  # same-DC traffic goes over lo


def netns_pids(name: str) -> list[int]:
    proc = sh(["ip", "netns", "pids", name], check=False)
    return [int(tok) for tok in proc.stdout.split() if tok.isdigit()]


def kill_netns_processes(names: list[str], timeout_s: float = 5.0) -> list[int]:
    """SIGKILL every process living in these namespaces and wait until they are gone."""
    pids = sorted({pid for ns in names for pid in netns_pids(ns)} - {os.getpid()})
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        # wait on a pidfd: returns as soon as the process is gone (no sleep-polling)
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue  # already gone
        try:
            import select

            select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        finally:
            os.close(fd)
    return pids


def delete_netns(name: str) -> None:
    proc = sh(["ip", "netns", "delete", name], check=False)
    if proc.returncode != 0 and (NETNS_DIR / name).exists():
        raise TestbedError(f"cannot delete network namespace {name}: {proc.stderr.strip()}")


def teardown_prefix(prefix: str) -> list[str]:
    """Remove every namespace of a testbed (processes inside are killed first) and its state.

    Deleting a namespace with live processes would only unlink its name; the namespace and its
    links would live on with the processes. So kill first, then delete. Returns what was removed.
    """
    names = testbed_netns(prefix)
    kill_netns_processes(names)
    errors = []
    for name in names:
        try:
            delete_netns(name)
        except TestbedError as exc:
            errors.append(str(exc))
    remove_state(prefix)
    if errors:
        raise TestbedError("; ".join(errors))
    return names


def owner_alive(prefix: str) -> bool | None:
    """Whether the process that owns this testbed lives; None when the owner is unknown."""
    state = read_state(prefix)
    pid = state.get("owner_pid") if state else None
    if pid is None and (m := OWNER_RE.match(prefix)):
        pid = int(m["pid"])
    if pid is None:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_stale(prefix: str) -> bool:
    """Left behind by a dead owner; testbeds kept up on purpose (`testbed up`) never are."""
    state = read_state(prefix)
    if state and state.get("persistent"):
        return False
    return owner_alive(prefix) is False


def reap_stale() -> list[str]:
    """Tear down testbeds whose owner died without cleaning up (SIGKILL, OOM, power loss)."""
    reaped = []
    for prefix in all_prefixes():
        if is_stale(prefix):
            try:
                teardown_prefix(prefix)
                reaped.append(prefix)
            except TestbedError:
                pass  # a concurrent reaper got there first; `down` reports real failures
    return reaped


# ------------------------------------------------------------------------ code inside a netns


def enter_netns(name: str) -> None:
    """Move the calling thread (a whole process, if it has one thread) into namespace `name`;
    FileNotFoundError when it does not exist."""
    fd = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        os.setns(fd, os.CLONE_NEWNET)
    finally:
        os.close(fd)


def in_netns[T](name: str, fn: Callable[[], T], timeout_s: float = 10.0) -> T:
    """Run fn in a short-lived thread that has joined namespace `name`; return its result.

    setns(CLONE_NEWNET) changes only the calling thread, so the caller stays where it is;
    sockets created by fn stay bound to `name` after the thread ends.
    """
    box: dict[str, object] = {}

    def target() -> None:
        try:
            try:
                enter_netns(name)
            except FileNotFoundError:
                box["missing"] = True
                return
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    t = threading.Thread(target=target, name=f"netns-{name}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TestbedError(f"operation inside namespace {name} did not finish within {timeout_s:g} s")
    if "missing" in box:  # only the namespace's own file: fn's FileNotFoundError is fn's
        raise TestbedError(f"network namespace {name} does not exist")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def socket_in_netns(name: str) -> socket.socket:
    """A TCP socket that lives in namespace `name`."""
    return in_netns(name, lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))


def free_port(name: str, addr: str) -> int:
    """A TCP port that is free on addr inside namespace `name` (asked from the kernel)."""

    def pick() -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, 0))
            return s.getsockname()[1]

    try:
        return in_netns(name, pick)
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:
            raise TestbedError(f"address {addr} is not configured in namespace {name}") from exc
        raise
