"""Exact resume (issue 28, item 1): a run stopped with --exit-interval N --save and resumed with
--load equals the uninterrupted run bit for bit, losses at every iteration and every parameter, with
the runtime's own state (incremental codec copies, error-feedback residuals, the shared expert and
its refresh counter) and the RNG saved next to Megatron's checkpoint (train/checkpoint.py)."""

import math
import os

import pytest
import torch

from megatron_hybridep.train.checkpoint import latest_iteration
from tests.matrix.harness import max_differences, train, write_cross_dc_plan

pytestmark = pytest.mark.exactness

# float32 (the codec has no float64 values): same machine, same ops in the same order, so bit for
# bit. The shared expert is refreshed every 2 steps: one refresh falls on the save (4), one after it.
COMPRESSED = ["--hybridep-compression-ratio", "10", "--hybridep-grad-compression-ratio", "10",
              "--hybridep-shared-refresh-interval", "2"]
ITERS, STOP = 6, 4


def _stop_and_resume(flags, dispatcher, plan, ckpt):
    """(loss, parameter) largest differences between the uninterrupted run and the one stopped at
    STOP (--exit-interval, saving on the way out as Megatron does) and resumed to ITERS."""
    full = train(4, flags, dispatcher, plan=plan, iters=ITERS)
    saving = [*flags, "--save", ckpt, "--save-interval", "100"]
    stopped = train(4, [*saving, "--exit-interval", str(STOP)], dispatcher, plan=plan, iters=ITERS)
    assert all(len(losses) == STOP for losses, _ in stopped) and latest_iteration(ckpt) == STOP
    resumed = train(4, [*flags, "--load", ckpt], dispatcher, plan=plan, iters=ITERS)
    assert all(len(losses) == ITERS - STOP for losses, _ in resumed)
    assert any(not math.isnan(x) for losses, _ in resumed for x in losses)
    return max_differences(resumed, [(losses[STOP:], params) for losses, params in full])


@pytest.mark.parametrize("extra", [
    [],                                                  # copies held for the iteration
    ["--hybridep-borrowed-copies", "microbatch"],        # a gather per micro-batch
    ["--hybridep-no-shared-expert"],                     # plain top-k: copies seeded with zeros
    ["--use-distributed-optimizer"],
], ids=["iteration", "microbatch", "topk", "distopt"])
def test_compressed_run_resumes_bit_for_bit(extra, tmp_path):
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    loss, param = _stop_and_resume([*COMPRESSED, *extra], "hybridep", plan, str(tmp_path / "ckpt"))
    assert loss == 0.0 and param == 0.0, f"resumed vs uninterrupted: loss {loss:.3g}, param {param:.3g}"


def test_dropout_resumes_bit_for_bit(tmp_path):
    """The RNG comes back: dropout masks after the resume are the uninterrupted run's."""
    flags = ["--hybridep-fp64", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    loss, param = _stop_and_resume(flags, "alltoall", None, str(tmp_path / "ckpt"))
    assert loss == 0.0 and param == 0.0, f"resumed vs uninterrupted: loss {loss:.3g}, param {param:.3g}"


def _runtime_state(ckpt, iteration, rank):
    path = os.path.join(ckpt, f"iter_{iteration:07d}", "hybridep", f"rank_{rank:05d}.pt")
    return torch.load(path, map_location="cpu", weights_only=True)["runtime"]


@pytest.mark.parametrize("saved_with,loaded_with", [("hybridep", "alltoall"), ("alltoall", "hybridep")])
def test_compressed_checkpoints_move_between_hybridep_and_alltoall(saved_with, loaded_with, tmp_path):
    """The runtime's state is a part of its own: a loader without a runtime ignores it, and a
    hybridep run started from a checkpoint without it starts its codec fresh (and trains)."""
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    ckpt = str(tmp_path / "ckpt")
    flags = {"hybridep": COMPRESSED, "alltoall": []}
    plans = {"hybridep": plan, "alltoall": None}
    train(4, [*flags[saved_with], "--save", ckpt, "--save-interval", "2", "--exit-interval", "2"], saved_with,
          plan=plans[saved_with], iters=3)
    state = _runtime_state(ckpt, 2, 1)
    if saved_with == "hybridep":  # the codec's copies and residuals are in it
        layer = state["layers"][0]["gathers"][0]
        assert state["step"] == 1 and layer["copies"] is not None and layer["grad_residuals"]
    else:
        assert state is None
    resumed = train(4, [*flags[loaded_with], "--load", ckpt], loaded_with, plan=plans[loaded_with], iters=3)
    assert all(len(losses) == 1 and math.isfinite(losses[0]) for losses, _ in resumed)
