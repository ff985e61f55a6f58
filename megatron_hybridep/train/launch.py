"""Run a function on N local torch.distributed ranks, each in its own process.

Used by the multi-rank tests, the benchmarks and pretrain_moe.py's local launcher. Guarantees:
a free rendezvous (the parent owns the TCPStore, so no port race), a hard per-run timeout, every
failing rank's traceback in the raised error, each hung rank's stack dumped before it is killed,
no process left behind, and (with ``stall=``) a stalled rank named within a bounded time: ranks
publish progress through ``progress()`` into shared memory and the parent's monitor loop fails the
job when a rank's progress has not moved for the stall timeout.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import multiprocessing as mp
import os
import pickle
import queue
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from megatron_hybridep.runtime.context import process_context
from megatron_hybridep.runtime.logs import quiet_known_warnings
from megatron_hybridep.train.rank_imports import PRELOAD

_SLOTS = 4  # per rank: progress beats, iteration, median step seconds, predicted step seconds
_PHASE = 32  # bytes of phase text per rank


class RankFailure(RuntimeError):
    """One or more ranks raised, crashed or timed out; the message holds every rank's report.
    ``signalled``: the signal the launcher received and forwarded to the ranks (None: none)."""

    def __init__(self, message: str, reports: dict[int, str], signalled: int | None = None) -> None:
        super().__init__(message)
        self.reports = reports
        self.signalled = signalled


class StallFailure(RankFailure):
    """A rank stopped making progress for the stall timeout; ``stalled`` names it (them)."""

    def __init__(self, message: str, reports: dict[int, str], stalled: list[int]) -> None:
        super().__init__(message, reports)
        self.stalled = stalled


@dataclass(frozen=True)
class StallRule:
    """When a rank that has stopped publishing progress is declared stalled.

    ``fixed`` seconds when given; otherwise max(floor, step_factor x the median measured step,
    predicted_factor x the predicted step): generous enough that a slow (WAN) collective inside
    one step never trips it, and far below gloo/NCCL's 30-minute collective timeout.
    """

    fixed: float | None = None
    floor: float = 60.0
    step_factor: float = 10.0
    predicted_factor: float = 3.0

    def seconds(self, median_step: float = 0.0, predicted_step: float = 0.0) -> float:
        if self.fixed is not None:
            return self.fixed
        return max(self.floor, self.step_factor * median_step, self.predicted_factor * predicted_step)


def progress(iteration: int, phase: str, step_seconds: float | None = None,
             predicted_seconds: float | None = None) -> None:
    """Tell the launcher this rank is alive and where it is (no-op outside run_ranks). Cheap: two
    shared-memory writes, no syscall, so it may be called several times per iteration."""
    beat = process_context().heartbeat
    beat.beats, beat.iteration, beat.phase, beat.when = beat.beats + 1, iteration, phase, time.monotonic()
    if beat.slots is None:
        return
    numbers, phases, rank = beat.slots
    base = rank * _SLOTS
    if step_seconds is not None:
        steps = beat.steps
        steps.append(step_seconds)
        del steps[:-101]  # a window: the median of the last ~100 steps
        numbers[base + 2] = sorted(steps)[len(steps) // 2]
    if predicted_seconds is not None:
        numbers[base + 3] = predicted_seconds
    text = phase.encode()[:_PHASE].ljust(_PHASE, b" ")
    phases[rank * _PHASE:(rank + 1) * _PHASE] = text
    numbers[base + 1] = iteration
    numbers[base] += 1  # last: the monitor sees a change only once the rest is written


def progress_status() -> str:
    """This rank's progress as one line, "beats iteration seconds-since phase" (what its beacon
    answers a peer whose collective timed out: train/reachability.py)."""
    beat = process_context().heartbeat
    return f"{beat.beats} {beat.iteration} {time.monotonic() - beat.when:.1f} {beat.phase}"


@dataclass
class RankContext:
    """What a rank function receives besides its own arguments."""

    rank: int
    world_size: int
    env: dict[str, str] = field(default_factory=dict)


@functools.cache
def _forkserver() -> mp.context.ForkServerContext:
    """The fork server's context, its preload set once per process."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_forkserver() -> None:
    """Start the fork server now: a launcher that still has its own imports and checks ahead of it
    (pretrain_moe.py: ~11 CPU-s) runs them beside the server's preload instead of before it."""
    from multiprocessing import forkserver

    _forkserver()  # the preload list first: the server reads it when it starts
    forkserver.ensure_running()


