"""Max-min fair rates by progressive filling: textbook cases, orbit counts = duplicated flows, and
the max-min characterisation (every flow has a saturated link on which its rate is the largest)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hybridep.sim.maxmin import max_min_rates

from . import reference as ref


def rates(links_of_flow, cap, counts=None, alive=None):
    fl = np.array([f for f, links in enumerate(links_of_flow) for _ in links], dtype=np.int64)
    lk = np.array([k for links in links_of_flow for k in links], dtype=np.int64)
    cnt = np.ones(len(fl)) if counts is None else np.array([c for cs in counts for c in cs], dtype=float)
    alive = np.ones(len(links_of_flow), bool) if alive is None else np.asarray(alive)
    return max_min_rates(alive, fl, lk, cnt, np.asarray(cap, dtype=float))


def test_equal_share_on_one_link():
    r = rates([[0]] * 4, [8.0])
    assert r == pytest.approx([2.0] * 4)


def test_textbook_two_links():
    # f0 crosses both links, f1 only link 0 (cap 1), f2 only link 1 (cap 2): f0 = f1 = 0.5, f2 takes the rest
    r = rates([[0, 1], [0], [1]], [1.0, 2.0])
    assert r == pytest.approx([0.5, 0.5, 1.5])


def test_dead_flows_get_nothing_and_leave_room():
    r = rates([[0], [0]], [4.0], alive=[True, False])
    assert r == pytest.approx([4.0, 0.0])


@st.composite
def incidences(draw):
    n_links = draw(st.integers(1, 5))
    n_flows = draw(st.integers(1, 6))
    flows = [sorted(draw(st.sets(st.integers(0, n_links - 1), min_size=1, max_size=n_links)))
             for _ in range(n_flows)]
    counts = [[draw(st.integers(1, 3)) for _ in f] for f in flows]
    cap = [draw(st.sampled_from([1.0, 2.5, 10.0, 40.0])) for _ in range(n_links)]
    return flows, counts, cap


@settings(max_examples=60, deadline=None)
@given(incidences())
def test_counts_equal_duplicated_flows_and_max_min_holds(case):
    """A class with count c on its links must get the rate of one of c explicit copies of it (what the
    symmetry reduction relies on): checked against plain-Python progressive filling over the copies.
    For arbitrary per-link counts: the max-min characterisation."""
    flows, counts, cap = case
    got = rates(flows, cap, counts)
    uniform = [[c[0]] * len(c) for c in counts]
    got_u = rates(flows, cap, uniform)
    explicit = []
    owner = []
    for f, (links, cs) in enumerate(zip(flows, uniform, strict=True)):
        for _ in range(cs[0]):
            explicit.append([("l", k) for k in links])
            owner.append(f)
    want = ref.max_min(explicit, {("l", k): c for k, c in enumerate(cap)})
    for f in range(len(flows)):
        assert got_u[f] == pytest.approx(want[owner.index(f)], rel=1e-9)
    # max-min characterisation for arbitrary counts: feasible, and each flow has a saturated link on
    # which no other flow gets more
    load = np.zeros(len(cap))
    for f, (links, cs) in enumerate(zip(flows, counts, strict=True)):
        for k, c in zip(links, cs, strict=True):
            load[k] += c * got[f]
    assert np.all(load <= np.asarray(cap) * (1 + 1e-9))
    for f, links in enumerate(flows):
        assert any(load[k] >= cap[k] * (1 - 1e-9)
                   and all(got[g] <= got[f] * (1 + 1e-9) for g, lg in enumerate(flows) if k in lg)
                   for k in links), (f, got)
