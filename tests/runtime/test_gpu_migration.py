"""Compressed expert migration with CUDA tensors (2 ranks on one GPU, gloo, spawned): the fused
decode (Triton, rebase folded in) gives peers the copy the owner holds, bit for bit, across
shared-expert refreshes; the compressed gradient return encodes on the gradients' device; both
agree with the CPU run. Marker ``gpu``; the CPU run of the same case is in the default suite."""

from __future__ import annotations

import pytest
import torch

from megatron_hybridep.train.launch import run_ranks

NUMEL, LOCAL, STEPS = 70_001, 2, 6  # rows of 70k elements: several Triton tiles, an odd tail


def _drift(ctx, device: str, grad_ratio: float):
    import torch.distributed as dist

    from megatron_hybridep.runtime.migration import DomainGather, MigrationConfig, SharedExpert

    if device == "cuda":
        torch.cuda.set_device(0)
    g = torch.Generator().manual_seed(11)
    weights = torch.randn(ctx.world_size, LOCAL, NUMEL, generator=g)
    common = torch.randn(NUMEL, generator=g) * 0.02
    own_drift = torch.randn(ctx.world_size, LOCAL, NUMEL, generator=g) * 0.01
    probe = torch.randn(LOCAL, NUMEL, generator=g).to(device)
    params = [(f"weight{i}", torch.nn.Parameter(weights[ctx.rank, i].clone().to(device))) for i in range(LOCAL)]
    cfg = MigrationConfig(8.0, grad_ratio, shared_refresh_every=2)
    gather = DomainGather(params, dist.group.WORLD, ctx.rank, num_local=LOCAL, config=cfg,
                          shared=SharedExpert(dist.group.WORLD, ctx.world_size * LOCAL, 2))
    peer = 1 - ctx.rank
    copies, held = [], []
    for step in range(1, STEPS + 1):
        views = gather.borrowed()[peer]
        copy = torch.stack([views[f"weight{i}"] for i in range(LOCAL)])
        (copy * probe).sum().backward()  # the peer's gradient, returned (compressed) to its owner
        copies.append(copy.detach().cpu())
        held.append(gather._held.detach().cpu().clone())  # what this owner says its peers hold (updated in place)
        weights += common + own_drift * step
        with torch.no_grad():
            for i, (_, p) in enumerate(params):
                p.copy_(weights[ctx.rank, i])
        gather.on_step(step)
        gather.start()  # encode with the new weights, as after an optimizer step
    grads = torch.stack([p.grad for _, p in params])
    assert grads.device.type == device
    return dict(copies=copies, held=held, grads=grads.cpu())


def _check(out):
    for r in (0, 1):
        for step, (copy, held) in enumerate(zip(out[r]["copies"], out[1 - r]["held"], strict=True)):
            assert torch.equal(copy, held), f"rank {r}'s copy differs from its owner's at step {step + 1}"


@pytest.mark.gpu
@pytest.mark.parametrize("grad_ratio", [1.0, 8.0], ids=["exact-grads", "compressed-grads"])
def test_compressed_migration_on_gpu(grad_ratio):
    gpu = run_ranks(_drift, 2, "cuda", grad_ratio, timeout=300, start_method="spawn")
    cpu = run_ranks(_drift, 2, "cpu", grad_ratio, timeout=300)
    _check(gpu)
    for r in (0, 1):
        scale = cpu[r]["copies"][-1].abs().max().item()
        for a, b in zip(gpu[r]["copies"], cpu[r]["copies"], strict=True):
            assert (a - b).abs().max().item() <= 4 * torch.finfo(torch.float32).eps * scale
        ref = cpu[r]["grads"]
        assert (gpu[r]["grads"] - ref).norm() <= 1e-5 * ref.norm()


def test_compressed_migration_on_cpu():
    _check(run_ranks(_drift, 2, "cpu", 8.0, timeout=300))
