"""The replicated layout's gradient all-reduces alone on the testbed: how long do they take without
Megatron, and what share of the shaped rate do they get?

The bench's ``replicated`` system (EP inside each DC, experts replicated across DCs) reduces two
gradient buffers at the end of the backward under --overlap-grad-reduce: the experts' over the
expert-data-parallel group (the ranks with the same offset in every DC) and the dense parameters'
over every rank. This runs those two all-reduces (gloo, both launched async, the experts' first as
Megatron's bucket groups do) with the sizes the bench's ranks count for bench-moe-deep, and reports
each rank's time, the bytes that crossed each DC uplink (link counters) and the share of the shaped
rate those bytes got. No Megatron, no model: what is left is the network and gloo.

    sudo python benchmarks/allreduce_probe.py                      # 2 DCs x 2 ranks, 10 Mbit/s (root)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# per rank, as the bench's ranks count bench-moe-deep's parameters at EP 2 (its report's "parameters" line)
EXPERT_PARAMS = 393_216
DENSE_PARAMS = 35_392


def rank_main(expert_n: int, dense_n: int, repeats: int) -> None:
    """One rank: ``repeats`` times both all-reduces after a barrier; prints one RESULT line of JSON."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_dc = int(os.environ["LOCAL_WORLD_SIZE"])
    # every rank creates every group, in the same order (torch.distributed's rule)
    groups = [dist.new_group(list(range(off, world, per_dc))) for off in range(per_dc)]
    experts, dense = torch.ones(expert_n), torch.ones(dense_n)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        works = [dist.all_reduce(experts, group=groups[rank % per_dc], async_op=True),
                 dist.all_reduce(dense, async_op=True)]
        for w in works:
            w.wait()
        times.append(time.perf_counter() - t0)
    print("RESULT " + json.dumps({"rank": rank, "times": times}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dcs", type=int, default=2)
    p.add_argument("--ranks-per-dc", type=int, default=2)
    p.add_argument("--rate", default="10mbit", help="WAN uplink rate of every DC (default 10mbit)")
    p.add_argument("--expert-params", type=int, default=EXPERT_PARAMS, help="expert parameters per rank (fp32)")
    p.add_argument("--dense-params", type=int, default=DENSE_PARAMS, help="dense parameters per rank (fp32)")
    p.add_argument("--repeats", type=int, default=4, help="all-reduce pairs per run")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_worker:
        rank_main(args.expert_params, args.dense_params, args.repeats)
        return 0
    if args.dcs < 2:
        p.error("--dcs: the all-reduces cross DCs only with 2 or more; fix: --dcs 2")

    from megatron_hybridep.testbed import shaping
    from megatron_hybridep.testbed.launcher import launch, python_cmd
    from megatron_hybridep.testbed.network import Testbed, TestbedConfig

    rate = shaping.parse_rate_mbit(args.rate)
    wire = rate * 1e6 / 8  # bytes per second through a shaped uplink (the counters count wire bytes)
    print("$ " + shlex.join(["python", "benchmarks/allreduce_probe.py", *(sys.argv[1:] if argv is None else argv)]))
    print(f"# {args.dcs} DCs x {args.ranks_per_dc} ranks, {args.rate}; per rank {args.expert_params:,} expert "
          f"parameters (all-reduced over the {args.dcs} ranks of its offset) and {args.dense_params:,} dense "
          f"(over all ranks), fp32, {args.repeats} repeats per run", flush=True)
    worker = python_cmd(__file__, "--rank-worker", "--expert-params", args.expert_params, "--dense-params",
                        args.dense_params, "--repeats", args.repeats)
    with Testbed(TestbedConfig(dcs=args.dcs, ranks_per_dc=args.ranks_per_dc, rate_mbit=rate, burst_ms=1)) as tb:
        for run in range(args.runs):
            before = tb.link_counters()
            res = launch(tb, worker, timeout_s=args.timeout, preload=["torch", "torch.distributed"]).raise_for_status()
            after = tb.link_counters()
            results = [json.loads(line.split("RESULT ", 1)[1]) for out in res.outputs
                       for line in out.splitlines() if line.startswith("RESULT ")]
            # the busiest uplink's bytes per all-reduce pair (start-up and barriers included: an upper bound)
            tx = max(b.tx_bytes - a.tx_bytes for a, b in zip(before, after, strict=True)) / args.repeats
            slowest = statistics.median(max(r["times"][i] for r in results) for i in range(args.repeats))
            print(f"run {run + 1}: slowest rank's median {slowest:.2f} s; {tx / 1e6:.2f} MB per uplink and pair "
                  f"= {tx / wire:.2f} s at the shaped rate: {tx / wire / slowest:.0%} of it")
            for r in sorted(results, key=lambda r: r["rank"]):
                print(f"  rank {r['rank']}: " + " ".join(f"{t:.2f}" for t in r["times"]) + " s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
