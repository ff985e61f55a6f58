"""Tier (b): the closed-form link model against brute-force flows, and the cost model's behaviour."""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hybridep.plan.cost import PHASES, CostModel
from megatron_hybridep.plan.network import (
    Network,
    dc_replica_family,
    domain_family,
    rail_family,
    replica_family,
    world_domain_sizes,
)
from megatron_hybridep.plan.plan import Plan, PlanError
from megatron_hybridep.plan.topology import Level, LinkOverride, Topology
from megatron_hybridep.plan.workload import GLOO_CALL_MS, Workload

from . import reference as ref
from .strategies import topology_and_plan


def assert_phase_matches(got, want):
    for lvl, lv in enumerate(want["levels"]):
        assert ref.close(got.pair_bytes[lvl], lv["pair"]), (lvl, got.pair_bytes, lv)
        assert ref.close(got.uplink_bytes[lvl], lv["uplink"]), (lvl, got.uplink_bytes, lv)
        assert ref.close(got.level_seconds[lvl], lv["time"]), (lvl, got.level_seconds, lv)
    assert ref.close(got.seconds, want["seconds"]), (got, want["seconds"])


@given(topology_and_plan(), st.sampled_from([1.0, 3.5e6]))
@settings(max_examples=70, deadline=None)
def test_closed_forms_match_brute_force_flows(tp, nbytes):
    topo, plan = tp
    net, lay = Network(topo), topo.ep_layout(plan.ep_size)
    S = world_domain_sizes(lay, plan.domain_sizes)
    world_rails = [[base + r for r in rail] for base in range(0, topo.world_size, plan.ep_size)
                   for rail in plan.rails]
    flows = [(a, b, nbytes) for g in world_rails for a in g for b in g if a != b]
    assert_phase_matches(net.a2a(rail_family(lay, S), nbytes), ref.phase(topo, flows, 1))
    doms = ref.world_domains(topo, plan)
    M = plan.domain_size
    assert_phase_matches(net.ring(domain_family(lay, S), nbytes, M - 1),
                         ref.phase(topo, ref.ring_flows(doms, nbytes), M - 1))
    k = topo.world_size // plan.ep_size
    assert_phase_matches(net.ring(replica_family(topo, lay), nbytes, 2 * (k - 1)),
                         ref.phase(topo, ref.ring_flows(ref.replica_groups(topo, plan.ep_size), nbytes),
                                   2 * (k - 1)))
    n0 = topo.level_counts[0]
    assert_phase_matches(net.ring(dc_replica_family(topo), nbytes, n0 - 1),
                         ref.phase(topo, ref.ring_flows(ref.dc_replica_groups(topo), nbytes), n0 - 1))


@given(topology_and_plan(max_ranks=24), st.integers(0, 2**32 - 1))
@settings(max_examples=50, deadline=None)
def test_explicit_flows_match_brute_force(tp, seed):
    topo, plan = tp
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 50, size=(plan.ep_size, plan.num_experts)).astype(float)
    net, lay = Network(topo), topo.ep_layout(plan.ep_size)
    dst = plan.compute_ranks().ravel()
    src = np.repeat(np.arange(plan.ep_size), plan.num_experts)
    got = net.flows(lay, src, dst, counts.ravel() * 7.0)
    assert_phase_matches(got, ref.phase(topo, ref.a2a_flows(topo, plan, counts.tolist(), 7.0), 1))


def workload(**kw):
    base = dict(hidden_size=128, ffn_hidden_size=256, num_experts=16, top_k=2, num_moe_layers=3,
                seq_length=256, tokens_per_rank=512)
    base.update(kw)
    return Workload(**base)


def paper_topo(dcs=2, gpus=8, dc_uplink=10.0):
    return Topology((Level("dc", dcs, 10.0, 100.0, dc_uplink), Level("gpu", gpus, 128.0, 5.0, 128.0)))


