"""What the plugin needs from megatron.training beyond its public API, in one place: hooks into
Megatron's own loop (it has no callbacks for them) and two private helpers. pretrain_moe.py's GPU
path installs the hooks; the CPU loop uses the helpers. Checked against megatron-core 0.19.2
(megatron/compat.py refuses other versions)."""

from __future__ import annotations

import argparse
from typing import Any


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
    so the runtime learns the step (shared-expert rule, encode/prefetch of layer 0) and its scheduler
    decides once per iteration, after every optimizer of a chained optimizer has stepped; before the
    step, borrowed gradients are tied to Megatron's no_sync/finalize (grad_sync.py). Checked
    against 0.19.2 (train_step(forward_step_func, data_iterator, model, optimizer,
    opt_param_scheduler, config, ...))."""
    from megatron.training import training

    from megatron_hybridep.runtime.context import process_context

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
        out = inner(*args, **kwargs)
        if runtime is not None:
            if runtime.scheduler is not None:  # decide before the next iteration's first gather starts
                decision = runtime.scheduler.step(runtime.step + 1)
                if decision is not None and decision.switched:
                    print(f"hybridep: plan switch -> {runtime.plan.label}: {decision.replan.reason}", flush=True)
            runtime.stats.reset()  # per-iteration statistics (the CPU loop's log does this)
            runtime.after_optimizer_step()
        return out

    train_step._hybridep = True  # type: ignore[attr-defined]
    training.train_step = train_step


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
