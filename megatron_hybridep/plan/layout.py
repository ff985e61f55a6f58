"""The layout planner: which Megatron layout (TP, PP, EP, DP) to run, and which HybridEP plan in it.

    results = plan_layouts(topology, workload)   # every admitted layout, the choice first
    results[0].layout.flags()                     # the Megatron flags of the choice
    print(format_layouts(results))                # `hybridep plan --layout auto`

Megatron orders ranks "tp-cp-ep-dp-pp" (megatron.core.parallel_state): TP fastest, PP outermost, so
a pipeline stage is a contiguous block of world / PP ranks (a divisor of one level's units and
whole inner levels: stages never straddle a DC boundary here) and a TP group is TP consecutive
ranks (inside the innermost unit). Experts run with expert TP = 1 (``--expert-tensor-parallel-size
1``): the expert generator is then "ep-dp-pp" over a stage's TP x DP ranks, so an EP group is EP
consecutive ranks of the stage, as the cost model places it, and EP divides the stage.

Rules: PP divides the layers (no uneven stages) and the world; TP divides the innermost level's
units, the attention heads (or the hidden size when heads are not stated) and the tokens of a
micro-batch; EP divides the experts and fits the stage's levels. A layout is admitted when one of
its plans fits the memory limit (the cost model's estimate: parameters, gradients, optimizer
state; activations not counted).

Every layout trains the same global batch. The workload's tokens per rank and micro-batches
describe the plain layout (TP 1, PP 1, DP = world); a layout keeps the micro-batch of one model
replica and runs M x TP x PP micro-batches (Megatron's GBS / (micro-batch x DP)). Under TP with
sequence parallelism each rank routes and sends 1/TP of its replica's tokens and computes 1/TP of
its dense work. TP's own all-gathers and reduce-scatters (attention in every layer, the FFN too in
dense layers) run on the innermost level and are added per micro-batch outside the pipeline
schedule (``tp_seconds``); everything else is the cost model's (plan/cost.py, with PP priced by
plan/pipeline.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from megatron_hybridep.plan.cost import bytes_human, seconds_human
from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.grid import divisors
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.planner import Candidate, choose_plan
from megatron_hybridep.plan.topology import Topology
from megatron_hybridep.plan.workload import Workload


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    ep: int
    dp: int
    micro_batches: int      # per iteration, for the same global batch as the plain layout
    stage: str = ""         # what one pipeline stage spans, e.g. "1 dc x 8 gpu"

    @property
    def label(self) -> str:
        return f"TP{self.tp} PP{self.pp} EP{self.ep} DP{self.dp}"

    def flags(self) -> str:
        """The Megatron command-line flags of this layout."""
        out = [f"--tensor-model-parallel-size {self.tp}", f"--pipeline-model-parallel-size {self.pp}",
               f"--expert-model-parallel-size {self.ep}"]
        if self.tp > 1:
            out += ["--sequence-parallel", "--expert-tensor-parallel-size 1"]
        return " ".join(out)


@dataclass(frozen=True)
class LayoutResult:
    layout: Layout
    workload: Workload              # as priced: this layout's TP, PP, micro-batches and tokens per rank
    best: Candidate | None          # the fastest plan that fits the memory (None: none fits)
    megatron: Candidate | None      # the fastest plan without hybridep that fits (plain EP)
    hybrid: Candidate | None        # the fastest hybridep plan that fits
    tp_seconds: float               # TP's collectives per iteration (module doc)
    least_memory: float             # bytes per rank of the smallest plan

    @property
    def fits(self) -> bool:
        return self.best is not None

    @property
    def step(self) -> float:
        return self.best.cost.total + self.tp_seconds if self.best else float("inf")

    @property
    def megatron_step(self) -> float:
        return self.megatron.cost.total + self.tp_seconds if self.megatron else float("inf")

    @property
    def hybrid_step(self) -> float:
        return self.hybrid.cost.total + self.tp_seconds if self.hybrid else float("inf")

    @property
    def hybridep(self) -> bool:
        return self.best is not None and is_hybridep(self.best.plan)

    @property
    def memory(self) -> float:
        m = self.best.cost.memory if self.best else None
        return m.total if m else self.least_memory

    def wan_uplink_bytes(self) -> float:
        """Bytes per iteration through the busiest uplink of the coarsest level (the DC's WAN uplink)."""
        if self.best is None or not self.best.cost.levels:
            return 0.0
        return self.best.cost.levels[0].uplink_bytes

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {"layout": lay.label, "tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "dp": lay.dp,
                "micro_batches": lay.micro_batches, "stage": lay.stage, "flags": lay.flags(), "fits": self.fits,
                "plan": self.best.plan.label if self.best else None, "hybridep": self.hybridep,
                "step_s": self.step if self.fits else None, "tp_s": self.tp_seconds,
                "megatron_plan": self.megatron.plan.label if self.megatron else None,
                "megatron_step_s": self.megatron_step if self.megatron else None,
                "hybridep_plan": self.hybrid.plan.label if self.hybrid else None,
                "hybridep_step_s": self.hybrid_step if self.hybrid else None,
                "wan_uplink_bytes": self.wan_uplink_bytes(), "memory_bytes": self.memory}


def is_hybridep(plan: Plan) -> bool:
    """Whether a plan needs HybridEP: borrowed experts (domains of S > 1) or hot-expert replicas."""
    return plan.kind == "domains" and (plan.domain_size > 1 or bool(plan.replicas))


# ---- enumeration ---------------------------------------------------------------------------------------
def layout_workload(workload: Workload, tp: int, pp: int) -> Workload:
    """``workload`` (the plain layout's) as a TP x PP layout runs it: same global batch (module doc)."""
    v = workload.virtual_pipeline_model_parallel_size
    virtual = v if pp > 1 and workload.layers % (pp * v) == 0 else 1
    t_pre = workload.t_pre_ms / tp if workload.t_pre_ms is not None else None
    return workload.replace(tensor_model_parallel_size=tp, expert_tensor_parallel_size=1,
                            pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=virtual,
                            micro_batches=workload.micro_batches * tp * pp, tokens_per_rank=workload.tokens // tp,
                            sequence_parallel=False, data_parallel_size=0, t_pre_ms=t_pre)


def _tp_ok(workload: Workload, tp: int) -> bool:
    heads = workload.num_attention_heads or workload.hidden_size
    return heads % tp == 0 and workload.tokens % tp == 0


def _stage(topology: Topology, pp: int) -> Topology | None:
    try:
        return topology.pipeline_stage(pp)
    except PlanError:
        return None


def _describe(stage: Topology) -> str:
    return " x ".join(f"{lv.count} {lv.name}" for lv in stage.levels if lv.count > 1) or f"1 {stage.levels[-1].name}"


def enumerate_layouts(topology: Topology, workload: Workload) -> list[Layout]:
    """Every (TP, PP, EP, DP) the topology and model admit by shape (memory aside), PP outermost as
    in Megatron's rank order, then EP, then TP."""
    n, inner = topology.world_size, topology.levels[-1].count
    out = []
    for pp in divisors(workload.layers):
        stage = _stage(topology, pp) if n % pp == 0 else None
        if stage is None:
            continue
        for ep in stage.feasible_ep_sizes(workload.num_experts):
            if workload.routing_counts is not None and workload.routing_counts.shape[-2] != ep:
                continue
            for tp in divisors(stage.levels[-1].count):
                if inner % tp or not _tp_ok(workload, tp):
                    continue
                out.append(Layout(tp, pp, ep, n // (tp * pp), workload.micro_batches * tp * pp,
                                  _describe(stage) if pp > 1 else ""))
    return out


def tp_seconds(topology: Topology, workload: Workload) -> float:
    """TP's collectives per iteration on one stage (``workload`` as the layout runs it): per micro-batch
    an all-gather and a reduce-scatter around attention in every layer and around the FFN in dense
    layers, forward and backward, each a ring over the innermost level of the replica's activations,
    plus the backend's fixed cost per call when one is asked for (Workload.call_seconds)."""
    tp = workload.tensor_model_parallel_size
    if tp == 1:
        return 0.0
    lv = topology.levels[-1]
    rate = min(lv.bandwidth, lv.uplink) if lv.uplink else lv.bandwidth
    pp = workload.pipeline_model_parallel_size
    moe = workload.stage_moe_layers
    dense = max(0, workload.layers // pp - moe)
    collectives = 4 * moe + 8 * dense
    full = workload.tokens * tp * workload.hidden_size * workload.activation_bytes
    one = (tp - 1) / tp * full / rate + (tp - 1) * lv.latency + workload.call_seconds
    return workload.micro_batches * collectives * one


# ---- planning ------------------------------------------------------------------------------------------
def plan_layout(topology: Topology, workload: Workload, layout: Layout, *,
                memory_limit_bytes: float | None = None, offer_exact: bool = True) -> LayoutResult:
    """The best plan (and the best plan with and without hybridep) in one layout. The replicated plan
    is left out: it is plain EP in the layout whose EP group is one DC. ``offer_exact``: choose_plan's."""
    w = layout_workload(workload, layout.tp, layout.pp)
    r = choose_plan(topology, w, layout.ep, memory_limit_bytes=memory_limit_bytes, include_replicated=False,
                    check_memory=False, offer_exact=offer_exact)
    fitting = [c for c in r.candidates if c.fits_memory]  # cheapest first
    best = fitting[0] if fitting else None
    megatron = next((c for c in fitting if not is_hybridep(c.plan)), None)
    hybrid = next((c for c in fitting if is_hybridep(c.plan)), None)
    least = min(c.cost.memory.total for c in r.candidates if c.cost.memory is not None)
    return LayoutResult(layout, w, best, megatron, hybrid, tp_seconds(topology, w), least)


# Exact HybridEP is chosen only when predicted this much faster than the best plain Megatron layout:
# in the testbed's near-ties (priced 0-5% faster) exact HybridEP measured faster at 9 of 20 points and
# up to 1.25x slower at the others, and a plain layout carries none of its own overheads, so a tie goes
# to Megatron. Compressed plans get no margin: in their near-ties they measured faster at 10 of 12
# points (1.03-1.35x; the other two 0.97x and 1.00x): docs/results.md, "The near-tie rule, measured".
PREFER_MEGATRON_WITHIN = 0.05


def within_margin(hybrid_s: float, plain_s: float, compressed: bool, margin: float = PREFER_MEGATRON_WITHIN) -> bool:
    """Whether a plain layout predicted at ``plain_s`` takes the choice from a hybridep one at ``hybrid_s``:
    within ``margin`` of an exact plan, no slower than a compressed one; an infinite margin (Megatron's
    own dispatcher: no hybridep plan runs) takes it from either."""
    return plain_s <= hybrid_s * (1 + (0.0 if compressed and margin != math.inf else margin))


def prefer_megatron(results: list[LayoutResult], margin: float = PREFER_MEGATRON_WITHIN) -> list[LayoutResult]:
    """``results`` (fastest first) with the choice first: the fastest, unless it needs exact hybridep and
    the best layout without hybridep is predicted within ``margin`` of it (a compressed plan: no slower
    than it); that layout then comes first, running its plain Megatron plan (its ``best`` is its
    ``megatron`` candidate)."""
    fit = [r for r in results if r.fits]
    base = best_megatron(fit)
    if not fit or not fit[0].hybridep or base is None or fit[0].best is None \
            or not within_margin(fit[0].step, base.megatron_step, fit[0].best.compressed, margin):
        return results
    plain = replace(base, best=base.megatron)
    return [plain, *(r for r in results if r is not base)]


def plan_layouts(topology: Topology, workload: Workload, *, memory_limit_bytes: float | None = None,
                 prefer_megatron_within: float = PREFER_MEGATRON_WITHIN,
                 offer_exact: bool = True) -> list[LayoutResult]:
    """Every layout the topology admits with its best plan; those that fit first, fastest first, then
    those that do not fit, smallest first; the choice first (``prefer_megatron``). ``workload``: the
    plain layout's (module doc). ``offer_exact``: with compression, each domain priced exact too
    (choose_plan's; the bench's auto-c, which compresses every domain it runs, passes False)."""
    results = [plan_layout(topology, workload, lay, memory_limit_bytes=memory_limit_bytes, offer_exact=offer_exact)
               for lay in enumerate_layouts(topology, workload)]
    if not results:
        raise PlanError(f"layout: no layout fits the shape of {topology.describe()} with {workload.layers} layers and "
                        f"{workload.num_experts} experts; fix: check the model's layer and expert counts")
    ordered = sorted(results, key=lambda x: (not x.fits, x.step, x.memory, x.layout.pp, x.layout.tp, -x.layout.ep))
    return prefer_megatron(ordered, prefer_megatron_within)


def best_megatron(results: list[LayoutResult]) -> LayoutResult | None:
    """The layout whose best plan without hybridep is fastest."""
    ok = [r for r in results if r.megatron is not None]
    return min(ok, key=lambda r: r.megatron_step) if ok else None


# ---- the table -----------------------------------------------------------------------------------------
def _name(r: LayoutResult, c: Candidate | None) -> str:
    return f"{r.layout.label} {c.plan.label if c else '-'}"


def verdict(results: list[LayoutResult]) -> str:
    """One line: does hybridep pay, against the best Megatron layout without it."""
    fit = [r for r in results if r.fits]
    if not fit:
        least = min(results, key=lambda r: r.memory)
        return (f"no layout fits the memory: the smallest, {least.layout.label}, needs {bytes_human(least.memory)} "
                "per rank; fix: use the distributed optimizer or raise --memory-limit-gb")
    best, base = fit[0], best_megatron(results)
    if not best.hybridep:
        h = min((r for r in fit if r.hybrid), key=lambda r: r.hybrid_step, default=None)
        if h and h.hybrid_step < best.step:
            tail = (f"; the fastest hybridep plan, {_name(h, h.hybrid)}, is predicted only "
                    f"{best.step / h.hybrid_step:.2f}x faster ({seconds_human(h.hybrid_step)}), within the margin "
                    f"that goes to plain Megatron (default {PREFER_MEGATRON_WITHIN:.0%} for exact plans: the cost "
                    "model's error)")
        else:
            tail = (f"; the fastest hybridep plan, {_name(h, h.hybrid)}, takes {seconds_human(h.hybrid_step)} "
                    f"({h.hybrid_step / best.step:.2f}x slower)" if h else "; no hybridep plan fits")
        return (f"hybridep does not pay here: the best layout is a plain Megatron one, {_name(best, best.best)} "
                f"({seconds_human(best.step)}){tail}")
    w = best.workload
    lossy = (f", with compressed migration (weights {w.compression_ratio:g}x, returned gradients "
             f"{w.grad_compression_ratio:g}x: a cost in model quality, docs/compression.md)"
             if max(w.compression_ratio, w.grad_compression_ratio) > 1 else "")
    if base is None:
        return f"hybridep pays: {_name(best, best.best)}{lossy}; no layout fits without it"
    return (f"hybridep pays: {_name(best, best.best)} ({seconds_human(best.step)}) is "
            f"{base.megatron_step / best.step:.2f}x faster than the best Megatron layout without it, "
            f"{_name(base, base.megatron)} ({seconds_human(base.megatron_step)}){lossy}")


def format_layouts(results: list[LayoutResult], top: int | None = None) -> str:
    """The layout table: one row per admitted layout (its best plan), fastest first, then the verdict."""
    base = best_megatron(results)
    ref = base.megatron_step if base else None
    heads = ["", "layout", "stage", "M", "plan", "predicted step", "TP coll.", "WAN bytes per uplink", "memory",
             "vs best Megatron"]
    fit = [r for r in results if r.fits]
    shown = fit[:top] if top else fit
    rows = [heads]
    for i, r in enumerate(shown):
        assert r.best is not None
        rows.append(["*" if i == 0 else "", r.layout.label, r.layout.stage or "-", str(r.layout.micro_batches),
                     r.best.plan.label, seconds_human(r.step), seconds_human(r.tp_seconds),
                     bytes_human(r.wan_uplink_bytes()), bytes_human(r.memory),
                     f"{ref / r.step:.2f}x" if ref else "-"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(heads))]
    out = []
    for i, row in enumerate(rows):
        cells = [c.ljust(widths[j]) if j in (0, 1, 2, 4) else c.rjust(widths[j]) for j, c in enumerate(row)]
        out.append("  ".join(cells).rstrip())
        if i == 0:
            out.append("-" * len(out[-1]))
    if top and len(fit) > top:
        out.append(f"... {len(fit) - top} more (drop --top to see all)")
    unfit = [r for r in results if not r.fits]
    if unfit:
        out.append(f"{len(unfit)} layout(s) do not fit the memory, e.g. " + ", ".join(
            f"{r.layout.label} ({bytes_human(r.memory)})" for r in unfit[:3]))
    out.append("predicted step = cost model (plan/cost.py, PP by plan/pipeline.py) + TP coll.; M = micro-batches "
               "for the same global batch; WAN bytes = through the busiest DC uplink per iteration; memory = per "
               "rank, activations not counted; vs best Megatron = the best layout without hybridep's step over "
               "this one's")
    if base is not None:
        assert base.megatron is not None
        out.append(f"best Megatron layout without hybridep: {base.layout.label} {base.megatron.plan.label}, "
                   f"{seconds_human(base.megatron_step)} ({base.layout.flags()})")
    if fit:
        assert fit[0].best is not None
        out.append(f"choice: {fit[0].layout.label} {fit[0].best.plan.label}, {seconds_human(fit[0].step)} "
                   f"({fit[0].layout.flags()})")
    out.append(verdict(results))
    return "\n".join(out)


__all__ = ["PREFER_MEGATRON_WITHIN", "Layout", "LayoutResult", "best_megatron", "enumerate_layouts", "format_layouts",
           "is_hybridep",
           "layout_workload", "plan_layout", "plan_layouts", "prefer_megatron", "tp_seconds", "verdict",
           "within_margin"]
