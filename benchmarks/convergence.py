#!/usr/bin/env python
"""Convergence of parameter-efficient migration on CPU (issue: shared + residual compression).

GPT-MoE (default 2 layers, 8 experts, top-2) on the synthetic Markov corpus or real text, 4 ranks as 2 DCs x 2 with
domains across DCs (every rank borrows the experts of its peer in the other DC), trained with
Megatron's DDP and Adam on identical data under: Megatron alltoall EP (the reference), HybridEP
exact, HybridEP with experts compressed Nx as shared + residual, and the same as plain top-k (no
shared expert, the paper's ablation). Prints the loss table, writes CSV + PNG.

    python benchmarks/convergence.py --steps 600 --vocab 32 --order 2 --init upcycled --seeds 1,2,3
    python benchmarks/convergence.py --steps 600 --corpus austen        # Jane Austen, bytes as tokens
    python benchmarks/convergence.py --steps 600 --data-path PREFIX     # from scripts/prepare_corpus
    python benchmarks/convergence.py --steps 400 --corpus austen --lr-decay-style cosine --lr-warmup-iters 40 \
        --domain 2,2 --systems alltoall,exact,w50g10    # Megatron's LR schedule; one domain of all 4 ranks

Besides the loss at equal steps it prints the steps each run needs to reach alltoall's loss at
--target-at of the run (same seed): compression's cost in training steps.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_hybridep.train.launch import run_ranks  # noqa: E402

RANKS = 4  # 2 DCs x 2


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


_RATIOS = re.compile(r"^(?:w(?P<w>\d+(?:\.\d+)?))?(?:g(?P<g>\d+(?:\.\d+)?))?(?:-wu(?P<wu>\d+))?(?P<cold>-cold)?"
                     r"(?P<b16>-b16)?$")


def system_config(system: str, refresh: int = 10):  # noqa: ANN201 - MigrationConfig, or None for a named system
    """'w10' = weights at 10x (shared + residual), 'g50' = returned gradients at 50x (top-k + error
    feedback), 'w50g50' = both; '-wu100': the gradients start exact and reach their ratio after 100
    steps; a '-cold' suffix: the first copies from the shared expert instead of one exact gather
    (the codec before exact_first_gather); '-b16': the returned gradients' kept values in bf16 (the
    runtime's default since 2026-11-26; without it they keep the gradient's fp32, as the curves recorded
    before were); None for the named systems (alltoall, exact, shared, topk, ...)."""
    from megatron_hybridep.runtime.migration import MigrationConfig

    m = _RATIOS.match(system)
    if not system or m is None or not (m["w"] or m["g"]):
        return None
    return MigrationConfig(float(m["w"] or 1), float(m["g"] or 1), True, refresh, exact_first_gather=not m["cold"],
                           grad_warmup_steps=int(m["wu"] or 0), grad_values="bf16" if m["b16"] else "same")


def lr_schedule(optimizer, lr: float, steps: int, style: str, warmup: int, min_lr: float):  # noqa: ANN201
    """Megatron's OptimizerParamScheduler as pretrain_gpt.py runs it (--lr-warmup-iters from 0,
    --lr-decay-style over the whole run to --min-lr), stepped once per iteration."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup,
                                   lr_decay_steps=steps, lr_decay_style=style, start_wd=0.0, end_wd=0.0,
                                   wd_incr_steps=steps, wd_incr_style="constant")


