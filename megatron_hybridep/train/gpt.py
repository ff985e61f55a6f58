"""The one model builder (GPTModel chunks + Megatron's DistributedDataParallel) and the one
training step (``run_iteration``), as Megatron's own training loop does them. pretrain_moe.py's CPU
loop builds from Megatron args through ``build_chunks``; ``build``/``train_step`` are the same on a
small keyword config (GPTMoEArgs) for the bench, the benchmarks and the tests."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from megatron_hybridep.plan.model import ModelSpec


@dataclass
class GPTMoEArgs:
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    num_experts: int = 8
    top_k: int = 2
    vocab_size: int = 256
    seq_length: int = 64
    micro_batch_size: int = 4
    dispatcher: str = "alltoall"
    aux_loss_coeff: float = 1e-2
    lr: float = 3e-3
    min_lr: float | None = None  # an LR schedule's floor (Megatron keeps it per parameter group)
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    seed: int = 1234
    expert_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1  # Megatron's rank order: stages outermost
    overlap_grad_reduce: bool = False      # Megatron DDP's --overlap-grad-reduce
    # torch.float64 for exactness tests: HybridEP vs alltoall then differ only by float64 rounding
    params_dtype: torch.dtype = torch.float32
    extra_config: dict[str, Any] = field(default_factory=dict)  # more TransformerConfig fields

    @classmethod
    def from_model(cls, spec: ModelSpec, **run: Any) -> GPTMoEArgs:
        """The args for ``spec`` with run settings ``run`` (fields of this class; seq_length overrides
        the spec's). build() makes every layer MoE with GELU experts of ffn_hidden_size, so a spec it
        cannot build is refused."""
        cannot = [what for what, bad in (
            ("dense layers", spec.num_layers != spec.num_moe_layers), ("gated (SwiGLU) experts", spec.gated_mlp),
            ("shared experts", spec.shared_experts), ("no num_attention_heads", not spec.num_attention_heads),
            ("no vocab_size", not spec.vocab_size)) if bad]
        if cannot:
            raise ValueError(f"GPTMoEArgs.from_model: {spec.name or 'the model'} has {', '.join(cannot)}; fix: a "
                             "spec with every layer MoE, GELU experts, heads and vocabulary stated")
        shape = dict(num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
                     num_attention_heads=spec.num_attention_heads, num_experts=spec.num_experts, top_k=spec.top_k,
                     vocab_size=spec.vocab_size, seq_length=spec.seq_length)
        return cls(**{**shape, **run})


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
    ps.initialize_model_parallel(expert_model_parallel_size=args.expert_model_parallel_size,
                                 pipeline_model_parallel_size=args.pipeline_model_parallel_size)
    model_parallel_cuda_manual_seed(args.seed)


def transformer_config(args: GPTMoEArgs):  # noqa: ANN201 - TransformerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, moe_ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_moe_experts=args.num_experts,
        moe_router_topk=args.top_k, moe_router_pre_softmax=args.top_k == 1,
        moe_token_dispatcher_type=args.dispatcher, moe_aux_loss_coeff=args.aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss" if args.aux_loss_coeff else "none",
        expert_model_parallel_size=args.expert_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, pipeline_dtype=args.params_dtype,
        use_cpu_initialization=True, add_bias_linear=False, bf16=False, fp16=False,
        params_dtype=args.params_dtype, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False,
    )
    kwargs.update(args.extra_config)
    return TransformerConfig(**kwargs)


def build(args: GPTMoEArgs) -> TrainState:
    """GPTModel (local layer spec, SequentialMLP experts) wrapped in Megatron DDP, plus Adam."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = transformer_config(args)
    spec = layer_spec(args.num_experts)
    # Reducing in fp32 would round float64 gradients; for fp32 params it changes nothing.
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=args.params_dtype != torch.float64,
                                               overlap_grad_reduce=args.overlap_grad_reduce,
                                               use_distributed_optimizer=False)
    (model,) = build_chunks(config, spec, ddp_config, vocab_size=args.vocab_size,
                            max_sequence_length=args.seq_length, params_dtype=args.params_dtype)
    set_overlap_hooks(config, [model], grad_reduce=args.overlap_grad_reduce)
    opt_config = OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                                 clip_grad=args.clip_grad, bf16=False, fp16=False,
                                 use_distributed_optimizer=False)
    optimizer = get_megatron_optimizer(opt_config, [model])
    return TrainState(args=args, model=model, optimizer=optimizer, config=config)


