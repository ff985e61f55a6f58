"""Flow classes: the symmetry reduction is exact, the groups are the plan's, the link model is
plan/network.py's, and one collective alone finishes when a brute-force flow simulation says."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hybridep.plan.grid import divisors
from megatron_hybridep.plan.network import Family, Network, domain_family, rail_family, world_domain_sizes
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.topology import Topology
from megatron_hybridep.sim.flows import A2A, RING, Collective, Space
from megatron_hybridep.sim.simulate import simulate

from ..plan.strategies import topologies
from . import reference as ref
from .helpers import block_time, two_level, workload


def _explicit_pairs(space: Space, coll: Collective) -> set[tuple[int, int]]:
    """(src, dst) ranks of every flow when no symmetry is used (periods = counts)."""
    fs = Space(space.levels, space.counts, space.counts)
    src, dst = fs._family_flows(coll)
    pv = np.cumprod((1,) + space.counts[::-1])[:-1][::-1]
    rank = lambda c: (c * pv).sum(axis=1)  # noqa: E731
    return {(int(a), int(b)) for a, b in zip(rank(src), rank(dst), strict=True) if a != b}


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_families_are_the_plans_groups(data):
    """The a2a family moves tokens exactly between the members of each of Plan.rails, the ring goes
    round each of Plan.domains in rank order: the simulator's groups are the runtime's."""
    counts = tuple(data.draw(st.lists(st.integers(2, 5), min_size=1, max_size=3)))
    sizes = tuple(data.draw(st.sampled_from(divisors(n))) for n in counts)
    plan = Plan.grid(counts, sizes, math.prod(counts))
    topo = Topology.from_dict({"levels": [{"name": f"l{i}", "count": n, "bandwidth_gbps": 1}
                                          for i, n in enumerate(counts)]})
    lay = topo.ep_layout(plan.ep_size)
    S = world_domain_sizes(lay, plan.domain_sizes)
    space = Space(topo.levels, topo.level_counts)
    rails = _explicit_pairs(space, Collective("x", A2A, rail_family(lay, S), 1.0))
    assert rails == {(a, b) for r in plan.rails for a in r for b in r if a != b}
    ring = _explicit_pairs(space, Collective("x", RING, domain_family(lay, S), 1.0))
    want = {(d[i], d[(i + 1) % len(d)]) for d in plan.domains if len(d) > 1 for i in range(len(d))}
    assert ring == want


def test_periods():
    n = (8, 4)
    assert Collective("a", A2A, Family((8, 4), (1, 1)), 1.0).periods(n) == (1, 1)        # one block: any shift
    assert Collective("a", A2A, Family((4, 1), (2, 1)), 1.0).periods(n) == (1, 1)        # rails over one block
    assert Collective("a", A2A, Family((2, 1), (1, 1)), 1.0).periods(n) == (2, 1)        # blocks of 2
    assert Collective("r", RING, Family((8, 4), (1, 1)), 1.0).periods(n) == (1, 4)       # ring: inner level fixed
    assert Collective("r", RING, Family((2, 1), (1, 1)), 1.0).periods(n) == (2, 1)
    over = two_level(8, 4, overrides=())
    assert Space(over.levels, over.level_counts, (1, 1)).periods == (1, 1)
    from megatron_hybridep.plan.topology import LinkOverride
    slow = two_level(8, 4, overrides=(LinkOverride(0, 7, 1.0, 0.0),))
    assert Space(slow.levels, slow.level_counts, (1, 1)).periods == (8, 1)               # overrides: no shift


def test_plain_ep_over_1000_dcs_is_one_rank_of_classes():
    """8000 ranks, 64 million flows: one representative, 7999 classes; bytes per level exact."""
    topo = two_level(1000, 8)
    fam = Family((1000, 8), (1, 1))
    coll = Collective("ep", A2A, fam, 1e6)
    space = Space(topo.levels, topo.level_counts, Space.periods_for([coll], topo.level_counts))
    fs = space.flows(coll)
    space.finalize()
    assert space.reps == 1 and fs.size == 7999
    assert fs.level_bytes[0] == pytest.approx(999 * 8 * 1e6) and fs.level_bytes[1] == pytest.approx(7 * 1e6)
    # the DC uplink carries all 8 GPUs' cross-DC traffic, as plan/network.py says
    assert fs.uplink_bytes[0] == pytest.approx(Network(topo).a2a(fam, 1e6).uplink_bytes[0])


@settings(max_examples=30, deadline=None)
@given(topologies(max_ranks=24), st.data())
def test_one_collective_matches_brute_force(topo, data):
    """Token all-to-all over the rails and the ring gather over the domains, each alone, against an
    event-driven max-min simulation of every explicit flow (groups from Plan.rails / Plan.domains)."""
    G = topo.world_size
    lay = topo.ep_layout(G)
    sizes = tuple(data.draw(st.sampled_from(divisors(n))) for n in lay.counts)
    E = G * 2
    plan = Plan("domains", lay.names, lay.counts, sizes, E)
    w = workload(E, compression_ratio=4.0)
    pair = w.dispatch_bytes * plan.domain_size / G
    want = ref.completion(topo, ref.a2a_flows(plan.rails, pair))
    assert block_time(topo, w, plan, "dispatch") == pytest.approx(want, rel=1e-7, abs=1e-15)
    S = plan.domain_size
    edge = (S - 1) * (E // G) * w.expert_wire_bytes
    want = ref.completion(topo, ref.ring_flows(plan.domains, edge), ring_steps=S - 1)
    assert block_time(topo, w, plan, "gather") == pytest.approx(want, rel=1e-7, abs=1e-15)


@settings(max_examples=25, deadline=None)
@given(topologies(max_ranks=32), st.data())
def test_symmetry_reduction_is_exact(topo, data):
    """A whole iteration (two micro-batches, all collectives, several EP groups, world-level
    all-reduce) with and without the reduction by translation symmetry."""
    ep = data.draw(st.sampled_from(topo.feasible_ep_sizes()))
    lay = topo.ep_layout(ep)
    E = ep * 2
    if lay.spans_dcs and len(lay.counts) > 1 and data.draw(st.booleans()):
        plan = Plan.replicated(lay.counts, E, lay.names)
    else:
        plan = Plan("domains", lay.names, lay.counts,
                    tuple(data.draw(st.sampled_from(divisors(n))) for n in lay.counts), E)
    w = workload(E, micro_batches=2, compression_ratio=8.0, shared_sync_bytes_per_layer=1e5)
    a = simulate(topo, w, plan)
    b = simulate(topo, w, plan, symmetry=False)
    assert a.total == pytest.approx(b.total, rel=1e-9)
    for k in a.phases:
        assert a.phases[k] == pytest.approx(b.phases[k], rel=1e-9, abs=1e-12)
