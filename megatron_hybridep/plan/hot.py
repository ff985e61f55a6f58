"""Skew-aware plans: replicate only the hottest experts to the ranks that send them the most tokens.

Under skewed routing a few experts get most tokens. Instead of gathering whole domains, a rank can
hold a *replica* of one hot expert and compute its own tokens for it (plan/replicas.py): those
tokens stop crossing the link to the expert's compute rank (dispatch + combine, forward and
backward), and the rank pays for the expert's weights (exact) and the return of its gradient, once
per micro-batch. ``place_replicas`` is the placement (a pure function, loads -> pairs, like
DeepSeek's EPLB); ``hot_plan`` prices it per link, then checks prefixes with the full cost model
(``CostModel.evaluate``, which prices the replica exchange); the planner adds the result
as a candidate when routing counts are known.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatron_hybridep.plan.cost import CostBreakdown, CostModel, bytes_human, seconds_human
from megatron_hybridep.plan.grid import coord_array
from megatron_hybridep.plan.phases import REPLICA
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.topology import EPLayout

REPLICA_PHASES = REPLICA


def place_replicas(loads: np.ndarray, holds: np.ndarray, token_seconds: np.ndarray,
                   replica_seconds: np.ndarray, max_per_rank: int) -> list[tuple[int, int]]:
    """Hot-expert replicas ``(expert, rank)``, most valuable first.

    loads[r, e]: tokens rank r routes to expert e; holds[r, e]: r already has e (owner or domain);
    token_seconds[r, e]: time saved per token of r for e computed at r instead of remotely;
    replica_seconds[r, e]: time to ship e's weights to r and return its gradient. A replica is
    worth ``loads * token_seconds - replica_seconds``; take positive ones, best first, at most
    ``max_per_rank`` per rank.

    Example: 2 ranks in 2 DCs, expert 0 on rank 0 is hot, expert 2 on rank 1 is cold;
    a token costs 1 ms to move, an expert 20 ms:

    >>> loads = np.array([[900., 10, 60, 30], [700, 40, 20, 40]])
    >>> holds = np.array([[1, 1, 0, 0], [0, 0, 1, 1]], dtype=bool)
    >>> tok = np.where(holds, 0.0, 1e-3); rep = np.where(holds, 0.0, 20e-3)
    >>> place_replicas(loads, holds, tok, rep, max_per_rank=1)
    [(0, 1), (2, 0)]

    Rank 1 gets expert 0 (700 ms of token traffic vs 20 ms), rank 0 expert 2 (60 vs 20); with a
    budget of 1 per rank rank 0 cannot also take expert 3 (30 vs 20 ms).
    """
    gain = np.asarray(loads, float) * np.asarray(token_seconds, float) - np.asarray(replica_seconds, float)
    gain = np.where(np.asarray(holds, bool), -np.inf, gain)
    taken = np.zeros(gain.shape[0], dtype=np.int64)
    out = []
    for flat in np.argsort(-gain, axis=None, kind="stable"):
        r, e = divmod(int(flat), gain.shape[1])
        if not gain[r, e] > 0:
            break
        if taken[r] < max_per_rank:
            taken[r] += 1
            out.append((e, r))
    return out


# ---- prices ----------------------------------------------------------------------------------------------
def _pair_prices(model: CostModel, lay: EPLayout, src: np.ndarray, dst: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seconds per byte, latency, crossing world level or -1) between EP-local ranks src -> dst:
    the coarsest differing level's link, or its uplink if slower (per-link view, no contention)."""
    net = model.network
    cs, cd = coord_array(src, lay.extent), coord_array(dst, lay.extent)
    differs = cs != cd
    level = np.where(differs.any(axis=1), np.argmax(differs, axis=1), -1)
    bw = np.array([min(b, u if u is not None else math.inf) for b, u in zip(net.bw, net.uplink, strict=True)])
    lat = np.asarray(net.lat)
    per_byte = np.where(level >= 0, 1.0 / bw[level], 0.0)
    return per_byte, np.where(level >= 0, lat[level], 0.0), level


