"""Compile the fused codec kernels (kernels/_fused_triton.py) for sm_90 without a GPU, as
aot_compile.py does for the codec kernels (and with its compile_all): catches lowering errors the
interpreter cannot see. Run by test_fused_codec.py in a subprocess with TRITON_INTERPRET=0. Prints
SKIP if no CUDA backend."""

import sys

from megatron_hybridep.kernels import _fused_triton as K
from tests.kernels.aot_compile import compile_all  # prints SKIP and exits where there is no CUDA backend


def variants():
    adam_scalars = {k: "fp32" for k in ("decay", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2",
                                        "step_size", "inv_sqrt_bc2", "eps")}
    for out_kind, out_t, grad_t, has_base in ((1, "*i16", "*fp32", True), (0, "*fp32", "*bf16", False)):
        yield f"adamw_hist out{out_kind}", K._adamw_hist_kernel, {
            "p_ptr": "*fp32", "g_ptr": grad_t, "m_ptr": "*fp32", "v_ptr": "*fp32", "out_ptr": out_t,
            "base_ptr": "*bf16" if has_base else "*fp32", "hist_ptr": "*i32", "n": "i32", "ntiles": "i32",
            **adam_scalars}, {"HAS_BASE": has_base, "OUT_KIND": out_kind, "BLOCK": K.ADAMW_TILE}
    for off_t, om, out_kind, out_t, base_t in (("*u8", 0xFF, 1, "*i16", "*bf16"),
                                               ("*i16", 0xFFFF, 0, "*fp32", "*fp32")):
        yield f"decode_rows out{out_kind}", K._decode_rows_kernel, {
            "base_ptr": base_t, "shift_ptr": base_t, "val_ptr": base_t, "off_ptr": off_t, "ent_ptr": "*i32",
            "out_ptr": out_t, "n": "i32", "ntiles": "i32", "val_stride": "i32", "off_stride": "i32"}, {
            "HAS_SHIFT": True, "OFF_MASK": om, "BLOCK_MASK": 255 if om == 0xFF else 0xFFFF, "OUT_KIND": out_kind,
            "BLOCK": K.TILE, "CHUNK": K.ENTRY_CHUNK}


if __name__ == "__main__":
    sys.exit(compile_all(variants()))
