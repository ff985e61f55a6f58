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


def pretrain_argv(system: str, preset: str, iters: int, use_te: bool, extra: list[str], ranks: int = 1) -> list[str]:
    """pretrain_moe.py's arguments for one system: the preset at EP = ranks (plan ep: the same
    traffic as alltoall, so the difference is the plugin's plumbing). Several ranks share the one
    GPU over gloo (NCCL takes one rank per GPU), without the distributed optimizer (gloo has no
    reduce-scatter)."""
    argv = ["--config", preset, "--moe-token-dispatcher-type", system,
            "--expert-model-parallel-size", str(ranks), "--hybridep-topology", "", "--hybridep-plan", "ep",
            "--bf16", "--train-iters", str(iters), "--log-interval", "1",
            "--lr-warmup-iters", "0", "--eval-iters", "0", "--save-interval", str(iters + 1)]
    argv += ["--use-distributed-optimizer"] if ranks == 1 else ["--distributed-backend", "gloo"]
    if not use_te:  # Megatron's local layers; its fusions need Apex or TE (README's H100 command)
        argv += ["--transformer-impl", "local", "--no-persist-layer-norm", "--no-masked-softmax-fusion",
                 "--no-gradient-accumulation-fusion", "--no-rope-fusion"]
    return argv + extra


def commands(system: str, args: argparse.Namespace, use_te: bool) -> list[list[str]]:
    """One torchrun per rank: Megatron sets the device from LOCAL_RANK, so ranks sharing the one GPU
    are launched as one-process 'nodes' (LOCAL_RANK 0 each) of a static rendezvous."""
    tail = [os.path.join(REPO, "pretrain_moe.py"),
            *pretrain_argv(system, args.preset, args.iters, use_te, args.extra, args.ranks)]
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"]
    if args.ranks == 1:
        return [[*run, "--standalone", *tail]]
    return [[*run, "--nnodes", str(args.ranks), "--node-rank", str(i), "--master-addr", "127.0.0.1",
             "--master-port", str(args.port), *tail] for i in range(args.ranks)]


def step_times_ms(log: str) -> dict[int, float]:
    """{iteration: ms} from Megatron's per-iteration log lines."""
    return {int(m.group(1)): float(m.group(2)) for m in ITER_RE.finditer(log)}


def run_median(cmds: list[list[str]], warmup: int, timeout: float) -> tuple[float, int, float]:
    """(median ms after warm-up, iterations counted, wall s) of one run; raises with the log's tail."""
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen(c, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for c in cmds]
    logs, codes = [], []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, timeout - (time.perf_counter() - t0)))[0])
            codes.append(p.returncode)
    finally:
        for p in procs:
            p.kill()
    wall = time.perf_counter() - t0
    log = "\n".join(logs)  # Megatron logs iterations on the last rank
    times = [ms for it, ms in sorted(step_times_ms(log).items()) if it > warmup]
    if any(codes) or not times:
        raise RuntimeError(f"run failed (rc {codes}, {len(times)} timed iterations): "
                           f"{shlex.join(cmds[0])}\n{log[-4000:]}")
    return statistics.median(times), len(times), wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="configs/presets/paper_s.yaml")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10, help="iterations dropped at the start of each run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ranks", type=int, default=1, help="ranks sharing the GPU (EP = ranks; > 1 runs gloo)")
    p.add_argument("--port", type=int, default=29511, help="rendezvous port with --ranks > 1")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--local", action="store_true", help="Megatron's local layers even if TransformerEngine imports")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--dry-run", action="store_true", help="print the commands and check them with "
                   "pretrain_moe.py's parser (no GPU needed)")
    p.add_argument("extra", nargs="*", help="more pretrain_moe.py flags (after --)")
    args = p.parse_args(argv)
    if args.warmup >= args.iters:
        p.error(f"--warmup {args.warmup} must be below --iters {args.iters}")
    if args.ranks > 1:  # the GPU presets turn the distributed optimizer on, and no flag turns it off
        import tempfile

        import yaml

        fd, path = tempfile.mkstemp(prefix="gpu_loop_", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump({"base": os.path.abspath(args.preset), "use_distributed_optimizer": False}, f)
        args.preset = path
    use_te = not args.local and transformer_engine_importable()
    print("# " + shlex.join([sys.executable, *sys.argv]), flush=True)
    cmds = {s: commands(s, args, use_te) for s in SYSTEMS}
    for s, cmd in cmds.items():
        print(f"# {s}: {' & '.join(shlex.join(c) for c in cmd)}", flush=True)
    if args.dry_run:
        from megatron_hybridep.megatron.arguments import parse

        for s in SYSTEMS:
            parsed = parse(pretrain_argv(s, args.preset, args.iters, use_te, args.extra, args.ranks))
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
                           ranks=args.ranks,
                           commands={s: [shlex.join(c) for c in cs] for s, cs in cmds.items()}, runs_ms=runs,
                           median_ms=med,
                           ratio=ratio), f, indent=2)
    return 0 if abs(ratio - 1) <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
