"""Tier (b): our cost model of one training iteration under a plan.

Beyond the paper's stream model (paper_model.py) it counts, per MoE layer and micro-batch:
- four token all-to-alls (dispatch + combine forward, their transposes backward) on the rails, with
  alpha-beta links at every level and uplink contention (network.py);
- expert compute on the rank that actually computes each token, so skewed routing shows (a hot
  expert's load is split over its domain's copies under HybridEP, not under plain EP);
- the expert all-gather in the domain (compressed bytes incl. indices), hidden where it fits
  behind what runs between its start and its use: layer 0's (started after the optimizer step)
  behind T_pre + the dispatch, layer l+1's (started after layer l's experts) behind layer l's
  combine + T_pre + the dispatch. All-to-alls count as cover only when they use no link level the
  gather uses (else they share bandwidth: the simulator resolves that, not this);
- the gradient return of borrowed experts to their owners, blocking, in the backward
  (runtime/migration.py: a reduce-scatter ring, or an all-to-all of the chunks when gradients are
  compressed (top-k payloads) or the backend is gloo, whose reduce-scatter would send twice the bytes);
  with ``async_grad_return`` (--hybridep-async-grad-return) overlapped with the rest of the backward
  (:func:`grad_return_exposed`); with ``early_return_rest_ratio`` (--hybridep-early-grad-return) the
  first M-1 micro-batches' returns hide behind the last micro-batch's forward and backward and only
  the rest's smaller payload is priced as above;
- with compression, the codec's compute on the rank (``Workload.codec_seconds``: encode the own
  experts and decode the borrowed ones and its own mirror per gather, encode the borrowed gradients
  with error feedback and decode the returned ones per return), exposed in those two phases: on CPU
  ranks it shares the training's cores, on GPU ranks the training's stream;
- how often those two run is the borrowed-copies mode (``Workload.borrowed_copies``, the runtime's
  --hybridep-borrowed-copies): "iteration" gathers in the first micro-batch only, keeps the copies
  for the iteration and returns the accumulated gradients once, in the last micro-batch's backward;
  "microbatch" gathers and returns in every micro-batch (later micro-batches start layer 0's gather
  at its MoE block: hidden behind the dispatch alone); "auto" is iteration when the memory it holds
  fits the memory limit (:func:`resolve_borrowed_copies`), else microbatch;
- domains with S > 1 and a refreshed shared expert: one all-reduce per layer over the EP group
  (amortised per step), blocking, before that layer's first gather of the step;
- once per iteration after the backward (Megatron's finalize_model_grads; exposed unless the
  workload sets overlap_grad_reduce / overlap_param_gather: :func:`data_parallel_exposed`): the
  dense-parameter gradient all-reduce over the
  data-parallel group (``dense_grad_allreduce``, a ring on the links it crosses; every plan pays it
  alike, but it is real time on a slow WAN and the scheduler's calibration needs it apart from
  compute), then one all-reduce of all expert gradients over the expert data-parallel replicas;
- for the replicated plan (EP inside each DC, experts in every DC): no gathers, that all-reduce
  over all DCs, and the memory of full expert replicas with their optimizer state.
With pipeline parallelism the phases above are one stage's (its MoE layers, its ranks: EP groups
and data-parallel groups live inside a stage; the busiest stage stands for all), and two more
phases put the pipeline around it (plan/pipeline.py): ``pipeline_bubble`` (fill and drain with free
sends) and ``pipeline_send`` (what the activation and gradient sends between stages add, over the
world's links). This is the closed form of the simulator's ``runtime`` schedule (sim/schedule.py).

Memory per rank (:meth:`CostModel.memory`): expert weights, held borrowed copies, gradients (main
grads at ``main_grad_bytes``), optimizer state (master weights + Adam moments, divided over the
(expert) data-parallel group under the distributed optimizer), and the same for the dense
parameters divided by TP x PP. Activations are not counted. The optimizer step is left out of the
time: every candidate pays it alike.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.network import (
    Family,
    Network,
    PhaseCost,
    dc_replica_family,
    domain_family,
    rail_family,
    replica_family,
    world_domain_sizes,
)
from megatron_hybridep.plan.phases import EXPOSED, REPLICA, Phase
from megatron_hybridep.plan.pipeline import Sends, boundary_sends, schedule_time
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.topology import EPLayout, Topology
from megatron_hybridep.plan.workload import Workload

# exposed-time phases, in the order they are reported; they sum to the total
PHASES = EXPOSED


@dataclass(frozen=True)
class LevelBreakdown:
    """Traffic of one world level per iteration."""

    name: str
    link_bytes: float               # bytes on the busiest sibling link (summed over phases)
    uplink_bytes: float             # bytes through the busiest unit uplink (summed over phases)
    seconds: dict[str, float]       # bandwidth time spent at this level, per phase (before overlap)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank (one pipeline stage's layers): expert parameters first, then dense ones."""

    owned_weights: float
    borrowed_weights: float         # held borrowed copies (domains) or hot-expert replicas
    grads: float                    # main grads of the owned experts
    borrowed_grads: float           # iteration mode: the accumulator of S x own experts for the iteration;
    #   microbatch mode: one layer's borrowed gradients before they return
    optimizer_state: float          # of the owned experts (sharded over expert DP by the distributed optimizer)
    codec_state: float = 0.0        # error-feedback accumulators (fp32) of compressed gradient returns
    dense_weights: float = 0.0
    dense_grads: float = 0.0
    dense_optimizer_state: float = 0.0
    borrowed_copies: str = ""       # the mode these figures hold for

    @property
    def expert_total(self) -> float:
        return (self.owned_weights + self.borrowed_weights + self.grads + self.borrowed_grads
                + self.optimizer_state + self.codec_state)

    @property
    def dense_total(self) -> float:
        return self.dense_weights + self.dense_grads + self.dense_optimizer_state

    @property
    def total(self) -> float:
        return self.expert_total + self.dense_total

    def as_dict(self) -> dict[str, float | str]:
        return {"owned_weights": self.owned_weights, "borrowed_weights": self.borrowed_weights,
                "grads": self.grads, "borrowed_grads": self.borrowed_grads,
                "optimizer_state": self.optimizer_state, "codec_state": self.codec_state,
                "dense_weights": self.dense_weights, "dense_grads": self.dense_grads,
                "dense_optimizer_state": self.dense_optimizer_state, "expert_total": self.expert_total,
                "total": self.total, "borrowed_copies": self.borrowed_copies}


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
    borrowed_copies: str = "microbatch"     # the mode priced ("iteration" or "microbatch")
    borrowed_reason: str = ""               # why (resolve_borrowed_copies)

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
                "memory": self.memory.as_dict() if self.memory else None, "notes": list(self.notes),
                "borrowed_copies": self.borrowed_copies, "borrowed_reason": self.borrowed_reason}


