"""Simulate one training iteration of a Plan on a Topology for a Workload.

    result = simulate(topo, work, plan)           # SimResult: total, exposed phases, timeline, traffic
    result = simulate(topo, work)                 # plan = the planner's choice (choose_plan)

How: the EP groups of the world run the same program on disjoint links (an EP group is a contiguous
block of ranks; its token all-to-alls, expert gathers, replica exchanges and gradient returns stay
inside it), so each *class* of EP groups (same per-pair overrides inside its span) is simulated once
in its own space (flows.py) and the iteration waits for the slowest. Then the collectives that cross
EP groups (expert data-parallel all-reduce, the replicated plan's all-reduce over DCs) run on the
world's links.

Complexity. Flow classes per collective: F = R (M - 1) for an all-to-all over groups of M ranks, R for a
ring, with R = prod_l pi_l representatives (flows.py; balanced routing on uniform links: pi = the domain
block at each level, so F <= G per all-to-all; per-pair overrides or skewed routing: R = all ranks of
the EP group). Incidence K <= F (1 + 2L) for L levels. One max-min fill: O(K b), b = distinct
bottlenecks (rounds). One distinct program segment: O(e K b), e = distinct drain times. The program
has O(L_moe m) instructions (m micro-batches); repeated segments are memo hits costing a hash of the
in-flight state. 1000 DCs x 8 GPUs, 256 experts (deepseek-v3-like, 58 layers x 8 micro-batches):
~0.1-0.2 s balanced, ~0.9 s with Zipf-skewed routing (benchmarks/sim_time.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_hybridep.plan.cost import CostModel, check_plan, codec_compute, data_parallel_exposed
from megatron_hybridep.plan.hot import REPLICA_PHASES
from megatron_hybridep.plan.network import (
    Family,
    dc_replica_family,
    domain_family,
    rail_family,
    replica_family,
    world_domain_sizes,
)
from megatron_hybridep.plan.phases import Phase
from megatron_hybridep.plan.pipeline import schedule_time
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.topology import EPLayout, Topology
from megatron_hybridep.plan.workload import Workload
from megatron_hybridep.sim.engine import BLOCK, Engine, EngineStats, Instr, Span, Trace
from megatron_hybridep.sim.flows import A2A, PAIRS, RING, Collective, FlowSet, Space
from megatron_hybridep.sim.schedule import PHASES, LayerWork, SimOptions, build_program


@dataclass(frozen=True)
class OpReport:
    """One collective of the iteration."""

    name: str
    kind: str
    occurrences: int
    busy_seconds: float          # summed issue-to-completion time
    exposed_seconds: float       # time the main thread waited for it
    level_bytes: dict[str, float]   # bytes per rank crossing each level, per occurrence
    uplink_bytes: dict[str, float]  # bytes through the busiest uplink of each level, per occurrence


@dataclass(frozen=True)
class GroupClass:
    """EP groups that share the same per-pair link overrides: simulated once."""

    groups: int
    overrides: tuple[tuple[int, int], ...]
    seconds: float               # EP-group part of the iteration (without world-level collectives)


@dataclass
class SimResult:
    plan: Plan
    total: float                             # seconds per iteration
    phases: dict[str, float]                 # exposed seconds per phase (sum = total)
    forward: float                           # seconds in forward passes (all micro-batches)
    timeline: list[Span]                     # slowest EP-group class, then the world-level collectives
    ops: dict[str, OpReport]
    group_classes: list[GroupClass]
    stats: EngineStats
    traffic: dict[str, float] = field(default_factory=dict)   # bytes per rank per iteration crossing each level
    notes: list[str] = field(default_factory=list)

    def layer_forward(self, layer: int = 0, micro_batch: int = 0) -> float:
        """Forward time of one MoE layer (from its T_pre to the end of its combine)."""
        spans = [s for s in self.timeline if s.kind != "async" and s.stage == "fwd" and s.layer == layer
                 and s.micro_batch == micro_batch]
        return max(s.end for s in spans) - min(s.start for s in spans) if spans else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.label, "domain_sizes": list(self.plan.domain_sizes), "kind": self.plan.kind,
                "total": self.total, "forward": self.forward, "phases": dict(self.phases),
                "traffic": dict(self.traffic),
                "ops": {k: {"kind": o.kind, "occurrences": o.occurrences, "busy_seconds": o.busy_seconds,
                            "exposed_seconds": o.exposed_seconds, "level_bytes": o.level_bytes,
                            "uplink_bytes": o.uplink_bytes} for k, o in self.ops.items()},
                "group_classes": [{"groups": g.groups, "overrides": [list(p) for p in g.overrides],
                                   "seconds": g.seconds} for g in self.group_classes],
                "notes": list(self.notes)}


# ---- the EP group's collectives ------------------------------------------------------------------------------
def _local(fam: Family, outer: int) -> Family:
    return Family(fam.sizes[outer:], fam.strides[outer:])


def ep_collectives(topology: Topology, workload: Workload, plan: Plan, lay: EPLayout, mode: str = "microbatch"
                   ) -> tuple[list[Collective], list[LayerWork], dict[str, str | None]]:
    """Collectives inside one EP group (levels ``lay.outer``.. of the world), the per-layer work and
    the names ``build_program`` takes (gather, grad_return, shared_sync, replicas, replica_grad);
    ``mode``: the borrowed-copies mode (what the gradient return carries)."""
    w, G, E = workload, plan.ep_size, plan.num_experts
    o = lay.outer
    S_world = world_domain_sizes(lay, plan.domain_sizes)
    rails = _local(rail_family(lay, S_world), o)
    colls: list[Collective] = []
    routing = w.routing_for(G)
    if routing is None and plan.replicas:  # balanced, spelled out so tokens follow the replicas (as hot.py)
        routing = np.full((1, G, E), w.tokens * w.top_k / E)
    layers: list[LayerWork] = []
    if routing is None:
        pair = w.dispatch_bytes * plan.domain_size / G
        colls += [Collective("dispatch", A2A, rails, pair), Collective("combine", A2A, rails, pair)]
        load = float(w.tokens * w.top_k)
        layers = [LayerWork(w.t_pre, load * w.expert_seconds_per_token, "dispatch", "combine")] * w.stage_moe_layers
    else:
        dst = plan.compute_ranks().ravel()
        src = np.repeat(np.arange(G), E)
        works = []
        for i, counts in enumerate(routing):
            c = counts.ravel()
            pair = np.bincount(src * G + dst, weights=c * w.token_bytes, minlength=G * G)
            s, d = np.divmod(np.arange(G * G), G)
            colls += [Collective(f"dispatch{i}", PAIRS, src=s, dst=d, pair_bytes=pair),
                      Collective(f"combine{i}", PAIRS, src=d, dst=s, pair_bytes=pair)]
            load = float(np.bincount(dst, weights=c, minlength=G).max())
            works.append(LayerWork(w.t_pre, load * w.expert_seconds_per_token, f"dispatch{i}", f"combine{i}"))
        layers = ([works[li % len(works)] for li in range(w.stage_moe_layers)] if len(works) == 1
                  else works[:w.stage_moe_layers])
    names: dict[str, str | None] = dict.fromkeys(("gather", "grad_return", "shared_sync", "replicas", "replica_grad"))
    if plan.kind == "domains" and plan.domain_size > 1:
        S = plan.domain_size
        own = E // G
        dom = _local(domain_family(lay, S_world), o)
        colls.append(Collective("gather", RING, dom, (S - 1) * own * w.expert_wire_bytes, S - 1))
        if w.grad_compression_ratio > 1 or w.backend == "gloo":  # chunks by all_to_all_single in the domain
            colls.append(Collective(Phase.GRAD_RETURN, A2A, dom, own * w.returned_grad_bytes(mode), 1))
        else:                               # reduce_scatter: a ring
            colls.append(Collective(Phase.GRAD_RETURN, RING, dom, (S - 1) * own * w.returned_grad_bytes(mode), S - 1))
        names.update(gather="gather", grad_return=Phase.GRAD_RETURN)
        codec_gather, codec_return = codec_compute(w, S, own, mode)
        layers = [dataclasses.replace(lw, codec_gather=codec_gather, codec_return=codec_return) for lw in layers]
    if names["gather"] is not None and w.shared_sync_bytes:  # refreshed by DomainGather.start(): domains of S > 1
        group = _local(domain_family(lay, lay.extent), o)
        colls.append(Collective(Phase.SHARED_SYNC, RING, group, 2 * (G - 1) / G * w.shared_sync_bytes, 2 * (G - 1)))
        names["shared_sync"] = Phase.SHARED_SYNC
    if plan.replicas:
        colls += replica_collectives(w, plan)
        names.update(replicas=Phase.REPLICA_WEIGHTS, replica_grad=Phase.REPLICA_GRAD_RETURN)
    return colls, layers, names


def replica_collectives(w: Workload, plan: Plan) -> list[Collective]:
    """The replica exchange as runtime/replication.py runs it: one all-to-all per direction, so all
    rows between two ranks are one message (one flow); exact weights out, exact gradients back."""
    G = plan.ep_size
    experts, ranks = (np.array(x, dtype=np.int64) for x in zip(*plan.replicas.pairs, strict=True))
    owners = experts // plan.experts_per_rank
    copies = np.bincount(owners * G + ranks, minlength=G * G)
    s, d = np.divmod(np.arange(G * G), G)
    return [Collective(Phase.REPLICA_WEIGHTS, PAIRS, src=s, dst=d, pair_bytes=copies * w.expert_bytes),
            Collective(Phase.REPLICA_GRAD_RETURN, PAIRS, src=d, dst=s,
                       pair_bytes=copies * w.expert_params * w.grad_bytes)]


def world_collectives(topology: Topology, workload: Workload, plan: Plan, lay: EPLayout,
                      dense_grad_bytes: float | None = None) -> list[tuple[str, Collective]]:
    """(phase, collective) across EP groups, in finalize_model_grads order: the dense gradients over
    the data-parallel group (``dense_grad_bytes`` per rank; None: the workload's main grads, as tier b
    prices them), then the expert gradients over the expert data-parallel replicas (one bucket each:
    Megatron DDP without overlap_grad_reduce reduces a buffer in one call). ``topology``: one
    pipeline stage (Topology.pipeline_stage)."""
    w = workload
    out = []
    n, tp = topology.level_counts, w.tensor_model_parallel_size
    k = topology.world_size // tp
    if dense_grad_bytes is None:
        dense_grad_bytes = w.model_dense_params / (tp * w.pipeline_model_parallel_size) * w.main_grad_bytes
    if dense_grad_bytes > 0 and k > 1:
        fam = Family(n[:-1] + (n[-1] // tp,), (1,) * (len(n) - 1) + (tp,))  # same TP rank: stride TP
        out.append((Phase.DENSE_GRAD_ALLREDUCE,
                    Collective(Phase.DENSE_GRAD_ALLREDUCE, RING, fam, 2 * (k - 1) / k * dense_grad_bytes, 2 * (k - 1))))
    if plan.kind == "domains":
        fam, k, own = replica_family(topology, lay), lay.num_groups, plan.num_experts // plan.ep_size
    else:
        fam, k, own = dc_replica_family(topology), topology.level_counts[0], plan.num_experts // plan.rail_size
    if k > 1:
        grad = own * w.expert_params / w.etp * w.main_grad_bytes * w.stage_moe_layers
        out.append((Phase.EXPERT_GRAD_ALLREDUCE,
                    Collective(Phase.EXPERT_GRAD_ALLREDUCE, RING, fam, 2 * (k - 1) / k * grad, 2 * (k - 1))))
    return out


# ---- EP-group classes ----------------------------------------------------------------------------------------
def group_classes(topology: Topology, lay: EPLayout) -> list[tuple[int, dict[tuple[int, int], tuple[float, float]]]]:
    """(number of EP groups, local overrides at the outer level) per class of identical EP groups."""
    lv = topology.levels[lay.outer]
    e, n = lay.extent[lay.outer], lv.count
    parents = math.prod(topology.level_counts[:lay.outer])
    per_group: dict[int, dict[tuple[int, int], tuple[float, float]]] = defaultdict(dict)
    for ov in lv.overrides:
        if ov.a // e == ov.b // e:
            g = ov.a // e
            vals = (ov.bandwidth_gbps * 1e9 / 8, ov.latency_us * 1e-6)
            per_group[g][(ov.a % e, ov.b % e)] = vals
            per_group[g][(ov.b % e, ov.a % e)] = vals
    classes: dict[tuple, list] = {}
    for g in range(n // e):
        table = per_group.get(g, {})
        sig = tuple(sorted(table.items()))
        if sig not in classes:
            classes[sig] = [0, table]
        classes[sig][0] += parents
    return [(c[0], c[1]) for c in classes.values()]


def _ep_space(topology: Topology, lay: EPLayout, local_over: dict, colls: Sequence[Collective],
              symmetry: bool = True, call_s: float = 0.0) -> Space:
    o = lay.outer
    levels = topology.levels[o:]
    counts = lay.extent[o:]
    overrides = [dict(local_over)] + [_override_dict(lv) for lv in levels[1:]]
    periods = Space.periods_for(colls, counts) if symmetry else counts
    return Space(levels, counts, periods, overrides, call_s)


def _override_dict(lv: Any) -> dict[tuple[int, int], tuple[float, float]]:
    a, b, bw, lat = lv.override_arrays()
    return {(int(x), int(y)): (float(u), float(v)) for x, y, u, v in zip(a, b, bw, lat, strict=True)}


def _build(space: Space, colls: Sequence[Collective]) -> list[FlowSet]:
    sets = [space.flows(c) for c in colls if not c.empty]
    space.finalize()
    return sets


# ---- the simulation -------------------------------------------------------------------------------------------
def resolve_plan(topology: Topology, workload: Workload, plan: Plan | None, ep_size: int | None) -> Plan:
    if plan is not None:
        return plan
    from megatron_hybridep.plan.planner import choose_plan

    return choose_plan(topology, workload, ep_size).best


def simulate(topology: Topology, workload: Workload, plan: Plan | None = None, *, ep_size: int | None = None,
             options: SimOptions | None = None, symmetry: bool = True) -> SimResult:
    """One training iteration, flow by flow (see the module doc). ``symmetry=False`` simulates every
    flow of every rank (no reduction by translation symmetry): for tests and small worlds."""
    options = options or SimOptions()
    plan = resolve_plan(topology, workload, plan, ep_size)
    model = CostModel(topology, workload)
    topology = model.topology  # one pipeline stage
    if options.gather not in ("iteration", "microbatch"):  # the mode tier b prices for this plan
        options = dataclasses.replace(options, gather=model.borrowed_copies(plan)[0])
    lay = check_plan(topology, workload, plan)
    colls, layers, names = ep_collectives(topology, workload, plan, lay, options.gather or "microbatch")
    present = {c.name for c in colls if not c.empty}
    program = build_program(layers, workload.micro_batches, **names, options=options, present=present)
    stats = EngineStats()
    classes: list[GroupClass] = []
    worst: tuple[Trace, list[FlowSet], Space] | None = None
    for n_groups, over in group_classes(topology, lay):
        space = _ep_space(topology, lay, over, colls, symmetry, workload.call_seconds)
        sets = _build(space, colls)
        trace = Engine(sets, space.link_cap).run(program)
        _add_stats(stats, trace.stats)
        classes.append(GroupClass(n_groups, tuple(sorted(k for k in over if k[0] < k[1])), trace.total))
        if worst is None or trace.total > worst[0].total:
            worst = (trace, sets, space)
    assert worst is not None
    trace, sets, space = worst
    spans = list(trace.spans)
    exposed = dict(trace.exposed)
    total = trace.total
    reports_sets = {fs.name: (fs, space) for fs in sets}

    wphases = [] if not options.backward else world_collectives(topology, workload, plan, lay,
                                                                 options.dense_grad_bytes)
    wcolls = [c for _, c in wphases]
    if wcolls:
        counts = topology.level_counts
        wspace = Space(topology.levels, counts, Space.periods_for(wcolls, counts) if symmetry else counts,
                       call_s=workload.call_seconds)
        wsets = _build(wspace, wcolls)
        prog = [Instr(BLOCK, ph, op=c.name, stage="step") for ph, c in wphases if not c.empty]
        wtrace = Engine(wsets, wspace.link_cap).run(prog)
        _add_stats(stats, wtrace.stats)
        for s in wtrace.spans:
            spans.append(Span(s.kind, s.phase, s.name, s.start + total, s.end + total, s.layer, s.micro_batch,
                              s.stage))
        for k, v in wtrace.exposed.items():
            exposed[k] = exposed.get(k, 0.0) + v
        total += wtrace.total
        reports_sets.update({fs.name: (fs, wspace) for fs in wsets})

    spans.sort(key=lambda s: (s.start, s.kind == "async"))
    phases = {p: exposed.get(p, 0.0) for p in PHASES + (REPLICA_PHASES if plan.replicas else ())}
    for k, v in exposed.items():
        if k not in phases:
            phases[k] = v
    forward = sum(s.seconds for s in spans if s.kind != "async" and s.stage == "fwd")
    if options.backward:
        total += _pipeline_and_overlap(model, plan, spans, phases)
    ops, traffic = _reports(spans, reports_sets)
    notes = []
    if workload.routing_counts is not None:
        notes.append("skewed routing: explicit flows per EP-rank pair")
    if len(classes) > 1:
        notes.append(f"{len(classes)} classes of EP groups (per-pair overrides): the slowest sets the pace")
    if plan.kind == "domains" and plan.domain_size > 1 and workload.micro_batches > 1:
        notes.append("borrowed copies: " + (
            f"gathered and their gradients returned in every micro-batch ({workload.micro_batches}x per iteration)"
            if options.gather == "microbatch" else "gathered once per iteration, gradients returned once"))
    if plan.replicas:
        notes.append(f"{len(plan.replicas)} hot-expert replicas: exact weights to each replica before its "
                     "layer's dispatch, gradients back in its backward (replica_weights, replica_grad_return)")
    return SimResult(plan, total, phases, forward, spans, ops, classes, stats, traffic, notes)


def _pipeline_and_overlap(model: CostModel, plan: Plan, spans: Sequence[Span], phases: dict[str, float]) -> float:
    """Tier b's closed forms on the simulated stage (plan/cost.py, plan/pipeline.py): the data-parallel
    reductions hidden by the overlap flags (bucket by bucket, behind the token all-to-alls only where
    those use none of the reductions' links) and the pipeline around the stage; updates ``phases``,
    returns the change of the total. A stage's micro-batch: its compute and token all-to-alls."""
    w, m = model.workload, model.workload.micro_batches
    work = (Phase.PRE_COMPUTE, Phase.EXPERT_COMPUTE, Phase.TOKEN_A2A_FWD, Phase.TOKEN_A2A_BWD)
    f = sum(s.seconds for s in spans if s.kind != "async" and s.stage == "fwd" and s.phase in work) / m
    b = sum(s.seconds for s in spans if s.kind != "async" and s.stage == "bwd" and s.phase in work) / m
    before = sum(phases.get(p, 0.0) for p in (Phase.DENSE_GRAD_ALLREDUCE, Phase.EXPERT_GRAD_ALLREDUCE))
    raw = model.evaluate(plan).raw if before else {}
    cover = (Phase.PRE_COMPUTE, Phase.EXPERT_COMPUTE) if raw.get("dp_shares_a2a_links") else work
    f_hide = sum(s.seconds for s in spans if s.kind != "async" and s.stage == "fwd" and s.phase in cover) / m
    b_hide = sum(s.seconds for s in spans if s.kind != "async" and s.stage == "bwd" and s.phase in cover) / m
    dense, expert = data_parallel_exposed(w, phases.get(Phase.DENSE_GRAD_ALLREDUCE, 0.0),
                                          phases.get(Phase.EXPERT_GRAD_ALLREDUCE, 0.0), f_hide, b_hide,
                                          (int(raw.get("dp_dense_buckets", 1)), int(raw.get("dp_expert_buckets", 1))))
    if before:
        phases[Phase.DENSE_GRAD_ALLREDUCE], phases[Phase.EXPERT_GRAD_ALLREDUCE] = dense, expert
    delta = dense + expert - before
    if w.pipeline_model_parallel_size > 1:
        pipe = schedule_time(w.pipeline_model_parallel_size, w.virtual_pipeline_model_parallel_size, m, f, b,
                             model.sends)
        phases[Phase.PIPELINE_BUBBLE], phases[Phase.PIPELINE_SEND] = pipe.bubble, pipe.send
        delta += pipe.bubble + pipe.send
    return delta


def _add_stats(into: EngineStats, s: EngineStats) -> None:
    for k in ("instructions", "segments", "memo_hits", "events", "fills"):
        setattr(into, k, getattr(into, k) + getattr(s, k))


def _reports(spans: Sequence[Span], sets: dict[str, tuple[FlowSet, Space]]) -> tuple[dict[str, OpReport],
                                                                                     dict[str, float]]:
    busy: dict[str, float] = defaultdict(float)
    exposed: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for s in spans:
        if s.kind == "async":
            busy[s.name] += s.seconds
            count[s.name] += 1
        elif s.kind == "block":
            busy[s.name] += s.seconds
            exposed[s.name] += s.seconds
            count[s.name] += 1
        elif s.kind == "wait":
            exposed[s.name.split("@")[0]] += s.seconds
    ops, traffic = {}, defaultdict(float)
    for name, (fs, space) in sets.items():
        if not count[name]:
            continue
        names = [lv.name for lv in space.levels]
        lb = {n: float(b) for n, b in zip(names, fs.level_bytes, strict=True)}
        ub = {n: float(b) for n, b in zip(names, fs.uplink_bytes if fs.uplink_bytes is not None else
                                          np.zeros(len(names)), strict=True)}
        kind = "a2a" if name.startswith(("dispatch", "combine")) else name
        ops[name] = OpReport(name, kind, count[name], busy[name], exposed[name], lb, ub)
        for n, b in lb.items():
            traffic[n] += b * count[name]
    return ops, dict(traffic)
