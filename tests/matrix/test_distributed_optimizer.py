"""Matrix: Megatron's distributed optimizer (--use-distributed-optimizer: main params and Adam state
sharded over data-parallel ranks, gradients reduce-scattered, parameters all-gathered). Its
checkpoint is refused on CPU for now (megatron/supported.py, test_refusals.py)."""

import pytest

from tests.matrix.harness import assert_same_training, train, write_cross_dc_plan

pytestmark = pytest.mark.matrix

DISTOPT = ["--hybridep-fp64", "--use-distributed-optimizer"]


def test_distributed_optimizer_matches_alltoall(tmp_path):
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    assert_same_training(train(4, DISTOPT, "hybridep", plan=plan), train(4, DISTOPT, "alltoall"))