def layer_spec(num_experts: int, *, qk_layernorm: bool = False, grouped_gemm: bool = False,
               transformer_engine: bool = False) -> Any:
    """Megatron's GPT layer spec, the local one (CPU, SequentialMLP experts) or Transformer Engine's,
    with its MoE module built as HybridEPMoELayer (plain MoELayer unless the config asks for hybridep)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from megatron_hybridep.megatron import hybridep_layer_spec

    if transformer_engine:
        return hybridep_layer_spec(specs.get_gpt_layer_with_transformer_engine_spec(num_experts, grouped_gemm,
                                                                                   qk_layernorm))
    return hybridep_layer_spec(specs.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=grouped_gemm,
                                                              qk_layernorm=qk_layernorm))


def model_kwargs(args: Any) -> dict[str, Any]:
    """GPTModel's arguments from Megatron args, as pretrain_gpt.py passes them."""
    return dict(vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base)


def gpt_model(config: Any, spec: Any, *, vocab_size: int, max_sequence_length: int, vp_stage: int | None = None,
              pre_process: bool | None = None, post_process: bool | None = None, **kwargs: Any) -> Any:
    """One GPTModel chunk (Megatron's get_model calls this per virtual stage on GPUs; build_chunks on
    CPU). pre/post_process default to whether this rank holds the first/last pipeline stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
                    max_sequence_length=max_sequence_length, pre_process=pre_process, post_process=post_process,
                    vp_stage=vp_stage, **{"position_embedding_type": "rope", **kwargs})


def build_chunks(config: Any, spec: Any, ddp_config: Any, *, params_dtype: Any, virtual_stages: int | None = None,
                 init_seed: int | None = None, **model: Any) -> list[Any]:
    """The CPU model builder (pretrain_gpt.py + megatron.training.get_model): one ``gpt_model``
    chunk per virtual pipeline stage of this rank, each wrapped in Megatron's DDP with the dense
    weights broadcast over data-parallel ranks. ``model``: gpt_model's keyword arguments.
    ``init_seed``: redraw the weights layout-independently from it (train/init.py)."""
    from megatron.core.distributed import DistributedDataParallel

    from megatron_hybridep.train.init import reinitialize

    chunks = []
    for stage in range(virtual_stages or 1):
        vp_stage = stage if virtual_stages else None
        with _default_dtype(params_dtype):  # torch's norms ignore config.params_dtype (float64)
            module = gpt_model(config, spec, vp_stage=vp_stage, **model)
        if init_seed is not None:
            reinitialize(module, config, init_seed)
        module.vp_stage = vp_stage
        chunk = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module,
                                        disable_bucketing=stage > 0)
        chunk.broadcast_params()
        chunks.append(chunk)
    return chunks


def set_overlap_hooks(config: Any, chunks: list[Any], *, grad_reduce: bool, align_grad_reduce: bool = True,
                      param_gather: bool = False) -> None:
    """The schedule's hooks Megatron's train() sets for the overlap flags: under PP the schedule then
    starts each chunk's gradient reduction itself, and (interleaved) its parameter all-gather.
    ``param_gather``: --overlap-param-gather with --align-param-gather."""
    def one_or_list(fs: list[Any]) -> Any:
        return fs[0] if len(fs) == 1 else fs

    if grad_reduce:
        config.no_sync_func = one_or_list([c.no_sync for c in chunks])
        if align_grad_reduce:
            config.grad_sync_func = one_or_list([c.start_grad_sync for c in chunks])
    if param_gather:
        config.param_sync_func = one_or_list([c.start_param_sync for c in chunks])


@contextlib.contextmanager
def _default_dtype(dtype: Any) -> Iterator[None]:
    """float64 runs build every parameter in float64; other dtypes leave torch's default alone."""
    if dtype != torch.float64:
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class StepResult:
    loss: float       # this rank's mean per-token loss over the micro-batches (NaN off the last PP stage)
    grad_norm: float
    after_step: Any = None  # what ``after_step`` returned (the scheduler's decision)


