"""A torch stand-in for Apex's ``fused_weight_gradient_mlp_cuda`` (Megatron's fused wgrad kernel for
--gradient-accumulation-fusion with local layers), so the fusion path runs where Apex cannot be
installed: on CPU, and on GPU machines without Apex or TransformerEngine. Apex's contract:
``main_grad += grad_output^T @ input``, accumulated in main_grad's dtype."""

from __future__ import annotations

import types

import torch


def _wgrad_accum(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    STAND_IN.calls += 1
    main_grad.add_(grad_output.t().to(main_grad.dtype) @ total_input.to(main_grad.dtype))


STAND_IN = types.SimpleNamespace(wgrad_gemm_accum_fp32=_wgrad_accum, wgrad_gemm_accum_fp16=_wgrad_accum, calls=0)


def install() -> types.SimpleNamespace:
    """Make Megatron's linear layers use the stand-in (before the model is built). Returns it;
    ``calls`` counts the fused wgrad calls."""
    from megatron_hybridep.megatron.compat import use_wgrad_kernel

    use_wgrad_kernel(STAND_IN)
    return STAND_IN
