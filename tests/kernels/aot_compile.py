"""Compile representative variants of the codec kernels for sm_90 without a GPU (Triton's CUDA
backend + bundled ptxas): catches lowering errors the interpreter cannot see. Run by
test_codec_kernels.py in a subprocess with TRITON_INTERPRET=0. Prints SKIP if no CUDA backend."""

import sys
from collections.abc import Iterable
from typing import Any

import triton
from triton.compiler import ASTSource

try:
    from triton.backends.compiler import GPUTarget
except ImportError:  # pragma: no cover
    print("SKIP no GPUTarget")
    sys.exit(0)

from megatron_hybridep.kernels import _codec_triton as K  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
P = lambda t: "*" + t


def variants():
    for wt in ("fp32", "bf16"):
        yield "hist", K._radix_hist_kernel, {
            "w_ptr": P(wt), "s_ptr": P(wt), "s_row_stride": "i32", "prefix_ptr": "*i32", "hist_ptr": "*i32",
            "n": "i32", "ntiles": "i32",
        }, {"SHIFT": 16, "HI_MASK": 0x7F000000, "HAS_SHARED": True, "BLOCK": K.HIST_TILE}
        yield "count", K._tile_count_kernel, {
            "w_ptr": P(wt), "s_ptr": P(wt), "s_row_stride": "i32", "thr_ptr": "*i32", "ngt_ptr": "*i32",
            "neq_ptr": "*i32", "n": "i32", "ntiles": "i32",
        }, {"HAS_SHARED": wt == "bf16", "BLOCK": K.TILE}
    yield "digit", K._digit_kernel, {"hist_ptr": "*i32", "prefix_ptr": "*i32", "krem_ptr": "*i32"}, {"SHIFT": 8}
    for vk, vt, ok, ot in ((0, "fp32", 0, "u8"), (1, "i16", 1, "i16"), (2, "fp16", 2, "i32")):
        yield f"compact v{vk} o{ok}", K._compact_kernel, {
            "w_ptr": "*bf16", "s_ptr": "*bf16", "s_row_stride": "i32", "thr_ptr": "*i32", "take_ptr": "*i32",
            "start_ptr": "*i32", "val_ptr": P(vt), "val_stride": "i32", "off_ptr": P(ot), "off_stride": "i32",
            "n": "i32", "ntiles": "i32",
        }, {"HAS_SHARED": True, "BLOCK_MASK": 255, "VKIND": vk, "OFF_KIND": ok, "BLOCK": K.TILE}
    for ok, ot, om, outk, outt in ((0, "u8", 0xFF, 1, "i16"), (1, "i16", 0xFFFF, 0, "fp32")):
        yield f"decode o{ok} out{outk}", K._decode_kernel, {
            "base_ptr": "*bf16", "val_ptr": "*bf16", "off_ptr": P(ot), "ent_ptr": "*i32", "out_ptr": P(outt),
            "n": "i32", "alpha": "fp32",
        }, {"HAS_BASE": True, "OFF_MASK": om, "BLOCK_MASK": 255, "OUT_KIND": outk, "BLOCK": K.TILE,
            "CHUNK": K.ENTRY_CHUNK}


def compile_all(variants: Iterable[tuple[str, Any, dict, dict]]) -> int:
    """Compile every (name, kernel, signature, constexprs) for TARGET; print a line each, then ALL OK or
    FAILED. Returns the exit status (aot_compile_fused.py uses it for the fused kernels)."""
    failed = 0
    for name, fn, sig, consts in variants:
        sig = {**sig, **{c: "constexpr" for c in consts}}
        try:
            c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=TARGET)
            print(f"{name}: ok ({'cubin' if 'cubin' in c.asm else 'ptx only'})")
        except Exception as e:  # report every variant, then fail
            failed += 1
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:2000]}")
    print("FAILED" if failed else "ALL OK")
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(compile_all(variants()))
