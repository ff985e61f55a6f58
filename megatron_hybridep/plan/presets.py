"""A training preset's settings (Megatron flag names, configs/presets/*.yaml) as the planner's
Workload and parallel layout, and whether a plan fits the memory of its paired topology.

The flag names are mapped onto model and run fields once, in settings.py (load_settings, the
``base:`` chain, lives there too so model.py's load_model can read presets).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.model import split_fields
from megatron_hybridep.plan.planner import PlanningResult, choose_plan
from megatron_hybridep.plan.settings import load_settings, moe_layer_count, settings_fields
from megatron_hybridep.plan.topology import Topology
from megatron_hybridep.plan.workload import Workload

__all__ = ["Layout", "fit", "layout", "load_settings", "moe_layer_count", "workload_from_settings"]


@dataclass(frozen=True)
class Layout:
    """The parallel layout a preset asks for on its topology."""

    ep: int
    pp: int
    tp: int
    dp: int

    def __str__(self) -> str:
        return f"EP {self.ep} x PP {self.pp} x TP {self.tp}, DP {self.dp}"


def workload_from_settings(s: Mapping[str, Any], name: str = "preset", data_parallel_size: int = 0) -> Workload:
    """The Workload of a preset's model and layout (the flags mapped by settings.py); micro-batches
    per iteration from global_batch_size over ``data_parallel_size`` when both are known, else 1."""
    spec, run = split_fields({**settings_fields(s, name, data_parallel_size), "name": name}, name)
    return Workload.from_model(spec, name, **run)


def layout(s: Mapping[str, Any], topology: Topology) -> Layout:
    tp = int(s.get("tensor_model_parallel_size") or 1)
    pp = int(s.get("pipeline_model_parallel_size") or 1)
    ep = int(s.get("expert_model_parallel_size") or 1)
    if topology.world_size % (tp * pp):
        raise PlanError(f"tensor_model_parallel_size x pipeline_model_parallel_size: {tp} x {pp} does not divide "
                        f"the {topology.world_size} ranks of {topology.name or topology.source}; fix: change them")
    return Layout(ep, pp, tp, topology.world_size // (tp * pp))


def fit(s: Mapping[str, Any], topology: Topology, name: str = "preset") -> tuple[Layout, PlanningResult]:
    """The preset's layout and the planner's result on ``topology`` with the memory check on (raises
    PlanError naming the shortfall when no plan fits)."""
    lay = layout(s, topology)
    work = workload_from_settings(s, name, lay.dp)
    return lay, choose_plan(topology, work, lay.ep, include_replicated=False)
