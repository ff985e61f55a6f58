"""Name the peers a rank cannot reach when a collective times out (torch-free).

gloo's timeout says only "Timed out waiting ... for recv"; it names no peer. Each rank therefore
opens a listening socket (a beacon) at start-up and the ranks exchange the endpoints. The kernel
completes a TCP handshake on a listening socket without the process doing anything, so after a
timeout a connect to a peer's beacon tells the three cases apart:
connected -> the host is reachable (the peer is alive, maybe stalled); refused -> reachable, but
the peer process is gone; no answer within the probe timeout -> unreachable (the network).

Which live peer is stalled: a beacon built with ``status`` also has a thread that replies with the
rank's progress ("beats iteration seconds-since phase", train/launch.py progress_status). A stopped
process completes the handshake (the kernel does) but never replies; a live one that is behind
replies with fewer progress beats than the others.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

PROBE_TIMEOUT_S = 2.0
REACHABLE, GONE, UNREACHABLE = "reachable", "process gone", "unreachable"
STOPPED = "not answering"  # handshake done by the kernel, no progress reply: the process is stopped
# what a failed collective's exception says (gloo, torch.distributed) when a peer did not answer
_COMM_FAILURE = ("timed out", "timeout", "connection closed by peer", "connection reset by peer",
                 "broken pipe", "no route to host")


@dataclass(frozen=True)
class Peer:
    rank: int
    dc: int | None
    host: str
    port: int
    answers: bool = False  # its beacon replies with its progress


@dataclass(frozen=True)
class Progress:
    """A peer's progress as its beacon reported it."""

    beats: int
    iteration: int
    idle_s: float
    phase: str

    @classmethod
    def parse(cls, line: str) -> Progress | None:
        parts = line.strip().split(" ", 3)
        try:
            return cls(int(parts[0]), int(parts[1]), float(parts[2]), parts[3] if len(parts) > 3 else "")
        except (ValueError, IndexError):
            return None


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
    """A listening socket: its backlog answers handshakes while the process lives; with ``status``,
    a thread replies to each connection with ``status()`` (which a stopped process cannot)."""

    def __init__(self, host: str | None = None, status: Callable[[], str] | None = None) -> None:
        self.host = host or own_address()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((self.host, 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        if status is not None:
            threading.Thread(target=self._serve, args=(status,), name="hybridep-beacon", daemon=True).start()

    def _serve(self, status: Callable[[], str]) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.sendall((status() + "\n").encode())
                except OSError:
                    pass

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the serving thread's accept
        except OSError:
            pass
        self._sock.close()


def probe_one(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    return _probe_peer(host, port, timeout_s, read=False)[0]


def _probe_peer(host: str, port: int, timeout_s: float, read: bool) -> tuple[str, Progress | None]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect((host, port))
        except ConnectionRefusedError:
            return GONE, None
        except OSError as exc:  # timeout, EHOSTUNREACH, ENETUNREACH
            if exc.errno == errno.ECONNREFUSED:
                return GONE, None
            return UNREACHABLE, None
        if not read:
            return REACHABLE, None
        data = b""
        try:
            while not data.endswith(b"\n"):
                chunk = s.recv(256)
                if not chunk:
                    break
                data += chunk
        except OSError:  # timeout: connected, but nothing answers
            pass
    progress = Progress.parse(data.decode(errors="replace")) if data else None
    return (REACHABLE, progress) if progress is not None else (STOPPED, None)


def probe(peers: list[Peer], timeout_s: float = PROBE_TIMEOUT_S, settle_s: float = 0.0,
          progress: dict[int, Progress] | None = None) -> dict[int, str]:
    """Probe every peer at once (one thread each): at most about 2 x timeout_s a pass (a second with settle_s).
    ``progress``, when given, receives what answering peers reported.

    settle_s: probe every peer not found gone once more after this long. After a connection reset
    the peer that reset it may still be exiting (its sockets close one by one, after its memory is
    freed), so its beacon can answer for a while longer, or not complete the handshake at all (seen
    once in CI: a killed peer probed "unreachable" right after its reset)."""
    found: dict[int, Progress] = {}
    first = _probe_all(peers, timeout_s, found)
    again = [p for p in peers if first[p.rank] != GONE]
    if settle_s > 0 and again:
        time.sleep(settle_s)
        first.update(_probe_all(again, timeout_s, found))
    if progress is not None:
        progress.update({r: p for r, p in found.items() if first[r] == REACHABLE})
    return first


def _probe_all(peers: list[Peer], timeout_s: float, progress: dict[int, Progress]) -> dict[int, str]:
    result: dict[int, str] = {}

    def one(p: Peer) -> None:
        result[p.rank], found = _probe_peer(p.host, p.port, timeout_s, read=p.answers)
        if found is not None:
            progress[p.rank] = found

    threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * timeout_s + 1.0)
    return {p.rank: result.get(p.rank, UNREACHABLE) for p in peers}


def is_timeout(error: BaseException) -> bool:
    return "timed out" in str(error).lower()


def looks_like_comm_failure(text: str) -> bool:
    """Whether an error's text is what gloo/torch.distributed say when a peer did not answer."""
    text = text.lower()
    return any(k in text for k in _COMM_FAILURE) or "distbackenderror" in text


def is_comm_failure(error: BaseException) -> bool:
    """Whether an exception is a collective that a peer did not complete (timeout, lost connection)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if looks_like_comm_failure(str(error)) or type(error).__name__ == "DistBackendError":
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


def _behind(progress: Mapping[int, Progress], mine: Progress | None) -> list[int]:
    """Peers with fewer progress beats than the furthest rank (this one included)."""
    beats = [p.beats for p in progress.values()] + ([mine.beats] if mine is not None else [])
    return [r for r, p in progress.items() if p.beats < max(beats, default=0)]


def failure_line(rank: int, dc: int | None, timeout_s: float | None, status: Mapping[int, str],
                 dcs: Mapping[int, int | None], error: BaseException | None = None,
                 progress: Mapping[int, Progress] | None = None, mine: Progress | None = None) -> str:
    """One line: which peers this rank could not reach after its collective failed, which live peer
    is stalled (``progress``: what answering peers reported; ``mine``: this rank's), and the fix."""
    me = f"rank {rank}" + ("" if dc is None else f" (DC {dc})")
    text = " ".join(str(error or "").split())
    if error is None or is_timeout(error):
        waited = f"a collective did not complete within {timeout_s:g} s (--hybridep-stall-timeout)" if timeout_s \
            else "a collective timed out"
    else:
        waited = f"a collective failed ({text[text.rfind('] ') + 2 if '] ' in text else 0:][:120]})"
    unreachable = [r for r, s in status.items() if s == UNREACHABLE]
    gone = [r for r, s in status.items() if s == GONE]
    stopped = [r for r, s in status.items() if s == STOPPED]
    behind = _behind(progress or {}, mine)
    parts = [f"{me}: {waited}"]
    if unreachable:
        parts.append(f"unreachable peers: {_ranks_by_dc(unreachable, dcs)}")
    if gone:
        parts.append(f"peers whose process is gone: {_ranks_by_dc(gone, dcs)}")
    if stopped:
        parts.append(f"stalled peers (reachable, process not answering: stopped?): {_ranks_by_dc(stopped, dcs)}")
    for r in behind:
        p = progress[r]
        parts.append(f"stalled peer: {_ranks_by_dc([r], dcs)} is behind, at iteration {p.iteration} "
                     f"({p.phase}), no progress for {p.idle_s:.0f} s")
    if not status:
        parts.append("peers not probed (no beacon)")
    elif not unreachable and not gone and not stopped and not behind:
        parts.append("every peer is reachable (a peer is stalled, not the network)")
    fix = ("fix: restore the network between these DCs, then rerun with --load <the --save directory> to resume "
           "from the last checkpoint" if unreachable else
           "fix: rerun with --load <the --save directory> to resume from the last checkpoint")
    return "; ".join(parts) + "; " + fix
