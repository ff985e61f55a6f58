"""Top-k gradient compression with error feedback."""

import pytest
import torch

from megatron_hybridep.runtime.compression import ErrorFeedbackTopK


def test_off_is_exact_and_stateless():
    ef = ErrorFeedbackTopK()  # ratio 1 = off
    g = torch.randn(4, 300, dtype=torch.bfloat16)
    p = ef.compress("w1", g)
    assert p.numel() == ef.nbytes(g.numel(), g.dtype)
    assert torch.equal(ef.decompress(p, shape=g.shape, dtype=g.dtype), g)
    assert ef.residual("w1") is None and ef.state_nbytes == 0
    acc = torch.ones(4, 300, dtype=torch.bfloat16)
    ef.decompress(p, out=acc, accumulate=True)
    assert torch.equal(acc, (1 + g.float()).to(torch.bfloat16))


@pytest.mark.parametrize("ratio", [1.0, 1.05])  # 1.05: bf16 values and a bitmap would not be smaller
def test_a_dense_payload_is_the_gradient_itself_whatever_the_value_dtype(ratio):
    """bf16 values are for sparse payloads, whose rounding the feedback keeps; a dense one (ratio 1,
    or sparse not smaller) has no feedback, so it carries the fp32 gradient, exact."""
    ef = ErrorFeedbackTopK(ratio, value_dtype=torch.bfloat16)
    g = torch.randn(1000)
    p = ef.compress("e0", g)
    assert p.numel() == 4000 and torch.equal(ef.decompress(p, shape=g.shape, dtype=g.dtype), g)
    assert ErrorFeedbackTopK(4, value_dtype=torch.bfloat16).nbytes(1000, torch.float32) < 0.7 * \
        ErrorFeedbackTopK(4).nbytes(1000, torch.float32)


@pytest.mark.parametrize("ratio", [20, 4])  # BLOCK8 indices; the bitmap (the default returns' 4x)
@pytest.mark.parametrize("dtype,vdt", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.bfloat16)])
def test_error_feedback_nothing_is_lost(dtype, vdt, ratio):
    """sum(sent) + residual == sum(grads): the dropped part is delayed, never lost."""
    torch.manual_seed(0)
    n, steps = 2000, 60
    ef = ErrorFeedbackTopK(ratio, value_dtype=vdt)
    sent = torch.zeros(n)
    true = torch.zeros(n)
    for _ in range(steps):
        g = torch.randn(n).to(dtype)
        p = ef.compress("e0", g)
        assert p.numel() == ef.nbytes(n, dtype) < n * g.element_size() / min(ratio, 4) * 1.5
        ef.decompress(p, out=sent, src_dtype=dtype, accumulate=True)
        true += g.float()
    # elementwise float32 only: each of the 2 running sums rounds by <= half an ulp per step
    bound = 2 * steps * 0.5 * torch.finfo(torch.float32).eps * 2 * true.abs().max().item()
    assert (sent + ef.residual("e0") - true).abs().max().item() <= bound


def test_error_feedback_converges_where_plain_topk_drifts():
    """A constant bias spread over many small coordinates: plain top-k never sends it, EF does."""
    torch.manual_seed(0)
    n = 1000
    bias = torch.full((n,), 0.05)
    errs = {}
    for name, ef_on in (("ef", True), ("plain", False)):
        ef = ErrorFeedbackTopK(50)
        sent, true = torch.zeros(n), torch.zeros(n)
        norms = []
        for t in range(1, 401):
            g = bias + torch.randn(n)
            if not ef_on:
                ef.reset()
            ef.decompress(ef.compress(0, g), out=sent, accumulate=True)
            true += g
            if t in (100, 400):
                norms.append(((sent - true).norm() / t).item())
        errs[name] = norms
    # EF: the mean error shrinks like 1/T (residual bounded); plain top-k keeps losing the bias.
    assert errs["ef"][1] < 0.4 * errs["ef"][0]
    assert errs["plain"][1] > 0.8 * bias.norm()
    assert errs["ef"][1] < 0.2 * errs["plain"][1]


def test_residual_stays_bounded():
    torch.manual_seed(1)
    n, ratio = 500, 10
    ef = ErrorFeedbackTopK(ratio)
    norms = []
    for _ in range(300):
        ef.compress("x", torch.randn(n))
        norms.append(ef.residual("x").norm().item())
    # Top-k is a delta-contraction (delta = k/n): ||e|| <= sqrt(1-d)/(1-sqrt(1-d)) * max||g||.
    d = (n // ratio) / n
    bound = (1 - d) ** 0.5 / (1 - (1 - d) ** 0.5) * (n ** 0.5 * 1.3)
    assert max(norms) < bound
    assert max(norms[150:]) < 1.5 * max(norms[:150])  # no growth


def test_keys_state_dict_and_validation():
    ef = ErrorFeedbackTopK(10)
    a, b = torch.randn(300), torch.randn(400)
    ef.compress("a", a)
    ef.compress("b", b)
    assert ef.residual("a").numel() == 300 and ef.residual("b").numel() == 400
    assert ef.state_nbytes == 4 * 700
    state = ef.state_dict()
    ef2 = ErrorFeedbackTopK(10)
    ef2.load_state_dict(state)
    assert torch.equal(ef.compress("a", a), ef2.compress("a", a))
    with pytest.raises(ValueError):
        ef.compress("a", torch.randn(1000))
    ef.reset("a")
    assert ef.residual("a") is None and ef.residual("b") is not None
