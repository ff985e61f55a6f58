"""Check the layout planner's near-tie rule against every recorded bench: at each point where a
HybridEP system was priced faster than a Megatron system (EP, replicated experts, one stage per DC)
by at most --margin, which one measured faster. Reads the `hybridep bench` report tables
(report.txt / *_report.txt) under the given folders; each report is counted once.

    python benchmarks/near_ties.py docs/results --margin 0.05
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

HYBRID = ("HybridEP", "HybridEP-c")
MEGATRON = ("alltoall EP", "replicated", "PP per DC")
# pt, tokens, traffic, system, plan..., median [min-max], vs EP, prediction (ms, or s with a suffix)
ROW = re.compile(r"^ *\d+ +(\d+) +\S+ +(alltoall EP|replicated|HybridEP-c|HybridEP|PP per DC)\s+.*?"
                 r"([\d,.]+s?)\s+\[[^\]]*\]\s+[\d.]+x\s+([\d,.]+s?)\s", re.M)


def ms(text: str) -> float:
    return float(text[:-1]) * 1e3 if text.endswith("s") else float(text.replace(",", ""))


def near_ties(report: str, margin: float) -> list[tuple[str, str, str, float, float, float, float]]:
    """(tokens, hybrid system, megatron system, hybrid measured, predicted, megatron measured, predicted)."""
    rows: dict[str, dict[str, tuple[float, float]]] = {}
    for tokens, system, measured, predicted in ROW.findall(report):
        rows.setdefault(tokens, {})[system] = (ms(measured), ms(predicted))
    out = []
    for tokens, point in rows.items():
        for h in HYBRID:
            for m in MEGATRON:
                if h in point and m in point and point[h][1] < point[m][1] <= point[h][1] * (1 + margin):
                    out.append((tokens, h, m, *point[h], *point[m]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--margin", type=float, default=0.05, help="the near-tie's width (default 5%%)")
    args = p.parse_args(argv)
    reports = sorted({f.resolve() for d in args.folders for pat in ("report.txt", "*_report.txt")
                      for f in d.rglob(pat)})
    wins: dict[tuple[str, bool], list[float]] = {}
    for f in reports:
        for tokens, h, m, hm, hp, mm, mp in near_ties(f.read_text(), args.margin):
            faster = hm < mm
            wins.setdefault((h, faster), []).append(mm / hm if faster else hm / mm)
            print(f"{f.parent.name}/{f.name} {tokens:>5} {h:10s} {hm:8.0f} ms (priced {hp:.0f}) | {m:11s} "
                  f"{mm:8.0f} ms (priced {mp:.0f}) -> {'HybridEP' if faster else 'Megatron'} faster")
    print(f"\nnear-ties (HybridEP priced 0-{args.margin:.0%} faster), {len(reports)} reports:")
    for h in HYBRID:
        for faster, who in ((True, "HybridEP"), (False, "Megatron")):
            r = wins.get((h, faster), [])
            if r:
                print(f"  {h:10s} {who} faster at {len(r)}: by {min(r):.2f}-{max(r):.2f}x, "
                      f"median {statistics.median(r):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