def stop_forkserver() -> None:
    """Kill the fork server start_forkserver() started, once the launcher is done with it: after bad
    input its preload would otherwise go on for seconds after the launcher has returned."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # multiprocessing has no public stop; _stop is what its own tests use
    pid = getattr(server, "_forkserver_pid", None)
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        server._stop()  # reaps it (gone before the launcher returns) and removes its socket file


def _context(start_method: str = "forkserver") -> mp.context.BaseContext:
    if start_method == "spawn":  # CUDA ranks: a forked child cannot use CUDA once its parent has
        return mp.get_context("spawn")
    return _forkserver()


def _rank_main(fn: Callable, rank: int, world_size: int, port: int, timeout: float, threads: int,
               env: dict[str, str], dump_path: str, results: mp.Queue, beat: tuple, args: tuple,
               kwargs: dict) -> None:
    process_context().heartbeat.slots = (*beat, rank)
    # Its own process group: the helpers it starts (Megatron's checkpoint writer) are killed with it,
    # even when it was SIGKILLed and they were left behind (a restart would pile them up)
    os.setpgid(0, 0)
    os.environ.update(env)
    quiet_known_warnings()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # A hung rank dumps every thread's stack and exits by itself, even if the parent is gone.
    dump = open(dump_path, "w")  # noqa: SIM115 - must outlive this frame for faulthandler
    faulthandler.dump_traceback_later(timeout, exit=True, file=dump)
    # The parent asks for a stack dump (SIGUSR1) before it kills a rank stuck behind a failed peer.
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=timedelta(seconds=timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        try:
            out = fn(RankContext(rank, world_size, env), *args, **kwargs)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        # Plain pickle copies tensor data; the queue's own pickler would share it through file
        # descriptors that die with this process.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - the parent reports it with the rank number
        results.put((rank, False, traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
              env: dict[str, str] | None = None, threads: int | None = None, stall: StallRule | None = None,
              start_method: str = "forkserver", forward_signals: bool = False, **kwargs: Any) -> list[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` gloo ranks; return results by rank.

    ``threads``: intra-op threads per rank; None = $HYBRIDEP_RANK_THREADS or 1 (tests vary it to
    change reduction splits, docs/testing.md).

    ``fn`` must be importable (a module-level function). Raises RankFailure naming each rank that
    raised, crashed or hung, with its traceback (or its stack dump when it hung). With ``stall``,
    once ranks call ``progress()``, a rank whose progress stops for ``stall.seconds(...)`` fails
    the job (StallError in the report, naming rank, pid and last phase) without waiting for ``timeout``.
    ``start_method``: "forkserver" (preloaded imports, fast) or "spawn" (ranks that use CUDA: on a
    GPU machine forked ranks failed with "Cannot re-initialize CUDA in forked subprocess").
    ``forward_signals``: a SIGTERM to this process (scancel, preemption, kill) is passed on to every
    rank, which may save and stop (Megatron's --exit-signal-handler) or die; results then come back
    as usual, or a RankFailure with ``signalled`` set. Ranks run in their own process groups, so
    without this they would not see it.
    """
    import torch.distributed as dist

    if threads is None:
        threads = int(os.environ.get("HYBRIDEP_RANK_THREADS", "1"))
    ctx = _context(start_method)
    # The parent hosts the rendezvous store: port 0 picks a free port with no race.
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          timeout=timedelta(seconds=timeout), wait_for_workers=False)
    results: mp.Queue = ctx.Queue()
    beat = (ctx.RawArray("d", world_size * _SLOTS), ctx.RawArray("c", world_size * _PHASE))
    with tempfile.TemporaryDirectory(prefix="hybridep-ranks-") as tmp:
        dumps = [os.path.join(tmp, f"rank{r}.stack") for r in range(world_size)]
        # Not daemonic: ranks may start helpers (Megatron's checkpoint writer does). They still end
        # by themselves (faulthandler timeout) and are killed in the finally below.
        procs = [ctx.Process(target=_rank_main, name=f"rank{r}", daemon=False,
                             args=(fn, r, world_size, store.port, timeout, threads, dict(env or {}),
                                   dumps[r], results, beat, args, kwargs))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        signalled: list[int] = []

        def forward(signum: int, frame: Any) -> None:
            signalled.append(signum)
            for p in procs:
                if p.is_alive() and p.pid is not None:
                    try:
                        os.kill(p.pid, signum)
                    except ProcessLookupError:
                        pass

        previous = None
        if forward_signals and threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, forward)
        outputs: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout + 15  # ranks dump their stacks at `timeout`
        monitor = _StallMonitor(beat, procs, stall) if stall is not None else None
        stalled: list[int] = []
        try:
            while len(outputs) + len(failures) < world_size:
                try:
                    rank, ok, payload = results.get(timeout=0.5)
                except queue.Empty:
                    for r, p in enumerate(procs):
                        if not p.is_alive() and r not in outputs and r not in failures \
                                and p.exitcode not in (0, None):
                            failures[r] = _dead_report(p.exitcode, dumps[r], timeout)
                    found = monitor.check(set(outputs) | set(failures)) if monitor else None
                    if found:
                        stalled = [r for r, text in found.items() if text.startswith("StallError")]
                        failures.update(found)
                        break
                    if time.monotonic() > deadline:
                        for r in range(world_size):
                            if r not in outputs and r not in failures:
                                failures[r] = f"no result after {timeout:.0f}s\n" + _read(dumps[r])
                        break
                    continue
                if ok:
                    outputs[rank] = pickle.loads(payload)
                else:
                    failures[rank] = payload
                if failures and not ok:
                    # Peers of a failed rank usually block in a collective: give them a moment to
                    # fail on their own, then stop waiting.
                    deadline = min(deadline, time.monotonic() + 10)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            _stop(procs, dump_first=bool(failures))
            results.close()
        if failures:
            for r in range(world_size):
                if r not in outputs and r not in failures:
                    failures[r] = "stopped after another rank failed\n" + _read(dumps[r])
            body = "\n".join(f"----- rank {r} -----\n{failures[r]}" for r in sorted(failures))
            message = f"{len(failures)} of {world_size} ranks failed in {fn.__name__}:\n{body}"
            if stalled:
                raise StallFailure(message, failures, stalled)
            if signalled:
                name = signal.Signals(signalled[0]).name
                message = f"{name} received and forwarded to every rank; {message}"
            raise RankFailure(message, failures, signalled[0] if signalled else None)
    return [outputs[r] for r in range(world_size)]


