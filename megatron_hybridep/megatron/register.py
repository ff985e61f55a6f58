"""Registration of the hybridep dispatcher with Megatron-Core.

Megatron's MoELayer hard-codes its dispatcher choice and has no registry. The plugin's own paths
(train/, testing/) build HybridEPMoELayer, a subclass that is plain MoELayer unless the config asks
for 'hybridep', through the layer spec (``hybridep_layer_spec``). Upstream code that builds its
specs itself (Megatron-LM's pretrain_gpt.py, MTP blocks) gets it from ``register()``, which rebinds
megatron.core.models.gpt.moe_module_specs.MoELayer, the name Megatron's spec builders use.
Checked against megatron-core 0.19.2.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from megatron_hybridep.megatron.compat import check_megatron_version
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.runtime.context import HybridEPRuntime, process_context
from megatron_hybridep.runtime.migration import MigrationConfig

_SPEC_MODULES = ("megatron.core.models.gpt.moe_module_specs",)


def install_hooks() -> None:
    """What every hybridep job needs before its model is built, whatever builds the specs: the
    parameter-version hook that lets borrowed copies see bf16/fp16 optimizer steps. Idempotent.
    Raises if megatron-core is outside the tested range (megatron/compat.py)."""
    check_megatron_version()
    from megatron_hybridep.megatron import param_versions

    param_versions.install()


def hybridep_layer_spec(spec: Any) -> Any:
    """A copy of the GPT layer spec ``spec`` (a TransformerLayer ModuleSpec from Megatron's
    gpt_layer_specs) whose MoE module is HybridEPMoELayer; a spec without MoE is returned as is.
    Megatron 0.19 gives the MoE module as ``partial(MoELayer, submodules=...)``; a ModuleSpec of
    MoELayer (older specs) is swapped too."""
    mlp = getattr(getattr(spec, "submodules", None), "mlp", None)
    swapped = hybridep_moe_spec(mlp)
    if swapped is mlp:
        return spec
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=swapped))


def hybridep_moe_spec(moe: Any) -> Any:
    """Megatron's MoE module spec ``moe`` (get_moe_module_spec's) building HybridEPMoELayer instead
    of MoELayer; anything else is returned as is."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_hybridep.megatron.moe_layer import HybridEPMoELayer

    if isinstance(moe, functools.partial) and moe.func is MoELayer:
        return functools.partial(HybridEPMoELayer, *moe.args, **moe.keywords)
    if isinstance(moe, ModuleSpec) and moe.module is MoELayer:
        return dataclasses.replace(moe, module=HybridEPMoELayer)
    return moe


def register() -> None:
    """Make ``moe_token_dispatcher_type='hybridep'`` selectable in specs that upstream code builds
    (Megatron-LM's pretrain_gpt.py): rebinds ``MoELayer`` in Megatron's MoE spec module to
    HybridEPMoELayer, and installs the hooks (``install_hooks``). Idempotent. The plugin's own paths
    use ``hybridep_layer_spec`` instead."""
    install_hooks()
    from megatron_hybridep.megatron.moe_layer import HybridEPMoELayer

    for name in _SPEC_MODULES:
        module = importlib.import_module(name)
        module.MoELayer = HybridEPMoELayer


def setup(plans: Sequence[Plan], ep_group: dist.ProcessGroup | None = None, active: int = 0,
          prefetch: bool = True, num_experts: int | None = None,
          migration: MigrationConfig | None = None) -> HybridEPRuntime:
    """Validate the plans against this job (and the model's expert count, if given) and build
    their process groups (collective: call on every rank, after initialize_model_parallel, before
    building the model). Every check runs before the first collective.

    Args:
        plans: the prebuilt plans (plan/plan.py), every one for Megatron's EP size; the scheduler
            may switch between them at iteration boundaries.
        ep_group: the expert-parallel group (default: Megatron's).
        active: index of the plan the first iteration runs.
        prefetch: start layer l + 1's expert gather while layer l computes.
        num_experts: the model's expert count, checked against every plan.
        migration: codec settings (compression ratios, borrowed-copy lifetime); default exact.

    Returns:
        The process's HybridEPRuntime, also held by its ProcessContext (runtime/context.py).
    """
    if num_experts is not None:
        for plan in plans:
            if plan.num_experts != num_experts:
                plan.validate(plan.megatron_ep_size, num_experts)  # raises, naming the field and the fix
    if ep_group is None:
        from megatron.core import parallel_state

        ep_group = parallel_state.get_expert_model_parallel_group()
    install_hooks()
    runtime = HybridEPRuntime(plans, ep_group, active=active, prefetch=prefetch, migration=migration)
    process_context().set_runtime(runtime)
    return runtime


def teardown() -> None:
    """Forget the runtime and undo ``install_hooks`` (tests and jobs that rebuild the model)."""
    from megatron_hybridep.megatron import param_versions

    ctx = process_context()
    if ctx.runtime is not None:
        for layer in ctx.runtime.layers:
            layer.drop_gather()
    ctx.set_runtime(None)
    param_versions.uninstall()
