"""Codec kernels: dispatcher, argument checks, torch reference semantics, and the Triton
kernels against the torch reference under TRITON_INTERPRET=1 (in a subprocess)."""

import pytest
import torch

from megatron_hybridep.kernels import codec as C

from .helpers import check_compiles_for_sm90, check_under_interpreter


def test_triton_kernels_match_torch_under_interpreter(interpreter_runs):
    check_under_interpreter(interpreter_runs["interp_cases.py"])


def test_triton_kernels_compile_for_sm90_without_a_gpu():
    check_compiles_for_sm90("aot_compile.py")


def test_dispatcher_uses_torch_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    t = torch.zeros(4)
    assert not C.triton_usable(t)
    assert C._pick("auto", t) == "torch"
    with pytest.raises(RuntimeError):
        C._pick("triton", t)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert C.triton_usable(t) == C._triton_importable()


def _bufs(n, k, bits, vdt=torch.float32):
    return (torch.empty(k, dtype=vdt), torch.empty(k * C.offsets_per_entry(bits), dtype=C.OFFSET_DTYPES[bits]),
            torch.empty(C._nblocks(n, bits), dtype=C.COUNT_DTYPES[bits]))


@pytest.mark.parametrize("bits,n,k", [(8, 70_000, 1234), (16, 70_000, 1234), (32, 70_000, 1234),
                                      (C.BITMAP_BITS, 70_003, 1234),  # a partial last byte
                                      (C.BITMAP_BITS, 300_005, 75_001), (8, 300_000, 30_000)])  # sampled threshold
def test_torch_reference_encode_decode(bits, n, k):
    torch.manual_seed(0)
    w, s = torch.randn(n), torch.randn(n)
    v, o, c = _bufs(n, k, bits)
    C.residual_topk_encode(w, s, k, bits, v, o, c, backend="torch")
    idx = C.absolute_indices(o, c, bits, k)
    ref = torch.topk((w - s).abs(), k).indices.sort().values
    assert torch.equal(idx, ref) and (bits == C.BITMAP_BITS or int(c.long().sum()) == k)  # bitmap: bytes
    assert torch.equal(v, (w - s)[ref])
    out = torch.empty(n)
    C.sparse_residual_decode(s, v, o, c, bits, out, backend="torch")
    expect = s.clone()
    expect[ref] += v
    assert torch.equal(out, expect)
    # In place with alpha=-1 removes exactly the sent entries (error-feedback use).
    acc = w - s
    C.sparse_residual_decode(acc, v, o, c, bits, acc, alpha=-1.0, backend="torch")
    assert torch.count_nonzero(acc[ref]) == 0 and torch.equal(acc[~torch.isin(torch.arange(n), ref)],
                                                              (w - s)[~torch.isin(torch.arange(n), ref)])


def test_argument_checks():
    n, k = 1000, 10
    w = torch.randn(n)
    v, o, c = _bufs(n, k, 8)
    with pytest.raises(ValueError):
        C.residual_topk_encode(w, None, 0, 8, v, o, c)
    with pytest.raises(ValueError):
        C.residual_topk_encode(w, None, k, 12, v, o, c)
    with pytest.raises(ValueError):
        C.residual_topk_encode(w, torch.randn(n + 1), k, 8, v, o, c)
    with pytest.raises(ValueError):
        C.residual_topk_encode(w, None, k, 8, v, o.to(torch.int32), c)
    with pytest.raises(ValueError):
        C.residual_topk_encode(w, None, k, 8, v.to(torch.float64), o, c)
    with pytest.raises(ValueError):
        C.sparse_residual_decode(None, v, o, c, 8, torch.empty(n + 300))


@pytest.mark.parametrize("case", ["randn", "ties", "sample_misleads", "k_large", "k_near_n"])
def test_kth_largest_is_exact_including_when_the_sample_misleads(case, monkeypatch):
    n, k = 1_000_000, 600
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 1 << 30, (n,), generator=g, dtype=torch.int32)
    calls = []
    real_topk = torch.topk
    monkeypatch.setattr(torch, "topk", lambda t, kk, **kw: calls.append(t.numel()) or real_topk(t, kk, **kw))
    if case == "ties":
        x = torch.randint(0, 50, (n,), generator=g, dtype=torch.int32)
    elif case == "sample_misleads":
        # The sampled entries are the only large ones but fewer than k: the bound from the
        # sample is too high, too few candidates survive, and the full top-k must run.
        stride = max(16, n // C._SAMPLE)  # kth_largest's own
        x = torch.randint(0, 10_000, (n,), generator=g, dtype=torch.int32)
        x[::stride] = 10_000
        k = 100_000
    elif case == "k_large":
        k = n // 4
    elif case == "k_near_n":
        k = n - 3
    got = C.kth_largest(x, k)
    assert got == real_topk(x, k).values[-1]
    full = n in calls
    if case == "k_near_n":  # exact, whichever path ran
        return
    assert full == (case == "sample_misleads")  # the fast path ran where it could
    if not full:  # the final top-k ran on a thin band around the answer
        assert calls[-1] < n // 20


def test_rows_encode_checks_shapes_and_equals_one_encode_per_row():
    from megatron_hybridep.runtime.compression import SharedResidualCodec

    torch.manual_seed(3)
    rows, n, k = 3, 5000, 50
    w, s = torch.randn(rows, n), torch.randn(rows, n)
    v, o, c = (torch.empty(rows, k), torch.empty(rows, k, dtype=torch.uint8),
               torch.empty(rows, C._nblocks(n, 8), dtype=torch.uint16))
    C.residual_topk_encode_rows(w, s, k, 8, v, o, c, backend="torch")
    for r in range(rows):
        one = _bufs(n, k, 8)
        C.residual_topk_encode(w[r], s[r], k, 8, *one, backend="torch")
        assert all(torch.equal(a, b) for a, b in zip(one, (v[r], o[r], c[r]), strict=True))
    with pytest.raises(ValueError, match="shared must be"):
        C.residual_topk_encode_rows(w, s[:2], k, 8, v, o, c)
    with pytest.raises(ValueError, match="values must be"):
        C.residual_topk_encode_rows(w, s, k, 8, v[:2], o, c)
    with pytest.raises(ValueError, match="first_hists"):
        C.residual_topk_encode_rows(w, s, k, 8, v, o, c, first_hists=torch.zeros(rows, 255, dtype=torch.int32))
    codec = SharedResidualCodec(20)
    assert torch.equal(codec.encode_batch(list(w), s), codec.encode_batch(w, s))
    assert torch.equal(codec.encode_batch(w, s[0]), torch.cat([codec.encode(x, s[0]) for x in w]))