def train(ctx, system: str, steps: int, ratio: float, grad_ratio: float, refresh: int, seed: int,
          vocab: int, order: int, init: str, data: str | None = None, model: dict | None = None,
          schedule: dict | None = None, domain: tuple[int, int] = (2, 1)):
    from megatron_hybridep.data.synthetic import MarkovCorpus
    from megatron_hybridep.data.windows import TokenWindows
    from megatron_hybridep.megatron import cpu_runtime, setup, teardown
    from megatron_hybridep.plan.plan import Plan
    from megatron_hybridep.runtime.migration import MigrationConfig
    from megatron_hybridep.train.gpt import GPTMoEArgs, build, initialize_parallel, train_step

    cpu_runtime.enable()
    args = GPTMoEArgs(expert_model_parallel_size=ctx.world_size, seed=seed, vocab_size=vocab,
                      dispatcher="alltoall" if system == "alltoall" else "hybridep", **(model or {}))
    initialize_parallel(args)
    if system != "alltoall":
        # the named systems keep the gradient's own value dtype, as their recorded curves were made
        migration = system_config(system) or {"exact": MigrationConfig(),
                     "shared": MigrationConfig(ratio, grad_ratio, True, refresh, grad_values="same"),
                     "topk": MigrationConfig(ratio, grad_ratio, False, refresh, grad_values="same"),
                     "shared-stateless": MigrationConfig(ratio, grad_ratio, True, refresh, incremental=False,
                                                         grad_values="same"),
                     "topk-stateless": MigrationConfig(ratio, grad_ratio, False, refresh, incremental=False,
                                                       grad_values="same"),
                     }[system]
        setup([Plan.grid((2, ctx.world_size // 2), domain, args.num_experts, ("dc", "gpu"))],
              migration=migration)
    state = build(args)
    lr_scheduler = lr_schedule(state.optimizer, args.lr, steps, **schedule) if schedule else None
    if init == "upcycled":
        upcycle(state.model.module, seed, noise=0.1)
    corpus = TokenWindows(data, seed) if data else MarkovCorpus(vocab_size=vocab, seed=seed, order=order)
    losses, times = [], []
    for step in range(steps):
        tokens, labels = corpus.batch(args.micro_batch_size, args.seq_length, ctx.rank, step)
        t0 = time.perf_counter()
        losses.append(train_step(state, tokens, labels)["loss"])
        times.append(time.perf_counter() - t0)
        if lr_scheduler is not None:
            lr_scheduler.step(1)
    if system != "alltoall":
        teardown()
    import torch
    import torch.distributed as dist

    t = torch.tensor(losses)
    dist.all_reduce(t)
    return (t / ctx.world_size).tolist(), statistics.median(times)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ratio", type=float, default=50.0, help="expert weight compression (element ratio)")
    p.add_argument("--grad-ratio", type=float, default=1.0, help="returned-gradient compression (1 = exact)")
    p.add_argument("--refresh", type=int, default=10, help="shared-expert refresh interval (steps)")
    p.add_argument("--seeds", default="1234", help="comma list: model init and corpus seeds (one run each)")
    p.add_argument("--window", type=int, default=20, help="final loss = mean of the last N steps")
    p.add_argument("--target-at", type=float, default=0.8,
                   help="steps to the same loss: each run's steps until its trailing --window mean reaches "
                        "alltoall's (same seed) at this fraction of the run, over alltoall's steps")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: 64 on the Markov corpus, "
                                                           "256 on text: bytes as tokens)")
    p.add_argument("--order", type=int, default=2, help="Markov order of the corpus (2: the experts matter)")
    data = p.add_mutually_exclusive_group()
    data.add_argument("--data-path", metavar="PREFIX",
                      help="train on a byte-token indexed dataset (PREFIX.bin/.idx, from scripts/prepare_corpus) "
                           "instead of the Markov corpus")
    data.add_argument("--corpus", metavar="FILE",
                      help="train on a UTF-8 text file, prepared into --cache-dir first ('austen': the built-in "
                           "novels)")
    p.add_argument("--cache-dir", default=None, help="where --corpus is prepared (default: the corpora cache, see "
                                                     "docs/data.md)")
    p.add_argument("--layers", type=int, default=2, help="transformer layers")
    p.add_argument("--experts", type=int, default=8, help="experts per MoE layer (a multiple of the 4 ranks)")
    p.add_argument("--topk", type=int, default=2, help="experts per token")
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3, help="Adam's (peak) learning rate")
    p.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="constant",
                   help="Megatron's LR schedule over --steps (constant: no warm-up, the lr throughout)")
    p.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warm-up from 0 (with a decay style)")
    p.add_argument("--min-lr", type=float, default=None, help="the decay's floor (default: --lr / 10)")
    p.add_argument("--domain", default="2,1", metavar="DC,GPU",
                   help="the HybridEP domain: 2,1 = one rank of each DC (half of each rank's tokens through "
                        "borrowed copies), 2,2 = all four ranks (three quarters), 1,2 = the two ranks of a DC")
    p.add_argument("--init", choices=("random", "upcycled"), default="random",
                   help="expert initialisation: Megatron's independent random experts, or upcycled")
    p.add_argument("--out", default=os.path.join(REPO, "runs", "convergence"))
    p.add_argument("--recorded-only", action="store_true",
                   help="make the table from the --from-csv curves alone: a curve they lack is an error, not a run")
    p.add_argument("--from-csv", action="append", default=[], metavar="FILE[:SUFFIX]",
                   help="reuse the curves of an earlier run's CSV (the same model and --steps); runs it holds are "
                        "not repeated; ':SUFFIX' renames its systems, e.g. ':-cold'")
    p.add_argument("--systems", default="alltoall,exact,shared,topk,shared-stateless,topk-stateless",
                   help="comma list; 'stateless' = residual against the shared expert (or zeros) at every "
                        "gather, the paper's scheme; without it the residual is against the peers' copy")
    a = p.parse_args(argv)
    if not 0 < a.target_at < 1:
        p.error(f"--target-at must be in (0, 1), got {a.target_at:g}")
    a.text = a.data_path is not None or a.corpus is not None
    if a.vocab is None:
        a.vocab = 256 if a.text else 64
    elif a.text and a.vocab < 256:
        p.error(f"--vocab {a.vocab}: text is read as bytes, which needs --vocab 256 or more")
    if a.systems.split(",")[0] != "alltoall":
        p.error("--systems must start with alltoall (the reference)")
    named = {"alltoall", "exact", "shared", "topk", "shared-stateless", "topk-stateless"}
    bad = [s for s in a.systems.split(",") if s not in named and system_config(s) is None]
    if bad:
        p.error(f"--systems: unknown {', '.join(bad)}; use {', '.join(sorted(named))} or wRgR (e.g. w10, g50, w50g50)")
    if a.experts % RANKS or not 1 <= a.topk <= a.experts:
        p.error(f"--experts must be a multiple of the {RANKS} ranks and --topk between 1 and --experts")
    try:
        a.domain = tuple(int(x) for x in a.domain.split(","))
    except ValueError:
        a.domain = ()
    if len(a.domain) != 2 or not all(d in (1, 2) for d in a.domain) or a.domain == (1, 1):
        p.error("--domain must be DC,GPU with each 1 or 2 and not 1,1 (e.g. 2,1 or 2,2)")
    a.model = dict(num_layers=a.layers, num_experts=a.experts, top_k=a.topk, seq_length=a.seq_length, lr=a.lr)
    if a.lr_decay_style == "constant" and (a.lr_warmup_iters or a.min_lr is not None):
        p.error("--lr-warmup-iters and --min-lr need --lr-decay-style linear or cosine")
    if not 0 <= a.lr_warmup_iters < a.steps:
        p.error(f"--lr-warmup-iters must be in [0, --steps {a.steps})")
    a.schedule = None if a.lr_decay_style == "constant" else dict(
        style=a.lr_decay_style, warmup=a.lr_warmup_iters, min_lr=a.lr / 10 if a.min_lr is None else a.min_lr)
    if a.schedule:
        a.model["min_lr"] = a.schedule["min_lr"]  # the optimizer's parameter groups carry it
    return a


