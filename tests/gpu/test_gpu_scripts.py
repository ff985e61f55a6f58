"""The GPU benchmark scripts are ready to run: their commands parse with pretrain_moe.py's own
parser and their log parsing reads Megatron's real log line (CPU; the runs themselves need a GPU)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_loop_overhead_reads_megatrons_per_iteration_log_line():
    loop = _load("gpu_loop_overhead")
    # The format strings of megatron.training.training.training_log (0.19.2), joined as it prints them.
    line = (f" [2026-11-23 21:00:00] iteration {12:8d}/{40:8d} |"
            + f" consumed samples: {48:12d} |"
            + f" elapsed time per iteration (ms): {123.45:.1f} |" + " learning rate: 3.0E-04 |")
    assert loop.step_times_ms(line + "\n" + line.replace("   12/", "   13/")) == {12: 123.5, 13: 123.5}


def test_loop_overhead_commands_parse(capsys):
    loop = _load("gpu_loop_overhead")
    assert loop.main(["--dry-run", "--iters", "20", "--warmup", "5", "--local"]) == 0
    out = capsys.readouterr().out
    for system in ("alltoall", "hybridep"):
        assert (f"# {system}: parsed: dispatcher={system} ep=1 bf16=True distributed_optimizer=True "
                "transformer_impl=local") in out


def test_loop_overhead_runs_are_valid_megatron_jobs():
    from megatron_hybridep.megatron.arguments import parse

    loop = _load("gpu_loop_overhead")
    args = parse(loop.pretrain_argv("hybridep", "configs/presets/paper_s.yaml", 20, False, []))
    # Megatron's pretrain divides by eval_interval even with --eval-iters 0 (failed on the H100)
    assert isinstance(args.eval_interval, int) and args.eval_interval > 0
    assert not args.apply_rope_fusion and not args.gradient_accumulation_fusion  # need TE / Apex


def test_loop_overhead_runs_ranks_sharing_the_gpu_as_one_process_nodes(capsys):
    loop = _load("gpu_loop_overhead")
    assert loop.main(["--dry-run", "--local", "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert "--nnodes 2 --node-rank 0" in out and "--nnodes 2 --node-rank 1" in out
    assert "ep=2 bf16=True distributed_optimizer=False" in out  # gloo: no reduce-scatter


def test_codec_benchmark_runs_its_logic_on_cpu(capsys):
    codec = _load("gpu_codec")
    assert codec.model_sizes() == {"deepseek-v3-like": 44_040_192, "paper-l/xl": 8_388_608, "paper-m": 4_718_592,
                                   "paper-s": 2_097_152}
    assert codec.main(["--device", "cpu", "--sizes", "5000", "--ratios", "10", "--repeats", "1", "--rows", "2"]) == 0
    out = capsys.readouterr().out
    assert "$ python benchmarks/gpu_codec.py --device cpu" in out and "  5000 " in out


def test_layer_overhead_benchmark_runs_on_cpu(tmp_path):
    import json
    import subprocess
    import sys

    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_layer_overhead.py"), "--device", "cpu", "--dtype", "fp32",
           "--hidden", "16", "--ffn", "32", "--experts", "4", "--seq", "8", "--batch", "2", "--iters", "6",
           "--warmup", "1", "--profile"]
    # both modes at once (one process each, mostly import time): the assertions are on counts, not times
    runs = {mode: subprocess.Popen([*cmd, "--port", str(29541 + i), *([mode] if mode else []),
                                    "--out", str(tmp_path / f"layer{mode}.json")],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
            for i, mode in enumerate(("", "--control"))}
    try:
        outputs = {mode: proc.communicate(timeout=120) for mode, proc in runs.items()}
    finally:
        for proc in runs.values():
            proc.kill()
    ops = {}
    for mode, (stdout, stderr) in outputs.items():
        assert runs[mode].returncode == 0, stderr[-3000:]
        r = json.loads((tmp_path / f"layer{mode}.json").read_text())
        assert "median of paired ratios" in stdout and r["control"] == bool(mode)
        assert ("A/A control" in stdout) == bool(mode)
        assert [len(r["times_ms"][s]) for s in ("alltoall", "hybridep")] == [6, 6] and r["ratio"] > 0
        lo, hi = r["ratio_ci95"]
        assert lo <= r["ratio"] <= hi
        ops[mode] = {s: sum(n for k, n in r["ops"][s].items() if k.startswith("aten::")) for s in r["ops"]}
    assert ops["--control"]["alltoall"] == ops["--control"]["hybridep"], ops  # two alltoall layers: same work
    # at EP = 1 the plugin adds only the routing count (sum, add, a dtype copy); the backward stamps of
    # a one-rank group (4 autograd nodes, 8 views) were half its cost on a launch-bound GPU layer
    extra = ops[""]["hybridep"] - ops[""]["alltoall"]
    assert 0 < extra <= 8, ops


def test_gpu_checks_script_parses_and_names_its_arguments():
    """scripts/gpu_checks, the one command a lent GPU machine runs: valid bash, and without its
    output folder it stops with the usage line instead of writing somewhere."""
    import subprocess

    script = ROOT / "scripts" / "gpu_checks"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert run.returncode != 0 and "usage: scripts/gpu_checks OUT [OLD_TREE]" in run.stderr
