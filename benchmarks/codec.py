"""Bytes per expert and CPU encode/decode time of the shared + residual codec.

    python benchmarks/codec.py [--repeats 5] [--ratios 1 10 50] [--sizes 2.1e6 4.7e6 8.4e6]

Expert sizes are the paper's (2.1M-8.4M parameters). Bytes are measured on the encoded payload
(values + block offsets + block counts + alignment padding), i.e. what an all-gather sends.
Times: median wall time of ``repeats`` runs per expert, torch backend (the Triton kernels run
on CUDA only; on CPU they exist for validation under TRITON_INTERPRET=1).
"""

import argparse
import functools
import shlex
import statistics
import sys
import time

import torch

from megatron_hybridep.runtime.compression import SharedResidualCodec


def _median_s(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[2.1e6, 4.7e6, 8.4e6])
    ap.add_argument("--ratios", type=float, nargs="+", default=[1, 10, 50])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print("$ python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]))
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} CPU threads, median of {args.repeats}")
    hdr = f"{'params':>9} {'dtype':>8} {'ratio':>5} {'scheme':>7} {'k':>9} {'bytes':>11} {'MB':>7} " \
          f"{'byte-x':>6} {'encode ms':>9} {'decode ms':>9}"
    print(hdr)
    for size in args.sizes:
        n = int(size)
        g = torch.Generator().manual_seed(0)
        for dname in args.dtypes:
            dtype = getattr(torch, dname)
            shared = (0.02 * torch.randn(n, generator=g)).to(dtype)
            w = (shared.float() + 0.005 * torch.randn(n, generator=g)).to(dtype)
            for ratio in args.ratios:
                codec = SharedResidualCodec(ratio)
                lay = codec.layout(n, dtype)
                payload = codec.encode(w, shared)
                assert payload.numel() == lay.nbytes
                out = torch.empty_like(w)
                enc = _median_s(functools.partial(codec.encode, w, shared, out=payload), args.repeats)
                dec = _median_s(functools.partial(codec.decode, payload, shared, out=out), args.repeats)
                print(f"{n:>9} {dname:>8} {ratio:>5g} {lay.scheme.name:>7} {lay.k:>9} {lay.nbytes:>11} "
                      f"{lay.nbytes / 1e6:>7.3f} {lay.byte_ratio:>6.1f} {enc * 1e3:>9.1f} {dec * 1e3:>9.1f}")


if __name__ == "__main__":
    main()
