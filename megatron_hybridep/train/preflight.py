"""Before the local ranks start: check the job once (``preflight``) and say what went wrong in one
line: bad input as the flag and the fix (``one_line``), an internal failure with where it was raised
and its full traceback in a file (``internal_line``, ``save_report``). Used by pretrain_moe.py."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import re
import tempfile
import traceback
import warnings
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def preflight(args: Any, world: int) -> None:
    """What every rank would check before its first collective, done once here: topology, plan,
    Megatron's validate_args and its LR scheduler's assertions. Raises the first problem."""
    from megatron_hybridep.megatron import cpu_runtime
    from megatron_hybridep.train import cpu_loop

    cpu_runtime.enable()  # as the ranks run: under TP, validate_args asks CUDA for the device's arch
    trial = copy.deepcopy(args)
    trial.world_size, trial.rank = world, 0
    quiet = io.StringIO()
    logging.disable(logging.WARNING)  # the ranks print the planner's warnings; not twice
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cpu_loop.plan_job(trial, world)
            from megatron.training.arguments import validate_args
            from megatron.training.global_vars import set_args
            from megatron.training.training import get_optimizer_param_scheduler

            validate_args(trial)
            set_args(trial)
            get_optimizer_param_scheduler(_NoOptimizer())
    finally:
        logging.disable(logging.NOTSET)


class _NoOptimizer:
    """Enough of an optimizer for Megatron's OptimizerParamScheduler to run its checks."""

    param_groups: list = []  # noqa: RUF012


# What checks of the flags and of the files they name raise (Megatron's validate_args asserts)
BAD_INPUT = (ValueError, AssertionError, OSError)


def is_bad_input(error: BaseException) -> bool:
    return isinstance(error, BAD_INPUT)


def internal_line(error: BaseException) -> str:
    """An unexpected failure (not bad input) as one line naming where it was raised (innermost frame)
    and the file that holds its full traceback."""
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
    where = (f"{_short(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}()" if frames
             else type(error).__module__)
    message = " ".join(str(error).split()) or "(no message)"
    report = save_report("".join(traceback.format_exception(error)))
    return (f"internal error before the ranks started: {type(error).__name__}: {message} (raised at {where}; "
            f"full traceback: {report})")


def one_line(error: BaseException, args: Any = None) -> str:
    """A bad input as one line: the message, or for a bare Megatron assertion its source line with
    the flags it involves and their values."""
    text = str(error).strip().splitlines()
    if text and not isinstance(error, AssertionError):
        line = " ".join(t.strip() for t in text)
        if line.startswith("ep_size:") and args is not None:  # the planner's EP group against the world
            flags = [f"--expert-model-parallel-size {args.expert_model_parallel_size}"]
            if "WORLD_SIZE" not in os.environ and "SLURM_PROCID" not in os.environ:
                flags.append(f"--hybridep-nproc {args.hybridep_nproc}")
            return f"{' with '.join(flags)}: {line}"
        field = re.match(r"model\.(\w+):", line)  # the cost model's workload, built from flags
        if field and args is not None:
            name = next((n for n in (f"hybridep_{field.group(1)}", field.group(1)) if hasattr(args, n)), None)
            if name:
                return f"--{name.replace('_', '-')} {getattr(args, name)}: {line}"
        for flag in ("--hybridep-topology", "--hybridep-plan", "--hybridep-dc-map", "--config", "--load"):
            value = getattr(args, flag[2:].replace("-", "_"), None)
            if value and str(value) in line and flag not in line:  # a file's own error: say which flag
                return f"{flag} {line}"
        return line
    frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
    where = f"`{frame.line}` ({_short(frame.filename)}:{frame.lineno})" if frame else type(error).__name__
    message = f"{' '.join(text)}; " if text else ""
    flags = _flags_in(frame.line if frame else " ".join(text), args)
    return (f"Megatron's check failed: {message}{where}"
            + (f"; involved: {flags}; fix: change these flags" if flags else "; fix: see the flags it names"))


_ALIASES = {"lr_warmup_steps": ("lr_warmup_iters", "lr_warmup_fraction"),
            "lr_decay_steps": ("lr_decay_iters", "train_iters"), "wsd_decay_steps": ("lr_wsd_decay_iters",),
            "init_lr": ("lr_warmup_init",), "max_lr": ("lr",), "start_wd": ("start_weight_decay",),
            "end_wd": ("end_weight_decay",)}


def _flags_in(line: str, args: Any) -> str:
    if args is None:
        return ""
    names: list[str] = []
    for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", line):
        for dest in _ALIASES.get(word, (word,)):
            if dest not in names and getattr(args, dest, None) is not None and dest not in ("self", "args"):
                names.append(dest)
    return ", ".join(f"--{n.replace('_', '-')} {getattr(args, n)}" for n in names)


def _short(path: str) -> str:
    return path.split("site-packages/")[-1].replace(REPO + "/", "")


def save_report(text: str) -> str:
    """Write a failure's full report to a file that outlives the run; returns its path."""
    with tempfile.NamedTemporaryFile("w", prefix="pretrain_moe-failure-", suffix=".log", delete=False) as f:
        f.write(text)
    return f.name
