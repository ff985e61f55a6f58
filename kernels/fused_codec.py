"""The codec fused into the passes around it (the paper fused encode into the optimizer step and
decode into the expert computation, cutting their overheads by up to 30% and 45%).

* :func:`adamw_step_hist` - the optimizer step's pass over a layer's expert rows [R, n] (AdamW on
  the fp32 master weights, the model copy written in its dtype, as Megatron's mixed-precision
  optimizers do) also counts each row's first radix-select histogram of |model - base|. Passing it
  to the encode (``first_hist`` of kernels.codec.residual_topk_encode, ``first_hists`` of
  SharedResidualCodec.encode_batch) skips the encode's first read of weight and base; the encoded
  payload is bit-identical to the unfused encode of the same weights.
* :func:`decode_rows` - the step just before the expert computation: every borrowed row of a layer
  rebuilt in one launch, with the rebase after a shared-expert refresh (base + shift) folded into
  the same pass: out = round(round(base + shift) + scatter(values)), bit-equal to the unfused
  ``decode(base + shift)``.

Both have a torch reference (CPU, and the semantics) and a Triton backend (CUDA, or CPU tensors
under TRITON_INTERPRET=1), picked as in kernels/codec.py.
"""

from __future__ import annotations

import math

import torch
from megatron_hybridep.kernels.codec import Backend, _pick, offsets_per_entry, sparse_residual_decode_torch


def adamw_scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> dict:
    """The per-step constants of the update (both backends use exactly these, as fp32)."""
    if step < 1:
        raise ValueError(f"step counts optimizer steps from 1, got {step}")

    def f32(x: float) -> float:
        return torch.tensor(x, dtype=torch.float32).item()

    return dict(decay=f32(1 - lr * weight_decay), beta1=f32(beta1), one_minus_beta1=f32(1 - beta1),
                beta2=f32(beta2), one_minus_beta2=f32(1 - beta2), step_size=f32(lr / (1 - beta1 ** step)),
                inv_sqrt_bc2=f32(1 / math.sqrt(1 - beta2 ** step)), eps=f32(eps))


def first_digit_hist(model: torch.Tensor, base: torch.Tensor | None) -> torch.Tensor:
    """int32[R, 256]: per row, the histogram of bits 24..30 of |float32(model) - float32(base)|."""
    r = model.float() if base is None else model.float() - base.float()
    digit = ((r.view(torch.int32) & 0x7FFFFFFF) >> 24).long()
    rows = digit.shape[0]
    flat = digit + 256 * torch.arange(rows, device=digit.device).unsqueeze(1)
    return torch.bincount(flat.reshape(-1), minlength=256 * rows).view(rows, 256).to(torch.int32)


def adamw_step_hist_torch(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                          model_out: torch.Tensor, base: torch.Tensor | None, scalars: dict) -> torch.Tensor:
    """Torch reference of :func:`adamw_step_hist` (the same update, op by op)."""
    s = scalars
    g = grad.float()
    param.mul_(s["decay"])
    exp_avg.mul_(s["beta1"]).add_(g * s["one_minus_beta1"])
    exp_avg_sq.mul_(s["beta2"]).add_((g * g) * s["one_minus_beta2"])
    denom = exp_avg_sq.sqrt().mul_(s["inv_sqrt_bc2"]).add_(s["eps"])
    param.sub_((exp_avg / denom) * s["step_size"])
    model_out.copy_(param)
    return first_digit_hist(model_out, base)


