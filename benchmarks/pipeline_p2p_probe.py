"""Megatron's 1F1B p2p pattern alone on the testbed: is the cost model's replay of the schedule
(plan/pipeline.py one_f_one_b) right, and what does one transfer really take?

One pipeline stage per DC, --ranks-per-dc ranks per stage; every rank runs stage s's op sequence
of the replay (plan/pipeline.py stage_program) with sleeps (or, --busy, matmuls that use a core) as
forward / backward compute and real gloo batch_isend_irecv of --bytes per rank and message, as
Megatron's P2PCommunicator does on CPU: receives posted first, as the CPU runtime makes Megatron
post them (--sends-first: Megatron's own order, in which gloo runs the two directions of a boundary
one after the other).
No Megatron, no model: what is left is the network, gloo and the schedule.

    sudo python benchmarks/pipeline_p2p_probe.py --dcs 4 --micro-batches 32     # needs root (testbed)

Prints per run: the measured iteration (median over ranks), the replay with the nominal transfer
time (a boundary's bytes at the link's TCP goodput) and the replay fed with the measured effective
transfer time of each boundary and direction (from the later of send / receive posted to the
receive done, mean over messages); and per boundary those effective times against the nominal.
If the replay with the measured times matches the measured iteration, the schedule logic is right
and only the per-message time is mispriced. With --busy the same two replays on the host's shared
cores (plan/pipeline.py one_f_one_b_shared: a stage waiting on a transfer leaves its cores to the
others), as the bench prices pipeline sends on the testbed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from collections import defaultdict
from functools import partial

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_hybridep.megatron.cpu_runtime import recvs_first  # noqa: E402
from megatron_hybridep.plan.pipeline import one_f_one_b, one_f_one_b_shared, stage_program  # noqa: E402

Message = tuple[str, int, int]  # (kind "a"/"g", boundary, micro-batch)


def matmuls_per_s() -> float:
    """How many 96 x 96 fp32 matmuls one core does per second here (measured alone, by the driver:
    the ranks contend for the cores, which is the point of --busy)."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(96, 96)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.3:
        a @ a
        n += 1
    return n / (time.perf_counter() - t0)


