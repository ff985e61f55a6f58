"""PNG figures (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from megatron_hybridep.plan.phases import Phase
from megatron_hybridep.sim.engine import Span

COLORS = {Phase.PRE_COMPUTE: "#8fbc8f", Phase.EXPERT_COMPUTE: "#2e8b57", Phase.TOKEN_A2A_FWD: "#d2691e",
          Phase.TOKEN_A2A_BWD: "#f4a460", Phase.EXPERT_ALLGATHER: "#4682b4", Phase.GRAD_RETURN: "#9370db",
          Phase.SHARED_SYNC: "#708090", Phase.EXPERT_GRAD_ALLREDUCE: "#b22222", Phase.DENSE_GRAD_ALLREDUCE: "#cd5c5c"}


def _pyplot():  # noqa: ANN202 - matplotlib module
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def _finish(fig: Any, path: str, title: str) -> None:
    """Title (if any), layout, written to ``path``, closed."""
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    _pyplot().close(fig)


def _speedup_axes(ax: Any) -> None:
    """Speed-up over EP against data centres, log-log, with a dashed line at 1."""
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("data centres")
    ax.set_ylabel("speed-up over EP")
    ax.grid(True, which="both", alpha=0.3)


def sweep_png(rows: Sequence[dict[str, Any]], path: str, title: str = "",
              claims: dict[str, tuple[float, float]] | None = None) -> None:
    """Speed-up over EP vs DC count, one panel per policy, one line per WAN bandwidth."""
    plt = _pyplot()
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, axes = plt.subplots(1, len(policies), figsize=(4.6 * len(policies), 3.8), squeeze=False)
    for ax, pol in zip(axes[0], policies, strict=True):
        by_bw: dict[float, list[tuple[int, float]]] = defaultdict(list)
        for r in rows:
            if r["policy"] == pol and r["speedup_vs_ep"] != "":
                by_bw[float(r["wan_gbps"])].append((int(r["dcs"]), float(r["speedup_vs_ep"])))
        for bw in sorted(by_bw):
            pts = sorted(by_bw[bw])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=f"{bw:g} Gbit/s")
        key = pol.split(":")[0]
        if claims and key in claims:
            lo, hi = claims[key]
            xmax = max((int(r["dcs"]) for r in rows), default=1000)
            ax.fill_between([xmax * 0.8, xmax * 1.25], lo, hi, color="red", alpha=0.2, label="paper @1000 DCs")
        _speedup_axes(ax)
        ax.set_title(pol)
    axes[0][0].legend(fontsize=7)
    _finish(fig, path, title)


def timeline_png(spans: Sequence[Span], path: str, title: str = "", max_spans: int = 400) -> None:
    """Gantt chart: the main thread (compute and blocking waits) and the asynchronous gathers."""
    plt = _pyplot()
    main = [s for s in spans if s.kind != "async" and s.seconds > 0][:max_spans]
    end = max((s.end for s in main), default=0.0)
    asyn = [s for s in spans if s.kind == "async" and s.start <= end]
    fig, ax = plt.subplots(figsize=(11, 2.6))
    for s in main:
        ax.barh(1, s.seconds, left=s.start, color=COLORS.get(s.phase, "#999999"), edgecolor="none")
    for s in asyn:
        ax.barh(0, s.seconds, left=s.start, color=COLORS.get(s.phase, "#999999"), edgecolor="white", lw=0.3)
    ax.set_yticks([0, 1], ["collectives\nin flight", "main thread"])
    ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for k, c in COLORS.items()
               if any(s.phase == k for s in list(main) + list(asyn))]
    labels = [k for k in COLORS if any(s.phase == k for s in list(main) + list(asyn))]
    ax.legend(handles, labels, fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    if title:
        ax.set_title(title, fontsize=10)
    _save(fig, path)
    plt.close(fig)


def agreement_png(points: Sequence[dict[str, float]], path: str, title: str = "") -> None:
    """Simulated vs closed-form layer time (log-log), and the relative error per point."""
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for key, marker, label in (("exact", "o", "stream model, exact bytes"), ("paper", "x", "paper's T(p)")):
        a.scatter([p[key] for p in points], [p["sim"] for p in points], s=12, marker=marker, label=label)
        b.scatter([p["p"] for p in points], [100 * (p["sim"] / p[key] - 1) for p in points], s=12, marker=marker,
                  label=label)
    lo = min(min(p["sim"], p["exact"], p["paper"]) for p in points)
    hi = max(max(p["sim"], p["exact"], p["paper"]) for p in points)
    a.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("closed form (s)")
    a.set_ylabel("simulated (s)")
    a.legend(fontsize=8)
    b.axhspan(-1, 1, color="green", alpha=0.15, label="+-1%")
    b.set_xlabel("p = 1 - S/G")
    b.set_ylabel("simulated / closed form - 1 (%)")
    b.legend(fontsize=8)
    _finish(fig, path, title)


def fig17_png(rows: Sequence[dict[str, Any]], path: str, title: str = "",
              claim: tuple[float, float] | None = None) -> None:
    """Like the paper's Fig. 17: speed-up over EP vs DCs, one line per bandwidth (closed form), one panel
    per reading; simulated points (equal domains) that lie on a line as crosses in its colour."""
    plt = _pyplot()
    readings = list(dict.fromkeys(r["reading"] for r in rows))
    fig, axes = plt.subplots(1, len(readings), figsize=(5.2 * len(readings), 3.9), squeeze=False)
    for ax, reading in zip(axes[0], readings, strict=True):
        mine = [r for r in rows if r["reading"] == reading]
        bws = sorted({float(r["wan_gbps"]) for r in mine})
        cmap = plt.get_cmap("viridis")
        for i, bw in enumerate(bws):
            color = cmap(i / max(1, len(bws) - 1))
            line = sorted((int(r["dcs"]), float(r["speedup_closed_form"])) for r in mine
                          if float(r["wan_gbps"]) == bw and r["speedup_sim"] == "")
            if line:
                ax.plot([p[0] for p in line], [p[1] for p in line], marker="o", ms=3, color=color,
                        label=f"{bw:g} Gbit/s")
            sim = [(int(r["dcs"]), float(r["speedup_sim"])) for r in mine  # only points on the plotted lines
                   if float(r["wan_gbps"]) == bw and r["speedup_sim"] != "" and r.get("on_line", True)]
            if sim:
                ax.scatter([p[0] for p in sim], [p[1] for p in sim], marker="x", s=40, color=color, zorder=3)
        if claim:
            ax.axhspan(*claim, color="red", alpha=0.12, label="paper @1000 DCs")
        _speedup_axes(ax)
        ax.set_title(reading, fontsize=9)
        ax.legend(fontsize=7)
    _finish(fig, path, title)
