"""Rank-side pieces shared by the MoE-layer tests (run inside train.launch.run_ranks)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_hybridep.plan.plan import Plan, PlanError
from megatron_hybridep.testing.exactness import scaled_error
from megatron_hybridep.testing.moe import MoESpec, rank_input


def init_ep_ranks(ctx, seed: int = 7) -> None:
    """The CPU runtime, EP over every rank, and Megatron's model-parallel RNG seeded."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hybridep.megatron import cpu_runtime

    cpu_runtime.enable()
    ps.initialize_model_parallel(expert_model_parallel_size=ctx.world_size)
    model_parallel_cuda_manual_seed(seed)


def run_steps(layer, spec: MoESpec, rank: int, world: int, steps: int, lr: float = 0.05):
    """``steps`` Adam steps on this rank's inputs: per step the output and the input, router and
    every local expert's gradients (experts by global index), then the parameters after them."""
    opt = torch.optim.Adam(layer.parameters(), lr=lr)
    n_local = spec.experts // world
    trace = []
    for step in range(steps):
        opt.zero_grad()
        x = rank_input(spec, rank, step).requires_grad_(True)
        out, _ = layer(x)
        out.backward(rank_input(spec, rank, 100 + step))
        grads = {"out": out.detach().clone(), "dx": x.grad.clone(), "router": layer.router.weight.grad.clone()}
        for i, e in enumerate(layer.experts.local_experts):
            grads[f"fc1[{rank * n_local + i}]"] = e.linear_fc1.weight.grad.clone()
            grads[f"fc2[{rank * n_local + i}]"] = e.linear_fc2.weight.grad.clone()
        trace.append(grads)
        opt.step()
    return trace, {n: p.detach().clone() for n, p in layer.named_parameters()}


def compare_with_oracle(ctx, plans: Sequence[Plan], specs: Sequence[MoESpec], steps: int,
                        build: Callable[[MoESpec, int, int], Any], summarize: Callable[..., dict]) -> list[dict]:
    """Per spec, Megatron's alltoall layer (the oracle, instrumented) and then, per plan, the hybridep
    layer run the same steps; ``errors`` maps every traced tensor and parameter to its scaled error
    against the oracle's. Returns ``summarize(plan=, spec=, runtime=, oracle_stats=, errors=)`` per run."""
    from megatron.core import parallel_state as ps

    from megatron_hybridep.megatron import setup, teardown
    from megatron_hybridep.megatron.dispatcher import instrument
    from megatron_hybridep.runtime.instrument import Stats

    init_ep_ranks(ctx)
    report = []
    for spec in specs:
        oracle = build(spec, ctx.rank, ctx.world_size)
        oracle_stats = Stats()
        instrument(oracle.token_dispatcher, oracle_stats, 0)
        ref_trace, ref_params = run_steps(oracle, spec, ctx.rank, ctx.world_size, steps)
        for plan in plans:
            runtime = setup([plan])
            layer = build(dataclasses.replace(spec, dispatcher="hybridep"), ctx.rank, ctx.world_size)
            assert type(layer).__name__ == "HybridEPMoELayer" and layer.hybridep
            trace, params = run_steps(layer, spec, ctx.rank, ctx.world_size, steps)
            errors = {f"step{s}.{k}": scaled_error(a[k], b[k])
                      for s, (a, b) in enumerate(zip(trace, ref_trace, strict=True)) for k in a}
            errors.update({f"param.{k}": scaled_error(params[k], ref_params[k]) for k in params})
            report.append(summarize(plan=plan, spec=spec, runtime=runtime, oracle_stats=oracle_stats,
                                    errors=errors))
            teardown()
    ps.destroy_model_parallel()
    return report


def setup_and_capture(ctx, plan: Callable[[], Plan], num_experts: int,
                      watched: Sequence[str]) -> tuple[str | None, list[str]]:
    """``setup`` of the plan ``plan()`` builds, with the ``watched`` torch.distributed calls recorded:
    (the PlanError's message, or None if setup accepted it; the calls made, in order)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_hybridep.megatron import cpu_runtime, setup

    cpu_runtime.enable()
    ps.initialize_model_parallel(expert_model_parallel_size=ctx.world_size)
    calls = []
    for name in watched:
        original = getattr(dist, name)
        setattr(dist, name, lambda *a, _n=name, _o=original, **k: (calls.append(_n), _o(*a, **k))[1])
    try:
        setup([plan()], num_experts=num_experts)
    except PlanError as exc:
        return str(exc), calls
    return None, calls
