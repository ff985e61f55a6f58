"""From Megatron arguments to a Plan: topology (YAML, SLURM or the CPU default), workload (the
model's shape from args) and --hybridep-plan (auto / ep / replicated / a plan file)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

from megatron_hybridep.plan.plan import Plan, PlanError
from megatron_hybridep.plan.planner import PlanningResult, choose_plan, compressible
from megatron_hybridep.plan.topology import Topology
from megatron_hybridep.plan.workload import GRAD_VALUE_BYTES, Workload, auto_early_return
from megatron_hybridep.runtime.logs import warn_once
from megatron_hybridep.runtime.migration import MigrationConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU_LINKS = os.path.join(REPO, "configs", "topologies", "2dc_x_2.yaml")
log = logging.getLogger("hybridep.planning")


@dataclass(frozen=True)
class PlanChoice:
    plan: Plan
    topology: Topology
    result: PlanningResult | None  # None for hand-picked plans

    @property
    def megatron_ep_size(self) -> int:
        return self.plan.megatron_ep_size

    @property
    def dispatcher(self) -> str:
        """What Megatron runs: the replicated plan is Megatron's own EP inside each DC."""
        return "alltoall" if self.plan.kind == "replicated" else "hybridep"


def topology_for(args: argparse.Namespace, world_size: int) -> Topology:
    spec = args.hybridep_topology
    if spec == "slurm":
        from megatron_hybridep.plan.slurm import topology_from_slurm

        if not args.hybridep_dc_map:
            raise PlanError("--hybridep-topology slurm needs --hybridep-dc-map FILE (hostname patterns -> DC); "
                            "fix: see configs/slurm/dc_map.example.yaml")
        topo = topology_from_slurm(args.hybridep_dc_map)
    elif spec:
        topo = Topology.from_yaml(spec)
    else:  # the CPU demo: 2 emulated DCs with the 2dc_x_2 preset's links
        base = Topology.from_yaml(CPU_LINKS)
        counts = (2, world_size // 2) if world_size % 2 == 0 and world_size >= 2 else (1, world_size)
        topo = base.with_counts(counts, source=f"built-in CPU default ({counts[0]} DCs x {counts[1]})")
    if topo.world_size != world_size:
        raise PlanError(f"--hybridep-topology: {topo.describe()} but the job has {world_size} ranks; fix: use a "
                        "topology whose level counts multiply to the world size")
    return topo


def workload_for(args: argparse.Namespace, world_size: int | None = None) -> Workload:
    """The planner's Workload from the parsed flags (plan/presets.py maps flag names: MoE layers from
    --moe-layer-freq, dtypes, distributed optimizer, TP, PP). Micro-batches per iteration need the
    data-parallel size: Megatron's (set by its validation) or, before that, ``world_size`` over
    TP x PP x CP."""
    from megatron_hybridep.plan.presets import workload_from_settings
    from megatron_hybridep.plan.workload import DEFAULT_THROUGHPUT_TFLOPS

    tflops = args.hybridep_throughput_tflops
    if tflops is None:
        import torch

        tflops = DEFAULT_THROUGHPUT_TFLOPS if torch.cuda.is_available() else 0.05
    dp = getattr(args, "data_parallel_size", None) or 0
    if not dp and world_size:
        dp = world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                            * (getattr(args, "context_parallel_size", None) or 1))
    w = workload_from_settings({**vars(args), "hybridep_throughput_tflops": tflops}, "from arguments", dp)
    return w.replace(compression_ratio=weight_ratio(args),
                     grad_compression_ratio=grad_ratio(args),
                     grad_value_bytes=GRAD_VALUE_BYTES[grad_values(args)],
                     max_compressed_domain=getattr(args, "hybridep_max_compressed_domain", 0),
                     borrowed_copies=getattr(args, "hybridep_borrowed_copies", None) or "auto",
                     async_grad_return=bool(getattr(args, "hybridep_async_grad_return", False)),
                     early_return_rest_ratio=early_return(args),
                     backend="gloo" if getattr(args, "distributed_backend", "nccl") == "gloo" else "nccl",
                     collective_overhead_ms=getattr(args, "hybridep_collective_overhead_ms", 0.0))


def _capped(ratio: float, cap: float) -> float:
    return min(ratio, cap) if cap and cap >= 1.0 else ratio


def weight_ratio(args: argparse.Namespace) -> float:
    """The expert-weight compression the job runs: the requested ratio, capped by
    --hybridep-max-compression-ratio (0: no cap)."""
    return _capped(args.hybridep_compression_ratio, getattr(args, "hybridep_max_compression_ratio", 0.0))


