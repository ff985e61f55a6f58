#!/usr/bin/env python
"""Model quality over seeds from time_to_loss.py runs: per seed, the steps each system needs to the
reference's target loss and its loss at equal steps against the reference; then per system the mean
change with a 95% interval and the worst seed. With --time, also the time to the target: per results.json,
reference / system wall-clock (that file's own target and step times, as its results.md), and the mean
over the files with a 95% interval.

Losses: a run's loss curve does not depend on the link it ran on (same plan, same numerics), so
runs from any rate join; a system that ran twice for one seed is checked to have the same curve. Times
do depend on it and on the host: --time pairs only the runs of one file.

    python benchmarks/ttl_seeds.py docs/results/time_to_loss/*_reno_strict_seed*/results.json \\
        docs/results/time_to_loss/*_reno_strict_early16_seed*/results.json

A system is named by time_to_loss.py's system and its --early-grad-return: "hybridep-c" (off: runs
recorded before the split was the default, or 0), "hybridep-c early 16" (asked for, or the default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from convergence import interval95  # noqa: E402
from time_to_loss import smooth, to_target  # noqa: E402

from megatron_hybridep.plan.workload import auto_early_return  # noqa: E402

COMPRESSED = ("hybridep-c", "auto-c")  # the systems --early-grad-return reaches


def label(system: str, early: float | None, grad_ratio: float) -> str:
    if system not in COMPRESSED:
        return system
    ratio = auto_early_return(grad_ratio) if early is None else early  # None: pretrain_moe.py's auto
    return f"{system} early {ratio:g}" if ratio else system


def curves(paths: list[str]) -> dict[int, dict[str, list[float]]]:
    """seed -> system label -> loss per iteration (runs joined with --recorded are skipped: their own
    file is read instead)."""
    out: dict[int, dict[str, list[float]]] = defaultdict(dict)
    for path in paths:
        data = json.loads(Path(path).read_text())
        a = data["args"]
        for system, reps in data["runs"].items():
            if system.endswith("(recorded)"):
                continue
            name = label(system, a.get("early_grad_return", 0.0), a.get("grad_ratio", 1.0))
            loss = [x[1] for x in reps[0]]
            seen = out[a["seed"]].get(name)
            if seen is not None and seen != loss:
                worst = max(abs(p - q) for p, q in zip(seen, loss, strict=False))
                raise SystemExit(f"{path}: {name} at seed {a['seed']} ran before with another curve (largest "
                                 f"difference {worst:.4g}); fix: pass runs of one corpus, model and batch")
            out[a["seed"]][name] = loss
    return out


def table(runs: dict[int, dict[str, list[float]]], reference: str, target_at: float, window: int) -> str:
    rows: list[str] = []
    per: dict[str, list] = defaultdict(list)
    systems = sorted({s for by in runs.values() for s in by if s != reference})
    for seed in sorted(runs):
        by = runs[seed]
        if reference not in by:
            rows.append(f"| {seed} | no {reference} run: skipped |")
            continue
        ref = smooth(by[reference], window)
        target = ref[max(1, round(target_at * len(ref))) - 1]
        ref_steps = next(i + 1 for i, v in enumerate(ref) if v <= target)
        cells = []
        for s in systems:
            if s not in by:
                cells.append("-")
                continue
            mine = smooth(by[s], window)
            steps = next((i + 1 for i, v in enumerate(mine) if v <= target), None)
            change = (mine[-1] / ref[-1] - 1) * 100
            per[s].append((seed, change, steps, ref_steps))
            cells.append(f"{steps if steps else 'not reached'} / {change:+.2f}%")
        rows.append(f"| {seed} | {target:.4f} | " + " | ".join(cells) + " |")
    head = [f"steps to {reference}'s loss at {target_at:g} of its run / loss at equal steps vs {reference} "
            f"(moving mean of {window})", "", "| seed | target | " + " | ".join(systems) + " |",
            "|---|---|" + "---|" * len(systems)]
    foot = []
    for s in systems:
        got = per[s]
        if not got:
            continue
        changes = [c for _, c, _, _ in got]
        worst = max(got, key=lambda x: x[1])
        reached = [(st, at) for _, _, st, at in got if st]
        extra = statistics.fmean(st / at for st, at in reached) if reached else float("nan")
        ci = (f", 95% interval [{interval95(changes)[0]:+.2f}%, {interval95(changes)[1]:+.2f}%]"
              if len(changes) > 1 else "")
        foot.append(f"{s}: {len(got)} seeds, loss {statistics.fmean(changes):+.2f}%{ci}, worst seed {worst[0]} "
                    f"{worst[1]:+.2f}%; steps to the target {extra:.3f}x {reference}'s ({len(reached)} reached)")
    base = systems[0] if systems else None
    for s in systems[1:]:  # each against the first, on the seeds both ran: the seed's own noise cancels
        mine, theirs = {seed: c for seed, c, _, _ in per[s]}, {seed: c for seed, c, _, _ in per[base]}
        both = sorted(set(mine) & set(theirs))
        if len(both) > 1:
            diff = [mine[seed] - theirs[seed] for seed in both]
            lo, hi = interval95(diff)
            foot.append(f"{s} - {base}, paired over {len(both)} seeds: {statistics.fmean(diff):+.2f} points of loss "
                        f"change, 95% interval [{lo:+.2f}, {hi:+.2f}]")
    return "\n".join(head + rows + [""] + foot)


def _seconds(reps: list, target: float, window: int, warmup: int) -> float | None:
    """Median wall-clock to the target over a system's repeats (None: a repeat never reached it)."""
    got = [to_target([tuple(x) for x in r], target, window, warmup)["seconds"] for r in reps]
    return statistics.median(got) if None not in got else None


