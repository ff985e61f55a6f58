"""The expert codec at real sizes on a GPU: encode / decode time, achieved memory bandwidth against
the GPU's peak, and the fused paths (kernels/fused_codec.py) against the unfused ones.

    python benchmarks/gpu_codec.py                          # on a GPU machine (docs/gpu.md)
    python benchmarks/gpu_codec.py --device cpu --sizes 20000 --repeats 2   # logic check, torch path

Sizes: a DeepSeek-V3-like expert (hidden 7168, ffn 2048, SwiGLU: 44.0M parameters) and the
paper's (configs/models/*.yaml: 2.1M, 4.7M, 8.4M), bf16, at 10x and 50x (element ratios).

Per size and ratio (median of --repeats, CUDA events, after warm-up):
- encode / decode of one expert (Triton), and bandwidth = the bytes the operation must move at
  least (encode: read weight + base, write the payload; decode: read base + payload, write the
  weight) / time, as a share of the peak;
- optimizer + encode of a layer's --rows experts (the owner's step): torch's fused AdamW on the fp32
  masters and the bf16 copy, then the encode one expert at a time (per-exp: the runtime before the
  batched encode) or every expert in one set of launches (batch: SharedResidualCodec.encode_batch,
  what the runtime runs); +hist = kernels.fused_codec.adamw_step_hist (AdamW + bf16 copy + the
  encode's first histogram in one pass), then the batched encode without that pass.
  "encode overhead" = that time minus the optimizer alone (torch fused AdamW + copy);
- decode of --rows borrowed experts just before the expert computation: unfused = what
  runtime/migration.py does per row (rebase copy + shift after a shared-expert refresh, then
  decode); fused = SharedResidualCodec.decode_rows (one launch, rebase folded in). Without a
  refresh (no shift) both are one pass per row; the fused one is a single launch;
- layer overhead: what one layer's codec adds to a step (encode overhead + decode without a
  refresh), before (per-expert encode, per-row decode) and now (batched encode, fused decode).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_hybridep.kernels import fused_codec as F  # noqa: E402
from megatron_hybridep.runtime.compression import SharedResidualCodec  # noqa: E402

# HBM peak by device name (bytes/s), used when torch does not report the memory clock and bus width.
PEAK_BYTES_S = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12,
                "H100 NVL": 3.9e12, "A100-SXM4-80GB": 2.039e12, "A100-SXM4-40GB": 1.555e12}


def peak_bandwidth(device: torch.device) -> tuple[float | None, str]:
    if device.type != "cuda":
        return None, "n/a on CPU"
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:  # double data rate
        return 2 * clock_khz * 1e3 * bus_bits / 8, f"memory clock {clock_khz / 1e6:.2f} GHz x {bus_bits} bit"
    for key, value in PEAK_BYTES_S.items():
        if key in props.name:
            return value, f"table entry {key!r}"
    return None, f"unknown for {props.name!r}"


def model_sizes() -> dict[str, int]:
    """Expert parameter counts: the DeepSeek-V3-like expert and the paper's models (configs/models/paper-*)."""
    from megatron_hybridep.plan.workload import Workload

    by_params = {3 * 7168 * 2048: "deepseek-v3-like"}
    for path in sorted(glob.glob(os.path.join(REPO, "configs", "models", "*.yaml"))):
        w = Workload.from_yaml(path)
        if not w.name.startswith("paper-"):  # CPU and bench models are not real sizes
            continue
        same = by_params.get(w.expert_params)  # paper-l and paper-xl share their expert size
        by_params[w.expert_params] = f"{same}/{w.name.removeprefix('paper-')}" if same else w.name
    return {name: n for n, name in by_params.items()}


def timer(device: torch.device, repeats: int, warmup: int = 3):
    def median_ms(fn, setup=None) -> float:
        times = []
        for i in range(warmup + repeats):
            if setup is not None:
                setup()
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                fn()
                ms = (time.perf_counter() - t0) * 1e3
            if i >= warmup:
                times.append(ms)
        return statistics.median(times)

    return median_ms


