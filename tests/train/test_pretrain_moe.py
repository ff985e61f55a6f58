"""pretrain_moe.py: the built-in default trains (shortened), presets load/override/reject, and a
run interrupted and resumed from a checkpoint reproduces the uninterrupted losses exactly."""

import os
import re
import subprocess
import sys

import pytest

from megatron_hybridep.runtime.launch import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESET = os.path.join(REPO, "configs", "presets", "cpu_demo.yaml")


def test_default_run_learns_the_synthetic_corpus():
    out = subprocess.run([sys.executable, "pretrain_moe.py", "--train-iters", "60", "--log-interval", "20"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    first, last = map(float, re.search(r"loss\s+([\d.]+) -> ([\d.]+)", out.stdout).groups())
    unigram = float(re.search(r"unigram ([\d.]+)", out.stdout).group(1))
    assert last < first - 1.5 and last < unigram - 1.0, out.stdout[-2000:]
    assert "plan               domains" in out.stdout  # the planner picked a HybridEP plan
    assert "inter-DC traffic" in out.stdout and "NOT shaped" in out.stdout


def test_preset_keys_are_checked_and_command_line_wins(tmp_path):
    from megatron_hybridep.megatron.arguments import PresetError, parse

    args = parse(["--train-iters", "7"], default_config=PRESET)
    assert args.train_iters == 7 and args.num_experts == 8 and args.moe_token_dispatcher_type == "hybridep"
    assert args.apply_rope_fusion is False  # a 'no_*: true' switch in the preset is applied
    child = tmp_path / "child.yaml"
    child.write_text(f"base: {PRESET}\nnum_experts: 16\n")
    assert parse(["--config", str(child)]).num_experts == 16
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_expertz: 8\n")
    with pytest.raises(PresetError, match=r"unknown key 'num_expertz'.*fix"):
        parse(["--config", str(bad)])
    with pytest.raises(PresetError, match="not found"):
        parse(["--config", str(tmp_path / "missing.yaml")])


def _train(ctx, argv):
    from megatron_hybridep.megatron import cpu_loop
    from megatron_hybridep.megatron.arguments import parse

    return cpu_loop.run(parse(argv, default_config=PRESET)).losses


def test_resume_reproduces_uninterrupted_losses(tmp_path):
    common = ["--log-interval", "100", "--lr-warmup-iters", "2"]
    full = run_ranks(_train, 4, ["--train-iters", "8", *common], timeout=300)[0]
    ckpt = str(tmp_path / "ckpt")
    # Interrupted at iteration 4 (Megatron's --exit-interval), same schedule as the full run.
    run_ranks(_train, 4, ["--train-iters", "8", "--exit-interval", "4", "--save", ckpt, "--save-interval", "4",
                          *common], timeout=300)
    resumed = run_ranks(_train, 4, ["--train-iters", "8", "--load", ckpt, "--save", ckpt, "--save-interval", "4",
                                     *common],
                        timeout=300)[0]
    assert len(resumed) == 4
    assert resumed == pytest.approx(full[4:], abs=1e-6), (resumed, full)
