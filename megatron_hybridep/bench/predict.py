"""Model side of `hybridep bench`: the benchmarked model (a plan ModelSpec), the testbed as a plan Topology, the
Workload of each point (fed with compute times measured on the unshaped testbed), the planner's
choice and the cost model's predicted step time per phase. Pure Python + plan/: no torch.

How a prediction is made (per system, plan and point):

    predicted = measured unshaped step  +  network(shaped rate) - network(unshaped rate)

- "measured unshaped step": the same system and plan on the same testbed with the WAN rate removed
  (calibration phase): compute, framework overhead and the CPU cost of communication. T_pre and the
  expert speed measured there are also fed to the Workload (t_pre_ms, throughput_tflops).
- "network(rate)": the exposed network phases of the cost model the planner uses (plan/cost.py,
  tier b: the runtime's schedule; token all-to-alls, gathers hidden behind T_pre where they fit,
  blocking gradient return, shared-expert refresh, expert- and dense-data-parallel all-reduces,
  overlapped under overlap_grad_reduce; pipeline sends for a layout with PP). Without the model's
  dense parameter count the dense all-reduce is priced as a blocking ring over every rank. Links
  run at the TCP goodput of the rate (selfcheck.TCP_GOODPUT_FRACTION).
- Calibration, stated as such: the shaped token all-to-alls are divided by the efficiency of a
  bare gloo all-to-all of EP's size on the shaped WAN (the bench's probe, per point; bench/probes.py:
  a long one's share of the rate, a short one's wire time over what shaping added to it). gloo
  exchanges both directions of a pair on one TCP connection, which gets less than the one-way
  goodput (selfcheck's two-way row). The borrowed experts' gradient return is such an all-to-all
  on gloo: when it lasts at least STEADY_S it is divided by the steady-state share (the probes of
  at least STEADY_S, pooled). ``uncalibrated_total`` is the same prediction without either.
- The router's skew (``routing_counts``, Session.routing): the tokens each rank routed to each expert per
  micro-batch in EP's unshaped run, per MoE layer. With them the cost model times each layer's token
  all-to-all by its busiest link (plan/network.py ``flows``) instead of by the balanced share: for every
  plan whose EP group is the world in one stage (ep, hybridep, hybridep-compressed, auto's PP 1 finalists).
- Pipeline sends on shared cores (a layout with PP, 1F1B, ``shared_cores`` given): the testbed's ranks
  share its cores, so a stage blocked on a send frees them for the other stages. The pipeline's
  term is then two replays of the schedule on shared cores (plan/pipeline.one_f_one_b_shared), shaped
  and unshaped sends, with the stage times scaled so that the free-send replay lasts the measured
  unshaped step (all of it counted as stage compute). The cost model's own stage compute (T_pre and
  the expert speed) is several times short of a CPU rank's step, and a wait only hides behind
  compute there is; and only where the ranks kept the cores busy: the unshaped step's CPU seconds per
  rank (``rank_cpu_s``; the bench scales them so that what its unpipelined systems' ranks got reads as
  saturated, Session.cpu_share) give the share of its compute a rank uses a core (:func:`pipeline_duty`). A
  stage of several EP groups (EP 1: data-parallel replicas, nothing couples them until the gradient
  reduction) is replayed as that many pipelines sharing the cores and the boundary links, started
  GROUP_PHASE / k of a micro-batch apart: in step they would wait together, measured they hide small
  sends almost entirely and large ones in part (docs/results.md, "Expert gathers behind their measured
  lead"). A blocked rank does not free all of its share: it keeps WAIT_HOLD of a computing rank's
  claim (measured, the waits cost CPU: one stage per DC on 4 DCs x 2 at 50 Mbit/s, 1024 tokens, a rank's
  CPU seconds per step rose from 0.74 to 1.05 s under shaping, before the kernel's own network work;
  docs/results.md, "One slow trial, and waiting ranks keep part of the cores").
- Prefetched expert gathers behind what the unshaped step ran (``gather_lead``, from its calibration):
  the cost model hides a gather behind its own T_pre (and all-to-alls on other links), which on CPU ranks
  is a few percent of what runs between a gather's launch and its use. The ranks time that (the gather's
  issue-to-use time less its wait, the first MoE layer's apart: it launches after the optimizer step);
  a gather of the shaped WAN's length then waits for what exceeds it. All-to-alls on the gather's links
  in that window share them, so their own shaped time is priced apart and adds no cover.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron_hybridep.plan.cost import CostModel
from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.layout import Layout, LayoutResult
from megatron_hybridep.plan.model import ModelSpec
from megatron_hybridep.plan.network import Family
from megatron_hybridep.plan.phases import Phase
from megatron_hybridep.plan.pipeline import Sends, one_f_one_b_shared
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.planner import PlanningResult, choose_plan
from megatron_hybridep.plan.topology import Level, Topology
from megatron_hybridep.plan.workload import Workload

STEADY_S = 0.05  # all-to-alls at least this long at the rate see steady-state TCP (one pooled efficiency)
# a stage's independent pipelines (EP 1 stages) replayed out of step: k groups start 0.25 / k of a micro-batch's
# compute apart (fitted on the recorded EP 1 rows; 0.5 hides too much of large sends: docs/results.md)
GROUP_PHASE = 0.25
# a rank blocked on a pipeline transfer keeps a quarter of a computing rank's claim on the cores (its gloo
# I/O thread, the kernel's TCP and shaping work, wake-ups): fitted on the 294 calibrate / measure pairs of the
# pipeline rows recorded before 2026-12-02 (within 10%: 239 with 0, 252 with 0.25, 244 with 0.5; docs/results.md)
WAIT_HOLD = 0.25
FP32 = 4  # bytes per element: the CPU runtime trains in fp32 (activations, weights, gradients)
# the network phases a prediction reports (plan/phases.py): token all-to-alls both ways as one
PHASES = (Phase.TOKEN_A2A, Phase.EXPERT_ALLGATHER, Phase.GRAD_RETURN, Phase.SHARED_SYNC, Phase.EXPERT_GRAD_ALLREDUCE,
          Phase.DENSE_GRAD_ALLREDUCE, Phase.REPLICA_WEIGHTS, Phase.REPLICA_GRAD_RETURN, Phase.PIPELINE_SEND)
# the runtime's Stats phases the bench worker reports per step (seconds and inter-DC bytes)
MEASURED = (Phase.TOKEN_DISPATCH, Phase.TOKEN_COMBINE, Phase.EXPERT_ALLGATHER, Phase.GRAD_RETURN)


# The built-in bench model (every layer MoE, GELU experts, fp32 on CPU).
BUILTIN = ModelSpec(name="bench-cpu", num_layers=2, hidden_size=64, ffn_hidden_size=64, num_attention_heads=4,
                    num_experts=8, top_k=2, vocab_size=256)


def load_model(path: str) -> ModelSpec:
    """A configs/models/*.yaml the bench's GPT can build: every layer MoE, GELU experts, no shared
    experts, heads and vocabulary stated (its run quantities are checked, then the bench measures its own)."""
    w = Workload.from_yaml(path)
    problems = []
    if w.layers != w.num_moe_layers:
        problems.append(f"num_layers ({w.num_layers}) must equal num_moe_layers ({w.num_moe_layers}): "
                        "the bench's GPT has an MoE block in every layer")
    if w.gated_mlp:
        problems.append("gated_mlp must be false: the bench's experts are GELU MLPs")
    if w.shared_experts:
        problems.append("shared_experts must be 0")
    for fld in ("num_attention_heads", "vocab_size"):
        if not getattr(w, fld):
            problems.append(f"{fld} must be stated (the GPT is built with it)")
    if problems:
        raise PlanError(f"{path}: " + "; ".join(problems) + "; fix: write a bench model YAML without them "
                        "(see configs/models/bench-moe.yaml)")
    return w.model.replace(name=w.name or path)


def check_model(spec: ModelSpec, world: int) -> None:
    """The bench's own limits: experts split evenly over every rank, whole attention heads."""
    if spec.num_experts % world:
        raise PlanError(f"model.num_experts: {spec.num_experts} experts cannot be split over {world} ranks; "
                        f"fix: use a multiple of {world} or change --dcs/--ranks-per-dc")
    if spec.hidden_size % spec.num_attention_heads:
        raise PlanError(f"model.hidden_size: {spec.hidden_size} is not divisible by "
                        f"{spec.num_attention_heads} attention heads; fix: use a multiple of it")


def token_traffic_bytes(spec: ModelSpec, tokens: int, micro_batches: int = 1) -> float:
    """Token bytes one rank dispatches per iteration under EP: 4 all-to-alls (dispatch, combine,
    and both again in the backward) per MoE layer and micro-batch, one row per selected expert."""
    return 4.0 * spec.num_moe_layers * tokens * micro_batches * spec.top_k * spec.hidden_size * FP32


def recorded_model(spec: ModelSpec) -> dict[str, Any]:
    """summary.json's "model": the keys runs have recorded since the bench began (readers compare runs)."""
    return {"name": spec.name, "num_layers": spec.num_layers, "hidden_size": spec.hidden_size,
            "ffn_hidden_size": spec.ffn_hidden_size, "num_attention_heads": spec.num_attention_heads,
            "num_experts": spec.num_experts, "topk": spec.top_k, "vocab_size": spec.vocab_size}


# ---- testbed -> plan inputs ------------------------------------------------------------------------
def testbed_topology(dcs: int, ranks_per_dc: int, wan_goodput_mbit: float, intra_goodput_mbit: float) -> Topology:
    """The testbed as a plan Topology: a DC uplink shared by its ranks (sibling link = uplink = the
    TCP goodput of the shaped rate), ranks inside a DC over loopback. No latency: netem is not used."""
    wan = wan_goodput_mbit / 1e3
    levels = [Level("dc", dcs, wan, 0.0, wan)]
    levels.append(Level("gpu", ranks_per_dc, intra_goodput_mbit / 1e3, 0.0))  # "gpu" = a rank, as in presets
    return Topology(tuple(levels), name=f"testbed {dcs}dc x {ranks_per_dc}", source="testbed")


@dataclass(frozen=True)
class Calibration:
    """Compute times of one point, measured on the unshaped testbed (per step, summed over layers)."""

    t_pre_s: float  # forward compute before the MoE block, all layers
    expert_fwd_s: float  # expert forward, all layers
    expert_rows: float  # token copies through the experts, all layers

    def workload(self, shape: ModelSpec, tokens: int, seq: int, compression_ratio: float = 1.0,
                 shared_sync_bytes_per_layer: float = 0.0, micro_batches: int = 1,
                 hold_copies: bool = True, overlap_grad_reduce: bool = False,
                 dense_params: int | None = None, grad_compression_ratio: float | None = None,
                 grad_value_bytes: int = 2, early_return_rest_ratio: float = 0.0) -> Workload:
        """tokens: per micro-batch; the timings are per iteration of `micro_batches` micro-batches.
        compression_ratio: shipped weights, grad_compression_ratio: returned gradients (default: the
        same) of the bench's compressed HybridEP, early_return_rest_ratio its --early-grad-return;
        hold_copies: borrowed copies held for the iteration (--borrowed-copies); dense_params: the
        model's non-expert parameters as its ranks counted them (the cost model then prices their
        data-parallel reduction, overlapped under overlap_grad_reduce, over each layout's DP group)."""
        per_copy = self.expert_fwd_s / max(self.expert_rows, 1.0)
        tflops = 2.0 * shape.expert_params / per_copy / 1e12 if per_copy > 0 else 1.0
        return Workload.from_model(
            shape.replace(seq_length=seq), micro_batch_size=tokens // seq, micro_batches=micro_batches,
            activation_bytes=FP32, weight_bytes=FP32, grad_bytes=FP32,
            t_pre_ms=self.t_pre_s / shape.num_moe_layers / micro_batches * 1e3, throughput_tflops=tflops,
            compression_ratio=compression_ratio,
            grad_compression_ratio=compression_ratio if grad_compression_ratio is None else grad_compression_ratio,
            grad_value_bytes=grad_value_bytes, early_return_rest_ratio=early_return_rest_ratio,
            shared_sync_bytes_per_layer=shared_sync_bytes_per_layer, backend="gloo",
            borrowed_copies="iteration" if hold_copies else "microbatch", overlap_grad_reduce=overlap_grad_reduce,
            dense_params=dense_params)


def system_plan(system: str, topology: Topology, num_experts: int) -> Plan:
    """The plan a baseline runs, in the planner's terms (for its predicted time)."""
    layout = topology.ep_layout(topology.world_size)
    if system == "ep":
        return Plan.grid(layout.counts, (1,) * len(layout.counts), num_experts, layout.names)
    if system == "replicated":
        return Plan.replicated(layout.counts, num_experts, layout.names)
    raise ValueError(f"system {system!r} has no fixed plan")


def pp_layout(dcs: int, ranks_per_dc: int, micro_batches: int) -> Layout:
    """The bench's ``pp`` system: one stage per DC, alltoall EP over the DC's ranks, the same global
    batch as the PP 1 systems (``micro_batches`` of theirs, times the stages)."""
    return Layout(1, dcs, ranks_per_dc, ranks_per_dc, micro_batches * dcs, f"1 dc x {ranks_per_dc} gpu")


def stage_plan(topology: Topology, pp: int, ep: int, num_experts: int) -> Plan:
    """Plain EP over ``ep`` ranks of a pipeline stage (what alltoall runs there)."""
    layout = topology.pipeline_stage(pp).ep_layout(ep)
    return Plan.grid(layout.counts, (1,) * len(layout.counts), num_experts, layout.names)


def layout_results(topology: Topology, workload: Workload) -> list[LayoutResult]:
    """The layouts the bench's auto systems choose from (bench/finalists.py): the layout planner's,
    those that fit without tensor parallelism (the bench's CPU ranks run none), its choice first.
    ``workload``: the PP 1 systems' (plan/layout.py); auto-c's hybridep plans run compressed (the
    bench passes them with its ratios), so they are priced so."""
    from megatron_hybridep.plan.layout import plan_layouts, prefer_megatron

    laid = plan_layouts(topology, workload, offer_exact=False)
    runnable = prefer_megatron([r for r in laid if r.fits and r.layout.tp == 1])
    if not runnable:
        raise PlanError(f"auto: no layout without tensor parallelism fits {topology.describe()}; fix: drop auto from "
                        "--systems")
    return runnable


def candidate_plans(topology: Topology, num_experts: int) -> list[Plan]:
    """Every HybridEP (domains) plan of the EP group spanning the testbed, for the calibration runs."""
    from megatron_hybridep.plan.planner import enumerate_plans

    layout = topology.ep_layout(topology.world_size)
    return enumerate_plans(layout, num_experts, include_replicated=False)


# ---- predictions ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class NetworkTime:
    """Exposed network seconds per iteration by phase, and bytes per DC uplink and direction."""

    seconds: dict[str, float]
    dc_uplink_bytes: float  # payload through the busiest DC uplink, one direction

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def network_time(topology: Topology, workload: Workload, plan: Plan, dense_params: int,
                 a2a_efficiency: float = 1.0, steady_efficiency: float = 1.0) -> NetworkTime:
    """The cost model's exposed network phases (module doc); token all-to-alls at a2a_efficiency of
    the link rate; the gradient return, a gloo all-to-all too (runtime/migration.py), at
    steady_efficiency when it lasts at least STEADY_S (shorter ones are start-up bound, like the probes)."""
    if not a2a_efficiency > 0 or not steady_efficiency > 0:
        raise PlanError(f"a2a_efficiency/steady_efficiency: must be > 0, got {a2a_efficiency!r}/{steady_efficiency!r}")
    cost = CostModel(topology, workload)
    cb = cost.evaluate(plan)  # with a plan's hot replicas (plan/hot.py)
    ph = cb.phases
    seconds = {p: ph[p] for p in PHASES if p in ph}
    seconds[Phase.TOKEN_A2A] = (ph[Phase.TOKEN_A2A_FWD] + ph[Phase.TOKEN_A2A_BWD]) / a2a_efficiency
    if seconds.get(Phase.GRAD_RETURN, 0.0) >= STEADY_S:
        seconds[Phase.GRAD_RETURN] /= steady_efficiency
    dc = next(lv for lv in cb.levels if lv.name == topology.levels[0].name)
    if workload.dense_params is not None:  # the cost model's own: the layout's DP group, overlap-aware
        return NetworkTime(seconds, dc.uplink_bytes)
    world = topology.world_size
    dense = cost.network.ring(Family(topology.level_counts, (1,) * len(topology.levels)),
                              2 * (world - 1) / world * dense_params * FP32, 2 * (world - 1))
    seconds[Phase.DENSE_GRAD_ALLREDUCE] = dense.seconds
    # bytes through a DC uplink (level 0), one direction, per iteration
    return NetworkTime(seconds, dc.uplink_bytes + dense.uplink_bytes[0])


@dataclass(frozen=True)
class GatherLead:
    """What ran on the unshaped testbed between a prefetched expert gather's launch and its use, per
    iteration (seconds, mean over ranks): every gather's, and the first MoE layer's apart where the run
    recorded it (older runs: None)."""

    total_s: float
    calls: float  # gathers per iteration (every layer's, every micro-batch that gathers)
    first_s: float | None = None
    first_calls: float = 0.0

    @classmethod
    def from_ranks(cls, ranks: dict[str, float] | None) -> GatherLead | None:
        """From a measured point's ``ranks`` (bench/worker.py); None where it ran no gather."""
        g = Phase.EXPERT_ALLGATHER
        if not ranks or ranks.get(f"{g}_wall_s", 0.0) <= 0:
            return None
        total = ranks[f"{g}_wall_s"] - ranks[f"{g}_s"]
        if f"{g}_calls" not in ranks:  # recorded before 2026-12-02: the mean over the prediction's calls
            return cls(total, 0.0)
        return cls(total, ranks[f"{g}_calls"], ranks[f"{g}_first_lead_s"], ranks[f"{g}_first_calls"])

    def exposed(self, gather_s: float, calls: int) -> float:
        """Seconds ``calls`` gathers of ``gather_s`` each wait per iteration, each behind its lead."""
        if self.first_s is None or not self.calls or self.first_calls >= self.calls:
            return calls * max(0.0, gather_s - self.total_s / (self.calls or calls))
        first = self.first_s / max(self.first_calls, 1.0)
        later = (self.total_s - self.first_s) / (self.calls - self.first_calls)
        share = self.first_calls / self.calls  # of the prediction's calls
        return calls * (share * max(0.0, gather_s - first) + (1 - share) * max(0.0, gather_s - later))


@dataclass(frozen=True)
class Prediction:
    total: float  # predicted step seconds (token all-to-alls calibrated by the probe)
    base: float  # measured unshaped step seconds it starts from
    phases: dict[str, float]  # shaped - unshaped network seconds per phase (calibrated)
    planner_total: float  # the cost model's own total (compute from T_pre and the expert speed, no residual)
    dc_uplink_bytes: float  # predicted payload per DC uplink and direction per iteration
    uncalibrated_total: float  # the same with the all-to-alls at the TCP goodput of the rate


def predict(shaped: Topology, unshaped: Topology, workload: Workload, plan: Plan, dense_params: int,
            unshaped_step_s: float, a2a_efficiency: float = 1.0, steady_efficiency: float = 1.0,
            shared_cores: float | None = None, gather_lead: GatherLead | None = None,
            rank_cpu_s: float | None = None) -> Prediction:
    """a2a_efficiency: share of the shaped rate a bare all-to-all of this size got (1 = none measured);
    steady_efficiency: the same for all-to-alls of at least STEADY_S (the pooled probes);
    shared_cores: the cores the testbed's ranks share (pipeline sends priced on them; module doc);
    gather_lead: what hid the expert gathers in the unshaped step (module doc; None: the cost model's cover);
    rank_cpu_s: a rank's CPU seconds in the unshaped step (pipeline sends on shared cores; None: saturated)."""
    net = workload.replace(collective_overhead_ms=0.0)  # the measured unshaped step holds gloo's per-call cost
    hi = network_time(shaped, net, plan, dense_params, a2a_efficiency, steady_efficiency)
    raw = network_time(shaped, net, plan, dense_params)
    lo = network_time(unshaped, net, plan, dense_params)
    phases = {k: hi.seconds.get(k, 0.0) - lo.seconds.get(k, 0.0) for k in PHASES}
    uncal = unshaped_step_s + raw.total - lo.total
    one_f_one_b = net.pipeline_model_parallel_size > 1 and net.virtual_pipeline_model_parallel_size == 1
    if shared_cores is not None and one_f_one_b:
        pipe = shared_pipeline_send(shaped, unshaped, net, plan, unshaped_step_s, shared_cores, rank_cpu_s)
        uncal += pipe - phases[Phase.PIPELINE_SEND]
        phases[Phase.PIPELINE_SEND] = pipe
    if gather_lead is not None:
        gathers = measured_cover_gathers(shaped, unshaped, net, plan, gather_lead)
        uncal += gathers - phases[Phase.EXPERT_ALLGATHER]
        phases[Phase.EXPERT_ALLGATHER] = gathers
    planner = CostModel(shaped, workload).evaluate(plan).total
    return Prediction(unshaped_step_s + sum(phases.values()), unshaped_step_s, phases, planner, hi.dc_uplink_bytes,
                      uncal)


def shared_pipeline_send(shaped: Topology, unshaped: Topology, workload: Workload, plan: Plan,
                         unshaped_step_s: float, cores: float, rank_cpu_s: float | None = None) -> float:
    """What the shaped WAN adds to a 1F1B pipeline whose ranks share ``cores`` (module doc);
    ``rank_cpu_s``: a rank's CPU seconds in the unshaped step (its duty, :func:`pipeline_duty`)."""
    pp, m = workload.pipeline_model_parallel_size, workload.micro_batches
    ranks = shaped.world_size // pp
    groups = ranks // plan.ep_size if plan.ep_size and ranks % plan.ep_size == 0 else 1
    spread = {"groups": groups, "stagger": GROUP_PHASE / groups if groups > 1 else 0.0, "hold": WAIT_HOLD}
    cost = CostModel(shaped, workload)
    raw = cost.evaluate(plan).raw
    f0, b0 = raw["stage_fwd"], raw["stage_bwd"]
    duty = 1.0 if rank_cpu_s is None else pipeline_duty(pp, m, f0, b0, ranks, cores, unshaped_step_s, rank_cpu_s,
                                                        **spread)
    scale = unshaped_step_s / one_f_one_b_shared(pp, m, f0, b0, ranks_per_stage=ranks, cores=cores, duty=duty,
                                                 **spread)

    def replay(sends: Sends) -> float:
        t = one_f_one_b_shared(pp, m, scale * f0, scale * b0, [p.seconds for p in sends.fwd],
                               [p.seconds for p in sends.bwd], ranks, cores, duty, **spread)
        return max(t, m * sends.per_micro_batch.seconds)  # sends sharing an uplink: never faster than its bytes

    return replay(cost.sends) - replay(CostModel(unshaped, workload).sends)


def pipeline_duty(pp: int, m: int, f0: float, b0: float, ranks: int, cores: float, step_s: float,
                  rank_cpu_s: float, groups: int = 1, stagger: float = 0.0, hold: float = 0.0) -> float:
    """The share of its compute a rank keeps a core busy, from the unshaped step: with the stage times
    scaled until the free-send replay lasts ``step_s``, a rank's CPU seconds are duty x its compute
    (m (f + b)); a lower duty contends less for the cores, so the replay needs longer stages. 1 when the
    cores were saturated (or the ranks report more CPU than that: the step's other work)."""
    def cpu(duty: float) -> float:
        return duty * step_s * m * (f0 + b0) / one_f_one_b_shared(pp, m, f0, b0, ranks_per_stage=ranks,
                                                                     cores=cores, duty=duty, groups=groups,
                                                                     stagger=stagger, hold=hold)
    if rank_cpu_s >= cpu(1.0):
        return 1.0
    lo, hi = 1e-3, 1.0  # cpu() rises with duty (less contention shortens the replay less than duty drops)
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cpu(mid) < rank_cpu_s else (lo, mid)
    return hi


def measured_cover_gathers(shaped: Topology, unshaped: Topology, workload: Workload, plan: Plan,
                           lead: GatherLead) -> float:
    """What the shaped WAN adds to the expert gathers' waits behind the measured ``lead`` (module doc);
    the codec's compute is in the measured unshaped step."""
    cb = CostModel(shaped, workload).evaluate(plan)
    calls = workload.stage_moe_layers * (1 if cb.borrowed_copies == "iteration" else workload.micro_batches)
    lo = CostModel(unshaped, workload).evaluate(plan).raw[Phase.EXPERT_ALLGATHER]
    return lead.exposed(cb.raw[Phase.EXPERT_ALLGATHER], calls) - lead.exposed(lo, calls)


def plan_for_point(topology: Topology, workload: Workload, ep_size: int) -> PlanningResult:
    """The planner's choice for one point (its own cost model, every candidate incl. replicated); the
    compressed system's domains all compressed (it is the system that compresses)."""
    return choose_plan(topology, workload, ep_size, offer_exact=False)


def best_domains_plan(result: PlanningResult) -> Plan:
    """HybridEP runs the planner's best HybridEP (domains) plan; the replicated plan is a baseline."""
    plan = next(c.plan for c in result.candidates if c.plan.kind == "domains")
    return dataclasses.replace(plan, predicted={}, link_bytes={})


__all__ = ["BUILTIN", "Calibration", "GatherLead", "MEASURED", "NetworkTime", "PHASES", "Prediction",
           "best_domains_plan", "candidate_plans", "check_model", "layout_results", "load_model",
           "measured_cover_gathers", "network_time", "pipeline_duty", "plan_for_point", "pp_layout", "predict",
           "recorded_model", "shared_pipeline_send", "stage_plan", "system_plan", "testbed_topology",
           "token_traffic_bytes"]
