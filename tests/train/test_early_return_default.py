"""--hybridep-early-grad-return's default, auto: the returned gradients leave in two parts (the first
M-1 micro-batches' share during the last micro-batch, the rest at 16x) wherever the split applies,
compressed returns held for the iteration, and nowhere else; the planner prices what the runtime runs
and the start-up log says it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_hybridep.megatron.arguments import parse
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.workload import EARLY_RETURN_RATIO
from megatron_hybridep.train.planning import early_return, migration_from_args, workload_for

PRESET = str(Path(__file__).resolve().parents[2] / "configs" / "presets" / "cpu_demo.yaml")
COMPRESSED = ["--hybridep-compression-ratio", "10", "--hybridep-grad-compression-ratio", "4"]


@pytest.mark.parametrize("text, value", [(None, None), ("auto", None), ("off", 0.0), ("0", 0.0), ("16", 16.0),
                                         ("1", 1.0)])
def test_the_flag_takes_auto_off_or_a_ratio(text, value):
    args = parse([] if text is None else ["--hybridep-early-grad-return", text])
    assert args.hybridep_early_grad_return == value


@pytest.mark.parametrize("bad", ["0.5", "-1", "inf", "x"])
def test_a_bad_value_is_refused_naming_the_flag(bad, capsys):
    with pytest.raises(SystemExit):
        parse(["--hybridep-early-grad-return", bad])
    assert "--hybridep-early-grad-return" in capsys.readouterr().err


@pytest.mark.parametrize("flags, ratio", [
    (COMPRESSED, EARLY_RETURN_RATIO),  # compressed returns, copies held (auto): split
    (["--hybridep-compression-ratio", "10"], 0.0),  # exact returns: nothing to split
    ([], 0.0),  # nothing compressed
    ([*COMPRESSED, "--hybridep-borrowed-copies", "microbatch"], 0.0),  # returned every micro-batch
    ([*COMPRESSED, "--hybridep-early-grad-return", "0"], 0.0),  # turned off
    ([*COMPRESSED, "--hybridep-early-grad-return", "8"], 8.0),  # asked for
    (["--hybridep-grad-compression-ratio", "2"], EARLY_RETURN_RATIO),  # under the cap: the rest 8x smaller
    (["--hybridep-grad-compression-ratio", "50", "--hybridep-max-grad-compression-ratio", "0"], 0.0),  # past the
    #   cap a 16x rest would be larger than one return
])
def test_auto_splits_where_it_applies_and_the_planner_prices_what_runs(flags, ratio):
    args = parse(flags, default_config=PRESET)
    assert early_return(args) == ratio
    assert migration_from_args(args).early_return_rest_ratio == ratio
    assert workload_for(args, 4).early_return_rest_ratio == ratio


def test_auto_is_off_when_the_held_copies_do_not_fit():
    """auto borrowed copies resolve to per micro-batch when held copies exceed the memory (build_runtime)."""
    args = parse(COMPRESSED)
    assert early_return(args, held=True) == EARLY_RETURN_RATIO and early_return(args, held=False) == 0.0
    per_micro_batch = dataclasses.replace(migration_from_args(args), hold_copies=False,
                                          early_return_rest_ratio=early_return(args, held=False))
    assert per_micro_batch.early_return_rest_ratio == 0.0


def test_auto_is_not_refused_where_an_explicit_split_is():
    from megatron_hybridep.megatron.supported import UnsupportedConfiguration

    per_micro_batch = [*COMPRESSED, "--hybridep-borrowed-copies", "microbatch"]
    assert early_return(parse(per_micro_batch, default_config=PRESET)) == 0.0  # the preset runs hybridep
    assert early_return(parse(["--hybridep-compression-ratio", "10"], default_config=PRESET)) == 0.0
    with pytest.raises(UnsupportedConfiguration, match="^--hybridep-early-grad-return:"):
        parse([*per_micro_batch, "--hybridep-early-grad-return", "16"], default_config=PRESET)


@pytest.mark.parametrize("global_batch, said", [(32, True), (4, False)])
def test_the_start_up_log_says_the_return_is_split(global_batch, said, capsys):
    from megatron_hybridep.train.reporting import Reporter

    args = parse([*COMPRESSED, "--global-batch-size", str(global_batch), "--micro-batch-size", "1"],
                 default_config=PRESET)
    args.data_parallel_size = 4  # M = 8 or 1
    plan = Plan.grid((2, 2), (2, 1), 8, ("dc", "gpu"))
    choice = SimpleNamespace(topology=SimpleNamespace(describe=lambda: "2 dc x 2 gpu", source="test"), plan=plan,
                             result=None)
    runtime = SimpleNamespace(migration=migration_from_args(args))
    Reporter(args, choice, runtime, rank=0)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert ("returned gradients in two parts" in out) == said
    assert ("rest at 16x (--hybridep-early-grad-return; 0 turns it off)" in out) == said
