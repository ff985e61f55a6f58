"""Sparse-residual codec kernels: residual top-k encode and scatter decode.

Two backends with identical, exactly specified results:
- torch: the reference, used on CPU and wherever Triton cannot run;
- triton: ``kernels/_codec_triton.py``, used for CUDA tensors, or for any tensor when
  ``TRITON_INTERPRET=1`` is set (that is how the tests validate it on CPU).

Encode semantics (both backends, bit for bit):
    r    = float32(weight) - float32(shared)         (r = float32(weight) when shared is None)
    mag  = bits(r) & 0x7FFFFFFF                       (|r| as an ordered int; finite inputs only)
    T    = the k-th largest mag
    sel  = {i: mag_i > T}  plus the lowest-index  k - #{mag > T}  entries with mag_i == T
The k selected entries are written in ascending index order; the index space is split into
blocks of 2**block_bits elements and each entry stores its offset inside its block
(``offsets``), ``counts[b]`` holding how many entries block b has. block_bits = 3 (BITMAP_BITS)
is the bitmap: ``counts[b]`` is block b's byte (bit j set: element 8b + j kept) and ``offsets``
is empty; it runs through the torch ops on every device (no Triton kernel). ``values`` holds r at the
selected entries, rounded to the values' dtype (round-to-nearest-even).

Decode semantics: ``out = base + alpha * scatter(values)`` computed in float32 and rounded to
``out``'s dtype; ``base`` may be None (zeros) or alias ``out`` (in-place accumulate). Results
equal the torch reference bit for bit when alpha is +-1 (other alphas may differ by fused
multiply-add rounding on GPU).
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

Backend = Literal["auto", "torch", "triton"]

# Offset/count dtypes the kernels accept, by block_bits (their sizes: plan/wire.py INDEX_BYTES).
BITMAP_BITS = 3  # blocks of 8: counts are bitmap bytes, no offsets (OFFSET_DTYPES[3]: the empty tensor's)
OFFSET_DTYPES = {BITMAP_BITS: torch.uint8, 8: torch.uint8, 16: torch.uint16, 32: torch.int32}
COUNT_DTYPES = {BITMAP_BITS: torch.uint8, 8: torch.uint16, 16: torch.int32, 32: torch.int32}

VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def offsets_per_entry(block_bits: int) -> int:
    """Offsets stored per kept entry: 1, or 0 for the bitmap."""
    return 0 if block_bits == BITMAP_BITS else 1


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - triton is in the lock, but stay usable without it
        return False
    return True


def interpreter_enabled() -> bool:
    """True when TRITON_INTERPRET=1, i.e. Triton kernels run on CPU tensors through the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def triton_usable(t: torch.Tensor) -> bool:
    """Whether the Triton backend can run on this tensor's device."""
    if not _triton_importable():
        return False
    return t.is_cuda or (interpreter_enabled() and t.device.type == "cpu")


def _pick(backend: Backend, t: torch.Tensor, block_bits: int | None = None) -> str:
    """The backend that runs on ``t``; the bitmap (``block_bits`` BITMAP_BITS) has torch ops only."""
    if block_bits == BITMAP_BITS:
        return "torch"
    if backend == "auto":
        return "triton" if triton_usable(t) else "torch"
    if backend == "triton" and not triton_usable(t):
        raise RuntimeError(f"triton backend requested but unusable on {t.device} "
                           "(set TRITON_INTERPRET=1 for CPU tensors)")
    return backend


