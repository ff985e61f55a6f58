"""The bench's bare all-to-all probe, per point: a gloo all-to-all of EP's size on the unshaped and
then the shaped WAN. Its efficiency is what the predictions divide the token all-to-alls by.

- Long probes (at least STEADY_S of wire at the rate) see steady-state TCP: the share of the rate
  they got, pooled over them (one number, less noisy than each).
- Short probes are mostly the call's fixed cost: 8 ranks on 2 cores take ~5 ms for a bare all-to-all
  unshaped, more than a 32-token call's 3 ms of wire, and a 1 ms HTB bucket lets part of it pass at
  once. That fixed cost is already in the measured unshaped step, so a short probe's efficiency is
  its wire time over what shaping added to it (shaped minus unshaped median, at least MIN_ADDED of
  the wire). Runs recorded before the unshaped probe (2026-12-01) keep each short probe's share of
  the rate, which charges the fixed cost twice.
"""

from __future__ import annotations

import statistics
from typing import Any

from megatron_hybridep.bench import predict as bp
from megatron_hybridep.bench.config import BenchConfig

STEADY_S = bp.STEADY_S  # probes at least this long at the rate see steady-state TCP: their efficiencies are pooled
MIN_ADDED = 0.01  # a short probe's added time, floor as a share of its wire time (noise can make it <= 0)


def steady_efficiency(probes: dict[int, dict[str, float]]) -> float:
    """The pooled share of the rate long all-to-alls get (1 when no probe was long enough)."""
    steady = [v["efficiency"] for v in probes.values() if v["ideal_s"] >= STEADY_S]
    return steady[0] if steady else 1.0


def probe_summary(cfg: BenchConfig, events: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per point, the shaped probe against the configured rate (its wire bytes / rate): ``measured``
    its share of the rate; ``unshaped_s`` and ``added_s`` (shaped - unshaped median) where the run
    probed unshaped too; ``efficiency`` what the prediction uses (module doc)."""
    unshaped = {e["point"]: e["median_s"] for e in events if e["event"] == "probe" and e.get("shaped") is False}
    out: dict[int, dict[str, float]] = {}
    for e in events:
        if e["event"] != "probe" or e.get("shaped") is False or not e["link"]:
            continue
        wire = sum(c["tx_bytes"] for c in e["link"]) / len(e["link"]) / e["repeats"]
        ideal = wire / (cfg.rate_mbit * 1e6 / 8)
        row = {"bytes_per_rank": e["bytes_per_rank"], "median_s": e["median_s"], "wan_mb": wire / 1e6,
               "ideal_s": ideal, "measured": ideal / e["median_s"], "efficiency": ideal / e["median_s"]}
        if e["point"] in unshaped:
            row.update(unshaped_s=unshaped[e["point"]], added_s=e["median_s"] - unshaped[e["point"]])
            if ideal < STEADY_S:
                row["efficiency"] = ideal / max(row["added_s"], MIN_ADDED * ideal)
        out[e["point"]] = row
    steady = [v["measured"] for v in out.values() if v["ideal_s"] >= STEADY_S]
    if steady:
        pooled = statistics.median(steady)
        for v in out.values():
            if v["ideal_s"] >= STEADY_S:
                v["efficiency"] = pooled
    return out


def format_probe(cfg: BenchConfig, probes: dict[int, dict[str, float]]) -> str:
    if not probes:
        return "all-to-all probe: none"

    def part(p: int, v: dict[str, float]) -> str:
        text = f"{cfg.points[p]['tokens']}: {v['median_s'] * 1e3:.1f}/{v['ideal_s'] * 1e3:.1f} ms = {v['measured']:.0%}"
        if "unshaped_s" in v:
            text += f" (unshaped {v['unshaped_s'] * 1e3:.1f} ms: {v['added_s'] * 1e3:+.1f} ms)"
        return text

    parts = [part(p, v) for p, v in sorted(probes.items())]
    pooled = sorted({round(v["efficiency"], 4) for v in probes.values() if v["ideal_s"] >= STEADY_S})
    short = any("unshaped_s" in v for v in probes.values())
    return ("bare gloo all-to-all of each point's EP size on the shaped WAN (median of the repeats / its wire bytes "
            "at the rate = share of the rate it gets): " + ", ".join(parts)
            + (f"; used for the prediction: {pooled[0]:.0%} (median of the probes >= {STEADY_S * 1e3:.0f} ms) at those "
               "points, " if pooled else "; used for the prediction: ")
            + ("each shorter probe's wire over what shaping added to it (the call's fixed cost is in the unshaped "
               "step)" if short else "each shorter probe's own share"))
