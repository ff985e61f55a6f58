"""Oracle: Megatron's alltoall-EP MoE layer on 1, 2 and 4 CPU ranks equals an independent
single-process computation (pure torch) with the same weights: outputs, input gradients, router
gradients and every expert gradient, in float64 (see TOL)."""

import pytest
import torch

from megatron_hybridep.testing.exactness import FP64_TOL, scaled_error
from megatron_hybridep.testing.moe import MoESpec, rank_input, reference_grads
from megatron_hybridep.train.launch import run_ranks
from tests.layer.helpers import init_ep_ranks

TOL = FP64_TOL
CASES = [MoESpec(top_k=k, aux_loss_coeff=aux, dtype=torch.float64) for k in (1, 2) for aux in (0.0, 1e-2)]


def _ep_case(ctx, cases):
    from megatron.core import parallel_state as ps

    from megatron_hybridep.testing.moe import build_moe_layer

    init_ep_ranks(ctx)
    errors = []
    for spec in cases:
        layer = build_moe_layer(spec, ctx.rank, ctx.world_size)
        x = rank_input(spec, ctx.rank).requires_grad_(True)
        out, _ = layer(x)
        out.backward(rank_input(spec, ctx.rank, step=99))
        ref = reference_grads(spec, ctx.world_size, ctx.rank)
        n_local = spec.experts // ctx.world_size
        err = {
            "out": scaled_error(out, ref["out"]),
            "dx": scaled_error(x.grad, ref["dx"]),
            "router": scaled_error(layer.router.weight.grad, ref["router"]),
        }
        for i, expert in enumerate(layer.experts.local_experts):
            e = ctx.rank * n_local + i
            err[f"fc1[{e}]"] = scaled_error(expert.linear_fc1.weight.grad, ref["fc1"][e])
            err[f"fc2[{e}]"] = scaled_error(expert.linear_fc2.weight.grad, ref["fc2"][e])
        errors.append((spec.top_k, spec.aux_loss_coeff, err))
    ps.destroy_model_parallel()
    return errors


@pytest.mark.exactness
@pytest.mark.parametrize("world", [1, 2, 4])
def test_alltoall_ep_matches_single_process_reference(world):
    results = run_ranks(_ep_case, world, CASES, timeout=240)
    for rank, errors in enumerate(results):
        for top_k, aux, err in errors:
            bad = {k: v for k, v in err.items() if not v <= TOL}
            assert not bad, f"rank {rank}/{world} top_k={top_k} aux={aux}: {bad}"


def test_reference_sees_aux_loss():
    """Guard against a vacuous oracle: the aux loss must change the router gradient."""
    spec = MoESpec(top_k=2)
    g = [
        reference_grads(MoESpec(top_k=2, aux_loss_coeff=c), 1, 0)["router"] for c in (0.0, 1.0)
    ]
    assert (g[0] - g[1]).abs().max() > 1e-3, spec
