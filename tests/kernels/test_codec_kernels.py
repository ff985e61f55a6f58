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
    return (torch.empty(k, dtype=vdt), torch.empty(k, dtype=C.OFFSET_DTYPES[bits]),
            torch.empty(C._nblocks(n, bits), dtype=C.COUNT_DTYPES[bits]))


@pytest.mark.parametrize("bits", [8, 16, 32])
def test_torch_reference_encode_decode(bits):
    torch.manual_seed(0)
    n, k = 70_000, 1234
    w, s = torch.randn(n), torch.randn(n)
    v, o, c = _bufs(n, k, bits)
    C.residual_topk_encode(w, s, k, bits, v, o, c, backend="torch")
    idx = C.absolute_indices(o, c, bits)
    ref = torch.topk((w - s).abs(), k).indices.sort().values
    assert torch.equal(idx, ref) and int(c.long().sum()) == k
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


@pytest.mark.parametrize("case", ["randn", "ties", "sample_misleads", "k_large"])
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
        stride = n // (1 << 16)
        x = torch.randint(0, 10_000, (n,), generator=g, dtype=torch.int32)
        x[::stride] = 10_000
        k = 100_000
    elif case == "k_large":
        k = n // 4
    got = C.kth_largest(x, k)
    assert got == real_topk(x, k).values[-1]
    full = n in calls
    assert full == (case in ("sample_misleads", "k_large"))  # the fast path ran where it could


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
