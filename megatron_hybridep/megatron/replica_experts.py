"""Tokens for hot-expert replicas, computed where they were routed (HybridEPMoELayer.preprocess).

A rank holding replicas of experts R computes its own (token, e in R) pairs with the replica
weights, through Megatron's experts module (``torch.func.functional_call``, a replica taking a local
expert slot's place), and removes those pairs from the routing map before Megatron's dispatcher
sees it. The combine is a sum of per-(token, expert) outputs already scaled by their probabilities,
so adding the local part to the dispatcher's output gives the same result as plain EP.
Checked against megatron-core 0.19.2 (SequentialMLP.forward(tokens, tokens_per_expert, probs)).
"""

from __future__ import annotations

import torch
from torch.func import functional_call

from megatron_hybridep.runtime.instrument import Stats
from megatron_hybridep.runtime.replication import ReplicaExchange


def replica_experts(experts: torch.nn.Module, exchange: ReplicaExchange, hidden: torch.Tensor,
                    probs: torch.Tensor, routing_map: torch.Tensor, stats: Stats | None = None, layer: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """-> (hidden for the dispatcher, routing map without the replicas' pairs, local output [T, H]
    or None). Every rank must call it (the exchange is collective over the EP group)."""
    hidden, copies = exchange.exchange(hidden)
    if not copies:
        return hidden, routing_map, None
    cols = torch.tensor([e for e, _ in copies], dtype=torch.long, device=routing_map.device)
    x = hidden.reshape(-1, hidden.shape[-1])
    local_map = routing_map[:, cols]
    if stats is not None:  # the dispatcher counts the rest: per-expert counts still cover every token
        counts = routing_map.new_zeros(routing_map.shape[1], dtype=torch.long)
        counts[cols] = local_map.sum(dim=0)  # on the routing map's device: no sync per layer call
        stats.add_routing(layer, counts)
    masked = routing_map.clone()
    masked[:, cols] = False
    out = x.new_zeros(x.shape)
    slots = exchange.num_local
    for first in range(0, len(copies), slots):
        weights: dict[str, torch.Tensor] = {}
        xs, ps, rows_all, per_slot = [], [], [], [0] * slots
        for slot, (e, tensors) in enumerate(copies[first:first + slots]):
            rows = local_map[:, first + slot].nonzero(as_tuple=True)[0]
            weights.update(zip(exchange.slot_names(slot), tensors, strict=True))
            xs.append(x.index_select(0, rows))
            ps.append(probs[rows, e])
            rows_all.append(rows)
            per_slot[slot] = int(rows.numel())
        y, bias = functional_call(experts, weights, (torch.cat(xs), torch.tensor(per_slot), torch.cat(ps)))
        assert bias is None, "expert bias is not supported by the hybridep dispatcher"
        out = out.index_add(0, torch.cat(rows_all), y.to(out.dtype))
    return hidden, masked, out
