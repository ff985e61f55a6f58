"""The shared expert of the weight codec (the paper's section 4): the mean of a layer's exact
experts, which borrowed copies are encoded against, and the rule for when it is refreshed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

ReduceSum = Callable[[torch.Tensor], torch.Tensor]


def shared_expert_mean(
    local_experts: Sequence[torch.Tensor],
    num_experts: int,
    reduce_sum: ReduceSum | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Mean of all ``num_experts`` experts of one MoE layer (one weight tensor of each).

    local_experts: the exact weights of the experts this rank *owns* (not borrowed copies).
    reduce_sum: sums a float32 tensor over the ranks that own the layer's experts, every
    expert being owned exactly once in that group (for example ``all_reduce(SUM)`` over the
    expert-parallel group of one expert-data-parallel replica). It must return bit-identical
    results on every rank, because encoder and decoder must use the same shared tensor
    (NCCL/gloo ring and tree all-reduce do; a reduce + broadcast also does). None = one process.
    Summation is in float32, in list order; the result is cast to ``dtype`` (default: the
    experts' dtype).
    """
    if not local_experts:
        raise ValueError("each rank needs at least one local expert (it defines shape and device)")
    acc = torch.zeros(local_experts[0].shape, dtype=torch.float32, device=local_experts[0].device)
    for w in local_experts:
        acc += w.float()
    if reduce_sum is not None:
        acc = reduce_sum(acc)
    return (acc / num_experts).to(dtype or local_experts[0].dtype)


@dataclass(frozen=True)
class SharedExpertRule:
    """When the shared expert is (re)computed as :func:`shared_expert_mean` of the exact experts.

    The rule (every rank applies it with the same step counter, so all ranks agree):
      * at start (and on resume, unless restored from the checkpoint): compute it;
      * then every ``refresh_every`` optimizer steps (0 = never: frozen after init);
      * the refresh happens after that step's optimizer update and before that step's encode,
        i.e. payloads are always encoded and decoded against the same shared tensor. Payloads
        in flight must be decoded before the swap (the migration queue drains every step).
    Cost: one dense all-reduce of one expert per layer per refresh. Why not every step (the
    paper): on a slow link a dense all-reduce costs ~2x an uncompressed expert, which would undo
    a 50x compression; refreshing every N steps amortises it to 2/N of an expert per step, and
    the residual only grows as fast as the experts drift from their mean.
    """

    refresh_every: int = 0

    def __post_init__(self) -> None:
        if self.refresh_every < 0:
            raise ValueError("refresh_every must be >= 0")

    def due(self, step: int, initialised: bool = True) -> bool:
        if not initialised:
            return True
        return self.refresh_every > 0 and step > 0 and step % self.refresh_every == 0

    def sync_bytes_per_step(self, numel: int, dtype: torch.dtype) -> float:
        """Average all-reduce payload per step and MoE layer for the planner (the all-reduce of
        one dense expert every ``refresh_every`` steps; 0 when frozen)."""
        if self.refresh_every == 0:
            return 0.0
        return numel * dtype.itemsize / self.refresh_every

    def maybe_refresh(
        self,
        step: int,
        shared: torch.Tensor | None,
        local_experts: Sequence[torch.Tensor],
        num_experts: int,
        reduce_sum: ReduceSum | None = None,
    ) -> torch.Tensor:
        """The shared tensor to use for ``step``: a new mean when due, else ``shared`` unchanged."""
        if self.due(step, initialised=shared is not None):
            dtype = shared.dtype if shared is not None else None
            return shared_expert_mean(local_experts, num_experts, reduce_sum, dtype=dtype)
        return shared
