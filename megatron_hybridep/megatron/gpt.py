"""A Megatron-Core GPT-MoE (GPTModel + DistributedDataParallel + Megatron optimizer) and one
training step, as Megatron's own training loop does it. Shared by pretrain_moe.py's CPU loop, the
tests and the benchmarks, so they all exercise the same Megatron code."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class GPTMoEArgs:
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    num_experts: int = 8
    topk: int = 2
    vocab_size: int = 256
    seq_length: int = 64
    micro_batch_size: int = 4
    dispatcher: str = "alltoall"
    aux_loss_coeff: float = 1e-2
    lr: float = 3e-3
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    seed: int = 1234
    expert_model_parallel_size: int = 1
    # torch.float64 for exactness tests: HybridEP vs alltoall then differ only by float64 rounding
    params_dtype: torch.dtype = torch.float32
    extra_config: dict[str, Any] = field(default_factory=dict)  # more TransformerConfig fields


@dataclass
class TrainState:
    args: GPTMoEArgs
    model: Any  # megatron DistributedDataParallel
    optimizer: Any
    config: Any
    iteration: int = 0


def initialize_parallel(args: GPTMoEArgs) -> None:
    """Megatron model-parallel state and RNG (torch.distributed must be initialised)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=args.expert_model_parallel_size)
    model_parallel_cuda_manual_seed(args.seed)


def transformer_config(args: GPTMoEArgs):  # noqa: ANN201 - TransformerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, moe_ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_moe_experts=args.num_experts,
        moe_router_topk=args.topk, moe_router_pre_softmax=args.topk == 1,
        moe_token_dispatcher_type=args.dispatcher, moe_aux_loss_coeff=args.aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss" if args.aux_loss_coeff else "none",
        expert_model_parallel_size=args.expert_model_parallel_size,
        use_cpu_initialization=True, add_bias_linear=False, bf16=False, fp16=False,
        params_dtype=args.params_dtype, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False,
    )
    kwargs.update(args.extra_config)
    return TransformerConfig(**kwargs)


def build(args: GPTMoEArgs) -> TrainState:
    """GPTModel (local layer spec, SequentialMLP experts) wrapped in Megatron DDP, plus Adam."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = transformer_config(args)
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False)
    default = torch.get_default_dtype()
    torch.set_default_dtype(args.params_dtype)  # torch LayerNorm ignores config.params_dtype
    try:
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab_size,
                         max_sequence_length=args.seq_length, position_embedding_type="rope")
    finally:
        torch.set_default_dtype(default)
    # Reducing in fp32 would round float64 gradients; for fp32 params it changes nothing.
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=args.params_dtype != torch.float64,
                                               overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    model.broadcast_params()  # dense weights identical across data-parallel ranks
    opt_config = OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=args.weight_decay,
                                 clip_grad=args.clip_grad, bf16=False, fp16=False,
                                 use_distributed_optimizer=False)
    optimizer = get_megatron_optimizer(opt_config, [model])
    return TrainState(args=args, model=model, optimizer=optimizer, config=config)


def forward_loss(state: TrainState, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of one micro-batch (the MoE aux loss rides on the backward pass)."""
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    per_token = state.model(input_ids=tokens, position_ids=position_ids, attention_mask=None,
                            labels=labels)
    # Megatron averages in fp32 (bf16/fp16 runs); float64 runs keep float64, or losses would round
    return per_token.to(torch.promote_types(per_token.dtype, torch.float32)).mean()


Batch = tuple[torch.Tensor, torch.Tensor]


def train_step(state: TrainState, tokens: torch.Tensor | Sequence[Batch],
               labels: torch.Tensor | None = None) -> dict[str, float]:
    """One iteration as Megatron's training loop runs it: ``train_step(state, tokens, labels)`` for
    one micro-batch or ``train_step(state, [(tokens, labels), ...])`` for M, through Megatron's
    schedule (get_forward_backward_func: no_sync for all but the last micro-batch, then
    finalize_model_grads), with the borrowed experts' gradient sync installed (grad_sync), and the
    optimizer step. Returns the mean per-token loss over the micro-batches and the grad norm."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_hybridep.megatron import grad_sync
    from megatron_hybridep.runtime.context import get_runtime

    batches = [(tokens, labels)] if labels is not None else list(tokens)  # type: ignore[arg-type]
    if not batches:
        raise ValueError("train_step: no micro-batches; fix: pass (tokens, labels) or a non-empty list of them")
    runtime = get_runtime()
    grad_sync.install(state.config, [state.model], runtime)  # idempotent; the bench may pre-set finalize
    state.config.grad_scale_func = state.optimizer.scale_loss
    state.model.zero_grad_buffer()
    state.optimizer.zero_grad()
    shape = batches[0][0].shape
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(batches), model=[state.model],
        num_microbatches=len(batches), seq_length=shape[1], micro_batch_size=shape[0], forward_only=False)
    ok, grad_norm, _ = state.optimizer.step()
    if not ok:
        raise RuntimeError(f"optimizer step {state.iteration} skipped (non-finite gradients)")
    state.iteration += 1
    if runtime is not None:
        runtime.after_optimizer_step()  # next iteration's first expert gather overlaps data loading
    total = torch.stack([x["lm loss"] for x in losses]).sum(dim=0)
    return {"loss": (total[0] / total[1]).item(), "grad_norm": float(grad_norm or 0.0)}


def _forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
    """Megatron's forward_step_func: the per-token losses and a loss function returning (sum, count,
    report); Megatron divides by both the count and the number of micro-batches."""
    tokens, labels = next(data_iterator)
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    per_token = model(input_ids=tokens, position_ids=position_ids, attention_mask=None, labels=labels)

    def loss_func(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        wide = torch.promote_types(out.dtype, torch.float32)
        total = out.to(wide).sum()
        count = torch.tensor(labels.numel(), dtype=torch.int)
        return total, count, {"lm loss": torch.stack([total.detach(), count.to(wide)])}

    return per_token, loss_func


def replace_args(args: GPTMoEArgs, **changes: Any) -> GPTMoEArgs:
    return dataclasses.replace(args, **changes)
