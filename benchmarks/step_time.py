#!/usr/bin/env python
"""Per-step time of the 4-rank GPT-MoE on CPU (unshaped loopback, gloo): Megatron alltoall EP vs
HybridEP plans, and the extra memory the borrowed expert copies take per MoE layer.

    python benchmarks/step_time.py --steps 30 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hybridep.train.launch import run_ranks  # noqa: E402

PLANS = {"alltoall": None, "hybridep S=1 (ep)": ((4,), (1,)), "hybridep dc2 gpu1": ((2, 2), (2, 1)),
         "hybridep S=4": ((4,), (4,))}


def worker(ctx, name: str, steps: int, warmup: int):
    from megatron_hybridep.data.synthetic import MarkovCorpus
    from megatron_hybridep.megatron import cpu_runtime, setup, teardown
    from megatron_hybridep.plan.plan import Plan
    from megatron_hybridep.train.gpt import GPTMoEArgs, build, initialize_parallel, train_step

    cpu_runtime.enable()
    args = GPTMoEArgs(expert_model_parallel_size=ctx.world_size,
                      dispatcher="alltoall" if PLANS[name] is None else "hybridep")
    initialize_parallel(args)
    runtime = None
    if PLANS[name] is not None:
        counts, sizes = PLANS[name]
        names = ("dc", "gpu") if len(counts) == 2 else ("gpu",)
        runtime = setup([Plan.grid(counts, sizes, args.num_experts, names)])
    state = build(args)
    corpus = MarkovCorpus()
    times = []
    for step in range(warmup + steps):
        tokens, labels = corpus.batch(args.micro_batch_size, args.seq_length, ctx.rank, step)
        t0 = time.perf_counter()
        train_step(state, tokens, labels)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    borrowed = dict(runtime.stats.borrowed_bytes) if runtime else {}
    if runtime:
        teardown()
    return statistics.median(times), borrowed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    print(f"{'system':22s} {'median step ms':>15s} {'spread (min-max of repeats)':>28s} {'borrowed KB/layer':>18s}")
    for name in PLANS:
        meds, borrowed = [], {}
        for _ in range(a.repeats):
            out = run_ranks(worker, 4, name, a.steps, a.warmup, timeout=600)
            meds.append(statistics.median(o[0] for o in out) * 1e3)
            borrowed = out[0][1]
        per_layer = max(borrowed.values()) / 1024 if borrowed else 0.0
        print(f"{name:22s} {statistics.median(meds):15.1f} {min(meds):13.1f} - {max(meds):<12.1f} {per_layer:18.1f}",
              flush=True)
    print("command: python benchmarks/step_time.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