@given(topology_and_plan(max_ranks=32), st.integers(1, 3))
@settings(max_examples=50, deadline=None)
def test_s1_predicts_plain_ep_traffic_exactly(tp, experts_per_rank):
    topo, _ = tp
    ep = _ep_size(topo)
    lay = topo.ep_layout(ep)
    E = ep * experts_per_rank
    w = workload(num_experts=E, top_k=1)
    plan = Plan("domains", lay.names, lay.counts, (1,) * len(lay.counts), E)
    model = CostModel(topo, w)
    (a2a,), _ = model.token_a2a(plan, lay)
    per_expert = w.tokens * w.top_k / E
    flows = ref.a2a_flows(topo, plan, [[per_expert] * E] * ep, w.token_bytes, use_owner=True)
    assert_phase_matches(a2a, ref.phase(topo, flows, 1))
    cost = model.evaluate(plan)
    assert cost.raw["expert_allgather"] == cost.raw["grad_return"] == cost.raw["shared_sync"] == 0
    assert cost.phases["expert_allgather"] == cost.phases["grad_return"] == 0
    assert cost.memory.borrowed_weights == 0


def _ep_size(topo):
    return max(topo.feasible_ep_sizes())


@given(topology_and_plan(max_ranks=32))
@settings(max_examples=50, deadline=None)
def test_uniform_routing_matrix_equals_balanced_closed_form(tp):
    topo, plan = tp
    w = workload(num_experts=plan.num_experts, top_k=1, compression_ratio=4.0)
    balanced = CostModel(topo, w).evaluate(plan)
    uniform = np.full((plan.ep_size, plan.num_experts), w.tokens * w.top_k / plan.num_experts)
    skewed_path = CostModel(topo, w.replace(routing_counts=uniform)).evaluate(plan)
    assert skewed_path.total == pytest.approx(balanced.total, rel=1e-9)
    for phase in PHASES:
        assert skewed_path.phases[phase] == pytest.approx(balanced.phases[phase], rel=1e-9, abs=1e-15)
    for a, b in zip(skewed_path.levels, balanced.levels, strict=True):
        assert a.link_bytes == pytest.approx(b.link_bytes) and a.uplink_bytes == pytest.approx(b.uplink_bytes)


def test_phases_sum_to_total_and_breakdown_shapes():
    topo = paper_topo(4)
    cost = CostModel(topo, workload(num_experts=32)).evaluate(Plan.grid((4, 8), (2, 2), 32))
    assert set(cost.phases) == set(PHASES)
    assert cost.total == pytest.approx(sum(cost.phases.values()))
    assert [lv.name for lv in cost.levels] == ["dc", "gpu"]
    assert set(cost.link_bytes()) == {"dc.link", "dc.uplink", "gpu.link", "gpu.uplink"}
    assert cost.predicted()["total"] == cost.total


def test_four_dcs_with_dc_domains_send_no_token_across_dcs():
    topo = paper_topo(4)
    lay = topo.ep_layout(32)
    model = CostModel(topo, workload(num_experts=32))
    (hybrid,), _ = model.token_a2a(Plan.grid((4, 8), (4, 1), 32), lay)
    (ep,), _ = model.token_a2a(Plan.grid((4, 8), (1, 1), 32), lay)
    assert hybrid.pair_bytes[0] == hybrid.uplink_bytes[0] == 0
    assert ep.pair_bytes[0] > 0 and ep.uplink_bytes[0] > 0
    assert hybrid.seconds < ep.seconds


def test_dc_uplink_contention():
    w = workload(num_experts=32)
    plan = Plan.grid((4, 8), (1, 1), 32)
    shared = CostModel(paper_topo(4, 8, dc_uplink=10.0), w).evaluate(plan)
    dedicated = CostModel(paper_topo(4, 8, dc_uplink=None), w).evaluate(plan)
    fat = CostModel(paper_topo(4, 8, dc_uplink=80.0), w).evaluate(plan)
    # all 8 GPUs of a DC send to 3 other DCs through one 10 Gbit/s uplink: it carries 3x what any
    # DC-to-DC link carries, so it is the bottleneck
    assert shared.phases["token_a2a_fwd"] > dedicated.phases["token_a2a_fwd"]
    assert shared.levels[0].seconds["token_a2a"] == pytest.approx(3 * dedicated.levels[0].seconds["token_a2a"])
    assert fat.phases["token_a2a_fwd"] == pytest.approx(dedicated.phases["token_a2a_fwd"])
    # more GPUs behind the same uplink (same tokens per GPU): slower
    bigger = CostModel(paper_topo(4, 16, dc_uplink=10.0), w.replace(num_experts=64)).evaluate(
        Plan.grid((4, 16), (1, 1), 64))
    assert bigger.raw["a2a"] > shared.raw["a2a"]