def grad_ratio(args: argparse.Namespace) -> float:
    """The returned-gradient compression the job runs: the requested ratio, capped by
    --hybridep-max-grad-compression-ratio (0: no cap)."""
    return _capped(args.hybridep_grad_compression_ratio, getattr(args, "hybridep_max_grad_compression_ratio", 0.0))


def grad_values(args: argparse.Namespace) -> str:
    return getattr(args, "hybridep_grad_compression_values", None) or "bf16"


def early_return(args: argparse.Namespace, held: bool | None = None) -> float:
    """--hybridep-early-grad-return's rest ratio: the value given, or for auto (None) the split where it
    applies (compressed returns within the quality cap, copies held: ``held``, or not forced per
    micro-batch; with M = 1 the runtime and the cost model split nothing), else 0."""
    given = getattr(args, "hybridep_early_grad_return", None)
    if given is not None:
        return given
    if held is None:
        held = getattr(args, "hybridep_borrowed_copies", "auto") != "microbatch"
    return auto_early_return(grad_ratio(args)) if held else 0.0


def ratio_notice(args: argparse.Namespace) -> str | None:
    """Lines for the log: when the cap lowered the requested ratio, and when weights and gradients
    are both compressed (the combination the 8-seed studies found costs more than either alone)."""
    lines = []
    if weight_ratio(args) < args.hybridep_compression_ratio:
        lines.append(f"[pretrain_moe] --hybridep-compression-ratio {args.hybridep_compression_ratio:g} capped at "
                     f"{weight_ratio(args):g} (--hybridep-max-compression-ratio): above it the shipped expert "
                     "weights cost model quality (docs/compression.md); raise the cap to accept that")
    if grad_ratio(args) < args.hybridep_grad_compression_ratio:
        lines.append(f"[pretrain_moe] --hybridep-grad-compression-ratio {args.hybridep_grad_compression_ratio:g} "
                     f"capped at {grad_ratio(args):g} (--hybridep-max-grad-compression-ratio): above it the returned "
                     "gradients cost model quality (docs/compression.md); raise the cap to accept that")
    if weight_ratio(args) > 1 and grad_ratio(args) > 1:
        lines.append("[pretrain_moe] note: weights and returned gradients both compressed where the plan compresses "
                     "(the start-up log says whether it does); on real text over "
                     "1,200 steps, weights 10x + gradients 4x (bf16 values) cost +0.21% in loss at equal steps over "
                     "8 seeds, up to +1.4% on one seed, and ~1% more steps to the same loss (10x + 10x: +0.97%, "
                     "up to +2.2%, ~5% more steps; docs/compression.md)")
    return "\n".join(lines) or None


def migration_from_args(args: argparse.Namespace) -> MigrationConfig:
    return MigrationConfig(compression_ratio=weight_ratio(args),
                           grad_compression_ratio=grad_ratio(args),
                           grad_values=grad_values(args),
                           grad_warmup_steps=getattr(args, "hybridep_grad_compression_warmup", 0),
                           use_shared=not args.hybridep_no_shared_expert,
                           shared_refresh_every=args.hybridep_shared_refresh_interval,
                           incremental=getattr(args, "hybridep_residual_base", "copy") == "copy",
                           hold_copies=getattr(args, "hybridep_borrowed_copies", "auto") != "microbatch",
                           async_return=bool(getattr(args, "hybridep_async_grad_return", False)),
                           early_return_rest_ratio=early_return(args),
                           check_finite=bool(getattr(args, "check_for_nan_in_loss_and_grad", False)))


def setup_from_args(args: argparse.Namespace, world_size: int, ep_group: Any = None) -> PlanChoice:
    """Choose the plan and build its runtime (after model-parallel init, before the model).
    Raises when the plan is Megatron's replicated one: that needs a different EP size, which
    must be set before model-parallel initialisation."""

    choice = choose(args, world_size)
    if choice.dispatcher != "hybridep":
        raise PlanError(f"hybridep: the plan is '{choice.plan.label}', Megatron's EP inside each DC; fix: rerun "
                        f"with --moe-token-dispatcher-type alltoall --expert-model-parallel-size "
                        f"{choice.megatron_ep_size}, or pick another plan with --hybridep-plan")
    build_runtime(args, choice, ep_group)
    return choice