class _StallMonitor:
    """The parent's view of the ranks' progress counters: when each last moved, as seen here (one
    clock, the parent's)."""

    def __init__(self, beat: tuple, procs: list, rule: StallRule) -> None:
        self.numbers, self.phases = beat
        self.procs, self.rule = procs, rule
        self.seen = [(0.0, time.monotonic())] * len(procs)

    def check(self, done: set[int]) -> dict[int, str] | None:
        now, world = time.monotonic(), len(self.procs)
        for r in range(world):
            beats = self.numbers[r * _SLOTS]
            if beats != self.seen[r][0]:
                self.seen[r] = (beats, now)
        if not any(self.seen[r][0] for r in range(world)):
            return None  # nobody publishes progress (start-up, or a function that never calls progress())
        median = max(self.numbers[r * _SLOTS + 2] for r in range(world))
        predicted = max(self.numbers[r * _SLOTS + 3] for r in range(world))
        limit = self.rule.seconds(median, predicted)
        waiting = [r for r in range(world) if r not in done]
        stale = [r for r in waiting if now - self.seen[r][1] > limit]
        if not stale:
            return None
        # The stalled rank is the one behind: stopped by a signal, else fewest beats, else quiet longest.
        stopped = [r for r in stale if _proc_state(self.procs[r].pid) in ("T", "t")]
        culprits = stopped or [min(stale, key=lambda r: (self.seen[r][0], self.seen[r][1]))]
        how = (f"max({self.rule.floor:.0f} s, {self.rule.step_factor:g} x median step {median:.3f} s, "
               f"{self.rule.predicted_factor:g} x predicted {predicted:.3f} s)" if self.rule.fixed is None
               else "--hybridep-stall-timeout")
        reports = {}
        for r in culprits:
            state = "stopped (SIGSTOP/SIGTSTP)" if r in stopped else "running but not progressing"
            reports[r] = (f"StallError: rank {r} (pid {self.procs[r].pid}) made no progress for "
                          f"{now - self.seen[r][1]:.0f} s > stall timeout {limit:.0f} s [{how}]; last at "
                          f"iteration {self.numbers[r * _SLOTS + 1]:.0f}, phase '{self._phase(r)}'; process "
                          f"{state}; fix: find why it stopped, or raise --hybridep-stall-timeout")
        for r in waiting:
            if r not in reports:
                reports[r] = (f"waiting for stalled rank(s) {culprits}: at iteration "
                              f"{self.numbers[r * _SLOTS + 1]:.0f}, phase '{self._phase(r)}'")
        return reports

    def _phase(self, r: int) -> str:
        return bytes(self.phases[r * _PHASE:(r + 1) * _PHASE]).decode(errors="replace").strip()


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def _stop(procs: list, dump_first: bool) -> None:
    for p in procs:
        p.join(timeout=0.1 if dump_first else 2)
    alive = [p for p in procs if p.is_alive()]
    if dump_first and alive:
        for p in alive:
            os.kill(p.pid, signal.SIGUSR1)
        time.sleep(0.5)  # not synchronisation: a grace period for the stack dump before SIGKILL
    for p in alive:
        p.kill()
        p.join(timeout=5)
    for p in procs:  # whatever each rank left in its group (its own exit or SIGKILL does not end them)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _dead_report(exitcode: int, dump_path: str, timeout: float) -> str:
    stack = _read(dump_path)
    if stack:
        return f"timed out after {timeout:.0f}s (exit code {exitcode}); stack at timeout:\n{stack}"
    return f"process died with exit code {exitcode} before reporting"


def world_from_env() -> tuple[int, int]:
    """(rank, world_size) of this process from the torch.distributed environment."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


__all__: Sequence[str] = ["RankContext", "RankFailure", "StallFailure", "StallRule", "progress", "run_ranks",
                           "world_from_env"]
