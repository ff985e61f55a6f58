"""Fused codec kernels (kernels/fused_codec.py) under TRITON_INTERPRET=1, run by
test_fused_codec.py in a subprocess: the Triton AdamW + first-histogram pass against the torch
reference, the encode fed its histogram against the plain encode (bit for bit), and the batched
rebase + decode against the unfused decode (bit for bit). Exits 1 on a mismatch."""

import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from megatron_hybridep.kernels import fused_codec as F  # noqa: E402
from megatron_hybridep.runtime.compression import SharedResidualCodec  # noqa: E402

bad = []


def check(ok, what):
    print(("ok       " if ok else "MISMATCH ") + what, flush=True)
    if not ok:
        bad.append(what)


def adamw_case(rows, n, dtype, with_base, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(rows, n, generator=g) * 0.02
    grad = (torch.randn(rows, n, generator=g) * 1e-3).to(dtype)
    m, v = torch.randn(rows, n, generator=g) * 1e-4, torch.rand(rows, n, generator=g) * 1e-6
    base = (p + torch.randn(rows, n, generator=g) * 1e-3).to(dtype) if with_base else None
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=7)
    state = {}
    for backend in ("torch", "triton"):
        pp, mm, vv = p.clone(), m.clone(), v.clone()
        out = torch.empty(rows, n, dtype=dtype)
        hist = F.adamw_step_hist(pp, grad, mm, vv, out, base, backend=backend, **kw)
        state[backend] = (pp, mm, vv, out, hist)
    tag = f"adamw rows={rows} n={n} {dtype} base={with_base}"
    (pt, mt, vt, _, _), (px, mx, vx, ox, hx) = state["torch"], state["triton"]
    pairs = ((pt, px), (mt, mx), (vt, vx))
    exact = all(torch.equal(a, b) for a, b in pairs)
    check(all(torch.allclose(a, b, rtol=1e-6, atol=1e-8) for a, b in pairs),
          tag + f": update within a few ulps (bit-exact: {exact})")
    check(torch.equal(ox, px.to(dtype)), tag + ": model copy is the rounded master")
    check(torch.equal(hx, F.first_digit_hist(ox, base)) and int(hx.sum()) == rows * n, tag + ": histogram")
    for ratio in (10, 50):
        codec = SharedResidualCodec(ratio, use_shared=with_base, backend="triton")
        plain = codec.encode_batch(ox, base)
        fused = codec.encode_batch(ox, base, first_hists=hx)
        check(torch.equal(plain, fused), tag + f": encode at {ratio}x with the fused histogram")


def decode_case(rows, n, dtype, ratio, shifted, inplace, seed):
    g = torch.Generator().manual_seed(seed)
    codec = SharedResidualCodec(ratio, backend="triton")
    copies = (torch.randn(rows, n, generator=g) * 0.02).to(dtype)
    weights = (copies.float() + torch.randn(rows, n, generator=g) * 1e-3).to(dtype)
    shift = (torch.randn(n, generator=g) * 1e-3).to(dtype) if shifted else None
    rebased = copies if shift is None else copies + shift.reshape(1, -1)
    payloads = codec.encode_batch(weights, rebased)
    want = codec.decode_batch(payloads, rebased, out=torch.empty_like(copies))
    ref = torch.empty_like(copies)
    F.decode_rows_torch(copies, *_sections(codec, payloads, rows, n, dtype), ref, shift)
    out = copies.clone() if inplace else torch.empty_like(copies)
    got = codec.decode_rows(payloads, out if inplace else copies, out=out, shift=shift)
    scheme = codec.layout(n, dtype).scheme.name
    tag = f"decode_rows rows={rows} n={n} {dtype} {ratio}x {scheme} shift={shifted} inplace={inplace}"
    check(torch.equal(got, want) and torch.equal(ref, want), tag)


def _sections(codec, payloads, rows, n, dtype):
    lay = codec.layout(n, dtype)
    p2 = payloads.view(rows, lay.nbytes)

    def cols(at, count, dt):
        return p2[:, at:at + count * dt.itemsize].view(dt)

    return (cols(lay.values_at, lay.k, lay.value_dtype), cols(lay.offsets_at, lay.k, lay.offset_dtype),
            cols(lay.counts_at, lay.nblocks, lay.count_dtype), lay.scheme.block_bits)


for dtype in (torch.bfloat16, torch.float32):
    for with_base in (True, False):
        adamw_case(3, 3000, dtype, with_base, seed=1)
for dtype in (torch.bfloat16, torch.float32):
    for shifted in (False, True):
        decode_case(3, 5000, dtype, 50, shifted, inplace=False, seed=2)
decode_case(2, 3000, torch.bfloat16, 10, True, inplace=True, seed=3)
decode_case(2, 140_000, torch.float32, 300, True, inplace=False, seed=4)  # BLOCK16 payloads
print("ALL OK" if not bad else f"{len(bad)} MISMATCH(ES)")
sys.exit(1 if bad else 0)
