"""A rank killed while a checkpoint is being saved: the previous checkpoint is still the latest, it
loads, and the resumed run reproduces the uninterrupted run's losses (issue 16, section 2)."""

import os

import pytest

from megatron_hybridep.train.launch import RankFailure, run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESET = os.path.join(REPO, "configs", "presets", "cpu_demo.yaml")
COMMON = ["--train-iters", "6", "--log-interval", "100", "--lr-warmup-iters", "1"]


def _train(ctx, argv):
    from megatron_hybridep.megatron.arguments import parse
    from megatron_hybridep.train import cpu_loop

    return cpu_loop.run(parse(argv, default_config=PRESET)).losses


def test_rank_killed_mid_save_keeps_the_previous_checkpoint_and_resume_matches(tmp_path):
    from megatron_hybridep.train.checkpoint import latest_iteration

    full = run_ranks(_train, 4, COMMON, timeout=300)[0]
    ckpt = str(tmp_path / "ckpt")
    saving = [*COMMON, "--save", ckpt, "--save-interval", "2"]
    with pytest.raises(RankFailure) as info:
        run_ranks(_train, 4, saving, timeout=300, env={"HYBRIDEP_TEST_DIE_IN_SAVE": "1:4"})
    assert "exit code -9" in info.value.reports[1]  # SIGKILLed in the middle of saving iteration 4
    assert latest_iteration(ckpt) == 2
    assert not os.path.exists(os.path.join(ckpt, "iter_0000004"))  # never a half-written checkpoint
    resumed = run_ranks(_train, 4, [*saving, "--load", ckpt], timeout=300)[0]
    assert resumed == pytest.approx(full[2:], abs=1e-6), (resumed, full)
    assert latest_iteration(ckpt) == 6 and not os.path.exists(os.path.join(ckpt, "iter_0000004.partial"))
