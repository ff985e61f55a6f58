"""What the plugin needs from megatron.training beyond its public API, in one place: hooks into
Megatron's own loop (it has no callbacks for them) and two private helpers. pretrain_moe.py's GPU
path installs the hooks; the CPU loop uses the helpers. Checked against megatron-core 0.19.2
(megatron/compat.py refuses other versions)."""

from __future__ import annotations

import argparse
import io
from collections.abc import Callable
from typing import Any

import torch


def build_tokenizer(args: argparse.Namespace) -> Any:
    """Megatron's tokenizer from args, setting args.padded_vocab_size as initialize_megatron does."""
    from megatron.training.global_vars import _build_tokenizer

    return _build_tokenizer(args)


def sharded_state_dict_metadata(args: argparse.Namespace) -> dict[str, Any]:
    """The checkpoint metadata megatron.training.checkpointing builds: it picks the distributed
    optimizer's sharding type ('dp_reshardable' by default); without it the optimizer falls back
    to a flattened-range format that dist_checkpointing 0.19 rejects."""
    from megatron.training.checkpointing import _build_sharded_state_dict_metadata

    return _build_sharded_state_dict_metadata(args)


def after_each_step() -> None:
    """Megatron's loop has no post-step callback: wrap its train_step (looked up by name in train())
    so the runtime learns each optimizer step. At its end the scheduler decides (after every optimizer
    of a chained optimizer has stepped) and the runtime's post-step (shared-expert rule, encode,
    layer 0's gather) becomes due; it runs at the start of the next train_step (or evaluation), so
    a checkpoint Megatron saves in between sees nothing in flight, as the CPU loop saves. Before
    the step, borrowed gradients are tied to Megatron's no_sync/finalize (grad_sync.py). Checked
    against 0.19.2 (train_step(forward_step_func, data_iterator, model, optimizer,
    opt_param_scheduler, config, ...), evaluate(forward_step_func, data_iterator, model, ...))."""
    from megatron.training import training

    from megatron_hybridep.runtime.context import process_context

    if not getattr(training.evaluate, "_hybridep", False):
        training.evaluate = _evaluate_after_the_post_step(training.evaluate)
    inner = training.train_step
    if getattr(inner, "_hybridep", False):
        return

    def train_step(*args: Any, **kwargs: Any) -> Any:
        runtime = process_context().runtime
        config = kwargs.get("config", args[5] if len(args) > 5 else None)
        model = kwargs.get("model", args[2] if len(args) > 2 else None)
        if runtime is not None and config is not None and model is not None:
            from megatron_hybridep.megatron import grad_sync

            # after train() set its own no_sync/finalize (it asserts no_sync_func is unset before)
            grad_sync.install(config, model if isinstance(model, list) else [model], runtime)
        if runtime is not None:  # after install: it sets the expert parameter sync the post-step runs first
            from megatron.core.num_microbatches_calculator import get_num_microbatches

            try:  # train() configured it; a caller that did not gets one return (no early split)
                runtime.micro_batches = get_num_microbatches()
            except AttributeError:
                runtime.micro_batches = None
            runtime.boundary = None
            _run_due_post_step(runtime)
        out = inner(*args, **kwargs)
        if runtime is not None:
            if runtime.scheduler is not None:  # decide before the next iteration's first gather starts
                decision = runtime.scheduler.step(runtime.step + 1)
                if decision is not None and decision.switched:
                    print(f"hybridep: plan switch -> {runtime.plan.label}: {decision.replan.reason}", flush=True)
            runtime.stats.reset()  # per-iteration statistics (the CPU loop's log does this)
            runtime.post_step_due = True
        return out

    train_step._hybridep = True  # type: ignore[attr-defined]
    training.train_step = train_step


def _evaluate_after_the_post_step(evaluate: Callable[..., Any]) -> Callable[..., Any]:
    """An evaluation's forward needs the post-step the last optimizer step owes. train() evaluates
    before it saves: keep the state a save must see, copied (the post-step updates the codec's
    tensors in place) into host memory (it is as large as the borrowed copies)."""
    from megatron_hybridep.runtime.context import process_context

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        runtime = process_context().runtime
        if runtime is not None and runtime.post_step_due:
            runtime.boundary = _host_copy(runtime.state_dict())
            _run_due_post_step(runtime)
        return evaluate(*args, **kwargs)

    wrapped._hybridep = True  # type: ignore[attr-defined]
    return wrapped


