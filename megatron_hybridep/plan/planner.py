"""Enumerate every feasible plan for an EP group, cost each one, return the best and all candidates.

Feasible plans: every combination of a divisor S_l of each level's count (S = 1 everywhere is plain
EP), plus the replicated plan when the EP group spans more than one DC, plus, when routing counts are
known (skew), each domains plan with hot-expert replicas (plan/hot.py) where they pay. A 1000-DC x 8-GPU world
with 256 experts plans in milliseconds (benchmarks/plan_time.py): the cost model is closed-form
per level and only skewed routing touches (G x E) arrays.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_hybridep.plan.cost import CostBreakdown, CostModel
from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.grid import divisors
from megatron_hybridep.plan.hot import hot_plan
from megatron_hybridep.plan.paper_model import PaperModel, PaperResult
from megatron_hybridep.plan.phases import Phase
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.topology import EPLayout, Topology
from megatron_hybridep.plan.workload import Workload

COST_MODELS = ("ours", "paper")


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    cost: CostBreakdown
    fits_memory: bool = True
    compressed: bool = False  # runs the workload's codec (borrowed copies travel compressed)


@dataclass(frozen=True)
class PlanningResult:
    topology: Topology
    workload: Workload
    layout: EPLayout
    cost_model: str
    best: Plan
    candidates: tuple[Candidate, ...]       # cheapest first
    paper: PaperResult

    @property
    def chosen(self) -> Candidate:
        return next(c for c in self.candidates if c.plan == self.best)

    @property
    def compressed(self) -> bool:
        """The chosen plan runs the workload's codec; False where compression was asked for but
        the exact plan is priced at least as fast (the codec's compute, or a domain over the cap)."""
        return self.chosen.compressed

    @property
    def plain_ep(self) -> Candidate:
        return next(c for c in self.candidates
                    if c.plan.kind == "domains" and c.plan.domain_size == 1 and not c.plan.replicas)

    def speedup(self, cand: Candidate) -> float:
        """Plain EP's predicted time over this candidate's."""
        return self.plain_ep.cost.total / cand.cost.total if cand.cost.total > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {
            "topology": self.topology.name or self.topology.source,
            "model": self.workload.name,
            "world_size": self.topology.world_size,
            "ep_size": self.layout.ep_size,
            "ep_levels": dict(zip(self.layout.names, self.layout.counts, strict=True)),
            "cost_model": self.cost_model,
            "best": self.best.to_dict(),
            "compressed": self.compressed,
            "candidates": [{"label": c.plan.label, "kind": c.plan.kind, "domain_sizes": list(c.plan.domain_sizes),
                            "fits_memory": c.fits_memory, "compressed": c.compressed, "speedup_vs_ep": self.speedup(c),
                            "cost": c.cost.to_dict()} for c in self.candidates],
            "paper": {"D": self.paper.D, "P": self.paper.P, "t_pre": self.paper.t_pre,
                      "layer_time": self.paper.layer_time,
                      "levels": [dataclasses.asdict(lv) for lv in self.paper.levels]},
        }


def enumerate_plans(layout: EPLayout, num_experts: int, include_replicated: bool = True) -> list[Plan]:
    """Every divisor combination of domain sizes, plus the replicated plan where it applies."""
    plans = [Plan("domains", layout.names, layout.counts, tuple(s), num_experts)
             for s in itertools.product(*(divisors(n) for n in layout.counts))]
    if include_replicated and layout.spans_dcs and len(layout.counts) > 1 and layout.levels[0] == 0:
        plans.append(Plan.replicated(layout.counts, num_experts, layout.names))
    return plans


def compressible(workload: Workload, plan: Plan) -> bool:
    """A HybridEP domain (S > 1) whose borrowed copies the workload's codec would compress."""
    return workload.compresses and plan.kind == "domains" and plan.domain_size > 1


def over_quality_cap(workload: Workload, plan: Plan) -> bool:
    """A compressed domain larger than ``workload.max_compressed_domain`` ranks (0: none is): a
    quality budget, since the loss cost grows with the share of tokens computed on compressed
    copies (docs/compression.md). Megatron's EP (S = 1) never is."""
    cap = workload.max_compressed_domain
    return bool(cap) and compressible(workload, plan) and plan.domain_size > cap


def within_quality_cap(workload: Workload, plans: list[Plan]) -> list[Plan]:
    """``plans`` without those over the quality cap (:func:`over_quality_cap`)."""
    return [p for p in plans if not over_quality_cap(workload, p)]


def with_hot_plans(model: CostModel, plans: list[Plan], replica_budget: int | None = None) -> list[Plan]:
    """``plans`` plus a hot-replica variant of each domains plan where replicas pay (skewed routing)."""
    if replica_budget == 0 or model.workload.routing_counts is None:
        return plans
    hot = [h[0] for p in plans if (h := hot_plan(model, p, replica_budget)) is not None]
    return plans + hot


def choose_plan(topology: Topology, workload: Workload, ep_size: int | None = None, *, cost: str = "ours",
                include_replicated: bool = True, memory_limit_bytes: float | None = None,
                replica_budget: int | None = None, check_memory: bool = True,
                offer_exact: bool = True) -> PlanningResult:
    """Plan one EP group: every candidate plan (HybridEP domains, Megatron's EP, replicated experts,
    and their hot-replica variants) priced by one cost model, cheapest first. The public planning
    entry; torch-free.

    Args:
        topology: the cluster (plan/topology.py): levels, bandwidths, memory per GPU, PP/TP/DP.
        workload: the model and the run (plan/workload.py): tokens per rank, micro-batches, codec ratios.
        ep_size: ranks in one EP group; default the largest that fits the levels and the experts.
        cost: "ours" (CostModel, plan/cost.py) or "paper" (the paper's model, no replicas).
        include_replicated: also price EP inside each DC with experts replicated across DCs.
        memory_limit_bytes: per-rank limit (default the topology's memory_gb_per_gpu); plans over it
            are refused unless ``check_memory`` is False.
        replica_budget: hot-expert replicas per rank (None: the experts a rank owns; 0: none).
        offer_exact: with compression in the workload, price each HybridEP domain exact too and keep
            the faster (``Candidate.compressed`` says which); False: every domain compressed, those
            over the quality cap left out (a system that must compress, e.g. the bench's hybridep-c).

    Returns:
        PlanningResult: ``.best`` the chosen Plan (its ``predicted`` seconds per phase and
        ``link_bytes`` filled in), ``.candidates`` every plan with its CostBreakdown, cheapest first,
        ``.topology`` the priced stage (with PP > 1, one pipeline stage).

    Raises:
        PlanError naming the field and the fix (an unknown cost model, no plan within memory).
    """
    if cost not in COST_MODELS:
        raise PlanError(f"cost: unknown cost model {cost!r}; fix: use one of {', '.join(COST_MODELS)}")
    limit = memory_limit_bytes if memory_limit_bytes is not None else topology.memory_bytes
    ours = CostModel(topology, workload, limit)
    stage = ours.topology
    if ep_size is None:
        ep_size = stage.default_ep_size(workload.num_experts)
    layout = stage.ep_layout(ep_size)
    stage.check_experts(workload.num_experts, ep_size)
    paper = PaperModel(stage, workload)
    model = ours if cost == "ours" else paper
    plans = enumerate_plans(layout, workload.num_experts, include_replicated and cost == "ours")
    # With compression asked, each HybridEP domain is priced both ways and runs the faster: the codec
    # costs compute (CPU ranks) and quality, so it must pay; domains over the quality cap run exact.
    exact = (CostModel(topology, workload.exact(), limit) if offer_exact and workload.compresses and cost == "ours"
             else None)
    if exact is None:
        plans = within_quality_cap(workload, plans)
    if cost == "ours":
        plans = with_hot_plans(ours, plans, replica_budget)
    cands = []
    for plan in plans:
        lossy = compressible(workload, plan)
        c = None if lossy and exact is not None and over_quality_cap(workload, plan) else model.evaluate(plan)
        if lossy and exact is not None:
            e = exact.evaluate(plan)
            if c is None or e.total <= c.total:
                c, lossy = e, False
        assert c is not None
        mem = c.memory if c.memory is not None else ours.memory(plan, layout)
        fits = limit is None or mem.total <= limit
        if c.memory is None:
            c = dataclasses.replace(c, memory=mem)
        plan = dataclasses.replace(plan, predicted=c.predicted(), link_bytes=c.link_bytes())
        cands.append(Candidate(plan, c, fits, lossy))
    # cheapest first; ties go to less memory, then smaller domains (fewer borrowed experts)
    cands.sort(key=lambda c: (check_memory and not c.fits_memory, c.cost.total,
                              c.cost.memory.total if c.cost.memory else 0, c.plan.domain_size, c.plan.kind))
    if check_memory and not cands[0].fits_memory:
        least = min(cands, key=lambda c: c.cost.memory.total if c.cost.memory else 0)
        m = least.cost.memory
        assert m is not None and limit is not None
        where = ("--memory-limit-gb" if memory_limit_bytes is not None
                 else f"{topology.source}.memory_gb_per_gpu")
        raise PlanError(f"memory_limit: no plan fits {limit / 1e9:.3g} GB per rank ({where}); the smallest, "
                        f"{least.plan.label}, needs {m.total / 1e9:.3g} GB (experts {m.expert_total / 1e9:.3g}, "
                        f"dense {m.dense_total / 1e9:.3g}); fix: spread the model over more ranks (EP size, "
                        "pipeline_model_parallel_size, tensor_model_parallel_size), use the distributed "
                        "optimizer, or raise --memory-limit-gb")
    return PlanningResult(stage, workload, layout, cost, cands[0].plan, tuple(cands), paper.optimum(ep_size))


def choose_plan_all_ep_sizes(topology: Topology, workload: Workload, **kwargs: Any) -> list[PlanningResult]:
    """choose_plan for every feasible EP size (smallest first), e.g. to see how far EP should span."""
    sizes = topology.pipeline_stage(workload.pipeline_model_parallel_size).feasible_ep_sizes(workload.num_experts)
    if workload.routing_counts is not None:
        sizes = tuple(s for s in sizes if s == workload.routing_counts.shape[-2])
    return [choose_plan(topology, workload, s, **kwargs) for s in sizes]


@dataclass(frozen=True)
class Replan:
    """Whether to switch plans while training, and why."""

    switch: bool
    plan: Plan                  # the plan to run next (the current one when not switching)
    current_seconds: float      # predicted per iteration, current plan
    best_seconds: float         # predicted per iteration, best candidate
    switch_seconds: float       # one-off cost of switching
    gain_seconds: float         # (current - best) x horizon
    reason: str


def replan(topology: Topology, workload: Workload, current: Plan, *, horizon_iterations: int,
           candidates: Sequence[Plan] | None = None, switch_seconds: float | None = None) -> Replan:
    """Re-evaluate with measured inputs (routing counts in ``workload``, bandwidths in ``topology``) and
    switch only when the predicted gain over ``horizon_iterations`` beats the switch cost.

    ``candidates``: the plans the runtime has prebuilt groups for (default: every feasible plan of the
    current EP group, with hot-replica variants under skewed routing). ``switch_seconds`` default: one
    exact (uncompressed) expert gather of the new plan in every MoE layer, since borrowed copies are
    rebuilt from scratch after a switch."""
    if horizon_iterations < 1:
        raise PlanError(f"horizon_iterations: must be >= 1, got {horizon_iterations}; fix: pass the number "
                        "of iterations until the next re-evaluation")
    model = CostModel(topology, workload)
    layout = model.layout(current.ep_size)
    pool = (list(candidates) if candidates is not None
            else with_hot_plans(model, within_quality_cap(workload, enumerate_plans(layout, current.num_experts))))
    if current not in pool:
        pool.append(current)
    costs = {p: model.evaluate(p) for p in pool}
    best = min(pool, key=lambda p: (costs[p].total, p.domain_size, p.kind))
    cur_t, best_t = costs[current].total, costs[best].total
    if switch_seconds is None:
        exact = CostModel(topology, workload.replace(compression_ratio=1.0, compressed_expert_bytes=None))
        switch_seconds = workload.num_moe_layers * exact.evaluate(best).raw[Phase.EXPERT_ALLGATHER]
    gain = (cur_t - best_t) * horizon_iterations
    if best == current or gain <= switch_seconds:
        why = ("the current plan is the best" if best == current else
               f"gain {gain:.3g} s over {horizon_iterations} iterations <= switch cost {switch_seconds:.3g} s")
        return Replan(False, current, cur_t, best_t, switch_seconds, gain, why)
    return Replan(True, best, cur_t, best_t, switch_seconds, gain,
                  f"{best.label}: gain {gain:.3g} s over {horizon_iterations} iterations > switch cost "
                  f"{switch_seconds:.3g} s")
