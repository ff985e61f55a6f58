"""--hybridep-max-grad-compression-ratio: the returned-gradient ratio the job runs is capped where the
8-seed study found it costs quality (docs/compression.md), and the log says so."""

from __future__ import annotations

import pytest

from megatron_hybridep.megatron.arguments import parse
from megatron_hybridep.train.planning import grad_ratio, migration_from_args, ratio_notice


def test_the_cap_lowers_the_ratio_and_says_so():
    args = parse(["--hybridep-grad-compression-ratio", "50"])
    assert args.hybridep_max_grad_compression_ratio == 10.0 and grad_ratio(args) == 10.0
    assert migration_from_args(args).grad_compression_ratio == 10.0
    assert "capped at 10" in ratio_notice(args) and "--hybridep-max-grad-compression-ratio" in ratio_notice(args)


@pytest.mark.parametrize("cap, runs", [("0", 50.0), ("100", 50.0), ("20", 20.0)])
def test_a_raised_or_no_cap_runs_what_is_asked(cap, runs):
    args = parse(["--hybridep-grad-compression-ratio", "50", "--hybridep-max-grad-compression-ratio", cap])
    assert grad_ratio(args) == runs
    assert (ratio_notice(args) is None) == (runs == 50.0)


def test_weights_and_gradients_both_compressed_are_noted():
    both = ratio_notice(parse(["--hybridep-compression-ratio", "50", "--hybridep-grad-compression-ratio", "10"]))
    assert both is not None and "both compressed" in both and "capped" not in both
    capped = ratio_notice(parse(["--hybridep-compression-ratio", "50", "--hybridep-grad-compression-ratio", "50"]))
    assert len(capped.splitlines()) == 2 and "capped at 10" in capped
    assert ratio_notice(parse(["--hybridep-compression-ratio", "50"])) is None  # weights alone


def test_under_the_cap_nothing_changes():
    args = parse(["--hybridep-grad-compression-ratio", "4"])
    assert grad_ratio(args) == 4.0 and ratio_notice(args) is None


@pytest.mark.parametrize("bad", ["0.5", "-1", "inf", "x"])
def test_a_bad_cap_is_refused(bad, capsys):
    with pytest.raises(SystemExit):
        parse(["--hybridep-max-grad-compression-ratio", bad])
    assert "--hybridep-max-grad-compression-ratio" in capsys.readouterr().err


def test_the_plan_command_notes_a_ratio_past_the_cap(capsys):
    import os

    from megatron_hybridep.cli import main

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base = ["plan", "--topology", os.path.join(root, "configs", "topologies", "2dc_x_8.yaml"), "--model",
            os.path.join(root, "configs", "models", "paper-s.yaml"), "--tokens-per-rank", "4096", "--top", "1"]
    assert main([*base, "--grad-compression-ratio", "50"]) == 0
    assert "note      returned gradients at 50x cost model quality above 10x" in capsys.readouterr().out
    assert main([*base, "--grad-compression-ratio", "10"]) == 0
    assert "note " not in capsys.readouterr().out
