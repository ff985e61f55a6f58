"""Hot-expert replicas in the simulator: the weights all-to-all and the gradient return, as
runtime/replication.py and megatron/moe_layer.py run them, against plan/hot.py's closed form."""

from __future__ import annotations

import pytest

from megatron_hybridep.plan.cost import CostModel
from megatron_hybridep.plan.hot import REPLICA_PHASES, hot_plan
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.topology import Level, Topology
from megatron_hybridep.plan.workload import Workload, zipf_routing
from megatron_hybridep.sim.schedule import PHASES, SimOptions
from megatron_hybridep.sim.simulate import simulate

from .helpers import block_time, domains, one_level, workload

ALL = PHASES + REPLICA_PHASES


def _topo(lan: float) -> Topology:
    # the shape of test_simulate.py's tier-b test: slow DC uplinks, ranks of a DC joined without an uplink
    return Topology((Level("dc", 2, 0.05, 0.0, 0.05), Level("gpu", 2, lan, 0.0, None)), name="2x2")


def _plan(topo: Topology, w: Workload, which: str) -> Plan:
    base = domains(topo, 4, (1, 1), 8)
    if which == "intra-dc":
        return base.with_replicas([(0, 1)])
    if which == "cross-dc":  # three WAN replicas; rank 0 both sends and receives
        return base.with_replicas([(0, 2), (1, 3), (7, 0)])
    found = hot_plan(CostModel(topo, w), base)  # the planner's own placement on skewed counts
    assert found is not None
    return found[0]


@pytest.mark.parametrize("which", ["intra-dc", "cross-dc", "hot"])
@pytest.mark.parametrize("m,t_pre", [(1, 0.5), (1, 1000.0), (3, 0.0)])
@pytest.mark.parametrize("lan", [1e6, 0.5])
def test_cost_model_is_the_closed_form_of_the_replica_exchange(which, m, t_pre, lan):
    """CostModel.evaluate and the runtime schedule agree phase by phase where the closed form's
    assumption holds: every exchange hides behind T_pre only. That is so with one MoE layer (the
    runtime starts layer l+1's exchange after layer l's experts, so layer l's combine covers it
    too), no domain gather (S = 1: nothing runs beside it), and one micro-batch or T_pre = 0 (later
    micro-batches start layer 0's exchange at its MoE block and wait at once: nothing covers it).
    lan=0.5 makes an intra-DC replica take real time; t_pre=1000 ms hides every weight exchange."""
    topo = _topo(lan)
    w = workload(8, micro_batches=m, num_moe_layers=1, t_pre_ms=t_pre)
    if which == "hot":
        w = w.replace(routing_counts=zipf_routing(4, 8, w.tokens, w.top_k, 1.5))
    plan = _plan(topo, w, which)
    sim = simulate(topo, w, plan)
    tb = CostModel(topo, w).evaluate(plan)
    for ph in ALL:
        assert sim.phases[ph] == pytest.approx(tb.phases[ph], rel=1e-6, abs=1e-9), ph
    assert sim.total == pytest.approx(tb.total, rel=1e-9)
    assert sim.phases["replica_grad_return"] > 0
    if t_pre < 1 and (lan < 1e3 or which != "intra-dc"):
        assert sim.phases["replica_weights"] > 0


def test_where_the_runtime_order_departs_from_the_closed_form():
    """The simulator follows the runtime; hot.py prices every exchange as prefetched behind what
    T_pre leaves after the gather. R: one weights exchange alone (intra-DC replica, 8.4 ms)."""
    topo = _topo(0.5)

    def run(sizes, **kw):
        w = workload(8, borrowed_copies="microbatch", **kw)
        plan = domains(topo, 4, sizes, 8).with_replicas([(0, 1)])
        return simulate(topo, w, plan), CostModel(topo, w).evaluate(plan), block_time(topo, w, plan,
                                                                                       "replica_weights")

    # 2 layers: layer 1's exchange starts after layer 0's experts and hides behind its WAN combine;
    # the closed form exposes it (T_pre = 0). Simulator lower by (L - 1) m R.
    sim, tb, R = run((1, 1), num_moe_layers=2, micro_batches=3, t_pre_ms=0.0)
    assert R == pytest.approx(0.008388608)
    assert sim.phases["replica_weights"] == pytest.approx(3 * R)
    assert tb.phases["replica_weights"] == pytest.approx(6 * R)
    assert tb.total - sim.total == pytest.approx(3 * R)

    # micro-batches after the first start layer 0's exchange at its MoE block and wait in preprocess:
    # exposed in full, where the closed form hides it behind T_pre. Simulator higher by (m - 1) R.
    sim, tb, R = run((1, 1), num_moe_layers=1, micro_batches=3, t_pre_ms=1000.0)
    assert sim.phases["replica_weights"] == pytest.approx(2 * R)
    assert tb.phases["replica_weights"] == 0.0
    assert sim.total - tb.total == pytest.approx(2 * R)

    # with a domain gather on the WAN (S = (2, 1)) the intra-DC exchange runs beside it, not after
    # it: exposed R - T_pre, and waiting for it before the dispatch also covers the gather.
    # Simulator lower by R.
    sim, tb, R = run((2, 1), num_moe_layers=1, micro_batches=1, t_pre_ms=0.5)
    assert sim.phases["replica_weights"] == pytest.approx(R - 0.5e-3)
    assert tb.phases["replica_weights"] == pytest.approx(R)
    assert tb.phases["expert_allgather"] - sim.phases["expert_allgather"] == pytest.approx(R - 0.5e-3)
    assert tb.total - sim.total == pytest.approx(R)


