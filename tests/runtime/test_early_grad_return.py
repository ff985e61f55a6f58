"""--hybridep-early-grad-return: the first M-1 micro-batches' borrowed gradients leave in the (M-1)th
backward and the last backward returns only the rest, at a higher ratio. The owners receive the
two payloads' sum, error feedback keeps everything either left (nothing lost), and the wire carries
one payload at each ratio."""

import pytest
import torch

from megatron_hybridep.plan.phases import Phase
from megatron_hybridep.runtime.borrowed import OwedGradient
from megatron_hybridep.train.launch import run_ranks


class _Wire:
    """Fake launchers: record what each launch was given, in order; a launch 'returns' 10x its input."""

    def __init__(self):
        self.calls = []

    def launcher(self, name):
        def launch(grad):
            self.calls.append((name, grad.clone()))
            return lambda: grad.clone() * 10
        return launch


def _owed(wire, micro_batches, asynchronous=False):
    deferring = {"on": True}
    owed = OwedGradient(lambda: deferring["on"], lambda g: wire.launcher("send")(g)(), wire.launcher("whole"),
                        lambda: asynchronous, early=(wire.launcher("early"), wire.launcher("rest")),
                        split_at=lambda: micro_batches - 1 if micro_batches > 1 else None)
    return owed, deferring


@pytest.mark.parametrize("asynchronous", [False, True], ids=["blocking", "async"])
def test_the_first_m_minus_1_leave_early_and_the_last_returns_the_rest(asynchronous):
    wire = _Wire()
    owed, deferring = _owed(wire, 4, asynchronous)
    grads = [torch.full((3,), float(i + 1)) for i in range(4)]
    for g in grads[:2]:
        assert owed(g) is None
    assert wire.calls == [] and owed.owes
    assert owed(grads[2]) is None  # the (M-1)th deferred backward launches the sum so far
    assert [n for n, _ in wire.calls] == ["early"] and torch.equal(wire.calls[0][1], torch.full((3,), 6.0))
    assert owed.acc is None and owed.owes
    deferring["on"] = False
    got = owed(grads[3])
    if asynchronous:
        assert got is None and owed.owes
        got = owed.flush()
    assert [n for n, _ in wire.calls] == ["early", "rest"] and torch.equal(wire.calls[1][1], grads[3])
    assert torch.equal(got, torch.full((3,), 100.0))  # both returns, joined
    assert not owed.owes and owed.deferred == 0
    deferring["on"] = True  # the next iteration splits again
    for g in grads[:3]:
        owed(g)
    assert [n for n, _ in wire.calls].count("early") == 2


def test_one_micro_batch_and_a_schedule_that_defers_the_last_backward():
    wire = _Wire()
    owed, deferring = _owed(wire, 1)
    deferring["on"] = False
    assert torch.equal(owed(torch.ones(2)), torch.full((2,), 10.0))
    assert [n for n, _ in wire.calls] == ["send"]  # M = 1: one return, as without the flag
    # interleaved chunks can leave the last backward under no_sync: flush launches the rest
    wire = _Wire()
    owed, deferring = _owed(wire, 3)
    for _ in range(3):
        owed(torch.ones(2))
    assert [n for n, _ in wire.calls] == ["early"]
    assert torch.equal(owed.flush(), torch.full((2,), 30.0))
    assert [n for n, _ in wire.calls] == ["early", "rest"] and not owed.owes
    owed(torch.ones(2))
    owed(torch.ones(2))  # the early part in flight; a plan switch forgets it like any owed gradient
    owed.forget()
    assert not owed.owes and owed.deferred == 0
    # a backward that skipped the copies would leave this rank's payloads unlike its peers': named, not hung
    owed(torch.ones(2))
    deferring["on"] = False
    with pytest.raises(RuntimeError, match="1 deferred backward passes before the last, expected 2"):
        owed(torch.ones(2))


