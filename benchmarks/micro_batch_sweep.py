#!/usr/bin/env python
"""Issue 14's targets across micro-batch counts, from `hybridep bench --micro-batches M` runs.

    python benchmarks/micro_batch_sweep.py docs/results/bench_moe_m1 docs/results/bench_moe_m4 \
        docs/results/bench_moe_m8 --out docs/results/bench_moe_sweep

Reads each run's bench.csv (no torch, no network) and prints, per point and system, the measured step,
the speedup over EP and the WAN bytes per iteration and DC uplink (link counters) at every M, then
the targets: HybridEP's WAN bytes per iteration do not grow with M (each point within the TCP/IP
header noise of its M = 1 value, 10%; points where the planner chose plain EP (S=1) at either M
excluded: their tokens cross per micro-batch by design), HybridEP >= 5x over EP at the top point at every M,
HybridEP-c >= 1.3x over replicated at the top point at the largest M, neither more than 5% slower
than EP at the lowest point, predicted step within 15% of measured everywhere. Writes sweep.md (the
printout) and sweep.png (step time and WAN bytes vs M at the top point) under --out.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

SYSTEMS = ("ep", "replicated", "hybridep", "hybridep-compressed")
LABEL = {"ep": "alltoall EP", "replicated": "replicated", "hybridep": "HybridEP", "hybridep-compressed": "HybridEP-c"}
WAN_NOISE = 0.10     # wire bytes per payload byte vary with segmenting: 2 x 66 header bytes per 1448
TOP_SPEEDUP, REPLICATED_SPEEDUP, LOW_SLOWDOWN, PRED_ERROR = 5.0, 1.3, 0.05, 0.15


def load(run: Path) -> tuple[int, dict[tuple[int, str], dict[str, float]]]:
    with open(run / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        sys.exit(f"error: {run}/bench.csv has no rows. Fix: rerun `hybridep bench --out {run}`")
    ms = {int(r["micro_batches"]) for r in rows}
    if len(ms) != 1:
        sys.exit(f"error: {run}/bench.csv mixes micro_batches {sorted(ms)}")
    keys = ("tokens", "median_s", "speedup_vs_ep", "wan_tx_mb", "pred_error_pct", "predicted_s")
    table = {(int(r["point"]), r["system"]): {k: float(r[k]) for k in keys} | {"plan": r["plan"]} for r in rows}
    return ms.pop(), table


def check(runs: dict[int, dict]) -> list[tuple[bool, str]]:
    out: list[tuple[bool, str]] = []
    ms = sorted(runs)
    points = sorted({p for t in runs.values() for p, _ in t})
    lo, hi = points[0], points[-1]
    base = runs[ms[0]]
    grow = [(m, p, runs[m][(p, "hybridep")]["wan_tx_mb"] / base[(p, "hybridep")]["wan_tx_mb"])
            for m in ms[1:] for p in points if (p, "hybridep") in runs[m] and (p, "hybridep") in base
            and not (runs[m][(p, "hybridep")]["plan"] + base[(p, "hybridep")]["plan"]).startswith("ep")
            and not base[(p, "hybridep")]["plan"].startswith("ep")]  # S=1 is plain EP: tokens per micro-batch
    worst = max(grow, key=lambda g: g[2], default=None)
    if worst:
        out.append((worst[2] <= 1 + WAN_NOISE, f"HybridEP WAN bytes per iteration do not grow with M: worst "
                    f"{worst[2]:.3f}x of M={ms[0]} (M={worst[0]}, point {worst[1]})"))
    for m in ms:
        t = runs[m]
        if (hi, "hybridep") in t:
            s = t[(hi, "hybridep")]["speedup_vs_ep"]
            out.append((s >= TOP_SPEEDUP, f"M={m} top point: HybridEP >= {TOP_SPEEDUP:g}x over EP: {s:.2f}x"))
        for sys_ in ("hybridep", "hybridep-compressed"):
            if (lo, sys_) in t and (lo, "ep") in t:
                d = t[(lo, sys_)]["median_s"] / t[(lo, "ep")]["median_s"] - 1
                out.append((d <= LOW_SLOWDOWN, f"M={m} lowest point: {LABEL[sys_]} at most "
                            f"{LOW_SLOWDOWN:.0%} slower than EP: {d * 100:+.1f}%"))
        w = max(t.items(), key=lambda kv: abs(kv[1]["pred_error_pct"]))
        out.append((abs(w[1]["pred_error_pct"]) <= PRED_ERROR * 100,
                    f"M={m} predicted within {PRED_ERROR:.0%} everywhere: worst {w[1]['pred_error_pct']:+.1f}% "
                    f"({LABEL[w[0][1]]}, point {w[0][0]})"))
    t = runs[ms[-1]]
    if (hi, "hybridep-compressed") in t and (hi, "replicated") in t:
        r = t[(hi, "replicated")]["median_s"] / t[(hi, "hybridep-compressed")]["median_s"]
        out.append((r >= REPLICATED_SPEEDUP, f"M={ms[-1]} top point: HybridEP-c >= {REPLICATED_SPEEDUP:g}x over "
                    f"replicated: {r:.2f}x"))
    return out


def report(runs: dict[int, dict]) -> str:
    ms = sorted(runs)
    points = sorted({p for t in runs.values() for p, _ in t})
    head = "pt tokens  system       " + "".join(f"  M={m}: ms   vs EP  WAN MB" for m in ms)
    lines = [head, "-" * len(head)]
    for p in points:
        for s in SYSTEMS:
            cells = []
            for m in ms:
                r = runs[m].get((p, s))
                cells.append(f"  {r['median_s'] * 1e3:8.0f} {r['speedup_vs_ep']:6.2f}x {r['wan_tx_mb']:6.2f}"
                             if r else " " * 25)
            tok = next(runs[m][(p, s)]["tokens"] for m in ms if (p, s) in runs[m])
            lines.append(f"{p:2d} {tok:6.0f}  {LABEL[s]:<12}" + "".join(cells))
    lines += ["", "ms = median step (iteration of M micro-batches); WAN MB = link counters per DC uplink per "
              "iteration (tx); tokens per micro-batch and rank", "", "targets:"]
    lines += [f"  [{'met' if ok else 'MISSED'}] {what}" for ok, what in check(runs)]
    return "\n".join(lines)


def plot(runs: dict[int, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = sorted(runs)
    hi = max(p for t in runs.values() for p, _ in t)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for s in SYSTEMS:
        rs = [runs[m].get((hi, s)) for m in ms]
        if any(r is None for r in rs):
            continue
        axes[0].plot(ms, [r["median_s"] for r in rs], "o-", label=LABEL[s])
        axes[1].plot(ms, [r["wan_tx_mb"] for r in rs], "o-", label=LABEL[s])
    axes[0].set(xlabel="micro-batches per iteration", ylabel="step time (s)", yscale="log",
                title="top point: step time")
    axes[1].set(xlabel="micro-batches per iteration", ylabel="MB per DC uplink per iteration", yscale="log",
                title="top point: WAN bytes per iteration")
    for ax in axes:
        ax.set_xticks(ms)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="`hybridep bench --out` directories, one per M")
    ap.add_argument("--out", type=Path, default=None, help="write sweep.md and sweep.png here")
    args = ap.parse_args(argv)
    runs: dict[int, dict] = {}
    for run in args.runs:
        m, table = load(run)
        if m in runs:
            sys.exit(f"error: two runs with --micro-batches {m}. Fix: pass one directory per M")
        runs[m] = table
    text = report(runs)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        cmd = "python benchmarks/micro_batch_sweep.py " + " ".join(str(r) for r in args.runs) + f" --out {args.out}"
        (args.out / "sweep.md").write_text(f"```\n{cmd}\n\n{text}\n```\n")
        plot(runs, args.out / "sweep.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
