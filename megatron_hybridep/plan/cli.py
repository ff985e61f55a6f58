"""`hybridep plan`: cost every feasible plan for a topology and a model, print them, mark the choice."""

from __future__ import annotations

import argparse
import json
import sys

from megatron_hybridep.plan.cost import bytes_human, seconds_human
from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.phases import Phase
from megatron_hybridep.plan.planner import (
    COST_MODELS,
    Candidate,
    PlanningResult,
    choose_plan,
    choose_plan_all_ep_sizes,
    compressible,
)
from megatron_hybridep.plan.topology import Topology
from megatron_hybridep.plan.workload import QUALITY_GRAD_RATIO, QUALITY_WEIGHT_RATIO, Workload, auto_early_return
from megatron_hybridep.plan.workload_args import add_workload_arguments, with_skew, workload_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Pick expert domains (which ranks all-gather each other's experts) and rails (which "
                          "exchange tokens) for an EP group: prints every candidate plan with its predicted "
                          "time per iteration and marks the choice.")
    parser.epilog = ("example: hybridep plan --topology configs/topologies/2dc_x_8.yaml "
                     "--model configs/models/paper-l.yaml --compression-ratio 50 --out plan.json")
    where = parser.add_argument_group("where the ranks are")
    where.add_argument("--topology", metavar="T.yaml",
                       help="topology YAML (configs/topologies/); with --slurm it supplies the link speeds")
    where.add_argument("--slurm", metavar="DCMAP",
                       help="build the topology from this SLURM allocation: DCMAP maps host patterns to DCs "
                            "(YAML with datacenters/levels, or text lines 'PATTERN DC')")
    add_workload_arguments(parser, parallelism=True)
    how = parser.add_argument_group("search and output")
    how.add_argument("--ep-size", default=None, metavar="G|all",
                     help="EP group size (default: the largest that fits the levels and the experts); "
                          "'all' plans every feasible size")
    how.add_argument("--cost", choices=COST_MODELS, default="ours",
                     help="ours (default): forward+backward, alpha-beta, contention, memory; "
                          "paper: the paper's stream model exactly (forward only)")
    how.add_argument("--no-replicated", action="store_true", help="leave out the replicated-experts plan")
    how.add_argument("--memory-limit-gb", type=float, metavar="GB",
                     help="refuse plans whose memory per rank (weights, held copies, gradients, optimizer "
                          "state) exceeds this (default: the topology's memory_gb_per_gpu)")
    how.add_argument("--no-memory-check", action="store_true",
                     help="cost plans that do not fit the memory too (marked '-') instead of refusing them")
    how.add_argument("--replica-budget", type=int, metavar="N",
                     help="hot-expert replicas a rank may hold per MoE layer, considered under skewed routing "
                          "(default: the experts a rank owns; 0: none)")
    how.add_argument("--top", type=int, metavar="N", help="print only the N cheapest candidates per EP size")
    how.add_argument("--json", action="store_true", help="print the full result as JSON instead of tables")
    how.add_argument("--explain", action="store_true",
                     help="say why the chosen plan wins: phase by phase against plain EP and the runner-up")
    how.add_argument("--out", metavar="plan.json", help="write the chosen plan (Plan JSON) here")
    how.add_argument("--layout", choices=("auto",),
                     help="auto: also choose the Megatron layout (TP, PP, EP, DP) for the same global batch "
                          "(--tokens-per-rank and --micro-batches describe TP 1 x PP 1) and print one row per "
                          "layout with its best plan, against the best layout without hybridep (plan/layout.py); "
                          "with --compression-ratio / --grad-compression-ratio its HybridEP plans are priced "
                          "compressed and exact, and the faster runs (the choice may then compress: a cost in "
                          "model quality)")


def _topology(args: argparse.Namespace) -> Topology:
    if args.slurm:
        from megatron_hybridep.plan.slurm import topology_from_slurm

        return topology_from_slurm(args.slurm, args.topology)
    if not args.topology:
        raise PlanError("--topology: required (or --slurm DCMAP); fix: e.g. --topology "
                        "configs/topologies/2dc_x_8.yaml")
    return Topology.from_yaml(args.topology)


