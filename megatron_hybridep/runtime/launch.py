"""Run a function on N local torch.distributed ranks, each in its own process.

Used by the multi-rank tests, the benchmarks and pretrain_moe.py's local launcher. Guarantees:
a free rendezvous (the parent owns the TCPStore, so no port race), a hard per-run timeout, every
failing rank's traceback in the raised error, each hung rank's stack dumped before it is killed,
and no process left behind.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

# Imported once by the fork server so each rank starts in ~0.1 s instead of re-importing torch and
# Megatron (~5 s each on these machines).
PRELOAD = ["torch", "torch.distributed", "megatron.core.transformer.moe.moe_layer",
           "megatron.core.models.gpt.gpt_model", "megatron.core.distributed", "megatron.core.optimizer"]

_CTX: mp.context.ForkServerContext | None = None


class RankFailure(RuntimeError):
    """One or more ranks raised, crashed or timed out; the message holds every rank's report."""

    def __init__(self, message: str, reports: dict[int, str]) -> None:
        super().__init__(message)
        self.reports = reports


@dataclass
class RankContext:
    """What a rank function receives besides its own arguments."""

    rank: int
    world_size: int
    env: dict[str, str] = field(default_factory=dict)


def _context() -> mp.context.ForkServerContext:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


def _rank_main(fn: Callable, rank: int, world_size: int, port: int, timeout: float, threads: int,
               env: dict[str, str], dump_path: str, results: mp.Queue, args: tuple, kwargs: dict) -> None:
    os.environ.update(env)
    for harmless in (r".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*",
                     r".*transformer-engine>=1\.7\.0 supports MoE experts.*",
                     r"full scope is deprecated.*", r"MimoModelConfig is experimental.*",
                     r".*`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated.*"):
        # CPU: no TE/Apex by design; the rest are Megatron's own calls, repeated on every rank
        warnings.filterwarnings("ignore", message=harmless)
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
              env: dict[str, str] | None = None, threads: int | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` gloo ranks; return results by rank.

    ``threads``: intra-op threads per rank; None = $HYBRIDEP_RANK_THREADS or 1 (tests vary it to
    change reduction splits, docs/testing.md).

    ``fn`` must be importable (a module-level function). Raises RankFailure naming each rank that
    raised, crashed or hung, with its traceback (or its stack dump when it hung).
    """
    import torch.distributed as dist

    if threads is None:
        threads = int(os.environ.get("HYBRIDEP_RANK_THREADS", "1"))
    ctx = _context()
    # The parent hosts the rendezvous store: port 0 picks a free port with no race.
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          timeout=timedelta(seconds=timeout), wait_for_workers=False)
    results: mp.Queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hybridep-ranks-") as tmp:
        dumps = [os.path.join(tmp, f"rank{r}.stack") for r in range(world_size)]
        # Not daemonic: ranks may start helpers (Megatron's checkpoint writer does). They still end
        # by themselves (faulthandler timeout) and are killed in the finally below.
        procs = [ctx.Process(target=_rank_main, name=f"rank{r}", daemon=False,
                             args=(fn, r, world_size, store.port, timeout, threads, dict(env or {}),
                                   dumps[r], results, args, kwargs))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        outputs: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout + 15  # ranks dump their stacks at `timeout`
        try:
            while len(outputs) + len(failures) < world_size:
                try:
                    rank, ok, payload = results.get(timeout=0.5)
                except queue.Empty:
                    for r, p in enumerate(procs):
                        if not p.is_alive() and r not in outputs and r not in failures \
                                and p.exitcode not in (0, None):
                            failures[r] = _dead_report(p.exitcode, dumps[r], timeout)
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
            _stop(procs, dump_first=bool(failures))
            results.close()
        if failures:
            for r in range(world_size):
                if r not in outputs and r not in failures:
                    failures[r] = "stopped after another rank failed\n" + _read(dumps[r])
            body = "\n".join(f"----- rank {r} -----\n{failures[r]}" for r in sorted(failures))
            raise RankFailure(f"{len(failures)} of {world_size} ranks failed in {fn.__name__}:\n{body}",
                              failures)
    return [outputs[r] for r in range(world_size)]


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


__all__: Sequence[str] = ["RankContext", "RankFailure", "run_ranks", "world_from_env"]
