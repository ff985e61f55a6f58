"""pretrain_moe.py on GPU clusters: Megatron's own training loop (megatron.training.pretrain), with
its checkpointing, logging and data pipeline, as pretrain_gpt.py uses it. The plugin adds the
hybridep dispatcher (registered before the model is built) and the plan (chosen once the model
parallel groups exist). Written against megatron-core 0.19.2's megatron.training API; CUDA only,
so it is not exercised by the CPU test suite (the CPU loop in cpu_loop.py drives the same
Megatron model, DDP, optimizer and checkpoint code)."""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any

import torch

from megatron_hybridep.megatron.arguments import add_hybridep_args


def _model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                    config: Any = None, pg_collection: Any = None) -> Any:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_hybridep.megatron.planning import setup_from_args
    from megatron_hybridep.runtime.context import get_runtime

    args = get_args()
    config = config or core_transformer_config_from_args(args)
    if args.moe_token_dispatcher_type == "hybridep" and get_runtime() is None:
        setup_from_args(args, torch.distributed.get_world_size(), parallel_state.get_expert_model_parallel_group())
    if args.transformer_impl == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(args.num_experts, args.moe_grouped_gemm,
                                                          args.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process, parallel_output=True,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
                    vp_stage=vp_stage)


def _loss(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    mask = loss_mask.view(-1).float()
    total = torch.sum(output.view(-1).float() * mask)
    tokens = mask.sum().to(torch.int)
    report = torch.cat([total.clone().detach().view(1), tokens.view(1).float()])
    return total, tokens, {"lm loss": report}


def _forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    tokens, labels = batch["tokens"].cuda(), batch["labels"].cuda()
    loss_mask = batch["loss_mask"].cuda()
    position_ids = batch["position_ids"].cuda()
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(_loss, loss_mask)


def _datasets_provider(train_val_test_num_samples: list[int], vp_stage: int | None = None) -> tuple:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.datasets.utils import get_blend_from_list
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length,
                              blend=get_blend_from_list(args.data_path), split=args.split,
                              tokenizer=get_tokenizer(), reset_position_ids=args.reset_position_ids,
                              reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
                              path_to_cache=args.data_cache_path, mid_level_dataset_surplus=0.005)
    kind = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(kind, train_val_test_num_samples, lambda: True, config).build()


def _after_each_step() -> None:
    """Megatron's loop has no post-step callback: wrap its train_step (looked up by name in train())
    so the runtime learns the step (shared-expert rule, encode/prefetch of layer 0) and its scheduler
    decides once per iteration, after every optimizer of a chained optimizer has stepped; before the
    step, borrowed gradients are tied to Megatron's no_sync/finalize (grad_sync.py). Checked
    against 0.19.2 (train_step(forward_step_func, data_iterator, model, optimizer,
    opt_param_scheduler, config, ...))."""
    from megatron.training import training

    from megatron_hybridep.runtime.context import get_runtime

    inner = training.train_step
    if getattr(inner, "_hybridep", False):
        return

    def train_step(*args: Any, **kwargs: Any) -> Any:
        runtime = get_runtime()
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


def _hybridep_in_every_parser() -> None:
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


def _use_prebuilt_dataset_helpers() -> None:
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


def pretrain(args: argparse.Namespace) -> int:
    """Hand the (preset-merged) command line to Megatron's pretrain(), the way pretrain_gpt.py of
    megatron-core 0.19 does: parse + validate (our flags added), build the config container, run."""
    from megatron.core.enums import ModelType
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.training import pretrain as megatron_pretrain

    from megatron_hybridep.megatron import register
    from megatron_hybridep.megatron.compat import check_transformer_impl

    check_transformer_impl(args.transformer_impl)  # before Megatron initialises anything
    register()
    _after_each_step()
    _hybridep_in_every_parser()
    _use_prebuilt_dataset_helpers()
    _datasets_provider.is_distributed = True
    sys.argv = ["pretrain_moe.py", *args.argv]
    margs = parse_and_validate_args(extra_args_provider=add_hybridep_args)
    megatron_pretrain(pretrain_cfg_container_from_args(margs), _datasets_provider, ModelType.encoder_or_decoder,
                      _forward_step, model_provider=_model_provider)
    return 0
