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
    added = added[:-2]
    if "--hybridep-plan" in added:  # a layout without hybridep runs its plain plan
        assert added[-2:] == ["--hybridep-plan", "ep"]
        added = added[:-2]
    chosen = dict(zip(added[::2], map(int, added[1::2]), strict=True))
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


TOPOLOGY_10MBIT = """name: testbed_2dc_x_2
world_size: 4
memory_gb_per_gpu: 8
levels:
- {name: dc, count: 2, bandwidth_gbps: 0.01, uplink_gbps: 0.01, latency_us: 0}
- {name: gpu, count: 2, bandwidth_gbps: 2.0, latency_us: 10}
"""
# issue 25's model with compression asked for: the stage's own planner picks a compressed domain inside
# each DC, predicted within the near-tie margin of the plain layout the layout planner chooses
COMPRESSED_JOB = ["--config", "configs/presets/cpu_demo.yaml", "--num-layers", "4", "--hidden-size", "128",
                  "--ffn-hidden-size", "512", "--moe-ffn-hidden-size", "512", "--num-experts", "16",
                  "--seq-length", "128", "--max-position-embeddings", "128",
                  "--micro-batch-size", "4", "--global-batch-size", "16", "--overlap-grad-reduce",
                  "--hybridep-compression-ratio", "10", "--hybridep-grad-compression-ratio", "4",
                  "--hybridep-layout", "auto"]


def test_a_plain_layout_runs_its_plain_plan_not_the_stage_planners_choice(tmp_path, capsys):
    """The layout planner chose a layout without hybridep (a tie goes to Megatron); the job re-planned
    the stage with --hybridep-plan auto, which has no such margin, and ran a compressed domain inside
    each DC: 1.55x slower than one stage per DC on the testbed (docs/results.md, 2026-11-29). Since the
    codec's compute is priced the stage's planner agrees on CPU ranks; on GPU ranks (codec free) it
    would still pick the domain, so the appended plan stays."""
    import pretrain_moe
    from megatron_hybridep.train.planning import choose

    topo = tmp_path / "topo.yaml"
    topo.write_text(TOPOLOGY_10MBIT)
    argv = [*BASE, *COMPRESSED_JOB, "--hybridep-topology", str(topo)]
    no_layout = [*BASE, *COMPRESSED_JOB[:-2], "--hybridep-topology", str(topo)]  # without --hybridep-layout auto
    before_argv = [*no_layout, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                   "--expert-tensor-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                   "--expert-model-parallel-size", "2"]
    before = pretrain_moe._args(before_argv)
    assert choose(before, 4).plan.label == "ep (S=1)"  # the stage's planner alone, the codec's compute priced
    free_codec = pretrain_moe._args([*before_argv, "--distributed-backend", "nccl"])  # GPU ranks: the codec priced 0
    assert choose(free_codec, 4).plan.domain_size == 2 and free_codec.hybridep_compression_ratio == 10
    final = _layout(argv)
    assert "plan ep (S=1)" in capsys.readouterr().out
    assert final[-4:] == ["--hybridep-plan", "ep", "--hybridep-layout", "off"]
    args = pretrain_moe._args(final)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    assert choose(args, 4).plan.label == "ep (S=1)"
    kept = _layout([*argv, "--hybridep-plan", "ep"])
    assert kept.count("--hybridep-plan") == 1  # a plan on the command line is the user's
    assert "--hybridep-plan ep kept; the layout was priced with plan ep (S=1)" in capsys.readouterr().out


def test_megatrons_dispatcher_gets_the_best_layout_without_hybridep(tmp_path):
    import pretrain_moe
    from megatron_hybridep.plan.layout import is_hybridep, plan_layouts
    from megatron_hybridep.train.planning import choose_layout, topology_for, workload_for

    topo = tmp_path / "topo.yaml"
    topo.write_text(TOPOLOGY_10MBIT)
    # the time-to-loss runs' token-heavy shape, where HybridEP-c wins by 4x in the model
    argv = [*BASE, *COMPRESSED_JOB, "--hybridep-topology", str(topo), "--hidden-size", "32",
            "--num-attention-heads", "2", "--ffn-hidden-size", "192", "--moe-ffn-hidden-size", "192",
            "--micro-batch-size", "8", "--global-batch-size", "256"]
    args = pretrain_moe._args(argv)
    ranked = plan_layouts(topology_for(args, 4), workload_for(args, 4))
    assert is_hybridep(ranked[0].best.plan)
    alltoall = pretrain_moe._args([*argv, "--moe-token-dispatcher-type", "alltoall"])
    flags, report = choose_layout(alltoall, 4, [])
    assert "--hybridep-plan" not in flags and "plan ep (S=1)" in report


def test_the_jobs_workload_carries_the_expert_tensor_parallel_size():
    """hybridep runs expert TP 1 (checked at start-up); the planner's workload took Megatron's default
    (ETP = TP) and priced every expert as split over TP."""
    import pretrain_moe
    from megatron_hybridep.train.planning import workload_for

    tp = [*BASE, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"]
    assert workload_for(pretrain_moe._args([*tp, "--expert-tensor-parallel-size", "1"]), 4).etp == 1
    alltoall = pretrain_moe._args([*tp, "--moe-token-dispatcher-type", "alltoall"])
    assert workload_for(alltoall, 4).etp == 2  # Megatron's default: ETP = TP (hybridep refuses it)
