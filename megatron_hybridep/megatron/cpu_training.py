"""megatron.training's own loop (pretrain(): initialize, get_model, train, save/load) on CPU with
gloo: the entries cpu_runtime.enable() adds for it. Used by the CPU tests of pretrain_moe.py's GPU
path; on a GPU nothing here is applied. Checked against megatron-core 0.19.2."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

# Modules whose module-global ``torch`` becomes cpu_runtime's CPU stand-in, with what needs it.
MODULE_SHIMS: dict[str, str] = {
    "megatron.training.initialize":
        "finish_mpu_init (MoE aux-loss scale on torch.cuda.current_device())",
    "megatron.training.training":
        "pretrain's start-time all-reduces on 'cuda', checkpoint_and_decide_exit's exit-duration flag, "
        "torch.cuda.empty_cache",
    "megatron.training.checkpointing":
        "read_metadata's iteration all-reduce on 'cuda', get_rng_state (torch.cuda.get_rng_state)",
    "megatron.training.utils.common_utils":
        "reduce_max_stat_across_model_parallel_group, logical_and_across_model_parallel_group on 'cuda'",
    "megatron.core.timers": "Timer.start/stop (torch.cuda.synchronize), _get_elapsed_time_all_ranks buffer",
    "megatron.core.rerun_state_machine":
        "RerunStateMachine._save_state/_restore_state (torch.cuda RNG), state_dict flags on 'cuda'",
}


def _allow_no_cuda(orig: Callable) -> Callable:
    """Wraps initialize_megatron as pretrain() calls it: upstream asserts torch.cuda.is_available()
    unless allow_no_cuda, its documented switch for CPU-only runs."""

    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return orig(*args, **kwargs)

    return initialize_megatron


@contextlib.contextmanager
def _module_cuda_to_cpu_is_a_no_op() -> Any:
    """While active, ``module.cuda('cpu')`` (the shim's current device) leaves the module where it
    is. nn.Module.cuda is a class attribute: process-wide, held only around get_model (start-up)."""
    original = torch.nn.Module.cuda

    def cuda(self: torch.nn.Module, device: Any = None) -> torch.nn.Module:
        if device == "cpu":
            return self
        return original(self, device)

    torch.nn.Module.cuda = cuda
    try:
        yield
    finally:
        torch.nn.Module.cuda = original


def _model_stays_on_cpu(orig: Callable) -> Callable:
    """Wraps get_model, which moves every model chunk to torch.cuda.current_device() (GPU
    allocation, unless meta-device or FSDP2 initialisation); on CPU the chunks already are there."""

    def get_model(*args: Any, **kwargs: Any) -> Any:
        with _module_cuda_to_cpu_is_a_no_op():
            return orig(*args, **kwargs)

    return get_model


# (module, attribute or 'Class.method', original -> replacement, upstream function affected)
FUNCTION_PATCHES: tuple[tuple[str, str, Callable[[Any], Any], str], ...] = (
    ("megatron.training.training", "initialize_megatron", _allow_no_cuda,
     "initialize.initialize_megatron as pretrain() calls it (asserts CUDA unless allow_no_cuda)"),
    ("megatron.training.training", "get_model", _model_stays_on_cpu,
     "training.get_model (model_module.cuda(torch.cuda.current_device()))"),
)