def adamw_step_hist(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    model_out: torch.Tensor, base: torch.Tensor | None, *, lr: float, beta1: float = 0.9,
                    beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0, step: int,
                    backend: Backend = "auto") -> torch.Tensor:
    """One AdamW step over expert rows, fused with the encode's first pass. Returns int32[R, 256].

    param, exp_avg, exp_avg_sq: fp32 [R, n], updated in place (decoupled weight decay, bias
    correction with ``step`` counted from 1). grad: [R, n], any float dtype. model_out: [R, n] in
    the model's dtype, receives the updated weights (round to nearest even). base: [R, n] or None
    (zeros): what the encode subtracts (the shared expert or the peers' copy). The Triton backend
    may differ from the torch reference in the last bit of the update (fused multiply-add); the
    histogram always matches the model weights it wrote, which is what the encode needs.
    """
    rows = param.shape[0]
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("model_out", model_out)) + (
            (("base", base),) if base is not None else ()):
        if t.shape != param.shape or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous with param's shape {tuple(param.shape)}, "
                             f"got {tuple(t.shape)}")
    if param.dim() != 2 or any(t.dtype != torch.float32 for t in (param, exp_avg, exp_avg_sq)):
        raise ValueError("param, exp_avg and exp_avg_sq must be fp32 [rows, n]")
    scalars = adamw_scalars(lr, beta1, beta2, eps, weight_decay, step)
    if _pick(backend, param) == "triton":
        from megatron_hybridep.kernels import _fused_triton

        hist = torch.zeros(rows, 256, dtype=torch.int32, device=param.device)
        _fused_triton.adamw_hist(param, grad, exp_avg, exp_avg_sq, model_out, base, hist, scalars)
        return hist
    return adamw_step_hist_torch(param, grad, exp_avg, exp_avg_sq, model_out, base, scalars)


def _entries(offsets: torch.Tensor, counts: torch.Tensor, block_bits: int, n: int, tile: int) -> torch.Tensor:
    """int32[R, ntiles + 1]: per row, the first entry of every `tile`-element output tile."""
    rows, k = offsets.shape
    ntiles = -(-n // tile)
    if block_bits == 8 and tile == 256:
        return torch.nn.functional.pad(counts.long().cumsum(1), (1, 0)).to(torch.int32)
    if block_bits >= 32:
        idx = offsets.long()
    else:
        blocks = torch.arange(counts.shape[1], device=offsets.device).repeat(rows)
        idx = (torch.repeat_interleave(blocks, counts.reshape(-1).long(), output_size=rows * k) << block_bits)
        idx = idx.view(rows, k) + offsets.long()
    bounds = (torch.arange(ntiles + 1, device=offsets.device, dtype=torch.int64) * tile).expand(rows, -1)
    return torch.searchsorted(idx.contiguous(), bounds.contiguous()).to(torch.int32)


def decode_rows_torch(base: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor,
                      block_bits: int, out: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`decode_rows`: the unfused path, row by row."""
    for r in range(out.shape[0]):
        b = base[r] if shift is None else base[r] + shift.reshape(-1)
        sparse_residual_decode_torch(b, values[r], offsets[r], counts[r], block_bits, out[r])
    return out


def decode_rows(base: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor,
                block_bits: int, out: torch.Tensor, *, shift: torch.Tensor | None = None,
                backend: Backend = "auto") -> torch.Tensor:
    """out[r] = (base[r] + shift) + scatter(values[r] at offsets[r]/counts[r]) for every row r.

    base, out: contiguous [R, n] (base may be out); values/offsets/counts: [R, k] / [R, k] /
    [R, nblocks], rows may be strided (column slices of a [R, nbytes] payload buffer, as
    SharedResidualCodec.decode_rows passes them); shift: [n] or None. Returns out.
    """
    rows, n = out.shape
    if base.shape != out.shape or not base.is_contiguous() or not out.is_contiguous():
        raise ValueError(f"base and out must be contiguous [rows, n], got {tuple(base.shape)}, {tuple(out.shape)}")
    if values.shape[0] != rows or counts.shape[0] != rows \
            or offsets.shape != (rows, values.shape[1] * offsets_per_entry(block_bits)):
        raise ValueError("values, offsets and counts need one row per output row")
    if shift is not None and (shift.numel() != n or shift.dtype != base.dtype):
        raise ValueError(f"shift must have {n} elements of {base.dtype}")
    if _pick(backend, out, block_bits) == "triton":
        from megatron_hybridep.kernels._codec_triton import TILE

        from megatron_hybridep.kernels import _fused_triton

        ent = _entries(offsets, counts, block_bits, n, TILE)
        _fused_triton.decode_rows(base, values, offsets, counts, block_bits, out,
                                  None if shift is None else shift.reshape(-1).contiguous(), ent)
        return out
    return decode_rows_torch(base, values, offsets, counts, block_bits, out, shift)