def bench_size(name: str, n: int, ratio: float, rows: int, device: torch.device, repeats: int,
               peak: float | None) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    bf16 = torch.bfloat16
    codec = SharedResidualCodec(ratio)
    median_ms = timer(device, repeats)
    lay = codec.layout(n, bf16)
    # one expert: encode and decode against a base 1e-3 away (the peers' copy)
    master = torch.randn(rows, n, device=device, generator=g) * 0.02
    base = (master + torch.randn(rows, n, device=device, generator=g) * 1e-3).to(bf16)
    model = master.to(bf16)
    payload = codec.encode(model[0], base[0])
    out = torch.empty(n, dtype=bf16, device=device)
    enc = median_ms(lambda: codec.encode(model[0], base[0], out=payload))
    dec = median_ms(lambda: codec.decode(payload, base[0], out=out))
    enc_bytes = 2 * n * 2 + lay.nbytes
    dec_bytes = n * 2 + lay.nbytes + n * 2
    row = dict(model=name, params=n, ratio=ratio, rows=rows, payload_bytes=lay.nbytes,
               encode_ms=enc, decode_ms=dec, encode_GBps=enc_bytes / enc / 1e6, decode_GBps=dec_bytes / dec / 1e6)
    if peak:
        row["encode_pct_peak"] = 100 * enc_bytes / (enc * 1e-3) / peak
        row["decode_pct_peak"] = 100 * dec_bytes / (dec * 1e-3) / peak

    # the owner's optimizer step + encode of `rows` experts, unfused vs fused
    grad = torch.randn(rows, n, device=device, generator=g) * 1e-3
    m, v = torch.zeros_like(master), torch.zeros_like(master)
    buf = torch.empty(rows * lay.nbytes, dtype=torch.uint8, device=device)
    param = torch.nn.Parameter(master.clone())
    param.grad = grad
    fused_ok = device.type == "cuda"
    opt = torch.optim.AdamW([param], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused_ok or None)

    def torch_step() -> None:
        opt.step()
        model.copy_(param.detach())

    state = {"step": 0}

    def fused_step() -> None:
        state["step"] += 1
        hists = F.adamw_step_hist(master, grad, m, v, model, base, lr=1e-4, beta1=0.9, beta2=0.95,
                                  weight_decay=0.1, step=state["step"])
        codec.encode_batch(model, base, out=buf, first_hists=hists)

    def per_expert_encode() -> None:  # the runtime before the batched encode: one set of launches per expert
        for e in range(rows):
            codec.encode(model[e], base[e], out=buf[e * lay.nbytes:(e + 1) * lay.nbytes])

    opt_ms = median_ms(torch_step)
    per_expert = median_ms(lambda: (torch_step(), per_expert_encode()))
    unfused = median_ms(lambda: (torch_step(), codec.encode_batch(model, base, out=buf)))
    fused = median_ms(fused_step)
    row.update(optimizer_ms=opt_ms, opt_encode_per_expert_ms=per_expert, opt_encode_unfused_ms=unfused,
               opt_encode_fused_ms=fused, encode_overhead_per_expert_ms=per_expert - opt_ms,
               encode_overhead_unfused_ms=unfused - opt_ms, encode_overhead_fused_ms=fused - opt_ms)

    # decode of `rows` borrowed experts before the expert computation, after a shared refresh
    payloads = codec.encode_batch(model, base)
    copies, decoded = base.clone(), torch.empty_like(base)
    shift = (torch.randn(n, device=device, generator=g) * 1e-4).to(bf16)

    def unfused_decode(with_shift: bool) -> None:  # runtime/migration.py's per-row path
        rebased = copies + shift.reshape(1, -1) if with_shift else copies
        codec.decode_batch(payloads, rebased, out=decoded)

    for with_shift, tag in ((True, "refresh"), (False, "plain")):
        row[f"decode_{tag}_unfused_ms"] = median_ms(lambda ws=with_shift: unfused_decode(ws))
        row[f"decode_{tag}_fused_ms"] = median_ms(
            lambda ws=with_shift: codec.decode_rows(payloads, copies, out=decoded, shift=shift if ws else None))
    # what one layer's codec adds to a step (owner's encode + the borrowed rows' decode, no refresh)
    row["layer_overhead_before_ms"] = row["encode_overhead_per_expert_ms"] + row["decode_plain_unfused_ms"]
    row["layer_overhead_now_ms"] = row["encode_overhead_unfused_ms"] + row["decode_plain_fused_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=float, nargs="*", default=None, help="expert parameter counts "
                   "(default: DeepSeek-V3-like + configs/models)")
    p.add_argument("--ratios", type=float, nargs="+", default=[10, 50])
    p.add_argument("--rows", type=int, default=8, help="experts per layer and rank for the fused comparisons")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu for a logic check)", file=sys.stderr)
        return 2
    print("$ " + shlex.join(["python", *([sys.argv[0], *sys.argv[1:]] if argv is None
                                          else ["benchmarks/gpu_codec.py", *argv])]), flush=True)
    sizes = ({f"{int(s)}": int(s) for s in args.sizes} if args.sizes else model_sizes())
    peak, source = peak_bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (torch path)"
    print(f"# {name}; torch {torch.__version__}; peak memory bandwidth "
          f"{f'{peak / 1e12:.2f} TB/s' if peak else 'n/a'} ({source}); bf16; median of {args.repeats}")
    rows = []
    hdr = (f"{'model':>17} {'params':>6} {'ratio':>5} {'enc ms':>7} {'GB/s':>6} {'%pk':>4} {'dec ms':>7} {'GB/s':>6} "
           f"{'%pk':>4} | {'opt ms':>7} {'enc ovh per-exp/batch/+hist ms':>30} | "
           f"{'dec refresh unf/fus':>20} {'dec plain unf/fus':>18} | {'layer ovh before/now':>20}")
    print(hdr)
    for label, n in sizes.items():
        for ratio in args.ratios:
            r = bench_size(label, n, ratio, args.rows, device, args.repeats, peak)
            rows.append(r)
            enc = (f"{r['encode_overhead_per_expert_ms']:.2f}/{r['encode_overhead_unfused_ms']:.2f}/"
                   f"{r['encode_overhead_fused_ms']:.2f}")
            print(f"{label:>17} {n / 1e6:5.1f}M {ratio:5.0f} {r['encode_ms']:7.3f} {r['encode_GBps']:6.0f} "
                  f"{r.get('encode_pct_peak', float('nan')):4.0f} {r['decode_ms']:7.3f} {r['decode_GBps']:6.0f} "
                  f"{r.get('decode_pct_peak', float('nan')):4.0f} | {r['optimizer_ms']:7.2f} {enc:>30} | "
                  f"{r['decode_refresh_unfused_ms']:9.2f}/{r['decode_refresh_fused_ms']:<9.2f} "
                  f"{r['decode_plain_unfused_ms']:8.2f}/{r['decode_plain_fused_ms']:<8.2f} | "
                  f"{r['layer_overhead_before_ms']:9.2f}/{r['layer_overhead_now_ms']:<9.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, torch=torch.__version__, peak_bytes_s=peak, peak_source=source,
                           rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
