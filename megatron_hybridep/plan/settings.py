"""Megatron flag names (configs/presets/*.yaml, pretrain_moe.py's args) as the planner's field names:
the ``base:`` chain of a preset and the one mapping from flags to model and run fields.

Plain dicts only, so model.py (ModelSpec) and presets.py (layouts, memory fit) both build on it.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.fields import load_yaml

# Flags only a preset spells (never a configs/models key): a file stating one is read as a preset.
PRESET_ONLY = ("base", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
               "moe_shared_expert_intermediate_size", "swiglu", "bf16", "fp16", "use_distributed_optimizer",
               "global_batch_size", "expert_model_parallel_size", "hybridep_throughput_tflops")


def load_settings(path: str) -> dict[str, Any]:
    """A preset with its ``base:`` chain merged (the later file wins), as pretrain_moe.py reads it."""
    if not os.path.exists(path):
        raise PlanError(f"{path}: file not found; fix: pass a preset from configs/presets/ (a 'base:' names a "
                        "file beside the preset)")
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


def is_preset(data: Any) -> bool:
    """Whether a YAML mapping uses Megatron flag names (a preset) rather than configs/models field names."""
    return isinstance(data, Mapping) and any(k in data for k in PRESET_ONLY)


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


def settings_fields(s: Mapping[str, Any], source: str = "preset", data_parallel_size: int = 0) -> dict[str, Any]:
    """Workload field names (architecture and run) from Megatron flag names: bf16/fp16 -> 2-byte
    params, fp32 main grads; micro-batches per iteration = global_batch_size / (micro_batch_size x
    ``data_parallel_size``) when both are known, else 1. Flags left unset keep the Workload's defaults."""
    try:
        layers = int(s["num_layers"])
        nbytes = 2 if s.get("bf16") or s.get("fp16") else 4
        expert_ffn = int(s.get("moe_ffn_hidden_size") or s["ffn_hidden_size"])
        shared = s.get("moe_shared_expert_intermediate_size")
        mbs, gbs = int(s.get("micro_batch_size") or 1), int(s.get("global_batch_size") or 0)
        out = dict(
            hidden_size=int(s["hidden_size"]), ffn_hidden_size=expert_ffn, num_experts=int(s["num_experts"]),
            top_k=int(s.get("moe_router_topk", 2)), num_layers=layers,
            num_moe_layers=moe_layer_count(layers, s.get("moe_layer_freq")),
            dense_ffn_hidden_size=int(s["ffn_hidden_size"]),
            shared_experts=math.ceil(int(shared) / expert_ffn) if shared else 0, gated_mlp=bool(s.get("swiglu")),
            num_attention_heads=int(s.get("num_attention_heads") or 0), vocab_size=int(s.get("vocab_size") or 0),
            seq_length=int(s["seq_length"]),
            micro_batch_size=mbs,
            micro_batches=max(1, gbs // (mbs * data_parallel_size)) if gbs and data_parallel_size else 1,
            activation_bytes=nbytes, weight_bytes=nbytes, grad_bytes=nbytes, main_grad_bytes=4,
            distributed_optimizer=bool(s.get("use_distributed_optimizer")),
            overlap_grad_reduce=bool(s.get("overlap_grad_reduce")),
            overlap_param_gather=bool(s.get("overlap_param_gather")),
            ddp_bucket_size=int(s["ddp_bucket_size"]) if s.get("ddp_bucket_size") else None,
            tensor_model_parallel_size=int(s.get("tensor_model_parallel_size") or 1),
            expert_tensor_parallel_size=int(s.get("expert_tensor_parallel_size") or 0),  # 0: TP, as Megatron
            pipeline_model_parallel_size=int(s.get("pipeline_model_parallel_size") or 1))
    except KeyError as exc:
        raise PlanError(f"{source}.{exc.args[0]}: required to describe the model; fix: set it in the preset") from None
    if s.get("hybridep_throughput_tflops"):
        out["throughput_tflops"] = float(s["hybridep_throughput_tflops"])
    return out
