"""Matrix: tensor parallelism with sequence parallelism, pipeline parallelism (1F1B) and virtual
pipeline stages (interleaved 1F1B: 4 layers, 2 stages, 2 chunks of one layer per rank), each with an
EP group whose HybridEP domains cross DCs. (Checkpoints with virtual stages are refused on CPU: see
megatron/supported.py and test_refusals.py.)

8 ranks as 4 DCs x 2: Megatron puts TP (and with PP, the pipeline stage) outermost-inner so an
EP group of 4 is 2 DCs x 2 ranks; the plan's domains pair one rank of each DC."""

import pytest

from tests.matrix.harness import assert_same_training, train, write_cross_dc_plan, write_topology

pytestmark = pytest.mark.matrix

FP64 = ["--hybridep-fp64", "--expert-model-parallel-size", "4"]
LAYOUTS = {
    "tp2-sp-ep4": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
                   "--global-batch-size", "8"],
    "pp2-ep4-1f1b": ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16"],
    "pp2-vpp2-ep4": ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                     "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "16"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_model_parallel_layout_matches_alltoall(layout, tmp_path):
    topology = write_topology(str(tmp_path / "topo.yaml"), dcs=4, per_dc=2)
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    flags = [*FP64, *LAYOUTS[layout]]
    hybrid = train(8, flags, "hybridep", plan=plan, topology=topology)
    oracle = train(8, flags, "alltoall", topology=topology)
    assert_same_training(hybrid, oracle)
