"""Matrix: Megatron's overlapped data-parallel reductions (--overlap-grad-reduce: DDP buckets
reduced from the grad hooks of the last micro-batch's backward; --overlap-param-gather with the
distributed optimizer: parameters all-gathered during the next forward), at 1 and 4 micro-batches,
with HybridEP domains across DCs. The borrowed experts' gradient return runs blocking, and with
--hybridep-async-grad-return launched in the backward and collected before the experts' bucket
is reduced (megatron/grad_sync.py)."""

import pytest

from tests.matrix.harness import assert_same_training, train, write_cross_dc_plan

pytestmark = pytest.mark.matrix

OVERLAP = {
    "grad-reduce": ["--hybridep-fp64", "--overlap-grad-reduce"],
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
