"""Matrix: activation recompute, full (every layer's forward re-run in backward) and selective
(--recompute-modules moe: the MoE layer re-run). HybridEP's borrowed expert copies are gathered
once per iteration and reused by the recomputed forward, so the result equals alltoall's."""

import pytest

from tests.matrix.harness import assert_same_training, train, write_cross_dc_plan

pytestmark = pytest.mark.matrix

RECOMPUTE = {
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "selective-moe": ["--recompute-granularity", "selective", "--recompute-modules", "moe"],
}


@pytest.mark.parametrize("mode", list(RECOMPUTE))
def test_recompute_matches_alltoall(mode, tmp_path):
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    flags = ["--hybridep-fp64", *RECOMPUTE[mode]]
    assert_same_training(train(4, flags, "hybridep", plan=plan), train(4, flags, "alltoall"))
