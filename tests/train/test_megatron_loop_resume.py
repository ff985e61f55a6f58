"""pretrain_moe.py's GPU path runs Megatron's own loop (megatron.training.pretrain). Here it runs on
CPU (gloo, cpu_runtime's patches) to check that a hybridep run with compression, stopped with
--exit-interval N --save and resumed with --load through Megatron's own save/load, equals the
uninterrupted run bit for bit (issue 28): the runtime's post-step is deferred to the next
train_step, so Megatron's save sees nothing in flight, and its state is saved in its own part."""

import functools
import math
import os

import pytest
import torch

from megatron_hybridep.train.checkpoint import latest_iteration
from megatron_hybridep.train.launch import run_ranks
from tests.matrix.harness import PRESET, TINY

pytestmark = pytest.mark.exactness

ITERS, STOP = 6, 4
# float32 (the codec has no float64 values); the shared expert is refreshed every 2 steps: one
# refresh falls on the save (4), one after it
BASE = [*TINY, "--train-iters", str(ITERS), "--hybridep-nproc", "2", "--expert-model-parallel-size", "2",
        "--mock-data", "--num-workers", "0", "--eval-interval", "1000", "--eval-iters", "0"]
HYBRIDEP = ["--moe-token-dispatcher-type", "hybridep", "--hybridep-compression-ratio", "10",
            "--hybridep-grad-compression-ratio", "10", "--hybridep-shared-refresh-interval", "2"]


@pytest.fixture(scope="module")
def compressed(tmp_path_factory) -> list[str]:
    """HybridEP with compression on one domain across the 2 DCs, pinned by a plan file: on CPU ranks the
    planner would run that domain exact (the codec's compute costs more than it saves on loopback)."""
    from megatron_hybridep.plan.plan import Plan

    plan = str(tmp_path_factory.mktemp("plan") / "plan.json")
    Plan.grid((2, 1), (2, 1), 8, ("dc", "gpu")).save(plan)
    return [*BASE, *HYBRIDEP, "--hybridep-plan", plan]


def _megatron_loop(ctx, argv: list[str]) -> tuple[list[float], dict[str, torch.Tensor]]:  # noqa: ANN001
    """gpu_pretrain.pretrain on this rank; (loss per iteration, parameters at the end)."""
    from megatron.training import training

    from megatron_hybridep.megatron import cpu_runtime, training_hooks
    from megatron_hybridep.megatron.arguments import parse
    from megatron_hybridep.train import gpu_pretrain

    cpu_runtime.enable()
    training_hooks.after_each_step()
    hooked = training.train_step
    losses: list[float] = []
    chunks: list = []

    def train_step(*args, **kwargs):  # records what Megatron's loop sees
        out = hooked(*args, **kwargs)
        chunks[:] = kwargs.get("model", args[2] if len(args) > 2 else None)
        loss = out[0].get("lm loss")
        losses.append(float(loss[0] / loss[1]) if loss is not None and loss.numel() == 2 else
                      float(loss) if loss is not None else math.nan)
        return out

    train_step._hybridep = True  # pretrain() must not wrap it again
    training.train_step = train_step
    try:
        gpu_pretrain.pretrain(parse(argv, default_config=PRESET))
    except SystemExit as e:  # --exit-interval: Megatron's train() ends the process with sys.exit(0)
        assert not e.code, e.code
    params = {n: p.detach().clone().double() for c in chunks for n, p in c.module.named_parameters()}
    return losses, params


def _run(argv: list[str]) -> list[tuple[list[float], dict[str, torch.Tensor]]]:
    return run_ranks(_megatron_loop, 2, argv, timeout=120)


@functools.cache
def _uninterrupted(flags: tuple[str, ...]) -> list[tuple[list[float], dict[str, torch.Tensor]]]:
    return _run(list(flags))


@pytest.mark.parametrize("training, around_save", [
    ([], []),
    # train() evaluates before it saves: the evaluation runs the post-step, the save sees the state
    # before it (the uninterrupted run does not evaluate: an evaluation does not change training)
    ([], ["--eval-interval", str(STOP), "--eval-iters", "1"]),
    # the distributed optimizer's step leaves the parameters' all-gather to the next forward (bf16:
    # with float32 parameters Megatron's own load of its state fails, a view of a grad-requiring leaf)
    (["--use-distributed-optimizer", "--overlap-param-gather", "--overlap-grad-reduce", "--bf16"], []),
], ids=["save", "evaluate-then-save", "distopt-overlap-bf16"])
def test_megatron_loop_resumes_a_compressed_hybridep_run_bit_for_bit(training, around_save, tmp_path, compressed):
    ckpt = str(tmp_path / "ckpt")
    flags = [*compressed, *training]
    uninterrupted = _uninterrupted(tuple(flags))
    stopped = _run([*flags, *around_save, "--save", ckpt, "--save-interval", "100", "--exit-interval", str(STOP)])
    assert all(len(losses) == STOP for losses, _ in stopped) and latest_iteration(ckpt) == STOP
    resumed = _run([*flags, *around_save, "--load", ckpt])
    for (full_losses, full_params), (losses, params) in zip(uninterrupted, resumed, strict=True):
        assert len(losses) == ITERS - STOP and not any(math.isnan(x) for x in losses)
        assert losses == full_losses[STOP:], f"resumed {losses} vs uninterrupted {full_losses[STOP:]}"
        assert params.keys() == full_params.keys()
        diff = max((params[n] - full_params[n]).abs().max().item() for n in params)
        assert diff == 0.0, f"parameters after the resume differ by up to {diff:.3g}"


def test_checkpoints_move_between_hybridep_and_alltoall(tmp_path, compressed):
    """The runtime's state is a part of its own: alltoall loads a hybridep checkpoint of Megatron's
    loop (and saves none), and hybridep resumes from that one with a fresh codec, and trains."""
    ckpt = str(tmp_path / "ckpt")
    save = ["--save", ckpt, "--save-interval", "100"]
    _run([*compressed, *save, "--exit-interval", "2"])
    state = _runtime_state(ckpt, 2)
    assert state["step"] == 1 and state["layers"][0]["gathers"][0]["copies"] is not None
    alltoall = _run([*BASE, "--moe-token-dispatcher-type", "alltoall", "--load", ckpt, *save, "--exit-interval", "4"])
    assert all(len(losses) == 2 and all(map(math.isfinite, losses)) for losses, _ in alltoall)
    assert latest_iteration(ckpt) == 4 and not os.path.exists(os.path.join(ckpt, "iter_0000004", "hybridep"))
    hybridep = _run([*compressed, "--load", ckpt])
    assert all(len(losses) == 2 and all(map(math.isfinite, losses)) for losses, _ in hybridep)


def _runtime_state(ckpt: str, iteration: int, rank: int = 1):
    path = os.path.join(ckpt, f"iter_{iteration:07d}", "hybridep", f"rank_{rank:05d}.pt")
    return torch.load(path, weights_only=True)["runtime"]