def load_text(a: argparse.Namespace):  # noqa: ANN201 - TokenWindows, or None on the Markov corpus
    """Prepare --corpus (once, before the ranks start) and open the data; None without text."""
    if not a.text:
        return None
    from megatron_hybridep.data.prepare import prepare_corpus
    from megatron_hybridep.data.text import CorpusError
    from megatron_hybridep.data.windows import TokenWindows

    if a.corpus is not None:
        a.data_path = prepare_corpus(a.corpus, cache_dir=a.cache_dir).prefix
    text = TokenWindows(a.data_path)
    if text.vocab_needed() > a.vocab:
        raise CorpusError(f"{a.data_path} holds token {text.vocab_needed() - 1}; pass --vocab {text.vocab_needed()} "
                          f"or more")
    return text


# Student's t, two-sided 95%, by degrees of freedom (no scipy in the field); 1.96 past 30.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def interval95(values: list[float]) -> tuple[float, float]:
    """95% confidence interval of the mean of independent runs (t-interval)."""
    n, mean = len(values), statistics.fmean(values)
    t = _T95[n - 2] if n - 1 <= len(_T95) else 1.96
    half = t * statistics.stdev(values) / n**0.5
    return mean - half, mean + half


def load_curves(spec: str, steps: int) -> dict[tuple[str, int], list[float]]:
    """Curves of an earlier run's CSV, ``FILE`` or ``FILE:SUFFIX`` (SUFFIX appended to its system
    names, e.g. ':-cold' for a run made before a codec change)."""
    path, _, suffix = spec.partition(":")
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) - 1 < steps:
        raise SystemExit(f"error: --from-csv {path}: {len(rows) - 1} steps, --steps is {steps}")
    out = {}
    for j, name in enumerate(rows[0][1:], start=1):
        system, seed = name.rsplit("@", 1)
        out[system + suffix, int(seed)] = [float(r[j]) for r in rows[1:steps + 1]]
    return out


