"""Tier (b): our cost model of one training iteration under a plan.

Beyond the paper's stream model (paper_model.py) it counts, per MoE layer and micro-batch:
- four token all-to-alls (dispatch + combine forward, their transposes backward) on the rails, with
  alpha-beta links at every level and uplink contention (network.py);
- expert compute on the rank that actually computes each token, so skewed routing shows (a hot
  expert's load is split over its domain's copies under HybridEP, not under plain EP);
- the expert all-gather in the domain (compressed bytes incl. indices), hidden where it fits
  behind what runs between its start and its use: layer 0's (started after the optimizer step)
  behind T_pre + the dispatch, layer l+1's (started after layer l's experts) behind layer l's
  combine + T_pre + the dispatch, and in micro-batches after the first layer 0's (started at its
  MoE block) behind the dispatch alone. All-to-alls count as cover only when they use no link
  level the gather uses (else they share bandwidth: the simulator resolves that, not this);
- the gradient return of borrowed experts to their owners, blocking, in every micro-batch's
  backward (runtime/migration.py: a reduce-scatter ring, or an all-to-all of top-k payloads when
  gradients are compressed);
- domains with S > 1 and a refreshed shared expert: one all-reduce per layer over the EP group
  (amortised per step), blocking, before that layer's first gather of the step;
- once per iteration after the backward: one all-reduce of all expert gradients over the expert
  data-parallel replicas (Megatron's finalize_model_grads; DDP is built with
  overlap_grad_reduce=False, so it is exposed);
- for the replicated plan (EP inside each DC, experts in every DC): no gathers, that all-reduce
  over all DCs, and the memory of full expert replicas with their optimizer state.
This is the closed form of the simulator's ``runtime`` schedule (sim/schedule.py).

Costs that every candidate pays alike (dense-parameter gradient all-reduce, the optimizer step) are
left out: they do not change the choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.network import (
    Network,
    PhaseCost,
    dc_replica_family,
    domain_family,
    rail_family,
    replica_family,
    world_domain_sizes,
)
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.topology import EPLayout, Topology
from megatron_hybridep.plan.workload import Workload

# exposed-time phases, in the order they are reported; they sum to the total
PHASES = ("pre_compute", "expert_compute", "token_a2a_fwd", "token_a2a_bwd", "expert_allgather",
          "grad_return", "shared_sync", "expert_grad_allreduce")


@dataclass(frozen=True)
class LevelBreakdown:
    """Traffic of one world level per iteration."""

    name: str
    link_bytes: float               # bytes on the busiest sibling link (summed over phases)
    uplink_bytes: float             # bytes through the busiest unit uplink (summed over phases)
    seconds: dict[str, float]       # bandwidth time spent at this level, per phase (before overlap)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Expert-related bytes per rank over all MoE layers."""

    owned_weights: float
    borrowed_weights: float
    grads: float
    borrowed_grads: float
    optimizer_state: float
    codec_state: float = 0.0        # error-feedback accumulators (fp32) of compressed gradient returns

    @property
    def total(self) -> float:
        return (self.owned_weights + self.borrowed_weights + self.grads + self.borrowed_grads
                + self.optimizer_state + self.codec_state)

    def as_dict(self) -> dict[str, float]:
        return {"owned_weights": self.owned_weights, "borrowed_weights": self.borrowed_weights,
                "grads": self.grads, "borrowed_grads": self.borrowed_grads,
                "optimizer_state": self.optimizer_state, "codec_state": self.codec_state, "total": self.total}


@dataclass(frozen=True)
class CostBreakdown:
    model: str                              # "ours" or "paper"
    total: float                            # seconds per iteration
    phases: dict[str, float]                # exposed seconds per iteration (sum = total)
    raw: dict[str, float]                   # seconds of one occurrence before overlap (per layer and
    #   micro-batch; expert_grad_allreduce: the one all-reduce per iteration)
    levels: tuple[LevelBreakdown, ...] = ()
    memory: MemoryBreakdown | None = None
    notes: tuple[str, ...] = field(default=())

    def link_bytes(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for lv in self.levels:
            out[f"{lv.name}.link"] = lv.link_bytes
            out[f"{lv.name}.uplink"] = lv.uplink_bytes
        return out

    def predicted(self) -> dict[str, float]:
        return {**self.phases, "total": self.total}

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "total": self.total, "phases": dict(self.phases), "raw": dict(self.raw),
                "levels": [{"name": lv.name, "link_bytes": lv.link_bytes, "uplink_bytes": lv.uplink_bytes,
                            "seconds": dict(lv.seconds)} for lv in self.levels],
                "memory": self.memory.as_dict() if self.memory else None, "notes": list(self.notes)}


