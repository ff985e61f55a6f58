"""A warm host for Python ranks: import the ranks' heavy modules once, then fork each rank from it.

A rank of `python script.py` on the testbed spends ~9 CPU-s importing torch and Megatron before its
first line; four ranks per launch and several launches per run make that most of a short run's time.
The host is a server process (``serve``, started by the launcher's first hosted rank) that imports the
caller's ``preload`` list once (names only: the testbed itself stays torch-free) and then forks one
child per rank. Each child behaves as `ip netns exec <ns> timeout <T> python ...` did:
- it joins the DC's network namespace (setns: root only, as the testbed already is);
- it leads its own session (killpg takes its whole tree) and ends by itself after ``alarm_s``
  (SIGALRM) even if the launcher is SIGKILLed;
- it gets the rank's environment, working directory and argv, with stdout+stderr merged into the
  launcher's pipe; its exit code is reported back by the host (its parent), Popen-style.

Only commands of this interpreter of the forms `script.py ...`, `-m module ...` and `-c code ...` are
hosted; the launcher runs anything else as before. One host serves every launch of a process whose
import-relevant environment (everything but the rank variables and HYBRIDEP_*) is the same.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
import types
from collections.abc import Mapping, Sequence
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import BinaryIO

from megatron_hybridep.testbed.netns import enter_netns

MAX_HOSTS = 2  # hosts kept per process (each holds torch and Megatron: ~1 GB)


def hostable(argv: Sequence[str]) -> bool:
    """True for `<this python> script ...`, `-m mod ...` or `-c code ...` (no other interpreter flags)."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return False
    return argv[1] in ("-c", "-m") and len(argv) >= 3 or not argv[1].startswith("-")


