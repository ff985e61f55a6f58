"""What one collective call costs on gloo beyond its bytes, with ranks sharing CPU cores.

The cost model can price a fixed cost per collective call (Workload.collective_overhead_ms; the
testbed's figure is GLOO_CALL_MS): on the testbed 4 ranks share 2 cores, and every blocking collective waits
for the slowest rank and for gloo's threads to be scheduled. This measures it without Megatron:
each rank computes a chunk (a single-threaded matmul sized to ``--compute-ms`` on an idle core),
then either nothing or one all-to-all of ``--bytes`` per rank; the overhead per call is the
difference of the two loops' times per chunk. The two loops alternate ``--repeats`` times in one
process group; medians with the spread over repeats.

    python benchmarks/collective_call_probe.py                           # 4 ranks, 0.5 / 5 / 20 ms chunks
    python benchmarks/collective_call_probe.py --ranks 2 --compute-ms 5
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import sys
import time


def _matmul_size(ms: float) -> int:
    """Square matmul size that takes about ``ms`` on this core, single-threaded."""
    import torch

    n = 64
    while True:
        a = torch.randn(n, n)
        a @ a  # first call: allocation and dispatch warm-up
        t0 = time.perf_counter()
        for _ in range(3):
            a @ a
        t = (time.perf_counter() - t0) / 3 * 1e3
        if t >= ms or n >= 4096:
            return n
        n = int(n * max(1.1, min(2.0, (ms / max(t, 1e-3)) ** (1 / 3))))


def rank_main(rank: int, world: int, port: int, sizes: list[int], nbytes: int, calls: int, repeats: int,
              out: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = torch.zeros(max(world, nbytes // 4 // world * world))
    y = torch.empty_like(x)
    res: dict[str, list[list[float]]] = {str(n): [[], []] for n in sizes}
    for n in sizes:
        a = torch.randn(n, n)
        for rep in range(repeats):
            for call in ((0, 1) if rep % 2 == 0 else (1, 0)):  # alternate which loop goes first
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    a @ a
                    if call:
                        dist.all_to_all_single(y, x)
                dist.barrier()
                res[str(n)][call].append((time.perf_counter() - t0) / calls)
    out[rank] = res
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4, help="gloo ranks on this host (the testbed runs 4 on 2 cores)")
    p.add_argument("--compute-ms", type=float, nargs="+", default=[0.5, 5.0, 20.0],
                   help="compute between calls, per chunk on an idle core")
    p.add_argument("--bytes", type=int, default=262_144, help="all-to-all bytes per rank")
    p.add_argument("--calls", type=int, default=40, help="chunks per timed loop")
    p.add_argument("--repeats", type=int, default=5, help="alternating pairs of loops")
    p.add_argument("--json", metavar="FILE", help="also write the figures here")
    args = p.parse_args(argv)
    if args.ranks < 2 or args.calls < 1 or args.repeats < 1 or args.bytes < 4:
        p.error("--ranks >= 2, --calls >= 1, --repeats >= 1 and --bytes >= 4")
    import torch.multiprocessing as mp

    sizes = [_matmul_size(ms) for ms in args.compute_ms]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        procs = [ctx.Process(target=rank_main, args=(r, args.ranks, port, sizes, args.bytes, args.calls,
                                                     args.repeats, out)) for r in range(args.ranks)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(600)
        if any(proc.exitcode != 0 for proc in procs):
            for proc in procs:
                proc.kill()
            print("a rank failed or hung: " + ", ".join(str(proc.exitcode) for proc in procs), file=sys.stderr)
            return 1
        res = dict(out)
    print(f"$ python benchmarks/collective_call_probe.py {shlex.join(argv if argv is not None else sys.argv[1:])}")
    print(f"{args.ranks} gloo ranks on {os.cpu_count()} cores, all-to-all of {args.bytes} B per rank, "
          f"{args.calls} calls per loop, {args.repeats} pairs")
    print("| compute ms (idle core) | matmul n | step ms without calls | with calls | overhead ms per call "
          "(median, min-max over pairs) |")
    print("|---|---|---|---|---|")
    rows = []
    for ms, n in zip(args.compute_ms, sizes, strict=True):
        # rank 0's loop times: every loop ends in a barrier, so all ranks' times agree
        base, call = res[0][str(n)]
        over = [(c - b) * 1e3 for b, c in zip(base, call, strict=True)]
        row = {"compute_ms": ms, "n": n, "base_ms": statistics.median(base) * 1e3,
               "call_ms": statistics.median(call) * 1e3, "overhead_ms": statistics.median(over),
               "overhead_min_ms": min(over), "overhead_max_ms": max(over)}
        rows.append(row)
        print(f"| {ms:g} | {n} | {row['base_ms']:.2f} | {row['call_ms']:.2f} | {row['overhead_ms']:.2f} "
              f"({row['overhead_min_ms']:.2f}-{row['overhead_max_ms']:.2f}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": argv if argv is not None else sys.argv[1:], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
