"""pretrain_moe.py's CPU training loop (gloo).

This small loop drives the *same* Megatron pieces as Megatron's own loop: the argument parser and
validation, core_transformer_config_from_args, GPTModel chunks with the local layer spec (pipeline
stages and virtual stages as megatron.training.get_model builds them), Megatron's DDP and optimizer
built from args, the OptimizerParamScheduler, Megatron's schedule (get_forward_backward_func: all
micro-batches, 1F1B / interleaved under PP, no_sync, finalize_model_grads) and dist_checkpointing
for --save/--load; and adds the launcher's progress beats and an atomic checkpoint commit. On GPU
clusters pretrain_moe.py uses megatron.training.pretrain instead (which also runs on CPU under
cpu_runtime's patches, for the tests of that path).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import signal
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch.distributed as dist

from megatron_hybridep.train import checkpoint, data, gpt
from megatron_hybridep.train.planning import PlanChoice, choose
from megatron_hybridep.train.reporting import RunSummary

log = logging.getLogger("pretrain_moe")


def _validated(args: argparse.Namespace) -> argparse.Namespace:
    from megatron.training.arguments import validate_args
    from megatron.training.global_vars import set_args

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
    from megatron_hybridep.megatron.training_hooks import build_tokenizer

    build_tokenizer(args)  # sets args.padded_vocab_size as initialize_megatron would
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
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.training import (
        get_megatron_ddp_config,
        get_megatron_optimizer_config,
        get_optimizer_param_scheduler,
    )

    config = core_transformer_config_from_args(args)
    spec = gpt.layer_spec(args.num_experts, qk_layernorm=args.qk_layernorm)
    chunks = gpt.build_chunks(config, spec, get_megatron_ddp_config(args), params_dtype=args.params_dtype,
                              virtual_stages=args.virtual_pipeline_model_parallel_size,
                              init_seed=args.seed if args.hybridep_layout_independent_init else None,
                              **gpt.model_kwargs(args))
    opt_config, overrides = get_megatron_optimizer_config(args)
    optimizer = get_megatron_optimizer(opt_config, chunks, config_overrides=overrides)
    scheduler = get_optimizer_param_scheduler(optimizer)
    gpt.set_overlap_hooks(config, chunks, grad_reduce=args.overlap_grad_reduce,
                          align_grad_reduce=getattr(args, "align_grad_reduce", True),
                          param_gather=args.overlap_param_gather and getattr(args, "align_param_gather", False))
    return chunks, optimizer, scheduler, config


def plan_job(args: argparse.Namespace, world: int) -> PlanChoice | None:
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

    from megatron_hybridep.megatron import cpu_runtime, install_hooks, teardown
    from megatron_hybridep.train.reporting import Reporter

    start = time.perf_counter()
    cpu_runtime.enable()
    install_hooks()
    world, rank = dist.get_world_size(), dist.get_rank()
    choice = plan_job(args, world)  # before validation: the replicated plan changes the EP size
    args = _validated(args)
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                 pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                                 expert_model_parallel_size=args.expert_model_parallel_size,
                                 expert_tensor_parallel_size=args.expert_tensor_parallel_size,
                                 virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size)
    model_parallel_cuda_manual_seed(args.seed)
    runtime = scheduler = None
    if choice is not None and choice.dispatcher == "hybridep":
        from megatron_hybridep.train.planning import build_runtime

        runtime = build_runtime(args, choice)
        scheduler = runtime.scheduler
    from megatron_hybridep.megatron import measure
    from megatron_hybridep.train.planning import topology_for

    measure.enable(choice.topology if choice is not None else topology_for(args, world),
                   runtime.stats if runtime is not None else None)
    chunks, optimizer, lr_scheduler, config = build_model(args)
    if getattr(args, "hybridep_collective_timeout", None):  # set by pretrain_moe.py under torchrun/srun/testbed
        from megatron_hybridep.runtime.groups import set_collective_timeout

        set_collective_timeout(args.hybridep_collective_timeout)
    model = chunks[0] if len(chunks) == 1 else chunks  # checkpoint.py takes one chunk
    iteration, restored = (checkpoint.load(args, _one(chunks, "--load"), optimizer, lr_scheduler, runtime)
                           if args.load else (0, False))
    if restored and iteration < args.train_iters:
        runtime.after_optimizer_step()  # what the saved run did right after saving
    batches = data.train_batches(args, start_iteration=iteration)
    reporter = Reporter(args, choice, runtime, rank)
    micro = data.micro_batches(args, ps.get_data_parallel_world_size())
    from megatron_hybridep.train.launch import progress  # the launcher's stall monitor (no-op elsewhere)

    # Megatron's --exit-signal-handler: on the signal (SIGTERM: scancel, preemption, torchrun's stop)
    # save and stop once every rank has agreed (an all-gather per iteration, only with the flag)
    signalled = None
    if args.exit_signal_handler:
        from megatron.training.dist_signal_handler import DistributedSignalHandler

        signalled = DistributedSignalHandler(args.exit_signal).__enter__()
    stop = False

    def saves(done: int) -> bool:
        """Whether iteration ``done`` ends with a checkpoint: --save-interval, --exit-interval (as
        Megatron does), the exit signal or the last iteration."""
        if not args.save:
            return False
        return stop or done == args.train_iters or any(n and done % n == 0
                                                       for n in (args.save_interval, args.exit_interval))

    save_seconds = 0.0

    def after_step(result: gpt.StepResult) -> Any:
        nonlocal save_seconds, stop
        lr_scheduler.step(increment=args.global_batch_size)
        # here, where a save keeps the runtime's state exact (before its post-step)
        stop = signalled is not None and any(signalled.signals_received())
        decision = scheduler.step(iteration + 1) if scheduler is not None else None  # reads the stats
        reporter.reduce(result.loss)  # resets the stats
        save_seconds = 0.0
        if saves(iteration + 1):
            # here, before the runtime's post-step encodes and launches the next gathers: nothing is
            # in flight, and a resumed run replays that post-step from the saved state
            progress(iteration + 1, "checkpoint save")
            t = time.perf_counter()
            _sync_params(chunks)  # --overlap-param-gather: the step's parameters gathered before they are saved
            checkpoint.save(args, iteration + 1, _one(chunks, "--save"), optimizer, lr_scheduler, runtime)
            save_seconds = time.perf_counter() - t
        return decision

    ran = False
    while iteration < args.train_iters:
        t0 = time.perf_counter()
        progress(iteration, "forward-backward", predicted_seconds=reporter.predicted)
        out = gpt.run_iteration(chunks, optimizer, config, [next(batches) for _ in range(micro)],
                                after_step=after_step, progress=partial(progress, iteration))
        iteration += 1
        ran = True
        decision = out.after_step
        seconds = time.perf_counter() - t0 - save_seconds
        reporter.step(iteration, seconds, out.grad_norm, lr_scheduler, decision)
        progress(iteration, "end of iteration", step_seconds=seconds)
        if on_iteration is not None:
            on_iteration(iteration, seconds, decision)
        if args.exit_interval and iteration % args.exit_interval == 0:  # Megatron's --exit-interval
            break
        if stop:
            if rank == 0:
                print(f"[pretrain_moe] {signal.Signals(args.exit_signal).name}: stopped after iteration {iteration}"
                      + (f", saved to {args.save}" if args.save else " (no --save: nothing saved)"), flush=True)
            break
    if signalled is not None:
        signalled.release()
    if scheduler is not None:
        scheduler.close()
    _sync_params(chunks)  # as Megatron's train() ends: the last step's parameters gathered
    if args.save and not ran:  # resumed at the end: save again, as before (the runtime is still at rest)
        checkpoint.save(args, iteration, _one(chunks, "--save"), optimizer, lr_scheduler, runtime)
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


def _sync_params(chunks: list[Any]) -> None:
    """--overlap-param-gather leaves the step's parameter all-gather to the next forward's pre-hooks:
    finish it before parameters are read outside a forward (checkpoint, the end of training), as
    Megatron's train() does (disable_forward_pre_hook). Collective over data-parallel ranks."""
    import torch

    for chunk in chunks:
        if chunk.ddp_config.overlap_param_gather:
            with torch.no_grad():
                chunk.start_param_sync(force_sync=True)


def _one(chunks: list[Any], flag: str) -> Any:
    if len(chunks) != 1:
        raise ValueError(f"{flag} with virtual pipeline stages is not supported by the CPU loop; fix: drop "
                         "--num-layers-per-virtual-pipeline-stage or the checkpoint flag")
    return chunks[0]


def _chunk_prefix(chunk: Any) -> str:
    """Parameter names of a pipeline stage's chunk, by global layer (comparable across layouts)."""
    stage = getattr(chunk.module, "vp_stage", None)
    return "" if stage is None else f"vp{stage}."