def steps_to_same_loss(curves: dict[tuple[str, int], list[float]], systems: list[str], seeds: list[int],
                       steps: int, window: int, target_at: float) -> str:
    """Compression's cost as training steps: per seed, the steps until a system's trailing mean
    reaches alltoall's at ``target_at`` of the run, divided by alltoall's; 'never' when it does not
    within the run (the time-to-loss view, independent of step time)."""
    from time_to_loss import smooth

    at = max(1, round(target_at * steps))
    lines = [f"\nsteps to alltoall's loss at step {at} (trailing mean of {window}), relative to alltoall's {at}:"]
    for s in systems[1:]:
        ratios = []
        for seed in seeds:
            target = smooth(curves["alltoall", seed], window)[at - 1]
            mine = smooth(curves[s, seed], window)
            hit = next((i + 1 for i in range(steps) if mine[i] <= target), None)
            ratios.append(hit / at if hit else None)
        got = [r for r in ratios if r is not None]
        each = ", ".join(f"{r:.3f}" if r else "never" for r in ratios)
        line = f"  {s:16s} reached {len(got)}/{len(seeds)}"
        if got:
            line += f"; {'' if len(got) == len(ratios) else 'those: '}{statistics.fmean(got):.3f}x"
            line += f" +- {statistics.stdev(got):.3f}" if len(got) > 1 else ""
            if len(got) > 2:
                lo, hi = interval95(got)
                line += f", 95% interval [{lo:.3f}, {hi:.3f}]"
        lines.append(f"{line} ({each})")
    return "\n".join(lines)


