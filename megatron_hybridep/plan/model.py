"""The model's architecture, stated once (ModelSpec), and the one loader of the two YAML formats
that describe it: configs/models/*.yaml (Workload field names) and configs/presets/*.yaml
(Megatron flag names, with a ``base:`` chain; mapped in settings.py).

A file also states run quantities (bytes per element, throughput, micro-batches...): load_model
returns them beside the spec, as Workload field names, for ``Workload.from_model(spec, **run)``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.fields import FieldReader, load_yaml
from megatron_hybridep.plan.settings import is_preset, load_settings, settings_fields


@dataclass(frozen=True)
class ModelSpec:
    """A GPT-MoE's shape. Two specs are equal when their architecture is (name and description aside).
    After construction num_layers, num_moe_layers and dense_ffn_hidden_size hold resolved values."""

    hidden_size: int
    ffn_hidden_size: int                 # of one routed expert
    num_experts: int
    top_k: int
    num_layers: int = 0                  # all transformer layers (0 = num_moe_layers)
    num_moe_layers: int = 0              # (0 = num_layers); the other layers are dense
    dense_ffn_hidden_size: int = 0       # FFN of the dense layers (0 = 4 * hidden)
    gated_mlp: bool = False              # SwiGLU MLPs have 3 matrices, plain GELU MLPs 2
    shared_experts: int = 0              # DeepSeek-style always-on experts of ffn_hidden_size
    num_attention_heads: int = 0         # 0 = not stated (TP must then divide hidden_size)
    vocab_size: int = 0                  # embedding rows (0 = embeddings not counted)
    seq_length: int = 2048
    name: str = field(default="", compare=False)
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        def need(cond: bool, fld: str, msg: str, fix: str) -> None:
            if not cond:
                raise PlanError(f"model.{fld}: {msg} (got {getattr(self, fld)!r}); fix: {fix}")

        def integer(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for fld in ("hidden_size", "ffn_hidden_size", "num_experts", "top_k", "seq_length"):
            need(integer(getattr(self, fld)) and getattr(self, fld) >= 1, fld, "must be a positive integer",
                 "set it from the model config")
        for fld in ("num_layers", "num_moe_layers", "dense_ffn_hidden_size", "shared_experts",
                    "num_attention_heads", "vocab_size"):
            need(integer(getattr(self, fld)) and getattr(self, fld) >= 0, fld, "must be an integer >= 0",
                 "set it from the model config")
        need(isinstance(self.gated_mlp, bool), "gated_mlp", "must be true or false", "true for SwiGLU experts")
        need(self.num_layers or self.num_moe_layers, "num_moe_layers", "must be a positive integer",
             "state num_moe_layers (MoE layers) or num_layers (all layers, every one MoE)")
        need(self.top_k <= self.num_experts, "top_k", f"cannot exceed num_experts={self.num_experts}",
             "lower --moe-router-topk")
        need(not (self.num_layers and self.num_moe_layers) or self.num_layers >= self.num_moe_layers, "num_layers",
             f"must be >= num_moe_layers={self.num_moe_layers}", "count all transformer layers")
        object.__setattr__(self, "num_layers", self.num_layers or self.num_moe_layers)
        object.__setattr__(self, "num_moe_layers", self.num_moe_layers or self.num_layers)
        object.__setattr__(self, "dense_ffn_hidden_size", self.dense_ffn_hidden_size or 4 * self.hidden_size)

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def expert_params(self) -> int:
        """Parameters of one routed (or shared) expert."""
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.ffn_hidden_size

    def replace(self, **changes: Any) -> ModelSpec:
        return dataclasses.replace(self, **changes)

    def fields(self) -> dict[str, Any]:
        """Every field by name (Workload spells them the same)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


ARCHITECTURE = tuple(f.name for f in dataclasses.fields(ModelSpec))


def load_model(path: str, run_keys: Collection[str] = ()) -> tuple[ModelSpec, dict[str, Any]]:
    """The model a YAML file describes, in either format, and the run quantities it also states.
    ``run_keys``: the run quantities the caller takes (Workload's); a configs/models file stating
    any other key is refused, naming the closest known one. A preset's run quantities are the
    mapped flags (settings.py) and its name is the file's."""
    data = load_yaml(path)
    if is_preset(data):
        fields = settings_fields(load_settings(path), path)
        fields.setdefault("name", os.path.splitext(os.path.basename(path))[0])
        return split_fields(fields, path)
    return model_from_dict(data, path, run_keys)


def model_from_dict(data: Any, source: str, run_keys: Collection[str] = ()) -> tuple[ModelSpec, dict[str, Any]]:
    """A configs/models mapping (keys = ModelSpec and ``run_keys`` names) as (spec, run); a relative
    routing_counts path is taken relative to a YAML ``source``."""
    r = FieldReader(data, source)
    fields = {k: r.raw(k) for k in (*ARCHITECTURE, *run_keys) if r.has(k)}
    r.seen.update(ARCHITECTURE, run_keys)
    r.done()
    routing = fields.get("routing_counts")
    if isinstance(routing, str) and not os.path.isabs(routing) and source.endswith((".yaml", ".yml")):
        fields["routing_counts"] = os.path.join(os.path.dirname(source), routing)
    return split_fields(fields, source)


def split_fields(fields: Mapping[str, Any], source: str) -> tuple[ModelSpec, dict[str, Any]]:
    """(the ModelSpec of the architecture fields, the other fields); errors name ``source`` and the field."""
    arch = {k: v for k, v in fields.items() if k in ARCHITECTURE}
    run = {k: v for k, v in fields.items() if k not in ARCHITECTURE}
    try:
        return ModelSpec(**arch), run
    except TypeError as exc:  # a required field is missing
        missing = next(f.name for f in dataclasses.fields(ModelSpec)
                       if f.default is dataclasses.MISSING and f.name not in arch)
        raise PlanError(f"{source}.{missing}: required field is missing ({exc}); "
                        "fix: add it (see configs/models/ for examples)") from None
    except PlanError as exc:
        raise PlanError(str(exc).replace("model.", f"{source}: ", 1)) from None
