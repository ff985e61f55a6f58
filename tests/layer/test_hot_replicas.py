"""Hot-expert replicas are exact: a plan with replicas equals Megatron's alltoall EP (the oracle) on
skewed routing, MoE layer level: outputs, input/router/every expert gradient at each of 4 Adam steps,
parameters after them (float64, to FP64_TOL relative above magnitude 1), and per-expert routing
counts (every token counted). Bad replica specs fail before any collective."""

import numpy as np
import pytest
import torch

from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.testing.exactness import FP64_TOL, scaled_error
from megatron_hybridep.testing.moe import MoESpec
from megatron_hybridep.train.launch import run_ranks
from tests.layer.helpers import compare_with_oracle, setup_and_capture

TOL = FP64_TOL
STEPS = 4
# aux-loss-free routing (sigmoid scores + a fixed expert bias, Megatron's own mechanism) makes
# experts 0 and 1 hot: the bias moves top-k selection, not the probabilities
SKEW = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 0.0}
BIAS = [0.6, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def _build(spec, rank, world):
    from megatron_hybridep.testing.moe import build_moe_layer

    layer = build_moe_layer(spec, rank, world)
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.tensor(BIAS))
    return layer


def _summary(plan, spec, runtime, oracle_stats, errors):
    return dict(plan=plan.label, top_k=spec.top_k, errors=errors,
                counts=np.asarray(sum(runtime.stats.tokens_per_expert.values())),
                ref_counts=np.asarray(sum(oracle_stats.tokens_per_expert.values())),
                token_bytes=runtime.stats.bytes_by(group="rail"),
                oracle_bytes=oracle_stats.bytes_by(group="rail"),
                replica_bytes=runtime.stats.bytes_by(phase="replica_weights"),
                grad_bytes=runtime.stats.bytes_by(phase="replica_grad_return"))


def _compare(ctx, plans, specs, steps):
    return compare_with_oracle(ctx, plans, specs, steps, _build, _summary)


def _plans(world):
    if world == 2:
        return [Plan.grid((2,), (1,), 8).with_replicas([(0, 1), (1, 1), (4, 0)], max_per_rank=2)]
    dcs = ("dc", "gpu")
    return [
        # plain EP + replicas; rank 2 holds 3 replicas (more than its 2 expert slots: two batches)
        Plan.grid((2, 2), (1, 1), 8, dcs).with_replicas([(0, 1), (0, 2), (0, 3), (1, 2), (2, 2), (1, 3)]),
        # EP inside each DC with domains across DCs, plus the hot expert in the other DC's rail
        Plan.grid((2, 2), (2, 1), 8, dcs).with_replicas([(0, 1), (0, 3), (1, 3)], max_per_rank=2),
        # domains inside each DC, hot experts replicated into the other DC
        Plan.grid((2, 2), (1, 2), 8, dcs).with_replicas([(0, 2), (0, 3), (1, 2), (4, 0)], max_per_rank=2),
    ]


@pytest.mark.exactness
@pytest.mark.parametrize("world", [2, 4])
def test_hot_replicas_match_alltoall(world):
    specs = [MoESpec(top_k=k, extra=SKEW, aux_loss_coeff=1e-2 if k == 2 else 0.0, dtype=torch.float64)
             for k in (1, 2)]
    results = run_ranks(_compare, world, _plans(world), specs, STEPS, timeout=500)
    for rank, report in enumerate(results):
        for r in report:
            bad = {k: v for k, v in r["errors"].items() if not v <= TOL}
            assert not bad, f"rank {rank} plan {r['plan']} top_k={r['top_k']}: {dict(list(bad.items())[:6])}"
            assert np.array_equal(r["counts"], r["ref_counts"]), (r["counts"], r["ref_counts"])
            assert r["token_bytes"] < r["oracle_bytes"]
    for r in results[0]:  # rank 0 owns expert 0, the hot one: it ships its weights, gets gradients back
        assert r["replica_bytes"] > 0 and r["counts"][0] > r["counts"][2:].max()
    total = sum(r["grad_bytes"] for report in results for r in report[:1])
    assert total == sum(r["replica_bytes"] for report in results for r in report[:1]) > 0


