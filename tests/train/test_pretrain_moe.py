"""pretrain_moe.py: the built-in default trains (shortened), presets load/override/reject, and a
run interrupted and resumed from a checkpoint reproduces the uninterrupted losses exactly."""

import os
import re
import subprocess
import sys

import pytest
import torch

from megatron_hybridep.train.launch import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESET = os.path.join(REPO, "configs", "presets", "cpu_demo.yaml")
NO_CUDA = "No CUDA runtime is found"


def test_default_run_learns_the_synthetic_corpus():
    out = subprocess.run([sys.executable, "pretrain_moe.py", "--train-iters", "60", "--log-interval", "20"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    first, last = map(float, re.search(r"loss\s+([\d.]+) -> ([\d.]+)", out.stdout).groups())
    unigram = float(re.search(r"unigram ([\d.]+)", out.stdout).group(1))
    assert last < first - 1.5 and last < unigram - 1.0, out.stdout[-2000:]
    assert "plan               domains" in out.stdout  # the planner picked a HybridEP plan
    assert "inter-DC traffic" in out.stdout and "NOT shaped" in out.stdout
    assert NO_CUDA not in out.stdout + out.stderr


def test_no_cuda_runtime_line_stays_out_of_cpu_runs():
    """torch logs it when Megatron imports torch.utils.cpp_extension on a machine without CUDA:
    pretrain_moe.py filters it before that import (the ranks' fork server does too: runtime/logs.py)."""
    out = subprocess.run([sys.executable, "-c", "import pretrain_moe, torch.utils.cpp_extension"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and NO_CUDA not in out.stdout + out.stderr, out.stderr[-2000:]


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


@pytest.mark.parametrize("flag, value, message", [
    ("--hybridep-replan-interval", "-1", "negative; fix"),
    ("--hybridep-replan-replicas", "two", "not an integer; fix"),
    ("--hybridep-replan-horizon", "0", "must be >= 1; fix"),
])
def test_scheduler_flags_reject_bad_values_naming_the_flag(flag, value, message, capsys):
    from megatron_hybridep.megatron.arguments import parse

    with pytest.raises(SystemExit):
        parse([flag, value], default_config=PRESET)
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and message in err, err
    args = parse(["--hybridep-replan-interval", "5", "--hybridep-replan-replicas", "2"], default_config=PRESET)
    assert (args.hybridep_replan_interval, args.hybridep_replan_replicas, args.hybridep_replan_horizon) == (5, 2, 100)


def test_scheduler_replicas_with_a_capacity_factor_fail_before_any_collective():
    import argparse

    from megatron_hybridep.plan.errors import PlanError
    from megatron_hybridep.train.planning import build_runtime

    args = argparse.Namespace(hybridep_replan_replicas=2, moe_expert_capacity_factor=1.0)
    with pytest.raises(PlanError, match=r"--hybridep-replan-replicas.*capacity-factor.*fix"):
        build_runtime(args, choice=None)  # no process group exists: it must not get that far


def _train(ctx, argv):
    from megatron_hybridep.megatron.arguments import parse
    from megatron_hybridep.train import cpu_loop

    return cpu_loop.run(parse(argv, default_config=PRESET)).losses


@pytest.mark.exactness
def test_resume_reproduces_uninterrupted_losses(tmp_path):
    common = ["--log-interval", "100", "--lr-warmup-iters", "2"]
    ckpt = str(tmp_path / "ckpt")
    # The uninterrupted run's own checkpoint of iteration 4 (the separate --exit-interval run is
    # tests/train/test_exact_resume.py's dropout test): a save must not disturb the run either.
    full = run_ranks(_train, 4, ["--train-iters", "8", "--save", ckpt, "--save-interval", "4", *common],
                     timeout=300)[0]
    resumed = run_ranks(_train, 4, ["--train-iters", "8", "--load", ckpt, "--ckpt-step", "4", *common],
                        timeout=300)[0]
    assert len(resumed) == 4
    # Same machine, same ops in the same order: bit for bit (a tolerance would be a guess).
    assert resumed == full[4:], (resumed, full)


@pytest.mark.parametrize("preset", sorted(p for p in os.listdir(os.path.join(REPO, "configs", "presets"))
                                          if p.endswith(".yaml") and not p.endswith("_base.yaml")))
def test_every_preset_parses_with_megatron_and_plans(preset, monkeypatch):
    """Each preset is valid Megatron + plugin flags and its paired topology plans."""
    from megatron_hybridep.megatron.arguments import parse
    from megatron_hybridep.train.planning import choose

    monkeypatch.chdir(REPO)
    args = parse(["--config", os.path.join("configs", "presets", preset)])
    assert args.num_experts and args.moe_token_dispatcher_type == "hybridep"
    world = args.hybridep_nproc if preset == "cpu_demo.yaml" else args.expert_model_parallel_size
    if args.hybridep_topology:
        from megatron_hybridep.plan.topology import Topology

        world = Topology.from_yaml(args.hybridep_topology).world_size
    choice = choose(args, world)
    assert choice.plan.num_experts == args.num_experts
    assert choice.result is not None and choice.result.candidates


def _short_run(ctx, argv):
    from megatron_hybridep.megatron.arguments import parse
    from megatron_hybridep.train import cpu_loop

    s = cpu_loop.run(parse(argv, default_config=PRESET))
    return s.losses


def _write_indexed_dataset(prefix, vocab, docs=64, seed=0):
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for _ in range(docs):
        builder.add_document(torch.from_numpy(rng.integers(0, vocab - 1, 200).astype(np.int32)), [200])
    builder.finalize(prefix + ".idx")


@pytest.mark.parametrize("data", ["mock", "indexed"])
def test_megatron_datasets_train_and_log_to_tensorboard(data, tmp_path):
    argv = ["--train-iters", "3", "--lr-warmup-iters", "1", "--expert-model-parallel-size", "2",
            "--global-batch-size", "8", "--hybridep-nproc", "2", "--log-interval", "1",
            "--tensorboard-dir", str(tmp_path / "tb"),
            "--data-cache-path", str(tmp_path / "cache")]
    if data == "mock":
        argv += ["--mock-data"]
    else:
        _write_indexed_dataset(str(tmp_path / "corpus"), vocab=256)
        argv += ["--data-path", str(tmp_path / "corpus"), "--split", "100,0,0"]
    losses = run_ranks(_short_run, 2, argv, timeout=300)[0]
    assert len(losses) == 3 and all(0 < x < 10 for x in losses)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/step_time_s", "train/inter_dc_bytes", "train/exposed_comm_s",
            "train/predicted_step_time_s"} <= tags, tags
    assert [round(e.value, 4) for e in acc.Scalars("train/loss")] == [round(x, 4) for x in losses]


def _run_collect(ctx, argv):
    from megatron_hybridep.megatron.arguments import parse
    from megatron_hybridep.train import cpu_loop

    s = cpu_loop.run(parse(argv, default_config=PRESET), collect_params=True)
    return s.params


@pytest.mark.exactness
@pytest.mark.parametrize("saved_with,loaded_with", [("hybridep", "alltoall"), ("alltoall", "hybridep")])
def test_checkpoints_move_between_hybridep_and_alltoall(saved_with, loaded_with, tmp_path):
    """Borrowed copies are never saved: a checkpoint written under one dispatcher loads under the
    other with identical parameters (and the same keys)."""
    common = ["--lr-warmup-iters", "1", "--log-interval", "100", "--save-interval", "2"]
    ckpt = str(tmp_path / "ckpt")
    saved = run_ranks(_run_collect, 4, ["--train-iters", "2", "--moe-token-dispatcher-type", saved_with,
                                        "--save", ckpt, *common], timeout=300)
    loaded = run_ranks(_run_collect, 4, ["--train-iters", "2", "--moe-token-dispatcher-type", loaded_with,
                                         "--load", ckpt, *common], timeout=300)
    for rank, (a, b) in enumerate(zip(saved, loaded, strict=True)):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), f"rank {rank}: {name} differs after load"


def test_auto_runs_the_best_plan_for_the_configured_ep_size_and_says_when_replicated_is_faster(caplog):
    import logging

    from megatron_hybridep.megatron.arguments import parse
    from megatron_hybridep.train.planning import choose

    args = parse([], default_config=PRESET)
    with caplog.at_level(logging.WARNING, logger="hybridep.planning"):
        choice = choose(args, 4)
    assert choice.plan.kind != "replicated" and choice.dispatcher == "hybridep"
    assert choice.result.best == choice.plan
    cheapest = choice.result.candidates[0]
    assert cheapest.plan.kind == "replicated"  # on the demo's links the cost model prefers it
    assert "--moe-token-dispatcher-type alltoall --expert-model-parallel-size 2" in caplog.text
    assert choice.result.chosen.cost.total > cheapest.cost.total