def test_pair_overrides_slow_only_the_plans_that_use_the_pair():
    w = workload(num_experts=32, compression_ratio=10.0)
    base = Topology((Level("dc", 4, 10.0, 100.0, None), Level("gpu", 8, 128.0, 5.0, 128.0)))
    slow02 = dataclasses.replace(base, levels=(dataclasses.replace(
        base.levels[0], overrides=(LinkOverride(0, 2, 1.0, 100.0),)),) + base.levels[1:])
    plan = Plan.grid((4, 8), (2, 1), 32)  # domains {DC0, DC1} and {DC2, DC3}; rails pair DC0-DC2, DC1-DC3
    a, b = CostModel(base, w).evaluate(plan), CostModel(slow02, w).evaluate(plan)
    assert b.raw["a2a"] > a.raw["a2a"]  # tokens cross the slow DC0-DC2 link
    assert b.raw["expert_allgather"] == pytest.approx(a.raw["expert_allgather"])  # gathers never do
    slow01 = dataclasses.replace(base, levels=(dataclasses.replace(
        base.levels[0], overrides=(LinkOverride(1, 0, 1.0, 100.0),)),) + base.levels[1:])
    c = CostModel(slow01, w).evaluate(plan)
    assert c.raw["a2a"] == pytest.approx(a.raw["a2a"])
    assert c.raw["expert_allgather"] > a.raw["expert_allgather"]


def test_latency_counts_once_per_all_to_all_and_per_ring_step():
    topo = Topology((Level("dc", 2, 1e9, 1000.0), Level("gpu", 4, 1e9, 10.0)))  # bandwidth ~ free
    model = CostModel(topo, workload(num_experts=8))
    cost = model.evaluate(Plan.grid((2, 4), (1, 4), 8))  # rails cross DCs, domains inside a DC
    assert cost.raw["a2a"] == pytest.approx(1000e-6, rel=1e-3)
    assert cost.raw["expert_allgather"] == pytest.approx(3 * 10e-6, rel=1e-3)


def test_a_collective_call_costs_its_fixed_overhead_once_when_asked_for():
    """A fixed cost per call (gloo ranks sharing cores: GLOO_CALL_MS) counts once per collective that
    moves bytes, not per ring step; none by default on either backend. A plan whose domain spans the
    EP group makes no token all-to-all and pays none of those calls."""
    topo = Topology((Level("dc", 2, 1e9, 0.0), Level("gpu", 4, 1e9, 0.0)))  # bandwidth ~ free, no latency
    rails = Plan.grid((2, 4), (1, 4), 8)
    gloo = CostModel(topo, workload(num_experts=8, backend="gloo", collective_overhead_ms=GLOO_CALL_MS)).evaluate(rails)
    call = GLOO_CALL_MS * 1e-3
    assert gloo.raw["a2a"] == pytest.approx(call, rel=1e-3)
    assert gloo.raw["expert_allgather"] == pytest.approx(call, rel=1e-3)  # a ring of 3 steps: one call
    assert gloo.phases["token_a2a_fwd"] == pytest.approx(2 * 3 * call, rel=1e-3)  # 2 per layer, 3 layers
    for backend in ("nccl", "gloo"):  # not priced unless asked for
        assert CostModel(topo, workload(num_experts=8, backend=backend)).evaluate(rails).raw["a2a"] < 1e-6
    set_ = CostModel(topo, workload(num_experts=8, collective_overhead_ms=0.5)).evaluate(rails)
    assert set_.raw["a2a"] == pytest.approx(0.5e-3, rel=1e-3)
    full = CostModel(topo, workload(num_experts=8, collective_overhead_ms=GLOO_CALL_MS)).evaluate(
        Plan.grid((2, 4), (2, 4), 8))
    assert full.phases["token_a2a_fwd"] == full.phases["token_a2a_bwd"] == 0.0
    with pytest.raises(PlanError, match="collective_overhead_ms"):
        workload(collective_overhead_ms=-1.0)


