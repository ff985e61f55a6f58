# Triton gives annotations on @triton.jit arguments a meaning (specialisation), so kernel
# arguments stay unannotated.
# ruff: noqa: ANN001
"""Triton backend of kernels/codec.py (import it through kernels.codec, which checks usability).

Encode is a radix select followed by a stream compaction, with no host synchronisation:
  1. four histogram passes over the 31-bit magnitude |r| (8 bits per pass, most significant
     first) find T, the exact k-th largest magnitude, and how many entries equal to T to take
     (the digit choice between passes runs as tiny torch ops on the device);
  2. a count pass gives, per 256-element tile, #(mag > T) and #(mag == T);
  3. torch prefix sums turn those into each tile's share of the ties (lowest indices first) and
     its output position; a compaction pass writes values and block offsets in index order.
r = w - shared is recomputed in every pass instead of stored: the passes are memory bound and
this saves a full fp32 copy of the expert.

Decode gives each 256-element output tile to one program: it loads the base tile, adds the
tile's sparse entries through a one-hot compare in registers (entries are sorted and unique,
so no atomics and no second write), and stores the tile once. The dense copy is thereby fused
with the scatter, and base may alias out.

bf16 rounding is done with integer arithmetic (round to nearest even) because the Triton
interpreter truncates fp32 -> bf16 casts while GPUs round; this keeps both paths equal to torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 256  # count/compact/decode tile; equals the smallest index block (2**8)
HIST_TILE = 4096  # radix histogram tile: 4096 beat 1024 by 15-20% at DeepSeek-V3 size on an H200 (docs/gpu.md)
ENTRY_CHUNK = 16  # sparse entries per one-hot step in decode: a 16 x 256 compare in registers

_VKIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _f32_to_bf16_bits(x):
    # Round to nearest even on the bit pattern (finite inputs; inf stays inf).
    b = x.to(tl.int32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return (b >> 16).to(tl.int16)


@triton.jit
def _store_float(ptr, x, mask, KIND: tl.constexpr):
    if KIND == 0:
        tl.store(ptr, x, mask=mask)
    elif KIND == 1:
        tl.store(ptr, _f32_to_bf16_bits(x), mask=mask)  # ptr is an int16 view of bf16 storage
    else:
        tl.store(ptr, x.to(tl.float16), mask=mask)


@triton.jit
def _residual(w_ptr, s_ptr, offs, mask, HAS_SHARED: tl.constexpr):
    r = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SHARED:
        r = r - tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return r


@triton.jit
def _radix_hist_kernel(w_ptr, s_ptr, s_row_stride, prefix_ptr, hist_ptr, n, ntiles,
                       SHIFT: tl.constexpr, HI_MASK: tl.constexpr, HAS_SHARED: tl.constexpr,
                       BLOCK: tl.constexpr):
    # grid: (programs per row, rows); each program strides over its row's tiles
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    row = tl.program_id(1).to(tl.int64)
    prefix = tl.load(prefix_ptr + row)
    h = tl.zeros([256], dtype=tl.int32)
    for t in range(pid, ntiles, nprog):
        local = t * BLOCK + tl.arange(0, BLOCK)
        m = local < n
        mag = _residual(w_ptr + row * n, s_ptr + row * s_row_stride, local, m,
                        HAS_SHARED).to(tl.int32, bitcast=True) & 0x7FFFFFFF
        # Only entries whose more significant digits equal the prefix found so far compete.
        m = m & ((mag & HI_MASK) == prefix)
        h += tl.histogram((mag >> SHIFT) & 0xFF, 256, mask=m)
    tl.atomic_add(hist_ptr + row * 256 + tl.arange(0, 256), h)


@triton.jit
def _digit_kernel(hist_ptr, prefix_ptr, krem_ptr, SHIFT: tl.constexpr):
    # one program per row: the digit d holding the krem-th largest, then krem -= #(digit > d)
    row = tl.program_id(0).to(tl.int64)
    d_all = tl.arange(0, 256)
    h = tl.load(hist_ptr + row * 256 + d_all)
    krem = tl.load(krem_ptr + row)
    tail = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # tail[d] = #(digit >= d)
    d = tl.sum((tail >= krem).to(tl.int32), axis=0) - 1
    tl.store(krem_ptr + row, krem - tl.sum(tl.where(d_all > d, h, 0), axis=0))
    tl.store(prefix_ptr + row, tl.load(prefix_ptr + row) | (d << SHIFT))


@triton.jit
def _tile_count_kernel(w_ptr, s_ptr, s_row_stride, thr_ptr, ngt_ptr, neq_ptr, n, ntiles,
                       HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr):
    # grid: (tiles, rows); tiles on axis 0 (CUDA caps the other axes at 65535)
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    thr = tl.load(thr_ptr + row)
    local = pid * BLOCK + tl.arange(0, BLOCK)
    m = local < n
    mag = _residual(w_ptr + row * n, s_ptr + row * s_row_stride, local, m,
                    HAS_SHARED).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tl.store(ngt_ptr + row * ntiles + pid, tl.sum(((mag > thr) & m).to(tl.int32), axis=0))
    tl.store(neq_ptr + row * ntiles + pid, tl.sum(((mag == thr) & m).to(tl.int32), axis=0))


@triton.jit
def _compact_kernel(w_ptr, s_ptr, s_row_stride, thr_ptr, take_ptr, start_ptr, val_ptr, val_stride,
                    off_ptr, off_stride, n, ntiles,
                    HAS_SHARED: tl.constexpr, BLOCK_MASK: tl.constexpr, VKIND: tl.constexpr,
                    OFF_KIND: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    thr = tl.load(thr_ptr + row)
    local = pid * BLOCK + tl.arange(0, BLOCK)
    m = local < n
    r = _residual(w_ptr + row * n, s_ptr + row * s_row_stride, local, m, HAS_SHARED)
    mag = r.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    gt = (mag > thr) & m
    eq = (mag == thr) & m
    take = tl.load(take_ptr + row * ntiles + pid)
    eq_rank = tl.cumsum(eq.to(tl.int32), axis=0) - 1
    sel = gt | (eq & (eq_rank < take))
    pos = tl.load(start_ptr + row * ntiles + pid) + tl.cumsum(sel.to(tl.int32), axis=0) - 1
    _store_float(val_ptr + row * val_stride + pos, r, sel, VKIND)
    lb = local & BLOCK_MASK
    out = off_ptr + row * off_stride + pos
    if OFF_KIND == 0:
        tl.store(out, lb.to(tl.uint8), mask=sel)
    elif OFF_KIND == 1:
        tl.store(out, lb.to(tl.int16), mask=sel)  # int16 view of uint16 storage
    else:
        tl.store(out, lb, mask=sel)


@triton.jit
def _decode_kernel(base_ptr, val_ptr, off_ptr, ent_ptr, out_ptr, n, alpha,
                   HAS_BASE: tl.constexpr, OFF_MASK: tl.constexpr, BLOCK_MASK: tl.constexpr,
                   OUT_KIND: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    lo = pid * BLOCK
    cols = tl.arange(0, BLOCK)
    offs = lo + cols
    m = offs < n
    if HAS_BASE:
        acc = tl.load(base_ptr + offs, mask=m, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
    e_lo = tl.load(ent_ptr + pid)
    e_hi = tl.load(ent_ptr + pid + 1)
    tile_local = lo & BLOCK_MASK
    res = tl.zeros([BLOCK], dtype=tl.float32)
    for e0 in range(e_lo, e_hi, CHUNK):
        e = e0 + tl.arange(0, CHUNK)
        em = e < e_hi
        off = tl.load(off_ptr + e, mask=em, other=0).to(tl.int32) & OFF_MASK
        v = tl.load(val_ptr + e, mask=em, other=0.0).to(tl.float32)
        hit = ((off - tile_local)[:, None] == cols[None, :]) & em[:, None]
        res += tl.sum(tl.where(hit, v[:, None], 0.0), axis=0)
    _store_float(out_ptr + offs, acc + alpha * res, m, OUT_KIND)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1)


def _as_kernel_float(t: torch.Tensor) -> torch.Tensor:
    # bf16 is written through int16 bit patterns (see _f32_to_bf16_bits).
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _hist_programs(ntiles: int, rows: int, device: torch.device) -> int:
    """Histogram programs per row: about 16 per SM over the whole launch (4 per SM left the
    bandwidth-bound passes latency bound at DeepSeek-V3 size)."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(ntiles, -(-16 * sms // rows)))
    return min(ntiles, 2)  # interpreter: programs run one after another anyway


