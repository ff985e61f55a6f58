"""Shared + residual weight codec: layouts, honest byte counts, round trips, error bounds."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hybridep.runtime.compression import (
    ALIGN,
    IndexScheme,
    PayloadLayout,
    SharedResidualCodec,
    TopKCodec,
    decode,
    decode_into,
    encode,
    encoded_nbytes,
    k_for_ratio,
    pack,
    plan_layout,
    unpack,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _expert(n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype)


def _dropped(w, shared, dec):
    """Residual r = w - shared with the kept entries (where decode moved off shared) zeroed."""
    r = w.float() - (0 if shared is None else shared.float())
    kept = dec.float() != (0 if shared is None else shared.float())
    return torch.where(kept, torch.zeros_like(r), r), kept


@pytest.mark.parametrize("dtype", DTYPES)
def test_ratio_one_is_dense_and_bit_exact(dtype):
    w = _expert(1000, dtype).view(10, 100)
    shared = _expert(1000, dtype, seed=1).view(10, 100)
    codec = SharedResidualCodec(1.0)
    payload = codec.encode(w, shared)
    lay = codec.layout(w.numel(), dtype)
    assert lay.dense and lay.k == w.numel()
    assert payload.dtype == torch.uint8
    assert payload.numel() == lay.nbytes == math.ceil(1000 * w.element_size() / 16) * 16
    out = codec.decode(payload, shared)
    assert out.shape == w.shape and out.dtype == dtype
    assert torch.equal(out, w)


def test_ratios_that_do_not_pay_fall_back_to_dense():
    # bf16 values + a bitmap (the cheapest index this dense): 1.05x would cost more than dense.
    assert plan_layout(1000, 1.05, torch.bfloat16).dense
    assert plan_layout(1000, 1.2, torch.bfloat16).scheme is IndexScheme.BITMAP  # 1,808 bytes < 2,000
    assert not plan_layout(1000, 4, torch.bfloat16).dense


def test_layout_byte_accounting_is_honest():
    n, vdt = 100_000, torch.bfloat16
    lay = plan_layout(n, 50, vdt)
    k = k_for_ratio(n, 50)
    assert lay.k == k == 2000 and lay.scheme is IndexScheme.BLOCK8
    nblocks = math.ceil(n / 256)
    a = lambda x: -(-x // ALIGN) * ALIGN
    assert lay.nbytes == a(2 * k) + a(2 * nblocks) + a(k)  # values + uint16 counts + uint8 offsets
    assert lay.nbytes < k * (2 + 4)  # far below value + int32 index
    assert encoded_nbytes(n, 50, vdt) == lay.nbytes
    assert lay.element_ratio == pytest.approx(50)
    assert lay.byte_ratio == pytest.approx(2 * n / lay.nbytes)


@pytest.mark.parametrize("n,ratio,expect", [(100_000, 4, IndexScheme.BITMAP), (100_000, 8, IndexScheme.BITMAP),
                                            (100_000, 9, IndexScheme.BLOCK8),
                                            (100_000, 10, IndexScheme.BLOCK8), (100_000, 50, IndexScheme.BLOCK8),
                                            (1_000_000, 500, IndexScheme.BLOCK16),
                                            (1_000_000, 100_000, IndexScheme.FLAT32)])
def test_scheme_choice_is_the_cheapest(n, ratio, expect):
    lay = plan_layout(n, ratio, torch.float32)
    assert lay.scheme is expect
    for s in (IndexScheme.BITMAP, IndexScheme.BLOCK8, IndexScheme.BLOCK16, IndexScheme.FLAT32):
        assert lay.nbytes <= PayloadLayout(n, lay.k, torch.float32, s).nbytes


@pytest.mark.parametrize("with_shared", [False, True])
@pytest.mark.parametrize("vdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio", [2, 4, 8])
def test_bitmap_payload_carries_block8s_entries_in_fewer_bytes(ratio, vdt, with_shared):
    """Below ratio ~8.5 the bitmap is chosen: the same kept entries as BLOCK8 (decoded bit for bit
    alike), n/8 bytes of index instead of k + n/128, and nothing else in the payload."""
    n = 70_001  # not a multiple of 8: the last bitmap byte is partial
    w = _expert(n, seed=5)
    shared = _expert(n, seed=6) if with_shared else None
    lay = plan_layout(n, ratio, vdt)
    assert lay.scheme is IndexScheme.BITMAP and lay.noffsets == 0
    block8 = PayloadLayout(n, lay.k, vdt, IndexScheme.BLOCK8)
    a = lambda x: -(-x // ALIGN) * ALIGN
    assert lay.nbytes == a(lay.k * vdt.itemsize) + a(math.ceil(n / 8)) < block8.nbytes
    payload = encode(w, shared, lay)
    assert sum(bin(b).count("1") for b in unpack(payload, lay).counts.tolist()) == lay.k  # one bit per entry
    base = torch.zeros(n) if shared is None else shared
    got = decode_into(payload, lay, base, torch.empty(n))
    want = decode_into(encode(w, shared, block8), block8, base, torch.empty(n))
    assert torch.equal(got, want)
    assert torch.equal(encode(w, shared, lay), payload)  # deterministic bytes, padding included


@pytest.mark.parametrize("ratio", [4, 10, 50, 300])
@pytest.mark.parametrize("vdt", [torch.float32, torch.bfloat16])
def test_bytes_ratio_mode_fits_budget_with_largest_k(ratio, vdt):
    n = 50_000
    lay = plan_layout(n, ratio, vdt, ratio_of="bytes")
    budget = n * torch.empty((), dtype=vdt).element_size() / ratio
    assert lay.nbytes <= budget
    assert plan_layout(n, n / (lay.k + 1), vdt).nbytes > budget or lay.k == n
    assert lay.byte_ratio >= ratio


@pytest.mark.parametrize("wdt", DTYPES)
@pytest.mark.parametrize("ratio", [3, 10, 50, 500])
def test_error_equals_dropped_residual_and_tail_mass(wdt, ratio):
    n = 70_000
    w, shared = _expert(n, wdt, 0), _expert(n, wdt, 1)
    codec = SharedResidualCodec(ratio, value_dtype=torch.float32)  # fp32 values: kept entries exact
    payload = codec.encode(w, shared)
    assert payload.numel() == codec.nbytes(n, wdt)  # bytes measured on the tensor that is sent
    dec = codec.decode(payload, shared)
    k = codec.layout(n, wdt).k
    r = w.float() - shared.float()
    dropped, kept = _dropped(w, shared, dec)
    assert int(kept.sum()) == k
    # Norms in float64: a float32 sum of 70k squares rounds by up to ~log2(n) * 2^-24 ~ 1e-6 depending
    # on the CPU's summation order, as large as eps below; float64 leaves only the codec's rounding.
    err = (dec.double() - w.double()).norm().item()
    # Kept entries come back up to rounding into the weight dtype; dropped ones are exactly -r.
    eps = {torch.float32: 1e-6, torch.bfloat16: 4e-3, torch.float16: 1e-3}[wdt]
    assert err == pytest.approx(dropped.double().norm().item(), rel=eps, abs=eps * r.double().norm().item())
    tail = r.abs().sort().values[: n - k]
    # top-k: the n-k smallest go (the same values, summed in another order: float64 makes it 1e-12)
    assert dropped.double().norm().item() == pytest.approx(tail.double().norm().item(), rel=1e-12)
    assert dropped.norm() ** 2 <= (1 - k / n) * r.norm() ** 2 + 1e-3
    assert dropped.abs().max() <= r.abs()[kept].min()


def test_selected_set_is_torch_topk_without_ties():
    n, k = 10_000, 200
    w, shared = _expert(n, seed=3), _expert(n, seed=4)
    lay = PayloadLayout(n, k, torch.float32, IndexScheme.BLOCK8)
    views = unpack(encode(w, shared, lay), lay)
    blocks = torch.repeat_interleave(torch.arange(views.counts.numel()), views.counts.long())
    idx = blocks * 256 + views.offsets.long()
    ref = torch.topk((w - shared).abs(), k).indices.sort().values
    assert torch.equal(idx, ref)
    assert torch.equal(views.values, (w - shared)[ref])


def test_ties_take_the_lowest_indices():
    n, k = 1000, 30
    w = torch.zeros(n)
    w[[5, 900]] = 3.0  # strictly largest
    w[::7] += 1.0  # 143 entries tie at magnitude 1
    w[5] = 3.0
    lay = plan_layout(n, n / k, torch.float32)
    dec = decode(encode(w, None, lay), lay, None)
    kept = (dec != 0).nonzero().squeeze(1)
    ties = torch.arange(0, n, 7)
    ties = ties[(ties != 5) & (ties != 900)]
    expect = torch.cat([torch.tensor([5, 900]), ties[: k - 2]]).sort().values
    assert torch.equal(kept, expect)


def test_shared_beats_plain_topk_when_experts_share_structure():
    torch.manual_seed(0)
    n, e = 20_000, 8
    common = torch.randn(n)
    experts = [common + 0.1 * torch.randn(n) for _ in range(e)]
    shared = torch.stack(experts).mean(0)
    with_shared, plain = SharedResidualCodec(50), TopKCodec(50)
    assert with_shared.nbytes(n, torch.float32) == plain.nbytes(n, torch.float32)  # same bytes
    err_s = sum((with_shared.decode(with_shared.encode(x, shared), shared) - x).norm() for x in experts)
    err_p = sum((plain.decode(plain.encode(x), dtype=torch.float32, shape=(n,)) - x).norm() for x in experts)
    assert err_s < 0.2 * err_p


def test_shared_codec_requires_shared_and_topk_ignores_it():
    w = _expert(1000)
    with pytest.raises(ValueError):
        SharedResidualCodec(10).encode(w)
    p = TopKCodec(10).encode(w, shared=torch.ones(1000))
    assert torch.equal(p, TopKCodec(10).encode(w))


def test_pack_unpack_views_and_concatenated_payloads():
    n, dtype = 3000, torch.bfloat16
    codec = SharedResidualCodec(20)
    shared = _expert(n, dtype, 9)
    experts = [_expert(n, dtype, s) for s in range(4)]
    lay = codec.layout(n, dtype)
    # Encode straight into slots of one buffer, as an all-gather input/output would hold them.
    buf = torch.empty(4 * lay.nbytes, dtype=torch.uint8)
    for i, x in enumerate(experts):
        codec.encode(x, shared, out=buf[i * lay.nbytes:(i + 1) * lay.nbytes])
    for i, x in enumerate(experts):
        slot = buf[i * lay.nbytes:(i + 1) * lay.nbytes]
        assert torch.equal(slot, codec.encode(x, shared))  # deterministic bytes, padding zeroed
        views = unpack(slot, lay)
        assert views.values.data_ptr() == slot.data_ptr()  # views, no copies
        assert torch.equal(pack(views, lay), slot)
        assert torch.equal(codec.decode(slot, shared), codec.decode(codec.encode(x, shared), shared))
    with pytest.raises(ValueError):
        unpack(torch.zeros(lay.nbytes + 1, dtype=torch.uint8)[1:], lay)  # misaligned
    with pytest.raises(ValueError):
        unpack(torch.zeros(lay.nbytes - 16, dtype=torch.uint8), lay)


def test_bf16_values_for_fp32_weights_round_kept_residuals_only():
    n = 5000
    w, shared = _expert(n, seed=1), _expert(n, seed=2)
    codec = SharedResidualCodec(10, value_dtype=torch.bfloat16)
    assert codec.layout(n, torch.float32).value_dtype == torch.bfloat16
    dec = codec.decode(codec.encode(w, shared), shared)
    r = w - shared
    dropped, kept = _dropped(w, shared, dec)
    # kept: within bf16 rounding of the residual (and fp32 rounding of shared + r)
    assert ((dec - w)[kept].abs() <= r[kept].abs() * 2**-8 + 1e-6).all()
    assert torch.equal((dec - w)[~kept], -r[~kept])


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3000), ratio=st.floats(1.0, 400.0), dt=st.sampled_from(DTYPES),
       use_shared=st.booleans(), seed=st.integers(0, 2**16))
def test_roundtrip_property(n, ratio, dt, use_shared, seed):
    w = _expert(n, dt, seed)
    shared = _expert(n, dt, seed + 1) if use_shared else None
    codec = SharedResidualCodec(ratio, use_shared=use_shared, value_dtype=torch.float32)
    lay = codec.layout(n, dt)
    p = codec.encode(w, shared)
    assert p.numel() == lay.nbytes == encoded_nbytes(n, ratio, torch.float32)
    assert lay.nbytes <= -(-n * 4 // 16) * 16  # never more than dense
    dec = codec.decode(p, shared, shape=(n,), dtype=dt)
    if lay.dense:
        assert torch.equal(dec, w.float().to(dt))
        return
    dropped, kept = _dropped(w, shared, dec)
    assert int(kept.sum()) <= lay.k  # kept entries whose residual rounds to 0 look unchanged
    eps = 1e-6 if dt == torch.float32 else 4e-3
    err = (dec.double() - w.double()).norm().item()  # float64 norms: no summation-order rounding
    assert abs(err - dropped.double().norm().item()) <= eps * (1 + w.double().norm().item())


def test_batch_encode_decode_matches_single():
    n, e, dtype = 2500, 3, torch.bfloat16
    codec = SharedResidualCodec(25)
    shared = _expert(n, dtype, 100).view(50, 50)
    flat_own = torch.stack([_expert(n, dtype, s) for s in range(e)]).view(e, 50, 50)
    buf = codec.encode_batch(flat_own, shared)
    nb = codec.nbytes(n, dtype)
    assert buf.numel() == e * nb
    out = torch.empty_like(flat_own)
    codec.decode_batch(buf.view(e, nb), shared, out=out)
    for i in range(e):
        assert torch.equal(buf[i * nb:(i + 1) * nb], codec.encode(flat_own[i], shared))
        assert torch.equal(out[i], codec.decode(codec.encode(flat_own[i], shared), shared))
    with pytest.raises(ValueError):
        codec.decode_batch(buf[:-16], shared, out=out)
