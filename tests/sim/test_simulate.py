"""One iteration under the runtime's schedule: what is exposed, what hides, what shares links, and
how EP groups with different links, skewed routing and the replicated plan show."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings

from megatron_hybridep.plan.cost import CostModel
from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.topology import Level, LinkOverride, Topology
from megatron_hybridep.plan.workload import zipf_routing
from megatron_hybridep.sim.schedule import PHASES, SimOptions
from megatron_hybridep.sim.simulate import simulate

from ..plan.strategies import topology_and_plan
from .helpers import domains, one_level, two_level, workload


def test_phases_sum_to_total_and_forward_is_part_of_it():
    topo = two_level(4, 4, wan=10, lan=100, wan_lat=500)
    w = workload(32, micro_batches=2, compression_ratio=10)
    for plan in (domains(topo, 16, (1, 1), 32), domains(topo, 16, (4, 1), 32), domains(topo, 16, (2, 2), 32),
                 Plan.replicated((4, 4), 32, ("dc", "gpu"))):
        r = simulate(topo, w, plan)
        assert sum(r.phases.values()) == pytest.approx(r.total)
        assert 0 < r.forward < r.total
        assert set(PHASES) <= set(r.phases)


def test_plain_ep_on_one_level_is_four_all_to_alls_per_layer_and_micro_batch():
    G, gbps = 8, 10.0
    w = workload(16, micro_batches=3, num_moe_layers=4)
    B = gbps * 1e9 / 8
    ep = domains(one_level(G, gbps), G, (1,), 16)
    r = simulate(one_level(G, gbps), w, ep)
    a2a = w.dispatch_bytes * (G - 1) / G / B
    assert r.phases["token_a2a_fwd"] == pytest.approx(2 * 4 * 3 * a2a)
    assert r.phases["token_a2a_bwd"] == pytest.approx(2 * 4 * 3 * a2a)
    compute = 3 * 4 * 3 * (w.t_pre + w.tokens * w.top_k * w.expert_seconds_per_token)
    assert r.total == pytest.approx(4 * 4 * 3 * a2a + compute)
    # latency: one round per all-to-all
    lat = simulate(one_level(G, gbps, latency_us=250.0), w, ep)
    assert lat.total - r.total == pytest.approx(4 * 4 * 3 * 250e-6)
    # a backend's fixed cost per call (gloo on shared cores): once per all-to-all too
    call = simulate(one_level(G, gbps), w.replace(collective_overhead_ms=0.25), ep)
    assert call.total - r.total == pytest.approx(4 * 4 * 3 * 250e-6)


def test_gather_hides_behind_compute_when_it_fits_and_is_exposed_when_not():
    topo = two_level(4, 2, wan=10, lan=100)
    plan = domains(topo, 8, (4, 1), 16)  # every DC in one domain: no token crosses the WAN
    small = workload(16, compression_ratio=1000, grad_compression_ratio=1000, t_pre_ms=50.0)
    r = simulate(topo, small.replace(codec_encode_ns=0.0, codec_decode_ns=0.0), plan)  # the network alone
    assert r.phases["expert_allgather"] == 0.0
    priced = simulate(topo, small, plan)  # the codec's compute runs after the wait, exposed as tier b prices it
    assert priced.phases["expert_allgather"] == pytest.approx(CostModel(topo, small).evaluate(plan).raw[
        "codec_weights"] * small.stage_moe_layers)
    assert r.ops["gather"].busy_seconds > 0  # it ran, hidden
    big = workload(16, t_pre_ms=0.01)  # exact 0.5 MB experts, almost no compute to hide behind
    r = simulate(topo, big, plan)
    assert r.phases["expert_allgather"] > 0.5 * r.ops["gather"].busy_seconds


def test_borrowed_copies_per_micro_batch_or_once_per_iteration():
    topo = two_level(2, 2)
    plan = domains(topo, 4, (2, 1), 8)
    w = workload(8, micro_batches=3, num_moe_layers=4, compression_ratio=20)
    per_mb = simulate(topo, w.replace(borrowed_copies="microbatch"), plan)
    once = simulate(topo, w, plan)  # auto: no memory limit stated, the copies are kept
    assert simulate(topo, w, plan, options=SimOptions(gather="micro-batch")).total == per_mb.total  # forced
    assert per_mb.ops["gather"].occurrences == 4 * 3 and once.ops["gather"].occurrences == 4
    assert per_mb.ops["grad_return"].occurrences == 4 * 3 and once.ops["grad_return"].occurrences == 4
    assert once.total < per_mb.total
    assert per_mb.traffic["dc"] > once.traffic["dc"]
    assert any("every micro-batch" in n for n in per_mb.notes)
    assert any("once per iteration" in n for n in once.notes)
    # the gradients return in the last micro-batch's backward, the gathers run in the first's forward
    assert {s.micro_batch for s in once.timeline if s.name == "grad_return"} == {2}
    assert {s.micro_batch for s in once.timeline if s.name == "gather"} == {0}
    # WAN bytes per iteration do not grow with M in iteration mode (tokens stay inside DCs here)
    more = simulate(topo, w.replace(micro_batches=6), plan)
    assert more.traffic["dc"] == pytest.approx(once.traffic["dc"])


def test_next_layers_gather_slows_this_layers_combine():
    """after_experts starts layer l+1's gather, which then shares the DC uplink with layer l's combine:
    the last layer's combine (nothing in flight) is faster than the first's."""
    topo = two_level(4, 2, wan=1, lan=100)
    plan = domains(topo, 8, (2, 1), 16)
    w = workload(16, num_moe_layers=3, compression_ratio=4)
    r = simulate(topo, w, plan)
    comb = {s.layer: s.seconds for s in r.timeline if s.kind == "block" and s.name == "combine" and s.stage == "fwd"}
    assert comb[0] > comb[2] * 1.05
    paper = simulate(topo, w, plan, options=SimOptions(schedule="paper"))
    comb_p = {s.layer: s.seconds for s in paper.timeline if s.kind == "block" and s.name == "combine"
              and s.stage == "fwd"}
    assert comb_p[0] == pytest.approx(comb_p[2])  # the paper's schedule never overlaps a gather with an a2a


def test_slow_pair_inside_one_ep_group_sets_the_pace():
    over = (LinkOverride(0, 1, 1.0, 20000.0),)  # DC 0 <-> DC 1: 1 Gbit/s, 20 ms, inside EP group 0
    topo = two_level(8, 2, wan=10, overrides=over)
    plan = domains(topo, 4, (1, 1), 8)        # EP groups of 2 DCs: 4 groups
    w = workload(8)
    r = simulate(topo, w, plan)
    assert sorted(g.groups for g in r.group_classes) == [1, 3]
    slow = max(r.group_classes, key=lambda g: g.seconds)
    assert slow.groups == 1 and slow.overrides == ((0, 1),)
    fast = simulate(two_level(8, 2, wan=10), w, plan)
    assert r.total > fast.total
    assert r.total == pytest.approx(slow.seconds + r.phases["expert_grad_allreduce"])


def test_skewed_routing_costs_time_and_hybridep_spreads_the_hot_expert():
    topo = two_level(2, 4, wan=10, lan=100)
    w = workload(16, num_moe_layers=2)
    skew = w.replace(routing_counts=zipf_routing(8, 16, w.tokens, w.top_k, 1.5))
    ep = domains(topo, 8, (1, 1), 16)
    r_bal, r_skew = simulate(topo, w, ep), simulate(topo, skew, ep)
    assert r_skew.phases["expert_compute"] > r_bal.phases["expert_compute"]
    assert r_skew.total > r_bal.total
    hy = simulate(topo, skew, domains(topo, 8, (2, 1), 16))  # a hot expert's tokens split over 2 copies
    assert hy.phases["expert_compute"] < r_skew.phases["expert_compute"]
    # explicit flows agree with the symmetry-free run
    assert simulate(topo, skew, ep, symmetry=False).total == pytest.approx(r_skew.total, rel=1e-9)


def test_replicated_plan_all_reduces_over_dcs():
    topo = two_level(4, 2, wan=10, lan=100)
    w = workload(8)
    r = simulate(topo, w, Plan.replicated((4, 2), 8, ("dc", "gpu")))
    k = 4
    grad = (8 // 2) * w.expert_params * w.main_grad_bytes * w.num_moe_layers  # fp32 main grads
    B = 10e9 / 8 / 2   # two GPUs of a DC share its uplink, one ring each
    assert r.phases["expert_grad_allreduce"] == pytest.approx(2 * (k - 1) / k * grad / B)
    assert r.phases["expert_allgather"] == 0 and r.traffic["dc"] > 0


@settings(max_examples=20, deadline=None)
@given(topology_and_plan(max_ranks=32, replicated=False))
def test_token_all_to_all_never_beats_the_busiest_link(case):
    """Flows cannot beat capacity: the simulated all-to-all is at least the closed form's busiest-link
    time (tier b), for plain EP where nothing else runs (no latency: tier b adds the worst latency
    to the worst bandwidth time, an upper bound)."""
    topo, plan = case
    topo = Topology(tuple(dataclasses.replace(lv, latency_us=0.0, overrides=tuple(
        dataclasses.replace(o, latency_us=0.0) for o in lv.overrides)) for lv in topo.levels))
    ep = Plan("domains", plan.level_names, plan.level_counts, (1,) * len(plan.level_counts), plan.num_experts)
    w = workload(plan.num_experts)
    r = simulate(topo, w, ep)
    tb = CostModel(topo, w).evaluate(ep)
    assert r.phases["token_a2a_fwd"] >= tb.phases["token_a2a_fwd"] * (1 - 1e-9)


def test_plan_for_another_topology_is_refused():
    topo = two_level(2, 4)
    with pytest.raises(PlanError, match="plan.level_counts"):
        simulate(topo, workload(16), Plan.grid((4, 2), (1, 1), 16))
    with pytest.raises(PlanError, match="num_experts"):
        simulate(topo, workload(16), domains(topo, 8, (1, 1), 8))


def test_auto_plan_is_the_planners():
    topo = two_level(2, 4)
    r = simulate(topo, workload(16, compression_ratio=50))
    from megatron_hybridep.plan.planner import choose_plan

    assert r.plan == choose_plan(topo, workload(16, compression_ratio=50)).best


def test_compressed_gradient_return_is_one_all_to_all_round():
    """Exact gradients go back by reduce-scatter (a ring: S-1 latency rounds), compressed ones by
    all_to_all_single of top-k payloads (one round), as runtime/migration.py does."""
    lat_us = 5000.0
    topo = two_level(4, 1, wan=10, lan=100, wan_lat=lat_us)
    plan = domains(topo, 4, (4,), 4)
    for ratio, rounds in ((1.0, 3), (50.0, 1)):
        w = workload(4, grad_compression_ratio=ratio, t_pre_ms=0.0)
        fast = simulate(two_level(4, 1, wan=10, lan=100), w, plan).ops["grad_return"]
        slow = simulate(topo, w, plan).ops["grad_return"]
        assert (slow.busy_seconds - fast.busy_seconds) / slow.occurrences == pytest.approx(rounds * lat_us * 1e-6)
        # (S-1) x own experts; kept for the iteration (auto, no limit), the fp32 accumulator returns
        assert fast.level_bytes["dc"] == pytest.approx(3 * w.returned_grad_bytes("iteration"))
        acc = w.replace(micro_batches=2).returned_grad_bytes("iteration")  # the fp32 accumulator
        assert w.returned_grad_bytes("iteration") == w.grad_wire_bytes
        # exact: the accumulator's fp32 (2x bf16); compressed: its kept values sent as bf16, unless "same"
        assert acc == (2 * w.grad_wire_bytes if ratio == 1 else w.grad_wire_bytes)
        same = w.replace(micro_batches=2, grad_value_bytes=0)
        assert ratio == 1 or same.returned_grad_bytes("iteration") > acc


def test_shared_expert_refresh_once_per_layer_per_step():
    topo = two_level(2, 2)
    w = workload(8, micro_batches=2, num_moe_layers=3, compression_ratio=20, shared_sync_bytes_per_layer=2e5)
    r = simulate(topo, w, domains(topo, 4, (2, 1), 8))
    assert r.ops["shared_sync"].occurrences == 3
    assert r.phases["shared_sync"] > 0
    assert "shared_sync" not in simulate(topo, w, domains(topo, 4, (1, 1), 8)).ops  # plain EP: no codec


@pytest.mark.parametrize("mode", ["iteration", "microbatch"])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("comp", [1.0, 20.0])
@pytest.mark.parametrize("sizes", [(1, 1), (2, 1), (2, 2), "replicated"])
@pytest.mark.parametrize("lan", [1e6, 0.5])
@pytest.mark.parametrize("call_ms", [0.0, 2.0])
def test_tier_b_is_the_closed_form_of_the_runtime_schedule(sizes, comp, m, lan, mode, call_ms):
    """With no latency, on 2 DCs x 2 (a plan's gathers and all-to-alls never share a link level),
    tier b (plan/cost.py) and the simulator agree per phase, in both borrowed-copies modes and with
    the dense gradient all-reduce: lan=0.5 Gbit/s makes the intra-DC all-to-alls a gather overlaps
    take real time (cover), lan=1e6 makes them free. The testbed's shape: DC uplinks, ranks of a DC
    joined by links without a per-rank uplink."""
    topo = Topology((Level("dc", 2, 0.05, 0.0, 0.05), Level("gpu", 2, lan, 0.0, None)), name="2x2")
    w = workload(8, micro_batches=m, compression_ratio=comp, grad_compression_ratio=comp,
                 shared_sync_bytes_per_layer=1e5 if comp > 1 else 0.0, t_pre_ms=0.5, borrowed_copies=mode,
                 dense_params=50_000, collective_overhead_ms=call_ms)
    plan = Plan.replicated((2, 2), 8, ("dc", "gpu")) if sizes == "replicated" else domains(topo, 4, sizes, 8)
    sim = simulate(topo, w, plan)
    tb = CostModel(topo, w).evaluate(plan)
    assert tb.total > 0 and tb.phases["dense_grad_allreduce"] > 0
    assert sim.ops["dense_grad_allreduce"].occurrences == 1
    for ph in PHASES:
        assert sim.phases[ph] == pytest.approx(tb.phases[ph], rel=1e-6, abs=1e-9), ph


def test_dense_gradient_all_reduce_is_a_ring_over_the_data_parallel_group():
    """Megatron's finalize_model_grads all-reduces the dense main grads over the data-parallel group:
    2 (k-1)/k of the buffer over the slowest ring edge (the DC uplink here), once per iteration,
    whatever the plan and the micro-batches; TP shrinks the buffer and the group."""
    topo = two_level(2, 4, wan=1.0, lan=100.0)
    B = 1.0 * 1e9 / 8
    w = workload(8, dense_params=1_000_000, micro_batches=4)
    buf = 1_000_000 * w.main_grad_bytes
    for plan in (domains(topo, 8, (1, 1), 8), domains(topo, 8, (2, 1), 8), Plan.replicated((2, 4), 8, ("dc", "gpu"))):
        r = simulate(topo, w, plan)
        tb = CostModel(topo, w).evaluate(plan)
        # ring over 8 ranks in rank order: two edges cross the WAN, one per direction per DC uplink
        assert r.phases["dense_grad_allreduce"] == pytest.approx(2 * 7 / 8 * buf / B, rel=1e-6)
        assert tb.phases["dense_grad_allreduce"] == pytest.approx(r.phases["dense_grad_allreduce"], rel=1e-6)
    tp2 = CostModel(topo, w.replace(tensor_model_parallel_size=2)).evaluate(domains(topo, 8, (1, 1), 8))
    # 4 ranks per TP rank, each holding half the buffer: 2 * 3/4 * buf/2, two TP rings share the uplink
    assert tp2.phases["dense_grad_allreduce"] == pytest.approx(2 * 2 * 3 / 4 * buf / 2 / B, rel=1e-6)
    none = simulate(topo, w, domains(topo, 8, (1, 1), 8), options=SimOptions(dense_grad_bytes=0.0))
    assert "dense_grad_allreduce" not in none.ops