def test_skewed_routing_is_spread_over_domain_copies():
    topo = paper_topo(1, 8)
    E, G = 16, 8
    counts = np.full((G, E), 10.0)
    counts[:, 3] = 500.0  # one hot expert, owned by rank 1
    w = workload(num_experts=E, routing_counts=counts)
    model = CostModel(topo, w)
    lay = topo.ep_layout(G)
    _, ep_load = model.token_a2a(Plan.grid((8,), (1,), E), lay)
    _, hybrid_load = model.token_a2a(Plan.grid((8,), (8,), E), lay)
    assert ep_load[0] == counts[:, 2:4].sum()  # rank 1 computes experts 2 and 3 for everyone
    assert hybrid_load[0] == counts[0].sum()  # with every expert everywhere each rank computes its own
    ep = model.evaluate(Plan.grid((8,), (1,), E))
    full = model.evaluate(Plan.grid((8,), (8,), E))
    assert full.phases["expert_compute"] < ep.phases["expert_compute"]


def test_memory_of_replicated_experts_and_domains():
    topo = paper_topo(2, 8)
    w = workload(num_experts=32)
    model = CostModel(topo, w)
    P = w.expert_params * w.num_moe_layers
    ep = model.evaluate(Plan.grid((2, 8), (1, 1), 32)).memory
    hyb = model.evaluate(Plan.grid((2, 8), (2, 1), 32)).memory
    rep = model.evaluate(Plan.replicated((2, 8), 32)).memory
    assert ep.owned_weights == 2 * P * w.weight_bytes
    assert ep.optimizer_state == 2 * P * w.optimizer_bytes_per_param
    assert hyb.borrowed_weights == 2 * P * w.weight_bytes and hyb.optimizer_state == ep.optimizer_state
    assert rep.owned_weights == 4 * P * w.weight_bytes  # E / (GPUs per DC) experts per rank
    assert rep.optimizer_state == 2 * ep.optimizer_state  # replicated optimizer state
    dist = CostModel(topo, w.replace(distributed_optimizer=True)).evaluate(Plan.replicated((2, 8), 32)).memory
    assert dist.optimizer_state == rep.optimizer_state / 2  # sharded over the 2 DC replicas


def test_replicated_plan_costs_a_gradient_allreduce_and_no_cross_dc_tokens():
    topo = paper_topo(2, 8)
    model = CostModel(topo, workload(num_experts=32))
    rep = model.evaluate(Plan.replicated((2, 8), 32))
    assert rep.raw["expert_allgather"] == 0 and rep.raw["expert_grad_allreduce"] > 0
    assert "token_a2a" not in rep.levels[0].seconds
    # uncompressed, the gather + gradient return of S_dc = 2 moves the same bytes as the all-reduce when
    # both are in the parameters' dtype; Megatron all-reduces fp32 main grads under bf16: 4 bytes not 2
    same = CostModel(topo, workload(num_experts=32, main_grad_bytes=2))
    hyb = same.evaluate(Plan.grid((2, 8), (2, 1), 32))
    rep2 = same.evaluate(Plan.replicated((2, 8), 32))
    assert hyb.levels[0].uplink_bytes == pytest.approx(rep2.levels[0].uplink_bytes)
    assert rep.levels[0].seconds["expert_grad_allreduce"] == pytest.approx(
        2 * rep2.levels[0].seconds["expert_grad_allreduce"])  # bandwidth time; the latency stays


