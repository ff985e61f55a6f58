"""Matrix: Megatron's distributed optimizer (--use-distributed-optimizer: main params and Adam state
sharded over data-parallel ranks, gradients reduce-scattered, parameters all-gathered), and its
checkpoint: a run resumed from a saved iteration ends where the uninterrupted run ends."""

import math
import os

import pytest

from megatron_hybridep.train.checkpoint import TRACKER, latest_iteration
from tests.matrix.harness import assert_same_training, max_differences, train, write_cross_dc_plan

pytestmark = pytest.mark.matrix

DISTOPT = ["--hybridep-fp64", "--use-distributed-optimizer"]


def test_distributed_optimizer_matches_alltoall(tmp_path):
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    assert_same_training(train(4, DISTOPT, "hybridep", plan=plan), train(4, DISTOPT, "alltoall"))


@pytest.mark.parametrize("dispatcher", ["alltoall", "hybridep"])
def test_distributed_optimizer_checkpoint_resumes_the_uninterrupted_run(dispatcher, tmp_path):
    plan = write_cross_dc_plan(str(tmp_path / "plan.json")) if dispatcher == "hybridep" else None
    ckpt = str(tmp_path / "ckpt")
    # The uninterrupted run saves at iterations 2 and 4 (saving does not change training);
    # pointing the tracker back at 2 makes a fresh run resume from the middle of it.
    full = train(4, [*DISTOPT, "--save", ckpt, "--save-interval", "2"], dispatcher, plan=plan, iters=4)
    assert latest_iteration(ckpt) == 4
    with open(os.path.join(ckpt, TRACKER), "w") as f:
        f.write("2")
    resumed = train(4, [*DISTOPT, "--load", ckpt], dispatcher, plan=plan, iters=4)
    assert all(len(losses) == 2 for losses, _ in resumed)
    # Model, sharded Adam state (moments and step) and scheduler all came back: iterations 3-4 and
    # the final parameters equal the uninterrupted run's bit for bit (same machine, same ops in the
    # same order, as tests/train's resume test; a tolerance would be a guess). A wrong Adam step
    # alone moved the loss by 3e-3.
    assert any(not math.isnan(x) for losses, _ in resumed for x in losses)
    loss, param = max_differences(resumed, [(losses[2:], params) for losses, params in full])
    assert loss == 0.0 and param == 0.0, f"resumed vs uninterrupted: loss {loss:.3g}, param {param:.3g}"