def _plan_workload(args: argparse.Namespace) -> Workload:
    """The flags' Workload, with pretrain_moe.py's default early gradient return (auto; the split applies
    only to compressed returns held for an iteration of M > 1, Workload.splits_grad_return)."""
    w = workload_from_args(args)
    auto = auto_early_return(w.grad_compression_ratio)
    return w.replace(early_return_rest_ratio=auto) if args.early_grad_return is None else w


def _workload(args: argparse.Namespace, ep_size: int | None, topology: Topology) -> Workload:
    w = _plan_workload(args)
    return with_skew(w, ep_size or topology.default_ep_size(w.num_experts), args.skew) if args.skew is not None else w


def _parse_ep(value: str | None) -> int | str | None:
    if value is None or value == "all":
        return value
    try:
        return int(value)
    except ValueError:
        raise PlanError(f"--ep-size: expected an integer or 'all', got {value!r}") from None


def run_layouts(args: argparse.Namespace) -> int:
    """--layout auto: a thin wrapper around plan/layout.py's plan_layouts."""
    from megatron_hybridep.plan.layout import format_layouts, plan_layouts

    fixed = [f for f, v in (("--pipeline-model-parallel-size", args.pipeline_model_parallel_size),
                            ("--tensor-model-parallel-size", args.tensor_model_parallel_size),
                            ("--ep-size", args.ep_size), ("--skew", args.skew)) if v is not None]
    if fixed:
        raise PlanError(f"{fixed[0]}: --layout auto chooses the layout itself; fix: drop {fixed[0]} or --layout")
    topology = _topology(args)
    workload = _plan_workload(args)
    limit = args.memory_limit_gb * 1e9 if args.memory_limit_gb is not None else None
    results = plan_layouts(topology, workload, memory_limit_bytes=limit)
    if args.out and results[0].best is not None:
        results[0].best.plan.save(args.out)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=1))
        return 0
    w = workload
    print(f"topology  {topology.name or topology.source}: {topology.describe()}, memory limit "
          + (f"{bytes_human(limit or topology.memory_bytes or 0)} per rank" if (limit or topology.memory_bytes)
             else "none stated"))
    print(f"model     {w.name or 'model'}: {w.layers} layers ({w.num_moe_layers} MoE), {w.num_experts} experts, "
          f"top-{w.top_k}; global batch {topology.world_size * w.tokens * w.micro_batches} tokens "
          f"({w.tokens} tokens/rank x {w.micro_batches} micro-batches at TP 1 x PP 1)")
    print()
    print(format_layouts(results, args.top))
    if args.out:
        print(f"\nwrote {args.out}")
    return 0


def run(args: argparse.Namespace) -> int:
    if getattr(args, "layout", None):
        try:
            return run_layouts(args)
        except PlanError as exc:
            print(f"hybridep plan: error: {exc}", file=sys.stderr)
            return 2
    try:
        ep = _parse_ep(args.ep_size)
        topology = _topology(args)
        if ep == "all" and args.skew is not None:
            raise PlanError("--skew: needs one EP size; fix: pass --ep-size G")
        workload = _workload(args, ep if isinstance(ep, int) else None, topology)
        limit = args.memory_limit_gb * 1e9 if args.memory_limit_gb is not None else None
        kw = dict(cost=args.cost, include_replicated=not args.no_replicated, memory_limit_bytes=limit,
                  replica_budget=args.replica_budget, check_memory=not args.no_memory_check)
        if ep == "all":
            results = choose_plan_all_ep_sizes(topology, workload, **kw)
        else:
            results = [choose_plan(topology, workload, ep, **kw)]  # type: ignore[arg-type]
    except PlanError as exc:
        print(f"hybridep plan: error: {exc}", file=sys.stderr)
        return 2
    best = min(results, key=lambda r: r.chosen.cost.total)
    if args.out:
        best.best.save(args.out)
    if args.json:
        out = [r.to_dict() for r in results]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=1))
        return 0
    print(header(results[0]))
    for r in results:
        print()
        print(table(r, args.top))
    if args.explain:
        print()
        print(explain(best))
    if len(results) > 1:
        print()
        print(f"best over EP sizes: ep_size={best.layout.ep_size}, {best.best.label}, "
              f"{seconds_human(best.chosen.cost.total)} per iteration")
    if args.out:
        print(f"\nwrote {args.out}")
    return 0