def speedups(paths: list[str], reference: str) -> str:
    """Per results.json: reference / system wall-clock to the file's target (its own moving mean, warm-up
    and step times: its results.md's "vs" column); then per system the mean with a 95% interval."""
    rows = ["time to the target, reference / system wall-clock, per results.json", "",
            "| seed | system | speed-up | reference | file |", "|---|---|---|---|---|"]
    per: dict[str, list[float]] = defaultdict(list)
    for path in paths:
        data = json.loads(Path(path).read_text())
        a, runs = data["args"], data["runs"]
        recorded = reference not in a.get("systems", reference).split(",")  # joined from another run's file
        refs = runs.get(reference) or runs.get(f"{reference} (recorded)")
        if refs is None:
            rows.append(f"| {a['seed']} | - | no {reference} run | - | {path} |")
            continue
        when = (data["target"], a.get("window", 10), a.get("warmup", 2))
        ref_s = _seconds(refs, *when)
        for system, reps in runs.items():
            if system == reference or system.endswith("(recorded)"):
                continue
            name = label(system, a.get("early_grad_return", 0.0), a.get("grad_ratio", 1.0))
            mine = _seconds(reps, *when)
            if mine is None or ref_s is None:
                rows.append(f"| {a['seed']} | {name} | not reached | - | {path} |")
                continue
            per[name].append(ref_s / mine)
            rows.append(f"| {a['seed']} | {name} | {ref_s / mine:.2f}x | {'recorded' if recorded else 'this run'} "
                        f"| {path} |")
    foot = []
    for name, xs in sorted(per.items()):
        ci = f", 95% interval [{interval95(xs)[0]:.2f}x, {interval95(xs)[1]:.2f}x]" if len(xs) > 1 else ""
        foot.append(f"{name}: {len(xs)} runs, {statistics.fmean(xs):.2f}x sooner than {reference}{ci}, "
                    f"range {min(xs):.2f}-{max(xs):.2f}x")
    return "\n".join(rows + [""] + foot)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="time_to_loss.py results.json files")
    p.add_argument("--reference", default="replicated", help="the system whose loss is the target (an exact one)")
    p.add_argument("--target-at", type=float, default=0.75, help="the target: the reference's loss at this "
                   "fraction of its run")
    p.add_argument("--window", type=int, default=10, help="logged iterations in the loss's moving mean")
    p.add_argument("--time", action="store_true", help="also the time to the target per file, with the mean "
                   "over the files (pass runs of one host and link: times depend on them)")
    a = p.parse_args(argv)
    print(table(curves(a.results), a.reference, a.target_at, a.window))
    if a.time:
        print("\n" + speedups(a.results, a.reference))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
