#!/usr/bin/env python
"""Soak test (issue 28, item 3): pretrain_moe's CPU loop on 4 local gloo ranks for many iterations with
the scheduler forced to switch to the next candidate plan every ``--switch-every`` iterations
(SchedulerConfig.cycle_every, a diagnostic with no flag) and hot replicas on. Every rank samples its
RSS, threads, open fds and process groups every ``--sample-every`` iterations; each switch is timed.

    python benchmarks/soak.py                                  # 3,000 iterations, a switch every 50
    python benchmarks/soak.py --iters 300 --switch-every 10    # a quick look

The topology is 2dc_x_2 with its WAN configured at 1 Mbit/s, so the cost model finds hot-replica
variants worth adopting (they join the cycle); the links themselves are loopback. Writes
soak_samples.csv, soak_switches.csv and soak.png under --out (default docs/results/soak/).
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hybridep.testing import soak  # noqa: E402
from megatron_hybridep.testing.loop import REPO, TINY  # noqa: E402
from megatron_hybridep.train.launch import run_ranks  # noqa: E402

METRICS = (("rss_kb", "RSS (MB)", 1 / 1024), ("threads", "threads", 1), ("fds", "open fds", 1),
           ("groups", "process groups alive", 1), ("hybridep_groups", "groups hybridep created", 1),
           ("plans", "plans held (adopted hot incl.)", 1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=3000)
    p.add_argument("--switch-every", type=int, default=50)
    p.add_argument("--sample-every", type=int, default=10)
    p.add_argument("--warmup", type=int, default=500, help="iterations before the 'warm' reference sample")
    p.add_argument("--replicas", type=int, default=2, help="--hybridep-replan-replicas")
    p.add_argument("--out", default=os.path.join(REPO, "docs", "results", "soak"))
    p.add_argument("--no-png", action="store_true")
    ns = p.parse_args(argv)
    if ns.switch_every % 10 and ns.switch_every > 10:
        p.error("--switch-every: a multiple of 10 (the scheduler decides every 10 iterations)")
    interval = min(10, ns.switch_every)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        flags = [*TINY, "--train-iters", str(ns.iters), "--log-interval", str(max(ns.iters // 10, 1)),
                 "--hybridep-replan-interval", str(interval), "--hybridep-replan-replicas", str(ns.replicas),
                 "--hybridep-topology", soak.slow_wan_topology(os.path.join(tmp, "slow_wan.yaml"))]
        per_rank = run_ranks(soak.rank, 4, flags, ns.switch_every, ns.sample_every, timeout=300 + ns.iters)
    os.makedirs(ns.out, exist_ok=True)
    _write(ns.out, per_rank)
    print(f"\ncommand: python benchmarks/soak.py {shlex.join(argv if argv is not None else sys.argv[1:])}")
    print(f"{ns.iters} iterations in {per_rank[0]['wall_s']:.0f} s, 4 ranks, a switch every {ns.switch_every}")
    _report(per_rank, ns.warmup)
    if not ns.no_png:
        _plot(per_rank, ns.warmup, os.path.join(ns.out, "soak.png"))
    print(f"written: {ns.out}/soak_samples.csv, soak_switches.csv{'' if ns.no_png else ', soak.png'}")
    return 0


def _write(out: str, per_rank: list[dict]) -> None:
    keys = ["iteration", *(m for m, _, _ in METRICS)]
    with open(os.path.join(out, "soak_samples.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["rank", *keys])
        for r, res in enumerate(per_rank):
            w.writerows([r, *(s[k] for k in keys)] for s in res["samples"])
    with open(os.path.join(out, "soak_switches.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["rank", "iteration", "plan", "decide_switch_s", "next_step_s"])
        for r, res in enumerate(per_rank):
            steps = res["step_s"]
            w.writerows([r, it, label, f"{s:.6f}", f"{steps[it]:.6f}" if it < len(steps) else ""]
                        for it, label, s in res["switches"])


def _spread(xs: list[float], unit: float = 1e3) -> str:
    return f"{statistics.median(xs) * unit:.1f} [{min(xs) * unit:.1f}-{max(xs) * unit:.1f}]"


def _report(per_rank: list[dict], warmup: int) -> None:
    print(f"\n{'rank 0 (worst growth: any rank)':34s} {'start':>8s} {'warm':>8s} {'last':>8s} {'median':>8s} "
          f"{'growth':>8s} {'worst':>8s}")
    for key, name, scale in METRICS:
        rows = []
        for res in per_rank:
            after = [s[key] for s in res["samples"] if s["iteration"] >= warmup]
            rows.append((res["samples"][0][key], after[0], after[-1], statistics.median(after),
                         max(after) / after[0] - 1 if after[0] else 0.0))
        start, warm, last, med, growth = rows[0]
        worst = max(r[4] for r in rows)
        print(f"{name:34s} {start * scale:8.1f} {warm * scale:8.1f} {last * scale:8.1f} {med * scale:8.1f} "
              f"{growth:8.1%} {worst:8.1%}")
    print(f"(warm = first sample at iteration >= {warmup}; growth = max after warm-up / warm - 1)")
    same = all([s[:2] for s in r["switches"]] == [s[:2] for s in per_rank[0]["switches"]] for r in per_rank)
    sw = per_rank[0]["switches"]
    print(f"\nswitches: {len(sw)} per rank, same iterations and plans on every rank: {same}; "
          f"distinct plans run: {len(set(per_rank[0]['labels']))}")
    decide = [s for r in per_rank for _, _, s in r["switches"]]
    print(f"switch (the scheduler's decision, adopt and switch), ms: median [min-max] {_spread(decide)}")
    nxt, others = [], []
    for r in per_rank:
        after = {it for it, _, _ in r["switches"]}  # step i (1-based) follows a switch at i - 1
        for i, s in enumerate(r["step_s"], start=1):
            if i > warmup:
                (nxt if i - 1 in after else others).append(s)
    if nxt and others:
        print(f"step after a switch (copies rebuilt under the new plan), ms: {_spread(nxt)}; "
              f"other steps: {_spread(others)}")


def _plot(per_rank: list[dict], warmup: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    for ax, (key, name, scale) in zip(axes.flat, METRICS[:4], strict=True):
        for r, res in enumerate(per_rank):
            ax.plot([s["iteration"] for s in res["samples"]], [s[key] * scale for s in res["samples"]],
                    label=f"rank {r}")
        ax.axvline(warmup, color="grey", linestyle=":")
        ax.set_title(name)
    axes.flat[0].legend()
    for ax in axes[1]:
        ax.set_xlabel("iteration")
    fig.suptitle("soak: plan switch every N iterations, hot replicas on (dotted: warm-up)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
