"""The Megatron configurations HybridEP supports (issue 15's matrix), as data in one place.

Each entry names a preset/flag key (Megatron's flag without '--', underscores), the values that
count as "off" (Megatron's default: nothing to prove), the values that are supported when it is on
(None: any value), other settings it requires, and the test that proves it exact against
Megatron's alltoall EP (filled in by the configuration-matrix work; "" = not yet proven).

``GOVERNED`` lists every key that changes how HybridEP has to run (precision, parallel layout,
recompute, router, MoE structure): a preset may set a governed key to a non-off value only when
it is in ``SUPPORTED``. Keys outside it (model shape, learning rate, logging) are free.
:func:`unsupported` checks a preset's settings against both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Supported:
    key: str
    what: str
    off: tuple[Any, ...]                     # values meaning "not used" (Megatron's default)
    values: tuple[Any, ...] | None = None    # supported values when on (None: any)
    requires: Mapping[str, Any] = field(default_factory=dict)  # other keys that must hold these values
    test: str = ""                           # pytest node id proving it exact against alltoall EP


SUPPORTED: tuple[Supported, ...] = (
    Supported("bf16", "bf16 parameters with fp32 main grads", (False, None), (True,)),
    Supported("use_distributed_optimizer", "Megatron's distributed optimizer", (False, None), (True,)),
    Supported("overlap_grad_reduce", "data-parallel gradient reduction overlapped with the backward",
              (False, None), (True,), test="tests/matrix/test_overlap.py::test_overlapped_reductions_match_alltoall"),
    Supported("overlap_param_gather", "parameter all-gather overlapped with the next forward", (False, None),
              (True,), requires={"use_distributed_optimizer": True, "overlap_grad_reduce": True},
              test="tests/matrix/test_overlap.py::test_overlapped_param_gather_with_expert_data_parallelism_matches_alltoall"),
    Supported("tensor_model_parallel_size", "tensor parallelism (with sequence parallelism)", (1, None),
              requires={"sequence_parallel": True}),
    Supported("sequence_parallel", "sequence parallelism (with TP > 1)", (False, None), (True,)),
    Supported("pipeline_model_parallel_size", "pipeline parallelism (1F1B)", (1, None)),
    Supported("recompute_granularity", "activation recompute", (None,), ("full", "selective")),
    Supported("recompute_method", "how full recompute picks layers", (None,), ("uniform", "block"),
              requires={"recompute_granularity": "full"}),
    Supported("recompute_num_layers", "layers per full-recompute unit", (None,),
              requires={"recompute_granularity": "full"}),
    Supported("recompute_modules", "modules selective recompute covers", (None,),
              requires={"recompute_granularity": "selective"}),
    Supported("moe_router_score_function", "DeepSeek-V3 router: sigmoid scores", ("softmax", None), ("sigmoid",)),
    Supported("moe_router_enable_expert_bias", "DeepSeek-V3 router: expert bias (aux-loss-free balancing)",
              (False, None), (True,), requires={"moe_router_score_function": "sigmoid"}),
    Supported("moe_router_topk_scaling_factor", "DeepSeek-V3 router: routed-weight scaling", (None,),
              requires={"moe_router_score_function": "sigmoid"}),
    Supported("moe_shared_expert_intermediate_size", "shared experts", (None,)),
    Supported("moe_layer_freq", "dense first layers / MoE every k layers", (1, None)),
    Supported("moe_expert_capacity_factor", "token dropping with a capacity factor", (None,)),
)

# keys whose non-off values change how HybridEP must run: only SUPPORTED ones may be set
GOVERNED: dict[str, tuple[Any, ...]] = {
    **{s.key: s.off for s in SUPPORTED},
    "fp16": (False, None),
    "context_parallel_size": (1, None),
    "expert_tensor_parallel_size": (None,),
    "virtual_pipeline_model_parallel_size": (None,),
    "num_layers_per_virtual_pipeline_stage": (None,),
    "moe_router_num_groups": (None,),
    "moe_router_group_topk": (None,),
    "moe_token_drop_policy": ("probs", None),
    "moe_pad_expert_input_to_capacity": (False, None),
}

BY_KEY = {s.key: s for s in SUPPORTED}


def unsupported(settings: Mapping[str, Any]) -> list[str]:
    """One line per governed setting a preset uses that the matrix does not support (empty: fine)."""
    out = []
    for key, off in GOVERNED.items():
        value = settings.get(key)
        if value in off:
            continue
        entry = BY_KEY.get(key)
        if entry is None:
            out.append(f"{key}: {value!r} is not in the supported configurations "
                       "(megatron_hybridep/plan/supported.py); fix: drop it")
            continue
        if entry.values is not None and value not in entry.values:
            out.append(f"{key}: {value!r} is not supported (supported: {list(entry.values)}); fix: use one of them")
        for need, want in entry.requires.items():
            if settings.get(need) != want:
                out.append(f"{key}: needs {need}: {want!r} (got {settings.get(need)!r}); fix: set it")
    return out