class CostModel:
    """Evaluates plans for one topology and workload (tier b)."""

    name = "ours"

    def __init__(self, topology: Topology, workload: Workload) -> None:
        self.topology = topology
        self.workload = workload
        self.network = Network(topology)
        self._layouts: dict[int, EPLayout] = {}

    def layout(self, ep_size: int) -> EPLayout:
        if ep_size not in self._layouts:
            self._layouts[ep_size] = self.topology.ep_layout(ep_size)
        return self._layouts[ep_size]

    def _layout_for(self, plan: Plan) -> EPLayout:
        lay = self.layout(plan.ep_size)
        if plan.level_counts != lay.counts:
            levels = dict(zip(lay.names, lay.counts, strict=True))
            raise PlanError(f"plan.level_counts: {plan.level_counts} but an EP group of {plan.ep_size} ranks in "
                            f"{self.topology.describe()} has levels {levels}; fix: make the plan for this "
                            "topology (hybridep plan)")
        if plan.num_experts != self.workload.num_experts:
            raise PlanError(f"plan.num_experts: {plan.num_experts} but the model has {self.workload.num_experts}; "
                            "fix: make the plan for this model")
        return lay

    # ---- the pieces ------------------------------------------------------------------------------------
    def token_a2a(self, plan: Plan, lay: EPLayout) -> tuple[list[PhaseCost], list[float]]:
        """One token all-to-all and the busiest rank's expert load (token copies), per routing layer."""
        w, G = self.workload, plan.ep_size
        S = world_domain_sizes(lay, plan.domain_sizes)
        routing = w.routing_for(G)
        if routing is None:
            pair = w.dispatch_bytes * plan.domain_size / G
            return [self.network.a2a(rail_family(lay, S), pair)], [float(w.tokens * w.top_k)]
        dst = plan.compute_ranks().ravel()
        src = np.repeat(np.arange(G), w.num_experts)
        phases, loads = [], []
        for counts in routing:
            c = counts.ravel()
            phases.append(self.network.flows(lay, src, dst, c * w.token_bytes))
            loads.append(float(np.bincount(dst, weights=c, minlength=G).max()))
        return phases, loads

    def memory(self, plan: Plan, lay: EPLayout) -> MemoryBreakdown:
        w = self.workload
        P = w.expert_params * w.num_moe_layers  # one expert's parameters over all MoE layers
        owned = plan.experts_per_rank
        borrowed = (plan.domain_size - 1) * owned if plan.kind == "domains" else 0
        dp = lay.num_groups if plan.kind == "domains" else self.topology.level_counts[0]
        opt_share = 1 / dp if w.distributed_optimizer else 1.0
        return MemoryBreakdown(owned_weights=owned * P * w.weight_bytes,
                               borrowed_weights=borrowed * P * w.weight_bytes,
                               grads=owned * P * w.grad_bytes,
                               borrowed_grads=borrowed * P * w.grad_bytes,
                               optimizer_state=owned * P * w.optimizer_bytes_per_param * opt_share,
                               codec_state=borrowed * P * 4 if w.grad_compression_ratio > 1 else 0.0)

    # ---- one plan ----------------------------------------------------------------------------------------
    def evaluate(self, plan: Plan) -> CostBreakdown:
        w, net = self.workload, self.network
        lay = self._layout_for(plan)
        G, S, E = plan.ep_size, plan.domain_size, plan.num_experts
        Lm, m = w.num_moe_layers, w.micro_batches
        S_world = world_domain_sizes(lay, plan.domain_sizes)
        a2a_layers, loads = self.token_a2a(plan, lay)
        per_layer = Lm / len(a2a_layers)  # a single routing matrix stands for every MoE layer
        a2a_total = sum(p.seconds for p in a2a_layers) * per_layer
        expert_fwd = sum(loads) * per_layer * w.expert_seconds_per_token
        t_pre = w.t_pre

        zero = PhaseCost.zero(net.L)
        ag = rs = shared = zero
        if plan.kind == "domains":
            own = E // G
            if S > 1:
                dom = domain_family(lay, S_world)
                ag = net.ring(dom, (S - 1) * own * w.expert_wire_bytes, S - 1)
                if w.grad_compression_ratio > 1:  # top-k payloads by all_to_all in the domain
                    rs = net.a2a(dom, own * w.grad_wire_bytes)
                else:
                    rs = net.ring(dom, (S - 1) * own * w.grad_wire_bytes, S - 1)
                if w.shared_sync_bytes:  # the shared expert is the mean over the whole EP group
                    ep_group = domain_family(lay, lay.extent)
                    shared = net.ring(ep_group, 2 * (G - 1) / G * w.shared_sync_bytes, 2 * (G - 1))
            fam, k = replica_family(self.topology, lay), lay.num_groups
        else:
            own = E // plan.rail_size
            fam, k = dc_replica_family(self.topology), self.topology.level_counts[0]
        grad_bytes = own * w.expert_params * w.grad_bytes * Lm  # one bucket: every MoE layer's expert grads
        allreduce = net.ring(fam, 2 * (k - 1) / k * grad_bytes, 2 * (k - 1)) if k > 1 else zero

        # overlap as the runtime schedules it (module doc): only the gathers hide
        disjoint = not any(a > 0 and any(p.level_seconds[i] > 0 for p in a2a_layers)
                           for i, a in enumerate(ag.level_seconds))
        a2a = a2a_total / Lm if disjoint else 0.0  # one all-to-all (mean over layers)
        first, later, restart = (max(0.0, ag.seconds - cover) for cover in (t_pre + a2a, t_pre + 2 * a2a, a2a))
        gathers = first + (Lm - 1) * later + (m - 1) * (restart + (Lm - 1) * later)
        phases = {
            "pre_compute": 3 * t_pre * Lm * m,
            "expert_compute": 3 * expert_fwd * m,
            "token_a2a_fwd": 2 * a2a_total * m,
            "token_a2a_bwd": 2 * a2a_total * m,
            "expert_allgather": gathers,
            "grad_return": Lm * m * rs.seconds,
            "shared_sync": Lm * shared.seconds,
            "expert_grad_allreduce": allreduce.seconds,
        }
        raw = {"t_pre": t_pre, "expert_fwd": expert_fwd / Lm, "a2a": a2a_total / Lm,
               "expert_allgather": ag.seconds, "grad_return": rs.seconds, "shared_sync": shared.seconds,
               "expert_grad_allreduce": allreduce.seconds}

        occurrences = [("token_a2a", p, 4 * m * per_layer) for p in a2a_layers] + [
            ("expert_allgather", ag, Lm * m), ("grad_return", rs, Lm * m), ("shared_sync", shared, Lm),
            ("expert_grad_allreduce", allreduce, 1)]
        levels = []
        for lvl, lv in enumerate(self.topology.levels):
            secs: dict[str, float] = {}
            link = up = 0.0
            for name, p, count in occurrences:
                if p.level_seconds[lvl] > 0:
                    secs[name] = secs.get(name, 0.0) + p.level_seconds[lvl] * count
                link += p.pair_bytes[lvl] * count
                up += p.uplink_bytes[lvl] * count
            levels.append(LevelBreakdown(lv.name, link, up, secs))
        notes = []
        if w.routing_counts is not None:
            notes.append("skewed routing from routing_counts")
        return CostBreakdown("ours", sum(phases.values()), phases, raw, tuple(levels), self.memory(plan, lay),
                             tuple(notes))


def bytes_human(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def seconds_human(t: float) -> str:
    if t == 0:
        return "0"
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"

