"""Hypothesis strategies shared by the plan tests: small worlds, EP sizes and plans."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from megatron_hybridep.plan.grid import divisors
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.topology import Level, LinkOverride, Topology


@st.composite
def grids(draw, max_levels: int = 3, max_count: int = 6, max_ranks: int = 48):
    """(level_counts, domain_sizes) of a plan grid."""
    n_levels = draw(st.integers(1, max_levels))
    counts = []
    for _ in range(n_levels):
        room = max_ranks // max(1, math.prod(counts))
        counts.append(draw(st.integers(1, max(1, min(max_count, room)))))
    sizes = [draw(st.sampled_from(divisors(n))) for n in counts]
    return tuple(counts), tuple(sizes)


@st.composite
def plans(draw, max_ranks: int = 48):
    counts, sizes = draw(grids(max_ranks=max_ranks))
    G = math.prod(counts)
    E = G * draw(st.integers(1, 3))
    return Plan.grid(counts, sizes, E)


@st.composite
def topologies(draw, max_ranks: int = 64, overrides: bool = True):
    n_levels = draw(st.integers(1, 3))
    levels = []
    prod = 1
    for i in range(n_levels):
        n = draw(st.integers(1, max(1, min(6, max_ranks // prod))))
        prod *= n
        over = []
        if overrides and n >= 2 and draw(st.booleans()):
            pairs = draw(st.sets(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1))
                                 .filter(lambda p: p[0] < p[1]), max_size=3))
            over = [LinkOverride(a, b, draw(st.sampled_from([0.5, 2.0, 40.0])),
                                 draw(st.sampled_from([1.0, 50.0, 5000.0]))) for a, b in sorted(pairs)]
        levels.append(Level(f"l{i}", n, draw(st.sampled_from([1.0, 10.0, 100.0])),
                            draw(st.sampled_from([0.0, 5.0, 100.0])),
                            draw(st.sampled_from([None, 5.0, 50.0])), tuple(over)))
    return Topology(tuple(levels), name="hyp")


@st.composite
def topology_and_plan(draw, max_ranks: int = 48, replicated: bool = True):
    """A topology, an EP size that fits it, and a plan (domains or replicated) for that EP group."""
    topo = draw(topologies(max_ranks=max_ranks))
    ep = draw(st.sampled_from(topo.feasible_ep_sizes()))
    lay = topo.ep_layout(ep)
    E = ep * draw(st.integers(1, 2))
    if replicated and lay.spans_dcs and len(lay.counts) > 1 and draw(st.booleans()):
        return topo, Plan.replicated(lay.counts, E, lay.names)
    sizes = tuple(draw(st.sampled_from(divisors(n))) for n in lay.counts)
    return topo, Plan("domains", lay.names, lay.counts, sizes, E)
