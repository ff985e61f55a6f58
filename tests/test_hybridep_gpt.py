"""A full GPTModel with Megatron DDP and optimizer: hybridep equals alltoall EP step for step
(losses and every parameter after 5 steps), and the checkpoint keys are the same."""

import pytest
import torch

from megatron_hybridep.runtime.launch import run_ranks

STEPS = 5


def _train_both(ctx, plan_args):
    from megatron_hybridep.data.synthetic import MarkovCorpus
    from megatron_hybridep.megatron import cpu_runtime, setup, teardown
    from megatron_hybridep.megatron.gpt import GPTMoEArgs, build, initialize_parallel, train_step
    from megatron_hybridep.plan.plan import Plan

    cpu_runtime.enable()
    corpus = MarkovCorpus()
    out = {}
    for dispatcher in ("alltoall", "hybridep"):
        args = GPTMoEArgs(expert_model_parallel_size=ctx.world_size, dispatcher=dispatcher, topk=2)
        initialize_parallel(args)
        if dispatcher == "hybridep":
            runtime = setup([Plan.grid(*plan_args)])
        state = build(args)
        if dispatcher == "alltoall":
            init = {k: v.clone() for k, v in state.model.module.state_dict().items() if torch.is_tensor(v)}
            keys = sorted(state.model.module.sharded_state_dict().keys())
        else:
            assert sorted(state.model.module.sharded_state_dict().keys()) == keys
            missing, unexpected = state.model.module.load_state_dict(init, strict=False)
            assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected
            state.model.broadcast_params()
        losses = []
        for step in range(STEPS):
            tokens, labels = corpus.batch(args.micro_batch_size, args.seq_length, ctx.rank, step)
            losses.append(train_step(state, tokens, labels)["loss"])
        out[dispatcher] = (losses, {k: v.detach().clone() for k, v in state.model.module.named_parameters()})
        if dispatcher == "hybridep":
            out["gather_bytes"] = runtime.stats.bytes_by(phase="expert_gather")
            teardown()
    return out


@pytest.mark.parametrize("plan_args", [((4,), (2,), 8), ((2, 2), (2, 1), 8, ("dc", "gpu"))],
                         ids=["S2", "2dcx2-domains-across-dcs"])
def test_gpt_moe_hybridep_equals_alltoall(plan_args):
    for rank, out in enumerate(run_ranks(_train_both, 4, plan_args, timeout=400)):
        ref_losses, ref_params = out["alltoall"]
        losses, params = out["hybridep"]
        assert out["gather_bytes"] > 0
        assert losses[-1] < losses[0]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) <= 1e-5, (losses, ref_losses)
        for name, p in params.items():
            err = (p - ref_params[name]).abs().max().item()
            assert err <= 1e-5, f"rank {rank}: {name} differs by {err}"