def build_runtime(args: argparse.Namespace, choice: PlanChoice, ep_group: Any = None) -> Any:
    """The runtime of a hybridep job (both loops). With --hybridep-replan-interval it holds every
    HybridEP candidate of the EP group (groups prebuilt, so a switch starts no group creation) and owns
    the scheduler (``runtime.scheduler``), which the loop steps after each optimizer step."""
    from megatron_hybridep.megatron.register import setup

    if getattr(args, "hybridep_replan_replicas", 0) and getattr(args, "moe_expert_capacity_factor", None) is not None:
        # checked here, before any collective: a replica plan adopted mid-run would fail in every MoE layer
        raise PlanError("--hybridep-replan-replicas: hot-expert replicas change which tokens "
                        "--moe-expert-capacity-factor drops; fix: drop one of the two flags")
    plans = [choice.plan]
    if args.hybridep_replan_interval and choice.result is not None:
        plans = [c.plan for c in choice.result.candidates if c.plan.kind == "domains"]
    from megatron_hybridep.plan.cost import resolve_borrowed_copies

    # auto: hold copies for the iteration when they fit the topology's memory, else per micro-batch
    mode, why = resolve_borrowed_copies(choice.topology, workload_for(args), choice.plan)
    args.hybridep_borrowed_copies_reason = why
    migration = dataclasses.replace(migration_from_args(args), hold_copies=mode == "iteration",
                                    early_return_rest_ratio=early_return(args, held=mode == "iteration"))
    runtime = setup(plans, ep_group=ep_group, num_experts=args.num_experts, migration=migration,
                    active=plans.index(choice.plan))
    if args.hybridep_replan_interval:
        from megatron_hybridep.runtime.scheduler import PlanScheduler, SchedulerConfig

        runtime.scheduler = PlanScheduler(runtime, choice.topology, workload_for(args),
                                          SchedulerConfig(interval=args.hybridep_replan_interval,
                                                          horizon=args.hybridep_replan_horizon,
                                                          replica_budget=args.hybridep_replan_replicas))
    return runtime


def _runnable(result: PlanningResult, ep: int) -> PlanningResult:
    """The replicated plan needs Megatron's EP size changed before model-parallel initialisation,
    which a started job cannot do: run the best plan for this EP size and say how to get the other."""
    runnable = next(c for c in result.candidates if c.plan.kind != "replicated")
    fastest = result.chosen
    warn_once(log, "hybridep: '%s' (Megatron EP inside each DC) is predicted faster than any plan for EP size %d "
                "(%.4g s vs %.4g s per iteration); running '%s'. To run it: --moe-token-dispatcher-type alltoall "
                "--expert-model-parallel-size %d", fastest.plan.label, ep, fastest.cost.total, runnable.cost.total,
                runnable.plan.label, fastest.plan.megatron_ep_size)
    return dataclasses.replace(result, best=runnable.plan)


def _say_if_capped(work: Workload, result: PlanningResult, topo: Topology, ep: int) -> None:
    """Log it when --hybridep-max-compressed-domain kept out a faster, larger compressed domain."""
    if not (work.compresses and work.max_compressed_domain):
        return
    free = choose_plan(topo, work.replace(max_compressed_domain=0), ep)
    if (free.compressed and free.best.domain_size > work.max_compressed_domain
            and free.chosen.cost.total < result.chosen.cost.total):
        warn_once(log, "hybridep: compressed domains capped at %d ranks (--hybridep-max-compressed-domain): running "
                  "'%s'%s (%.4g s per iteration predicted); '%s' compressed is predicted faster (%.4g s) but computes "
                  "%.0f%% of the routed tokens on compressed copies, a larger loss cost (docs/compression.md); 0 "
                  "lifts the cap", work.max_compressed_domain, result.best.label,
                  "" if result.compressed or result.best.domain_size == 1 else " exact", result.chosen.cost.total,
                  free.best.label, free.chosen.cost.total, 100 * free.best.borrowed_share)


def _run_exact(args: argparse.Namespace, result: PlanningResult) -> None:
    """Compression was asked for, but the planner priced the chosen domain exact at least as fast (the
    codec's compute on CPU ranks, or a domain over --hybridep-max-compressed-domain): run it exact,
    and say why in the start-up log (train/reporting.py)."""
    lossy = [c for c in result.candidates if c.compressed]
    rival = (f"; the best compressed plan, {lossy[0].plan.label}, {lossy[0].cost.total:.4g} s" if lossy
             else "; no domain is priced faster compressed")
    args.hybridep_exact_reason = (f"compression asked for, but '{result.best.label}' runs exact: priced "
                                  f"{result.chosen.cost.total:.4g} s per iteration{rival} (the codec's compute and "
                                  "quality must pay; a plan file, --hybridep-plan, keeps compression)")
    args.hybridep_compression_ratio = args.hybridep_grad_compression_ratio = 1.0


