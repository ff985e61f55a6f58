"""Matrix: the combination the GPU presets use, bf16 + distributed optimizer + pipeline parallelism
(1F1B) + full activation recompute, with an EP group whose domains cross DCs (8 ranks as 4 DCs x 2,
PP=2 x EP=4). The tolerance is alltoall's own bf16 error against the same job in float64."""

import pytest

from tests.matrix.harness import max_differences, train, write_cross_dc_plan, write_topology

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
    loss_err, param_err = max_differences(oracle, exact)
    assert 0 < param_err < 0.1, param_err
    loss, param = max_differences(hybrid, oracle)
    assert loss <= loss_err and param <= param_err, (
        f"hybridep vs alltoall: loss {loss:.3g} (oracle's own bf16 error {loss_err:.3g}), "
        f"params {param:.3g} (oracle's own bf16 error {param_err:.3g})")
