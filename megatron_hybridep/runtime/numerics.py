"""Finite-value checks for what HybridEP adds to a step: decoded (compressed) copies of borrowed
experts and the gradients computed for them. Enabled by Megatron's own switch,
--check-for-nan-in-loss-and-grad; Megatron's check sees only the owner's summed gradient norm,
this one names the layer, the expert and its owner rank where the first non-finite value appears."""

from __future__ import annotations

import torch


class NonFiniteError(FloatingPointError):
    """A NaN or Inf in a borrowed expert's copy or gradient; the message says where."""


def check_finite(tensor: torch.Tensor, what: str, layer: int, expert: int, owner: int) -> None:
    """Raise NonFiniteError unless every element of ``tensor`` is finite."""
    if bool(torch.isfinite(tensor).all()):
        return
    nan = int(torch.isnan(tensor).sum())
    inf = int(torch.isinf(tensor).sum())
    raise NonFiniteError(f"{what}: {nan} NaN and {inf} Inf of {tensor.numel()} values in MoE layer {layer}, "
                         f"local expert {expert} of owner rank {owner} (--check-for-nan-in-loss-and-grad); "
                         "fix: lower --lr or raise --hybridep-compression-ratio's precision (smaller ratio)")


def check_rows(rows: torch.Tensor, what: str, layer: int, owners: list[int], skip: int | None = None) -> None:
    """``rows`` is [domain position, local expert, ...]: one fast all-finite test, and only on failure
    a search for the first bad (owner, expert). ``skip``: this rank's own (unused) slot. The fast test
    is the sum (one pass, no mask: a NaN or Inf makes it non-finite; an overflow of finite values
    only sends it to the exact search, which then finds nothing)."""
    if bool(torch.isfinite(rows.sum())):
        return
    for q, owner in enumerate(owners):
        if q == skip:
            continue
        for e in range(rows.shape[1]):
            check_finite(rows[q, e], what, layer, e, owner)
