"""Matrix: Megatron's overlapped data-parallel reductions (--overlap-grad-reduce: DDP buckets
reduced from the grad hooks of the last micro-batch's backward; --overlap-param-gather with the
distributed optimizer: parameters all-gathered during the next forward), at 1 and 4 micro-batches,
with HybridEP domains across DCs. The borrowed experts' gradient return runs blocking, and with
--hybridep-async-grad-return launched in the backward and collected before the experts' bucket
is reduced (megatron/grad_sync.py)."""

import pytest

from megatron_hybridep.train.launch import run_ranks
from tests.matrix.harness import PRESET, TINY, assert_same_training, train, write_cross_dc_plan, write_topology

pytestmark = pytest.mark.matrix

OVERLAP = {
    "grad-reduce": ["--hybridep-fp64", "--overlap-grad-reduce"],
    # ~1 layer's experts per bucket: the last layer's expert bucket is reduced in the middle of the
    # backward, before the first layer's return is even launched
    "grad-reduce-small-buckets": ["--hybridep-fp64", "--overlap-grad-reduce", "--ddp-bucket-size", "4096"],
    "param-gather": ["--hybridep-fp64", "--use-distributed-optimizer", "--overlap-grad-reduce",
                     "--overlap-param-gather"],
}
# micro-batch 2 x data-parallel 4 ranks x M micro-batches
GLOBAL_BATCH = {1: "8", 4: "32"}


@pytest.mark.parametrize("micro", list(GLOBAL_BATCH))
@pytest.mark.parametrize("overlap", list(OVERLAP))
def test_overlapped_reductions_match_alltoall(overlap, micro, tmp_path):
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    flags = [*OVERLAP[overlap], "--global-batch-size", GLOBAL_BATCH[micro]]
    oracle = train(4, flags, "alltoall")
    assert_same_training(train(4, flags, "hybridep", plan=plan), oracle)
    assert_same_training(train(4, [*flags, "--hybridep-async-grad-return"], "hybridep", plan=plan), oracle)


def test_overlapped_param_gather_with_expert_data_parallelism_matches_alltoall(tmp_path):
    """8 ranks as 4 DCs x 2 with EP 4: two expert data-parallel replicas, so the distributed
    optimizer shards the experts and --overlap-param-gather leaves half of each owner's updated
    expert to the next forward's all-gather. HybridEP reads the owners' experts right after the
    step (the next gathers), so it must finish that all-gather first (runtime.expert_param_sync);
    without it the second iteration's loss was off by 4e-3."""
    topology = write_topology(str(tmp_path / "topo.yaml"), dcs=4, per_dc=2)
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    flags = [*OVERLAP["param-gather"], "--expert-model-parallel-size", "4", "--global-batch-size", "32"]
    oracle = train(8, flags, "alltoall", topology=topology)
    assert_same_training(train(8, flags, "hybridep", plan=plan, topology=topology), oracle)
    assert_same_training(train(8, [*flags, "--hybridep-async-grad-return"], "hybridep", plan=plan,
                               topology=topology), oracle)


PIPELINES = {
    "pp2-ep4-1f1b": ["--pipeline-model-parallel-size", "2"],
    "pp2-vpp2-ep4": ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                     "--num-layers-per-virtual-pipeline-stage", "1"],
}


@pytest.mark.parametrize("layout", list(PIPELINES))
def test_overlapped_reduction_under_pipeline_parallelism_matches_alltoall(layout, tmp_path):
    """8 ranks as 4 DCs x 2, PP 2 x EP 4, 4 micro-batches: the CPU loop sets the schedule's
    grad_sync_func as Megatron's train() does, so later stages run their last backward under
    no_sync and the schedule starts each chunk's reduction; the chunk's borrowed gradients are
    returned first (without it: 'borrowed gradients were still owed')."""
    topology = write_topology(str(tmp_path / "topo.yaml"), dcs=4, per_dc=2)
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    flags = ["--hybridep-fp64", "--overlap-grad-reduce", "--expert-model-parallel-size", "4",
             "--global-batch-size", "32", *PIPELINES[layout]]
    oracle = train(8, flags, "alltoall", topology=topology)
    assert_same_training(train(8, flags, "hybridep", plan=plan, topology=topology), oracle)
    assert_same_training(train(8, [*flags, "--hybridep-async-grad-return"], "hybridep", plan=plan,
                               topology=topology), oracle)


def _collects(ctx, argv: list[str]) -> list[tuple[bool, int]]:
    """(inside the backward?, returns collected) for every collect_grad_returns call of one run."""
    import torch

    from megatron_hybridep.megatron.arguments import parse
    from megatron_hybridep.runtime.context import HybridEPRuntime
    from megatron_hybridep.train import cpu_loop

    seen = []
    inner = HybridEPRuntime.collect_grad_returns

    def collect(self):  # noqa: ANN001, ANN202
        n = inner(self)
        seen.append((torch._C._current_autograd_node() is not None, n))
        return n

    HybridEPRuntime.collect_grad_returns = collect
    cpu_loop.run(parse(argv, default_config=PRESET))
    return seen


def test_async_returns_are_collected_inside_the_backward_bucket_by_bucket(tmp_path):
    """Small buckets, 4 micro-batches: from the second iteration (Megatron starts buckets from its
    grad hooks once it has counted them) each layer's return is collected by the expert bucket that
    needs it, from inside the backward, one layer at a time; finalize finds nothing left."""
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    argv = [*TINY, "--train-iters", "3", "--hybridep-nproc", "4", *OVERLAP["grad-reduce-small-buckets"],
            "--global-batch-size", "32", "--hybridep-async-grad-return", "--hybridep-plan", plan]
    for seen in run_ranks(_collects, 4, argv, timeout=300):
        first, later = seen[:5], seen[5:]  # iteration 1: finalize (both layers) + 4 expert buckets
        assert first[0] == (False, 2) and sum(n for _, n in first) == 2, seen
        inside = [n for backward, n in later if backward]
        assert sorted(inside) == [0, 0, 0, 0, 1, 1, 1, 1], seen  # 2 iterations x 4 buckets, a layer each
        assert all(n == 0 for backward, n in later if not backward), seen
