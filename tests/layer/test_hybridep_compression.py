"""Compressed expert migration wired into the dispatcher: borrowed copies are exactly the codec's
shared + residual reconstruction of the peer's weights (shared = mean of all experts over the EP
group), bytes on the wire are the codec's payload size, owners stay exact, and compressed
gradient return keeps the error-feedback promise (nothing lost, only delayed)."""

import dataclasses

import pytest
import torch

from megatron_hybridep.plan.phases import Phase
from megatron_hybridep.testing.moe import MoESpec, global_weights, rank_input
from megatron_hybridep.train.launch import run_ranks

SPEC = MoESpec(hidden=16, ffn=32, experts=4, top_k=2, seq=8, batch=2)


def _init(ctx):
    from megatron.core import parallel_state as ps

    from megatron_hybridep.megatron import cpu_runtime

    cpu_runtime.enable()
    ps.initialize_model_parallel(expert_model_parallel_size=ctx.world_size)


def _domain_layer(ctx, migration):
    """(runtime, hybridep layer) with every rank in one domain, ``migration`` moving the experts."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hybridep.megatron import setup
    from megatron_hybridep.plan.plan import Plan
    from megatron_hybridep.testing.moe import build_moe_layer

    model_parallel_cuda_manual_seed(7)
    runtime = setup([Plan.grid((ctx.world_size,), (ctx.world_size,), SPEC.experts)], migration=migration)
    return runtime, build_moe_layer(dataclasses.replace(SPEC, dispatcher="hybridep"), ctx.rank, ctx.world_size)


def _compressed(ctx, ratio, grad_ratio, use_shared, steps):
    from megatron.core import parallel_state as ps

    from megatron_hybridep.megatron import teardown
    from megatron_hybridep.runtime.compression import SharedResidualCodec
    from megatron_hybridep.runtime.migration import MigrationConfig

    _init(ctx)
    runtime, layer = _domain_layer(ctx, MigrationConfig(ratio, grad_ratio, use_shared, shared_refresh_every=0,
                                                        incremental=False))  # fixed copies: same backward passes
    gather = layer._plan_state[0].gather
    borrowed = gather.borrowed()
    # The oracle for the copies: encode the peer's true weights with the codec directly.
    w = global_weights(SPEC)
    rows = torch.cat([w.fc1.reshape(SPEC.experts, -1), w.fc2.reshape(SPEC.experts, -1)], dim=1)
    # compute_shared's contract: float32, each rank sums its own experts in order, then the group sum
    # (two ranks: a + b, exact and the same on both), so the copies must match bit for bit
    owned = [rows[r * (SPEC.experts // ctx.world_size):(r + 1) * (SPEC.experts // ctx.world_size)]
             for r in range(ctx.world_size)]
    partial = [sum(list(o.unbind(0)), torch.zeros_like(rows[0])) for o in owned]
    shared = sum(partial[1:], partial[0]) / SPEC.experts if use_shared else None
    codec = SharedResidualCodec(ratio, use_shared=use_shared)
    errors, exact_errors = [], []
    n_local = SPEC.experts // ctx.world_size
    for q, views in enumerate(borrowed):
        if views is None:
            continue
        for i in range(n_local):
            e = q * n_local + i
            want = codec.decode(codec.encode(rows[e], shared), shared, shape=rows[e].shape, dtype=rows.dtype)
            got = torch.cat([views[f"local_experts.{i}.linear_fc1.weight"].reshape(-1),
                             views[f"local_experts.{i}.linear_fc2.weight"].reshape(-1)])
            errors.append((got - want).abs().max().item())
            exact_errors.append((got - rows[e]).abs().max().item())
    wire = runtime.stats.bytes_by(phase=Phase.EXPERT_ALLGATHER)
    expected_wire = (ctx.world_size - 1) * n_local * codec.nbytes(rows.shape[1], rows.dtype)
    # Gradient return with error feedback: the owner's accumulated expert gradient over `steps`
    # identical backward passes, against `steps` times one exact pass (grad ratio 1).
    x = rank_input(SPEC, ctx.rank)
    for _ in range(steps):
        out, _ = layer(x)
        out.backward(rank_input(SPEC, ctx.rank, 99))
    grad_sum = torch.cat([p.grad.reshape(-1) for p in layer.experts.parameters()])
    teardown()
    ps.destroy_model_parallel()
    return dict(errors=errors, exact_errors=exact_errors, wire=wire, expected_wire=expected_wire,
                grad_sum=grad_sum)


@pytest.mark.parametrize("use_shared", [True, False], ids=["shared+residual", "plain-topk"])
def test_borrowed_copies_are_the_codec_reconstruction(use_shared):
    for r in run_ranks(_compressed, 2, 8.0, 1.0, use_shared, 1, timeout=240):
        assert r["errors"] and max(r["errors"]) == 0.0, r["errors"]  # same inputs, same codec: bitwise
        assert max(r["exact_errors"]) > 1e-3  # really compressed, not a silent exact path
        assert r["wire"] == r["expected_wire"] > 0


def _compressed_cases(ctx, cases):
    return [_compressed(ctx, *case) for case in cases]  # one rank start for several layers


def test_compressed_gradient_return_loses_nothing_over_steps():
    steps = 12
    cases = [(8.0, 1.0, True, steps), (8.0, 16.0, True, steps), (8.0, 16.0, True, 1), (8.0, 1.0, True, 1)]
    for exact, lossy, one, exact1 in run_ranks(_compressed_cases, 2, cases, timeout=240):
        ref, got = exact["grad_sum"], lossy["grad_sum"]
        rel_many = ((got - ref).norm() / ref.norm()).item()
        rel_one = ((one["grad_sum"] - exact1["grad_sum"]).norm() / exact1["grad_sum"].norm()).item()
        assert rel_one > 0.01, "gradient return was not compressed"
        assert rel_many < rel_one / 2, (rel_many, rel_one)  # the dropped part arrives later


def _warmup_returns(ctx, cases):
    """For each (ratio, warm-up steps, steps): one backward at each optimizer step in steps
    (residual cleared between), gradients returned at ratio with that warm-up -> {step: (bytes
    sent, owner's gradient)}."""
    from megatron.core import parallel_state as ps

    from megatron_hybridep.megatron import teardown
    from megatron_hybridep.runtime.migration import MigrationConfig

    _init(ctx)
    results = []
    for ratio, warmup, steps_at in cases:
        runtime, layer = _domain_layer(ctx, MigrationConfig(4.0, ratio, shared_refresh_every=0, incremental=False,
                                                            grad_warmup_steps=warmup))
        gather = layer._plan_state[0].gather
        out_of = {}
        for step in steps_at:
            layer.on_step(step)  # what the runtime does after each optimizer step (and on resume)
            if gather.grad_codec is not None:
                gather.grad_codec.reset()
            layer.zero_grad(set_to_none=True)
            runtime.stats.reset()
            out, _ = layer(rank_input(SPEC, ctx.rank))
            out.backward(rank_input(SPEC, ctx.rank, 99))
            out_of[step] = (runtime.stats.bytes_by(phase=Phase.GRAD_RETURN),
                            torch.cat([p.grad.reshape(-1) for p in layer.experts.parameters()]))
        teardown()
        results.append(out_of)
    ps.destroy_model_parallel()
    return results


def test_gradient_warmup_starts_exact_and_reaches_the_ratio():
    """--hybridep-grad-compression-warmup 4 at 16x: step 0 returns the dense gradient, step 2 the
    ratio 16 ** (2/4) = 4x, step 4 on the full 16x, each the same as a run without warm-up at
    that ratio; the ratio comes from the step alone, so a resumed run picks it up."""
    fixed = (1.0, 4.0, 16.0)
    out = run_ranks(_warmup_returns, 2, [(16.0, 4, (0, 2, 4))] + [(r, 0, (0,)) for r in fixed], timeout=240)
    for rank, (warm, *refs) in enumerate(out):
        for step, ref in zip((0, 2, 4), refs, strict=True):
            (nbytes, grad), (ref_bytes, ref_grad) = warm[step], ref[0]
            assert nbytes == ref_bytes > 0 and torch.equal(grad, ref_grad), (rank, step, nbytes, ref_bytes)
        assert warm[0][0] > warm[2][0] > warm[4][0]  # the wire really shrinks


def _incremental_copies(ctx, incremental, use_shared, ahead=False, numel=64, ratio=8.0, gathers=10, exact_first=False):
    """One expert per rank, a domain of 2: the error of the copy of the peer's expert after each
    gather (weights fixed), after weights drift, and after a plan switch (drop). Cold start (the
    first copy from the shared base) unless ``exact_first``."""
    import torch.distributed as dist

    from megatron_hybridep.runtime.instrument import Stats
    from megatron_hybridep.runtime.migration import DomainGather, MigrationConfig, SharedExpert

    weights = torch.randn(ctx.world_size, numel, generator=torch.Generator().manual_seed(3))
    own = torch.nn.Parameter(weights[ctx.rank].clone())
    shared = SharedExpert(dist.group.WORLD, ctx.world_size, refresh_every=0) if use_shared else None
    stats = Stats()
    gather = DomainGather([("weight", own)], dist.group.WORLD, ctx.rank, stats=stats, shared=shared,
                          config=MigrationConfig(ratio, use_shared=use_shared, incremental=incremental,
                                                 hold_copies=False,  # a gather per call, weights fixed or not
                                                 exact_first_gather=exact_first))
    peer = 1 - ctx.rank

    def error() -> float:
        return (gather.borrowed()[peer]["weight"].detach() - weights[peer]).abs().max().item()

    fixed = [error() for _ in range(gathers)]
    drift = torch.randn(weights.shape, generator=torch.Generator().manual_seed(4)) * 1e-3
    drifting = []
    for _ in range(gathers):
        weights += drift
        with torch.no_grad():
            own.copy_(weights[ctx.rank])
        if ahead:  # the runtime's post-optimizer-step encode; a repeated one replaces the first
            gather.encode_ahead()
            gather.encode_ahead()
        drifting.append(error())
    gather.drop()
    after_drop = error()
    return dict(fixed=fixed, drifting=drifting, after_drop=after_drop,
                wire=stats.bytes_by(phase=Phase.EXPERT_ALLGATHER), per_gather=gather.bytes_per_rank)


@pytest.mark.parametrize("use_shared", [True, False], ids=["shared+residual", "plain-topk"])
def test_incremental_copies_converge_and_restart_after_a_switch(use_shared):
    inc = run_ranks(_incremental_copies, 2, True, use_shared, timeout=120)
    stateless = run_ranks(_incremental_copies, 2, False, use_shared, timeout=120)
    for r, s in zip(inc, stateless, strict=True):
        # first gather: both ship top-k against the same base, so the copies agree
        assert r["fixed"][0] == pytest.approx(s["fixed"][0]) and r["fixed"][0] > 0.05
        # fixed weights: each gather sends 1/8 of the entries, so 8 gathers ship the whole expert
        assert all(b <= a for a, b in zip(r["fixed"], r["fixed"][1:], strict=False))
        # exact up to the two float32 roundings of base + (w - base): elementwise, the same on any CPU
        w = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
        assert r["fixed"][7] <= 2 * torch.finfo(torch.float32).eps * w.abs().max().item()
        assert s["fixed"] == [s["fixed"][0]] * len(s["fixed"])  # stateless never improves
        # drifting weights: the copy tracks them to the order of the drift, the stateless one does not
        assert max(r["drifting"]) < 0.01 < min(s["drifting"])
        # a plan switch drops the copies: the next gather rebuilds from the base like the first
        assert r["after_drop"] == pytest.approx(r["fixed"][0], rel=0.5) and r["after_drop"] > 0.05
        # the same bytes per gather either way: the payload size is the codec's
        assert r["wire"] == s["wire"] == (2 * len(r["fixed"]) + 1) * r["per_gather"]


def test_the_first_gather_ships_exact_experts_by_default():
    """Copies start exact (one uncompressed gather, and again after a plan switch), then stay
    within the drift with compressed gathers; the bytes counted are what was sent."""
    got = run_ranks(_incremental_copies, 2, True, True, False, exact_first=True, timeout=120)
    cold = run_ranks(_incremental_copies, 2, True, True, False, timeout=120)
    for r, c in zip(got, cold, strict=True):
        assert r["fixed"] == [0.0] * len(r["fixed"]) and c["fixed"][0] > 0.05
        assert max(r["drifting"]) < 0.01 and r["after_drop"] == 0.0
        dense = 64 * 4  # one fp32 expert of 64 elements, uncompressed
        assert r["wire"] == 2 * dense + (2 * len(r["fixed"]) - 1) * r["per_gather"]  # first and after the drop


def test_encoding_right_after_the_step_gives_the_same_copies():
    now = run_ranks(_incremental_copies, 2, True, True, False, timeout=120)
    ahead = run_ranks(_incremental_copies, 2, True, True, True, timeout=120)
    for a, b in zip(now, ahead, strict=True):
        assert a["drifting"] == b["drifting"] and a["wire"] == b["wire"]


def _common_drift(ctx, use_shared, numel=64, ratio=8.0, steps=12):
    """Both experts move by the same large vector each step (drift common to all experts); the
    shared expert is refreshed every step. Returns the copy error after each step."""
    import torch.distributed as dist

    from megatron_hybridep.runtime.migration import DomainGather, MigrationConfig, SharedExpert

    weights = torch.randn(ctx.world_size, numel, generator=torch.Generator().manual_seed(3))
    common = torch.randn(numel, generator=torch.Generator().manual_seed(5)) * 0.05
    own = torch.nn.Parameter(weights[ctx.rank].clone())
    shared = SharedExpert(dist.group.WORLD, ctx.world_size, refresh_every=1) if use_shared else None
    gather = DomainGather([("weight", own)], dist.group.WORLD, ctx.rank, shared=shared,
                          config=MigrationConfig(ratio, use_shared=use_shared, shared_refresh_every=1))
    errors = []
    for step in range(1, steps + 1):
        errors.append((gather.borrowed()[1 - ctx.rank]["weight"].detach() - weights[1 - ctx.rank]).abs().max().item())
        weights += common
        with torch.no_grad():
            own.copy_(weights[ctx.rank])
        gather.on_step(step)
    return errors


def test_shared_refresh_moves_every_copy_by_the_common_drift():
    with_shared = run_ranks(_common_drift, 2, True, timeout=120)
    plain = run_ranks(_common_drift, 2, False, timeout=120)
    for s, p in zip(with_shared, plain, strict=True):
        # after 8 gathers the expert-specific part is shipped; the common drift rides on the refresh
        assert max(s[8:]) < 1e-5, s
        assert min(p[8:]) > 0.01, p  # without the shared expert the drift must go through top-k


def _return_bytes(ctx, grad_values):
    """Bytes one rank's compressed gradient return puts on the wire, with the kept values in
    ``grad_values``, and the payload the wire format gives for that rank's chunk."""
    from megatron.core import parallel_state as ps

    from megatron_hybridep.megatron import teardown
    from megatron_hybridep.plan import wire
    from megatron_hybridep.runtime.migration import MigrationConfig

    _init(ctx)
    runtime, layer = _domain_layer(ctx, MigrationConfig(4.0, 16.0, shared_refresh_every=0, grad_values=grad_values))
    out, _ = layer(rank_input(SPEC, ctx.rank))
    out.backward(rank_input(SPEC, ctx.rank, 99))
    gather = layer._plan_state[0].gather
    sent = runtime.stats.bytes_by(phase=Phase.GRAD_RETURN)
    teardown()
    ps.destroy_model_parallel()
    return sent, {v: wire.payload_bytes(gather.numel, 16.0, v) for v in (2, 4)}


def test_returned_gradients_carry_bf16_values_by_default():
    """The default sends the kept values in bf16 (the fp32 gradient's rounding stays in the error
    feedback: test_compressed_gradient_return_loses_nothing_over_steps runs on it); "same" keeps fp32."""
    from megatron_hybridep.runtime.migration import MigrationConfig

    assert MigrationConfig().grad_values == "bf16"
    for (bf16, payload), (same, _) in zip(run_ranks(_return_bytes, 2, "bf16", timeout=120),
                                          run_ranks(_return_bytes, 2, "same", timeout=120), strict=True):
        assert bf16 == payload[2] and same == payload[4] and bf16 < 0.7 * same, (bf16, same, payload)
    with pytest.raises(ValueError, match="grad_values"):
        MigrationConfig(grad_values="fp8")