def test_replica_exchange_is_bytes_over_bandwidth_on_one_link():
    """Two ranks on one link, both of owner 0's experts replicated on rank 1: one message of two
    experts each way, fully exposed (T_pre = 0, one layer), plus one latency round."""
    gbps, lat_us = 1.0, 300.0
    topo = one_level(2, gbps, latency_us=lat_us)
    B = gbps * 1e9 / 8
    w = workload(4, num_moe_layers=1, t_pre_ms=0.0)
    plan = domains(topo, 2, (1,), 4).with_replicas([(0, 1), (1, 1)])
    r = simulate(topo, w, plan)
    assert r.phases["replica_weights"] == pytest.approx(2 * w.expert_bytes / B + lat_us * 1e-6)
    assert r.phases["replica_grad_return"] == pytest.approx(2 * w.expert_params * w.grad_bytes / B + lat_us * 1e-6)
    assert r.ops["replica_weights"].level_bytes["gpu"] == pytest.approx(w.expert_bytes)  # per rank: 2 over 2 ranks
    assert r.phases["replica_weights"] > 0.1 * r.total  # big enough that dropping it shows
    without = simulate(topo, w, plan.base)
    assert "replica_weights" not in without.phases
    tb = CostModel(topo, w).evaluate(plan)
    for ph in REPLICA_PHASES:
        assert r.phases[ph] == pytest.approx(tb.phases[ph], rel=1e-9)


def test_replica_exchange_in_runtime_order():
    """Started with the gather (after the optimizer step, after the previous layer's experts, or at
    layer 0's MoE block in later micro-batches), waited before the dispatch; gradients back after
    the dispatch's transpose, before attention's backward; every micro-batch unless --gather iteration."""
    topo = _topo(0.5)
    w = workload(8, num_moe_layers=2, micro_batches=2, compression_ratio=20, shared_sync_bytes_per_layer=1e5,
                 borrowed_copies="microbatch")
    plan = domains(topo, 4, (2, 1), 8).with_replicas([(0, 1)])
    r = simulate(topo, w, plan)
    assert r.ops["replica_weights"].occurrences == 4 and r.ops["replica_grad_return"].occurrences == 4
    assert sum(r.phases.values()) == pytest.approx(r.total)

    def main(layer, mb, stage):
        return [s.phase for s in r.timeline if s.kind != "async" and (s.layer, s.micro_batch, s.stage) ==
                (layer, mb, stage)]

    assert main(0, 1, "fwd") == ["pre_compute", "replica_weights", "token_a2a_fwd", "expert_allgather",
                                 "expert_allgather", "expert_compute", "token_a2a_fwd"]  # the wait, then the codec
    assert main(1, 0, "bwd") == ["token_a2a_bwd", "expert_compute", "grad_return", "token_a2a_bwd",
                                 "replica_grad_return", "pre_compute"]
    issued = {(s.name, s.layer, s.micro_batch): s.start for s in r.timeline if s.kind == "async"}
    for layer, mb in ((0, 0), (1, 0), (0, 1), (1, 1)):
        assert issued[("replica_weights", layer, mb)] == issued[("gather", layer, mb)]
    pre = next(s for s in r.timeline if s.kind == "compute" and (s.layer, s.micro_batch, s.stage) == (0, 1, "fwd"))
    assert issued[("replica_weights", 0, 1)] == pytest.approx(pre.end)  # not prefetched
    once = simulate(topo, w, plan, options=SimOptions(gather="iteration"))
    assert once.ops["replica_weights"].occurrences == 2 and once.ops["replica_grad_return"].occurrences == 2
    paper = simulate(topo, w, plan, options=SimOptions(schedule="paper"))
    assert paper.ops["replica_weights"].occurrences == 2  # the paper's schedule gathers once per iteration
    assert sum(paper.phases.values()) == pytest.approx(paper.total)