def _rows_grid(ntiles: int, rows: int) -> tuple[int, int]:
    if rows > 65535:
        raise ValueError(f"{rows} rows in one launch; CUDA's grid allows 65535 on axis 1")
    return ntiles, rows


def _radix_select(w: torch.Tensor, s: torch.Tensor | None, s_row_stride: int, k: int,
                  first_hists: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: (T, how many entries equal to T to take), int32[R] each, all on the device, in
    eight launches whatever R is. ``first_hists``: the top digit's [R, 256] histograms, already
    counted (by a fused optimizer step)."""
    rows, n = w.shape
    dev = w.device
    prefix = torch.zeros(rows, dtype=torch.int32, device=dev)
    krem = torch.full((rows,), k, dtype=torch.int32, device=dev)
    hists = torch.zeros(4, rows, 256, dtype=torch.int32, device=dev)
    ntiles = triton.cdiv(n, HIST_TILE)
    grid = _rows_grid(_hist_programs(ntiles, rows, dev), rows)
    for i, shift in enumerate((24, 16, 8, 0)):
        hist = hists[i]
        if shift == 24 and first_hists is not None:
            hist = first_hists.contiguous()
        else:
            hi_mask = (0x7FFFFFFF >> (shift + 8)) << (shift + 8)
            _radix_hist_kernel[grid](w, w if s is None else s, s_row_stride, prefix, hist, n, ntiles,
                                     SHIFT=shift, HI_MASK=hi_mask, HAS_SHARED=s is not None, BLOCK=HIST_TILE)
        _digit_kernel[(rows,)](hist, prefix, krem, SHIFT=shift)
    return prefix, krem


def residual_topk_encode_rows(weight, shared, k: int, block_bits: int, values, offsets, counts,
                              first_hists=None) -> None:
    """Every row of weight [R, n] encoded at once (arguments: kernels.codec.residual_topk_encode_rows)."""
    rows, n = weight.shape
    w = weight.contiguous()
    s = None if shared is None else shared.contiguous()
    s_row_stride = 0 if s is None or s.dim() == 1 else n
    thr, need_eq = _radix_select(w, s, s_row_stride, k, first_hists)
    ntiles = triton.cdiv(n, TILE)
    ngt = torch.empty(rows, ntiles, dtype=torch.int32, device=w.device)
    neq = torch.empty(rows, ntiles, dtype=torch.int32, device=w.device)
    s_arg = w if s is None else s
    grid = _rows_grid(ntiles, rows)
    _tile_count_kernel[grid](w, s_arg, s_row_stride, thr, ngt, neq, n, ntiles, HAS_SHARED=s is not None,
                             BLOCK=TILE)
    neq64 = neq.long()
    eq_before = neq64.cumsum(1) - neq64
    take = (need_eq.long().unsqueeze(1) - eq_before).clamp(min=0).minimum(neq64)  # ties: lowest indices
    cnt = ngt.long() + take
    start = cnt.cumsum(1) - cnt
    off_kind = {8: 0, 16: 1, 32: 2}[block_bits]
    off_arg = offsets.view(torch.int16) if block_bits == 16 else offsets
    _compact_kernel[grid](w, s_arg, s_row_stride, thr, take.to(torch.int32), start.to(torch.int32),
                          _as_kernel_float(values), values.stride(0), off_arg, offsets.stride(0), n, ntiles,
                          HAS_SHARED=s is not None,
                          BLOCK_MASK=0x7FFFFFFF if block_bits >= 32 else (1 << block_bits) - 1,
                          VKIND=_VKIND[values.dtype], OFF_KIND=off_kind, BLOCK=TILE)
    if block_bits == 8:
        counts.copy_(cnt)
    elif block_bits == 16:
        per_block = (1 << 16) // TILE
        padded = torch.nn.functional.pad(cnt, (0, (-ntiles) % per_block))
        counts.copy_(padded.view(rows, -1, per_block).sum(2))
    else:
        counts.fill_(k)


def sparse_residual_decode(base: torch.Tensor | None, values: torch.Tensor, offsets: torch.Tensor,
                           counts: torch.Tensor, block_bits: int, out: torch.Tensor, alpha: float) -> torch.Tensor:
    from megatron_hybridep.kernels.codec import absolute_indices

    n = out.numel()
    ntiles = triton.cdiv(n, TILE)
    if block_bits == 8:  # tile == index block: entry ranges come straight from the counts
        ent = torch.nn.functional.pad(counts.long().cumsum(0), (1, 0))
    else:
        bounds = torch.arange(ntiles + 1, device=out.device, dtype=torch.int64) * TILE
        ent = torch.searchsorted(absolute_indices(offsets, counts, block_bits), bounds)
    off_arg = offsets.view(torch.int16) if block_bits == 16 else offsets
    b = None if base is None else _flat(base)
    out_flat = out.view(-1)
    _decode_kernel[(ntiles,)](b if b is not None else out_flat, values, off_arg, ent.to(torch.int32),
                              _as_kernel_float(out_flat), n, float(alpha),
                              HAS_BASE=b is not None,
                              OFF_MASK={8: 0xFF, 16: 0xFFFF, 32: 0x7FFFFFFF}[block_bits],
                              BLOCK_MASK=0x7FFFFFFF if block_bits >= 32 else (1 << block_bits) - 1,
                              OUT_KIND=_VKIND[out.dtype], BLOCK=TILE, CHUNK=ENTRY_CHUNK)
    return out
