#!/usr/bin/env python
"""Convergence of parameter-efficient migration on CPU (issue: shared + residual compression).

GPT-MoE (2 layers, 8 experts, top-2) on the synthetic Markov corpus, 4 ranks as 2 DCs x 2 with
domains across DCs (every rank borrows the experts of its peer in the other DC), trained with
Megatron's DDP and Adam on identical data under: Megatron alltoall EP (the reference), HybridEP
exact, HybridEP with experts compressed Nx as shared + residual, and the same as plain top-k (no
shared expert, the paper's ablation). Prints the loss table, writes CSV + PNG.

    python benchmarks/convergence.py --steps 600 --vocab 32 --order 2 --init upcycled --seeds 1,2,3
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_hybridep.train.launch import run_ranks  # noqa: E402


def upcycle(model, seed: int, noise: float) -> None:
    """Experts = one dense MLP (identical on every rank) + small per-expert noise, as when an MoE is
    upcycled from a dense checkpoint: experts then share structure, which is what the shared
    expert of shared + residual compression captures."""
    import torch
    from megatron.core.transformer.moe.experts import SequentialMLP

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, SequentialMLP):
                experts = list(module.local_experts)
                for name, p in experts[0].named_parameters():
                    base = torch.randn(p.shape, generator=g) * p.std()
                    for e in experts:
                        q = dict(e.named_parameters())[name]
                        q.copy_(base + noise * q)


def train(ctx, system: str, steps: int, ratio: float, grad_ratio: float, refresh: int, seed: int,
          vocab: int, order: int, init: str):
    from megatron_hybridep.data.synthetic import MarkovCorpus
    from megatron_hybridep.megatron import cpu_runtime, setup, teardown
    from megatron_hybridep.plan.plan import Plan
    from megatron_hybridep.runtime.migration import MigrationConfig
    from megatron_hybridep.train.gpt import GPTMoEArgs, build, initialize_parallel, train_step

    cpu_runtime.enable()
    args = GPTMoEArgs(expert_model_parallel_size=ctx.world_size, seed=seed, vocab_size=vocab,
                      dispatcher="alltoall" if system == "alltoall" else "hybridep")
    initialize_parallel(args)
    if system != "alltoall":
        migration = {"exact": MigrationConfig(),
                     "shared": MigrationConfig(ratio, grad_ratio, True, refresh),
                     "topk": MigrationConfig(ratio, grad_ratio, False, refresh),
                     "shared-stateless": MigrationConfig(ratio, grad_ratio, True, refresh, incremental=False),
                     "topk-stateless": MigrationConfig(ratio, grad_ratio, False, refresh, incremental=False),
                     }[system]
        setup([Plan.grid((2, ctx.world_size // 2), (2, 1), args.num_experts, ("dc", "gpu"))],
              migration=migration)
    state = build(args)
    if init == "upcycled":
        upcycle(state.model.module, seed, noise=0.1)
    corpus = MarkovCorpus(vocab_size=vocab, seed=seed, order=order)
    losses, times = [], []
    for step in range(steps):
        tokens, labels = corpus.batch(args.micro_batch_size, args.seq_length, ctx.rank, step)
        t0 = time.perf_counter()
        losses.append(train_step(state, tokens, labels)["loss"])
        times.append(time.perf_counter() - t0)
    if system != "alltoall":
        teardown()
    import torch
    import torch.distributed as dist

    t = torch.tensor(losses)
    dist.all_reduce(t)
    return (t / ctx.world_size).tolist(), statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ratio", type=float, default=50.0, help="expert weight compression (element ratio)")
    p.add_argument("--grad-ratio", type=float, default=1.0, help="returned-gradient compression (1 = exact)")
    p.add_argument("--refresh", type=int, default=10, help="shared-expert refresh interval (steps)")
    p.add_argument("--seeds", default="1234", help="comma list: model init and corpus seeds (one run each)")
    p.add_argument("--window", type=int, default=20, help="final loss = mean of the last N steps")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--order", type=int, default=2, help="Markov order of the corpus (2: the experts matter)")
    p.add_argument("--init", choices=("random", "upcycled"), default="random",
                   help="expert initialisation: Megatron's independent random experts, or upcycled")
    p.add_argument("--out", default=os.path.join(REPO, "runs", "convergence"))
    p.add_argument("--systems", default="alltoall,exact,shared,topk,shared-stateless,topk-stateless",
                   help="comma list; 'stateless' = residual against the shared expert (or zeros) at every "
                        "gather, the paper's scheme; without it the residual is against the peers' copy")
    a = p.parse_args(argv)
    systems = a.systems.split(",")
    seeds = [int(x) for x in a.seeds.split(",")]
    if systems[0] != "alltoall":
        p.error("--systems must start with alltoall (the reference)")
    curves, step_ms = {}, {}
    for seed in seeds:
        for system in systems:
            losses, med = run_ranks(train, 4, system, a.steps, a.ratio, a.grad_ratio, a.refresh, seed,
                                    a.vocab, a.order, a.init, timeout=1800)[0]
            curves[system, seed], step_ms[system, seed] = losses, med * 1e3
            print(f"  seed {seed} {system:16s} done: final {statistics.fmean(losses[-a.window:]):.4f}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    tag = f"convergence_order{a.order}_v{a.vocab}_{a.init}_{a.ratio:g}x"
    keys = [(s, seed) for seed in seeds for s in systems]
    with open(os.path.join(a.out, f"{tag}.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *[f"{s}@{seed}" for s, seed in keys]])  # mean training loss over the 4 ranks
        for i in range(a.steps):
            w.writerow([i + 1, *[f"{curves[k][i]:.6f}" for k in keys]])
    from megatron_hybridep.data.synthetic import MarkovCorpus

    def final(key: tuple[str, int]) -> float:
        return statistics.fmean(curves[key][-a.window:])

    first = statistics.fmean(curves["alltoall", seed][0] for seed in seeds)
    best = statistics.fmean(MarkovCorpus(vocab_size=a.vocab, seed=seed, order=a.order).conditional_entropy()
                            for seed in seeds)
    print(f"\nloss after {a.steps} steps (mean of last {a.window}), {len(seeds)} seed(s) {a.seeds}; first step "
          f"{first:.4f}, best achievable {best:.3f} nats (means over seeds); {a.init} experts")
    print(f"{'system':44s} {'final loss':>10s} {'vs EP (mean +- sd over seeds)':>30s} {'step ms':>8s}")
    names = {"alltoall": "Megatron alltoall EP", "exact": "HybridEP exact",
             "shared": f"HybridEP {a.ratio:g}x shared+residual", "topk": f"HybridEP {a.ratio:g}x plain top-k",
             "shared-stateless": f"HybridEP {a.ratio:g}x shared+residual, stateless",
             "topk-stateless": f"HybridEP {a.ratio:g}x plain top-k, stateless"}
    for s in systems:
        deltas = [(final((s, seed)) - final(("alltoall", seed))) / final(("alltoall", seed)) * 100 for seed in seeds]
        sd = statistics.stdev(deltas) if len(deltas) > 1 else 0.0
        spread = f"{statistics.fmean(deltas):+7.2f}% +- {sd:.2f} ({', '.join(f'{d:+.2f}' for d in deltas)})"
        print(f"{names[s]:44s} {statistics.fmean(final((s, seed)) for seed in seeds):10.4f} {spread:>30s} "
              f"{statistics.median(step_ms[s, seed] for seed in seeds):8.1f}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for s in systems:  # mean over seeds
            mean = [statistics.fmean(curves[s, seed][i] for seed in seeds) for i in range(a.steps)]
            ax.plot(range(1, a.steps + 1), mean, label=names[s], lw=1.2)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (nats/token)")
        ax.set_title(f"GPT-MoE, 2 DCs x 2, domains across DCs, {a.ratio:g}x, {a.init} experts", fontsize=10)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, f"{tag}.png"), dpi=120)
    except ImportError:
        pass
    print(f"\nwrote {a.out}/{tag}.csv and {tag}.png")
    print("command: python benchmarks/convergence.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
