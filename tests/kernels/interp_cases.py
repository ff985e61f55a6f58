"""Triton-vs-torch equality cases, run by test_codec_kernels.py in a subprocess with
TRITON_INTERPRET=1 (the variable must be set before triton is imported, and would slow down
every other test if set in the main session). Prints one line per case; exits 1 on a mismatch.
Sizes are small: the interpreter runs every program in numpy, one after another."""

import os
import sys
import time

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from megatron_hybridep.kernels import codec as C  # noqa: E402
from megatron_hybridep.runtime import compression as M  # noqa: E402

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def make(n, wdt, kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":  # few distinct magnitudes: many ties at the threshold
        return torch.randint(-4, 5, (n,), generator=g).to(wdt)
    if kind == "halfway":  # fp32 bit patterns exactly halfway between bf16 values (rounding test)
        hi = torch.randint(0x3C00, 0x4100, (n,), generator=g, dtype=torch.int32) << 16
        lo = torch.tensor([0x8000, 0x7FFF, 0x8001, 0x0000], dtype=torch.int32)[torch.arange(n) % 4]
        sign = torch.where(torch.rand(n, generator=g) < 0.5, -1, 1).to(torch.int32)
        return ((hi | lo).view(torch.float32) * sign).to(wdt)
    if kind == "zeros":
        return torch.zeros(n, dtype=wdt)
    return torch.randn(n, generator=g).to(wdt)


def encode_decode(backend, w, s, k, bits, vdt, out_dtype, base_mode):
    n = w.numel()
    v = torch.full((k,), 7, dtype=vdt)
    o = torch.zeros(k, dtype=C.OFFSET_DTYPES[bits])
    c = torch.zeros(C._nblocks(n, bits), dtype=C.COUNT_DTYPES[bits])
    C.residual_topk_encode(w, s, k, bits, v, o, c, backend=backend)
    if base_mode == "shared":
        out = torch.empty(n, dtype=out_dtype)
        C.sparse_residual_decode(s, v, o, c, bits, out, backend=backend)
    elif base_mode == "none":
        out = torch.empty(n, dtype=out_dtype)
        C.sparse_residual_decode(None, v, o, c, bits, out, backend=backend)
    else:  # in place, subtracting: what the error-feedback compressor does
        out = w.clone().to(out_dtype)
        C.sparse_residual_decode(out, v, o, c, bits, out, alpha=-1.0, backend=backend)
    return v, o, c, out


CASES = [
    # n, k, block_bits, weight dtype, value dtype, shared?, data, out dtype, decode base
    (1000, 37, 8, F32, F32, True, "randn", F32, "shared"),
    (1000, 37, 8, BF16, BF16, True, "randn", BF16, "shared"),
    (1000, 100, 8, F32, BF16, True, "ties", F32, "shared"),
    (777, 50, 8, F16, F16, False, "randn", F16, "none"),
    (513, 1, 8, F32, F32, True, "randn", F32, "shared"),
    (3000, 2999, 8, F32, F32, True, "ties", F32, "shared"),
    (1024, 300, 8, F32, BF16, False, "halfway", BF16, "none"),
    (900, 40, 8, F32, F32, True, "zeros", F32, "shared"),
    (2000, 120, 8, F32, F32, False, "randn", F32, "inplace"),
    (1200, 5, 32, F32, F32, False, "ties", F32, "none"),
    (1500, 30, 16, BF16, F32, True, "randn", BF16, "shared"),
    (65536 + 700, 300, 16, BF16, BF16, True, "randn", BF16, "shared"),  # several 2**16 blocks
]


def main():
    failed = 0
    probe = torch.zeros(1)
    print(f"triton_usable(cpu)={C.triton_usable(probe)}")
    if not C.triton_usable(probe):
        return 1
    for i, (n, k, bits, wdt, vdt, has_s, data, odt, base) in enumerate(CASES):
        w = make(n, wdt, data, 2 * i)
        s = make(n, wdt, data, 2 * i + 1) if has_s else None
        t0 = time.perf_counter()
        ref = encode_decode("torch", w, s, k, bits, vdt, odt, base)
        tri = encode_decode("triton", w, s, k, bits, vdt, odt, base)
        same = [torch.equal(a, b) for a, b in zip(ref, tri, strict=True)]
        ok = all(same)
        failed += not ok
        print(f"case {i}: n={n} k={k} bits={bits} w={wdt} v={vdt} shared={has_s} {data} out={odt} {base}: "
              f"{'ok' if ok else 'MISMATCH values/offsets/counts/out=' + str(same)} ({time.perf_counter() - t0:.1f}s)")
    # The codec layer picks Triton by itself under the interpreter ("auto"); same bytes as torch.
    w, s = make(5000, BF16, "randn", 99), make(5000, BF16, "randn", 98)
    lay = M.plan_layout(5000, 50, BF16)
    p_auto, p_torch = M.encode(w, s, lay), M.encode(w, s, lay, backend="torch")
    d_auto, d_torch = M.decode(p_auto, lay, s), M.decode(p_torch, lay, s, backend="torch")
    ok = torch.equal(p_auto, p_torch) and torch.equal(d_auto, d_torch)
    failed += not ok
    print(f"codec auto backend: {'ok' if ok else 'MISMATCH'}")
    # Rows encoded in one set of launches: each row's bytes are its single-tensor encode's.
    for rows, n, ratio, dt, base in ((3, 2000, 20, BF16, "per-row"), (2, 1500, 10, F32, "one"),
                                     (3, 777, 8, F16, "none"), (2, 140_000, 300, F32, "per-row"),
                                     (2, 900, 1.0, BF16, "per-row")):
        g = torch.Generator().manual_seed(rows * n)
        w = torch.randn(rows, n, generator=g).to(dt)
        s = {"per-row": (torch.randn(rows, n, generator=g) * 0.1).to(dt), "one": torch.randn(n, generator=g).to(dt),
             "none": None}[base]
        codec = M.SharedResidualCodec(ratio, use_shared=s is not None, backend="triton")
        batch = codec.encode_batch(w, s)
        one = torch.cat([codec.encode(w[r], None if s is None else (s if s.dim() == 1 else s[r]))
                         for r in range(rows)])
        ref = M.SharedResidualCodec(ratio, use_shared=s is not None, backend="torch").encode_batch(w, s)
        ok = torch.equal(batch, one) and torch.equal(batch, ref)
        failed += not ok
        print(f"encode_batch rows={rows} n={n} {ratio}x {dt} base={base} "
              f"{codec.layout(n, dt).scheme.name}: {'ok' if ok else 'MISMATCH'}")
    print("FAILED" if failed else "ALL OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
