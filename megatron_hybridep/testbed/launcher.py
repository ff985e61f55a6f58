"""Run K ranks in each DC namespace with the torch.distributed environment.

Rank order: DC index most significant, rank = dc * K + local_rank (the mixed-radix order the
planner uses). Every rank is `ip netns exec <dc ns> timeout <T> <cmd>` in its own session:
- its own session/process group, so killing the group kills the rank's whole process tree;
- coreutils `timeout` inside, so a rank ends by itself even if this launcher is SIGKILLed;
- with ``preload`` (module names) and a command of this interpreter, the same forked from a warm
  host that imported those modules once (testbed/warm_host.py): a rank then starts in ~0.1 s;
- stdout+stderr merged, read line by line, kept per rank and optionally streamed with a
  "[r<rank> dc<dc>] " prefix and/or written to <log_dir>/rank<rank>.log.

    group = tb.start([sys.executable, "train.py"], timeout_s=300)
    group.wait_output(r"step 3", ranks=[0])   # e.g. change the WAN rate after step 3
    tb.set_rate(1, 50)
    result = group.wait()                     # LaunchResult: returncodes, outputs, timed_out
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from megatron_hybridep.testbed import netns, warm_host
from megatron_hybridep.testbed.interface import EmulatedDCs, RankInfo
from megatron_hybridep.testbed.sh import TestbedError

KILL_GRACE_S = 3.0  # SIGTERM -> SIGKILL
FAIL_FAST_GRACE_S = 2.0  # after a rank fails, how long the others may take to notice and exit
WRAPPER_SLACK_S = 30.0  # the in-namespace `timeout` fires this long after the launcher's own
MAX_OUTPUT_CHARS = 4_000_000  # per rank kept in memory (the tail); log_dir keeps everything


def rank_layout(tb: EmulatedDCs, ranks_per_dc: int) -> list[RankInfo]:
    world = tb.dcs * ranks_per_dc
    return [
        RankInfo(dc * ranks_per_dc + local, dc, local, world, ranks_per_dc, tb.netns(dc),
                 tb.address(dc), tb.interface)
        for dc in range(tb.dcs)
        for local in range(ranks_per_dc)
    ]


def rank_env(info: RankInfo, master_addr: str, master_port: int, num_dcs: int) -> dict[str, str]:
    """The torch.distributed (env://) variables plus HYBRIDEP_* for one rank."""
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "RANK": str(info.rank),
        "WORLD_SIZE": str(info.world_size),
        "LOCAL_RANK": str(info.local_rank),
        "LOCAL_WORLD_SIZE": str(info.ranks_per_dc),
        "GLOO_SOCKET_IFNAME": info.interface,
        "TP_SOCKET_IFNAME": info.interface,
        "HYBRIDEP_DC": str(info.dc),
        "HYBRIDEP_NUM_DCS": str(num_dcs),
        "HYBRIDEP_DC_ADDR": info.address,
        "PYTHONUNBUFFERED": "1",  # so streamed output arrives line by line
    }


PER_RANK_ENV = tuple(rank_env(RankInfo(0, 0, 0, 1, 1, "", "", ""), "", 0, 1))  # the variables ranks differ in


@dataclass
class LaunchResult:
    """Outcome of one launch. returncodes[r] < 0 means rank r was killed by signal -rc."""

    ranks: list[RankInfo]
    returncodes: list[int]
    outputs: list[str]
    timed_out: bool
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)

    @property
    def failed_ranks(self) -> list[int]:
        return [r for r, rc in enumerate(self.returncodes) if rc != 0]

    def raise_for_status(self) -> LaunchResult:
        if self.ok:
            return self
        what = f"timed out after {self.elapsed_s:.1f} s" if self.timed_out else "failed"
        tails = []
        for r in self.failed_ranks[:4]:
            tail = "\n".join(self.outputs[r].splitlines()[-15:])
            tails.append(f"--- rank {r} (exit {self.returncodes[r]}) ---\n{tail}")
        raise TestbedError(f"launch {what}; failed ranks {self.failed_ranks}\n" + "\n".join(tails))


