"""Tier (a): the paper's stream model, its closed form, its cases and the rounding to feasible S."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_hybridep.plan.grid import divisors
from megatron_hybridep.plan.paper_model import (
    BALANCE,
    CLAMPED,
    MOVE_ALL,
    PaperModel,
    optimal_p,
    round_domain_size,
    stream_time,
)
from megatron_hybridep.plan.plan import Plan, PlanError
from megatron_hybridep.plan.topology import Topology
from megatron_hybridep.plan.workload import Workload

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRID = np.linspace(0.0, 1.0, 2001)


def brute_min(G, D, P, B, t_pre):
    return min(stream_time(float(p), G, D, P, B, t_pre).total for p in GRID)


def test_stream_time_terms():
    G, D, P, B, t_pre = 8, 4e6, 1e6, 1.25e9, 1e-3
    ep = stream_time(1 - 1 / G, G, D, P, B, t_pre)  # S = 1: plain EP
    # as published, p is continuous: at S = 1 the formula still charges (1 - p) = 1/G of the gather
    assert ep.ag == pytest.approx((G - 1) * P / (G * B))
    assert ep.a2a == pytest.approx(2 * (1 - 1 / G) * (G - 1) * D / (G * B))
    full = stream_time(0.0, G, D, P, B, t_pre)  # S = G: every expert everywhere, no token traffic
    assert full.a2a == 0 and full.ag == pytest.approx((G - 1) * P / B)
    assert full.total == max(t_pre, full.ag)
    with pytest.raises(PlanError, match="p: the all-to-all fraction"):
        stream_time(1.5, G, D, P, B, t_pre)


def test_case_move_all_experts():
    G, P, B = 8, 1e6, 1.25e9
    D = G * P / 2  # 2D == G P: the boundary belongs to this case
    p, case = optimal_p(G, D, P, B, 0.0)
    assert (p, case) == (0.0, MOVE_ALL)
    assert stream_time(0.0, G, D, P, B, 0.0).total <= brute_min(G, D, P, B, 0.0) + 1e-12


def test_case_balance_gathers_exactly_what_t_pre_hides():
    G, D, P, B, t_pre = 8, 1e6, 1e6, 1.25e9, 2e-3
    p, case = optimal_p(G, D, P, B, t_pre)
    assert case == BALANCE and 0 < p < 1
    st_ = stream_time(p, G, D, P, B, t_pre)
    assert st_.ag == pytest.approx(t_pre)  # the defining property of the interior optimum
    assert st_.total <= brute_min(G, D, P, B, t_pre) + 1e-12


def test_case_clamped_at_zero():
    G, D, P, B = 8, 1e6, 1e6, 1.25e9
    t_pre = 2 * (G - 1) * P / B  # compute hides even the gather of every expert
    p, case = optimal_p(G, D, P, B, t_pre)
    assert (p, case) == (0.0, CLAMPED)
    assert stream_time(0.0, G, D, P, B, t_pre).total == pytest.approx(t_pre)


@given(st.sampled_from([2, 4, 6, 8, 12, 16, 32]), st.floats(1e3, 1e9), st.floats(1e3, 1e9),
       st.floats(1e8, 1e11), st.floats(0, 0.5))
@settings(max_examples=150, deadline=None)
def test_closed_form_is_the_minimum_and_rounding_is_the_best_divisor(G, D, P, B, t_pre):
    p, _ = optimal_p(G, D, P, B, t_pre)
    best = stream_time(p, G, D, P, B, t_pre).total
    assert best <= brute_min(G, D, P, B, t_pre) * (1 + 1e-9) + 1e-15
    s = round_domain_size(p, G, D, P, B, t_pre)
    assert G % s == 0
    by_divisor = {d: stream_time(1 - d / G, G, D, P, B, t_pre).total for d in divisors(G)}
    assert by_divisor[s] <= min(by_divisor.values()) * (1 + 1e-12)


def one_level():
    return Topology.from_dict({"levels": [{"name": "gpu", "count": 8, "bandwidth_gbps": 10}]})


@given(st.integers(16, 20000), st.floats(1.0, 60.0))
@settings(max_examples=40, deadline=None)
def test_one_level_model_matches_the_equation_and_the_optimum(tokens, ratio):
    w = Workload(hidden_size=256, ffn_hidden_size=1024, num_experts=16, top_k=2, num_moe_layers=3,
                 seq_length=128, tokens_per_rank=tokens, compression_ratio=ratio)
    model = PaperModel(one_level(), w)
    res = model.optimum(8)
    lv = res.levels[0]
    D, P, B = w.dispatch_bytes, 2 * w.expert_wire_bytes, one_level().levels[0].bandwidth
    assert (res.D, res.P) == (D, P)
    assert lv.p_star == pytest.approx(optimal_p(8, D, P, B, w.t_pre)[0])
    assert res.layer_time == pytest.approx(stream_time(lv.p, 8, D, P, B, w.t_pre).total)
    totals = {s: model.evaluate(Plan.grid((8,), (s,), 16)).total for s in divisors(8)}
    assert totals[lv.s] <= min(totals.values()) * (1 + 1e-12)
    assume(lv.p > 0)
    assert totals[lv.s] == pytest.approx(3 * w.t_pre + 3 * (stream_time(lv.p, 8, D, P, B, w.t_pre).total - w.t_pre))


def test_multi_level_preset_and_errors():
    topo = Topology.from_yaml(os.path.join(ROOT, "configs", "topologies", "4dc_x_8.yaml"))
    w = Workload.from_yaml(os.path.join(ROOT, "configs", "models", "paper-l.yaml"))
    res = PaperModel(topo, w).optimum(32)
    assert [lv.name for lv in res.levels] == ["dc", "gpu"]
    for lv in res.levels:
        assert lv.G % lv.s == 0 and math.isclose(lv.p, 1 - lv.s / lv.G)
    with pytest.raises(PlanError, match="replicated"):
        PaperModel(topo, w).evaluate(Plan.replicated((4, 8), 32))
