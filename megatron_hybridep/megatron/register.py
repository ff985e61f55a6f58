"""Registration of the hybridep dispatcher with Megatron-Core.

Megatron's MoELayer hard-codes its dispatcher choice and has no registry, and its layer-spec
builders bind the MoELayer class by name (megatron.core.models.gpt.moe_module_specs.MoELayer,
used by the local and TransformerEngine GPT specs and by MTP blocks). ``register()`` rebinds that
name to HybridEPMoELayer, a subclass that is plain MoELayer unless the config asks for
'hybridep'. Checked against megatron-core 0.19.2.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch.distributed as dist

from megatron_hybridep.megatron.compat import check_megatron_version
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.runtime.context import HybridEPRuntime, process_context
from megatron_hybridep.runtime.migration import MigrationConfig

_SPEC_MODULES = ("megatron.core.models.gpt.moe_module_specs",)


def register() -> None:
    """Make ``moe_token_dispatcher_type='hybridep'`` selectable. Idempotent.

    Rebinds ``MoELayer`` in Megatron's MoE spec module to HybridEPMoELayer (for specs built by
    upstream code such as pretrain_gpt.py) and installs the parameter-version hook that lets
    borrowed copies see bf16/fp16 optimizer steps. Raises if megatron-core is outside the tested
    range (megatron/compat.py)."""
    check_megatron_version()
    from megatron_hybridep.megatron import param_versions
    from megatron_hybridep.megatron.moe_layer import HybridEPMoELayer

    param_versions.install()  # borrowed copies see bf16/fp16 optimizer steps
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
    register()
    runtime = HybridEPRuntime(plans, ep_group, active=active, prefetch=prefetch, migration=migration)
    process_context().set_runtime(runtime)
    return runtime


def teardown() -> None:
    """Forget the runtime (tests and jobs that rebuild the model)."""
    ctx = process_context()
    if ctx.runtime is not None:
        for layer in ctx.runtime.layers:
            layer.drop_gather()
    ctx.set_runtime(None)
