"""Borrowed copies are views of one flat buffer (views_of): their gradient is the flat gradient that
autograd's own slicing gives, built by one backward node (not one zero-filled buffer per view)."""

import torch

from megatron_hybridep.runtime.borrowed import views_of


def _spans():
    return [(0, torch.Size([3, 4])), (12, torch.Size([5])), (20, torch.Size([2, 2, 2]))]  # 17-19 and 28-29 unused


def _loss(tensors):
    a, b, c = tensors
    return (a.sin() * 2).sum() + (b * b).sum() + (c.exp() * c).sum()


def test_gradient_equals_autograd_slicing_in_float64():
    torch.manual_seed(0)
    flat = torch.randn(30, dtype=torch.float64, requires_grad=True)
    ref_flat = flat.detach().clone().requires_grad_(True)
    _loss(views_of(flat, _spans())).backward()
    _loss([ref_flat[s:s + shape.numel()].view(shape) for s, shape in _spans()]).backward()
    assert torch.equal(flat.grad, ref_flat.grad)
    assert flat.grad[17:20].eq(0).all() and flat.grad[28:].eq(0).all()


def test_views_share_the_buffer_and_one_backward_node():
    flat = torch.arange(30, dtype=torch.float32, requires_grad=True)
    views = views_of(flat * 1, _spans())
    assert len({v.grad_fn for v in views}) == 1
    assert views[1].tolist() == [12.0, 13.0, 14.0, 15.0, 16.0]
    assert views[2].shape == (2, 2, 2) and views[2][1, 1, 1].item() == 27.0


def test_views_that_get_no_gradient_count_as_zero():
    flat = torch.ones(30, requires_grad=True)
    a, _, c = views_of(flat, _spans())
    (3 * a.sum() + c.sum()).backward()
    expected = torch.zeros(30)
    expected[:12], expected[20:28] = 3, 1
    assert torch.equal(flat.grad, expected)


def test_no_view_used_gives_no_gradient():
    flat = torch.ones(30, requires_grad=True)
    other = torch.ones(2, requires_grad=True)
    views = views_of(flat, _spans())
    (other.sum() + 0 * views[0].detach().sum()).backward()
    assert flat.grad is None
