"""Done-when (a): where the paper's assumptions hold (balanced routing, one level, no latency) the
simulated forward time of a MoE layer agrees with the closed-form stream model within 1%.

Setup: G ranks on one level, each behind its own link of bandwidth B (the paper's B), the paper's
schedule (layer l's gather starts with its T_pre and is waited for before the dispatch), forward only.
- Against the stream model with the bytes an all-gather ((S-1)P) and an all-to-all (pD) really move:
  equal for every G, S, B, D, P, T_pre (up to float rounding).
- Against the paper's T(p) verbatim (plan/paper_model.stream_time): it charges the gather
  (1-p)(G-1)P = S(G-1)P/G and the all-to-all p(G-1)D/G, so it is exact for S = G and within
  1/(G-1) of the truth otherwise when the gather hides behind T_pre: within 1% for G >= 101.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hybridep.plan.grid import divisors
from megatron_hybridep.plan.paper_model import stream_time
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.sim.schedule import SimOptions
from megatron_hybridep.sim.simulate import simulate
from megatron_hybridep.sim.validate import stream_model_exact

from .helpers import one_level, workload

PAPER = SimOptions(schedule="paper", backward=False)


def layer(G, S, gbps, t_pre_ms, tokens, ratio):
    topo = one_level(G, gbps)
    w = workload(G, tokens_per_rank=tokens, t_pre_ms=t_pre_ms, compression_ratio=ratio, num_moe_layers=3,
                 throughput_tflops=1e9)  # expert compute ~0: the paper's T(p) has none
    r = simulate(topo, w, Plan.grid((G,), (S,), G), options=PAPER)
    D, P, B = w.dispatch_bytes, w.expert_wire_bytes, gbps * 1e9 / 8
    expert = w.tokens * w.top_k * w.expert_seconds_per_token
    return r.layer_forward(1) - expert, D, P, B, w.t_pre


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 250, 1000]), st.data(),
       st.sampled_from([0.5, 1.0, 10.0, 100.0]), st.floats(0.0, 50.0), st.sampled_from([256, 1024, 4096]),
       st.sampled_from([1.0, 10.0, 50.0, 200.0]))
def test_agrees_with_the_stream_model(G, data, gbps, t_pre_ms, tokens, ratio):
    S = data.draw(st.sampled_from(divisors(G)))
    sim, D, P, B, t_pre = layer(G, S, gbps, t_pre_ms, tokens, ratio)
    want = stream_model_exact(G, S, D, P, B, t_pre)
    assert sim == pytest.approx(want, rel=1e-6)  # well inside 1%


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([101, 128, 250, 500, 1000]), st.data(), st.sampled_from([1.0, 10.0, 100.0]),
       st.sampled_from([1024, 4096]))
def test_agrees_with_the_papers_formula_within_1_percent(G, data, gbps, tokens):
    S = data.draw(st.sampled_from(divisors(G)))
    # enough T_pre to hide the paper's gather term (its S(G-1)P/G over-counts (S-1)P unless S = G)
    _, D, P, B, _ = layer(G, S, gbps, 0.0, tokens, 50.0)
    t_pre = 1.01 * S * P / B
    sim, D, P, B, t_pre = layer(G, S, gbps, t_pre * 1e3, tokens, 50.0)
    paper = stream_time(1 - S / G, G, D, P, B, t_pre).total
    assert sim == pytest.approx(paper, rel=0.01)


@pytest.mark.parametrize("G", [4, 16, 64])
def test_move_all_experts_is_exact_for_any_size(G):
    """S = G (p = 0): no tokens move, the gather is the paper's (G-1)P/B exactly, exposed or not."""
    for t_pre_ms in (0.0, 1000.0):
        sim, D, P, B, t_pre = layer(G, G, 10.0, t_pre_ms, 2048, 20.0)
        assert sim == pytest.approx(stream_time(0.0, G, D, P, B, t_pre).total, rel=1e-9)


def test_the_1_percent_band_is_tight_enough_to_fail():
    """The check can fail: with latency the simulated layer is off the latency-free closed form."""
    G, S = 128, 8
    topo = one_level(G, 10.0, latency_us=2000.0)
    w = workload(G, compression_ratio=50.0, throughput_tflops=1e9, num_moe_layers=3)
    r = simulate(topo, w, Plan.grid((G,), (S,), G), options=PAPER)
    sim = r.layer_forward(1) - w.tokens * w.top_k * w.expert_seconds_per_token
    want = stream_model_exact(G, S, w.dispatch_bytes, w.expert_wire_bytes, 10e9 / 8, w.t_pre)
    assert abs(sim / want - 1) > 0.01
