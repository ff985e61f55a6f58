#!/usr/bin/env python
"""Does a rank process that builds one system after another get slower? (the bench's workers do)

    python benchmarks/rebuild_probe.py                 # with megatron/group_reuse.py, as the bench runs
    python benchmarks/rebuild_probe.py --no-reuse      # Megatron's own: new process groups every build

4 local CPU ranks build the bench's expert-heavy model (configs/models/bench-moe-deep.yaml, 8
micro-batches of 6 x 32 tokens) in three layouts, EP4, PP2 EP2 and EP2, one after another, --rounds
times, as a bench worker builds its systems at a point; each build trains 2 warm-up and 4 timed
steps. Per build: the median step (rank 0), the threads of rank 0's process and Python's object count.
The same layout should take the same time in every round.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_hybridep.train.launch import run_ranks  # noqa: E402

LAYOUTS = (("EP4", 4, 1), ("PP2 EP2", 2, 2), ("EP2", 2, 1))


def _rank(ctx, reuse: bool, rounds: int) -> list[tuple]:  # noqa: ANN001
    import torch.distributed as dist

    from megatron_hybridep.bench.predict import load_model
    from megatron_hybridep.data.synthetic import MarkovCorpus
    from megatron_hybridep.megatron import cpu_runtime
    from megatron_hybridep.megatron.group_reuse import reuse_megatron_groups
    from megatron_hybridep.train.gpt import GPTMoEArgs, build, initialize_parallel, train_step

    logging.getLogger("megatron").setLevel(logging.ERROR)  # every build logs its buckets and config
    cpu_runtime.enable()
    if reuse:
        reuse_megatron_groups()
    model = load_model(os.path.join(REPO, "configs", "models", "bench-moe-deep.yaml"))
    corpus = MarkovCorpus(vocab_size=model.vocab_size)
    rank, rows = dist.get_rank(), []
    for r in range(rounds):
        for name, ep, pp in LAYOUTS:
            args = GPTMoEArgs.from_model(model, seq_length=32, overlap_grad_reduce=True, dispatcher="alltoall",
                                         expert_model_parallel_size=ep, pipeline_model_parallel_size=pp)
            initialize_parallel(args)
            state = build(args)
            m = 8 * pp  # the same global batch on 1/pp of the data-parallel ranks
            steps = [[corpus.batch(6, 32, rank, s * m + j) for j in range(m)] for s in range(6)]
            for batch in steps[:2]:
                train_step(state, batch)
            dist.barrier()
            times = []
            for batch in steps[2:]:
                t = time.perf_counter()
                train_step(state, batch)
                times.append(time.perf_counter() - t)
            dist.barrier()
            del state
            rows.append((r, name, statistics.median(times), len(os.listdir("/proc/self/task")), len(gc.get_objects())))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reuse", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse Megatron's groups across builds (megatron/group_reuse.py; default on, as the bench)")
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args(argv)
    rows = run_ranks(_rank, 4, a.reuse, a.rounds, timeout=3600)[0]
    print(f"command: python benchmarks/rebuild_probe.py {'' if a.reuse else '--no-reuse '}--rounds {a.rounds}")
    print(f"{'round':>5} {'layout':<8} {'median step ms':>14} {'threads':>8} {'objects':>9}")
    for r, name, step, threads, objects in rows:
        print(f"{r:>5} {name:<8} {step * 1e3:>14,.0f} {threads:>8} {objects:>9,}")
    first = {name: step for r, name, step, _, _ in rows if r == 0}
    last = {name: step for r, name, step, _, _ in rows if r == a.rounds - 1}
    print("last round / first: " + ", ".join(f"{n} {last[n] / first[n]:.2f}x" for n in first))
    return 0


if __name__ == "__main__":
    sys.exit(main())