def host_key(env: Mapping[str, str], per_rank: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """The environment a host must be started with for these ranks: read at import time (PYTHONPATH,
    OMP_NUM_THREADS, ATEN_CPU_CAPABILITY, ...), so ranks whose key differs need another host."""
    return tuple(sorted((k, v) for k, v in env.items() if k not in per_rank and not k.startswith("HYBRIDEP_")))


class HostedProcess:
    """One hosted rank, with the parts of subprocess.Popen the launcher uses."""

    def __init__(self, host: WarmHost, pid: int, stdout: BinaryIO, argv: Sequence[str]) -> None:
        self.host, self.pid, self.stdout, self.args = host, pid, stdout, list(argv)

    @property
    def returncode(self) -> int | None:
        return self.host.returncode(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        rc = self.host.wait_exit(self.pid, timeout)
        if rc is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return rc


class WarmHost:
    """The launcher's side of one host: start it, ask it for ranks, collect their exit codes."""

    def __init__(self, preload: Sequence[str], env: Mapping[str, str]) -> None:
        mine, theirs = _socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"import sys; from {__name__} import serve; serve(int(sys.argv[1]), sys.argv[2:])",
             str(theirs.fileno()), *preload],
            stdin=subprocess.DEVNULL, env=dict(env), pass_fds=(theirs.fileno(),))
        theirs.close()
        self.conn = mine
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._started: dict[int, int | str] = {}
        self._exits: dict[int, int] = {}
        self._live: set[int] = set()
        self._dead = False
        self._next_id = 0
        self._reader = threading.Thread(target=self._read, name="warm-host", daemon=True)
        self._reader.start()

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, netns: str,
              alarm_s: int) -> HostedProcess:
        read_fd, write_fd = os.pipe()
        try:
            with self._send_lock:
                self._next_id += 1
                req = self._next_id
                self.conn.send((req, list(argv), dict(env), cwd, netns, alarm_s))
                reduction.send_handle(self.conn, write_fd, self.proc.pid)
            with self._cond:
                self._cond.wait_for(lambda: req in self._started or self._dead)
                answer = self._started.pop(req, "the warm host exited")
        finally:
            os.close(write_fd)
        if isinstance(answer, str):
            os.close(read_fd)
            raise OSError(f"warm host could not start the rank: {answer}")
        return HostedProcess(self, answer, open(read_fd, "rb"), argv)  # noqa: SIM115 - the reader closes it

    def returncode(self, pid: int) -> int | None:
        with self._cond:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits, timeout)
            return self._exits.get(pid)

    def busy(self) -> bool:
        with self._cond:
            return bool(self._live)

    def alive(self) -> bool:
        return not self._dead

    def close(self) -> None:
        """Close the channel: the host exits, and ranks still running are killed (none should be: the
        launcher closes idle hosts, and at exit its ranks are gone). A launcher that is SIGKILLed
        closes nothing: its host sees the channel close and exits, its ranks run on until their alarm."""
        with contextlib.suppress(OSError):
            # shutdown, not only close: the reader thread's blocked recv keeps the socket open otherwise
            with socket.fromfd(self.conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.shutdown(socket.SHUT_RDWR)
            self.conn.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _read(self) -> None:
        try:
            while True:
                kind, *rest = self.conn.recv()
                with self._cond:
                    if kind == "started":
                        req, pid = rest
                        self._started[req] = pid
                        if isinstance(pid, int):
                            self._live.add(pid)
                    elif kind == "exit":
                        pid, rc = rest
                        self._exits[pid] = rc
                        self._live.discard(pid)
                    self._cond.notify_all()
        except (EOFError, OSError):
            pass
        with self._cond:  # a host that died leaves its ranks without a parent to report them
            self._dead = True
            for pid in self._live:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                self._exits[pid] = -signal.SIGKILL
            self._live.clear()
            self._cond.notify_all()


class HostPool:
    """This process's hosts, one per preload list and import-relevant environment, at most MAX_HOSTS
    (the oldest idle one goes first); closed when the process exits."""

    def __init__(self) -> None:
        self._hosts: dict[tuple, WarmHost] = {}
        self._lock = threading.Lock()
        atexit.register(self.close_all)

    def host_for(self, preload: Sequence[str], env: Mapping[str, str], per_rank: Sequence[str]) -> WarmHost:
        key = (tuple(preload), host_key(env, per_rank))
        with self._lock:
            host = self._hosts.get(key)
            if host is not None and host.alive():
                return host
            for old_key, old in list(self._hosts.items()):
                if len(self._hosts) < MAX_HOSTS:
                    break
                if not old.busy():
                    old.close()
                    del self._hosts[old_key]
            host = self._hosts[key] = WarmHost(preload, dict(key[1]))
            return host

    def close_all(self) -> None:
        with self._lock:
            for host in self._hosts.values():
                host.close()
            self._hosts.clear()


@functools.cache
def pool() -> HostPool:
    return HostPool()


def host_for(preload: Sequence[str], env: Mapping[str, str], per_rank: Sequence[str]) -> WarmHost:
    """This process's host for ``preload`` and the import-relevant part of ``env`` (started on first use)."""
    return pool().host_for(preload, env, per_rank)


def _socketpair() -> tuple[Connection, Connection]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return Connection(a.detach()), Connection(b.detach())


# ------------------------------------------------------------------------------------- the host


def serve(fd: int, preload: Sequence[str]) -> None:
    """The host's main loop (its process only): import ``preload``, then fork ranks until the channel closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the launcher's to handle
    for name in preload:
        importlib.import_module(name)
    conn = Connection(fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD writes the wake-up fd
    sys.stdout.flush()
    while True:
        ready, _, _ = select.select([conn.fileno(), wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(conn)
        if conn.fileno() in ready:
            try:
                req, argv, env, cwd, netns, alarm_s = conn.recv()
                out_fd = reduction.recv_handle(conn)
            except (EOFError, OSError):
                return  # the launcher is gone: so is the host; ranks end by their alarm or `down`
            try:
                pid = os.fork()
            except OSError as exc:
                conn.send(("started", req, str(exc)))
                os.close(out_fd)
                continue
            if pid == 0:
                os.close(wake_r)
                os.close(wake_w)
                _rank(conn, out_fd, argv, env, cwd, netns, alarm_s)
            os.close(out_fd)
            conn.send(("started", req, pid))


def _reap(conn: Connection) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        with contextlib.suppress(OSError):
            conn.send(("exit", pid, os.waitstatus_to_exitcode(status)))


def _rank(conn: Connection, out_fd: int, argv: list[str], env: dict[str, str], cwd: str | None, netns: str,
          alarm_s: int) -> None:
    """In the forked child: become the rank, run its command, exit with its code. Never returns."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        conn.close()
        enter_netns(netns)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        if cwd:
            os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        for stream in (sys.stdout, sys.stderr):  # the same objects (loggers made at import hold them), now on the pipe
            stream.reconfigure(line_buffering=True, write_through=True)
        signal.alarm(alarm_s)
        _run(argv[1:])
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            shutdown = getattr(threading, "_shutdown", None)
            if shutdown is not None:
                shutdown()  # as the interpreter does: wait for non-daemon threads
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _run(args: list[str]) -> None:
    """What `python <args>` runs, in this process (its SystemExit propagates)."""
    import runpy

    if args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(args[1], "<string>", "exec"), main.__dict__)  # noqa: S102 - the launcher's own command
    elif args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1

