"""The hybridep token dispatcher: Megatron's all-to-all dispatcher over a plan's rail group.

Megatron's MoEAlltoAllTokenDispatcher assumes expert e lives on EP rank e // L'. Over a rail that
holds when experts are numbered domain-major (domain j owns the contiguous block
[j*S*L, (j+1)*S*L)), so the dispatcher sees the routing columns in that order and, with
L' = S*L local experts per rail rank, every token goes to the rail member in its expert's domain;
a token whose expert is in the sender's own domain stays local (the self-chunk of the all-to-all).
With S = 1 the order is the identity and this is exactly Megatron's EP.

Checked against megatron-core 0.19.2 (MoEAlltoAllTokenDispatcher: dispatch_preprocess,
token_dispatch, token_combine, input_splits/output_splits).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from megatron_hybridep.plan.phases import Phase
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.runtime.instrument import Stats


def expert_order(plan: Plan, local_experts: int) -> list[int]:
    """order[p] = Megatron expert id seen at dispatcher column p: domains in rail order, members in
    domain order, local experts in owner order."""
    return [member * local_experts + i
            for domain in sorted(plan.domains, key=min)
            for member in domain
            for i in range(local_experts)]


def _record(stats: Stats, layer: int, phase: str, splits: Any, me: int, row_bytes: int,
            levels: tuple[str, ...] | None, seconds: float) -> None:
    """Bytes this rank sends to each other rank (its own chunk never leaves the process), summed
    per link level, plus the call's time."""
    stats.add(layer, phase, "rail", 0, seconds)
    if splits is None:  # a one-rank rail: nothing is sent
        return
    rows = np.asarray(splits.cpu() if torch.is_tensor(splits) else splits)
    for pos, n in enumerate(rows.tolist()):
        if pos != me and n:
            stats.add(layer, phase, "rail", n * row_bytes, 0.0, level=levels[pos] if levels else "all")


class _Stamp(torch.autograd.Function):
    """Identity whose backward calls ``mark()``: one on a collective's input and one on its output
    bracket that collective's transpose in the backward pass (the output's runs first)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mark: Any) -> torch.Tensor:  # noqa: ANN401
        ctx.mark = mark
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN401
        ctx.mark()
        return grad, None


def _time_backward(x: torch.Tensor, call: Any, record: Any) -> Any:  # noqa: ANN401
    """``call(x)`` whose backward transpose is timed: ``record(seconds)`` once it has run. Only when
    ``x`` needs a gradient (training); the first tensor of a tuple output carries the stamp."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return call(x)
    t: dict[str, float] = {}
    x = _Stamp.apply(x, lambda: record(time.perf_counter() - t.pop("end", time.perf_counter())))
    out = call(x)
    end = _Stamp.apply(out[0] if isinstance(out, tuple) else out, lambda: t.__setitem__("end", time.perf_counter()))
    return (end, *out[1:]) if isinstance(out, tuple) else end


def instrument(dispatcher: MoEAlltoAllTokenDispatcher, stats: Stats, layer: int,
               levels: tuple[str, ...] | None = None) -> None:
    """Count routing, bytes sent to other ranks and time of an all-to-all dispatcher instance
    (hybridep or Megatron's own, so both are measured the same way). The backward pass runs the
    transposes (same bytes, reverse direction: what this rank received): timed as TOKEN_A2A_BWD, so
    a training step's blocking token traffic is all timed (the scheduler's compute excludes it)."""
    preprocess, dispatch, combine = (dispatcher.dispatch_preprocess, dispatcher.token_dispatch,
                                     dispatcher.token_combine)
    # A one-rank group has no transpose to time; the stamps' autograd nodes would be most of what the
    # plugin adds to a launch-bound GPU layer (docs/gpu.md, G5b).
    timed = _time_backward if dispatcher.ep_size * dispatcher.tp_size > 1 else (lambda x, call, _record: call(x))

    def dispatch_preprocess(hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):  # noqa: ANN202
        stats.add_routing(layer, routing_map.sum(dim=0))  # stays on the device: no sync here
        return preprocess(hidden_states, routing_map, probs)

    def backward_record(splits: Any, row: int) -> Any:  # noqa: ANN401
        splits = None if splits is None else np.asarray(splits.cpu() if torch.is_tensor(splits) else splits).copy()
        return lambda seconds: _record(stats, layer, Phase.TOKEN_A2A_BWD, splits, dispatcher.ep_rank, row, levels,
                                       seconds)

    def token_dispatch(hidden_states: torch.Tensor, probs: torch.Tensor):  # noqa: ANN202
        t0 = time.perf_counter()
        row = hidden_states.shape[-1] * hidden_states.element_size() + (0 if probs is None else probs.element_size())
        out = timed(hidden_states, lambda x: dispatch(x, probs), backward_record(dispatcher.output_splits, row))
        _record(stats, layer, Phase.TOKEN_DISPATCH, dispatcher.input_splits, dispatcher.ep_rank, row, levels,
                time.perf_counter() - t0)
        return out

    def token_combine(hidden_states: torch.Tensor):  # noqa: ANN202
        t0 = time.perf_counter()
        row = hidden_states.shape[-1] * hidden_states.element_size()
        out = timed(hidden_states, combine, backward_record(dispatcher.input_splits, row))
        _record(stats, layer, Phase.TOKEN_COMBINE, dispatcher.output_splits, dispatcher.ep_rank, row, levels,
                time.perf_counter() - t0)
        return out

    dispatcher.dispatch_preprocess = dispatch_preprocess
    dispatcher.token_dispatch = token_dispatch
    dispatcher.token_combine = token_combine


class HybridEPTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """Megatron's all-to-all dispatcher over a plan's rail group (the ranks holding the same position
    in every domain), with the expert columns renumbered domain-major. Same interface and tensors as
    MoEAlltoAllTokenDispatcher: ``dispatch_preprocess(hidden_states [tokens, hidden],
    routing_map [tokens, experts] bool, probs [tokens, experts] float)``, then ``token_dispatch``,
    ``dispatch_postprocess`` -> (tokens per local expert, concatenated [sum, hidden] in the
    activation dtype, their probs), and the combine steps back to [tokens, hidden].

    Args:
        order: ``order[j]`` = Megatron's expert index placed at column j (``expert_order``): rail
            position r then owns domain r's S x L experts as one contiguous block.
        masked: hot-expert replicas remove (token, expert) pairs from the routing map, so tokens no
            longer carry exactly top-k pairs; the permuted size is counted instead of assumed.
        *args, **kwargs: MoEAlltoAllTokenDispatcher's (num_local_experts, local_expert_indices,
            config, pg_collection with the rail group as its EP group).
    """

    def __init__(self, *args: Any, order: list[int], masked: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.order = torch.as_tensor(order, dtype=torch.long)
        self.identity = bool(torch.equal(self.order, torch.arange(len(order))))
        self.masked = masked

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        out = super().preprocess(routing_map)
        if self.masked and not self.drop_and_pad:
            self.num_out_tokens = int(routing_map.sum())
        return out

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.identity:
            order = self.order.to(routing_map.device)
            routing_map, probs = routing_map[:, order], probs[:, order]
        return super().dispatch_preprocess(hidden_states, routing_map, probs)
