"""The quality caps: --hybridep-max-compression-ratio and --hybridep-max-grad-compression-ratio (the
weight and returned-gradient ratios the job runs are capped where the 8-seed studies found they cost
quality, docs/compression.md, and the log says so) and --hybridep-max-compressed-domain (no
compressed domain of more ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_hybridep.megatron.arguments import parse
from megatron_hybridep.train.planning import grad_ratio, migration_from_args, ratio_notice, weight_ratio, workload_for

ROOT = Path(__file__).resolve().parents[2]
PRESET = str(ROOT / "configs" / "presets" / "cpu_demo.yaml")


def test_the_cap_lowers_the_ratio_and_says_so():
    args = parse(["--hybridep-grad-compression-ratio", "50"])
    assert args.hybridep_max_grad_compression_ratio == 4.0 and grad_ratio(args) == 4.0
    assert migration_from_args(args).grad_compression_ratio == 4.0
    assert "capped at 4" in ratio_notice(args) and "--hybridep-max-grad-compression-ratio" in ratio_notice(args)


@pytest.mark.parametrize("cap, runs", [("0", 50.0), ("100", 50.0), ("20", 20.0)])
def test_a_raised_or_no_cap_runs_what_is_asked(cap, runs):
    args = parse(["--hybridep-grad-compression-ratio", "50", "--hybridep-max-grad-compression-ratio", cap])
    assert grad_ratio(args) == runs
    assert (ratio_notice(args) is None) == (runs == 50.0)


def test_the_weight_cap_lowers_the_ratio_for_the_runtime_and_the_planner_and_says_so():
    args = parse(["--hybridep-compression-ratio", "50"], default_config=PRESET)
    assert args.hybridep_max_compression_ratio == 10.0 and weight_ratio(args) == 10.0
    assert migration_from_args(args).compression_ratio == 10.0
    assert workload_for(args, 4).compression_ratio == 10.0  # the plan is priced at what runs
    notice = ratio_notice(args)
    assert "--hybridep-compression-ratio 50 capped at 10" in notice and "--hybridep-max-compression-ratio" in notice
    free = parse(["--hybridep-compression-ratio", "50", "--hybridep-max-compression-ratio", "0"], default_config=PRESET)
    assert weight_ratio(free) == 50.0 and workload_for(free, 4).compression_ratio == 50.0
    assert ratio_notice(free) is None
    assert weight_ratio(parse(["--hybridep-compression-ratio", "4"])) == 4.0  # under the cap


def test_weights_and_gradients_both_compressed_are_noted():
    both = ratio_notice(parse(["--hybridep-compression-ratio", "10", "--hybridep-grad-compression-ratio", "4"]))
    assert both is not None and "both compressed" in both and "capped" not in both
    capped = ratio_notice(parse(["--hybridep-compression-ratio", "50", "--hybridep-grad-compression-ratio", "50"]))
    assert len(capped.splitlines()) == 3 and "50 capped at 10" in capped and "50 capped at 4" in capped
    assert ratio_notice(parse(["--hybridep-compression-ratio", "10"])) is None  # weights alone, within the cap


def test_under_the_cap_nothing_changes():
    args = parse(["--hybridep-grad-compression-ratio", "3"])
    assert grad_ratio(args) == 3.0 and ratio_notice(args) is None


@pytest.mark.parametrize("flag", ["--hybridep-max-grad-compression-ratio", "--hybridep-max-compression-ratio"])
@pytest.mark.parametrize("bad", ["0.5", "-1", "inf", "x"])
def test_a_bad_cap_is_refused(flag, bad, capsys):
    with pytest.raises(SystemExit):
        parse([flag, bad])
    assert flag in capsys.readouterr().err


def test_the_plan_command_notes_a_ratio_past_the_cap(capsys):
    import os

    from megatron_hybridep.cli import main

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base = ["plan", "--topology", os.path.join(root, "configs", "topologies", "2dc_x_8.yaml"), "--model",
            os.path.join(root, "configs", "models", "paper-s.yaml"), "--tokens-per-rank", "4096", "--top", "1"]
    assert main([*base, "--grad-compression-ratio", "50"]) == 0
    assert "note      returned gradients at 50x cost model quality above 4x" in capsys.readouterr().out
    assert main([*base, "--grad-compression-ratio", "4"]) == 0
    assert "note " not in capsys.readouterr().out
    assert main([*base, "--compression-ratio", "50"]) == 0
    assert "note      expert weights at 50x cost model quality above 10x" in capsys.readouterr().out


def test_the_compressed_domain_cap_reaches_the_planner_and_refuses_a_plan_file_over_it(tmp_path):
    """--hybridep-max-compressed-domain: the planner's candidates stay within it, and a hand-made plan
    file with larger compressed domains is refused before any rank starts, naming the flag and fix."""
    from megatron_hybridep.plan.plan import Plan, PlanError
    from megatron_hybridep.train.planning import choose, workload_for

    comp = ["--hybridep-compression-ratio", "50", "--hybridep-grad-compression-ratio", "10"]
    args = parse([*comp, "--hybridep-max-compressed-domain", "2"], default_config=PRESET)
    assert workload_for(args, 4).max_compressed_domain == 2 and workload_for(args, 4).compresses
    choice = choose(args, 4)
    assert all(c.plan.domain_size <= 2 for c in choice.result.candidates if c.compressed)  # larger ones: exact
    assert parse(comp, default_config=PRESET).hybridep_max_compressed_domain == 2  # the default
    uncapped = choose(parse([*comp, "--hybridep-max-compressed-domain", "0"], default_config=PRESET), 4)
    assert any(c.plan.domain_size == 4 for c in uncapped.result.candidates if c.plan.kind == "domains")
    path = tmp_path / "plan.json"
    Plan.grid((2, 2), (2, 2), args.num_experts, ("dc", "gpu")).save(str(path))
    with pytest.raises(PlanError, match="--hybridep-max-compressed-domain 2; fix"):
        choose(parse([*comp, "--hybridep-max-compressed-domain", "2", "--hybridep-plan", str(path)],
                     default_config=PRESET), 4)
    exact = parse(["--hybridep-max-compressed-domain", "2", "--hybridep-plan", str(path)], default_config=PRESET)
    assert choose(exact, 4).plan.domain_size == 4  # exact migration: no quality cost, no cap


def test_the_log_says_when_the_cap_kept_out_a_faster_domain(caplog):
    """On a topology where one compressed domain of all four ranks is the fastest plan, the default
    cap runs a 2-rank domain and the log names both plans, the share and how to lift the cap."""
    import logging

    from megatron_hybridep.train.planning import choose

    argv = ["--hybridep-compression-ratio", "50", "--hybridep-grad-compression-ratio", "10",
            "--hybridep-topology", str(ROOT / "configs" / "topologies" / "2dc_x_2.yaml"), "--micro-batch-size", "64",
            "--distributed-backend", "nccl"]  # GPU ranks: the codec's compute priced 0 (on CPU ranks it does not pay)
    free = choose(parse([*argv, "--hybridep-max-compressed-domain", "0"], default_config=PRESET), 4)
    assert free.plan.label == "domains dc2 gpu2", free.plan.label  # the premise: the widest domain wins
    with caplog.at_level(logging.WARNING, logger="hybridep.planning"):
        capped = choose(parse(argv, default_config=PRESET), 4)
    assert capped.plan.domain_size <= 2 or not capped.result.compressed  # larger domains run exact
    assert "capped at 2 ranks" in caplog.text and "'domains dc2 gpu2' compressed is predicted faster" in caplog.text
    assert "75% of the routed tokens" in caplog.text and "0 lifts the cap" in caplog.text


def test_the_start_up_log_states_the_share_on_compressed_copies(capsys):
    from types import SimpleNamespace

    from megatron_hybridep.runtime.migration import MigrationConfig
    from megatron_hybridep.train.planning import choose
    from megatron_hybridep.train.reporting import Reporter

    comp = ["--hybridep-compression-ratio", "50", "--hybridep-grad-compression-ratio", "10", "--hybridep-plan", "auto"]
    args = parse([*comp, "--distributed-backend", "nccl"], default_config=PRESET)  # GPU ranks: the codec priced 0
    choice = choose(args, 4)
    assert choice.plan.domain_size == 2 and choice.result.compressed  # the demo's plan, within the default cap
    Reporter(args, choice, SimpleNamespace(migration=MigrationConfig(50.0, 10.0)), rank=0)
    assert "50% of the routed tokens computed on compressed copies" in capsys.readouterr().out
    cpu = parse(comp, default_config=PRESET)  # CPU ranks: the codec's compute costs more than it saves here
    choice = choose(cpu, 4)
    assert choice.plan.domain_size == 2 and not choice.result.compressed  # the same domain, exact
    assert (cpu.hybridep_compression_ratio, cpu.hybridep_grad_compression_ratio) == (1.0, 1.0)  # what runs
    assert migration_from_args(cpu).compression_ratio == 1.0
    Reporter(cpu, choice, SimpleNamespace(migration=migration_from_args(cpu)), rank=0)
    out = capsys.readouterr().out
    assert f"compression asked for, but '{choice.plan.label}' runs exact" in out and "compressed copies" not in out
    Reporter(args, choice, SimpleNamespace(migration=MigrationConfig()), rank=0)  # exact: nothing to say
    assert "compressed copies" not in capsys.readouterr().out
    plain = parse(["--hybridep-compression-ratio", "50", "--hybridep-plan", "ep"], default_config=PRESET)
    Reporter(plain, choose(plain, 4), SimpleNamespace(migration=MigrationConfig(50.0)), rank=0)
    out = capsys.readouterr().out  # asked for, but S = 1 borrows nothing (the layout planner's plain plans)
    assert "borrows no experts: nothing is compressed" in out and "compressed copies" not in out


def test_the_gradient_value_dtype_reaches_the_runtime_and_the_planner():
    args = parse(["--hybridep-grad-compression-ratio", "4"], default_config=PRESET)
    assert migration_from_args(args).grad_values == "bf16" and workload_for(args, 4).grad_value_bytes == 2
    same = parse(["--hybridep-grad-compression-ratio", "4", "--hybridep-grad-compression-values", "same"],
                 default_config=PRESET)
    assert migration_from_args(same).grad_values == "same" and workload_for(same, 4).grad_value_bytes == 0
    # fp32 preset: the priced return shrinks with bf16 values (3 bytes per kept value with its index, not 5)
    assert workload_for(args, 4).grad_wire_bytes < 0.7 * workload_for(same, 4).grad_wire_bytes
