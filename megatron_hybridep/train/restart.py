"""Restart without a person (issue 28, item 2): after a fault, every rank starts again from the last
complete checkpoint in the --save directory, as Megatron's --load would resume it.

Who restarts depends on who launched the ranks:
- pretrain_moe.py's local launcher: ``run_with_restarts`` (--hybridep-max-restarts N);
- torchrun: its elastic agent (torchrun --max-restarts N), which sets TORCHELASTIC_RESTART_COUNT;
- scripts/slurm/pretrain_moe.sbatch and the testbed's launcher: their own loop, which sets
  HYBRIDEP_RESTART_COUNT / HYBRIDEP_MAX_RESTARTS (a requeued SLURM job has SLURM_RESTART_COUNT).
A restarted rank sets ``--load`` to the --save directory (``resume_on_restart``).

Only faults restart the job (a rank that died or stalled, a collective that failed or timed out):
an exception of the run itself (bad input, NaN) would repeat exactly after an exact resume.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from megatron_hybridep.train import launch
from megatron_hybridep.train.checkpoint import TRACKER, latest_iteration
from megatron_hybridep.train.launch import RankFailure, StallFailure
from megatron_hybridep.train.reachability import looks_like_comm_failure

RESTART_COUNT = ("TORCHELASTIC_RESTART_COUNT", "HYBRIDEP_RESTART_COUNT", "SLURM_RESTART_COUNT")
MAX_RESTARTS = ("TORCHELASTIC_MAX_RESTARTS", "HYBRIDEP_MAX_RESTARTS")


def check_flags(args: argparse.Namespace) -> None:
    """A restart resumes from the last checkpoint: refuse --hybridep-max-restarts without one."""
    n = getattr(args, "hybridep_max_restarts", 0)
    if n and not (args.save and args.save_interval):
        missing = " and ".join(f for f, v in (("--save DIR", args.save), ("--save-interval N", args.save_interval))
                               if not v)
        raise ValueError(f"--hybridep-max-restarts {n} needs {missing}: a restart resumes from the last complete "
                         "checkpoint; fix: add --save <dir> --save-interval <iterations>, or drop "
                         "--hybridep-max-restarts")


def _env_int(env: Mapping[str, str], names: Sequence[str]) -> int | None:
    values = [int(env[n]) for n in names if env.get(n, "").strip().lstrip("-").isdigit()]
    return max(values) if values else None


def check_launched(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> None:
    """Under torchrun/srun the process that launched the ranks restarts them, not pretrain_moe.py:
    --hybridep-max-restarts must agree with it."""
    check_flags(args)
    n = getattr(args, "hybridep_max_restarts", 0)
    outer = _env_int(env, MAX_RESTARTS)
    if n and outer != n:
        has = "sets none" if outer is None else f"allows {outer}"
        raise ValueError(f"--hybridep-max-restarts {n}: this rank was started by torchrun/srun, which restarts the "
                         f"ranks, not pretrain_moe.py (its launcher {has}); fix: torchrun --max-restarts {n} "
                         f"(elastic agent) or scripts/slurm/pretrain_moe.sbatch ... --hybridep-max-restarts {n}")


def resume_on_restart(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> int:
    """On a restart (the launcher's restart count > 0), resume from the --save directory when it
    holds a checkpoint (--load = --save, as Megatron users set it); returns the restart count."""
    count = _env_int(env, RESTART_COUNT) or 0
    if count > 0 and args.save and latest_iteration(args.save) is not None:
        args.load = args.save
    return count


def _own_error(text: str) -> str | None:
    """A rank's report as its error line; None for a rank stopped after another failed."""
    lines = [x for x in text.strip().splitlines() if x.strip()]
    if not lines or lines[0].startswith(("stopped after", "waiting for")):
        return None
    if lines[0].startswith(("process died", "timed out after", "no result after", "StallError")):
        return lines[0].strip()
    return next((x for x in reversed(lines) if not x.startswith(" ")), lines[-1]).strip()


def root_cause(failure: RankFailure) -> str:
    """The root cause among the ranks' reports, one line: a rank that died, stalled or raised, before
    a peer whose collective failed because of it; the lowest rank first."""
    errors = {r: e for r, text in failure.reports.items() if (e := _own_error(text))}
    if failure.signalled is not None:
        return (f"stopped by {signal.Signals(failure.signalled).name} (forwarded to every rank); to save a "
                "checkpoint first, run with --exit-signal-handler and --save")
    if not errors:
        return "every rank stopped; " + failure.reports[min(failure.reports)].splitlines()[0]
    rank = min(errors, key=lambda r: (looks_like_comm_failure(errors[r]) and not errors[r].startswith(
        ("process died", "timed out after", "no result after", "StallError")), r))
    return f"rank {rank}: {errors[rank]}"


def is_fault(failure: RankFailure) -> bool:
    """A rank died, hung or stalled, or a collective failed: what a restart can get past. Not a
    signal the launcher forwarded (someone asked the job to stop)."""
    if failure.signalled is not None:
        return False
    if isinstance(failure, StallFailure):
        return True
    errors = [e for text in failure.reports.values() if (e := _own_error(text))]
    return any(e.startswith(("process died", "timed out after", "no result after")) or looks_like_comm_failure(e)
               for e in errors)


def with_load(argv: Sequence[str], save: str) -> list[str]:
    """``argv`` resuming from ``save`` (argparse: the last --load wins)."""
    return [*argv, "--load", save]


def _since_checkpoint(save: str, attempt_start: float) -> float:
    """Wall seconds of work the restart throws away: since the last checkpoint was committed, or
    since this attempt started when it committed none."""
    try:
        committed = os.path.getmtime(os.path.join(save, TRACKER))
    except OSError:
        committed = attempt_start
    return time.time() - max(committed, attempt_start)


def run_with_restarts(fn: Callable[..., Any], nproc: int, argv: Sequence[str], *fn_args: Any, max_restarts: int,
                      save: str | None, log: Callable[[str], None] = print, **run_kwargs: Any) -> tuple[list[Any], int]:
    """``run_ranks(fn, nproc, argv, *fn_args, ...)``; after a fault, again from the last checkpoint in ``save``
    (``fn`` gets argv with --load), at most ``max_restarts`` times. Returns (results, restarts).
    The last failure is raised with ``restarts`` (how many were made) and ``restartable`` set."""
    attempt, current = 0, list(argv)
    while True:
        started = time.time()
        try:
            # launch.run_ranks looked up here: the input tests stub it
            return launch.run_ranks(fn, nproc, current, *fn_args, **run_kwargs), attempt
        except RankFailure as failure:
            failure.restarts, failure.restartable = attempt, is_fault(failure)
            if attempt >= max_restarts or not failure.restartable or not save:
                raise
            attempt += 1
            lost = _since_checkpoint(save, started)
            resumed = latest_iteration(save)
            where = (f"resuming from iteration {resumed} (the last complete checkpoint in {save})"
                     if resumed is not None else "starting again from the beginning (no checkpoint yet)")
            cause = root_cause(failure)
            if len(cause) > 300:
                cause = cause[:297] + "..."
            log(f"[pretrain_moe] restart {attempt}/{max_restarts}: {cause}; {where}; time lost {lost:.1f} s "
                "(the work since the last checkpoint) plus this restart's start-up")
            current = with_load(argv, save) if resumed is not None else list(argv)
