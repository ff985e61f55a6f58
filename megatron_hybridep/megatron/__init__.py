"""Megatron-Core glue: the only package that touches Megatron internals.

    from megatron_hybridep.megatron import register, setup
    register()                    # once, before building layer specs
    ...initialize_model_parallel(...)
    setup([plan])                 # build domain/rail groups for the plans this job may use
    ...build GPTModel with config.moe_token_dispatcher_type = "hybridep"
"""

from __future__ import annotations

from megatron_hybridep.megatron.register import register, setup, teardown

__all__ = ["register", "setup", "teardown"]
