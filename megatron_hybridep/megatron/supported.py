"""Combinations pretrain_moe.py cannot run, refused when the arguments are parsed: before any
process starts or any collective runs, with one line naming the flag and the fix.

The supported ones are the configuration matrix (docs/configurations.md, tests/matrix/). Rules
marked ``cpu`` are limits of the CPU loop only (megatron.training.pretrain runs on GPU)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


class UnsupportedConfiguration(ValueError):
    """A flag combination that cannot run; the message names the flag and the fix."""


def _hybridep(args: argparse.Namespace) -> bool:
    return getattr(args, "moe_token_dispatcher_type", None) == "hybridep"


def _expert_tp(args: argparse.Namespace) -> int:
    # Megatron's validate_args defaults it to the dense TP size
    etp = getattr(args, "expert_tensor_parallel_size", None)
    return etp if etp is not None else getattr(args, "tensor_model_parallel_size", 1)


@dataclass(frozen=True)
class Rule:
    flag: str
    applies: Callable[[argparse.Namespace], bool]
    fix: str
    cpu: bool = False  # a limit of the CPU loop only


RULES: tuple[Rule, ...] = (
    Rule("--expert-tensor-parallel-size", lambda a: _hybridep(a) and _expert_tp(a) != 1,
         "hybridep runs experts whole (expert TP 1) and Megatron defaults it to --tensor-model-parallel-size; "
         "fix: pass --expert-tensor-parallel-size 1"),
    Rule("--moe-shared-expert-overlap", lambda a: _hybridep(a) and getattr(a, "moe_shared_expert_overlap", False),
         "overlaps the shared expert with the token all-to-all on CUDA streams that hybridep does not drive; "
         "fix: drop --moe-shared-expert-overlap"),
    Rule("--moe-latent-size", lambda a: _hybridep(a) and bool(getattr(a, "moe_latent_size", None)),
         "latent MoE is not supported by hybridep; fix: drop --moe-latent-size or use alltoall"),
    Rule("--fp8-format", lambda a: _hybridep(a) and bool(getattr(a, "fp8", None)),
         "untested with hybridep: TransformerEngine keeps FP8 scaling state (amax history) per expert module, and "
         "borrowed experts run through this rank's modules would share and update it; fix: drop --fp8-format "
         "(bf16) or use --moe-token-dispatcher-type alltoall"),
    Rule("--hybridep-early-grad-return",
         lambda a: _hybridep(a) and bool(getattr(a, "hybridep_early_grad_return", 0)) and (
             getattr(a, "hybridep_grad_compression_ratio", 1.0) <= 1
             or getattr(a, "hybridep_borrowed_copies", "auto") == "microbatch"),
         "splits the compressed return of borrowed experts' gradients held for the iteration; fix: add "
         "--hybridep-grad-compression-ratio > 1 (and not --hybridep-borrowed-copies microbatch), or drop it"),
    Rule("--num-layers-per-virtual-pipeline-stage",
         lambda a: bool(_virtual_stages(a)) and bool(getattr(a, "save", None) or getattr(a, "load", None)),
         "with --save/--load: the CPU loop checkpoints a single model chunk, and virtual pipeline stages give "
         "this rank several; fix: drop --save/--load or the virtual stages on CPU (megatron.training "
         "checkpoints them on GPU)", cpu=True),
)


def _virtual_stages(args: argparse.Namespace) -> int | None:
    return (getattr(args, "virtual_pipeline_model_parallel_size", None)
            or getattr(args, "num_layers_per_virtual_pipeline_stage", None)
            or getattr(args, "num_virtual_stages_per_pipeline_rank", None))


def check(args: argparse.Namespace, cpu: bool | None = None) -> None:
    """Raise UnsupportedConfiguration for the first rule ``args`` break (``cpu``: whether the CPU
    loop will run the job; default: no CUDA here)."""
    if cpu is None:
        import torch

        cpu = not torch.cuda.is_available()
    for rule in RULES:
        if (cpu or not rule.cpu) and rule.applies(args):
            raise UnsupportedConfiguration(f"{rule.flag}: {rule.fix}")
