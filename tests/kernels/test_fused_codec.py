"""Fused codec (kernels/fused_codec.py): the torch reference is AdamW and the unfused decode; the
Triton kernels match it under TRITON_INTERPRET=1 (subprocess, small sizes)."""

import pytest
import torch

from megatron_hybridep.kernels import fused_codec as F
from megatron_hybridep.runtime.compression import SharedResidualCodec

from .helpers import check_compiles_for_sm90, check_under_interpreter


def test_fused_triton_kernels_match_torch_under_interpreter(interpreter_runs):
    check_under_interpreter(interpreter_runs["interp_fused_cases.py"])


def test_fused_triton_kernels_compile_for_sm90_without_a_gpu():
    check_compiles_for_sm90("aot_compile_fused.py")


def test_reference_update_is_torch_adamw():
    torch.manual_seed(0)
    p = torch.randn(2, 500) * 0.02
    grads = [torch.randn(2, 500) * 1e-3 for _ in range(3)]
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    mine, m, v = p.clone(), torch.zeros_like(p), torch.zeros_like(p)
    out = torch.empty(2, 500, dtype=torch.bfloat16)
    for step, g in enumerate(grads, start=1):
        ref.grad = g
        opt.step()
        F.adamw_step_hist(mine, g, m, v, out, None, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8,
                          weight_decay=0.1, step=step, backend="torch")
    assert torch.allclose(mine, ref.detach(), rtol=1e-5, atol=1e-9)
    assert torch.equal(out, mine.to(torch.bfloat16))


def test_histogram_counts_the_top_digit_of_the_residual():
    model = torch.tensor([[1.0, -2.0, 0.5, 3.0]], dtype=torch.bfloat16)
    base = torch.tensor([[1.0, 0.0, 0.25, -1.0]], dtype=torch.bfloat16)
    h = F.first_digit_hist(model, base)
    r = torch.tensor([0.0, -2.0, 0.25, 4.0])
    want = torch.bincount((r.view(torch.int32) & 0x7FFFFFFF) >> 24, minlength=256).to(torch.int32)
    assert torch.equal(h[0], want) and int(h.sum()) == 4


@pytest.mark.parametrize("ratio", [20, 4])  # BLOCK8, and the bitmap (torch ops on every backend)
@pytest.mark.parametrize("shifted", [False, True])
def test_decode_rows_equals_the_unfused_decode_on_cpu(shifted, ratio):
    torch.manual_seed(1)
    codec = SharedResidualCodec(ratio)
    copies = torch.randn(3, 4000).to(torch.bfloat16)
    shift = (torch.randn(4000) * 0.01).to(torch.bfloat16) if shifted else None
    rebased = copies if shift is None else copies + shift
    payloads = codec.encode_batch((copies.float() + 0.01 * torch.randn(3, 4000)).to(torch.bfloat16), rebased)
    want = codec.decode_batch(payloads, rebased, out=torch.empty_like(copies))
    got = codec.decode_rows(payloads, copies, out=torch.empty_like(copies), shift=shift)
    assert torch.equal(got, want)


def test_bad_shapes_are_refused():
    p = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="grad must be contiguous"):
        F.adamw_step_hist(p, torch.zeros(2, 7), torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(2, 8), None,
                          lr=1e-3, step=1)
    with pytest.raises(ValueError, match="step counts optimizer steps from 1"):
        F.adamw_step_hist(p, p.clone(), p.clone(), p.clone(), p.clone(), None, lr=1e-3, step=0)


def test_decode_grid_puts_tiles_on_the_axis_without_cuda_s_65535_cap():
    from megatron_hybridep.kernels._fused_triton import decode_rows_grid

    assert decode_rows_grid(8, 172_032) == (172_032, 8)  # a 44M-element DeepSeek-V3 expert row, 8 rows
    with pytest.raises(ValueError, match="65535"):
        decode_rows_grid(70_000, 4)
