"""Building blocks for exactness tests and benchmarks: a Megatron MoE layer with weights taken from
one global, seeded set, and an independent pure-torch reference of the same MoE math.

The reference is the oracle's oracle: it shares no code with Megatron, so a CPU-runtime patch that
changed Megatron's numerics would show up as a mismatch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MoESpec:
    hidden: int = 16
    ffn: int = 32
    experts: int = 8
    top_k: int = 2
    aux_loss_coeff: float = 0.0
    seq: int = 12
    batch: int = 2
    dispatcher: str = "alltoall"
    seed: int = 1234
    dtype: torch.dtype = torch.float32  # float64 for exactness tests (values drawn in fp32, then cast)
    pre_softmax: bool | None = None  # None: Megatron's requirement (pre-softmax iff top-1)
    extra: dict = field(default_factory=dict)  # more TransformerConfig fields

    @property
    def use_pre_softmax(self) -> bool:
        return self.top_k == 1 if self.pre_softmax is None else self.pre_softmax


@dataclass
class GlobalWeights:
    """All experts' weights, identical on every rank (generated from the spec's seed)."""

    router: torch.Tensor  # [E, H]
    fc1: torch.Tensor  # [E, F, H]
    fc2: torch.Tensor  # [E, H, F]


def global_weights(spec: MoESpec) -> GlobalWeights:
    g = torch.Generator().manual_seed(spec.seed)
    h, f, e = spec.hidden, spec.ffn, spec.experts
    return GlobalWeights(
        router=(torch.randn(e, h, generator=g) * 0.5).to(spec.dtype),
        fc1=(torch.randn(e, f, h, generator=g) / h**0.5).to(spec.dtype),
        fc2=(torch.randn(e, h, f, generator=g) / f**0.5).to(spec.dtype),
    )


def rank_input(spec: MoESpec, rank: int, step: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(spec.seed * 1000 + rank * 17 + step)
    return torch.randn(spec.seq, spec.batch, spec.hidden, generator=g).to(spec.dtype)


def layer_config(spec: MoESpec, **overrides: object):  # noqa: ANN201 - TransformerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=1, hidden_size=spec.hidden, ffn_hidden_size=spec.ffn, moe_ffn_hidden_size=spec.ffn,
        num_attention_heads=4, num_moe_experts=spec.experts, moe_router_topk=spec.top_k,
        moe_token_dispatcher_type=spec.dispatcher, moe_aux_loss_coeff=spec.aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss" if spec.aux_loss_coeff else "none",
        moe_router_pre_softmax=spec.use_pre_softmax, use_cpu_initialization=True, add_bias_linear=False,
        bf16=False, fp16=False, params_dtype=spec.dtype,
    )
    kwargs.update(spec.extra)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_moe_layer(spec: MoESpec, ep_rank: int, ep_size: int, *, grouped_gemm: bool = False,  # noqa: ANN201
                    transformer_engine: bool = False, **config_overrides: object):
    """A Megatron MoE layer holding this EP rank's slice of the global weights: the local spec's
    SequentialMLP by default; ``grouped_gemm`` with ``transformer_engine`` gives TEGroupedMLP
    (megatron-core 0.19 has no non-TE grouped experts: the local backend then builds SequentialMLP).
    Model parallel state must be initialised by the caller."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_hybridep.megatron import hybridep_moe_spec

    if grouped_gemm:
        config_overrides.setdefault("moe_grouped_gemm", True)
    config = layer_config(spec, **config_overrides)
    build = hybridep_moe_spec(get_moe_module_spec(use_te=transformer_engine, num_experts=spec.experts,
                                                  moe_grouped_gemm=grouped_gemm))
    layer = build(config=config)
    load_global_weights(layer, global_weights(spec), ep_rank, ep_size)
    return layer


