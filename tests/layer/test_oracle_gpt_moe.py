"""A 4-rank GPT-MoE (2 layers, alltoall EP=4) on CPU: 3 optimizer steps through Megatron's DDP and
optimizer, loss decreasing, dense parameters bitwise identical on every rank, experts distinct.
Float64, as the exactness tests that build on this oracle run it."""

import pytest
import torch

from megatron_hybridep.train.launch import run_ranks


def _train(ctx, steps):
    import torch.distributed as dist

    from megatron_hybridep.data.synthetic import MarkovCorpus
    from megatron_hybridep.megatron import cpu_runtime
    from megatron_hybridep.train.gpt import GPTMoEArgs, build, initialize_parallel, train_step

    cpu_runtime.enable()
    args = GPTMoEArgs(expert_model_parallel_size=ctx.world_size, params_dtype=torch.float64)
    initialize_parallel(args)
    state = build(args)
    tokens, labels = MarkovCorpus().batch(args.micro_batch_size, args.seq_length, ctx.rank, 0)
    losses = [train_step(state, tokens, labels)["loss"] for _ in range(steps)]
    dense, expert = [], []
    for p in state.model.module.parameters():
        (dense if getattr(p, "allreduce", True) else expert).append(p.detach().reshape(-1))
    dense_all = [torch.empty_like(torch.cat(dense)) for _ in range(ctx.world_size)]
    dist.all_gather(dense_all, torch.cat(dense))
    expert_all = [torch.empty_like(torch.cat(expert)) for _ in range(ctx.world_size)]
    dist.all_gather(expert_all, torch.cat(expert))
    return losses, dense_all, expert_all


@pytest.mark.exactness
def test_gpt_moe_ep4_trains_with_consistent_replicas():
    results = run_ranks(_train, 4, 3, timeout=240)
    for rank, (losses, dense_all, expert_all) in enumerate(results):
        assert losses[0] > losses[1] > losses[2], f"rank {rank}: loss not decreasing {losses}"
        assert dense_all[0].dtype == torch.float64
        for other in range(1, 4):
            assert torch.equal(dense_all[0], dense_all[other]), f"dense params differ on rank {other}"
            assert not torch.equal(expert_all[0], expert_all[other]), "expert params should differ"
