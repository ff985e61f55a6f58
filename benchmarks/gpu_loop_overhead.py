"""Megatron's own GPU loop (megatron.training.pretrain via pretrain_moe.py) with the hybridep
dispatcher vs alltoall on one GPU, EP = 1, bf16, the distributed optimizer: the plugin's plumbing
overhead (HybridEPMoELayer, instrumentation, the train_step wrapper, the runtime's per-step call).
Target: hybridep's median step time within 2% of alltoall's.

    python benchmarks/gpu_loop_overhead.py                    # on a GPU machine (docs/gpu.md)
    python benchmarks/gpu_loop_overhead.py --dry-run          # anywhere: print + parse the commands

Each run is `torchrun --standalone --nproc-per-node 1 pretrain_moe.py --config PRESET <overrides>`
with --log-interval 1, so Megatron prints every iteration's time ("elapsed time per iteration
(ms)"); the first --warmup iterations are dropped, each run gives its median, and the systems'
runs alternate (ABAB..., the order flipped every repeat) so drift hits both alike. The report is
the median over repeats of each system's run medians, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ("alltoall", "hybridep")
ITER_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
TARGET = 0.02


def transformer_engine_importable() -> bool:
    from megatron_hybridep.megatron.compat import transformer_engine_version

    return transformer_engine_version() is not None


def pretrain_argv(system: str, preset: str, iters: int, use_te: bool, extra: list[str]) -> list[str]:
    """pretrain_moe.py's arguments for one system: the preset at EP = 1 on one rank."""
    argv = ["--config", preset, "--moe-token-dispatcher-type", system,
            "--expert-model-parallel-size", "1", "--hybridep-topology", "", "--hybridep-plan", "ep",
            "--bf16", "--use-distributed-optimizer", "--train-iters", str(iters), "--log-interval", "1",
            "--lr-warmup-iters", "0", "--eval-iters", "0", "--save-interval", str(iters + 1)]
    if not use_te:  # Megatron's local layers; its fusions need Apex or TE (README's H100 command)
        argv += ["--transformer-impl", "local", "--no-persist-layer-norm", "--no-masked-softmax-fusion"]
    return argv + extra


def command(system: str, args: argparse.Namespace, use_te: bool) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
            os.path.join(REPO, "pretrain_moe.py"),
            *pretrain_argv(system, args.preset, args.iters, use_te, args.extra)]


def step_times_ms(log: str) -> dict[int, float]:
    """{iteration: ms} from Megatron's per-iteration log lines."""
    return {int(m.group(1)): float(m.group(2)) for m in ITER_RE.finditer(log)}


def run_median(cmd: list[str], warmup: int, timeout: float) -> tuple[float, int, float]:
    """(median ms after warm-up, iterations counted, wall s) of one run; raises with the log's tail."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})
    wall = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    times = [ms for it, ms in sorted(step_times_ms(log).items()) if it > warmup]
    if proc.returncode != 0 or not times:
        raise RuntimeError(f"run failed (rc {proc.returncode}, {len(times)} timed iterations): "
                           f"{shlex.join(cmd)}\n{log[-4000:]}")
    return statistics.median(times), len(times), wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="configs/presets/paper_s.yaml")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10, help="iterations dropped at the start of each run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--local", action="store_true", help="Megatron's local layers even if TransformerEngine imports")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--dry-run", action="store_true", help="print the commands and check them with "
                   "pretrain_moe.py's parser (no GPU needed)")
    p.add_argument("extra", nargs="*", help="more pretrain_moe.py flags (after --)")
    args = p.parse_args(argv)
    if args.warmup >= args.iters:
        p.error(f"--warmup {args.warmup} must be below --iters {args.iters}")
    use_te = not args.local and transformer_engine_importable()
    print("# " + shlex.join([sys.executable, *sys.argv]), flush=True)
    cmds = {s: command(s, args, use_te) for s in SYSTEMS}
    for s, cmd in cmds.items():
        print(f"# {s}: {shlex.join(cmd)}", flush=True)
    if args.dry_run:
        from megatron_hybridep.megatron.arguments import parse

        for s in SYSTEMS:
            parsed = parse(pretrain_argv(s, args.preset, args.iters, use_te, args.extra))
            print(f"# {s}: parsed: dispatcher={parsed.moe_token_dispatcher_type} "
                  f"ep={parsed.expert_model_parallel_size} "
                  f"bf16={parsed.bf16} distributed_optimizer={parsed.use_distributed_optimizer} "
                  f"transformer_impl={parsed.transformer_impl} layers={parsed.num_layers} experts={parsed.num_experts}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU (use --dry-run to check the commands)", file=sys.stderr)
        return 2
    runs: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    for r in range(args.repeats):
        for s in (SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]):
            med, n, wall = run_median(cmds[s], args.warmup, args.timeout)
            runs[s].append(med)
            print(f"repeat {r} {s:9s} median {med:8.2f} ms over {n} iterations (run {wall:.0f} s)", flush=True)
    med = {s: statistics.median(v) for s, v in runs.items()}
    ratio = med["hybridep"] / med["alltoall"]
    te = "yes" if use_te else "no (local layers)"
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | TransformerEngine {te}")
    for s in SYSTEMS:
        print(f"{s:9s} median step {med[s]:8.2f} ms  (runs: {', '.join(f'{x:.2f}' for x in runs[s])})")
    verdict = "within" if abs(ratio - 1) <= TARGET else "NOT within"
    print(f"hybridep / alltoall = {ratio:.4f} ({(ratio - 1) * 100:+.2f}%), {verdict} the {TARGET:.0%} target")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, transformer_engine=use_te,
                           commands={s: shlex.join(c) for s, c in cmds.items()}, runs_ms=runs, median_ms=med,
                           ratio=ratio), f, indent=2)
    return 0 if abs(ratio - 1) <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