def _split_return(ctx, rest_ratio, micro, warmup=0, step=0):
    """One expert per rank in a domain of 2: ``micro`` backward passes through the borrowed copy of the
    peer's expert (the first micro-1 deferred) -> (what this rank received, what it owed the peer in
    total, the error-feedback residual it keeps for the peer, bytes returned, early launched)."""
    import torch.distributed as dist

    from megatron_hybridep.runtime.instrument import Stats
    from megatron_hybridep.runtime.migration import DomainGather, MigrationConfig

    numel, peer = 512, 1 - ctx.rank
    own = torch.nn.Parameter(torch.randn(numel, generator=torch.Generator().manual_seed(ctx.rank)))
    stats, deferring = Stats(), {"on": True}
    gather = DomainGather([("weight", own)], dist.group.WORLD, ctx.rank, stats=stats,
                          config=MigrationConfig(grad_compression_ratio=4.0, early_return_rest_ratio=rest_ratio,
                                                 grad_warmup_steps=warmup),
                          defer=lambda: deferring["on"], micro_batches=lambda: micro)
    gather.on_step(step)
    owed_total, early = torch.zeros(numel), []
    for j in range(micro):
        deferring["on"] = j < micro - 1
        dy = torch.randn(numel, generator=torch.Generator().manual_seed(100 * ctx.rank + j))
        (gather.borrowed()[peer]["weight"] * dy).sum().backward()
        owed_total += dy
        early.append(gather.owed.pending_early is not None)
    residual = gather.grad_codec.residual((0, peer))
    return dict(received=own.grad.clone(), owed=owed_total, residual=None if residual is None else residual.clone(),
                bytes=stats.bytes_by(phase=Phase.GRAD_RETURN), early=early,
                sizes={r: gather.grad_codec.__class__(r, value_dtype=torch.bfloat16).nbytes(numel, torch.float32)
                       for r in (4.0, rest_ratio or 4.0)})


def test_domain_gather_splits_the_return_and_loses_nothing():
    split = run_ranks(_split_return, 2, 16.0, 4, timeout=120)
    whole = run_ranks(_split_return, 2, 0.0, 4, timeout=120)
    for s, w in zip(split, whole, strict=True):
        # launched in the 3rd backward, joined in the 4th
        assert s["early"] == [False, False, True, False] and not any(w["early"])
        assert s["bytes"] == s["sizes"][4.0] + s["sizes"][16.0] > w["bytes"] == w["sizes"][4.0]
    for mine, peer in ((0, 1), (1, 0)):
        # what the owner received is what the peer owed less what its error feedback still holds
        sent = split[peer]["owed"] - split[peer]["residual"]
        assert torch.allclose(split[mine]["received"], sent, rtol=0, atol=1e-5)
        assert (split[peer]["residual"] != 0).any()  # compressed: something was held back
        assert not torch.allclose(split[mine]["received"], whole[mine]["received"])


def _train(ctx, rest_ratio):
    from megatron_hybridep.data.synthetic import MarkovCorpus
    from megatron_hybridep.megatron import cpu_runtime, setup, teardown
    from megatron_hybridep.plan.plan import Plan
    from megatron_hybridep.runtime.migration import MigrationConfig
    from megatron_hybridep.train.gpt import GPTMoEArgs, build, initialize_parallel, train_step

    cpu_runtime.enable()
    corpus = MarkovCorpus()
    args = GPTMoEArgs(expert_model_parallel_size=ctx.world_size, dispatcher="hybridep", top_k=2,
                      micro_batch_size=2, seq_length=16)
    initialize_parallel(args)
    runtime = setup([Plan.grid((2,), (2,), args.num_experts, ("gpu",))],
                    migration=MigrationConfig(4.0, 4.0, early_return_rest_ratio=rest_ratio))
    state = build(args)
    losses, returned = [], []
    for step in range(2):
        batches = [corpus.batch(2, 16, ctx.rank, 4 * step + j) for j in range(4)]
        runtime.stats.reset()  # per iteration, as the loop's log does
        losses.append(train_step(state, batches)["loss"])
        returned.append(runtime.stats.bytes_by(phase=Phase.GRAD_RETURN))
    teardown()
    return losses, returned, runtime.micro_batches


def test_train_step_returns_early_through_megatrons_schedule():
    """Through run_iteration (Megatron's no_sync schedule, M = 4): the loop tells the runtime M, and
    every layer's return goes as two payloads, the second smaller; the model trains."""
    for (losses, split, m), (ref_losses, whole, _) in zip(run_ranks(_train, 2, 16.0, timeout=300),
                                                         run_ranks(_train, 2, 0.0, timeout=300), strict=True):
        assert m == 4
        assert all(b > a > 0 for a, b in zip(whole, split, strict=True)) and max(split) < 2 * min(whole)
        assert losses[0] == ref_losses[0]  # the first step's forward precedes any return
        assert all(torch.isfinite(torch.tensor(losses)))


def test_no_split_during_the_gradient_warmup():
    for r in run_ranks(_split_return, 2, 16.0, 4, 10, 3, timeout=120):
        assert not any(r["early"])  # the warm-up's exact-to-ratio ramp returns whole