def _host_copy(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every tensor copied to CPU, tensors that share storage still sharing it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location="cpu", weights_only=True)


def _run_due_post_step(runtime: Any) -> None:
    if runtime.post_step_due:
        runtime.post_step_due = False
        runtime.after_optimizer_step()


def runtime_in_checkpoints(write: Callable[[str, int, dict[str, Any]], None],
                           read: Callable[[str, Any], bool]) -> None:
    """Megatron's save/load have no hook for extra state: wrap save_checkpoint and load_checkpoint as
    megatron.training.training looks them up, so the HybridEP runtime's state goes into its own part
    of each checkpoint directory (``write(iteration_dir, iteration, state)``, after Megatron's own
    save) and comes back after Megatron's load (``read(iteration_dir, runtime)``: restored or not;
    then its post-step is replayed before the first forward, as the saved run ran it after saving).
    Checked against 0.19.2 (save_checkpoint(iteration, model, optimizer, ..., non_persistent_ckpt=),
    load_checkpoint(...) -> (iteration, flops))."""
    from megatron.training import checkpointing, get_args, training

    from megatron_hybridep.runtime.context import process_context

    save, load = training.save_checkpoint, training.load_checkpoint
    if getattr(save, "_hybridep", False):
        return

    def save_checkpoint(iteration: int, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        out = save(iteration, model, optimizer, *args, **kwargs)
        runtime = process_context().runtime
        # not for Megatron's conversion/upcycling saves (no optimizer) or non-persistent ones
        if runtime is not None and optimizer is not None and not kwargs.get("non_persistent_ckpt"):
            state = runtime.boundary if runtime.boundary is not None else runtime.state_dict()
            write(checkpointing.get_checkpoint_name(get_args().save, iteration, return_base_dir=True),
                  iteration, state)
        return out

    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        out = load(*args, **kwargs)
        runtime, margs = process_context().runtime, get_args()
        if runtime is not None and out[0] > 0 and margs.load and kwargs.get("load_arg", "load") == "load":
            path = checkpointing.get_checkpoint_name(margs.load, out[0], return_base_dir=True)
            runtime.post_step_due = read(path, runtime)
            if not runtime.post_step_due and torch.distributed.get_rank() == 0:
                print(f"hybridep: {path} holds no runtime state for this run (alltoall, older or another plan); "
                      "borrowed-expert copies and codec state start fresh", flush=True)
        return out

    save_checkpoint._hybridep = True  # type: ignore[attr-defined]
    training.save_checkpoint, training.load_checkpoint = save_checkpoint, load_checkpoint


def hybridep_in_every_parser() -> None:
    """Megatron re-parses sys.argv with its own parser inside pretrain() (ft_integration.setup,
    unknown flags ignored, but the dispatcher choice still checked): make every parser it builds
    accept 'hybridep'. Checked against 0.19.2."""
    from megatron.training import arguments

    from megatron_hybridep.megatron.arguments import _allow_hybridep_dispatcher

    inner = arguments.add_megatron_arguments
    if getattr(inner, "_hybridep", False):
        return

    def add_megatron_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser = inner(parser)
        _allow_hybridep_dispatcher(parser)
        return parser

    add_megatron_arguments._hybridep = True  # type: ignore[attr-defined]
    arguments.add_megatron_arguments = add_megatron_arguments


def use_prebuilt_dataset_helpers() -> None:
    """The megatron-core wheel ships the dataset index helpers prebuilt (helpers_cpp) but not their
    Makefile, and megatron.training still runs `make` on rank 0 at start-up, which then exits.
    Skip the build only when the prebuilt module imports; a source checkout keeps Megatron's."""
    import importlib.util
    import os

    from megatron.core.datasets import utils

    here = os.path.dirname(utils.__file__)
    if os.path.exists(os.path.join(here, "Makefile")) or importlib.util.find_spec(
            "megatron.core.datasets.helpers_cpp") is None:
        return
    utils.compile_helpers = lambda: None
