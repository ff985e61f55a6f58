"""pretrain_moe.py's CPU training loop (gloo).

Megatron's own training loop (megatron.training.pretrain) hard-codes CUDA too deeply to patch
narrowly, so on CPU this small loop drives the *same* Megatron pieces: the argument parser and
validation, core_transformer_config_from_args, GPTModel chunks with the local layer spec (pipeline
stages and virtual stages as megatron.training.get_model builds them), Megatron's DDP and optimizer
built from args, the OptimizerParamScheduler, Megatron's schedule (get_forward_backward_func: all
micro-batches, 1F1B / interleaved under PP, no_sync, finalize_model_grads) and dist_checkpointing
for --save/--load. On GPU clusters pretrain_moe.py uses megatron.training.pretrain instead.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from megatron_hybridep.megatron import checkpoint, data
from megatron_hybridep.megatron.planning import PlanChoice, choose

log = logging.getLogger("pretrain_moe")


@dataclass
class RunSummary:
    iterations: int = 0
    first_loss: float = math.nan
    final_loss: float = math.nan
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    inter_dc_bytes: float = 0.0
    inter_dc_by_phase: dict[str, float] = field(default_factory=dict)  # summed over ranks and iterations
    plan: str = ""
    unigram_entropy: float | None = None
    wall_s: float = 0.0
    params: dict[str, torch.Tensor] | None = None  # final parameters, when run(collect_params=True)


def _validated(args: argparse.Namespace) -> argparse.Namespace:
    from megatron.training.arguments import validate_args
    from megatron.training.global_vars import set_args

    if args.moe_token_dispatcher_type == "hybridep" and args.gradient_accumulation_fusion:
        args.gradient_accumulation_fusion = False  # no fused wgrad into main_grad on CPU anyway
    if getattr(args, "hybridep_print_args", False):
        validate_args(args)
    else:
        _without_args_table(validate_args, args)
    if getattr(args, "hybridep_fp64", False):
        import torch

        if args.bf16 or args.fp16:
            raise ValueError("--hybridep-fp64 runs every parameter in float64; fix: drop --bf16/--fp16")
        args.params_dtype = torch.float64  # exactness checks: summation order cannot hide or fake a bug
        args.accumulate_allreduce_grads_in_fp32 = False  # main grads in the parameters' float64
    set_args(args)
    from megatron.training.global_vars import _build_tokenizer

    _build_tokenizer(args)  # sets args.padded_vocab_size as initialize_megatron would
    return args


def _without_args_table(validate_args: Callable[..., Any], args: argparse.Namespace) -> None:
    """Megatron's validate_args with the rest of its output, less the table of every argument it
    prints on rank 0 (it has no flag for it; --hybridep-print-args keeps it)."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            validate_args(args)
    finally:
        skip = False
        for line in out.getvalue().splitlines():
            if line.startswith("-" * 8) and " arguments " in line:
                skip = not line.lstrip("-").startswith(" end of")
                continue
            if not skip:
                print(line, flush=True)


