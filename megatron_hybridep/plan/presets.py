"""A training preset's settings (Megatron flag names, configs/presets/*.yaml) as the planner's
Workload and parallel layout, and whether a plan fits the memory of its paired topology.

The Workload stays the one description of the model: this only maps flag names onto it.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.fields import load_yaml
from megatron_hybridep.plan.planner import PlanningResult, choose_plan
from megatron_hybridep.plan.topology import Topology
from megatron_hybridep.plan.workload import Workload


def load_settings(path: str) -> dict[str, Any]:
    """A preset with its ``base:`` chain merged (the later file wins), as pretrain_moe.py reads it."""
    data = load_yaml(path) or {}
    if not isinstance(data, dict):
        raise PlanError(f"{path}: expected a mapping of flag names to values")
    data = dict(data)
    base = data.pop("base", None)
    if base is None:
        return data
    merged = load_settings(os.path.join(os.path.dirname(path), base))
    merged.update(data)
    return merged


def moe_layer_count(num_layers: int, freq: Any) -> int:
    """MoE layers under Megatron's --moe-layer-freq: an int k (every k-th layer, from layer 0) or a
    pattern like "([0]*3+[1]*58)" (1 = MoE), which must list every layer."""
    if freq is None:
        return num_layers
    if isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1:
        return math.ceil(num_layers / freq)
    text = str(freq)
    if not re.fullmatch(r"[\s\[\]()01*+,0-9]+", text):
        raise PlanError(f"moe_layer_freq: cannot read {freq!r}; fix: an integer or a list pattern like "
                        "([0]*3+[1]*58)")
    pattern = eval(text, {"__builtins__": {}}, {})  # noqa: S307 - digits, brackets and * + only (checked)
    pattern = list(pattern) if isinstance(pattern, list | tuple) else [pattern]
    if len(pattern) != num_layers or any(x not in (0, 1) for x in pattern):
        raise PlanError(f"moe_layer_freq: {freq!r} gives {len(pattern)} entries for {num_layers} layers; fix: one "
                        "0 (dense) or 1 (MoE) per layer")
    return int(sum(pattern))


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
    """The Workload of a preset's model and layout (bf16/fp16 -> 2-byte params, fp32 main grads);
    micro-batches per iteration = global_batch_size / (micro_batch_size x ``data_parallel_size``)
    when both are known, else 1."""
    try:
        layers = int(s["num_layers"])
        half = bool(s.get("bf16") or s.get("fp16"))
        expert_ffn = int(s.get("moe_ffn_hidden_size") or s["ffn_hidden_size"])
        shared = s.get("moe_shared_expert_intermediate_size")
        mbs, gbs = int(s.get("micro_batch_size") or 1), int(s.get("global_batch_size") or 0)
        m = max(1, gbs // (mbs * data_parallel_size)) if gbs and data_parallel_size else 1
        return Workload(
            hidden_size=int(s["hidden_size"]), ffn_hidden_size=expert_ffn, num_experts=int(s["num_experts"]),
            top_k=int(s.get("moe_router_topk", 2)), num_layers=layers,
            num_moe_layers=moe_layer_count(layers, s.get("moe_layer_freq")),
            dense_ffn_hidden_size=int(s["ffn_hidden_size"]), shared_experts=math.ceil(int(shared) / expert_ffn)
            if shared else 0, gated_mlp=bool(s.get("swiglu")), seq_length=int(s["seq_length"]),
            micro_batch_size=mbs, micro_batches=m, activation_bytes=2 if half else 4,
            weight_bytes=2 if half else 4, grad_bytes=2 if half else 4, main_grad_bytes=4,
            distributed_optimizer=bool(s.get("use_distributed_optimizer")),
            overlap_grad_reduce=bool(s.get("overlap_grad_reduce")),
            overlap_param_gather=bool(s.get("overlap_param_gather")),
            ddp_bucket_size=int(s["ddp_bucket_size"]) if s.get("ddp_bucket_size") else None,
            tensor_model_parallel_size=int(s.get("tensor_model_parallel_size") or 1),
            pipeline_model_parallel_size=int(s.get("pipeline_model_parallel_size") or 1),
            vocab_size=int(s.get("vocab_size") or 0),
            throughput_tflops=float(s.get("hybridep_throughput_tflops") or 300.0), name=name)
    except KeyError as exc:
        raise PlanError(f"{name}.{exc.args[0]}: required to describe the model; fix: set it in the preset") from None


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
