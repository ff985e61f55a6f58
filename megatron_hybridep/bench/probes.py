"""The bench's bare all-to-all probe on the shaped WAN: per point, the share of the rate a gloo
all-to-all of EP's size got (what the predictions divide the token all-to-alls by)."""

from __future__ import annotations

import statistics
from typing import Any

from megatron_hybridep.bench import predict as bp
from megatron_hybridep.bench.config import BenchConfig

STEADY_S = bp.STEADY_S  # probes at least this long at the rate see steady-state TCP: their efficiencies are pooled


def steady_efficiency(probes: dict[int, dict[str, float]]) -> float:
    """The pooled share of the rate long all-to-alls get (1 when no probe was long enough)."""
    steady = [v["efficiency"] for v in probes.values() if v["ideal_s"] >= STEADY_S]
    return steady[0] if steady else 1.0


def probe_summary(cfg: BenchConfig, events: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per point, the bare all-to-all probe against the configured rate (its wire bytes / rate).
    ``efficiency`` (what the prediction uses): the median over the probes of at least STEADY_S at
    the rate (one number for steady-state TCP, less noisy than each probe); shorter probes keep their
    own (their time is mostly start-up, which depends on the size). ``measured``: each probe's own."""
    out = {}
    for e in events:
        if e["event"] != "probe" or not e["link"]:
            continue
        wire = sum(c["tx_bytes"] for c in e["link"]) / len(e["link"]) / e["repeats"]
        ideal = wire / (cfg.rate_mbit * 1e6 / 8)
        out[e["point"]] = {"bytes_per_rank": e["bytes_per_rank"], "median_s": e["median_s"], "wan_mb": wire / 1e6,
                           "ideal_s": ideal, "measured": ideal / e["median_s"], "efficiency": ideal / e["median_s"]}
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
    parts = [f"{cfg.points[p]['tokens']}: {v['median_s'] * 1e3:.0f}/{v['ideal_s'] * 1e3:.0f} ms = {v['measured']:.0%}"
             for p, v in sorted(probes.items())]
    pooled = sorted({round(v["efficiency"], 4) for v in probes.values() if v["ideal_s"] >= STEADY_S})
    return ("bare gloo all-to-all of each point's EP size on the shaped WAN (median of the repeats / its wire bytes "
            "at the rate = share of the rate it gets): " + ", ".join(parts)
            + (f"; used for the prediction: {pooled[0]:.0%} (median of the probes >= {STEADY_S * 1e3:.0f} ms) at those "
               "points, each shorter probe's own elsewhere" if pooled else ""))
