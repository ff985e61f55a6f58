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
HIST_TILE = 1024
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
def _radix_hist_kernel(w_ptr, s_ptr, prefix_ptr, hist_ptr, n, ntiles,
                       SHIFT: tl.constexpr, HI_MASK: tl.constexpr, HAS_SHARED: tl.constexpr,
                       BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    prefix = tl.load(prefix_ptr)
    h = tl.zeros([256], dtype=tl.int32)
    for t in range(pid, ntiles, nprog):
        offs = t * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        mag = _residual(w_ptr, s_ptr, offs, m, HAS_SHARED).to(tl.int32, bitcast=True) & 0x7FFFFFFF
        # Only entries whose more significant digits equal the prefix found so far compete.
        m = m & ((mag & HI_MASK) == prefix)
        h += tl.histogram((mag >> SHIFT) & 0xFF, 256, mask=m)
    tl.atomic_add(hist_ptr + tl.arange(0, 256), h)


@triton.jit
def _tile_count_kernel(w_ptr, s_ptr, thr_ptr, ngt_ptr, neq_ptr, n,
                       HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    thr = tl.load(thr_ptr)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    mag = _residual(w_ptr, s_ptr, offs, m, HAS_SHARED).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tl.store(ngt_ptr + pid, tl.sum(((mag > thr) & m).to(tl.int32), axis=0))
    tl.store(neq_ptr + pid, tl.sum(((mag == thr) & m).to(tl.int32), axis=0))


@triton.jit
def _compact_kernel(w_ptr, s_ptr, thr_ptr, take_ptr, start_ptr, val_ptr, off_ptr, n,
                    HAS_SHARED: tl.constexpr, BLOCK_MASK: tl.constexpr, VKIND: tl.constexpr,
                    OFF_KIND: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    thr = tl.load(thr_ptr)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    r = _residual(w_ptr, s_ptr, offs, m, HAS_SHARED)
    mag = r.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    gt = (mag > thr) & m
    eq = (mag == thr) & m
    take = tl.load(take_ptr + pid)
    eq_rank = tl.cumsum(eq.to(tl.int32), axis=0) - 1
    sel = gt | (eq & (eq_rank < take))
    pos = tl.load(start_ptr + pid) + tl.cumsum(sel.to(tl.int32), axis=0) - 1
    _store_float(val_ptr + pos, r, sel, VKIND)
    local = offs & BLOCK_MASK
    if OFF_KIND == 0:
        tl.store(off_ptr + pos, local.to(tl.uint8), mask=sel)
    elif OFF_KIND == 1:
        tl.store(off_ptr + pos, local.to(tl.int16), mask=sel)  # int16 view of uint16 storage
    else:
        tl.store(off_ptr + pos, local, mask=sel)


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


def _hist_programs(ntiles: int, device: torch.device) -> int:
    if device.type == "cuda":
        return min(ntiles, 4 * torch.cuda.get_device_properties(device).multi_processor_count)
    return min(ntiles, 4)  # interpreter: programs run one after another anyway


def _radix_select(w: torch.Tensor, s: torch.Tensor | None, k: int,
                  first_hist: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(T as int32[1], how many entries equal to T to take as int64[]), all on the device.
    ``first_hist``: the top digit's histogram, already counted (by a fused optimizer step)."""
    n = w.numel()
    dev = w.device
    prefix = torch.zeros(1, dtype=torch.int32, device=dev)
    krem = torch.full((), k, dtype=torch.int64, device=dev)
    hist = torch.empty(256, dtype=torch.int32, device=dev)
    ntiles = triton.cdiv(n, HIST_TILE)
    grid = (_hist_programs(ntiles, dev),)
    for shift in (24, 16, 8, 0):
        if shift == 24 and first_hist is not None:
            hist.copy_(first_hist)
        else:
            hist.zero_()
            hi_mask = (0x7FFFFFFF >> (shift + 8)) << (shift + 8)
            _radix_hist_kernel[grid](w, w if s is None else s, prefix, hist, n, ntiles,
                                     SHIFT=shift, HI_MASK=hi_mask, HAS_SHARED=s is not None, BLOCK=HIST_TILE)
        tail = hist.flip(0).cumsum(0).flip(0)  # tail[d] = #(digit >= d)
        d = (tail >= krem).sum() - 1  # the digit holding the krem-th largest
        above = torch.nn.functional.pad(tail, (0, 1)).gather(0, (d + 1).view(1)).squeeze(0)
        krem = krem - above
        prefix = prefix | (d.to(torch.int32) << shift)
    return prefix, krem


def residual_topk_encode(
    weight: torch.Tensor,
    shared: torch.Tensor | None,
    k: int,
    block_bits: int,
    values: torch.Tensor,
    offsets: torch.Tensor,
    counts: torch.Tensor,
    first_hist: torch.Tensor | None = None,
) -> None:
    w = _flat(weight)
    s = None if shared is None else _flat(shared)
    n = w.numel()
    thr, need_eq = _radix_select(w, s, k, first_hist)
    ntiles = triton.cdiv(n, TILE)
    ngt = torch.empty(ntiles, dtype=torch.int32, device=w.device)
    neq = torch.empty(ntiles, dtype=torch.int32, device=w.device)
    s_arg = w if s is None else s
    _tile_count_kernel[(ntiles,)](w, s_arg, thr, ngt, neq, n, HAS_SHARED=s is not None, BLOCK=TILE)
    neq64 = neq.long()
    eq_before = neq64.cumsum(0) - neq64
    take = (need_eq - eq_before).clamp(min=0).minimum(neq64)  # ties go to the lowest indices
    cnt = ngt.long() + take
    start = cnt.cumsum(0) - cnt
    off_kind = {8: 0, 16: 1, 32: 2}[block_bits]
    off_arg = offsets.view(torch.int16) if block_bits == 16 else offsets
    _compact_kernel[(ntiles,)](w, s_arg, thr, take.to(torch.int32), start.to(torch.int32),
                               _as_kernel_float(values), off_arg, n,
                               HAS_SHARED=s is not None,
                               BLOCK_MASK=0x7FFFFFFF if block_bits >= 32 else (1 << block_bits) - 1,
                               VKIND=_VKIND[values.dtype], OFF_KIND=off_kind, BLOCK=TILE)
    if block_bits == 8:
        counts.copy_(cnt)
    elif block_bits == 16:
        per_block = (1 << 16) // TILE
        padded = torch.nn.functional.pad(cnt, (0, (-ntiles) % per_block))
        counts.copy_(padded.view(-1, per_block).sum(1))
    else:
        counts.fill_(k)


def sparse_residual_decode(
    base: torch.Tensor | None,
    values: torch.Tensor,
    offsets: torch.Tensor,
    counts: torch.Tensor,
    block_bits: int,
    out: torch.Tensor,
    alpha: float,
) -> torch.Tensor:
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