class CostModel:
    """Evaluates plans for one topology and workload (tier b). With PP > 1 ``topology`` is one
    pipeline stage of the given one (Topology.pipeline_stage). ``memory_limit_bytes``: the limit the
    "auto" borrowed-copies mode checks against (default: the topology's memory_gb_per_gpu)."""

    name = "ours"

    def __init__(self, topology: Topology, workload: Workload, memory_limit_bytes: float | None = None) -> None:
        self.world = topology
        self.topology = topology.pipeline_stage(workload.pipeline_model_parallel_size)
        self.workload = workload
        self.memory_limit_bytes = memory_limit_bytes if memory_limit_bytes is not None else topology.memory_bytes
        self.network = Network(self.topology, workload.call_seconds)
        self._layouts: dict[int, EPLayout] = {}
        tp = workload.tensor_model_parallel_size
        stage = self.topology.world_size
        if stage % tp:
            raise PlanError(f"tensor_model_parallel_size: {tp} does not divide the {stage} ranks of a pipeline "
                            f"stage ({self.topology.describe()}); fix: use a divisor of it")
        dp = stage // tp
        if workload.data_parallel_size and workload.data_parallel_size != dp:
            raise PlanError(f"data_parallel_size: {workload.data_parallel_size} but world {topology.world_size} / "
                            f"(TP {tp} x PP {workload.pipeline_model_parallel_size}) = {dp}; fix: set it to {dp} "
                            "or leave it out")
        self.dp = dp
        self._sends: Sends | None = None

    @property
    def sends(self) -> Sends:
        """The pipeline's sends of one micro-batch over the world's links (plan/pipeline.py)."""
        if self._sends is None:
            w = self.workload
            self._sends = boundary_sends(self.world, w.pipeline_model_parallel_size, w.pipeline_send_bytes,
                                         w.virtual_pipeline_model_parallel_size, w.call_seconds)
        return self._sends

    def layout(self, ep_size: int) -> EPLayout:
        if ep_size not in self._layouts:
            self._layouts[ep_size] = self.topology.ep_layout(ep_size)
        return self._layouts[ep_size]

    def _layout_for(self, plan: Plan) -> EPLayout:
        return check_plan(self.topology, self.workload, plan, self.layout(plan.ep_size))

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

    def memory(self, plan: Plan, lay: EPLayout | None = None, mode: str | None = None) -> MemoryBreakdown:
        """Bytes per rank (module doc) with the borrowed copies held as ``mode`` does (default: the
        mode this plan resolves to)."""
        w = self.workload
        mode = mode or self.borrowed_copies(plan)[0]
        tp = w.tensor_model_parallel_size
        P = w.expert_params / w.etp * w.stage_moe_layers  # one expert's parameters on this rank, over its layers
        owned = plan.experts_per_rank
        S = plan.domain_size if plan.kind == "domains" else 1
        borrowed = (S - 1) * owned
        group = plan.ep_size if plan.kind == "domains" else plan.rail_size
        edp = max(1, self.topology.world_size // (w.etp * group))  # expert DP: a stage / (ETP x EP)
        opt = w.optimizer_bytes_per_param
        if mode == "iteration" and w.micro_batches > 1:  # accumulated over the iteration (borrowed.py)
            held_grads = S * owned * P * w.main_grad_bytes if S > 1 else 0.0
        else:  # one layer's borrowed gradients on their way back
            held_grads = borrowed * P / w.stage_moe_layers * w.grad_bytes
        dense = w.model_dense_params / (tp * w.pipeline_model_parallel_size)
        return MemoryBreakdown(owned_weights=owned * P * w.weight_bytes,
                               borrowed_weights=borrowed * P * w.weight_bytes,
                               grads=owned * P * w.main_grad_bytes,
                               borrowed_grads=held_grads,
                               optimizer_state=owned * P * opt / (edp if w.distributed_optimizer else 1),
                               codec_state=borrowed * P * 4 if w.grad_compression_ratio > 1 else 0.0,
                               dense_weights=dense * w.weight_bytes, dense_grads=dense * w.main_grad_bytes,
                               dense_optimizer_state=dense * opt / (self.dp if w.distributed_optimizer else 1),
                               borrowed_copies=mode)

    def borrowed_copies(self, plan: Plan) -> tuple[str, str]:
        """(mode, reason) for this plan: the workload's mode, or for "auto" iteration when the memory
        it holds fits the limit (module doc)."""
        w = self.workload
        if plan.kind != "domains" or plan.domain_size == 1:
            mode = "iteration" if w.borrowed_copies == "auto" else w.borrowed_copies
            return mode, "no borrowed experts"
        if w.borrowed_copies != "auto":
            return w.borrowed_copies, f"borrowed_copies={w.borrowed_copies} (forced)"
        need = self.memory(plan, mode="iteration")
        held = need.borrowed_weights + need.borrowed_grads
        limit = self.memory_limit_bytes
        if limit is None:
            return "iteration", (f"held borrowed copies need {bytes_human(held)} per rank, no memory limit "
                                 "stated: iteration")
        mode = "iteration" if need.total <= limit else "microbatch"
        return mode, (f"held borrowed copies need {bytes_human(held)} per rank ({bytes_human(need.total)} in all), "
                      f"limit {bytes_human(limit)}: {mode}")

    def dense_allreduce(self) -> PhaseCost:
        """The dense gradients' all-reduce over the data-parallel group (ranks of a stage with the same
        TP rank): a ring of the main-grad buffer, reduce-scatter + all-gather."""
        w, n = self.workload, self.topology.level_counts
        tp, k = w.tensor_model_parallel_size, self.dp
        nbytes = w.model_dense_params / (tp * w.pipeline_model_parallel_size) * w.main_grad_bytes
        if k == 1 or nbytes <= 0:
            return PhaseCost.zero(self.network.L)
        if n[-1] % tp:
            raise PlanError(f"tensor_model_parallel_size: {tp} does not divide the {n[-1]} ranks of the innermost "
                            f"level ({self.topology.describe()}); fix: keep TP groups inside one unit")
        fam = Family(n[:-1] + (n[-1] // tp,), (1,) * (len(n) - 1) + (tp,))
        return self.network.ring(fam, 2 * (k - 1) / k * nbytes, 2 * (k - 1))

    def grad_buckets(self, params: float) -> int:
        """Megatron DDP's gradient buckets for ``params`` parameters of one buffer (dense or expert):
        --ddp-bucket-size, default max(40M, 1M x DP)."""
        size = self.workload.ddp_bucket_size or max(40_000_000, 1_000_000 * self.dp)
        return max(1, math.ceil(params / size)) if params > 0 else 0

    # ---- one plan ----------------------------------------------------------------------------------------
    def evaluate(self, plan: Plan) -> CostBreakdown:
        """The plan's iteration time by phase, its bytes per link level and its memory; with hot
        replicas (plan/hot.py) the replica exchange too: the one entry that prices a plan."""
        return _with_replicas(self, plan) if plan.replicas else self._evaluate(plan)

    def _evaluate(self, plan: Plan) -> CostBreakdown:
        w, net = self.workload, self.network
        lay = self._layout_for(plan)
        G, S, E = plan.ep_size, plan.domain_size, plan.num_experts
        Lm, m = w.stage_moe_layers, w.micro_batches
        mode, why = self.borrowed_copies(plan)
        mg = 1 if mode == "iteration" else m  # micro-batches that gather and return
        S_world = world_domain_sizes(lay, plan.domain_sizes)
        a2a_layers, loads = self.token_a2a(plan, lay)
        per_layer = Lm / len(a2a_layers)  # a single routing matrix stands for every MoE layer
        a2a_total = sum(p.seconds for p in a2a_layers) * per_layer
        expert_fwd = sum(loads) * per_layer * w.expert_seconds_per_token
        t_pre = w.t_pre

        zero = PhaseCost.zero(net.L)
        ag = rs = rest = shared = zero
        codec_w = codec_g = 0.0  # a rank's codec compute per layer and gather / return
        if plan.kind == "domains":
            own = E // G
            if S > 1:
                codec_w, codec_g = codec_compute(w, S, own, mode)
                dom = domain_family(lay, S_world)
                ag = net.ring(dom, (S - 1) * own * w.expert_wire_bytes, S - 1)
                if w.grad_compression_ratio > 1 or w.backend == "gloo":  # chunks by all_to_all in the domain
                    rs = net.a2a(dom, own * w.returned_grad_bytes(mode))
                else:
                    rs = net.ring(dom, (S - 1) * own * w.returned_grad_bytes(mode), S - 1)
                if w.splits_grad_return(mode):  # --hybridep-early-grad-return: the last backward's share
                    rest = net.a2a(dom, own * w.rest_grad_bytes(mode))
                if w.shared_sync_bytes:  # the shared expert is the mean over the whole EP group
                    ep_group = domain_family(lay, lay.extent)
                    shared = net.ring(ep_group, 2 * (G - 1) / G * w.shared_sync_bytes, 2 * (G - 1))
            fam, k = replica_family(self.topology, lay), lay.num_groups
        else:
            own = E // plan.rail_size
            fam, k = dc_replica_family(self.topology), self.topology.level_counts[0]
        # one bucket: every MoE layer's expert main grads
        grad_bytes = own * w.expert_params / w.etp * w.main_grad_bytes * Lm
        allreduce = net.ring(fam, 2 * (k - 1) / k * grad_bytes, 2 * (k - 1)) if k > 1 else zero

        # overlap as the runtime schedules it (module doc): only the gathers hide
        disjoint = not any(a > 0 and any(p.level_seconds[i] > 0 for p in a2a_layers)
                           for i, a in enumerate(ag.level_seconds))
        a2a = a2a_total / Lm if disjoint else 0.0  # one all-to-all (mean over layers)
        first, later, restart = (max(0.0, ag.seconds - cover) for cover in (t_pre + a2a, t_pre + 2 * a2a, a2a))
        gathers = first + (Lm - 1) * later + (mg - 1) * (restart + (Lm - 1) * later) + Lm * mg * codec_w
        dense = self.dense_allreduce()
        # one micro-batch on this stage, forward and backward: what can hide the data-parallel
        # reductions; the token all-to-alls only where they use none of the reductions' links
        # (at the reductions' bottleneck level: a ring across DCs also crosses the fast links inside one)
        level_s = [d + e for d, e in zip(dense.level_seconds, allreduce.level_seconds, strict=True)]
        neck = max(range(len(level_s)), key=level_s.__getitem__)
        shared_link = level_s[neck] > 0 and any(p.level_seconds[neck] > 0 for p in a2a_layers)
        hide = 0.0 if shared_link else 2 * a2a_total
        f = t_pre * Lm + expert_fwd + 2 * a2a_total
        b = 2 * (t_pre * Lm + expert_fwd) + 2 * a2a_total
        dense_params = w.model_dense_params / (w.tensor_model_parallel_size * w.pipeline_model_parallel_size)
        buckets = (self.grad_buckets(dense_params), self.grad_buckets(grad_bytes / w.main_grad_bytes))
        dense_s, expert_s = data_parallel_exposed(w, dense.seconds, allreduce.seconds, f - 2 * a2a_total + hide,
                                                  b - 2 * a2a_total + hide, buckets)
        phases = {
            Phase.PRE_COMPUTE: 3 * t_pre * Lm * m,
            Phase.EXPERT_COMPUTE: 3 * expert_fwd * m,
            Phase.TOKEN_A2A_FWD: 2 * a2a_total * m,
            Phase.TOKEN_A2A_BWD: 2 * a2a_total * m,
            Phase.EXPERT_ALLGATHER: gathers,
            Phase.GRAD_RETURN: (grad_return_exposed(w, rs.seconds, mg, b) if rest is zero else
                                # the first M-1 micro-batches' returns cross during the last one's pass
                                max(0.0, Lm * rs.seconds - (f + b)) + grad_return_exposed(w, rest.seconds, 1, b))
            + Lm * mg * codec_g,
            Phase.SHARED_SYNC: Lm * shared.seconds,
            Phase.DENSE_GRAD_ALLREDUCE: dense_s,
            Phase.EXPERT_GRAD_ALLREDUCE: expert_s,
        }
        raw = {"t_pre": t_pre, "expert_fwd": expert_fwd / Lm, "a2a": a2a_total / Lm,
               Phase.EXPERT_ALLGATHER: ag.seconds, Phase.GRAD_RETURN: rs.seconds, "grad_return_rest": rest.seconds,
               Phase.SHARED_SYNC: shared.seconds, "codec_weights": codec_w, "codec_grads": codec_g,
               Phase.DENSE_GRAD_ALLREDUCE: dense.seconds, Phase.EXPERT_GRAD_ALLREDUCE: allreduce.seconds,
               "dp_dense_buckets": float(buckets[0]), "dp_expert_buckets": float(buckets[1]),
               "dp_shares_a2a_links": float(shared_link)}

        occurrences = [(Phase.TOKEN_A2A, p, 4 * m * per_layer) for p in a2a_layers] + [
            (Phase.EXPERT_ALLGATHER, ag, Lm * mg), (Phase.GRAD_RETURN, rs, Lm * mg), (Phase.GRAD_RETURN, rest, Lm),
            (Phase.SHARED_SYNC, shared, Lm),
            (Phase.DENSE_GRAD_ALLREDUCE, dense, 1), (Phase.EXPERT_GRAD_ALLREDUCE, allreduce, 1)]
        P, v = w.pipeline_model_parallel_size, w.virtual_pipeline_model_parallel_size
        notes = []
        if P > 1:
            sends = self.sends
            pipe = schedule_time(P, v, m, f, b, sends)
            phases[Phase.PIPELINE_BUBBLE] = pipe.bubble
            phases[Phase.PIPELINE_SEND] = pipe.send
            raw.update({"stage_fwd": f, "stage_bwd": b, Phase.PIPELINE_SEND: sends.per_micro_batch.seconds,
                        "pipeline_send_fwd": max(p.seconds for p in sends.fwd),
                        "pipeline_send_bwd": max(p.seconds for p in sends.bwd)})
            occurrences.append((Phase.PIPELINE_SEND, sends.per_micro_batch, m))
            schedule = f"interleaved, {v} chunks per rank" if v > 1 else "1F1B"
            notes.append(f"pipeline: {P} stages, {schedule}, {m} micro-batches; {bytes_human(w.pipeline_send_bytes)} "
                         f"per rank per send; bubble {seconds_human(pipe.bubble)}, sends add "
                         f"{seconds_human(pipe.send)}")
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
        if w.routing_counts is not None:
            notes.append("skewed routing from routing_counts")
        if plan.kind == "domains" and S > 1:
            notes.append(f"borrowed copies: {why}")
        return CostBreakdown("ours", sum(phases.values()), phases, raw, tuple(levels),
                             self.memory(plan, lay, mode), tuple(notes), mode, why)


def codec_compute(w: Workload, S: int, own: int, mode: str) -> tuple[float, float]:
    """A rank's codec compute per MoE layer in a compressed domain of S ranks owning ``own`` experts
    each: (per gather: encode its own experts, decode the S - 1 members' and its own mirror; per
    return: encode the S - 1 borrowed gradients and remove what was sent (error feedback), and the
    owner's decode of the S - 1 payloads it receives). 0 for what travels exact."""
    elems = own * w.expert_params / w.etp
    gather = w.codec_seconds(elems, S * elems) if w.compression_ratio > 1 else 0.0
    sends = 2 if w.splits_grad_return(mode) else 1
    ret = (w.codec_seconds(sends * (S - 1) * elems, 2 * sends * (S - 1) * elems)
           if w.grad_compression_ratio > 1 else 0.0)
    return gather, ret


def grad_return_exposed(w: Workload, one: float, returns: int, bwd: float) -> float:
    """Exposed seconds of the borrowed experts' gradient returns: ``one`` layer's return, ``returns``
    times per MoE layer (once per iteration, or per micro-batch). Blocking, each is waited for in its
    layer's backward. With async_grad_return a layer's return is launched there and overlaps the
    backward of the layers below it ((Lm - 1) / Lm of one micro-batch's ``bwd`` on the stage); the
    returns queue on the link one after another, and what is left is waited for at the end."""
    Lm = w.stage_moe_layers
    total = Lm * returns * one
    if not w.async_grad_return or total <= 0:
        return total
    return returns * max(0.0, Lm * one - (Lm - 1) / Lm * bwd)


def data_parallel_exposed(w: Workload, dense: float, expert: float, fwd: float, bwd: float,
                          buckets: tuple[int, int] = (1, 1)) -> tuple[float, float]:
    """Exposed seconds of the dense and expert data-parallel reductions (``dense`` / ``expert``: each
    alone). Under the distributed optimizer half of each ring is the reduce-scatter of gradients and
    half the all-gather of parameters (priced at today's bytes). overlap_grad_reduce hides the
    gradient part behind one micro-batch's backward ``bwd`` (Megatron syncs gradients only in the
    last one), bucket by bucket. ``buckets``: (dense, expert) buffers' bucket counts; a buffer's
    buckets are ready one after another over the backward, its last (the first layers') only at
    the end, so the last buckets' share q = (dense / B_d + expert / B_e) / r never hides: what is
    left is max(q r, r - bwd (1 - q)) (one bucket per buffer, the usual case for a small model:
    q = 1, nothing hides). overlap_param_gather hides the gather behind the next iteration's first
    forward ``fwd``, likewise. Both reductions share the cover, split in proportion to their times."""
    total = dense + expert
    if total <= 0 or not (w.overlap_grad_reduce or w.overlap_param_gather):
        return dense, expert
    gather = total / 2 if w.distributed_optimizer else 0.0
    reduce = total - gather
    q = (dense / max(1, buckets[0]) + expert / max(1, buckets[1])) / total
    if w.overlap_grad_reduce:
        reduce = max(q * reduce, reduce - bwd * (1 - q))
    if w.overlap_param_gather:
        gather = max(q * gather, gather - fwd * (1 - q))
    share = (reduce + gather) / total
    return dense * share, expert * share


def resolve_borrowed_copies(topology: Topology, workload: Workload, plan: Plan,
                            memory_limit_bytes: float | None = None) -> tuple[str, str]:
    """The borrowed-copies mode a job runs and a one-line reason, for start-up: ``workload``'s
    ``borrowed_copies`` (the --hybridep-borrowed-copies flag) with "auto" resolved by the memory
    check against ``memory_limit_bytes`` (default: the topology's memory_gb_per_gpu; none stated:
    iteration). Pure: the same on every rank.

    >>> mode, why = resolve_borrowed_copies(topo, work.replace(borrowed_copies="auto"), plan)
    >>> why   # e.g. "held borrowed copies need 3.2 GB per rank (41 GB in all), limit 80 GB: iteration"
    """
    return CostModel(topology, workload, memory_limit_bytes).borrowed_copies(plan)


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


def check_plan(topology: Topology, workload: Workload, plan: Plan, layout: EPLayout | None = None) -> EPLayout:
    """The plan's EP layout in this topology, or a PlanError naming the field that does not match."""
    lay = layout or topology.ep_layout(plan.ep_size)
    if plan.level_counts != lay.counts:
        levels = dict(zip(lay.names, lay.counts, strict=True))
        raise PlanError(f"plan.level_counts: {plan.level_counts} but an EP group of {plan.ep_size} ranks in "
                        f"{topology.describe()} has levels {levels}; fix: make the plan for this topology "
                        "(hybridep plan) or pass --plan ep|replicated|S,S")
    if plan.num_experts != workload.num_experts:
        raise PlanError(f"plan.num_experts: {plan.num_experts} but the model has {workload.num_experts}; "
                        "fix: make the plan for this model")
    return lay


def _with_replicas(model: CostModel, plan: Plan) -> CostBreakdown:
    """The breakdown plus the replica exchange of a plan with hot replicas (plan/hot.py). Token traffic and
    expert load already follow ``plan.compute_ranks()`` (replica-aware) when routing counts are
    given; balanced routing is spelled out as counts so they do. The exchange is exact, once per
    micro-batch and layer (once per iteration when borrowed copies are kept for it: replicas start
    with the gather, runtime start_gather): weights owner -> replica prefetched like the domain gather (hidden behind
    what T_pre has left after it), the gradient back blocking in the backward pass."""
    w, G, E = model.workload, plan.ep_size, plan.num_experts
    if w.routing_for(G) is None:
        model = CostModel(model.world, w.replace(routing_counts=np.full((G, E), w.tokens * w.top_k / E)))
    c = model._evaluate(plan)
    lay = model.layout(G)
    experts, dst = (np.array(x, dtype=np.int64) for x in zip(*plan.replicas.pairs, strict=True))
    owners = experts // plan.experts_per_rank
    ones = np.ones(len(experts))
    fwd = model.network.flows(lay, owners, dst, ones * w.expert_bytes)
    bwd = model.network.flows(lay, dst, owners, ones * w.expert_params * w.grad_bytes)
    count = w.stage_moe_layers * (1 if c.borrowed_copies == "iteration" else w.micro_batches)  # gather's rhythm
    hide = max(0.0, w.t_pre - c.raw[Phase.EXPERT_ALLGATHER])  # prefetched like the gather, behind what T_pre has left
    phases = {**c.phases, Phase.REPLICA_WEIGHTS: count * max(0.0, fwd.seconds - hide),
              Phase.REPLICA_GRAD_RETURN: count * bwd.seconds}
    raw = {**c.raw, Phase.REPLICA_WEIGHTS: fwd.seconds, Phase.REPLICA_GRAD_RETURN: bwd.seconds}
    levels = tuple(LevelBreakdown(
        lv.name, lv.link_bytes + count * (fwd.pair_bytes[i] + bwd.pair_bytes[i]),
        lv.uplink_bytes + count * (fwd.uplink_bytes[i] + bwd.uplink_bytes[i]),
        {**lv.seconds, **{k: count * p.level_seconds[i] for k, p in zip(REPLICA, (fwd, bwd), strict=True)
                          if p.level_seconds[i] > 0}}) for i, lv in enumerate(c.levels))
    memory = c.memory
    if memory is not None:
        n = max(plan.replicas.per_rank().values()) * w.expert_params * w.stage_moe_layers
        memory = dataclasses.replace(memory, borrowed_weights=memory.borrowed_weights + n * w.weight_bytes,
                                     borrowed_grads=memory.borrowed_grads + n * w.grad_bytes)
    notes = c.notes + (f"{len(plan.replicas)} hot-expert replicas: exact weights, exchanged per micro-batch",)
    return CostBreakdown(c.model, sum(phases.values()), phases, raw, levels, memory, notes, c.borrowed_copies,
                         c.borrowed_reason)
