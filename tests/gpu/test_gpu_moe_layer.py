"""On one GPU: the hybridep MoE layer with grouped-GEMM experts (TEGroupedMLP when TransformerEngine
imports; otherwise Megatron's local experts, since megatron-core 0.19 has no non-TE grouped MLP),
bf16, equals Megatron's alltoall EP on 2 and 4 ranks.

One GPU holds one NCCL rank, so the ranks share GPU 0 and talk over gloo with CUDA tensors (the
shared harness run_ranks). This checks the CUDA compute path (TE kernels, bf16, Megatron's CUDA
streams and device-to-host syncs in the dispatcher) and the collectives' semantics on device
tensors; it does not exercise NCCL (docs/gpu.md says what that leaves open).

Tolerance: bf16 differs from exact math anyway, so both systems are measured against a float64
reference with the same bf16-rounded weights and inputs, routed as the oracle routed (a near-tie
that bf16 breaks the other way would compare different experts); hybridep must route like the
oracle and be within twice the oracle's own error on every output and gradient."""

import dataclasses

import pytest
import torch

from megatron_hybridep.testing.moe import MoESpec, rank_input, reference_grads
from megatron_hybridep.train.launch import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

SPEC = MoESpec(hidden=128, ffn=256, experts=8, top_k=2, aux_loss_coeff=1e-2, seq=64, batch=2)


def _te_available() -> bool:
    from megatron_hybridep.megatron.compat import transformer_engine_version

    return transformer_engine_version() is not None


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def _run(layer, spec: MoESpec, rank: int, fused: bool) -> dict[str, torch.Tensor]:
    from megatron_hybridep.testing.moe import expert_weights

    experts = [p for pair in expert_weights(layer) for p in pair]
    if fused:  # what Megatron's DDP gives parameters: an fp32 main_grad the fused wgrad adds into
        for p in experts:
            p.main_grad, p.grad_added_to_main_grad = torch.zeros_like(p, dtype=torch.float32), False
    x = rank_input(spec, rank).to("cuda", torch.bfloat16).requires_grad_(True)
    seen = []
    hook = layer.router.register_forward_hook(lambda _m, _i, o: seen.append(o[1].detach()))
    out, _ = layer(x)
    hook.remove()
    out.backward(rank_input(spec, rank, step=99).to("cuda", torch.bfloat16))
    torch.cuda.synchronize()
    got = {"out": out.detach(), "dx": x.grad, "router": layer.router.weight.grad}
    for i, (fc1, fc2) in enumerate(expert_weights(layer)):
        got[f"fc1.{i}"], got[f"fc2.{i}"] = (fc1.main_grad, fc2.main_grad) if fused else (fc1.grad, fc2.grad)
    assert all(t.is_cuda for t in got.values())
    routing_map = seen[0].cpu()  # [tokens, experts] bool: the experts each token went to
    top_idx = routing_map.nonzero()[:, 1].view(routing_map.shape[0], spec.top_k)
    return {k: v.double().cpu() for k, v in got.items()}, top_idx


def _gpu_case(ctx, plans, use_te: bool, fused: bool):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hybridep.megatron import cpu_runtime, setup, teardown
    from megatron_hybridep.testing import fused_wgrad
    from megatron_hybridep.testing.moe import build_moe_layer

    torch.cuda.set_device(0)  # every rank on the one GPU
    assert cpu_runtime.enable() is False  # CUDA present: Megatron untouched
    ps.initialize_model_parallel(expert_model_parallel_size=ctx.world_size)
    model_parallel_cuda_manual_seed(7)
    spec = SPEC
    if fused:  # --gradient-accumulation-fusion; without Apex/TE, its wgrad kernel's stand-in
        stand_in = fused_wgrad.install() if not use_te else None
        spec = dataclasses.replace(SPEC, extra={"gradient_accumulation_fusion": True})
    build = dict(grouped_gemm=True, transformer_engine=use_te, bf16=True, params_dtype=torch.bfloat16,
                 use_cpu_initialization=False)
    oracle_layer = build_moe_layer(spec, ctx.rank, ctx.world_size, **build).cuda()
    experts_type = type(oracle_layer.experts).__name__
    oracle = _run(oracle_layer, spec, ctx.rank, fused)
    results = {}
    for plan in plans:
        setup([plan])
        layer = build_moe_layer(dataclasses.replace(spec, dispatcher="hybridep"), ctx.rank, ctx.world_size,
                                **build).cuda()
        assert layer.hybridep
        results[plan.label] = _run(layer, spec, ctx.rank, fused)
        teardown()
    ps.destroy_model_parallel()
    if fused and not use_te:
        assert stand_in.calls, "the fused wgrad path never ran"
    return experts_type, oracle, results


def _plans(world: int):
    from megatron_hybridep.plan.plan import Plan

    plans = [Plan.grid((world,), (s,), SPEC.experts) for s in (2, 4) if s <= world]
    if world == 4:
        plans.append(Plan.grid((2, 2), (2, 1), SPEC.experts, ("dc", "gpu")))
    return plans


@pytest.mark.parametrize("world, fused", [(2, False), (4, False), (4, True)], ids=["2", "4", "4-fused-wgrad"])
def test_hybridep_grouped_bf16_equals_alltoall_on_one_gpu(world, fused):
    use_te = _te_available()
    out = run_ranks(_gpu_case, world, _plans(world), use_te, fused, timeout=500, start_method="spawn")
    n_local = SPEC.experts // world
    routes = [oracle[1] for _, oracle, _ in out]
    for rank, (experts_type, (oracle, route), results) in enumerate(out):
        assert experts_type == ("TEGroupedMLP" if use_te else "SequentialMLP")
        ref = reference_grads(SPEC, world, rank, cast=_bf16, routes=routes)
        ref.update({f"{n}.{i}": ref[n][rank * n_local + i] for n in ("fc1", "fc2") for i in range(n_local)})
        oracle_err = {k: (v - ref[k]).abs().max().item() for k, v in oracle.items()}
        scale = {k: ref[k].abs().max().item() for k in oracle}
        # The oracle itself must agree with float64 on its own routing: bf16 error, nothing larger.
        off = {k: e for k, e in oracle_err.items() if not e <= 0.05 * scale[k] + 1e-3}
        assert not off, f"rank {rank}: alltoall bf16 vs float64 too far (routing tie?): {off}"
        for label, (got, got_route) in results.items():
            assert torch.equal(got_route, route), f"rank {rank} plan {label}: routed unlike alltoall"
            err = {k: (v - ref[k]).abs().max().item() for k, v in got.items()}
            bad = {k: (err[k], oracle_err[k]) for k in err if not err[k] <= 2 * oracle_err[k] + 1e-6}
            assert not bad, f"rank {rank} plan {label} ({experts_type}): (hybridep err, alltoall err) {bad}"
