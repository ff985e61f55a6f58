# Triton gives annotations on @triton.jit arguments a meaning (specialisation), so kernel
# arguments stay unannotated.
# ruff: noqa: ANN001
"""Triton backend of kernels/fused_codec.py (import it through that module).

adamw_hist: one pass over a layer's expert rows does the AdamW update of the fp32 master weights,
writes the model copy (bf16/fp16/fp32) and counts the first radix-select histogram (bits 24..30 of
|model - base|) per row, so the encode that follows skips its first read of weight and base.

decode_rows: one launch decodes every borrowed row of a layer: out = round(round(base + shift) +
scatter(values)), i.e. the rebase after a shared-expert refresh and the decode in one pass (grid:
256-element tile x row, entries found as in the plain decode kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from megatron_hybridep.kernels._codec_triton import _VKIND, ENTRY_CHUNK, TILE, _as_kernel_float, _store_float

ADAMW_TILE = 1024  # the fused optimizer pass holds six fp32 tiles in registers


@triton.jit
def _round_as(x, KIND: tl.constexpr):
    """x (fp32) rounded to the storage dtype and widened back: what a store + load would give."""
    if KIND == 1:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        return b.to(tl.float32, bitcast=True)
    elif KIND == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _adamw_hist_kernel(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, base_ptr, hist_ptr, n, ntiles,
                       decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_sqrt_bc2, eps,
                       HAS_BASE: tl.constexpr, OUT_KIND: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    nprog = tl.num_programs(1)
    row_start = row * n
    h = tl.zeros([256], dtype=tl.int32)
    for t in range(pid, ntiles, nprog):
        local = t * BLOCK + tl.arange(0, BLOCK)
        m = local < n
        offs = row_start + local
        p = tl.load(p_ptr + offs, mask=m, other=0.0)
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        mom = tl.load(m_ptr + offs, mask=m, other=0.0)
        vel = tl.load(v_ptr + offs, mask=m, other=0.0)
        p = p * decay
        mom = beta1 * mom + one_minus_beta1 * g
        vel = beta2 * vel + one_minus_beta2 * (g * g)
        denom = tl.sqrt(vel) * inv_sqrt_bc2 + eps
        p = p - step_size * (mom / denom)
        tl.store(p_ptr + offs, p, mask=m)
        tl.store(m_ptr + offs, mom, mask=m)
        tl.store(v_ptr + offs, vel, mask=m)
        _store_float(out_ptr + offs, p, m, OUT_KIND)
        r = _round_as(p, OUT_KIND)
        if HAS_BASE:
            r = r - tl.load(base_ptr + offs, mask=m, other=0.0).to(tl.float32)
        mag = r.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        h += tl.histogram((mag >> 24) & 0xFF, 256, mask=m)
    tl.atomic_add(hist_ptr + row * 256 + tl.arange(0, 256), h)


@triton.jit
def _decode_rows_kernel(base_ptr, shift_ptr, val_ptr, off_ptr, ent_ptr, out_ptr, n, ntiles,
                        val_stride, off_stride,
                        HAS_SHIFT: tl.constexpr, OFF_MASK: tl.constexpr, BLOCK_MASK: tl.constexpr,
                        OUT_KIND: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    # tiles on axis 0: CUDA caps grid axes 1 and 2 at 65535 blocks, and a 44M-element row has 172k tiles
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    lo = pid * BLOCK
    cols = tl.arange(0, BLOCK)
    local = lo + cols
    m = local < n
    offs = row * n + local
    acc = tl.load(base_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_SHIFT:  # the rebased copy, rounded as the unfused path stores it
        acc = _round_as(acc + tl.load(shift_ptr + local, mask=m, other=0.0).to(tl.float32), OUT_KIND)
    e_lo = tl.load(ent_ptr + row * (ntiles + 1) + pid)
    e_hi = tl.load(ent_ptr + row * (ntiles + 1) + pid + 1)
    tile_local = lo & BLOCK_MASK
    res = tl.zeros([BLOCK], dtype=tl.float32)
    for e0 in range(e_lo, e_hi, CHUNK):
        e = e0 + tl.arange(0, CHUNK)
        em = e < e_hi
        off = tl.load(off_ptr + row * off_stride + e, mask=em, other=0).to(tl.int32) & OFF_MASK
        v = tl.load(val_ptr + row * val_stride + e, mask=em, other=0.0).to(tl.float32)
        hit = ((off - tile_local)[:, None] == cols[None, :]) & em[:, None]
        res += tl.sum(tl.where(hit, v[:, None], 0.0), axis=0)
    _store_float(out_ptr + offs, acc + res, m, OUT_KIND)


def _programs_per_row(ntiles: int, rows: int, device: torch.device) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(ntiles, -(-4 * sms // rows)))
    return min(ntiles, 2)  # interpreter: programs run one after another anyway


def adamw_hist(param, grad, exp_avg, exp_avg_sq, model_out, base, hist, scalars: dict) -> None:
    rows, n = param.shape
    ntiles = triton.cdiv(n, ADAMW_TILE)
    grid = (rows, _programs_per_row(ntiles, rows, param.device))
    out = _as_kernel_float(model_out.view(-1))
    _adamw_hist_kernel[grid](param, grad, exp_avg, exp_avg_sq, out, param if base is None else base, hist,
                             n, ntiles, **scalars, HAS_BASE=base is not None, OUT_KIND=_VKIND[model_out.dtype],
                             BLOCK=ADAMW_TILE)


def decode_rows_grid(rows: int, ntiles: int) -> tuple[int, int]:
    """(tiles, rows): CUDA allows 2**31 - 1 blocks on axis 0 but only 65535 on the others."""
    if rows > 65535:
        raise ValueError(f"decode_rows: {rows} rows in one launch; CUDA's grid allows 65535")
    return ntiles, rows


def decode_rows(base, values, offsets, counts, block_bits: int, out, shift, ent) -> None:
    rows, n = out.shape
    ntiles = triton.cdiv(n, TILE)
    off_arg = offsets.view(torch.int16) if block_bits == 16 else offsets
    _decode_rows_kernel[decode_rows_grid(rows, ntiles)](
        base, out if shift is None else shift, values, off_arg, ent, _as_kernel_float(out), n, ntiles,
        values.stride(0), offsets.stride(0),
        HAS_SHIFT=shift is not None, OFF_MASK={8: 0xFF, 16: 0xFFFF, 32: 0x7FFFFFFF}[block_bits],
        BLOCK_MASK=0x7FFFFFFF if block_bits >= 32 else (1 << block_bits) - 1,
        OUT_KIND=_VKIND[out.dtype], BLOCK=TILE, CHUNK=ENTRY_CHUNK)
