"""Matrix: Megatron's distributed optimizer (--use-distributed-optimizer: main params and Adam state
sharded over data-parallel ranks, gradients reduce-scattered, parameters all-gathered), and its
sharded checkpoint: a run saved at iteration k and resumed equals the uninterrupted run."""

import pytest
import torch

from tests.matrix.harness import assert_same_training, train, write_cross_dc_plan

pytestmark = pytest.mark.matrix

DISTOPT = ["--hybridep-fp64", "--use-distributed-optimizer"]


def test_distributed_optimizer_matches_alltoall(tmp_path):
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    assert_same_training(train(4, DISTOPT, "hybridep", plan=plan), train(4, DISTOPT, "alltoall"))


def test_distributed_optimizer_resume_equals_uninterrupted(tmp_path):
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    ckpt = str(tmp_path / "ckpt")
    full = train(4, DISTOPT, "hybridep", plan=plan, iters=4)
    train(4, [*DISTOPT, "--save", ckpt, "--save-interval", "2", "--exit-interval", "2"], "hybridep", plan=plan,
          iters=4)
    resumed = train(4, [*DISTOPT, "--load", ckpt], "hybridep", plan=plan, iters=4)
    for rank, ((losses, params), (resumed_losses, resumed_params)) in enumerate(zip(full, resumed, strict=True)):
        assert resumed_losses == losses[2:], (rank, resumed_losses, losses)  # same schedule, same data
        for name, value in params.items():  # Adam moments and main params came back exactly
            assert torch.equal(resumed_params[name], value), f"rank {rank}: {name} differs after resume"
