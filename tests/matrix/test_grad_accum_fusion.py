"""Matrix: --gradient-accumulation-fusion (Megatron's default on GPU). Megatron's fused linear layers
add each weight's gradient into ``weight.main_grad``; borrowed expert copies get a main_grad of
their own and return its sum to the owners (runtime/borrowed.py FusedWgrad).

Megatron takes the fused wgrad kernel from Apex, which is neither on the package index nor on CPU:
megatron_hybridep.testing.fused_wgrad stands in for it with Apex's contract. bf16, 4
micro-batches, domains across DCs; the tolerance is twice alltoall's own bf16 error against float64
(harness.assert_within_oracle_rounding)."""

import pytest

from megatron_hybridep.train.launch import run_ranks
from tests.matrix.harness import PRESET, TINY, assert_within_oracle_rounding, train, write_cross_dc_plan

pytestmark = pytest.mark.matrix

FLAGS = ["--bf16", "--global-batch-size", "32"]  # 4 ranks of data parallelism x micro-batch 2: 4 micro-batches


def _fused_run(ctx, argv: list[str]):
    from megatron_hybridep.megatron.arguments import parse
    from megatron_hybridep.testing import fused_wgrad
    from megatron_hybridep.train import cpu_loop

    stand_in = fused_wgrad.install()
    args = parse(argv, default_config=PRESET)
    args.gradient_accumulation_fusion = True  # the presets turn it off; Megatron's flag only turns it off
    summary = cpu_loop.run(args, collect_params=True)
    assert stand_in.calls, "the fused wgrad path never ran"
    return summary.losses, {name: p.double() for name, p in summary.params.items()}


def _train_fused(dispatcher: str, plan: str | None = None):
    argv = [*TINY, "--train-iters", "3", "--hybridep-nproc", "4", *FLAGS, "--moe-token-dispatcher-type", dispatcher]
    if plan is not None:
        argv += ["--hybridep-plan", plan]
    return run_ranks(_fused_run, 4, argv, timeout=300)


def test_gradient_accumulation_fusion_matches_alltoall_within_its_own_rounding(tmp_path):
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    exact = train(4, ["--hybridep-fp64", "--global-batch-size", "32"], "alltoall")
    oracle = _train_fused("alltoall")
    hybrid = _train_fused("hybridep", plan)
    assert_within_oracle_rounding(hybrid, oracle, exact, " with fusion")