# ---- formatting ---------------------------------------------------------------------------------------
def explain(r: PlanningResult) -> str:
    """Why the chosen plan wins: per-phase exposed time against plain EP and the runner-up, the
    phases that decide it, and the traffic and memory that pay for it."""
    chosen = r.chosen
    others = [c for c in r.candidates if c.plan != chosen.plan]
    lines = [f"why {chosen.plan.label} ({seconds_human(chosen.cost.total)} per iteration):"]
    for rival, name in ((r.plain_ep, "plain EP"), (others[0] if others else None, "the runner-up")):
        if rival is None or rival.plan == chosen.plan:
            continue
        diffs = {ph: rival.cost.phases.get(ph, 0.0) - chosen.cost.phases.get(ph, 0.0)
                 for ph in set(rival.cost.phases) | set(chosen.cost.phases)}
        order = sorted(diffs.items(), key=lambda kv: -abs(kv[1]))
        parts = [f"{ph} {'saves' if d > 0 else 'costs'} {seconds_human(abs(d))}" for ph, d in order if abs(d) > 0]
        lines.append(f"  vs {name} {rival.plan.label} ({seconds_human(rival.cost.total)}, "
                     f"{rival.cost.total / max(chosen.cost.total, 1e-12):.2f}x slower): " + "; ".join(parts[:4]))
    w = r.workload
    lines.append(f"  inputs: {bytes_human(w.dispatch_bytes)} of tokens per all-to-all per rank vs "
                 f"{bytes_human(w.expert_wire_bytes)} per shipped expert; T_pre {seconds_human(w.t_pre)} hides "
                 "expert gathers; slowest link " + min((lv for lv in r.topology.levels),
                                                        key=lambda lv: lv.bandwidth_gbps).name)
    if chosen.plan.kind == "domains" and chosen.plan.domain_size > 1:
        lines.append(f"  borrowed copies: {chosen.cost.borrowed_copies} ({chosen.cost.borrowed_reason}); gathered "
                     + ("once per iteration, gradients returned once" if chosen.cost.borrowed_copies == "iteration"
                        else f"and returned in each of the {w.micro_batches} micro-batches"))
    m = chosen.cost.memory
    if m is not None:
        limit = r.topology.memory_bytes
        lines.append(f"  memory per rank: {bytes_human(m.total)}" + (f" of {bytes_human(limit)}" if limit else "")
                     + f": expert weights {bytes_human(m.owned_weights)}, held copies {bytes_human(m.borrowed_weights)}"
                     f", expert grads {bytes_human(m.grads + m.borrowed_grads)}, expert optimizer "
                     f"{bytes_human(m.optimizer_state)}, dense {bytes_human(m.dense_total)} (activations not counted)")
    lines += [f"  note: {n}" for n in chosen.cost.notes if not n.startswith("borrowed copies:")]
    if chosen.plan.replicas:
        from megatron_hybridep.plan.cost import CostModel
        from megatron_hybridep.plan.hot import explain as explain_replicas

        lines.append(f"  hot-expert replicas (budget {chosen.plan.replicas.max_per_rank} per rank; a rank computes "
                     "its own tokens for these experts):")
        lines += ["    " + x for x in explain_replicas(CostModel(r.topology, w), chosen.plan)]
    return "\n".join(lines)



