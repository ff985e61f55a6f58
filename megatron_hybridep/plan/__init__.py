"""plan/: where the ranks are, what the model sends, and which ranks share experts.

Pure Python + numpy (never torch or Megatron), so the planner, simulator and CLI run anywhere.

    topo = Topology.from_yaml("configs/topologies/2dc_x_8.yaml")      # or slurm.topology_from_slurm(...)
    work = Workload.from_yaml("configs/models/paper-l.yaml")
    result = choose_plan(topo, work)             # every feasible plan, costed; result.best is a Plan
    result.best.domains, result.best.rails       # expert all-gather groups, token all-to-all groups
    result.best.save("plan.json")

Modules: grid (mixed-radix coordinates), plan (Plan), pairs (Algorithm 1), topology, slurm, model
(ModelSpec: the architecture; load_model reads configs/models and configs/presets), settings (Megatron
flag names -> fields), workload,
network (alpha-beta link model), pipeline (sends between stages, 1F1B and interleaved schedules), cost
(tier b, ours), paper_model (tier a, the paper's), planner, layout (which Megatron layout: TP, PP,
EP, DP, each with its best plan), cli.
"""

from megatron_hybridep.plan.cost import CostBreakdown, CostModel, LevelBreakdown, MemoryBreakdown
from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.model import ModelSpec, load_model
from megatron_hybridep.plan.paper_model import PaperModel
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.planner import (
    Candidate,
    PlanningResult,
    Replan,
    choose_plan,
    choose_plan_all_ep_sizes,
    replan,
)
from megatron_hybridep.plan.topology import EPLayout, Level, LinkOverride, Topology
from megatron_hybridep.plan.workload import Workload

__all__ = [
    "Candidate", "CostBreakdown", "CostModel", "EPLayout", "Level", "LevelBreakdown", "LinkOverride",
    "MemoryBreakdown", "ModelSpec", "PaperModel", "Plan", "PlanError", "PlanningResult", "Replan", "Topology",
    "Workload", "choose_plan", "choose_plan_all_ep_sizes", "load_model", "replan",
]