def choose(args: argparse.Namespace, world_size: int) -> PlanChoice:
    """The plan this job runs (identical on every rank: pure function of args and topology)."""
    topo = topology_for(args, world_size)
    ep = args.expert_model_parallel_size
    layout = topo.ep_layout(ep)
    mode = args.hybridep_plan
    if mode == "ep":
        return PlanChoice(Plan.grid(layout.counts, (1,) * len(layout.counts), args.num_experts, layout.names),
                          topo, None)
    if mode == "replicated":
        if len(layout.counts) < 2 or not layout.spans_dcs:
            raise PlanError(f"--hybridep-plan replicated: the EP group ({' x '.join(map(str, layout.counts))} "
                            f"{'/'.join(layout.names)}) does not span two or more DCs, so there is nothing to "
                            "replicate across; fix: use --hybridep-plan ep or auto, or a larger "
                            "--expert-model-parallel-size that spans DCs")
        return PlanChoice(Plan.replicated(layout.counts, args.num_experts, layout.names), topo, None)
    if mode == "auto":
        work = workload_for(args, world_size)
        result = choose_plan(topo, work, ep)
        _say_if_capped(work, result, topo, ep)
        if result.best.kind == "replicated":
            result = _runnable(result, ep)
        if compressible(work, result.best) and not result.compressed:
            _run_exact(args, result)
        return PlanChoice(result.best, topo, result)
    if not os.path.exists(mode):
        raise PlanError(f"--hybridep-plan {mode!r}: not auto, ep, replicated or an existing plan file; fix: "
                        "pass one of those (plan files come from 'hybridep plan --out plan.json')")
    plan = Plan.load(mode)
    plan.validate(ep if plan.kind != "replicated" else plan.megatron_ep_size, args.num_experts)
    cap = getattr(args, "hybridep_max_compressed_domain", 0)
    if cap and plan.kind == "domains" and plan.domain_size > cap and workload_for(args, world_size).compresses:
        raise PlanError(f"--hybridep-plan {mode}: domains of {plan.domain_size} ranks with compressed migration, "
                        f"over --hybridep-max-compressed-domain {cap}; fix: a plan with smaller domains "
                        "(hybridep plan --max-compressed-domain), or raise or drop the cap")
    return PlanChoice(plan, topo, None)


LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--expert-model-parallel-size")


def choose_layout(args: argparse.Namespace, world_size: int, fixed: list[str]) -> tuple[list[str], str]:
    """--hybridep-layout auto: (the flags of the layout planner's choice, or [] when the command line
    fixes one of ``LAYOUT_FLAGS``; a report to print). The workload is the job's at TP 1 x PP 1 with
    the same global batch (plan/layout.py)."""
    from megatron_hybridep.plan.cost import seconds_human
    from megatron_hybridep.plan.layout import PREFER_MEGATRON_WITHIN, format_layouts, is_hybridep, plan_layouts

    topology = topology_for(args, world_size)
    w = workload_for(args, world_size)
    split = w.tensor_model_parallel_size * w.pipeline_model_parallel_size
    w = w.replace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                  micro_batches=max(1, w.micro_batches // split))
    hybrid = getattr(args, "moe_token_dispatcher_type", "hybridep") == "hybridep"
    # Megatron's own dispatcher runs no hybridep plan: the best layout without one
    results = plan_layouts(topology, w, prefer_megatron_within=PREFER_MEGATRON_WITHIN if hybrid else float("inf"))
    runnable = [r for r in results if r.fits]
    if not runnable:
        raise PlanError("--hybridep-layout auto: no layout fits this job; fix: drop --hybridep-layout or "
                        "change the model or topology (hybridep plan --layout auto shows why)")
    choice = runnable[0]
    lines = [f"[layout] {topology.describe()}, same global batch for every layout (hybridep plan --layout auto)",
             format_layouts(results, top=5)]
    flags = choice.layout.flags().split()
    plan = choice.best.plan
    if fixed:
        lines.append(f"[layout] {', '.join(fixed)} fixed on the command line: keeping your layout; the planner's "
                     f"choice would be {' '.join(flags)}")
        return [], "\n".join(lines)
    if not is_hybridep(plan) and hybrid:
        # The stage's own planner (--hybridep-plan auto) has no near-tie margin and could pick hybridep inside it.
        if getattr(args, "hybridep_plan", "auto") == "auto":
            flags += ["--hybridep-plan", "ep"]
        else:
            lines.append(f"[layout] --hybridep-plan {args.hybridep_plan} kept; the layout was priced with plan "
                         f"{plan.label}")
    lines.append(f"[layout] running {choice.layout.label} ({' '.join(flags)}), plan {plan.label}, predicted "
                 f"{seconds_human(choice.step)} per iteration")
    return flags, "\n".join(lines)
