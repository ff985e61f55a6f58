"""Brute-force references for the plan tests: explicit flows over every world rank, plain loops.

The closed forms in megatron_hybridep/plan/network.py must agree with these on small worlds."""

from __future__ import annotations

import math
from collections import defaultdict

from megatron_hybridep.plan.grid import coords_of
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.topology import Topology


def link(topo: Topology, lvl: int, u: int, v: int) -> tuple[float, float]:
    """(bytes/s, seconds) of the sibling link between coordinates u and v at level l."""
    lv = topo.levels[lvl]
    for o in lv.overrides:
        if {o.a, o.b} == {u, v}:
            return o.bandwidth_gbps * 1e9 / 8, o.latency_us * 1e-6
    return lv.bandwidth, lv.latency


def level_loads(topo: Topology, flows: list[tuple[int, int, float]]) -> list[dict[str, float]]:
    """Per level: busiest sibling link bytes, busiest uplink bytes, bandwidth time, worst latency."""
    n = topo.level_counts
    L = len(n)
    pair = [defaultdict(float) for _ in range(L)]
    egress = [defaultdict(float) for _ in range(L)]
    ingress = [defaultdict(float) for _ in range(L)]
    for a, b, w in flows:
        if a == b or w <= 0:
            continue
        ca, cb = coords_of(a, n), coords_of(b, n)
        first = next(lvl for lvl in range(L) if ca[lvl] != cb[lvl])
        pair[first][(ca[:first], ca[first], cb[first])] += w
        for lvl in range(first, L):
            egress[lvl][ca[: lvl + 1]] += w
            ingress[lvl][cb[: lvl + 1]] += w
    out = []
    for lvl in range(L):
        pair_max = max(pair[lvl].values(), default=0.0)
        pair_time = max((w / link(topo, lvl, u, v)[0] for (_, u, v), w in pair[lvl].items()), default=0.0)
        lat = max((link(topo, lvl, u, v)[1] for (_, u, v) in pair[lvl]), default=0.0)
        up = max(list(egress[lvl].values()) + list(ingress[lvl].values()), default=0.0)
        t = pair_time
        if topo.levels[lvl].uplink is not None and up > 0:
            t = max(t, up / topo.levels[lvl].uplink)
        out.append({"pair": pair_max, "uplink": up, "time": t, "latency": lat})
    return out


def ring_flows(groups: list[list[int]], edge_bytes: float) -> list[tuple[int, int, float]]:
    flows = []
    for g in groups:
        g = sorted(g)
        if len(g) > 1:
            flows += [(g[i], g[(i + 1) % len(g)], edge_bytes) for i in range(len(g))]
    return flows


def ep_groups(topo: Topology, ep_size: int) -> list[list[int]]:
    return [list(range(k * ep_size, (k + 1) * ep_size)) for k in range(topo.world_size // ep_size)]


def world_domains(topo: Topology, plan: Plan) -> list[list[int]]:
    G = plan.ep_size
    return [[base + r for r in d] for base in range(0, topo.world_size, G) for d in plan.domains]


def replica_groups(topo: Topology, ep_size: int) -> list[list[int]]:
    return [list(range(i, topo.world_size, ep_size)) for i in range(ep_size)]


def dc_replica_groups(topo: Topology) -> list[list[int]]:
    per_dc = topo.world_size // topo.level_counts[0]
    return [list(range(i, topo.world_size, per_dc)) for i in range(per_dc)]


def a2a_flows(topo: Topology, plan: Plan, counts: list[list[float]], token_bytes: float,
              use_owner: bool = False) -> list[tuple[int, int, float]]:
    """Token flows of one all-to-all in every EP group. ``counts[r][e]``: tokens from EP rank r to expert e.
    ``use_owner``: plain EP's destinations (the owner), independent of compute_rank."""
    G, E = plan.ep_size, plan.num_experts
    flows = []
    for base in range(0, topo.world_size, G):
        for r in range(G):
            for e in range(E):
                dst = e // (E // G) if use_owner else plan.compute_rank(r, e)
                flows.append((base + r, base + dst, counts[r][e] * token_bytes))
    return flows


def phase(topo: Topology, flows: list[tuple[int, int, float]], rounds: int) -> dict[str, object]:
    """Time of a phase: slowest level + rounds x worst latency (a2a: rounds=1)."""
    levels = level_loads(topo, flows)
    busy = max(lv["time"] for lv in levels)
    latency = rounds * max(lv["latency"] for lv in levels) if busy > 0 else 0.0
    return {"levels": levels, "seconds": busy + latency if busy > 0 else 0.0}


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