def build_model(args: argparse.Namespace) -> tuple[list[Any], Any, Any, Any]:
    """(DDP model chunks, optimizer, scheduler, config) from Megatron args, as pretrain_gpt.py and
    megatron.training.get_model build them: one chunk per virtual pipeline stage of this rank."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.training import (
        get_megatron_ddp_config,
        get_megatron_optimizer_config,
        get_optimizer_param_scheduler,
    )

    config = core_transformer_config_from_args(args)
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False,
                                    qk_layernorm=args.qk_layernorm)
    vp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for stage in range(vp or 1):
        vp_stage = stage if vp else None
        with _default_dtype(args.params_dtype):  # Megatron's torch norms ignore params_dtype (float64)
            module = _gpt(args, config, spec, vp_stage)
        module.vp_stage = vp_stage
        chunk = DistributedDataParallel(config=config, ddp_config=get_megatron_ddp_config(args), module=module,
                                        disable_bucketing=stage > 0)
        chunk.broadcast_params()
        chunks.append(chunk)
    opt_config, overrides = get_megatron_optimizer_config(args)
    optimizer = get_megatron_optimizer(opt_config, chunks, config_overrides=overrides)
    scheduler = get_optimizer_param_scheduler(optimizer)
    return chunks, optimizer, scheduler, config


@contextlib.contextmanager
def _default_dtype(dtype: Any) -> Any:
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


def _gpt(args: argparse.Namespace, config: Any, spec: Any, vp_stage: int | None) -> Any:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
                    vp_stage=vp_stage)


def _plan_job(args: argparse.Namespace, world: int) -> PlanChoice | None:
    if args.moe_token_dispatcher_type != "hybridep":
        return None
    choice = choose(args, world)
    if choice.dispatcher == "alltoall":  # replicated: Megatron's EP inside each DC + expert DP
        args.moe_token_dispatcher_type = "alltoall"
        args.expert_model_parallel_size = choice.megatron_ep_size
    return choice


def run(args: argparse.Namespace, collect_params: bool = False,
        on_iteration: Callable[[int, float, Any], None] | None = None) -> RunSummary:
    """One rank of the job (torch.distributed already initialised with gloo). ``on_iteration(iteration,
    step_seconds, scheduler_decision_or_None)`` runs after each iteration's log (benchmarks use it to
    sync with a controller, e.g. to change the WAN rate at a known iteration)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hybridep.megatron import cpu_runtime, register, teardown
    from megatron_hybridep.megatron.reporting import Reporter

    start = time.perf_counter()
    cpu_runtime.enable()
    register()
    world, rank = dist.get_world_size(), dist.get_rank()
    choice = _plan_job(args, world)  # before validation: the replicated plan changes the EP size
    args = _validated(args)
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                 pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                                 expert_model_parallel_size=args.expert_model_parallel_size,
                                 expert_tensor_parallel_size=args.expert_tensor_parallel_size,
                                 virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size)
    model_parallel_cuda_manual_seed(args.seed)
    runtime = scheduler = None
    if choice is not None and choice.dispatcher == "hybridep":
        from megatron_hybridep.megatron.planning import build_runtime

        runtime = build_runtime(args, choice)
        scheduler = runtime.scheduler
    from megatron_hybridep.megatron import measure
    from megatron_hybridep.megatron.planning import topology_for

    measure.enable(choice.topology if choice is not None else topology_for(args, world),
                   runtime.stats if runtime is not None else None)
    chunks, optimizer, lr_scheduler, config = build_model(args)
    if getattr(args, "hybridep_collective_timeout", None):  # set by pretrain_moe.py under torchrun/srun/testbed
        from megatron_hybridep.runtime.groups import set_collective_timeout

        set_collective_timeout(args.hybridep_collective_timeout)
    model = chunks[0] if len(chunks) == 1 else chunks  # checkpoint.py takes one chunk
    iteration = checkpoint.load(args, _one(chunks, "--load"), optimizer, lr_scheduler) if args.load else 0
    batches = data.train_batches(args, start_iteration=iteration)
    reporter = Reporter(args, choice, runtime, rank)
    micro = args.global_batch_size // (args.micro_batch_size * ps.get_data_parallel_world_size())
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_hybridep.megatron import grad_sync

    grad_sync.install(config, chunks, runtime)
    config.grad_scale_func = optimizer.scale_loss
    forward_backward = get_forward_backward_func()
    iterators = [_MicroBatches() for _ in chunks]
    saved = False
    from megatron_hybridep.runtime.launch import progress  # the launcher's stall monitor (no-op elsewhere)

    while iteration < args.train_iters:
        t0 = time.perf_counter()
        progress(iteration, "forward-backward", predicted_seconds=reporter.predicted)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        batch_list = [next(batches) for _ in range(micro)]
        for it in iterators:
            it.load(batch_list)
        losses = forward_backward(forward_step_func=_forward_step, data_iterator=iterators if len(chunks) > 1
                                  else iterators[0], model=chunks, num_microbatches=micro,
                                  seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                                  forward_only=False)
        progress(iteration, "optimizer step")
        ok, grad_norm, _ = optimizer.step()
        if not ok:
            raise RuntimeError(f"iteration {iteration}: optimizer step skipped (non-finite gradients)")
        lr_scheduler.step(increment=args.global_batch_size)
        iteration += 1
        # Decide before the next iteration's first gather starts: the scheduler's all-reduce would
        # otherwise queue behind the gather's bytes on a slow WAN, and a switch has nothing to drop.
        decision = scheduler.step(iteration) if scheduler is not None else None
        if runtime is not None:
            runtime.after_optimizer_step()
        seconds = time.perf_counter() - t0
        reporter.step(iteration, _mean_loss(losses), seconds, grad_norm, lr_scheduler, decision)
        progress(iteration, "checkpoint save" if args.save else "end of iteration", step_seconds=seconds)
        if on_iteration is not None:
            on_iteration(iteration, seconds, decision)
        saved = bool(args.save and args.save_interval and iteration % args.save_interval == 0)
        if saved:
            checkpoint.save(args, iteration, _one(chunks, "--save"), optimizer, lr_scheduler)
        if args.exit_interval and iteration % args.exit_interval == 0:  # Megatron's --exit-interval
            break
    if scheduler is not None:
        scheduler.close()
    if args.save and not saved:
        checkpoint.save(args, iteration, _one(chunks, "--save"), optimizer, lr_scheduler)
    summary = reporter.finish(time.perf_counter() - start)
    if collect_params:
        summary.params = {f"{_chunk_prefix(c)}{n}": p.detach().clone()
                          for c in chunks for n, p in c.module.named_parameters()}
    del model
    measure.disable()
    if runtime is not None:
        teardown()
    ps.destroy_model_parallel()
    return summary