def expert_weights(layer: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(fc1, fc2) weight of each local expert: SequentialMLP's local_experts.<i> or grouped-GEMM
    experts' weight<i> (TEGroupedMLP)."""
    experts = layer.experts
    if hasattr(experts, "local_experts"):
        return [(e.linear_fc1.weight, e.linear_fc2.weight) for e in experts.local_experts]
    fc1, fc2 = experts.linear_fc1, experts.linear_fc2
    if getattr(fc1, "weight0", None) is None:
        raise ValueError(f"{type(experts).__name__}: expected per-expert weight<i> parameters (TE GroupedLinear "
                         "without single_grouped_weight)")
    return [(getattr(fc1, f"weight{i}"), getattr(fc2, f"weight{i}")) for i in range(experts.num_local_experts)]


def load_global_weights(layer: torch.nn.Module, w: GlobalWeights, ep_rank: int, ep_size: int) -> None:
    n_local = w.fc1.shape[0] // ep_size
    with torch.no_grad():
        layer.router.weight.copy_(w.router)
        for i, (fc1, fc2) in enumerate(expert_weights(layer)):
            e = ep_rank * n_local + i
            fc1.copy_(w.fc1[e])
            fc2.copy_(w.fc2[e])


def reference_moe(x: torch.Tensor, w: GlobalWeights, top_k: int, aux_loss_coeff: float = 0.0,
                  pre_softmax: bool = False, top_idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch MoE forward on one rank's tokens: (output, aux_loss).

    Megatron's routing: top-k over logits then softmax over the k selected (or, pre-softmax, top-k
    of the softmax over all experts); GELU MLP experts;
    Switch load-balancing loss E*coeff/(k*T^2) * sum_e(sum_t softmax(logits)_te * count_e).
    Megatron's precision contract: routing scores in float32, probabilities cast back to the
    logits' dtype (a no-op in float32; in float64 the probabilities carry float32 rounding).
    ``top_idx`` [tokens, top_k]: route as given (a bf16 run's choice: a near-tie that bf16 breaks
    the other way would otherwise compare different experts).
    """
    shape = x.shape
    tokens = x.reshape(-1, shape[-1])
    logits = tokens @ w.router.t()
    if pre_softmax:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_probs, top_idx = (torch.topk(scores, top_k, dim=-1) if top_idx is None
                              else (scores.gather(1, top_idx), top_idx))
    else:
        top_logits, top_idx = (torch.topk(logits, top_k, dim=-1) if top_idx is None
                               else (logits.gather(1, top_idx), top_idx))
        top_probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32)
    top_probs = top_probs.to(logits.dtype)
    out = torch.zeros_like(tokens)
    for e in range(w.fc1.shape[0]):
        rows, slot = (top_idx == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        h = F.gelu(tokens[rows] @ w.fc1[e].t()) @ w.fc2[e].t()
        out = out.index_add(0, rows, h * top_probs[rows, slot].unsqueeze(-1))
    aux = logits.new_zeros(())
    if aux_loss_coeff:
        num_experts, t = w.fc1.shape[0], tokens.shape[0]
        counts = torch.zeros(num_experts).index_add_(0, top_idx.reshape(-1), torch.ones(top_idx.numel()))
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        aux = (scores.sum(0) * counts).sum() * num_experts * aux_loss_coeff / (top_k * t * t)
    return out.reshape(shape), aux


def reference_grads(spec: MoESpec, world: int, rank: int, *, cast: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    routes: Sequence[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every rank's tokens through :func:`reference_moe` in one process, with the upstream gradient
    ``rank_input(spec, r, step=99)``: rank ``rank``'s output and input and router gradients ("out",
    "dx", "router") and every expert's ("fc1", "fc2"). ``cast``: applied to the weights, inputs and
    upstream gradients first (e.g. the bf16 rounding a GPU layer sees); ``routes``: per rank, the
    experts to route to (``top_idx``; default: the reference's own choice)."""
    as_seen = cast if cast is not None else (lambda t: t)
    w = global_weights(spec)
    w.router, w.fc1, w.fc2 = (as_seen(t).requires_grad_(True) for t in (w.router, w.fc1, w.fc2))
    mine: dict[str, torch.Tensor] = {}
    for r in range(world):
        x = as_seen(rank_input(spec, r)).requires_grad_(True)
        out, aux = reference_moe(x, w, spec.top_k, spec.aux_loss_coeff, spec.use_pre_softmax,
                                 top_idx=None if routes is None else routes[r])
        dy = as_seen(rank_input(spec, r, step=99))
        before = w.router.grad.clone() if w.router.grad is not None else 0
        (out * dy).sum().add(aux).backward()
        if r == rank:
            mine = {"out": out.detach(), "dx": x.grad, "router": w.router.grad - before}
    mine["fc1"], mine["fc2"] = w.fc1.grad, w.fc2.grad
    return mine
