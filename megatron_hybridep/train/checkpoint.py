"""--save/--load for the CPU loop with Megatron's dist_checkpointing (the same sharded format the
GPU path writes). Megatron's part holds exactly what plain EP holds: borrowed expert copies are not
parameters, so a checkpoint written under hybridep loads under alltoall and the reverse.

For an exact resume each rank also writes its own file, ``hybridep/rank_NNNNN.pt`` in the
iteration's directory: the RNG states and the HybridEP runtime's state (runtime/context.py
state_dict: the codec's copies, error-feedback residuals, shared expert, step counter, plans). A
loader without a runtime (alltoall) ignores it; a checkpoint without it (alltoall, older) resumes
the runtime fresh, as before."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
from typing import Any

import torch
import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"
EXTRA = "hybridep"


def _dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _sharded_state(args: argparse.Namespace, model: Any, optimizer: Any, scheduler: Any, iteration: int,
                   loading: bool = False) -> dict[str, Any]:
    from megatron_hybridep.megatron.training_hooks import sharded_state_dict_metadata

    metadata = sharded_state_dict_metadata(args)  # Megatron's own (distributed optimizer sharding)
    model_sd = model.module.sharded_state_dict(metadata=metadata)
    # is_loading creates the optimizer's (Adam) state first, so the template has slots to fill.
    return {"model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=metadata),
            "opt_param_scheduler": scheduler.state_dict(), "iteration": iteration}


def _extra_file(path: str, rank: int) -> str:
    return os.path.join(path, EXTRA, f"rank_{rank:05d}.pt")


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def save(args: argparse.Namespace, iteration: int, model: Any, optimizer: Any, scheduler: Any,
         runtime: Any = None) -> str:
    """Atomic: every rank writes into iter_N.partial; only after all have finished does rank 0
    rename it to iter_N and then replace the tracker (os.replace), so a rank killed mid-save leaves
    the tracker on the previous complete checkpoint and no half-written iter_N. With a HybridEP
    ``runtime``, call between the optimizer step and its ``after_optimizer_step``."""
    from megatron.core import dist_checkpointing

    path = _dir(args.save, iteration)
    partial = path + ".partial"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a previous attempt killed mid-save
        os.makedirs(partial)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(args, model, optimizer, scheduler, iteration), partial)
    save_extra(partial, iteration, runtime.state_dict() if runtime is not None else None)
    _test_hook_die_in_save(iteration)
    dist.barrier()
    if dist.get_rank() == 0:
        if os.path.exists(path):  # re-saving an iteration (a resumed run): the new one wins
            shutil.rmtree(path)
        os.rename(partial, path)
        tmp = os.path.join(args.save, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(args.save, TRACKER))
    dist.barrier()
    return path


def save_extra(path: str, iteration: int, runtime_state: dict[str, Any] | None) -> None:
    """This rank's own part of the checkpoint in directory ``path`` (after Megatron's shards: it warns
    about a non-empty directory): the RNG and the runtime's ``state_dict`` (None: alltoall). Megatron's
    own loop writes it too (megatron/training_hooks.py), so either loop reads the other's."""
    os.makedirs(os.path.join(path, EXTRA), exist_ok=True)
    extra = {"iteration": iteration, "rng": _rng_state(), "runtime": runtime_state}
    torch.save(extra, _extra_file(path, dist.get_rank()))


def _test_hook_die_in_save(iteration: int) -> None:
    """HYBRIDEP_TEST_DIE_IN_SAVE=RANK:ITERATION kills that rank after its shards are written and before
    the checkpoint is committed (tests/faults: a rank killed while a checkpoint is being saved)."""
    spec = os.environ.get("HYBRIDEP_TEST_DIE_IN_SAVE")
    if spec and spec == f"{dist.get_rank()}:{iteration}":
        os.kill(os.getpid(), signal.SIGKILL)


def latest_iteration(root: str) -> int | None:
    tracker = os.path.join(root, TRACKER)
    if not os.path.exists(tracker):
        return None
    with open(tracker) as f:
        return int(f.read().strip())


def load(args: argparse.Namespace, model: Any, optimizer: Any, scheduler: Any, runtime: Any = None
         ) -> tuple[int, bool]:
    """Restore model, optimizer, scheduler, RNG and the HybridEP ``runtime``'s state; returns the
    iteration to continue from (0 when the directory holds no checkpoint, as Megatron does) and
    whether the runtime's state was restored (then the caller runs its ``after_optimizer_step``
    before the next iteration, as the saved run did after saving)."""
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(args.load)
    step = getattr(args, "ckpt_step", None)  # Megatron's --ckpt-step: that iteration, not the latest
    if step is not None:
        if not os.path.isdir(_dir(args.load, step)):
            saved = sorted(int(d[5:]) for d in (os.listdir(args.load) if os.path.isdir(args.load) else [])
                           if d.startswith("iter_") and d[5:].isdigit())  # not an uncommitted .partial
            raise FileNotFoundError(f"--ckpt-step {step}: no checkpoint of iteration {step} in --load {args.load} "
                                    f"(saved: {saved or 'none'}); fix: pass one of those, or drop --ckpt-step")
        iteration = step
    if iteration is None:
        if getattr(args, "exit_on_missing_checkpoint", False):
            raise FileNotFoundError(f"--load {args.load}: no {TRACKER}; fix: point --load at a --save directory")
        return 0, False
    template = _sharded_state(args, model, optimizer, scheduler, iteration, loading=True)
    state = dist_checkpointing.load(template, _dir(args.load, iteration))
    # no_grad: with fp32/fp64 params the distributed optimizer's main params are views of the
    # model's (grad-requiring) params, and its load copies into them in place.
    with torch.no_grad():
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    restored = load_extra(_dir(args.load, iteration), runtime)
    torch.distributed.barrier()
    return int(state["iteration"]), restored


def load_extra(path: str, runtime: Any, rng: bool = True, device: Any = "cpu") -> bool:
    """Restore this rank's part of the checkpoint in directory ``path`` into ``runtime`` (and the RNG,
    unless the loop restores its own: Megatron's); whether the runtime's state was restored.
    ``device``: where the runtime's tensors go (its experts' device)."""
    path = _extra_file(path, dist.get_rank())
    if not os.path.exists(path):  # written without it (older checkpoints): RNG and runtime start fresh
        return False
    extra = torch.load(path, map_location=device, weights_only=True)
    if rng:
        _set_rng_state(extra["rng"])
    if runtime is None or extra["runtime"] is None:  # alltoall on either side: Megatron's part is all there is
        return False
    return runtime.load_state_dict(extra["runtime"])