def header(r: PlanningResult) -> str:
    t, w = r.topology, r.workload
    comp = ""
    if w.expert_wire_bytes != w.expert_bytes:
        ratio = w.expert_bytes / w.expert_wire_bytes
        comp = f", shipped as {bytes_human(w.expert_wire_bytes)} ({ratio:.1f}x incl. indices)"
    skew = "skewed (routing counts)" if w.routing_counts is not None else "balanced"
    lines = [
        f"topology  {t.name or t.source}: {t.describe()}"
        + (f" per pipeline stage, {w.pipeline_model_parallel_size} stages" if w.pipeline_model_parallel_size > 1
           else ""),
        f"model     {w.name or 'model'}: {w.num_experts} experts, top-{w.top_k}, {w.num_moe_layers} MoE layers, "
        f"{w.tokens} tokens/rank/micro-batch x {w.micro_batches} micro-batch(es), {skew} routing",
        f"layout    TP {w.tensor_model_parallel_size} x PP {w.pipeline_model_parallel_size}, "
        f"{w.model_dense_params / 1e6:.4g}M dense params, borrowed copies {w.borrowed_copies}, memory limit "
        + (f"{bytes_human(t.memory_bytes)} per rank" if t.memory_bytes else "none stated"),
        f"traffic   D = {bytes_human(w.dispatch_bytes)} per all-to-all per rank; expert "
        f"{bytes_human(w.expert_bytes)}{comp}; T_pre = {seconds_human(w.t_pre)} per MoE layer",
        *([f"pipeline  {_pipeline_line(w)}"] if w.pipeline_model_parallel_size > 1 else []),
        "cost      " + ("ours: forward+backward, alpha-beta links, uplink contention; exposed time per iteration"
                        if r.cost_model == "ours" else "paper: the stream model (forward only); time per iteration"),
    ]
    if w.compresses:
        cap = (f"domains capped at {w.max_compressed_domain} ranks (--max-compressed-domain)"
               if w.max_compressed_domain else "no cap on domain size (--max-compressed-domain S sets one)")
        share = r.best.borrowed_share if r.compressed else 0.0
        lines.append("quality   compressed migration: " + (
            f"{r.best.label} computes {share:.0%} of the routed tokens on compressed copies" if share
            else f"{r.best.label} uses none") + f"; {cap}; the loss cost grows with that share (docs/compression.md)"
            + ("; 'exact' plans are priced at least as fast without the codec and run without it"
               if any(_exact(r, c) for c in r.candidates) else ""))
    if w.compression_ratio > QUALITY_WEIGHT_RATIO:
        lines.append(f"note      expert weights at {w.compression_ratio:g}x cost model quality above "
                     f"{QUALITY_WEIGHT_RATIO:g}x (docs/compression.md); pretrain_moe.py caps them there unless "
                     "--hybridep-max-compression-ratio is raised")
    if w.grad_compression_ratio > QUALITY_GRAD_RATIO:
        lines.append(f"note      returned gradients at {w.grad_compression_ratio:g}x cost model quality above "
                     f"{QUALITY_GRAD_RATIO:g}x (docs/compression.md); pretrain_moe.py caps them there unless "
                     "--hybridep-max-grad-compression-ratio is raised")
    return "\n".join(lines)


def _pipeline_line(w: Workload) -> str:
    v = w.virtual_pipeline_model_parallel_size
    schedule = f"interleaved ({v} chunks per rank, sends overlapped)" if v > 1 else "1F1B (blocking sends)"
    dp = [f for f, on in (("overlap_grad_reduce", w.overlap_grad_reduce),
                          ("overlap_param_gather", w.overlap_param_gather)) if on]
    return (f"{w.pipeline_model_parallel_size} stages, {schedule}; {bytes_human(w.pipeline_send_bytes)} of "
            f"activations per rank per send; the table prices one stage's work plus the pipeline; "
            f"data-parallel reductions {'overlapped: ' + ', '.join(dp) if dp else 'blocking'}")


def _exact(r: PlanningResult, c: Candidate) -> bool:
    """A HybridEP domain that runs without the codec although compression was asked for."""
    return compressible(r.workload, c.plan) and not c.compressed


