"""HybridEPMoELayer: Megatron's MoELayer with the hybridep dispatcher and domain experts.

A subclass (so every ``isinstance(x, MoELayer)`` check, MTP layers included, keeps working) that
behaves exactly like MoELayer unless ``config.moe_token_dispatcher_type == "hybridep"``. Then:

- the token dispatcher is Megatron's own all-to-all dispatcher run over the plan's *rail* group,
  with the experts renumbered domain-major so that 'rail position j' = 'domain j' holds a
  contiguous block of S*L experts (see ``expert_order``);
- the experts module is Megatron's (same parameters, same checkpoint keys as plain EP); borrowed
  peers' experts run through the same module with ``torch.func.functional_call``.

Checked against megatron-core 0.19.2 (MoELayer.__init__ / routed_experts_compute / dispatcher API).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from torch.func import functional_call

from megatron_hybridep.megatron.dispatcher import HybridEPTokenDispatcher, expert_order, instrument
from megatron_hybridep.runtime.context import HybridEPRuntime, get_runtime
from megatron_hybridep.runtime.groups import PlanGroups
from megatron_hybridep.runtime.migration import DomainGather, SharedExpert

log = logging.getLogger(__name__)

HYBRIDEP = "hybridep"


class HybridEPConfigError(ValueError):
    """A Megatron setting that the hybridep dispatcher cannot honour; says which and the fix."""


def _check_config(config: Any) -> None:
    problems = []
    if getattr(config, "expert_tensor_parallel_size", 1) not in (None, 1):
        problems.append("expert_tensor_parallel_size must be 1 (use --expert-tensor-parallel-size 1)")
    if getattr(config, "gradient_accumulation_fusion", False):
        problems.append("gradient_accumulation_fusion writes wgrads into main_grad, which borrowed expert "
                        "copies do not have (use --no-gradient-accumulation-fusion)")
    if getattr(config, "moe_shared_expert_overlap", False):
        problems.append("moe_shared_expert_overlap is not supported (drop --moe-shared-expert-overlap)")
    if getattr(config, "moe_latent_size", None):
        problems.append("moe_latent_size is not supported with hybridep")
    if problems:
        raise HybridEPConfigError("--moe-token-dispatcher-type hybridep: " + "; ".join(problems))


class HybridEPMoELayer(MoELayer):
    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        hybrid = config.moe_token_dispatcher_type == HYBRIDEP
        if not hybrid:
            super().__init__(config, *args, **kwargs)
            self.hybridep = False
            return
        _check_config(config)
        runtime = get_runtime()
        if runtime is None:
            raise HybridEPConfigError(
                "moe_token_dispatcher_type='hybridep' but no HybridEP runtime is set up: call "
                "megatron_hybridep.megatron.setup(plans) after initialize_model_parallel and before "
                "building the model (pretrain_moe.py does this from --hybridep-plan)")
        # MoELayer picks its dispatcher from this string and rejects unknown ones; build it as
        # 'alltoall' (whose dispatcher we replace below) and restore the user's value.
        config.moe_token_dispatcher_type = "alltoall"
        try:
            super().__init__(config, *args, **kwargs)
        finally:
            config.moe_token_dispatcher_type = HYBRIDEP
        self.hybridep = True
        self._runtime: HybridEPRuntime = runtime
        pg_collection = kwargs.get("pg_collection") or get_default_pg_collection()
        cfg = runtime.migration
        self._shared = (SharedExpert(runtime.ep_group, self.config.num_moe_experts, cfg.shared_refresh_every)
                        if cfg.compresses_weights and cfg.use_shared else None)
        self._plan_state = [self._build_for_plan(g, pg_collection) for g in runtime.groups]
        self._index = runtime.register_layer(self)
        self.token_dispatcher = self._plan_state[runtime.active][0]

    def _build_for_plan(self, groups: PlanGroups, pg_collection: Any) -> tuple[HybridEPTokenDispatcher,
                                                                                 DomainGather | None]:
        plan, local = groups.plan, self.num_local_experts
        if plan.num_experts != self.config.num_moe_experts:
            raise HybridEPConfigError(f"plan {plan.label} has num_experts={plan.num_experts} but the model has "
                                      f"{self.config.num_moe_experts}; re-plan for this model")
        domain_size = len(groups.domain_ranks)
        rail_pgs = copy.copy(pg_collection)
        rail_pgs.ep = groups.rail
        rail_pgs.tp_ep = groups.rail  # expert TP is 1 (checked)
        first = groups.domain_index * domain_size * local
        dispatcher = HybridEPTokenDispatcher(
            domain_size * local, list(range(first, first + domain_size * local)), config=self.config,
            pg_collection=rail_pgs, order=expert_order(plan, local))
        gather = None
        if domain_size > 1:
            gather = DomainGather(list(self.experts.named_parameters()), groups.domain, groups.domain_position,
                                  layer=self._layer_key(), stats=self._runtime.stats, levels=groups.domain_levels,
                                  num_local=local, config=self._runtime.migration, shared=self._shared)
        instrument(dispatcher, self._runtime.stats, self._layer_key(), groups.rail_levels)
        return dispatcher, gather

    def _layer_key(self) -> int:
        return int(self.layer_number or 0)

    # ---- runtime hooks ---------------------------------------------------------------------
    def start_gather(self) -> None:
        gather = self._plan_state[self._runtime.active][1]
        if gather is not None:
            gather.start()

    def on_step(self, step: int) -> None:
        for _, gather in self._plan_state:
            if gather is not None:
                gather.on_step(step)

    def drop_gather(self) -> None:
        for _, gather in self._plan_state:
            if gather is not None:
                gather.drop()

    # ---- MoELayer overrides ----------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):  # noqa: ANN201
        if self.hybridep:
            self.token_dispatcher = self._plan_state[self._runtime.active][0]
            self.start_gather()  # usually already in flight (prefetched); overlaps routing if not
        return super().forward(hidden_states, *args, **kwargs)

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):  # noqa: ANN201
        if not self.hybridep:
            return super().routed_experts_compute(hidden_states, probs)
        dispatched, tokens_per_expert, permuted_probs = self.token_dispatcher.dispatch_postprocess(
            hidden_states, probs)
        gather = self._plan_state[self._runtime.active][1]
        if gather is None:
            expert_output, bias = self.experts(dispatched, tokens_per_expert, permuted_probs)
        else:
            expert_output, bias = self._domain_experts(gather, dispatched, tokens_per_expert, permuted_probs)
        self._runtime.after_experts(self._index)
        assert bias is None, "expert bias is not supported by the hybridep dispatcher"
        return self.token_dispatcher.combine_preprocess(expert_output), None

    def _domain_experts(self, gather: DomainGather, tokens: torch.Tensor, tokens_per_expert: torch.Tensor,
                        probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Run the S*L experts of the domain: slots [q*L, (q+1)*L) belong to domain position q,
        computed with this rank's parameters (q = self) or peer q's borrowed copies."""
        borrowed = gather.borrowed()
        local = self.num_local_experts
        counts = torch.as_tensor(tokens_per_expert).reshape(len(borrowed), local)
        per_member = counts.sum(dim=1).tolist()
        outputs = []
        for weights, x, p, tpe in zip(borrowed, tokens.split(per_member), probs.split(per_member), counts,
                                      strict=True):
            if weights is None:
                out, _ = self.experts(x, tpe, p)
            else:
                out, _ = functional_call(self.experts, weights, (x, tpe, p))
            outputs.append(out)
        return torch.cat(outputs, dim=0), None
