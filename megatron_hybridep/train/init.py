"""Layout-independent initialisation: the same model, weight for weight, under any TP, PP or EP.

Megatron seeds its RNG per pipeline stage (seed + 100 x PP rank), per TP rank and per EP rank, so
one seed gives a different model in every layout: comparing layouts by loss then mixes the layout
with the initialisation. ``--hybridep-layout-independent-init`` redraws every random parameter from
its global identity instead: the key is its name with the global layer number and the global expert
index, and a TP-sharded parameter is this rank's slice of the full tensor drawn once. The
distribution is Megatron's: normal(0, init_method_std), scaled by 1/sqrt(2 x layers) for the output
projections (linear_proj, linear_fc2); constant parameters (norms, biases) are left as built.
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Any

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_SCALED = (".linear_proj.weight", ".linear_fc2.weight")


def global_name(module: Any, name: str, ep_rank: int) -> str:
    """``name`` of a parameter of one GPTModel chunk with the global layer number and expert index."""
    m = _LAYER.match(name)
    if m:
        layer = module.decoder.layers[int(m.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}." + name[m.end():]
        e = _EXPERT.search(name)
        if e:
            local = layer.mlp.experts.num_local_experts
            name = name[:e.start()] + f".local_experts.{ep_rank * local + int(e.group(1))}." + name[e.end():]
    if name == "output_layer.weight" and getattr(module, "share_embeddings_and_output_weights", False):
        return "embedding.word_embeddings.weight"  # tied: the first stage's embedding
    return name


def std_for(name: str, config: Any) -> float:
    """Megatron's init std of a random parameter (TransformerConfig's init_method / output_layer_init_method)."""
    std = config.init_method_std
    return std / math.sqrt(2.0 * config.num_layers) if name.endswith(_SCALED) else std


def _draw(key: str, seed: int, shape: tuple[int, ...], std: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    return torch.randn(shape, generator=g, dtype=torch.float32) * std


def reinitialize(module: Any, config: Any, seed: int) -> int:
    """Redraw every non-constant parameter of ``module`` (one GPTModel chunk, before DDP wraps it)
    from its global identity (module doc). Returns how many parameters were redrawn."""
    from megatron.core import parallel_state as ps

    ep_rank = ps.get_expert_model_parallel_rank()
    done = 0
    with torch.no_grad():
        for name, p in module.named_parameters():
            flat = p.detach().reshape(-1)
            if flat.numel() == 0 or bool((flat == flat[0]).all()):
                continue  # norms and biases: constant in every layout
            key = global_name(module, name, ep_rank)
            shape = tuple(p.shape)
            dim = getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1
            expert = not getattr(p, "allreduce", True)
            size = (ps.get_expert_tensor_parallel_world_size() if expert else ps.get_tensor_model_parallel_world_size())
            if dim >= 0 and size > 1:
                rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
                full = list(shape)
                full[dim] *= size
                value = _draw(key, seed, tuple(full), std_for(name, config)).chunk(size, dim)[rank]
            else:
                value = _draw(key, seed, shape, std_for(name, config))
            p.copy_(value.to(p.dtype))
            done += 1
    return done


__all__ = ["global_name", "reinitialize", "std_for"]
