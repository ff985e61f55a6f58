"""Bad plans and settings fail at start-up with a message that names the field and the fix,
before any collective starts."""

import pytest

from megatron_hybridep.plan.plan import Plan, PlanError
from megatron_hybridep.train.launch import run_ranks
from tests.layer.helpers import setup_and_capture


def _setup_and_capture(ctx, plan_args, num_experts):
    return setup_and_capture(ctx, lambda: Plan.grid(*plan_args), num_experts, (
        "new_group", "all_gather_object", "all_gather_into_tensor", "all_to_all_single", "barrier"))


@pytest.mark.parametrize("plan_args,num_experts,words", [
    (((4,), (2,), 8), 8, ["expert_model_parallel_size=2", "fix"]),     # plan for 4 ranks, job has 2
    (((2,), (2,), 16), 8, ["num_experts", "16", "8", "fix"]),          # plan for another model
])
def test_bad_plan_fails_before_any_collective(plan_args, num_experts, words):
    for message, calls in run_ranks(_setup_and_capture, 2, plan_args, num_experts, timeout=60):
        assert message is not None, "setup accepted a plan that does not fit the job"
        assert all(w in message for w in words), message
        assert calls == [], f"collectives ran before the error: {calls}"


def test_domain_size_must_divide_the_level():
    with pytest.raises(PlanError, match=r"domain_sizes\[0\].*divisor.*fix"):
        Plan.grid((4,), (3,), 8)


def _build_without_setup(ctx):
    from megatron.core import parallel_state as ps

    from megatron_hybridep.megatron import cpu_runtime
    from megatron_hybridep.megatron.moe_layer import HybridEPConfigError
    from megatron_hybridep.testing.moe import MoESpec, build_moe_layer

    cpu_runtime.enable()
    ps.initialize_model_parallel(expert_model_parallel_size=ctx.world_size)
    messages = []
    for extra in ({}, {"expert_tensor_parallel_size": 2}):
        try:
            build_moe_layer(MoESpec(dispatcher="hybridep", extra=extra), ctx.rank, ctx.world_size)
        except HybridEPConfigError as exc:
            messages.append(str(exc))
    return messages


def test_hybridep_without_runtime_or_with_unsupported_flags_is_explained():
    messages = run_ranks(_build_without_setup, 1, timeout=60)[0]
    assert len(messages) == 2
    assert "megatron_hybridep.megatron.setup" in messages[0]
    assert "--expert-tensor-parallel-size 1" in messages[1]


def test_hybridep_layer_is_a_megatron_moe_layer():
    from megatron.core.models.gpt import moe_module_specs
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_hybridep.megatron import register
    from megatron_hybridep.megatron.moe_layer import HybridEPMoELayer

    register()
    assert moe_module_specs.MoELayer is HybridEPMoELayer and issubclass(HybridEPMoELayer, MoELayer)
