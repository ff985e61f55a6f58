"""Shared-expert rule: mean of all experts, identical on every rank, refreshed on schedule."""

import threading

import pytest
import torch

from megatron_hybridep.runtime.compression import SharedExpertRule, SharedResidualCodec, shared_expert_mean


class FakeAllReduce:
    """An in-process SUM all-reduce across `world` threads (fixed rank order, like a ring)."""

    def __init__(self, world):
        self.world, self.barrier, self.slots = world, threading.Barrier(world), [None] * world

    def for_rank(self, rank):
        def reduce_sum(t):
            self.slots[rank] = t.clone()
            self.barrier.wait()
            out = torch.zeros_like(t)
            for s in self.slots:
                out += s
            self.barrier.wait()
            return out

        return reduce_sum


def _run_ranks(world, fn):
    results = [None] * world
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, fn(r))) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_mean_is_identical_on_every_rank():
    torch.manual_seed(0)
    world, per_rank, n = 4, 3, 5000
    experts = [torch.randn(n, dtype=torch.bfloat16) for _ in range(world * per_rank)]
    ar = FakeAllReduce(world)
    shared = _run_ranks(world, lambda r: shared_expert_mean(experts[r * per_rank:(r + 1) * per_rank],
                                                            world * per_rank, ar.for_rank(r)))
    for s in shared[1:]:
        assert torch.equal(s, shared[0])  # bit-identical: encoder and decoder agree
    assert shared[0].dtype == torch.bfloat16
    ref = torch.stack([e.float() for e in experts]).mean(0)
    assert torch.allclose(shared[0].float(), ref, atol=1e-2)
    # Any rank's payload decodes identically with any other rank's shared tensor.
    codec = SharedResidualCodec(50)
    p = codec.encode(experts[5], shared[1])
    assert torch.equal(codec.decode(p, shared[3]), codec.decode(p, shared[1]))


def test_single_process_and_validation():
    xs = [torch.ones(10), 3 * torch.ones(10)]
    assert torch.equal(shared_expert_mean(xs, 2), 2 * torch.ones(10))
    with pytest.raises(ValueError):
        shared_expert_mean([], 2)


def test_refresh_schedule():
    rule = SharedExpertRule(refresh_every=5)
    assert rule.due(3, initialised=False)
    assert [s for s in range(16) if rule.due(s)] == [5, 10, 15]
    frozen = SharedExpertRule()
    assert not any(frozen.due(s) for s in range(100)) and frozen.due(7, initialised=False)
    with pytest.raises(ValueError):
        SharedExpertRule(-1)
    assert rule.sync_bytes_per_step(1000, torch.bfloat16) == 2000 / 5
    assert frozen.sync_bytes_per_step(1000, torch.bfloat16) == 0


def test_maybe_refresh_follows_the_experts_and_cuts_error_after_drift():
    torch.manual_seed(0)
    n, e = 4000, 8
    experts = [torch.randn(n) for _ in range(e)]
    rule = SharedExpertRule(refresh_every=10)
    shared = rule.maybe_refresh(0, None, experts, e)
    # the documented float32 sum in list order, then / e: bit for bit (a reduction's order is the CPU's)
    assert torch.equal(shared, sum(experts, torch.zeros(n)) / e)
    assert rule.maybe_refresh(3, shared, experts, e) is shared  # not due: same tensor
    drift = 2 * torch.randn(n)  # training moves all experts together
    experts = [x + drift for x in experts]
    refreshed = rule.maybe_refresh(10, shared, experts, e)
    assert refreshed is not shared
    codec = SharedResidualCodec(50)
    err = lambda s: sum((codec.decode(codec.encode(x, s), s) - x).norm() for x in experts)
    assert err(refreshed) < 0.5 * err(shared)