def _row(r: PlanningResult, c: Candidate, wan: str) -> list[str]:
    ph, P = c.cost.phases, Phase

    def sum_of(*phases: Phase) -> float:
        return sum(ph.get(x, 0) for x in phases)

    mem = c.cost.memory.total if c.cost.memory else 0.0
    lv = next((x for x in c.cost.levels if x.name == wan), None)
    mark = "*" if c.plan == r.best else ("-" if not c.fits_memory else "")
    copies = c.cost.borrowed_copies if c.plan.kind == "domains" and c.plan.domain_size > 1 else "-"
    label = c.plan.label + (" exact" if _exact(r, c) else "")
    return [mark, label, f"{c.plan.domain_size} x {c.plan.rail_size}", copies, seconds_human(c.cost.total),
            f"{r.speedup(c):.2f}x", seconds_human(sum_of(P.PRE_COMPUTE, P.EXPERT_COMPUTE)),
            seconds_human(sum_of(P.TOKEN_A2A_FWD, P.TOKEN_A2A_BWD)),
            seconds_human(sum_of(P.EXPERT_ALLGATHER, P.SHARED_SYNC, P.REPLICA_WEIGHTS)),
            seconds_human(sum_of(P.GRAD_RETURN, P.REPLICA_GRAD_RETURN)),
            seconds_human(sum_of(P.EXPERT_GRAD_ALLREDUCE)), seconds_human(sum_of(P.DENSE_GRAD_ALLREDUCE))] + (
            [seconds_human(sum_of(P.PIPELINE_BUBBLE)), seconds_human(sum_of(P.PIPELINE_SEND))] if _piped(r) else []) + [
            bytes_human(lv.uplink_bytes) if lv and r.cost_model == "ours" else "-",
            bytes_human(mem)]


def _piped(r: PlanningResult) -> bool:
    return r.workload.pipeline_model_parallel_size > 1 and r.cost_model == "ours"


def table(r: PlanningResult, top: int | None = None) -> str:
    lay = r.layout
    wan = r.topology.levels[0].name
    heads = ["", "plan", "domain x rail", "copies", "total", "vs EP", "compute", "token a2a", "gather*", "grad ret*",
             "allreduce*", "dense ar*"] + (["bubble", "pp send*"] if _piped(r) else []) + [f"{wan} uplink", "memory"]
    cands = r.candidates[:top] if top else r.candidates
    rows = [heads] + [_row(r, c, wan) for c in cands]
    widths = [max(len(row[i]) for row in rows) for i in range(len(heads))]
    out = [f"EP group: {lay.ep_size} ranks = " + " x ".join(f"{n} {c}" for n, c in zip(lay.counts, lay.names,
                                                                                       strict=True))
           + f" ({lay.num_groups} EP group(s) in the world); {len(r.candidates)} candidates"]
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])] + [x.rjust(widths[j + 2])
                                                                      for j, x in enumerate(row[2:])]
        out.append("  ".join(cells).rstrip())
        if i == 0:
            out.append("-" * len(out[-1]))
    if top and len(r.candidates) > top:
        out.append(f"... {len(r.candidates) - top} more (drop --top to see all)")
    chosen = r.chosen
    p = chosen.plan
    if p.kind == "replicated":
        groups = (f"EP inside each {wan} ({len(p.rails)} rails of {p.rail_size}, token all-to-all), experts "
                  f"replicated in every {wan} (gradient all-reduce)")
    else:
        groups = (f"{len(p.domains)} domain(s) of {p.domain_size} (expert all-gather), {len(p.rails)} rail(s) "
                  f"of {p.rail_size} (token all-to-all)")
    out.append(f"* chosen: {p.label}: {groups}; {r.speedup(chosen):.2f}x vs plain EP")
    out.append("  exposed times per iteration; '*' columns are the part not hidden behind compute; "
               f"{wan} uplink = bytes through the busiest {wan} uplink per iteration;\n"
               "  copies = when borrowed experts are gathered and their gradients returned (iteration: once, "
               "microbatch: every micro-batch); memory = per rank; '-' = does not fit it")
    paper = ", ".join(f"{lv.name}: G={lv.G} p*={lv.p_star:.2f} -> S={lv.s} [{lv.case}]" for lv in r.paper.levels)
    out.append(f"paper model (tier a): {paper}")
    return "\n".join(out)
