"""Optimizer steps that write 16-bit parameters bump their version counters.

HybridEP's borrowed expert copies are keyed on the owners' parameter version counters
(runtime/borrowed.py: a copy gathered before an optimizer step is never used after it). fp32
optimizers update parameters in place, which bumps them; Megatron's mixed-precision optimizers
(Float16OptimizerWithFloat16Params, DistributedOptimizer with bf16/fp16 params) write the updated
main params back through ``param.data`` (_copy_main_params_to_model_params / the param buffer),
which does not. Without this, every --bf16/--fp16 run kept the first step's borrowed copies.

``install()`` wraps MixedPrecisionOptimizer.step_with_ready_grads (megatron-core 0.19.2): after a
step that updated parameters, every 16-bit model parameter's version is incremented (with the distributed optimizer,
also those whose shard another rank updated: the all-gather writes them through the buffer). Idempotent;
``uninstall()`` restores Megatron's method (teardown() calls it).
"""

from __future__ import annotations

from typing import Any

import torch

_MARK = "_hybridep_bumps_param_versions"


def _model_16bit_params(optimizer: Any) -> list[torch.Tensor]:
    buffers = getattr(optimizer, "buffers", None)
    if buffers:  # DistributedOptimizer: every param of its buffers, shards of other ranks included (all-gathered)
        return [p for buffer in buffers for p in buffer.params if p.dtype in (torch.bfloat16, torch.float16)]
    return [p for group in getattr(optimizer, "float16_groups", []) for p in group]


def install() -> None:
    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

    original = MixedPrecisionOptimizer.step_with_ready_grads
    if getattr(original, _MARK, False):
        return

    def step_with_ready_grads(self: Any, *args: Any, **kwargs: Any) -> Any:
        updated = original(self, *args, **kwargs)
        if updated:
            for param in _model_16bit_params(self):
                torch.autograd.graph.increment_version(param)
        return updated

    setattr(step_with_ready_grads, _MARK, True)
    step_with_ready_grads.__wrapped__ = original
    MixedPrecisionOptimizer.step_with_ready_grads = step_with_ready_grads


def uninstall() -> None:
    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

    current = MixedPrecisionOptimizer.step_with_ready_grads
    if getattr(current, _MARK, False):
        MixedPrecisionOptimizer.step_with_ready_grads = current.__wrapped__
