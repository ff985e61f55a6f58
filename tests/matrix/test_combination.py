"""Matrix: the combination the GPU presets use, bf16 + distributed optimizer + pipeline parallelism
(1F1B) + full activation recompute, with an EP group whose domains cross DCs (8 ranks as 4 DCs x 2,
PP=2 x EP=4). The tolerance is twice alltoall's own bf16 error against the same job in float64
(harness.assert_within_oracle_rounding)."""

import pytest

from tests.matrix.harness import assert_within_oracle_rounding, train, write_cross_dc_plan, write_topology

pytestmark = pytest.mark.matrix

LAYOUT = ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "4", "--global-batch-size", "16",
          "--use-distributed-optimizer", "--recompute-granularity", "full", "--recompute-method", "uniform",
          "--recompute-num-layers", "1"]


def test_bf16_distributed_optimizer_pipeline_recompute_matches_alltoall(tmp_path):
    topology = write_topology(str(tmp_path / "topo.yaml"), dcs=4, per_dc=2)
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    exact = train(8, [*LAYOUT, "--hybridep-fp64"], "alltoall", topology=topology)
    oracle = train(8, [*LAYOUT, "--bf16"], "alltoall", topology=topology)
    hybrid = train(8, [*LAYOUT, "--bf16"], "hybridep", plan=plan, topology=topology)
    assert_within_oracle_rounding(hybrid, oracle, exact)