def test_compression_shrinks_the_gather_by_the_byte_ratio():
    topo = paper_topo(2, 8)
    w = workload(num_experts=32)
    plan = Plan.grid((2, 8), (2, 1), 32)
    exact = CostModel(topo, w).evaluate(plan)
    comp_w = w.replace(compression_ratio=20.0)
    comp = CostModel(topo, comp_w).evaluate(plan)
    ratio = w.expert_bytes / comp_w.expert_wire_bytes
    assert exact.levels[0].seconds["expert_allgather"] / comp.levels[0].seconds["expert_allgather"] == \
        pytest.approx(ratio)
    assert comp.raw["shared_sync"] == 0  # the codec's default: the shared expert is frozen after init
    refreshed = CostModel(topo, comp_w.replace(shared_sync_bytes_per_layer=w.expert_bytes / 10)).evaluate(plan)
    assert refreshed.raw["shared_sync"] > 0
    assert refreshed.phases["shared_sync"] == pytest.approx(w.num_moe_layers * refreshed.raw["shared_sync"])
    assert refreshed.total > comp.total


def test_microbatch_mode_repeats_tokens_gathers_and_returns():
    """borrowed_copies="microbatch": gathers and gradient returns in every micro-batch; layer 0's gather
    in later micro-batches starts at its MoE block, so it has no T_pre to hide behind."""
    topo = paper_topo(2, 8)
    plan = Plan.grid((2, 8), (2, 1), 32)
    one = CostModel(topo, workload(num_experts=32, borrowed_copies="microbatch")).evaluate(plan)
    four = CostModel(topo, workload(num_experts=32, micro_batches=4, borrowed_copies="microbatch")).evaluate(plan)
    assert four.borrowed_copies == "microbatch"
    Lm, ag, t_pre = workload(num_experts=32).num_moe_layers, one.raw["expert_allgather"], one.raw["t_pre"]
    assert four.phases["token_a2a_fwd"] == pytest.approx(4 * one.phases["token_a2a_fwd"])
    assert one.phases["grad_return"] > 0
    assert four.phases["grad_return"] == pytest.approx(4 * one.phases["grad_return"])
    hidden = max(0.0, ag - t_pre)
    assert four.phases["expert_allgather"] == pytest.approx(4 * Lm * hidden + 3 * (ag - hidden))
    assert four.phases["expert_grad_allreduce"] == one.phases["expert_grad_allreduce"]
    assert four.levels[0].seconds["expert_allgather"] == pytest.approx(4 * one.levels[0].seconds["expert_allgather"])


@pytest.mark.parametrize("m", [2, 4, 16])
def test_iteration_mode_gathers_and_returns_once_whatever_the_micro_batches(m):
    """borrowed_copies="iteration": the gather and the gradient return cost the same at every M > 1
    (the return carries the fp32 accumulator; at M = 1 nothing accumulates and the bf16 gradient
    goes back); tokens and compute still scale with M."""
    topo = paper_topo(2, 8)
    plan = Plan.grid((2, 8), (2, 1), 32)
    single = CostModel(topo, workload(num_experts=32, borrowed_copies="iteration")).evaluate(plan)
    one = CostModel(topo, workload(num_experts=32, borrowed_copies="iteration", micro_batches=2)).evaluate(plan)
    assert one.levels[0].seconds["grad_return"] == pytest.approx(2 * single.levels[0].seconds["grad_return"])
    assert one.phases["expert_allgather"] == pytest.approx(single.phases["expert_allgather"])
    many = CostModel(topo, workload(num_experts=32, micro_batches=m, borrowed_copies="iteration")).evaluate(plan)
    assert many.borrowed_copies == "iteration" and one.phases["grad_return"] > 0
    for ph in ("expert_allgather", "grad_return", "shared_sync", "expert_grad_allreduce", "dense_grad_allreduce"):
        assert many.phases[ph] == pytest.approx(one.phases[ph]), ph
    assert many.phases["token_a2a_fwd"] == pytest.approx(m / 2 * one.phases["token_a2a_fwd"])
    for name in ("expert_allgather", "grad_return"):  # WAN time of these phases per iteration
        assert many.levels[0].seconds[name] == pytest.approx(one.levels[0].seconds[name])


