"""Megatron-Core glue: the only package that touches Megatron internals.

    from megatron_hybridep.megatron import hybridep_layer_spec, setup
    ...initialize_model_parallel(...)
    setup([plan])                 # build domain/rail groups for the plans this job may use
    spec = hybridep_layer_spec(get_gpt_layer_local_spec(num_experts=...))
    ...build GPTModel from spec with config.moe_token_dispatcher_type = "hybridep"

Code that builds its specs itself (Megatron-LM's pretrain_gpt.py) calls ``register()`` once before:
Megatron's spec builders then make HybridEPMoELayer.
"""

from __future__ import annotations

from megatron_hybridep.megatron.register import (
    hybridep_layer_spec,
    hybridep_moe_spec,
    install_hooks,
    register,
    setup,
    teardown,
)

__all__ = ["hybridep_layer_spec", "hybridep_moe_spec", "install_hooks", "register", "setup", "teardown"]
