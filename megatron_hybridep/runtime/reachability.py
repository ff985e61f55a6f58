"""Name the peers a rank cannot reach when a collective times out (torch-free).

gloo's timeout says only "Timed out waiting ... for recv"; it names no peer. Each rank therefore
opens a listening socket (a beacon) at start-up and the ranks exchange the endpoints. The kernel
completes a TCP handshake on a listening socket without the process doing anything, so after a
timeout a connect to a peer's beacon tells the three cases apart:
connected -> the host is reachable (the peer is alive, maybe stalled); refused -> reachable, but
the peer process is gone; no answer within the probe timeout -> unreachable (the network).
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

PROBE_TIMEOUT_S = 2.0
REACHABLE, GONE, UNREACHABLE = "reachable", "process gone", "unreachable"
# what a failed collective's exception says (gloo, torch.distributed) when a peer did not answer
_COMM_FAILURE = ("timed out", "timeout", "connection closed by peer", "connection reset by peer",
                 "broken pipe", "no route to host")


@dataclass(frozen=True)
class Peer:
    rank: int
    dc: int | None
    host: str
    port: int


def own_address() -> str:
    """The address peers reach this rank at: the testbed's DC address, else the source address of
    the route to MASTER_ADDR (a UDP connect sends nothing), else the host name's."""
    addr = os.environ.get("HYBRIDEP_DC_ADDR")
    if addr:
        return addr
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, 9))
                return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class Beacon:
    """A listening socket nobody accepts on: its backlog answers handshakes while the process lives."""

    def __init__(self, host: str | None = None) -> None:
        self.host = host or own_address()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((self.host, 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]

    def close(self) -> None:
        self._sock.close()


def probe_one(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect((host, port))
        except ConnectionRefusedError:
            return GONE
        except OSError as exc:  # timeout, EHOSTUNREACH, ENETUNREACH
            if exc.errno == errno.ECONNREFUSED:
                return GONE
            return UNREACHABLE
    return REACHABLE


def probe(peers: list[Peer], timeout_s: float = PROBE_TIMEOUT_S, settle_s: float = 0.0) -> dict[int, str]:
    """Probe every peer at once (one thread each): takes at most about timeout_s (+ settle_s).

    settle_s: probe the peers that answered once more after this long. After a connection reset
    the peer that reset it may still be exiting (its sockets close one by one), so its beacon can
    answer for a few more milliseconds."""
    first = _probe_all(peers, timeout_s)
    again = [p for p in peers if first[p.rank] == REACHABLE]
    if settle_s > 0 and again:
        time.sleep(settle_s)
        first.update(_probe_all(again, timeout_s))
    return first


def _probe_all(peers: list[Peer], timeout_s: float) -> dict[int, str]:
    result: dict[int, str] = {}

    def one(p: Peer) -> None:
        result[p.rank] = probe_one(p.host, p.port, timeout_s)

    threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 1.0)
    return {p.rank: result.get(p.rank, UNREACHABLE) for p in peers}


def is_timeout(error: BaseException) -> bool:
    return "timed out" in str(error).lower()


def is_comm_failure(error: BaseException) -> bool:
    """Whether an exception is a collective that a peer did not complete (timeout, lost connection)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error).lower()
        if any(k in text for k in _COMM_FAILURE) or type(error).__name__ == "DistBackendError":
            return True
        error = error.__cause__ or error.__context__
    return False


def _ranks_by_dc(ranks: list[int], dcs: Mapping[int, int | None]) -> str:
    by_dc: dict[int | None, list[int]] = {}
    for r in sorted(ranks):
        by_dc.setdefault(dcs.get(r), []).append(r)
    parts = []
    for dc, rs in by_dc.items():
        who = f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}"
        parts.append(who if dc is None else f"{who} (DC {dc})")
    return "; ".join(parts)


def failure_line(rank: int, dc: int | None, timeout_s: float | None, status: Mapping[int, str],
                 dcs: Mapping[int, int | None], error: BaseException | None = None) -> str:
    """One line: which peers this rank could not reach after its collective failed, and the fix."""
    me = f"rank {rank}" + ("" if dc is None else f" (DC {dc})")
    text = " ".join(str(error or "").split())
    if error is None or is_timeout(error):
        waited = f"a collective did not complete within {timeout_s:g} s (--hybridep-stall-timeout)" if timeout_s \
            else "a collective timed out"
    else:
        waited = f"a collective failed ({text[text.rfind('] ') + 2 if '] ' in text else 0:][:120]})"
    unreachable = [r for r, s in status.items() if s == UNREACHABLE]
    gone = [r for r, s in status.items() if s == GONE]
    parts = [f"{me}: {waited}"]
    if unreachable:
        parts.append(f"unreachable peers: {_ranks_by_dc(unreachable, dcs)}")
    if gone:
        parts.append(f"peers whose process is gone: {_ranks_by_dc(gone, dcs)}")
    if not status:
        parts.append("peers not probed (no beacon)")
    elif not unreachable and not gone:
        parts.append("every peer is reachable (a peer is stalled, not the network)")
    fix = ("fix: restore the network between these DCs, then rerun with --load <the --save directory> to resume "
           "from the last checkpoint" if unreachable else
           "fix: rerun with --load <the --save directory> to resume from the last checkpoint")
    return "; ".join(parts) + "; " + fix