def test_auto_mode_keeps_copies_when_they_fit_and_regathers_when_not():
    topo = paper_topo(2, 8)
    plan = Plan.grid((2, 8), (2, 1), 32)
    w = workload(num_experts=32, micro_batches=8)
    fits = CostModel(topo, w)  # no memory stated: iteration
    assert fits.borrowed_copies(plan)[0] == "iteration"
    it = CostModel(topo, w).memory(plan, mode="iteration")
    mb = CostModel(topo, w).memory(plan, mode="microbatch")
    assert it.total > mb.total  # the accumulator of S x own experts is held for the iteration
    between = (it.total + mb.total) / 2
    mode, why = CostModel(topo, w, memory_limit_bytes=between).borrowed_copies(plan)
    assert mode == "microbatch" and "limit" in why and why.endswith("microbatch")
    mode, why = CostModel(topo, w, memory_limit_bytes=it.total).borrowed_copies(plan)
    assert mode == "iteration" and why.endswith("iteration")
    slow = CostModel(topo, w, memory_limit_bytes=between).evaluate(plan)
    fast = CostModel(topo, w, memory_limit_bytes=it.total).evaluate(plan)
    assert slow.borrowed_copies == "microbatch" and slow.phases["grad_return"] == pytest.approx(
        8 * w.num_moe_layers * slow.raw["grad_return"])
    assert fast.phases["grad_return"] == pytest.approx(w.num_moe_layers * fast.raw["grad_return"])
    # once per iteration the return carries the fp32 accumulator, per micro-batch the bf16 gradient
    assert fast.levels[0].seconds["grad_return"] == pytest.approx(2 * slow.levels[0].seconds["grad_return"] / 8)
    assert CostModel(topo, w.replace(borrowed_copies="microbatch")).borrowed_copies(plan)[0] == "microbatch"


def test_gradient_traffic_is_exposed_as_the_runtime_blocks_on_it():
    """Gradient return and the expert data-parallel all-reduce are blocking in the runtime (the
    return in the backward, finalize_model_grads without overlap_grad_reduce): all of it counts."""
    topo = paper_topo(2, 8)
    model = CostModel(topo, workload(num_experts=32))
    hyb = model.evaluate(Plan.grid((2, 8), (2, 1), 32))
    assert hyb.raw["grad_return"] > 0
    assert hyb.phases["grad_return"] == pytest.approx(3 * hyb.raw["grad_return"])
    rep = model.evaluate(Plan.replicated((2, 8), 32))
    assert rep.raw["expert_grad_allreduce"] > 0
    assert rep.phases["expert_grad_allreduce"] == rep.raw["expert_grad_allreduce"]


def test_async_gradient_return_hides_behind_the_backward_of_the_layers_below():
    """--hybridep-async-grad-return: each layer's return is launched in its backward and waited for at
    the end; the backward of the layers below covers (Lm - 1) / Lm of one micro-batch's backward."""
    topo = paper_topo(2, 8)
    plan = Plan.grid((2, 8), (2, 1), 32)
    blocking = CostModel(topo, workload(num_experts=32)).evaluate(plan)
    w = workload(num_experts=32, async_grad_return=True)
    hidden = CostModel(topo, w).evaluate(plan)
    one, Lm = blocking.raw["grad_return"], w.stage_moe_layers
    bwd = hidden.raw["t_pre"] * Lm * 2 + 2 * hidden.raw["expert_fwd"] * Lm + 2 * hidden.raw["a2a"] * Lm
    assert hidden.phases["grad_return"] == pytest.approx(max(0.0, Lm * one - (Lm - 1) / Lm * bwd))
    assert hidden.phases["grad_return"] < blocking.phases["grad_return"]
    assert blocking.phases["grad_return"] == pytest.approx(Lm * one)  # blocking: every return waited for


