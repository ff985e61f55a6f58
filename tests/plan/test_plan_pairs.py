"""Algorithm 1 (pair classification) reproduces Table VII and agrees with the plan's domains and rails."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings

from megatron_hybridep.plan.grid import divisors
from megatron_hybridep.plan.pairs import PairKind, classify_pair, count_pairs, pair_matrix, table_vii
from megatron_hybridep.plan.plan import Plan, PlanError

from .strategies import grids


@pytest.mark.parametrize("G", [8, 16, 32])
def test_table_vii_counts_by_brute_force(G):
    for S in divisors(G):
        m = pair_matrix((G,), (S,), 0)
        a2a, ag = int((m == 2).sum()), int((m == 1).sum())
        assert (a2a, ag) == (G * (G // S - 1), G * (S - 1))
        assert (a2a, ag) == table_vii(G)[S]
        assert count_pairs((G,), (S,))[0] == {PairKind.AG: ag, PairKind.A2A: a2a}


def test_table_vii_g8_row_as_printed_in_the_paper():
    G = 8
    got = {S: (int((pair_matrix((G,), (S,), 0) == 2).sum()), int((pair_matrix((G,), (S,), 0) == 1).sum()))
           for S in (1, 2, 4, 8)}
    assert got == {1: (56, 0), 2: (24, 8), 4: (8, 24), 8: (0, 56)}


@given(grids(max_ranks=36))
@settings(max_examples=40, deadline=None)
def test_classification_agrees_with_domains_and_rails(grid):
    counts, sizes = grid
    plan = Plan.grid(counts, sizes, math.prod(counts))
    G = plan.ep_size
    ag_graph = np.zeros((G, G), dtype=bool)
    a2a_graph = np.zeros((G, G), dtype=bool)
    closed = count_pairs(counts, sizes)
    for lvl in range(len(counts)):
        m = pair_matrix(counts, sizes, lvl)
        assert int((m == 1).sum()) == closed[lvl][PairKind.AG]
        assert int((m == 2).sum()) == closed[lvl][PairKind.A2A]
        for a, b in zip(*np.nonzero(m), strict=True):
            kind = classify_pair(counts, sizes, int(a), int(b), lvl)
            assert kind == (PairKind.AG if m[a, b] == 1 else PairKind.A2A)
            if kind == PairKind.AG:
                assert b in plan.domain_of(int(a))
            else:
                assert b in plan.rail_of(int(a))
        ag_graph |= m == 1
        a2a_graph |= m == 2
    assert _components(ag_graph) == sorted(plan.domains)
    assert _components(a2a_graph) == sorted(plan.rails)


def _components(adj: np.ndarray) -> list[tuple[int, ...]]:
    seen, out = set(), []
    for start in range(len(adj)):
        if start in seen:
            continue
        stack, comp = [start], set()
        while stack:
            x = stack.pop()
            if x in comp:
                continue
            comp.add(x)
            stack.extend(int(y) for y in np.nonzero(adj[x])[0])
        seen |= comp
        out.append(tuple(sorted(comp)))
    return sorted(out)


def test_coordinates_above_the_level_must_match():
    # 2 DCs x 4 GPUs, S = (1, 2): rank 0 = (dc0, gpu0), rank 5 = (dc1, gpu1). The GPU coordinates share a
    # block and nothing lies below the GPU level, so the paper's check alone would call this an AG pair,
    # yet the ranks are in different domains (different DC blocks with S_dc = 1).
    counts, sizes = (2, 4), (1, 2)
    plan = Plan.grid(counts, sizes, 8)
    assert 5 not in plan.domain_of(0)
    assert classify_pair(counts, sizes, 0, 5, 1) == PairKind.NONE
    assert classify_pair(counts, sizes, 0, 1, 1) == PairKind.AG
    assert classify_pair(counts, sizes, 0, 2, 1) == PairKind.A2A
    assert classify_pair(counts, sizes, 0, 4, 0) == PairKind.A2A
    assert classify_pair(counts, sizes, 0, 0, 0) == PairKind.NONE


def test_pair_errors():
    with pytest.raises(PlanError, match="divide"):
        count_pairs((4,), (3,))
    with pytest.raises(PlanError, match="out of range"):
        classify_pair((4,), (2,), 0, 4, 0)
