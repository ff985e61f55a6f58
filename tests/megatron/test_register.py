"""The plugin's own paths put HybridEPMoELayer in the layer spec; only register() (for upstream code that
builds its own specs) rebinds Megatron's MoELayer name, and teardown() undoes the optimizer hook."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import functools
from megatron.core.models.gpt import gpt_layer_specs, moe_module_specs
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron_hybridep.megatron import hybridep_layer_spec, hybridep_moe_spec
from megatron_hybridep.megatron.moe_layer import HybridEPMoELayer
from megatron_hybridep.train.gpt import layer_spec

moe = layer_spec(8).submodules.mlp
dense = gpt_layer_specs.get_gpt_layer_local_spec()
old_style = ModuleSpec(module=MoELayer)
ref = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=8).submodules.mlp
print(moe.func is HybridEPMoELayer, repr(moe.keywords) == repr(ref.keywords),
      hybridep_layer_spec(dense) is dense, hybridep_moe_spec(old_style).module is HybridEPMoELayer,
      moe_module_specs.MoELayer is MoELayer)
"""


def test_own_layer_spec_builds_the_hybridep_layer_without_rebinding():
    # a fresh interpreter: an earlier register() in this process would hide a spec that lacks the layer
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True).stdout.split()
    # the layer, Megatron's submodules kept, a dense spec untouched, an old-style spec swapped, no rebinding
    assert out == ["True"] * 5, out


def test_teardown_undoes_the_optimizer_hook():
    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

    from megatron_hybridep.megatron import install_hooks, param_versions, teardown

    teardown()  # from whatever earlier tests in this process left
    original = MixedPrecisionOptimizer.step_with_ready_grads
    assert not getattr(original, param_versions._MARK, False)
    install_hooks()
    install_hooks()  # idempotent: wrapped once
    wrapped = MixedPrecisionOptimizer.step_with_ready_grads
    assert wrapped is not original and wrapped.__wrapped__ is original
    teardown()
    assert MixedPrecisionOptimizer.step_with_ready_grads is original