class RankGroup:
    """Running ranks. Use wait() (or launch()) to collect; leaving a `with` block kills them.

    The launch deadline (timeout_s from the start) is enforced by wait(); if nobody waits (or
    the launcher dies), the `timeout` wrapper inside the namespace ends each rank 30 s later."""

    def __init__(
        self,
        tb: EmulatedDCs,
        cmd: Sequence[str] | Callable[[RankInfo], Sequence[str]],
        *,
        ranks_per_dc: int | None = None,
        env: Mapping[str, str] | Callable[[RankInfo], Mapping[str, str]] | None = None,
        timeout_s: float = 600.0,
        stream: IO[str] | None = None,
        log_dir: str | Path | None = None,
        cwd: str | Path | None = None,
        fail_fast: bool = True,
        preload: Sequence[str] = (),
    ) -> None:
        if timeout_s <= 0:
            raise TestbedError("timeout_s must be positive")
        self.ranks = tb.ranks(ranks_per_dc)
        self.timeout_s = timeout_s
        self.fail_fast = fail_fast
        self._preload = list(preload)
        self.master_addr = tb.address(0)
        self.master_port = netns.free_port(tb.netns(0), self.master_addr)
        self._stream = stream
        self._log_dir = Path(log_dir) if log_dir else None
        if self._log_dir:
            self._log_dir.mkdir(parents=True, exist_ok=True)
        self._lines: list[list[str]] = [[] for _ in self.ranks]
        self._chars = [0] * len(self.ranks)
        self._cond = threading.Condition()
        self._stream_lock = threading.Lock()
        self._procs: list[subprocess.Popen[bytes] | warm_host.HostedProcess] = []
        self._readers: list[threading.Thread] = []
        self._returncodes: list[int | None] = [None] * len(self.ranks)
        self._result: LaunchResult | None = None
        self._t0 = time.monotonic()
        self._deadline = self._t0 + timeout_s
        try:
            for info in self.ranks:
                self._spawn(info, tb, cmd, env, cwd)
        except BaseException:
            self.kill()
            raise

    def _spawn(self, info: RankInfo, tb: EmulatedDCs, cmd: object, env: object, cwd: object) -> None:
        argv = [str(a) for a in (cmd(info) if callable(cmd) else cmd)]
        if not argv:
            raise TestbedError("empty command")
        full_env = dict(os.environ)
        full_env.setdefault("OMP_NUM_THREADS", "1")  # K ranks share the cores (as torchrun does)
        full_env.update(rank_env(info, self.master_addr, self.master_port, tb.dcs))
        user_env = env(info) if callable(env) else (env or {})
        full_env.update({k: str(v) for k, v in user_env.items()})
        wrapper_s = round(self.timeout_s + WRAPPER_SLACK_S)
        if self._preload and warm_host.hostable(argv) and os.environ.get("HYBRIDEP_TESTBED_WARM", "1") != "0":
            host = warm_host.host_for(self._preload, full_env, PER_RANK_ENV)
            self._start(info, host.spawn(argv, full_env, str(cwd) if cwd else None, info.netns, wrapper_s))
            return
        proc = subprocess.Popen(
            ["ip", "netns", "exec", info.netns, "timeout", "-k", "5s", f"{wrapper_s}s", *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=cwd,
            start_new_session=True,  # own process group: killpg takes the whole tree
        )
        self._start(info, proc)

    def _start(self, info: RankInfo, proc: subprocess.Popen[bytes] | warm_host.HostedProcess) -> None:
        self._procs.append(proc)
        reader = threading.Thread(target=self._read, args=(info, proc), daemon=True,
                                  name=f"rank{info.rank}-output")
        reader.start()
        self._readers.append(reader)

    def _read(self, info: RankInfo, proc: subprocess.Popen[bytes] | warm_host.HostedProcess) -> None:
        prefix = f"[r{info.rank} dc{info.dc}] "
        log = open(self._log_dir / f"rank{info.rank}.log", "w") if self._log_dir else None  # noqa: SIM115
        try:
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.decode("utf-8", errors="replace")
                if log:
                    log.write(line)
                    log.flush()
                if self._stream is not None:
                    with self._stream_lock:
                        self._stream.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
                        self._stream.flush()
                with self._cond:
                    self._append(info.rank, line)
                    self._cond.notify_all()
        finally:
            if log:
                log.close()
            with self._cond:
                self._cond.notify_all()

    def _append(self, rank: int, line: str) -> None:
        lines = self._lines[rank]
        lines.append(line)
        self._chars[rank] += len(line)
        while self._chars[rank] > MAX_OUTPUT_CHARS and len(lines) > 1:
            self._chars[rank] -= len(lines.pop(0))

    # ------------------------------------------------------------------------------ queries
    @property
    def pids(self) -> list[int]:
        """PIDs of the rank processes (each leads its own process group)."""
        return [p.pid for p in self._procs]

    def output(self, rank: int) -> str:
        with self._cond:
            return "".join(self._lines[rank])

    def poll(self) -> list[int | None]:
        """Exit code per rank, None while running."""
        return [p.poll() for p in self._procs]

    def wait_output(self, pattern: str, *, ranks: Iterable[int] | None = None,
                    timeout_s: float = 60.0) -> bool:
        """Block until each of `ranks` (default: all) printed a line matching regex `pattern`.

        False on timeout, or as soon as a rank that has not matched has exited."""
        regex = re.compile(pattern)
        todo = set(range(len(self.ranks)) if ranks is None else ranks)
        seen = dict.fromkeys(todo, 0)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for r in list(todo):
                    if any(regex.search(line) for line in self._lines[r][seen[r]:]):
                        todo.discard(r)
                    else:
                        seen[r] = len(self._lines[r])
                if not todo:
                    return True
                if any(self._procs[r].poll() is not None and not self._readers[r].is_alive()
                       for r in todo):
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 1.0))  # woken by each new line; 1 s catches exits

    # ---------------------------------------------------------------------------- waiting
    def wait(self, timeout_s: float | None = None) -> LaunchResult:
        """Wait for all ranks (until the launch deadline, or `timeout_s` if sooner: then the
        ranks are killed too). With fail_fast, one failing rank ends the others."""
        if self._result is not None:
            return self._result
        deadline = self._deadline if timeout_s is None else min(self._deadline, time.monotonic() + timeout_s)
        timed_out = False
        try:
            timed_out = not self._wait_all(deadline)
        finally:
            self.kill()  # the stragglers of a failed/timed-out run, and any grandchildren
        for reader in self._readers:
            reader.join(timeout=5.0)
        returncodes = [rc if rc is not None else -signal.SIGKILL for rc in self._returncodes]
        self._result = LaunchResult(
            ranks=self.ranks,
            returncodes=returncodes,
            outputs=["".join(lines) for lines in self._lines],
            timed_out=timed_out,
            elapsed_s=time.monotonic() - self._t0,
        )
        return self._result

    def _wait_all(self, deadline: float) -> bool:
        """Reap ranks as they exit (pidfd + select: no polling loop). False on the deadline."""
        fds: dict[int, int] = {}
        stop_at = deadline
        for i, p in enumerate(self._procs):
            try:
                fds[os.pidfd_open(p.pid)] = i
            except ProcessLookupError:  # already reaped (by poll() or wait_output): nothing to wait on
                self._returncodes[i] = rc = p.wait()
                if rc != 0 and self.fail_fast:
                    stop_at = min(stop_at, time.monotonic() + FAIL_FAST_GRACE_S)
        try:
            while fds:
                left = stop_at - time.monotonic()
                if left <= 0:
                    return stop_at < deadline  # cut short by fail-fast is no timeout
                ready, _, _ = select.select(list(fds), [], [], left)
                for fd in ready:
                    i = fds.pop(fd)
                    os.close(fd)
                    rc = self._procs[i].wait()
                    self._returncodes[i] = rc
                    if rc != 0 and self.fail_fast and fds:
                        # the others would hang in a collective waiting for the dead rank
                        stop_at = min(stop_at, time.monotonic() + FAIL_FAST_GRACE_S)
            return True
        finally:
            for fd in fds:
                os.close(fd)

    def kill(self) -> None:
        """SIGTERM each rank's process group, SIGKILL what is left after a grace period."""
        live = [p for p in self._procs if p.poll() is None]
        for p in live:
            _killpg(p.pid, signal.SIGTERM)
        grace_end = time.monotonic() + KILL_GRACE_S
        for p in live:
            try:
                p.wait(timeout=max(0.0, grace_end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for i, p in enumerate(self._procs):
            _killpg(p.pid, signal.SIGKILL)  # also grandchildren left in the group
            try:
                rc = p.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                rc = None
            if self._returncodes[i] is None:
                self._returncodes[i] = rc

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def start(tb: EmulatedDCs, cmd: Sequence[str] | Callable[[RankInfo], Sequence[str]], **options: Any) -> RankGroup:
    """Start ranks_per_dc ranks (default: the testbed's) in every DC and return at once; ``options``
    as RankGroup's. cmd/env may be callables of RankInfo for per-rank arguments. `env` is added on top
    of this process's environment and the torch.distributed variables (it may override them)."""
    return RankGroup(tb, cmd, **options)


def launch(tb: EmulatedDCs, cmd: Sequence[str] | Callable[[RankInfo], Sequence[str]], **options: Any) -> LaunchResult:
    """start(...) then wait(): per-rank exit codes and output; killed on timeout/failure."""
    return start(tb, cmd, **options).wait()


@dataclass
class ElasticResult:
    """Every start of an elastic launch; the job's outcome is the last one's."""

    attempts: list[LaunchResult]

    @property
    def result(self) -> LaunchResult:
        return self.attempts[-1]

    @property
    def ok(self) -> bool:
        return self.result.ok

    @property
    def restarts(self) -> int:
        return len(self.attempts) - 1


def launch_elastic(tb: EmulatedDCs, cmd: Sequence[str] | Callable[[RankInfo], Sequence[str]], *, max_restarts: int,
                   on_start: Callable[[RankGroup, int], None] | None = None, **options: Any) -> ElasticResult:
    """What torchrun's elastic agent does with --max-restarts: start every rank; when one fails, stop
    them all (fail-fast) and start them all again, at most ``max_restarts`` times. Each start's ranks
    get HYBRIDEP_RESTART_COUNT (0, 1, ...) and HYBRIDEP_MAX_RESTARTS, from which pretrain_moe.py
    resumes from its --save directory. ``on_start(group, attempt)`` runs after each start (e.g. a
    test's fault); ``options`` as start()'s, each start getting the whole ``timeout_s``."""
    user_env = options.pop("env", None)
    attempts: list[LaunchResult] = []
    for attempt in range(max_restarts + 1):
        def env(info: RankInfo, attempt: int = attempt) -> dict[str, str]:
            base = user_env(info) if callable(user_env) else dict(user_env or {})
            return {**base, "HYBRIDEP_RESTART_COUNT": str(attempt), "HYBRIDEP_MAX_RESTARTS": str(max_restarts)}

        with start(tb, cmd, env=env, **options) as group:
            if on_start is not None:
                on_start(group, attempt)
            attempts.append(group.wait())
        if attempts[-1].ok:
            break
    return ElasticResult(attempts)


def python_cmd(script: str | Path, *args: object) -> list[str]:
    """[this interpreter, script, args...]: ranks run in the same venv as the caller."""
    return [sys.executable, str(script), *map(str, args)]
