"""Brute-force references for the simulator tests: every flow of every rank, plain Python loops, the
groups taken from Plan.domains / Plan.rails (not from the families the simulator uses)."""

from __future__ import annotations

from collections import defaultdict

from megatron_hybridep.plan.grid import coords_of
from megatron_hybridep.plan.topology import Topology


def sibling(topo: Topology, lvl: int, u: int, v: int) -> tuple[float, float]:
    lv = topo.levels[lvl]
    for o in lv.overrides:
        if {o.a, o.b} == {u, v}:
            return o.bandwidth_gbps * 1e9 / 8, o.latency_us * 1e-6
    return lv.bandwidth, lv.latency


def flow_links(topo: Topology, a: int, b: int) -> tuple[list[tuple], dict[tuple, float], float]:
    """Links of the flow a -> b (keys), their capacities, and the flow's latency."""
    n = topo.level_counts
    ca, cb = coords_of(a, n), coords_of(b, n)
    first = next(lvl for lvl in range(len(n)) if ca[lvl] != cb[lvl])
    bw, lat = sibling(topo, first, ca[first], cb[first])
    keys = [("sib", first, ca[:first], ca[first], cb[first])]
    caps = {keys[0]: bw}
    for lvl in range(first, len(n)):
        up = topo.levels[lvl].uplink
        if up is not None:
            for k in (("out", lvl, ca[:lvl + 1]), ("in", lvl, cb[:lvl + 1])):
                keys.append(k)
                caps[k] = up
    return keys, caps, lat


def a2a_flows(groups, nbytes: float) -> list[tuple[int, int, float]]:
    return [(a, b, nbytes) for g in groups for a in g for b in g if a != b]


def ring_flows(groups, nbytes: float) -> list[tuple[int, int, float]]:
    out = []
    for g in groups:
        g = sorted(g)
        if len(g) > 1:
            out += [(g[i], g[(i + 1) % len(g)], nbytes) for i in range(len(g))]
    return out


def max_min(flows: list[list[tuple]], caps: dict[tuple, float]) -> list[float]:
    """Progressive filling over explicit flows (each a list of link keys)."""
    rate = [0.0] * len(flows)
    frozen = [False] * len(flows)
    rem = dict(caps)
    while not all(frozen):
        load = defaultdict(int)
        for i, links in enumerate(flows):
            if not frozen[i]:
                for k in links:
                    load[k] += 1
        delta = min(rem[k] / c for k, c in load.items())
        for i in range(len(flows)):
            if not frozen[i]:
                rate[i] += delta
        full = set()
        for k, c in load.items():
            rem[k] -= delta * c
            if rem[k] <= 1e-9 * caps[k]:
                full.add(k)
        for i, links in enumerate(flows):
            if not frozen[i] and any(k in full for k in links):
                frozen[i] = True
    return rate


def completion(topo: Topology, flows: list[tuple[int, int, float]], ring_steps: int | None = None) -> float:
    """Seconds until every flow of one collective (running alone) has arrived: event-driven max-min,
    a flow done `latency` after its last byte (ring: steps x the worst latency of the collective)."""
    flows = [f for f in flows if f[0] != f[1] and f[2] > 0]
    if not flows:
        return 0.0
    info = [flow_links(topo, a, b) for a, b, _ in flows]
    caps: dict[tuple, float] = {}
    for _, c, _ in info:
        caps.update(c)
    worst = max(lat for _, _, lat in info)
    tails = [ring_steps * worst if ring_steps is not None else lat for _, _, lat in info]
    left = [w for _, _, w in flows]
    done = [None] * len(flows)
    t = 0.0
    while any(d is None for d in done):
        alive = [i for i in range(len(flows)) if done[i] is None]
        rates = max_min([info[i][0] for i in alive], caps)
        dt = min(left[i] / r for i, r in zip(alive, rates, strict=True))
        t += dt
        for i, r in zip(alive, rates, strict=True):
            left[i] -= r * dt
            if left[i] <= 1e-9 * flows[i][2]:
                done[i] = t + tails[i]
    return max(done)