def _one(chunks: list[Any], flag: str) -> Any:
    if len(chunks) != 1:
        raise ValueError(f"{flag} with virtual pipeline stages is not supported by the CPU loop; fix: drop "
                         "--num-layers-per-virtual-pipeline-stage or the checkpoint flag")
    return chunks[0]


def _chunk_prefix(chunk: Any) -> str:
    """Parameter names of a pipeline stage's chunk, by global layer (comparable across layouts)."""
    stage = getattr(chunk.module, "vp_stage", None)
    return "" if stage is None else f"vp{stage}."


class _MicroBatches:
    """The iteration's micro-batches for one model chunk: every pipeline stage and virtual chunk of
    a data-parallel rank reads the same ones (first stages the tokens, last stages the labels)."""

    def __init__(self) -> None:
        self.pending: list[Any] = []

    def load(self, batches: list[Any]) -> None:
        self.pending = list(batches)

    def __iter__(self) -> _MicroBatches:
        return self

    def __next__(self) -> Any:
        return self.pending.pop(0)


def _forward_step(data_iterator: Any, model: Any) -> tuple[Any, Callable[..., Any]]:
    """Megatron's forward_step_func: (output, loss_func) as pretrain_gpt.py returns them; non-last
    pipeline stages get their input from the schedule (set_input_tensor)."""
    tokens, labels = next(data_iterator)
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    output = model(input_ids=tokens, position_ids=position_ids, attention_mask=None, labels=labels)
    return output, partial(_loss, labels.numel())


def _loss(count: int, per_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of per-token losses and their count (Megatron divides by both count and micro-batches)."""
    wide = torch.promote_types(per_token.dtype, torch.float32)
    total = per_token.to(wide).sum()
    n = torch.tensor(count, dtype=torch.int)
    return total, n, {"lm loss": torch.stack([total.detach(), n.to(wide)])}


def _mean_loss(losses: list[dict[str, torch.Tensor]]) -> float:
    """This rank's mean loss over the iteration (NaN on ranks without the last pipeline stage)."""
    if not losses:
        return math.nan
    total = torch.stack([x["lm loss"] for x in losses]).sum(dim=0)
    return (total[0] / total[1]).item()
