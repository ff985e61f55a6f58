"""Model side of `hybridep bench`: the benchmarked model's shape, the testbed as a plan Topology, the
Workload of each point (fed with compute times measured on the unshaped testbed), the planner's
choice and the cost model's predicted step time per phase. Pure Python + plan/: no torch.

How a prediction is made (per system, plan and point):

    predicted = measured unshaped step  +  network(shaped rate) - network(unshaped rate)

- "measured unshaped step": the same system and plan on the same testbed with the WAN rate removed
  (calibration phase): compute, framework overhead and the CPU cost of communication. T_pre and the
  expert speed measured there are also fed to the Workload (t_pre_ms, throughput_tflops).
- "network(rate)": the cost model's (plan/cost.py) per-occurrence times, combined the way this
  runtime executes them: token all-to-alls (4 per MoE layer) exposed; each expert all-gather hidden
  behind the compute it overlaps (the runtime prefetches it, from the previous layer's experts or
  the previous optimizer step to its use: measured unshaped as the gather's issue-to-use time; T_pre
  if unknown); the gradient return, the expert-data-parallel all-reduce (replicated plan) and the
  dense-parameter all-reduce exposed (gpt.py builds DDP with overlap_grad_reduce=False and the
  gradient return is a blocking collective in the backward pass). The dense all-reduce is absent
  from the cost model (every plan pays it) and is added here with the same ring primitive.
- Backend fact the planner is told too: gloo's reduce_scatter is an all-reduce followed by a local
  slice (measured on the testbed: 2x the bytes of a reduce-scatter), so the gradient return ships
  2 x (S-1) x own experts' gradients, not 1 x. Workload.compressed_grad_bytes carries that factor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron_hybridep.plan.cost import CostModel
from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.network import Family
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.planner import PlanningResult, choose_plan
from megatron_hybridep.plan.topology import Level, Topology
from megatron_hybridep.plan.workload import Workload

FP32 = 4  # bytes per element: the CPU runtime trains in fp32 (activations, weights, gradients)
GLOO_REDUCE_SCATTER_FACTOR = 2.0  # gloo runs reduce_scatter as all-reduce + slice
PHASES = ("token_a2a", "expert_gather", "grad_return", "expert_grad_allreduce", "dense_grad_allreduce")


@dataclass(frozen=True)
class ModelShape:
    """The GPT-MoE the bench trains (every layer MoE, GELU experts, fp32 on CPU)."""

    name: str = "bench-cpu"
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 64
    num_attention_heads: int = 4
    num_experts: int = 8
    topk: int = 2
    vocab_size: int = 256

    def gpt_args(self, seq_length: int) -> dict[str, Any]:
        """GPTMoEArgs fields (megatron/gpt.py)."""
        return {"num_layers": self.num_layers, "hidden_size": self.hidden_size,
                "ffn_hidden_size": self.ffn_hidden_size, "num_attention_heads": self.num_attention_heads,
                "num_experts": self.num_experts, "topk": self.topk, "vocab_size": self.vocab_size,
                "seq_length": seq_length}

    @property
    def expert_params(self) -> int:
        return 2 * self.hidden_size * self.ffn_hidden_size

    def token_traffic_bytes(self, tokens: int) -> float:
        """Token bytes one rank dispatches per iteration under EP: 4 all-to-alls (dispatch, combine,
        and both again in the backward) per MoE layer, one row per selected expert."""
        return 4.0 * self.num_layers * tokens * self.topk * self.hidden_size * FP32

    def check(self, world: int) -> None:
        if self.num_experts % world:
            raise PlanError(f"model.num_experts: {self.num_experts} experts cannot be split over {world} ranks; "
                            f"fix: use a multiple of {world} or change --dcs/--ranks-per-dc")
        if self.hidden_size % self.num_attention_heads:
            raise PlanError(f"model.hidden_size: {self.hidden_size} is not divisible by "
                            f"{self.num_attention_heads} attention heads; fix: use a multiple of it")


BUILTIN = ModelShape()


def load_model(path: str) -> ModelShape:
    """A configs/models/*.yaml Workload as the bench's model (all layers MoE, GELU experts)."""
    w = Workload.from_yaml(path)
    problems = []
    if w.layers != w.num_moe_layers:
        problems.append(f"num_layers ({w.num_layers}) must equal num_moe_layers ({w.num_moe_layers}): "
                        "the bench's GPT has an MoE block in every layer")
    if w.gated_mlp:
        problems.append("gated_mlp must be false: the bench's experts are GELU MLPs")
    if w.shared_experts:
        problems.append("shared_experts must be 0")
    if problems:
        raise PlanError(f"{path}: " + "; ".join(problems) + "; fix: write a bench model YAML without them")
    heads = max(1, w.hidden_size // 16)
    return ModelShape(name=w.name or path, num_layers=w.num_moe_layers, hidden_size=w.hidden_size,
                      ffn_hidden_size=w.ffn_hidden_size, num_attention_heads=heads,
                      num_experts=w.num_experts, topk=w.top_k)


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

    def workload(self, shape: ModelShape, tokens: int, seq: int) -> Workload:
        per_copy = self.expert_fwd_s / max(self.expert_rows, 1.0)
        tflops = 2.0 * shape.expert_params / per_copy / 1e12 if per_copy > 0 else 1.0
        return Workload(
            hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
            num_experts=shape.num_experts, top_k=shape.topk, num_moe_layers=shape.num_layers,
            num_layers=shape.num_layers, seq_length=seq, micro_batch_size=tokens // seq,
            activation_bytes=FP32, weight_bytes=FP32, grad_bytes=FP32,
            t_pre_ms=self.t_pre_s / shape.num_layers * 1e3, throughput_tflops=tflops,
            compressed_grad_bytes=GLOO_REDUCE_SCATTER_FACTOR * shape.expert_params * FP32,
            name=shape.name)


def system_plan(system: str, topology: Topology, num_experts: int) -> Plan:
    """The plan a baseline runs, in the planner's terms (for its predicted time)."""
    layout = topology.ep_layout(topology.world_size)
    if system == "ep":
        return Plan.grid(layout.counts, (1,) * len(layout.counts), num_experts, layout.names)
    if system == "replicated":
        return Plan.replicated(layout.counts, num_experts, layout.names)
    raise ValueError(f"system {system!r} has no fixed plan")


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
                 gather_window_s: float | None = None) -> NetworkTime:
    """The cost model's per-occurrence times combined as this runtime runs them (module doc).
    gather_window_s: compute one layer's prefetched gather overlaps (measured; default T_pre)."""
    cost = CostModel(topology, workload)
    cb = cost.evaluate(plan)
    raw, Lm = cb.raw, workload.num_moe_layers
    net = cost.network
    window = workload.t_pre if gather_window_s is None else gather_window_s
    seconds = {
        "token_a2a": 4 * Lm * raw["a2a"],
        "expert_gather": Lm * max(0.0, raw["expert_allgather"] - window),
        "grad_return": Lm * raw["grad_return"],  # compressed_grad_bytes carries gloo's factor 2
        "expert_grad_allreduce": Lm * raw["expert_grad_allreduce"],
    }
    world = topology.world_size
    dense = net.ring(Family(topology.level_counts, (1,) * len(topology.levels)),
                     2 * (world - 1) / world * dense_params * FP32, 2 * (world - 1))
    seconds["dense_grad_allreduce"] = dense.seconds
    # bytes through a DC uplink (level 0), one direction, per iteration
    dc = next(lv for lv in cb.levels if lv.name == topology.levels[0].name)
    uplink = dc.uplink_bytes + dense.uplink_bytes[0]
    return NetworkTime(seconds, uplink)


@dataclass(frozen=True)
class Prediction:
    total: float  # predicted step seconds
    base: float  # measured unshaped step seconds it starts from
    phases: dict[str, float]  # shaped - unshaped network seconds per phase
    planner_total: float  # the cost model's own total (its overlap assumptions, no residual)
    dc_uplink_bytes: float  # predicted payload per DC uplink and direction per iteration


def predict(shaped: Topology, unshaped: Topology, workload: Workload, plan: Plan, dense_params: int,
            unshaped_step_s: float, gather_window_s: float | None = None) -> Prediction:
    hi = network_time(shaped, workload, plan, dense_params, gather_window_s)
    lo = network_time(unshaped, workload, plan, dense_params, gather_window_s)
    phases = {k: hi.seconds[k] - lo.seconds[k] for k in PHASES}
    planner = CostModel(shaped, workload).evaluate(plan).total
    return Prediction(unshaped_step_s + sum(phases.values()), unshaped_step_s, phases, planner, hi.dc_uplink_bytes)


def plan_for_point(topology: Topology, workload: Workload, ep_size: int) -> PlanningResult:
    """The planner's choice for one point (its own cost model, every candidate incl. replicated)."""
    return choose_plan(topology, workload, ep_size)


def best_domains_plan(result: PlanningResult) -> Plan:
    """HybridEP runs the planner's best HybridEP (domains) plan; the replicated plan is a baseline."""
    plan = next(c.plan for c in result.candidates if c.plan.kind == "domains")
    return dataclasses.replace(plan, predicted={}, link_bytes={})


__all__ = ["BUILTIN", "Calibration", "ModelShape", "NetworkTime", "PHASES", "Prediction", "best_domains_plan",
           "candidate_plans", "load_model", "network_time", "plan_for_point", "predict", "system_plan",
           "testbed_topology"]