@dataclass(frozen=True)
class ReplicaPrices:
    """Per (rank, expert), per MoE layer and iteration: what a replica saves and costs."""

    loads: np.ndarray            # (G, E) tokens per micro-batch
    holds: np.ndarray            # (G, E) bool
    token_seconds: np.ndarray    # (G, E) per token
    replica_seconds: np.ndarray  # (G, E)
    token_level: np.ndarray      # (G, E) world level tokens cross under the base plan (-1: local)


def replica_prices(model: CostModel, base: Plan) -> ReplicaPrices | None:
    """Prices for ``place_replicas`` from the workload's routing counts (None when balanced)."""
    w, G, E = model.workload, base.ep_size, base.num_experts
    routing = w.routing_for(G)
    if routing is None:
        return None
    lay = model.layout(G)
    loads = routing.mean(axis=0)
    ranks, experts = np.repeat(np.arange(G), E), np.tile(np.arange(E), G)
    compute = base.base.compute_ranks().ravel()
    owners = experts // base.experts_per_rank
    holds = (compute == ranks).reshape(G, E)
    tok_pb, _, tok_level = _pair_prices(model, lay, ranks, compute)
    rep_pb, rep_lat, _ = _pair_prices(model, lay, owners, ranks)
    m = w.micro_batches
    m_rep = 1 if model.borrowed_copies(base)[0] == "iteration" else m  # replicas follow the gather's rhythm
    token_seconds = 4 * m * w.token_bytes * tok_pb            # dispatch + combine, forward + backward
    ship = w.expert_bytes + w.expert_params * w.grad_bytes    # exact weights out, exact gradient back
    replica_seconds = m_rep * (ship * rep_pb + 2 * rep_lat)  # per-link view: hiding is left to CostModel.evaluate
    return ReplicaPrices(loads, holds, token_seconds.reshape(G, E), replica_seconds.reshape(G, E),
                         tok_level.reshape(G, E))


def hot_plan(model: CostModel, base: Plan, max_per_rank: int | None = None) -> tuple[Plan, CostBreakdown] | None:
    """The base plan plus the replicas ``place_replicas`` picks, if the full cost model agrees that
    they pay (it also sees contention and expert load): the best of the placement's prefixes of
    1, 2, 4, ... and all pairs. None when routing is balanced or nothing pays.
    ``max_per_rank`` defaults to the experts a rank owns (memory of one extra domain member)."""
    if base.kind != "domains" or base.replicas:
        return None
    prices = replica_prices(model, base)
    if prices is None:
        return None
    budget = base.experts_per_rank if max_per_rank is None else max_per_rank
    pairs = place_replicas(prices.loads, prices.holds, prices.token_seconds, prices.replica_seconds, budget)
    if not pairs:
        return None
    best, best_cost = None, model.evaluate(base)
    sizes = sorted({len(pairs), *(2 ** i for i in range(int(math.log2(len(pairs))) + 1))})
    for n in sizes:
        plan = base.with_replicas(pairs[:n], budget)
        cost = model.evaluate(plan)
        if cost.total < best_cost.total:
            best, best_cost = plan, cost
    return None if best is None else (best, best_cost)


def explain(model: CostModel, plan: Plan) -> list[str]:
    """One line per replica: its tokens, the link they no longer cross, saved vs paid time."""
    prices = replica_prices(model, plan.base)
    if prices is None or not plan.replicas:
        return []
    Lm, names = model.workload.num_moe_layers, model.topology.level_names
    lines = []
    for e, r in plan.replicas.pairs:
        lvl = int(prices.token_level[r, e])
        saved = Lm * prices.loads[r, e] * prices.token_seconds[r, e]
        paid = Lm * prices.replica_seconds[r, e]
        lines.append(f"expert {e} -> rank {r} (owner rank {plan.owner_of_expert(e)}): "
                     f"{prices.loads[r, e]:.0f} tokens/micro-batch stop crossing "
                     f"{names[lvl] if lvl >= 0 else 'nothing'} "
                     f"({bytes_human(4 * prices.loads[r, e] * model.workload.token_bytes)} per layer pass); saves "
                     f"{seconds_human(saved)}, pays {seconds_human(paid)} for weights + gradient per iteration")
    return lines
