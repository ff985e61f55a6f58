"""NaN/Inf in a borrowed expert's gradient or decoded copy is named by layer, expert and owner."""

import math

import pytest
import torch

from megatron_hybridep.runtime.numerics import NonFiniteError, check_finite, check_rows
from megatron_hybridep.train.launch import run_ranks


def test_finite_tensors_pass():
    check_finite(torch.randn(10), "decoded copy", 0, 1, 2)
    check_rows(torch.randn(2, 3, 4), "gradient", 1, owners=[5, 6])
    check_rows(torch.full((2, 3, 4), 3e38), "gradient", 1, owners=[5, 6])  # finite, though their sum overflows
    check_rows(torch.full((2, 3, 4), 3e38, dtype=torch.bfloat16), "gradient", 1, owners=[5, 6])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_is_named(bad):
    t = torch.zeros(8)
    t[3] = bad
    with pytest.raises(NonFiniteError, match=r"decoded copy: .* MoE layer 4, local expert 1 of owner rank 7 "
                                             r"\(--check-for-nan-in-loss-and-grad\); fix"):
        check_finite(t, "decoded copy", 4, 1, 7)


def test_rows_find_the_first_bad_owner_and_expert_and_skip_own_slot():
    rows = torch.zeros(3, 2, 5)
    rows[0, 0, 0] = math.nan  # this rank's own slot: never used, not checked
    check_rows(rows, "copy", 0, owners=[10, 11, 12], skip=0)
    rows[2, 1, 4] = math.inf
    with pytest.raises(NonFiniteError, match="local expert 1 of owner rank 12"):
        check_rows(rows, "copy", 3, owners=[10, 11, 12], skip=0)


def _gather_with_nan(ctx, where):
    import torch.distributed as dist

    from megatron_hybridep.runtime.migration import DomainGather, MigrationConfig

    gen = torch.Generator().manual_seed(ctx.rank)
    own = [torch.nn.Parameter(torch.randn(16, generator=gen)) for _ in range(2)]  # two local experts
    compressed = where == "copy"  # plain top-k: a NaN in one expert stays in that expert's payload
    gather = DomainGather([("weight0", own[0]), ("weight1", own[1])], dist.group.WORLD, ctx.rank, layer=1, num_local=2,
                          config=MigrationConfig(4.0 if compressed else 1.0, use_shared=False, hold_copies=False,
                                                 check_finite=True))
    if where == "copy" and ctx.rank == 1:
        with torch.no_grad():
            own[1][5] = math.nan  # rank 1's expert 1 ships a NaN; rank 0 decodes it
    copies = gather.borrowed()
    peer = copies[1 - ctx.rank]
    loss = peer["weight0"].sum() + peer["weight1"].sum() + own[0].sum() + own[1].sum()
    if where == "grad" and ctx.rank == 0:
        loss = loss + (peer["weight0"] * math.inf).sum() * 0  # inf * 0: NaN in the gradient of rank 1's expert 0
    loss.backward()
    gather.flush_owed()
    return "no error"


@pytest.mark.parametrize("where, rank, words", [
    ("copy", 0, "decoded copy of a borrowed expert: .* MoE layer 1, local expert 1 of owner rank 1"),
    ("grad", 0, "gradient of a borrowed expert: .* MoE layer 1, local expert 0 of owner rank 1"),
])
def test_migration_names_the_non_finite_borrowed_expert(where, rank, words):
    from megatron_hybridep.train.launch import RankFailure

    with pytest.raises(RankFailure) as info:
        run_ranks(_gather_with_nan, 2, where, timeout=120)
    import re

    assert re.search(words, info.value.reports[rank]), info.value.reports[rank]
