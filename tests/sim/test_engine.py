"""The event-driven executor: compute and collectives overlap, links are shared while both run, the
memo never changes a result."""

from __future__ import annotations

import pytest

from megatron_hybridep.plan.network import Family
from megatron_hybridep.sim.engine import BLOCK, COMPUTE, START, WAIT, Engine, Instr
from megatron_hybridep.sim.flows import A2A, RING, Collective, Space

from .helpers import one_level

G, GBPS = 4, 8.0
B = GBPS * 1e9 / 8


def engine(*colls, memo=True):
    topo = one_level(G, GBPS)
    space = Space(topo.levels, topo.level_counts, Space.periods_for(colls, topo.level_counts))
    sets = [space.flows(c) for c in colls]
    space.finalize()
    return Engine(sets, space.link_cap, memo=memo)


A2A_1MB = Collective("a2a", A2A, Family((G,), (1,)), 1e6)      # 3 MB leave every rank
RING_2MB = Collective("ring", RING, Family((G,), (1,)), 2e6, 3)  # 2 MB leave every rank


def test_blocking_alone_takes_bytes_over_bandwidth():
    t = engine(A2A_1MB).run([Instr(BLOCK, "x", op="a2a")]).total
    assert t == pytest.approx(3e6 / B)


def test_async_collective_hides_behind_compute():
    e = engine(RING_2MB)
    comm = 2e6 / B
    for compute in (0.5 * comm, 2 * comm):
        tr = e.run([Instr(START, "g", op="ring", key="k"), Instr(COMPUTE, "c", seconds=compute),
                    Instr(WAIT, "g", op="k")])
        assert tr.total == pytest.approx(max(compute, comm))
        assert tr.exposed["g"] == pytest.approx(max(0.0, comm - compute))


def test_concurrent_collectives_share_the_link():
    """Both leave through the same per-rank link: max-min gives the a2a's 3 flows 3/4 of it until it is
    done, the ring the rest; the link never idles, so the later one ends at (3 + 2) MB / B."""
    tr = engine(A2A_1MB, RING_2MB).run([Instr(START, "g", op="ring", key="k"), Instr(BLOCK, "a", op="a2a"),
                                        Instr(WAIT, "g", op="k")])
    a2a_alone = 3e6 / B
    assert tr.exposed["a"] == pytest.approx(a2a_alone / 0.75)  # slowed by the gather
    assert tr.total == pytest.approx(5e6 / B)


def test_latency_tail_after_the_last_byte():
    topo = one_level(G, GBPS, latency_us=100.0)
    ring = Collective("ring", RING, Family((G,), (1,)), 2e6, 3)
    space = Space(topo.levels, topo.level_counts, (1,))
    sets = [space.flows(ring), space.flows(A2A_1MB)]
    space.finalize()
    e = Engine(sets, space.link_cap)
    assert e.run([Instr(BLOCK, "r", op="ring")]).total == pytest.approx(2e6 / B + 3 * 100e-6)
    assert e.run([Instr(BLOCK, "a", op="a2a")]).total == pytest.approx(3e6 / B + 100e-6)


def test_memo_changes_nothing():
    prog = []
    for layer in range(5):
        prog += [Instr(START, "g", op="ring", key=f"k{layer}"), Instr(COMPUTE, "c", seconds=1e-4 * (layer % 2 + 1)),
                 Instr(BLOCK, "a", op="a2a"), Instr(WAIT, "g", op=f"k{layer}"), Instr(COMPUTE, "c", seconds=5e-5)]
    with_memo = engine(A2A_1MB, RING_2MB).run(prog * 3)
    without = engine(A2A_1MB, RING_2MB, memo=False).run(prog * 3)
    assert with_memo.stats.memo_hits > 0 and without.stats.memo_hits == 0
    assert with_memo.total == pytest.approx(without.total, rel=1e-9)
    assert [s.end for s in with_memo.spans] == pytest.approx([s.end for s in without.spans], rel=1e-9)