def flatness(curves: dict[tuple[str, int], list[float]], systems: list[str], seeds: list[int], steps: int,
             window: int, tail: float = 0.2) -> str:
    """How much each system's loss still fell over the last ``tail`` of the run (trailing means of
    ``window`` steps at both ends, per seed): whether the run was long enough that the loss had
    flattened, so that the comparison at its end is not one of learning speed alone."""
    from time_to_loss import smooth

    start = max(window, round((1 - tail) * steps))
    lines = [f"\nloss drop over the last {steps - start} steps (trailing mean of {window} at step {start} -> {steps}):"]
    for s in systems:
        drops = []
        for seed in seeds:
            curve = smooth(curves[s, seed], window)
            drops.append((curve[start - 1] - curve[-1]) / curve[start - 1] * 100)
        lines.append(f"  {s:16s} {statistics.fmean(drops):.2f}% ({', '.join(f'{d:.2f}' for d in drops)})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from megatron_hybridep.data.text import CorpusError

    try:
        text = load_text(a)
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    systems = a.systems.split(",")
    seeds = [int(x) for x in a.seeds.split(",")]
    curves, step_ms = {}, {}
    for spec in a.from_csv:  # earlier runs' curves; a later file wins, and these runs are not repeated
        curves.update(load_curves(spec, a.steps))
    missing = [f"{s}@{seed}" for seed in seeds for s in systems if (s, seed) not in curves]
    if a.recorded_only and missing:
        print(f"error: --recorded-only: the --from-csv files hold no {', '.join(missing)}; fix: add the CSV that "
              f"has them, or drop --recorded-only to train them", file=sys.stderr)
        return 2
    for seed in seeds:
        for system in systems:
            if (system, seed) in curves:
                continue
            losses, med = run_ranks(train, RANKS, system, a.steps, a.ratio, a.grad_ratio, a.refresh, seed,
                                    a.vocab, a.order, a.init, a.data_path, a.model, a.schedule, a.domain,
                                    timeout=1800)[0]
            curves[system, seed], step_ms[system, seed] = losses, med * 1e3
            print(f"  seed {seed} {system:16s} done: final {statistics.fmean(losses[-a.window:]):.4f}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    if text is not None:
        tag = f"convergence_{os.path.basename(a.data_path)}_{a.init}_{a.ratio:g}x"
    else:
        tag = f"convergence_order{a.order}_v{a.vocab}_{a.init}_{a.ratio:g}x"
    if (a.layers, a.experts, a.topk, a.seq_length) != (2, 8, 2, 64):  # the default keeps its old file names
        tag += f"_L{a.layers}E{a.experts}k{a.topk}s{a.seq_length}"
    if a.domain != (2, 1):
        tag += f"_dc{a.domain[0]}gpu{a.domain[1]}"
    if a.lr != 3e-3 or a.schedule:  # the constant 3e-3 keeps its old file names
        tag += f"_lr{a.lr:g}"
        if a.schedule:
            tag += f"_{a.lr_decay_style}{a.lr_warmup_iters}-{a.schedule['min_lr']:g}"
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
    if text is not None:
        reference = f"byte unigram entropy {text.unigram_entropy():.3f} nats ({a.data_path})"
    else:
        best = statistics.fmean(MarkovCorpus(vocab_size=a.vocab, seed=seed, order=a.order).conditional_entropy()
                                for seed in seeds)
        reference = f"best achievable {best:.3f} nats (means over seeds)"
    print(f"\nloss after {a.steps} steps (mean of last {a.window}), {len(seeds)} seed(s) {a.seeds}; first step "
          f"{first:.4f}, {reference}; {a.init} experts")
    print(f"{'system':44s} {'final loss':>10s} {'vs EP (mean +- sd over seeds)':>30s} {'step ms':>8s}")
    names = {"alltoall": "Megatron alltoall EP", "exact": "HybridEP exact",
             "shared": f"HybridEP {a.ratio:g}x shared+residual", "topk": f"HybridEP {a.ratio:g}x plain top-k",
             "shared-stateless": f"HybridEP {a.ratio:g}x shared+residual, stateless",
             "topk-stateless": f"HybridEP {a.ratio:g}x plain top-k, stateless"}
    for s in systems:
        if s not in names:
            m = _RATIOS.match(s)
            parts = ([f"weights {m['w']}x"] if m["w"] else []) + ([f"gradients {m['g']}x"] if m["g"] else [])
            names[s] = ("HybridEP " + " + ".join(parts) + (f", warm-up {m['wu']}" if m["wu"] else "")
                        + (", cold start" if m["cold"] else "") + (" (bf16)" if m["b16"] else ""))
    for s in systems:
        deltas = [(final((s, seed)) - final(("alltoall", seed))) / final(("alltoall", seed)) * 100 for seed in seeds]
        sd = statistics.stdev(deltas) if len(deltas) > 1 else 0.0
        spread = f"{statistics.fmean(deltas):+7.2f}% +- {sd:.2f} ({', '.join(f'{d:+.2f}' for d in deltas)})"
        ms = [step_ms[s, x] for x in seeds if (s, x) in step_ms]  # none: every curve from --from-csv
        print(f"{names[s]:44s} {statistics.fmean(final((s, seed)) for seed in seeds):10.4f} {spread:>30s} "
              f"{f'{statistics.median(ms):8.1f}' if ms else '       -'}")
        if len(seeds) > 1 and s != "alltoall":
            lo, hi = interval95(deltas)
            worst = max(range(len(seeds)), key=lambda i: deltas[i])
            print(f"{'':44s} 95% interval of the mean [{lo:+.2f}%, {hi:+.2f}%]; worst seed {seeds[worst]}: "
                  f"{deltas[worst]:+.2f}%")
    print(steps_to_same_loss(curves, systems, seeds, a.steps, a.window, a.target_at))
    print(flatness(curves, systems, seeds, a.steps, a.window))
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
        on = f", {os.path.basename(a.data_path)}" if text is not None else ""
        lr = f", lr {a.lr:g} {a.lr_decay_style}" + (f" to {a.schedule['min_lr']:g}" if a.schedule else "")
        ax.set_title(f"GPT-MoE, 2 DCs x 2, domains dc{a.domain[0]} gpu{a.domain[1]}, {a.init} experts{on}{lr}",
                     fontsize=10)
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
