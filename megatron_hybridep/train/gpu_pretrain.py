"""pretrain_moe.py on GPU clusters: Megatron's own training loop (megatron.training.pretrain), with
its checkpointing, logging and data pipeline, as pretrain_gpt.py uses it. The plugin adds the
hybridep dispatcher (its MoE layer in the layer spec), the plan (chosen once the model parallel
groups exist), and its runtime state in Megatron's checkpoints (training_hooks). Written against
megatron-core 0.19.2's megatron.training API for CUDA; the CPU tests run it on gloo ranks under
cpu_runtime (tests/train/test_megatron_loop_resume.py), while pretrain_moe.py on CPU uses the CPU
loop (cpu_loop.py: the same Megatron model, DDP, optimizer and checkpoint code)."""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any

import torch

from megatron_hybridep.megatron.arguments import add_hybridep_args
from megatron_hybridep.train import gpt


def _model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                    config: Any = None, pg_collection: Any = None) -> Any:
    from megatron.core import parallel_state
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_hybridep.runtime.context import process_context
    from megatron_hybridep.train.planning import setup_from_args

    args = get_args()
    config = config or core_transformer_config_from_args(args)
    if args.moe_token_dispatcher_type == "hybridep" and process_context().runtime is None:
        setup_from_args(args, torch.distributed.get_world_size(), parallel_state.get_expert_model_parallel_group())
    spec = gpt.layer_spec(args.num_experts, qk_layernorm=args.qk_layernorm, grouped_gemm=args.moe_grouped_gemm,
                          transformer_engine=args.transformer_impl == "transformer_engine")
    model = gpt.gpt_model(config, spec, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                          **gpt.model_kwargs(args))
    if args.hybridep_layout_independent_init:
        from megatron_hybridep.train.init import reinitialize

        reinitialize(model, config, args.seed)
    return model


def _masked_loss(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    mask = loss_mask.view(-1).float()
    total = torch.sum(output.view(-1).float() * mask)
    tokens = mask.sum().to(torch.int)
    report = torch.cat([total.clone().detach().view(1), tokens.view(1).float()])
    return total, tokens, {"lm loss": report}


def _device() -> torch.device:
    """The model's device: this rank's GPU (set by Megatron's initialisation, so looked up when
    needed), or the CPU under cpu_runtime (the CPU tests of this path)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _gpu_forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    device = _device()
    tokens, labels = batch["tokens"].to(device), batch["labels"].to(device)
    loss_mask = batch["loss_mask"].to(device)
    position_ids = batch["position_ids"].to(device)
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(_masked_loss, loss_mask)


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


def _load_runtime_state(path: str, runtime: Any) -> bool:
    """Megatron restores its own RNG; the runtime's tensors go to the model's device."""
    from megatron_hybridep.train import checkpoint

    return checkpoint.load_extra(path, runtime, rng=False, device=_device())


def pretrain(args: argparse.Namespace) -> int:
    """Hand the (preset-merged) command line to Megatron's pretrain(), the way pretrain_gpt.py of
    megatron-core 0.19 does: parse + validate (our flags added), build the config container, run."""
    from megatron.core.enums import ModelType
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.training import pretrain as megatron_pretrain

    from megatron_hybridep.megatron import install_hooks, training_hooks
    from megatron_hybridep.megatron.compat import check_transformer_impl
    from megatron_hybridep.train import checkpoint

    check_transformer_impl(args.transformer_impl)  # before Megatron initialises anything
    install_hooks()
    training_hooks.after_each_step()
    training_hooks.runtime_in_checkpoints(checkpoint.save_extra, _load_runtime_state)
    training_hooks.hybridep_in_every_parser()
    training_hooks.use_prebuilt_dataset_helpers()
    _datasets_provider.is_distributed = True
    sys.argv = ["pretrain_moe.py", *args.argv]
    margs = parse_and_validate_args(extra_args_provider=add_hybridep_args)
    megatron_pretrain(pretrain_cfg_container_from_args(margs), _datasets_provider, ModelType.encoder_or_decoder,
                      _gpu_forward_step, model_provider=_model_provider)
    return 0