def _busy(per_s: float):
    """A compute stand-in that uses a core: ``duration * per_s`` small matmuls (``duration`` alone)."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(96, 96)

    def run(duration: float) -> None:
        for _ in range(int(duration * per_s)):
            a @ a

    return run


def rank_main(nbytes: int, pp: int, m: int, f: float, b: float, busy_per_s: float = 0.0,
              sends_first: bool = False) -> None:
    """One rank: stage s's ops, timed; prints one RESULT line of JSON."""
    import torch
    import torch.distributed as dist

    compute = _busy(busy_per_s) if busy_per_s else time.sleep
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_stage = world // pp
    s, off = divmod(rank, per_stage)
    n = nbytes // 4

    def peer(stage: int) -> int:
        return stage * per_stage + off

    dist.barrier()
    t0 = time.perf_counter()
    log = []
    for op in stage_program(s, pp, m):
        if op in ("F", "B"):
            compute(f if op == "F" else b)  # a stand-in: the probe is about the network
            continue
        ops = []
        for side, (kind, _, _) in op:
            if side == "send":
                ops.append(dist.P2POp(dist.isend, torch.ones(n), peer(s + 1 if kind == "a" else s - 1)))
            else:
                ops.append(dist.P2POp(dist.irecv, torch.empty(n), peer(s - 1 if kind == "a" else s + 1)))
        if not sends_first:  # what Megatron's batches do under the CPU runtime (cpu_runtime.recvs_first)
            ops = recvs_first(ops)
        w0 = time.perf_counter()
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        log.append([[[side, list(msg)] for side, msg in op], w0 - t0, time.perf_counter() - t0])
    total = time.perf_counter() - t0
    print("RESULT " + json.dumps({"rank": rank, "stage": s, "offset": off, "total": total, "log": log}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def effective_times(results: list[dict]) -> dict[tuple[str, int], list[float]]:
    """Per (kind, boundary): each message's time from the later of its send and receive being posted
    to its receive completing (one entry per message and stage offset)."""
    posted: dict[tuple, float] = {}
    done: dict[tuple, float] = {}
    for r in results:
        for items, w0, w1 in r["log"]:
            for side, msg in items:
                key = (tuple(msg), r["offset"])
                posted[(key, side)] = w0
                if side == "recv":
                    done[key] = w1
    out: dict[tuple[str, int], list[float]] = defaultdict(list)
    for key, end in done.items():
        (kind, boundary, _), _ = key
        out[(kind, boundary)].append(end - max(posted[(key, "send")], posted[(key, "recv")]))
    return dict(out)


def replays(pp: int, m: int, f: float, b: float, nominal: float, eff: dict[tuple[str, int], list[float]],
            ranks: int = 1, cores: float | None = None) -> tuple[float, float]:
    """(the replay with the nominal time everywhere, the replay with each boundary's measured mean);
    ``cores``: on that many cores shared by ``ranks`` per stage (None: a core per rank)."""
    fwd = [statistics.fmean(eff[("a", k)]) for k in range(pp - 1)]
    bwd = [statistics.fmean(eff[("g", k)]) for k in range(pp - 1)]
    replay = one_f_one_b if cores is None else partial(one_f_one_b_shared, ranks_per_stage=ranks, cores=cores)
    return replay(pp, m, f, b, [nominal] * (pp - 1), [nominal] * (pp - 1)), replay(pp, m, f, b, fwd, bwd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dcs", type=int, default=4, help="DCs = pipeline stages (default 4)")
    p.add_argument("--ranks-per-dc", type=int, default=2)
    p.add_argument("--rate", default="10mbit", help="WAN uplink rate of every DC (default 10mbit)")
    p.add_argument("--micro-batches", type=int, default=32)
    p.add_argument("--bytes", type=int, default=137_000, help="bytes per rank and message (default: the "
                   "bench's bench-moe-deep activations at 1024 tokens)")
    p.add_argument("--fwd-s", type=float, default=0.05, help="forward compute per micro-batch (a sleep)")
    p.add_argument("--bwd-s", type=float, default=0.1)
    p.add_argument("--busy", action="store_true", help="compute with a core (matmuls timed alone) instead of "
                   "sleeping: ranks then contend for the cores as in a real run")
    p.add_argument("--sends-first", action="store_true", help="post each batch in Megatron's own order "
                   "(sends before receives), as upstream Megatron does on gloo; default: receives first, as under the "
                   "CPU runtime")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--busy-per-s", type=float, default=0.0, help=argparse.SUPPRESS)  # the driver's calibration
    args = p.parse_args(argv)
    pp, m = args.dcs, args.micro_batches
    if args.rank_worker:
        rank_main(args.bytes, pp, m, args.fwd_s, args.bwd_s, args.busy_per_s, args.sends_first)
        return 0
    if pp < 2:
        p.error("--dcs: a pipeline needs at least 2 stages (one per DC); fix: --dcs 2 or more")

    from megatron_hybridep.testbed import shaping
    from megatron_hybridep.testbed.launcher import launch, python_cmd
    from megatron_hybridep.testbed.network import Testbed, TestbedConfig
    from megatron_hybridep.testbed.selfcheck import TCP_GOODPUT_FRACTION

    rate = shaping.parse_rate_mbit(args.rate)
    nominal = args.ranks_per_dc * args.bytes * 8 / (rate * 1e6 * TCP_GOODPUT_FRACTION)
    print("$ " + shlex.join(["python", "benchmarks/pipeline_p2p_probe.py", *(sys.argv[1:] if argv is None else argv)]))
    print(f"# {pp} stages (one per DC) x {args.ranks_per_dc} ranks, {args.rate}, {m} micro-batches, "
          f"{args.bytes:,} B per rank and message, compute {args.fwd_s}/{args.bwd_s} s "
          f"({'busy: matmuls' if args.busy else 'sleeping'}), {'sends' if args.sends_first else 'receives'} first; "
          f"nominal transfer "
          f"{nominal * 1e3:.0f} ms (a boundary's bytes at {TCP_GOODPUT_FRACTION:.1%} of the rate)", flush=True)
    busy = matmuls_per_s() if args.busy else 0.0
    worker = python_cmd(__file__, "--rank-worker", "--dcs", pp, "--micro-batches", m, "--bytes", args.bytes,
                        "--fwd-s", args.fwd_s, "--bwd-s", args.bwd_s, "--busy-per-s", busy,
                        *(["--sends-first"] if args.sends_first else []))
    with Testbed(TestbedConfig(dcs=pp, ranks_per_dc=args.ranks_per_dc, rate_mbit=rate, burst_ms=1)) as tb:
        for run in range(args.repeats):
            res = launch(tb, worker, timeout_s=args.timeout, preload=["torch", "torch.distributed"]).raise_for_status()
            results = [json.loads(line.split("RESULT ", 1)[1]) for out in res.outputs
                       for line in out.splitlines() if line.startswith("RESULT ")]
            eff = effective_times(results)
            measured = statistics.median(r["total"] for r in results)
            nominal_replay, fitted_replay = replays(pp, m, args.fwd_s, args.bwd_s, nominal, eff)
            print(f"run {run + 1}: measured {measured:.2f} s; replay, nominal transfers {nominal_replay:.2f} s "
                  f"({nominal_replay / measured - 1:+.0%}); replay, measured transfers {fitted_replay:.2f} s "
                  f"({fitted_replay / measured - 1:+.0%})")
            if args.busy:  # the ranks contend for the host's cores
                cores = len(os.sched_getaffinity(0))
                shared_nominal, shared_fitted = replays(pp, m, args.fwd_s, args.bwd_s, nominal, eff,
                                                        args.ranks_per_dc, cores)
                print(f"  on {cores} shared cores: replay, nominal transfers {shared_nominal:.2f} s "
                      f"({shared_nominal / measured - 1:+.0%}); replay, measured transfers {shared_fitted:.2f} s "
                      f"({shared_fitted / measured - 1:+.0%})")
            for (kind, k), v in sorted(eff.items(), key=lambda kv: (kv[0][1], kv[0][0])):
                what = f"stage {k} -> {k + 1} activations" if kind == "a" else f"stage {k + 1} -> {k} gradients"
                print(f"  {what:<26} mean {statistics.fmean(v) * 1e3:5.0f} ms = {statistics.fmean(v) / nominal:4.2f}x "
                      f"nominal (median {statistics.median(v) * 1e3:.0f}, {len(v)} messages)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
