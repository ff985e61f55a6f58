"""The control channel between `hybridep bench` (parent) and its rank 0 worker: newline-delimited
JSON requests and replies over a Unix socket (a file path, so it works across the DC network
namespaces: the ranks share the parent's filesystem, not its network).

The worker asks before each phase ("what now?"); the parent changes the WAN rate, picks plans and
answers with what to run. No sleeps: the parent blocks in select() on the socket and on pidfds of
the rank processes, so a crashed rank wakes it as surely as a request does.

    server = ControlServer(path)                 # parent, before launching the ranks
    server.serve(pids, handler, deadline)        # handler(request) -> reply, until a "bye"
    result = launch_controlled(tb, cmd, handler, path, deadline, env=env)  # parent: the two around tb.start
    client = ControlClient(path)                 # worker rank 0
    reply = client.request({"phase": "next"})
"""

from __future__ import annotations

import json
import os
import select
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

CONTROL_ENV = "HYBRIDEP_BENCH_CONTROL"  # the socket path, passed to the ranks in their environment
BYE = "bye"


class ControlError(RuntimeError):
    """The other side went away or broke the protocol."""


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall((json.dumps(msg) + "\n").encode())


class _LineReader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def ready(self) -> bool:
        return b"\n" in self.buf

    def feed(self) -> bool:
        """Read what is there; False at EOF."""
        chunk = self.sock.recv(65536)
        self.buf += chunk
        return bool(chunk)

    def line(self) -> dict[str, Any]:
        raw, self.buf = self.buf.split(b"\n", 1)
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ControlError(f"bad control message {raw[:200]!r}: {exc}") from None


class ControlServer:
    """Parent side. Create before the ranks start (they connect at once)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(1)

    def serve(self, pids: Sequence[int], handler: Callable[[dict[str, Any]], dict[str, Any]],
              deadline: float) -> bool:
        """Answer requests until the worker says bye (True) or a rank exits / the deadline passes
        (False: the caller's group.wait() then reports why)."""
        pidfds = [os.pidfd_open(p) for p in pids]
        conn: socket.socket | None = None
        try:
            reader: _LineReader | None = None
            while True:
                if reader is not None and reader.ready():
                    request = reader.line()
                    if request.get("op") == BYE:
                        _send(conn, {"ok": True})  # type: ignore[arg-type]
                        return True
                    _send(conn, handler(request))  # type: ignore[arg-type]
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                watch = [conn if conn is not None else self.sock, *pidfds]
                ready, _, _ = select.select(watch, [], [], left)
                if any(fd in ready for fd in pidfds):
                    return False  # a rank ended before saying bye: it failed
                if conn is None and self.sock in ready:
                    conn, _ = self.sock.accept()
                    reader = _LineReader(conn)
                elif conn is not None and conn in ready and reader is not None and not reader.feed():
                    return False  # rank 0 closed the channel without bye
        finally:
            for fd in pidfds:
                os.close(fd)
            if conn is not None:
                conn.close()

    def close(self) -> None:
        self.sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class ControlClient:
    """Worker side (rank 0 only)."""

    def __init__(self, path: str, timeout_s: float = 3600.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)  # the parent answers in seconds; this only bounds a hang
        self.sock.connect(path)
        self.reader = _LineReader(self.sock)

    def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        _send(self.sock, msg)
        while not self.reader.ready():
            if not self.reader.feed():
                raise ControlError("the bench parent closed the control channel")
        return self.reader.line()

    def bye(self) -> None:
        self.request({"op": BYE})
        self.sock.close()


def launch_controlled(tb: Any, cmd: Sequence[str], handler: Callable[[dict[str, Any]], dict[str, Any]], path: str,
                      deadline: float, *, env: dict[str, str], **options: Any) -> Any:
    """Run ``cmd``'s ranks on the testbed ``tb`` (testbed.Testbed; ``options`` as its start's) with a
    control server at ``path`` (the ranks' environment: ``env`` plus CONTROL_ENV), answering rank 0
    with ``handler`` until it says bye, a rank ends or ``deadline`` (time.monotonic()) passes.
    Returns the ranks' LaunchResult (not raised for status)."""
    server = ControlServer(path)
    try:
        group = tb.start(cmd, env={**env, CONTROL_ENV: server.path}, **options)
        with group:
            server.serve(group.pids, handler, deadline)
            return group.wait()
    finally:
        server.close()