def test_early_gradient_return_prices_the_rest_on_the_tail_and_both_payloads_on_the_wire():
    """--hybridep-early-grad-return R: the first M-1 micro-batches' returns (at the gradient ratio)
    hide behind the last micro-batch's forward and backward, the rest (at R) is waited for as a
    return is; the WAN carries both payloads. Off without compressed gradients or with M = 1."""
    topo = paper_topo(2, 8)
    plan = Plan.grid((2, 8), (2, 1), 32)
    # not hidden when a micro-batch's compute is shorter than the returns: both payloads then cost
    tiny = dict(num_experts=32, grad_compression_ratio=4.0, micro_batches=8, borrowed_copies="iteration")
    assert CostModel(topo, workload(**tiny, early_return_rest_ratio=16.0)).evaluate(plan).phases["grad_return"] > \
        CostModel(topo, workload(**tiny)).evaluate(plan).phases["grad_return"]
    base = dict(tiny, t_pre_ms=5.0)  # a micro-batch's pass covers the early returns
    one = CostModel(topo, workload(**base)).evaluate(plan)
    w = workload(**base, early_return_rest_ratio=16.0)
    split = CostModel(topo, w).evaluate(plan)
    Lm = w.stage_moe_layers
    fb = 3 * (split.raw["t_pre"] * Lm + split.raw["expert_fwd"] * Lm) + 4 * split.raw["a2a"] * Lm
    assert 0 < split.raw["grad_return_rest"] < split.raw["grad_return"] == one.raw["grad_return"]
    assert split.phases["grad_return"] == pytest.approx(
        max(0.0, Lm * one.raw["grad_return"] - fb) + Lm * split.raw["grad_return_rest"] + Lm * split.raw["codec_grads"])
    assert split.phases["grad_return"] < one.phases["grad_return"]
    wan = lambda c: c.levels[0].uplink_bytes  # noqa: E731
    assert wan(split) > wan(one)  # both payloads cross
    assert w.rest_grad_bytes("iteration") < w.returned_grad_bytes("iteration")
    for off in (dict(base, grad_compression_ratio=1.0), dict(base, micro_batches=1)):
        a = CostModel(topo, workload(**off)).evaluate(plan)
        b = CostModel(topo, workload(**off, early_return_rest_ratio=16.0)).evaluate(plan)
        assert a.phases == b.phases and b.raw["grad_return_rest"] == 0
    with pytest.raises(PlanError, match="early_return_rest_ratio"):
        workload(early_return_rest_ratio=0.5)


def test_gloo_returns_gradients_by_all_to_all_as_the_runtime_does():
    """runtime/migration.py on gloo sends each chunk to its owner (all_to_all_single): a 4-rank domain
    over 2 DCs puts 2 ranks x 2 remote chunks through each DC uplink, a ring 3 chunks (its two WAN
    edges carry S - 1 each); on NCCL it is the reduce-scatter ring. The gather is a ring on both."""
    topo = Topology((Level("dc", 2, 10.0, 0.0, 10.0), Level("gpu", 2, 1000.0, 0.0)))
    plan = Plan.grid((2, 2), (2, 2), 16)
    nccl = CostModel(topo, workload()).evaluate(plan)
    gloo = CostModel(topo, workload(backend="gloo")).evaluate(plan)
    assert gloo.raw["grad_return"] == pytest.approx(4 / 3 * nccl.raw["grad_return"], rel=1e-3)
    assert gloo.raw["expert_allgather"] == nccl.raw["expert_allgather"]
    with pytest.raises(PlanError, match="backend"):
        workload(backend="mpi")


def test_expert_grad_allreduce_is_one_bucket_for_all_layers():
    """Megatron reduces all expert gradients in one call: latency once, not once per layer."""
    topo = Topology((Level("dc", 2, 1e9, 1000.0), Level("gpu", 4, 1e9, 0.0)))  # bandwidth ~ free
    for layers in (1, 8):
        w = workload(num_experts=8, num_moe_layers=layers, num_layers=layers)
        rep = CostModel(topo, w).evaluate(Plan.replicated((2, 4), 8))
        assert rep.phases["expert_grad_allreduce"] == pytest.approx(2 * 1000e-6, rel=1e-3)


