"""The simulator prices pipeline parallelism and the overlap flags as tier b does (plan/pipeline.py):
it simulates one stage flow by flow and puts the same schedule around it."""

from __future__ import annotations

import pytest

from megatron_hybridep.plan.cost import CostModel
from megatron_hybridep.plan.phases import PIPELINE, Phase
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.topology import Level, Topology
from megatron_hybridep.plan.workload import Workload
from megatron_hybridep.sim import simulate

TOPO = Topology((Level("dc", 4, 1.0, 100.0, 1.0), Level("gpu", 2, 100.0, 5.0, 100.0)))
WORK = Workload(hidden_size=256, ffn_hidden_size=512, num_experts=8, top_k=2, num_moe_layers=8, seq_length=512,
                micro_batches=4, throughput_tflops=1.0, pipeline_model_parallel_size=4)


@pytest.mark.parametrize("virtual", [1, 2])
def test_pipeline_phases_match_tier_b(virtual):
    w = WORK.replace(virtual_pipeline_model_parallel_size=virtual)
    plan = Plan.grid((2,), (1,), 8, ("gpu",))
    tierb = CostModel(TOPO, w).evaluate(plan)
    sim = simulate(TOPO, w, plan)
    for ph in PIPELINE:
        assert sim.phases[ph] > 0
        assert sim.phases[ph] == pytest.approx(tierb.phases[ph], rel=1e-6)
    assert sim.total == pytest.approx(sum(sim.phases.values()))
    assert sim.total == pytest.approx(tierb.total, rel=1e-3)


def test_overlap_grad_reduce_hides_the_dense_reduction_in_the_simulator_too():
    w = WORK.replace(pipeline_model_parallel_size=1, micro_batches=2)
    topo = Topology((Level("dc", 2, 0.1, 100.0, 0.1), Level("gpu", 2, 100.0, 5.0, 100.0)))
    plan = Plan.grid((2,), (1,), 8, ("gpu",))
    # small buckets (Megatron's --ddp-bucket-size): one bucket would be reduced only after the backward
    on_w = w.replace(overlap_grad_reduce=True, ddp_bucket_size=10_000)
    off, on = simulate(topo, w, plan), simulate(topo, on_w, plan)
    assert off.phases[Phase.DENSE_GRAD_ALLREDUCE] > 0
    assert on.phases[Phase.DENSE_GRAD_ALLREDUCE] < off.phases[Phase.DENSE_GRAD_ALLREDUCE]
    one_bucket = simulate(topo, w.replace(overlap_grad_reduce=True, ddp_bucket_size=10**9), plan)
    assert one_bucket.phases[Phase.DENSE_GRAD_ALLREDUCE] == pytest.approx(off.phases[Phase.DENSE_GRAD_ALLREDUCE])
    tierb = CostModel(topo, on_w).evaluate(plan)
    assert on.phases[Phase.DENSE_GRAD_ALLREDUCE] == pytest.approx(tierb.phases[Phase.DENSE_GRAD_ALLREDUCE], rel=1e-3)
