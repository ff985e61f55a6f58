"""pretrain_moe.py's CPU training loop (gloo).

Megatron's own training loop (megatron.training.pretrain) hard-codes CUDA too deeply to patch
narrowly, so on CPU this small loop drives the *same* Megatron pieces: the argument parser and
validation, core_transformer_config_from_args, GPTModel with the local layer spec, Megatron's DDP
and optimizer built from args (get_megatron_ddp_config / get_megatron_optimizer_config), the
OptimizerParamScheduler, finalize_model_grads and dist_checkpointing for --save/--load. On GPU
clusters pretrain_moe.py uses megatron.training.pretrain instead.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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
    plan: str = ""
    unigram_entropy: float | None = None
    wall_s: float = 0.0
    params: dict[str, torch.Tensor] | None = None  # final parameters, when run(collect_params=True)


def _validated(args: argparse.Namespace) -> argparse.Namespace:
    from megatron.training.arguments import validate_args
    from megatron.training.global_vars import set_args

    if args.moe_token_dispatcher_type == "hybridep" and args.gradient_accumulation_fusion:
        args.gradient_accumulation_fusion = False  # no fused wgrad into main_grad on CPU anyway
    validate_args(args)
    set_args(args)
    from megatron.training.global_vars import _build_tokenizer

    _build_tokenizer(args)  # sets args.padded_vocab_size as initialize_megatron would
    return args


def build_model(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """(DDP model, optimizer, scheduler, config) from Megatron args, as pretrain_gpt.py builds them."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
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
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base)
    model = DistributedDataParallel(config=config, ddp_config=get_megatron_ddp_config(args), module=model)
    model.broadcast_params()
    opt_config, overrides = get_megatron_optimizer_config(args)
    optimizer = get_megatron_optimizer(opt_config, [model], config_overrides=overrides)
    scheduler = get_optimizer_param_scheduler(optimizer)
    return model, optimizer, scheduler, config


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
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
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
                                 expert_model_parallel_size=args.expert_model_parallel_size)
    model_parallel_cuda_manual_seed(args.seed)
    runtime = scheduler = None
    if choice is not None and choice.dispatcher == "hybridep":
        from megatron_hybridep.megatron.planning import build_runtime

        runtime = build_runtime(args, choice)
        scheduler = runtime.scheduler
    model, optimizer, lr_scheduler, _ = build_model(args)
    iteration = checkpoint.load(args, model, optimizer, lr_scheduler) if args.load else 0
    batches = data.train_batches(args, start_iteration=iteration)
    reporter = Reporter(args, choice, runtime, rank)
    micro = args.global_batch_size // (args.micro_batch_size * ps.get_data_parallel_world_size())
    saved = False
    while iteration < args.train_iters:
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss_sum = 0.0
        for _ in range(micro):
            tokens, labels = next(batches)
            loss = _forward(model, tokens, labels) / micro
            loss.backward()
            loss_sum += loss.item()
        finalize_model_grads([model])
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
        reporter.step(iteration, loss_sum, seconds, grad_norm, lr_scheduler, decision)
        if on_iteration is not None:
            on_iteration(iteration, seconds, decision)
        saved = bool(args.save and args.save_interval and iteration % args.save_interval == 0)
        if saved:
            checkpoint.save(args, iteration, model, optimizer, lr_scheduler)
        if args.exit_interval and iteration % args.exit_interval == 0:  # Megatron's --exit-interval
            break
    if scheduler is not None:
        scheduler.close()
    if args.save and not saved:
        checkpoint.save(args, iteration, model, optimizer, lr_scheduler)
    summary = reporter.finish(time.perf_counter() - start)
    if collect_params:
        summary.params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    if runtime is not None:
        teardown()
    ps.destroy_model_parallel()
    return summary


def _forward(model: Any, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    return model(input_ids=tokens, position_ids=position_ids, attention_mask=None, labels=labels).float().mean()