def _nblocks(n: int, block_bits: int) -> int:
    return 1 if block_bits >= 32 else -(-n // (1 << block_bits))


def _check_encode(weight: torch.Tensor, shared: torch.Tensor | None, k: int, block_bits: int, values: torch.Tensor,
                  offsets: torch.Tensor, counts: torch.Tensor) -> None:
    n = weight.numel()
    if block_bits not in OFFSET_DTYPES:
        raise ValueError(f"block_bits must be one of {sorted(OFFSET_DTYPES)}, got {block_bits}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= numel, got k={k}, numel={n}")
    if n >= 2**31:
        raise ValueError("tensors of 2**31 elements or more are not supported")
    if shared is not None and shared.numel() != n:
        raise ValueError(f"shared has {shared.numel()} elements, weight has {n}")
    if values.numel() != k or offsets.numel() != k * offsets_per_entry(block_bits) \
            or counts.numel() != _nblocks(n, block_bits):
        raise ValueError("values/offsets/counts have the wrong sizes for this k and block_bits")
    if offsets.dtype != OFFSET_DTYPES[block_bits] or counts.dtype != COUNT_DTYPES[block_bits]:
        raise ValueError(f"block_bits={block_bits} needs offsets {OFFSET_DTYPES[block_bits]}, "
                         f"counts {COUNT_DTYPES[block_bits]}")
    if values.dtype not in VALUE_DTYPES:
        raise ValueError(f"value dtype must be one of {VALUE_DTYPES}, got {values.dtype}")


_SAMPLE = 1 << 16  # most sampled entries


def kth_largest(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest element of flat ``x`` (0-dim tensor), exactly.

    A full top-k over millions of entries dominates CPU encode time, so a strided sample gives
    two bounds about 4 sigma of sampling noise either side of the k-th largest: t_hi (fewer than
    k entries above it) and t_lo (at least k entries at or above it). Then the answer is the
    (k - #{x > t_hi})-th largest of the thin band [t_lo, t_hi], a few passes over x and a
    top-k over ~1% of it; if the sample misled either bound, the full top-k runs. The result
    never depends on the sample.
    """
    n = x.numel()
    stride = max(16, n // _SAMPLE)  # a sample of 1/16 or less
    if n >= 1024 * stride and k < n:
        sample = x[::stride]
        m = sample.numel()
        mean = m * k / n
        spread = 4 * (mean * (1 - k / n)) ** 0.5 + 4
        hi_rank, lo_rank = int(mean - spread), min(m, int(mean + spread) + 1)
        ranked = torch.topk(sample, lo_rank).values  # descending
        t_lo = ranked[-1]
        band = x >= t_lo
        above = 0
        if hi_rank >= 1:
            t_hi = ranked[hi_rank - 1]
            over = x > t_hi
            above = int(torch.count_nonzero(over))
            band ^= over  # over is inside band: this removes it
        need = k - above
        if need >= 1:
            cand = x[band]
            if cand.numel() >= need:
                return torch.topk(cand, need, sorted=False).values.min()
    return torch.topk(x, k, sorted=False).values.min()


def residual_topk_encode_torch(weight: torch.Tensor, shared: torch.Tensor | None, k: int, block_bits: int,
                               values: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor) -> None:
    """Torch reference of :func:`residual_topk_encode` (same arguments)."""
    w = weight.reshape(-1)
    r = w.float()
    if shared is not None:
        # fp32 math either way; in place when .float() made a copy (saves a pass and a buffer).
        r = r - shared.reshape(-1) if w.dtype == torch.float32 else r.sub_(shared.reshape(-1))
    n = r.numel()
    # Integer magnitudes: same order as |r| for finite floats, and +0/-0 compare equal.
    mag = r.view(torch.int32) & 0x7FFFFFFF
    sel = None
    if k >= n:
        idx = torch.arange(n, device=r.device)
    else:
        thr = kth_largest(mag, k)
        sel = mag >= thr
        surplus = int(torch.count_nonzero(sel)) - k
        if surplus > 0:  # ties at the threshold: drop the highest-index ones
            ties = torch.nonzero(mag == thr).squeeze(1)
            sel[ties[ties.numel() - surplus:]] = False
        idx = torch.nonzero_static(sel, size=k).squeeze(1)
    values.copy_(r[idx])
    if block_bits == BITMAP_BITS:
        if sel is None:
            sel = torch.ones(n, dtype=torch.bool, device=r.device)
        kept = sel.view(torch.uint8)
        if n % 8:
            kept = torch.cat([kept, kept.new_zeros(8 - n % 8)])
        shifts = torch.arange(8, dtype=torch.uint8, device=r.device)
        counts.copy_((kept.view(-1, 8) << shifts).sum(1, dtype=torch.uint8))  # distinct bits: the sum is an OR
    elif block_bits >= 32:
        offsets.copy_(idx)
        counts.fill_(k)
    else:
        offsets.copy_(idx & ((1 << block_bits) - 1))
        counts.copy_(torch.bincount(idx >> block_bits, minlength=counts.numel()))


def residual_topk_encode(weight: torch.Tensor, shared: torch.Tensor | None, k: int, block_bits: int,
                         values: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor, *,
                         backend: Backend = "auto", first_hist: torch.Tensor | None = None) -> None:
    """Select the top-k of |weight - shared| and write (values, offsets, counts) in place.

    weight, shared: same numel (any shape, contiguous); shared None means zeros (plain top-k).
    values: [k] float32/bfloat16/float16. offsets: [k] uint8 (block_bits 8), uint16 (16) or
    int32 (32 = one block, offsets are absolute indices). counts: [ceil(numel / 2**block_bits)]
    uint16 (8) or int32 (16, 32). See the module docstring for the exact selection rule.
    ``first_hist``: int32[256] histogram of bits 24..30 of the magnitudes, counted by a fused
    optimizer step (kernels/fused_codec.py); the Triton backend then skips its first pass.
    Results are the same with or without it; the torch backend ignores it.
    """
    _check_encode(weight, shared, k, block_bits, values, offsets, counts)
    residual_topk_encode_rows(weight.reshape(1, -1), None if shared is None else shared.reshape(-1), k, block_bits,
                              values.view(1, -1), offsets.view(1, -1), counts.view(1, -1), backend=backend,
                              first_hists=None if first_hist is None else first_hist.reshape(1, -1))


def residual_topk_encode_rows(weight: torch.Tensor, shared: torch.Tensor | None, k: int, block_bits: int,
                              values: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor, *,
                              backend: Backend = "auto", first_hists: torch.Tensor | None = None) -> None:
    """:func:`residual_topk_encode` of every row of ``weight`` [R, n], each row on its own.

    shared: [R, n] (one base per row), [n] (one for all rows) or None. values / offsets / counts:
    [R, k] / [R, k] / [R, nblocks]; their rows may be strided (column slices of a [R, nbytes]
    payload buffer, as SharedResidualCodec.encode_batch passes them), the last dim contiguous.
    first_hists: int32 [R, 256] or None. The Triton backend encodes all rows in one set of
    launches (the encode is launch bound on a GPU, whatever the expert's size); the torch
    backend is the per-row reference. Each row's bytes equal the single-tensor encode's.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [rows, n], got {tuple(weight.shape)}")
    rows, n = weight.shape
    if shared is not None and shared.shape not in ((rows, n), (n,)):
        raise ValueError(f"shared must be [{rows}, {n}] or [{n}], got {tuple(shared.shape)}")
    for name, t, cols in (("values", values, k), ("offsets", offsets, k * offsets_per_entry(block_bits)),
                          ("counts", counts, _nblocks(n, block_bits))):
        if t.shape != (rows, cols) or (cols > 1 and t.stride(1) != 1):
            raise ValueError(f"{name} must be [{rows}, {cols}] with contiguous rows, got {tuple(t.shape)}")
    _check_encode(weight[0], None if shared is None else shared.reshape(-1, n)[0], k, block_bits,
                  values[0], offsets[0], counts[0])
    if first_hists is not None and (first_hists.shape != (rows, 256) or first_hists.dtype != torch.int32):
        raise ValueError(f"first_hists must be int32[{rows}, 256], got {first_hists.dtype}{tuple(first_hists.shape)}")
    if _pick(backend, weight, block_bits) == "triton":
        from megatron_hybridep.kernels import _codec_triton

        _codec_triton.residual_topk_encode_rows(weight, shared, k, block_bits, values, offsets, counts,
                                                first_hists=first_hists)
        return
    for r in range(rows):
        s = None if shared is None else (shared if shared.dim() == 1 else shared[r])
        residual_topk_encode_torch(weight[r], s, k, block_bits, values[r], offsets[r], counts[r])


def absolute_indices(offsets: torch.Tensor, counts: torch.Tensor, block_bits: int,
                     k: int | None = None) -> torch.Tensor:
    """int64 absolute positions of the encoded entries (ascending). ``k``: the entries' count,
    needed for the bitmap (whose offsets are empty)."""
    if block_bits == BITMAP_BITS:
        if k is None:
            raise ValueError("a bitmap's entries need k (the values' count)")
        shifts = torch.arange(8, dtype=torch.uint8, device=counts.device)
        kept = (counts.reshape(-1, 1) >> shifts) & 1
        return torch.nonzero_static(kept.reshape(-1), size=k).squeeze(1)  # static size: no device sync
    if block_bits >= 32:
        return offsets.long()
    nb = counts.numel()
    base = torch.arange(nb, device=offsets.device, dtype=torch.int64) << block_bits
    # output_size avoids a device sync on CUDA.
    return torch.repeat_interleave(base, counts.long(), output_size=offsets.numel()) + offsets.long()


def _check_decode(base: torch.Tensor | None, values: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor,
                  block_bits: int, out: torch.Tensor) -> None:
    if block_bits not in OFFSET_DTYPES:
        raise ValueError(f"block_bits must be one of {sorted(OFFSET_DTYPES)}, got {block_bits}")
    if base is not None and base.numel() != out.numel():
        raise ValueError(f"base has {base.numel()} elements, out has {out.numel()}")
    if values.numel() * offsets_per_entry(block_bits) != offsets.numel() \
            or counts.numel() != _nblocks(out.numel(), block_bits):
        raise ValueError("values/offsets/counts sizes do not match out and block_bits")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")


def sparse_residual_decode_torch(base: torch.Tensor | None, values: torch.Tensor, offsets: torch.Tensor,
                                 counts: torch.Tensor, block_bits: int, out: torch.Tensor,
                                 alpha: float = 1.0) -> torch.Tensor:
    """Torch reference of :func:`sparse_residual_decode` (same arguments).

    One dense copy of base, then O(k) work on the kept entries only: every output element is
    round(float32(base) + alpha * value) or round(float32(base)), exactly as the Triton kernel.
    """
    flat = out.view(-1)
    idx = absolute_indices(offsets, counts, block_bits, values.numel())
    if base is None:
        kept = torch.zeros(idx.numel(), dtype=torch.float32, device=out.device)
        flat.zero_()
    else:
        b = base.reshape(-1)
        kept = b[idx].float()  # gathered before any write: base may alias out
        if b.data_ptr() != flat.data_ptr():
            flat.copy_(b)
    kept.add_(values.float(), alpha=alpha)
    flat[idx] = kept.to(out.dtype)
    return out


def sparse_residual_decode(base: torch.Tensor | None, values: torch.Tensor, offsets: torch.Tensor,
                           counts: torch.Tensor, block_bits: int, out: torch.Tensor, alpha: float = 1.0, *,
                           backend: Backend = "auto") -> torch.Tensor:
    """out = base + alpha * scatter(values at offsets/counts); base None = zeros; base may be
    ``out`` itself (in-place accumulate; other overlaps are not supported).

    The dense copy of base is fused with the scatter: every output element is written once.
    Returns out.
    """
    _check_decode(base, values, offsets, counts, block_bits, out)
    if _pick(backend, out, block_bits) == "triton":
        from megatron_hybridep.kernels import _codec_triton

        return _codec_triton.sparse_residual_decode(base, values, offsets, counts, block_bits, out, alpha)
    return sparse_residual_decode_torch(base, values, offsets, counts, block_bits, out, alpha)