def _setup_and_capture(ctx, plan_dict):
    return setup_and_capture(ctx, lambda: Plan.from_dict(plan_dict, source="plan.json"), 8,
                             ("new_group", "all_gather_object", "all_to_all_single", "broadcast", "barrier"))


@pytest.mark.parametrize("pairs,budget,words", [
    ([[8, 1]], None, ["plan.replicas", "expert 8 out of range", "fix"]),
    ([[0, 0]], None, ["pair [0, 0]", "its owner", "fix"]),
    ([[0, 1], [2, 1], [3, 1]], 2, ["rank 1 holds 3 replicas", "max_per_rank=2", "fix"]),
    ([[0, "1"]], None, ["pairs[0]", "integers", "fix"]),
])
def test_bad_replicas_fail_before_any_collective(pairs, budget, words):
    d = Plan.grid((2,), (1,), 8).to_dict()
    d["replicas"] = {"pairs": pairs, "max_per_rank": budget}
    for message, calls in run_ranks(_setup_and_capture, 2, d, timeout=60):
        assert message is not None, "setup accepted bad replicas"
        assert all(w in message for w in words), message
        assert calls == [], f"collectives ran before the error: {calls}"


def _gpt_both(ctx, plan_dict, steps):
    from megatron_hybridep.data.synthetic import MarkovCorpus
    from megatron_hybridep.megatron import cpu_runtime, setup, teardown
    from megatron_hybridep.train.gpt import GPTMoEArgs, build, initialize_parallel, train_step

    cpu_runtime.enable()
    corpus = MarkovCorpus()
    out = {}
    for dispatcher in ("alltoall", "hybridep"):
        args = GPTMoEArgs(expert_model_parallel_size=ctx.world_size, dispatcher=dispatcher, top_k=2,
                          extra_config=SKEW, params_dtype=torch.float64)
        initialize_parallel(args)
        if dispatcher == "hybridep":
            runtime = setup([Plan.from_dict(plan_dict)])
        state = build(args)
        if dispatcher == "alltoall":
            with torch.no_grad():
                for layer in state.model.module.decoder.layers:
                    layer.mlp.router.expert_bias.copy_(torch.tensor(BIAS))
            init = {k: v.clone() for k, v in state.model.module.state_dict().items() if torch.is_tensor(v)}
        else:
            state.model.module.load_state_dict(init, strict=False)
            state.model.broadcast_params()
        losses = []
        for step in range(steps):
            tokens, labels = corpus.batch(args.micro_batch_size, args.seq_length, ctx.rank, step)
            losses.append(train_step(state, tokens, labels)["loss"])
        out[dispatcher] = (losses, {k: v.detach().clone() for k, v in state.model.module.named_parameters()})
        if dispatcher == "hybridep":
            out["replica_bytes"] = runtime.stats.bytes_by(phase="replica_weights")
            teardown()
    return out


@pytest.mark.exactness
def test_gpt_moe_with_hot_replicas_equals_alltoall():
    """Full GPTModel, Megatron DDP and optimizer: replicas' gradients land in the owners' DDP buffers."""
    plan = Plan.grid((2, 2), (1, 1), 8, ("dc", "gpu")).with_replicas([(0, 1), (0, 2), (0, 3), (1, 2), (1, 3)])
    results = run_ranks(_gpt_both, 4, plan.to_dict(), 4, timeout=400)
    assert results[0]["replica_bytes"] > 0
    for rank, out in enumerate(results):
        (ref_losses, ref_params), (losses, params) = out["alltoall"], out["hybridep"]
        assert scaled_error(torch.tensor(losses), torch.tensor(ref_losses)) <= TOL, (losses, ref_losses)
        for name, p in params.items():
            err = scaled_error(p, ref_params[name])
            assert p.dtype == torch.float64 and err <= TOL, f"rank {rank}: {name} differs by {err}"