def test_plain_ep_pays_no_migration_or_shared_sync():
    topo = paper_topo(2, 8)
    w = workload(num_experts=32, compression_ratio=50.0, grad_compression_ratio=50.0,
                 shared_sync_bytes_per_layer=1e6)
    ep = CostModel(topo, w).evaluate(Plan.grid((2, 8), (1, 1), 32))
    for ph in ("expert_allgather", "grad_return", "shared_sync"):
        assert ep.phases[ph] == 0 and ep.raw[ph] == 0
    hyb = CostModel(topo, w).evaluate(Plan.grid((2, 8), (2, 1), 32))
    assert hyb.phases["shared_sync"] > 0


def test_world_larger_than_ep_group_adds_expert_data_parallel_allreduce():
    topo = paper_topo(4, 8)
    model = CostModel(topo, workload(num_experts=16))
    within = model.evaluate(Plan.grid((8,), (1,), 16))  # EP = 8: four EP groups, one per DC
    assert within.raw["expert_grad_allreduce"] > 0 and within.levels[0].uplink_bytes > 0
    assert "token_a2a" not in within.levels[0].seconds  # tokens stay inside the DC


def test_plan_must_match_topology_and_model():
    topo = paper_topo(2, 8)
    model = CostModel(topo, workload(num_experts=32))
    with pytest.raises(PlanError, match=r"plan.level_counts.*\{'dc': 2, 'gpu': 8\}"):
        model.evaluate(Plan.grid((4, 4), (1, 1), 32))
    with pytest.raises(PlanError, match="plan.num_experts: 16"):
        model.evaluate(Plan.grid((2, 8), (1, 1), 16))
    assert math.isfinite(model.evaluate(Plan.grid((2, 8), (1, 1), 32)).total)


def test_resolve_borrowed_copies_says_why_in_one_line():
    from megatron_hybridep.plan.cost import resolve_borrowed_copies

    topo = Topology.from_yaml(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "configs", "topologies", "2dc_x_8.yaml"))
    w = workload(num_experts=32, micro_batches=8)
    plan = Plan.grid((2, 8), (2, 1), 32)
    mode, why = resolve_borrowed_copies(topo, w, plan)
    assert mode == "iteration" and why.startswith("held borrowed copies need ") and why.endswith(
        "limit 80 GB: iteration") and "\n" not in why
    mode, why = resolve_borrowed_copies(topo, w, plan, memory_limit_bytes=1e6)
    assert mode == "microbatch" and why.endswith("limit 1 MB: microbatch")
    assert resolve_borrowed_copies(topo, w.replace(borrowed_copies="microbatch"), plan) == (
        "microbatch", "borrowed_copies=microbatch (forced)")
    assert resolve_borrowed_copies(topo, w, Plan.grid((2, 8), (1, 1), 32))[1] == "no borrowed experts"


def test_pipeline_stage_is_a_contiguous_block_of_ranks():
    topo = Topology((Level("dc", 8, 10.0, 100.0, 10.0, (LinkOverride(0, 1, 1.0, 5.0), LinkOverride(2, 5, 1.0, 5.0))),
                     Level("gpu", 8, 100.0)), memory_gb_per_gpu=80)
    stage = topo.pipeline_stage(4)
    assert stage.level_counts == (2, 8) and stage.memory_gb_per_gpu == 80
    assert stage.levels[0].overrides == (LinkOverride(0, 1, 1.0, 5.0),)  # only the first stage's pairs
    assert topo.pipeline_stage(1) is topo and topo.pipeline_stage(16).level_counts == (1, 4)
    with pytest.raises(PlanError, match="pipeline_model_parallel_size: 3 does not divide"):
        topo.pipeline_stage(3)
    w = workload(num_experts=16, num_moe_layers=8, pipeline_model_parallel_size=4)
    model = CostModel(topo, w)
    assert model.topology == stage and w.stage_moe_layers == 2
    one = CostModel(stage, w.replace(pipeline_model_parallel_size=1, num_moe_layers=2, dense_params=0))
    plan = Plan.grid((2, 8), (2, 1), 16)
    a, b = model.evaluate(plan), one.evaluate(plan)
    for ph in ("token_a2a_fwd", "expert_allgather", "grad_return", "expert_compute"):
        assert a.phases[ph] == pytest.approx(b.phases[ph]), ph  # a stage's layers on a stage's ranks
