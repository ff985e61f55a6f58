#!/usr/bin/env python
"""What the bench's ``auto`` system would run with today's layout planner, at the points of finished
`hybridep bench` runs, and how fast that layout and plan measured there (any exact system of the
run that ran the same layout and plan). A planner change is checked against recorded
measurements; a new bench run confirms it.

    python benchmarks/auto_rechoice.py docs/results/layout_bench/2dc_x_2_50mbit docs/results/layout_bench/2dc_x_2_10mbit
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_hybridep.bench import predict as bp  # noqa: E402
from megatron_hybridep.bench.reanalyse import recorded_session  # noqa: E402
from megatron_hybridep.plan.layout import is_hybridep  # noqa: E402
from megatron_hybridep.plan.plan import Plan  # noqa: E402

EXACT = ("ep", "replicated", "hybridep", "pp", "auto")


def key(pp: int, ep: int, plan: Plan) -> tuple[int, int, str]:
    return pp, ep, plan.label if is_hybridep(plan) else "plain"


def measured_keys(summary: dict, cfg, rows: list[dict]) -> dict[tuple[int, str], tuple[int, int, str]]:  # noqa: ANN001
    """(point, system) -> the (PP, EP, plan) it ran."""
    out = {}
    for r in rows:
        p, s = int(r["point"]), r["system"]
        ran = summary.get("layouts", {}).get(f"{p} {s}")
        if ran:
            out[p, s] = key(ran["layout"]["pp"], ran["layout"]["ep"], Plan.from_dict(ran["plan"]))
        elif s == "ep":
            out[p, s] = (1, cfg.world, "plain")
        elif s == "replicated":
            out[p, s] = (1, cfg.ranks_per_dc, "plain")
        elif s == "hybridep":
            out[p, s] = (1, cfg.world, "plain" if r["plan"].startswith("ep") else r["plan"])
    return out


def rechoose(out: Path) -> list[str]:
    summary, session = recorded_session(out)
    cfg = session.cfg
    rows = [r for r in csv.DictReader((out / "bench.csv").open()) if r["system"] in EXACT]
    ran = measured_keys(summary, cfg, rows)
    lines, close = [], 0
    for i, point in enumerate(cfg.points):
        c = bp.choose_layout(session.topology(shaped=True), session.workload(point, session.events))
        assert c.best is not None
        k = key(c.layout.pp, c.layout.ep, c.best.plan)
        at = {r["system"]: float(r["median_s"]) for r in rows if int(r["point"]) == i}
        same = [at[s] for s in at if ran.get((i, s)) == k]
        fastest = min(at.values())
        if same:
            ratio = max(same) / fastest
            close += ratio <= 1.05
            how = (f"measured {', '.join(f'{x * 1e3:.0f}' for x in same)} ms (worst {ratio:.2f}x the fastest exact "
                   f"system, {fastest * 1e3:.0f} ms)")
        else:
            how = "this layout and plan did not run here"
        was = ran.get((i, "auto"))
        lines.append(f"  pt {i} ({point['tokens']} tokens): {c.layout.label} {c.best.plan.label}"
                     f"{' (unchanged)' if was == k else f' (ran: PP{was[0]} EP{was[1]} {was[2]})' if was else ''}"
                     f"; {how}")
    lines.insert(0, f"{out}: within 5% of the fastest exact system at {close}/{len(cfg.points)} points "
                    "(the worst of the runs with that layout and plan)")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="--out directories of finished `hybridep bench` runs")
    for run in p.parse_args(argv).runs:
        print("\n".join(rechoose(Path(run))))
    print("command: python benchmarks/auto_rechoice.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