def run_iteration(chunks: list[Any], optimizer: Any, config: Any, batches: Sequence[Batch], *,
                  after_step: Callable[[StepResult], Any] | None = None,
                  progress: Callable[[str], None] | None = None) -> StepResult:
    """The one training step every driver runs (pretrain_moe.py's CPU loop, train_step below, the
    bench, the benchmarks, the tests), as Megatron's training loop does it: Megatron's schedule over
    all micro-batches (get_forward_backward_func: 1F1B / interleaved under PP, no_sync for all but
    the last micro-batch, then finalize_model_grads) with the borrowed experts' gradient sync
    installed (grad_sync), the optimizer step, ``after_step(result)`` (LR schedule, the HybridEP
    scheduler, the log's reductions), then the runtime's post-step, which starts the next iteration's
    first expert gather: a blocking collective after that point queues behind the gather's bytes on
    a slow WAN (measured: ~0.1 s per call at 20 Mbit/s), so drivers run theirs in ``after_step``."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_hybridep.megatron import grad_sync, measure
    from megatron_hybridep.runtime.context import process_context

    if not batches:
        raise ValueError("train step: no micro-batches; fix: pass a non-empty list of (tokens, labels)")
    runtime = process_context().runtime
    grad_sync.install(config, chunks, runtime)  # idempotent; the bench may pre-set finalize
    if runtime is not None:
        runtime.micro_batches = len(batches)
    config.grad_scale_func = optimizer.scale_loss
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    # every pipeline stage and virtual chunk of a data-parallel rank reads the same micro-batches
    iterators = [iter(list(batches)) for _ in chunks]
    tokens = batches[0][0]
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks, num_microbatches=len(batches), seq_length=tokens.shape[1],
        micro_batch_size=tokens.shape[0], forward_only=False, **measure.schedule_kwargs(config))
    if progress is not None:
        progress("optimizer step")
    ok, grad_norm, _ = optimizer.step()
    if not ok:
        raise RuntimeError("optimizer step skipped (non-finite gradients)")
    result = StepResult(loss=_mean_loss(losses), grad_norm=float(grad_norm or 0.0))
    # Before the next iteration's first gather starts: collectives would otherwise queue behind the
    # gather's bytes on a slow WAN, and a plan switch has nothing to drop.
    if after_step is not None:
        result.after_step = after_step(result)
    if runtime is not None:
        runtime.after_optimizer_step()
    return result


def train_step(state: TrainState, tokens: torch.Tensor | Sequence[Batch],
               labels: torch.Tensor | None = None) -> dict[str, float]:
    """``run_iteration`` on a TrainState: ``train_step(state, tokens, labels)`` for one micro-batch
    or ``train_step(state, [(tokens, labels), ...])`` for M. Returns the mean per-token loss over
    the micro-batches and the grad norm."""
    batches = [(tokens, labels)] if labels is not None else list(tokens)  # type: ignore[arg-type]
    out = run_iteration([state.model], state.optimizer, state.config, batches)
    state.iteration += 1
    return {"loss": out.loss, "grad_norm": out.grad_norm}


def _forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Callable[..., Any]]:
    """Megatron's forward_step_func: (output, loss_func) as pretrain_gpt.py returns them; non-first
    pipeline stages get their input from the schedule (set_input_tensor)."""
    tokens, labels = next(data_iterator)
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    output = model(input_ids=tokens, position_ids=position_ids, attention_mask=None, labels=labels)
    return output, partial(_loss, labels.numel())


def _loss(count: int, per_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of per-token losses and their count (Megatron divides by both count and micro-batches)."""
    wide = torch.promote_types(per_token.dtype, torch.float32)  # fp32 for bf16/fp16, float64 stays
    total = per_token.to(wide).sum()
    n = torch.tensor(count, dtype=torch.int)
    return total, n, {"lm loss": torch.stack([total.detach(), n.to(wide)])}


def _mean_loss(losses: list[dict[str, torch.Tensor]]) -> float:
    if not losses:
        return math.nan
    total = torch.stack([x["lm loss"] for x in losses]).sum(dim=0)
    return (total[0] / total[1]).item()
