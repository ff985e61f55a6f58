"""pretrain_moe.py --hybridep-layout auto: the layout planner's TP/PP/EP become the job's flags,
unless the command line fixes one of them (then it only says what it would set)."""

import pytest

BASE = ["--train-iters", "2", "--lr-warmup-iters", "1"]


def _layout(argv, world=4):
    import pretrain_moe

    return pretrain_moe._with_layout(argv, world, announce=True)


def test_auto_appends_the_planners_layout_and_the_job_parses_it(capsys):
    import pretrain_moe

    argv = [*BASE, "--hybridep-layout", "auto"]
    final = _layout(argv)
    report = capsys.readouterr().out
    added = final[len(argv):]
    assert added[-2:] == ["--hybridep-layout", "off"]  # the ranks do not plan again
    chosen = dict(zip(added[:-2:2], map(int, added[1:-2:2]), strict=True))
    assert set(chosen) >= {"--pipeline-model-parallel-size", "--expert-model-parallel-size"}
    label = (f"TP{chosen['--tensor-model-parallel-size']} PP{chosen['--pipeline-model-parallel-size']} "
             f"EP{chosen['--expert-model-parallel-size']}")
    assert f"[layout] running {label}" in report and "hybridep plan --layout auto" in report
    args = pretrain_moe._args(final)
    assert (args.pipeline_model_parallel_size, args.expert_model_parallel_size) == (
        chosen["--pipeline-model-parallel-size"], chosen["--expert-model-parallel-size"])
    assert args.tensor_model_parallel_size == chosen.get("--tensor-model-parallel-size", 1)
    assert _layout(final) == final  # idempotent: the ranks see the final flags


@pytest.mark.parametrize("fixed", ["--pipeline-model-parallel-size", "--expert-model-parallel-size"])
def test_a_layout_fixed_on_the_command_line_is_kept_and_the_choice_printed(fixed, capsys):
    argv = [*BASE, "--hybridep-layout", "auto", fixed, "1"]
    assert _layout(argv) == argv
    out = capsys.readouterr().out
    assert f"{fixed} fixed on the command line: keeping your layout; the planner's choice would be" in out


def test_tensor_parallel_layouts_pass_the_cpu_preflight():
    """TP + SP through pretrain_moe.py on CPU: Megatron's validate_args asks CUDA for the device's
    architecture under TP; the parent's preflight runs with the CPU runtime as the ranks do (it
    stopped with "Found no NVIDIA driver")."""
    import pretrain_moe
    from megatron_hybridep.train.preflight import preflight

    for dispatcher in ("hybridep", "alltoall"):
        args = pretrain_moe._args([*BASE, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                   "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                                   "--moe-token-dispatcher-type", dispatcher])
        preflight(args, 4)


def test_off_changes_nothing(capsys):
    assert _layout(BASE) == BASE
    assert capsys.readouterr().out == ""


def test_the_testbed_comparison_reads_pretrain_moes_log_line():
    import importlib.util
    from pathlib import Path

    from megatron_hybridep.plan.cost import bytes_human

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "layout_vs_pp.py"
    spec = importlib.util.spec_from_file_location("layout_vs_pp", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # the format of train/reporting.py's per-iteration line
    lines = [f" iter {i:5d}/4 | loss {5.5:7.4f} | step {ms:7.1f} ms | {1000:9.0f} tok/s | lr 3.00e-04 | "
             f"grad-norm {0.5:6.3f} | inter-DC {bytes_human(b)}/iter | exposed comm {1.0:6.1f} ms | plan ep (S=1)"
             for i, ms, b in ((1, 9000.0, 8.39e6), (2, 3100.0, 8.39e6), (3, 2900.0, 524e3))]
    steps, wan = bench.parse_log("\n".join(lines), warmup=1)
    assert steps == [3.1, 2.9] and wan == 524e3
    assert set(bench.systems(2, 4)) == {"ep", "hybridep", "pp", "pp-hybridep", "auto"}


def test_the_planners_micro_batches_come_from_the_world_before_megatron_validates():
    """The parent plans before Megatron's validation sets data_parallel_size: the global batch still
    splits into micro-batches over DP = world / (TP x PP) (it was taken as one micro-batch, so auto
    planned an 8x smaller batch here and chose a layout for it)."""
    import pretrain_moe
    from megatron_hybridep.train.planning import workload_for

    args = pretrain_moe._args([*BASE, "--micro-batch-size", "8", "--global-batch-size", "256"])
    assert getattr(args, "data_parallel_size", None) is None
    assert workload_for(args, 4).micro_batches == 8 and workload_for(args, 8).micro_batches == 4
    pp = pretrain_moe._args([*BASE, "--micro-batch-size", "8", "--global-batch-size", "256",
                             "--pipeline-model-parallel-size", "2"])
    assert workload_for(pp, 4).micro_batches == 16
    assert workload_for(args).micro_batches == 1  # no world: as before (callers after validation have DP)
