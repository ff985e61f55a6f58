"""Neighbourhood plans: the paper's Definition 1 with any p = k / (N - 1), simulated flow by flow.

Equal domains (plan/plan.py) give p = 1 - 1/m only. A *neighbourhood* plan of size S at the DC level
lets every DC d hold the experts of DCs d, d+1, ..., d+S-1 (mod N), GPU index by GPU index (as a
domain plan with S_gpu = 1 does): a token from (d_s, g_s) for the expert of (d_o, g_o) is computed
at (d_s, g_o) when d_o is in d_s's neighbourhood, else it goes to its owner. Every DC then reaches
N - S peers by all-to-all (p = (N - S) / (N - 1)) and gathers S - 1 experts per GPU, for any S.

The runtime does not run these plans (the dispatcher needs domains that partition the ranks: see
runtime/groups.py); this module only simulates them, with explicit flows (O((8N)^2) pairs: small N),
to check the closed form of sim/paper_regime.py where equal domains cannot reach the paper's p.
"""

from __future__ import annotations

import numpy as np

from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.topology import Topology
from megatron_hybridep.plan.workload import Workload
from megatron_hybridep.sim.engine import Engine
from megatron_hybridep.sim.flows import PAIRS, Collective, Space
from megatron_hybridep.sim.schedule import LayerWork, SimOptions, build_program


def compute_ranks(N: int, R: int, S: int) -> np.ndarray:
    """(G, G) rank that computes src's tokens for the expert owned by rank o (one expert per rank)."""
    if not 1 <= S <= N:
        raise PlanError(f"neighbourhood size: S={S} must lie in 1..{N} DCs; fix: pick S = N - k for k peers")
    r = np.arange(N * R)
    ds, do, go = (r // R)[:, None], (r // R)[None, :], (r % R)[None, :]
    near = (do - ds) % N < S
    return np.where(near, ds * R + go, do * R + go)


def collectives(N: int, R: int, S: int, w: Workload) -> list[Collective]:
    G = N * R
    per_expert = w.dispatch_bytes / G
    dst = compute_ranks(N, R, S)
    src = np.repeat(np.arange(G), G)
    pair = np.bincount(src * G + dst.ravel(), weights=np.full(G * G, per_expert), minlength=G * G)
    s, d = np.divmod(np.arange(G * G), G)
    out = [Collective("dispatch", PAIRS, src=s, dst=d, pair_bytes=pair),
           Collective("combine", PAIRS, src=d, dst=s, pair_bytes=pair)]
    # owner (d_o, g) ships its expert to (d_o - i, g), i = 1..S-1: the DCs whose neighbourhood holds it
    gathered = np.zeros((G, G))
    for i in range(1, S):
        holders = ((np.arange(G) // R - i) % N) * R + np.arange(G) % R
        gathered[np.arange(G), holders] = w.expert_wire_bytes
    out.append(Collective("gather", PAIRS, src=s, dst=d, pair_bytes=gathered.ravel()))
    return out


def simulate_neighbourhood(topo: Topology, w: Workload, S: int,
                           options: SimOptions | None = None) -> float:
    """Iteration seconds of the neighbourhood plan of S DCs (one expert per GPU, balanced routing)."""
    options = options or SimOptions(schedule="paper", backward=False)
    if options.backward:
        raise PlanError("neighbourhood plans: forward only (the paper's model); fix: SimOptions(backward=False)")
    N, R = topo.levels[0].count, topo.world_size // topo.levels[0].count
    if w.num_experts != N * R:
        raise PlanError(f"model.num_experts: {w.num_experts}; neighbourhood plans here hold one expert per GPU "
                        f"({N * R}); fix: set num_experts to the world size")
    colls = collectives(N, R, S, w)
    space = Space(topo.levels, topo.level_counts, topo.level_counts)
    sets = [space.flows(c) for c in colls if not c.empty]
    space.finalize()
    present = {c.name for c in colls if not c.empty}
    layer = LayerWork(w.t_pre, w.tokens * w.top_k * w.expert_seconds_per_token, "dispatch", "combine")
    program = build_program([layer] * w.num_moe_layers, w.micro_batches, gather="gather", grad_return=None,
                            shared_sync=None, options=options, present=present)
    return Engine(sets, space.link_cap).run(program).total
