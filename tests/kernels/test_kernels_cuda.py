"""The Triton codec kernels on a real GPU, against the torch reference on the same device
(sizes up to the paper's 8.4M-parameter experts). Marked gpu: skipped without CUDA; on a GPU
machine `pytest -m gpu tests/kernels/test_kernels_cuda.py -s`."""

import pytest
import torch

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

from megatron_hybridep.kernels import codec as C  # noqa: E402
from megatron_hybridep.runtime.compression import ErrorFeedbackTopK, SharedResidualCodec  # noqa: E402


def _encode(backend, w, s, k, bits, vdt):
    n = w.numel()
    v = torch.empty(k, dtype=vdt, device=w.device)
    o = torch.empty(k, dtype=C.OFFSET_DTYPES[bits], device=w.device)
    c = torch.empty(C._nblocks(n, bits), dtype=C.COUNT_DTYPES[bits], device=w.device)
    C.residual_topk_encode(w, s, k, bits, v, o, c, backend=backend)
    out = torch.empty(n, dtype=w.dtype, device=w.device)
    C.sparse_residual_decode(s, v, o, c, bits, out, backend=backend)
    return v, o, c, out


@pytest.mark.parametrize("n,ratio", [(1000, 4), (65_536, 50), (300_001, 10), (2_100_000, 50), (8_400_000, 50)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 16])
def test_triton_equals_torch_on_gpu(n, ratio, dtype, bits):
    g = torch.Generator(device="cuda").manual_seed(n + bits)
    w = torch.randn(n, device="cuda", generator=g).to(dtype)
    s = torch.randn(n, device="cuda", generator=g).to(dtype) * 0.1
    k = max(1, n // ratio)
    ref = _encode("torch", w, s, k, bits, dtype)
    got = _encode("triton", w, s, k, bits, dtype)
    for a, b, name in zip(got, ref, ("values", "offsets", "counts", "decoded"), strict=True):
        assert torch.equal(a, b), f"{name} differ (n={n}, ratio={ratio}, {dtype}, bits={bits})"


def test_codec_and_error_feedback_on_gpu_match_cpu():
    torch.manual_seed(0)
    w, shared = torch.randn(2, 2_100_000), torch.randn(2_100_000) * 0.1
    codec = SharedResidualCodec(50)
    cpu = codec.decode_batch(codec.encode_batch(w, shared), shared, out=torch.empty_like(w))
    wg, sg = w.cuda(), shared.cuda()
    gpu = codec.decode_batch(codec.encode_batch(wg, sg), sg, out=torch.empty_like(wg))
    assert torch.equal(gpu.cpu(), cpu)
    ef = ErrorFeedbackTopK(20)
    sent = torch.zeros(100_000, device="cuda")
    g = torch.randn(100_000, device="cuda")
    for _ in range(30):
        sent += ef.decompress(ef.compress("k", g), shape=g.shape, dtype=g.dtype)
    assert torch.allclose(sent + ef.residual("k"), 30 * g, atol=1e-3)


def test_encode_decode_speed_report():
    """Prints GPU encode/decode time per 8.4M-parameter expert (not an assertion on speed)."""
    from triton.testing import do_bench

    w = torch.randn(8_400_000, device="cuda", dtype=torch.bfloat16)
    s = torch.randn(8_400_000, device="cuda", dtype=torch.bfloat16) * 0.1
    codec = SharedResidualCodec(50)
    payload = codec.encode(w, s)
    out = torch.empty_like(w)
    enc = do_bench(lambda: codec.encode(w, s, out=payload))
    dec = do_bench(lambda: codec.decode(payload, s, out=out))
    print(f"\n[gpu] 8.4M-param bf16 expert, 50x: encode {enc:.3f} ms, decode {dec:.3f} ms "
          f"({torch.cuda.get_device_name()})")
    assert enc > 0 and dec > 0


def test_fused_decode_of_a_deepseek_size_layer():
    """A row of 17M elements has more 256-element tiles than CUDA allows on grid axis 1 (65535): the
    launch failed with 'invalid argument' at DeepSeek-V3 size until tiles moved to axis 0."""
    n, rows = 17_000_000, 2
    g = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16)
    base = torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16) * 0.1
    shift = (torch.randn(n, device="cuda", generator=g) * 0.01).to(torch.bfloat16)
    codec = SharedResidualCodec(50)
    payloads = codec.encode_batch(w, base + shift)
    want = codec.decode_batch(payloads, base + shift, out=torch.empty_like(w))
    got = codec.decode_rows(payloads, base, out=torch.empty_like(w), shift=shift)
    assert torch.equal(got, want)


@pytest.mark.parametrize("rows,n,ratio,dtype,base", [
    (8, 2_100_000, 50, torch.bfloat16, "per-row"),   # paper-s layer: the runtime's case
    (3, 300_001, 10, torch.float32, "one"),          # one shared expert for every row
    (2, 140_000, 300, torch.bfloat16, "per-row"),    # BLOCK16 payloads
    (2, 17_000_000, 50, torch.bfloat16, "per-row"),  # 66k tiles per row: tiles must stay on grid axis 0
])
def test_batched_encode_equals_per_expert_encode_on_gpu(rows, n, ratio, dtype, base):
    """encode_batch encodes every row in one set of launches; each slot must hold the bytes the
    single-expert encode gives (Triton) and the torch reference gives, fused histogram or not."""
    from megatron_hybridep.kernels.fused_codec import first_digit_hist

    g = torch.Generator(device="cuda").manual_seed(rows * n)
    w = torch.randn(rows, n, device="cuda", generator=g).to(dtype)
    s = (torch.randn(rows, n, device="cuda", generator=g) * 0.1).to(dtype) if base == "per-row" \
        else torch.randn(n, device="cuda", generator=g).to(dtype)
    codec = SharedResidualCodec(ratio)
    batch = codec.encode_batch(w, s)
    one = torch.cat([codec.encode(w[r], s[r] if s.dim() == 2 else s) for r in range(rows)])
    assert torch.equal(batch, one)
    hists = first_digit_hist(w, s if s.dim() == 2 else s.expand(rows, n))
    assert torch.equal(codec.encode_batch(w, s, first_hists=hists), batch)
    if n <= 2_100_000:  # the torch reference's top-k is slow at DeepSeek size
        ref = SharedResidualCodec(ratio, backend="torch").encode_batch(w, s)
        assert torch.equal(batch, ref)
