"""On a CUDA machine: the CPU runtime stays off, and a hybridep MoE layer (EP=1, one process,
NCCL) gives Megatron's alltoall results on the GPU. Marked gpu: skipped without CUDA, `pytest -m gpu` runs it."""

import os

import pytest
import torch

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def test_hybridep_layer_on_gpu_matches_alltoall(monkeypatch):
    import dataclasses

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hybridep.megatron import cpu_runtime, setup, teardown
    from megatron_hybridep.plan.plan import Plan
    from megatron_hybridep.testing.moe import MoESpec, build_moe_layer, rank_input

    assert cpu_runtime.enable() is False  # CUDA present: Megatron untouched
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", os.environ.get("HYBRIDEP_TEST_PORT", "29533"))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        ps.initialize_model_parallel(expert_model_parallel_size=1)
        model_parallel_cuda_manual_seed(3)
        spec = MoESpec(hidden=64, ffn=128, experts=8, top_k=2, aux_loss_coeff=1e-2, seq=32, batch=4)
        results = {}
        for dispatcher in ("alltoall", "hybridep"):
            if dispatcher == "hybridep":
                setup([Plan.grid((1,), (1,), spec.experts)])
            layer = build_moe_layer(dataclasses.replace(spec, dispatcher=dispatcher), 0, 1).cuda()
            x = rank_input(spec, 0).cuda().requires_grad_(True)
            out, _ = layer(x)
            out.backward(rank_input(spec, 0, 9).cuda())
            results[dispatcher] = (out.detach(), x.grad, layer.router.weight.grad,
                                   layer.experts.local_experts[3].linear_fc1.weight.grad)
        teardown()
        for a, b in zip(results["alltoall"], results["hybridep"], strict=True):
            assert a.is_cuda and torch.allclose(a, b, atol=1e-5, rtol=0)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
