"""The hybridep MoE layer's own cost on one GPU, in one process: Megatron's alltoall layer and the
hybridep layer (EP = 1, plan ep, so both move the same tokens) built from the same weights, forward +
backward (+ hybridep's per-step call) timed alternately, the order flipped every iteration, so clock,
allocator and host noise hit both alike. G5 runs the whole Megatron loop in separate processes,
whose medians moved by up to 29% run to run (docs/gpu.md); pairing inside one process is what can
resolve a 2% difference.

    python benchmarks/gpu_layer_overhead.py                       # paper_s's layer, bf16 (docs/gpu.md)
    python benchmarks/gpu_layer_overhead.py --device cpu --hidden 32 --ffn 64 --experts 4 --seq 16 --iters 10

Reports each system's median time per layer call, the median of the paired ratios with a bootstrap
95% interval, and the difference in ms (what the plugin adds per MoE layer and micro-batch).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shlex
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SYSTEMS = ("alltoall", "hybridep")


def bootstrap_interval(values: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the median of ``values`` (resampled with replacement)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def _layers(spec, device: str, use_te: bool, control: bool = False):  # noqa: ANN202 - (layers by system, runtime)
    import torch

    from megatron_hybridep.megatron import setup
    from megatron_hybridep.plan.plan import Plan
    from megatron_hybridep.testing.moe import build_moe_layer

    build = {}
    if device == "cuda":
        build = dict(grouped_gemm=True, transformer_engine=use_te, bf16=spec.dtype == torch.bfloat16,
                     params_dtype=spec.dtype, use_cpu_initialization=False)
    layers = {"alltoall": build_moe_layer(spec, 0, 1, **build).to(device)}
    runtime = setup([Plan.grid((1,), (1,), spec.experts)])
    second = spec if control else dataclasses.replace(spec, dispatcher="hybridep")
    layers["hybridep"] = build_moe_layer(second, 0, 1, **build).to(device)
    assert layers["hybridep"].hybridep != control and not layers["alltoall"].hybridep
    return layers, runtime


def measure(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hybridep.megatron import cpu_runtime, teardown
    from megatron_hybridep.megatron.compat import transformer_engine_version
    from megatron_hybridep.testing.moe import MoESpec, rank_input

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    else:
        cpu_runtime.enable()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    try:
        ps.initialize_model_parallel(expert_model_parallel_size=1)
        model_parallel_cuda_manual_seed(3)
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
        spec = MoESpec(hidden=args.hidden, ffn=args.ffn, experts=args.experts, top_k=args.topk,
                       aux_loss_coeff=1e-2, seq=args.seq, batch=args.batch, dtype=dtype)
        use_te = cuda and not args.local and transformer_engine_version() is not None
        layers, runtime = _layers(spec, args.device, use_te, args.control)
        x0 = rank_input(spec, 0).to(args.device)
        dy = rank_input(spec, 0, step=9).to(args.device)
        sync = torch.cuda.synchronize if cuda else (lambda: None)

        def call(system: str) -> float:
            layer = layers[system]
            layer.zero_grad(set_to_none=True)
            x = x0.detach().requires_grad_(True)
            sync()
            t0 = time.perf_counter()
            out, _ = layer(x)
            out.backward(dy)
            if layer.hybridep:
                runtime.after_optimizer_step()  # the plugin's per-step call, once per layer here
            sync()
            return (time.perf_counter() - t0) * 1e3

        times: dict[str, list[float]] = {s: [] for s in SYSTEMS}
        for i in range(args.warmup + args.iters):
            for s in (SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]):
                ms = call(s)
                if i >= args.warmup:
                    times[s].append(ms)
        ops = {s: op_counts(lambda s=s: call(s), cuda) for s in SYSTEMS} if args.profile else None
        teardown()
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    ratios = [h / a for a, h in zip(times["alltoall"], times["hybridep"], strict=True)]
    diffs = [h - a for a, h in zip(times["alltoall"], times["hybridep"], strict=True)]
    experts = "TEGroupedMLP" if use_te else "SequentialMLP (Megatron's local experts)"
    device = torch.cuda.get_device_name() if cuda else "cpu"
    return dict(device=device, torch=torch.__version__, experts=experts, dtype=args.dtype,
                tokens=args.seq * args.batch, shape=dict(hidden=args.hidden, ffn=args.ffn, experts=args.experts,
                                                        topk=args.topk),
                iters=args.iters, median_ms={s: statistics.median(v) for s, v in times.items()},
                ratio=statistics.median(ratios), ratio_ci95=bootstrap_interval(ratios),
                control=args.control, diff_ms=statistics.median(diffs), diff_ms_ci95=bootstrap_interval(diffs),
                times_ms=times, ops=ops)


def op_counts(fn, cuda: bool) -> dict[str, int]:  # noqa: ANN001
    """One call under torch.profiler: how many times each operator ran (``cuda:`` entries: GPU
    kernels and copies), i.e. what one system launches that the other does not."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        fn()
    counts: Counter[str] = Counter()
    for e in prof.events():
        gpu = cuda and e.device_type.name == "CUDA"
        if gpu or e.name.startswith("aten::"):
            counts[("cuda: " if gpu else "") + e.name[:80]] += 1
    return dict(counts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4, help="micro-batch size (tokens = seq x batch)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--iters", type=int, default=200, help="timed calls per system")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--local", action="store_true", help="Megatron's local experts even if TransformerEngine imports")
    p.add_argument("--port", type=int, default=29517)
    p.add_argument("--control", action="store_true", help="A/A control: the 'hybridep' slot holds a second alltoall "
                   "layer, so the ratio shows what pairing two layer objects gives with no plugin at all")
    p.add_argument("--profile", action="store_true", help="then profile one call of each: the operators and "
                   "GPU kernels hybridep runs that alltoall does not")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --device cpu)", file=sys.stderr)
            return 2
    command = shlex.join(["python", "benchmarks/gpu_layer_overhead.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"$ {command}", flush=True)
    r = measure(args)
    if args.control:
        print("A/A control: 'hybridep' below is a second alltoall layer with the same weights")
    print(f"{r['device']} | torch {r['torch']} | {r['experts']} | {r['dtype']} | {r['tokens']} tokens, "
          f"hidden {args.hidden}, {args.experts} experts of ffn {args.ffn}, top-{args.topk} | {args.iters} pairs")
    for s in SYSTEMS:
        print(f"{s:9s} median {r['median_ms'][s]:9.3f} ms per layer call (forward + backward)")
    lo, hi = r["ratio_ci95"]
    dlo, dhi = r["diff_ms_ci95"]
    print(f"hybridep / alltoall, median of paired ratios: {r['ratio']:.4f} [95% {lo:.4f}, {hi:.4f}]; "
          f"difference {r['diff_ms']:+.3f} ms [{dlo:+.3f}, {dhi:+.3f}]")
    if r["ops"]:
        a, h = r["ops"]["alltoall"], r["ops"]["hybridep"]
        kernels = {s: sum(n for k, n in r["ops"][s].items() if k.startswith("cuda: ")) for s in SYSTEMS}
        print(f"one call profiled: aten ops alltoall {sum(n for k, n in a.items() if k.startswith('aten'))}, "
              f"hybridep {sum(n for k, n in h.items() if k.startswith('aten'))}; GPU kernels and copies "
              f"alltoall {kernels['alltoall']}, hybridep {kernels['hybridep']}")
        for k in sorted(set(a) | set(h), key=lambda k: (k.startswith("aten"), k)):
            if a.get(k, 0) != h.get(k, 0):
                print(f"  {h.get(k, 0) - a.get(k, 0):+3d}  {k}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**r, "command": command}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
