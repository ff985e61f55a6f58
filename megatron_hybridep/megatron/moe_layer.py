"""HybridEPMoELayer: Megatron's MoELayer with the hybridep dispatcher and domain experts.

A subclass (so every ``isinstance(x, MoELayer)`` check, MTP layers included, keeps working) that
behaves exactly like MoELayer unless ``config.moe_token_dispatcher_type == "hybridep"``. Then:

- the token dispatcher is Megatron's own all-to-all dispatcher run over the plan's *rail* group,
  with the experts renumbered domain-major so that 'rail position j' = 'domain j' holds a
  contiguous block of S*L experts (see ``expert_order``);
- the experts module is Megatron's (same parameters, same checkpoint keys as plain EP); borrowed
  peers' experts run through the same module with ``torch.func.functional_call``;
- hot-expert replicas (plan.replicas): a rank computes its own tokens for the experts it holds
  replicas of before dispatch (replica_experts.py) and adds them to the combined output;
- fast path: with a plan of domain size 1 and no replicas the layer runs MoELayer's own forward with
  a Megatron alltoall dispatcher (over the EP group itself when the rail is that group), i.e.
  Megatron's plain EP path; only the routing/bytes instrumentation stays on.

Checked against megatron-core 0.19.2 (MoELayer.__init__ / routed_experts_compute / dispatcher API).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from torch.func import functional_call

from megatron_hybridep.megatron import measure
from megatron_hybridep.megatron.dispatcher import HybridEPTokenDispatcher, expert_order, instrument
from megatron_hybridep.megatron.replica_experts import replica_experts
from megatron_hybridep.runtime.context import HybridEPRuntime, process_context
from megatron_hybridep.runtime.groups import PlanGroups, crossing_level
from megatron_hybridep.runtime.migration import DomainGather, SharedExpert
from megatron_hybridep.runtime.replication import ReplicaExchange

log = logging.getLogger(__name__)

HYBRIDEP = "hybridep"


class HybridEPConfigError(ValueError):
    """A Megatron setting that the hybridep dispatcher cannot honour; says which and the fix."""


def _check_config(config: Any) -> None:
    problems = []
    if getattr(config, "expert_tensor_parallel_size", 1) not in (None, 1):
        problems.append("expert_tensor_parallel_size must be 1 (use --expert-tensor-parallel-size 1)")
    if getattr(config, "moe_shared_expert_overlap", False):
        problems.append("moe_shared_expert_overlap is not supported (drop --moe-shared-expert-overlap)")
    if getattr(config, "moe_latent_size", None):
        problems.append("moe_latent_size is not supported with hybridep")
    if problems:
        raise HybridEPConfigError("--moe-token-dispatcher-type hybridep: " + "; ".join(problems))


@dataclass
class PlanState:
    """One plan's machinery in one layer."""

    dispatcher: MoEAlltoAllTokenDispatcher
    gather: DomainGather | None = None       # domain size > 1
    replicas: ReplicaExchange | None = None  # plan.replicas

    @property
    def plain(self) -> bool:
        """Megatron's EP path unchanged (domain size 1, no replicas)."""
        return self.gather is None and self.replicas is None


class HybridEPMoELayer(MoELayer):
    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        hybrid = config.moe_token_dispatcher_type == HYBRIDEP
        if not hybrid:
            super().__init__(config, *args, **kwargs)
            self.hybridep = False
            self._measure_plain_ep()
            return
        _check_config(config)
        runtime = process_context().runtime
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
        self._pg_collection = pg_collection
        self._key = process_context().register_moe_layer(self)  # before the plans' machinery: it keys their statistics
        self._plan_state = [self._build_for_plan(g, pg_collection) for g in runtime.groups]
        self._replica_out: torch.Tensor | None = None
        self.token_dispatcher = self._plan_state[runtime.active].dispatcher

    def _measure_plain_ep(self) -> None:
        """Megatron's own dispatcher counted like hybridep's, when the job measures (measure.py)."""
        stats = measure.stats()
        if stats is None or not isinstance(self.token_dispatcher, MoEAlltoAllTokenDispatcher):
            return
        ranks = dist.get_process_group_ranks(self.token_dispatcher.ep_group)
        instrument(self.token_dispatcher, stats, process_context().register_moe_layer(),
                   measure.levels_towards(ranks, dist.get_rank()))

    @property
    def _active(self) -> PlanState:
        return self._plan_state[self._runtime.active]

    def _build_for_plan(self, groups: PlanGroups, pg_collection: Any) -> PlanState:
        plan, local = groups.plan, self.num_local_experts
        if plan.num_experts != self.config.num_moe_experts:
            raise HybridEPConfigError(f"plan {plan.label} has num_experts={plan.num_experts} but the model has "
                                      f"{self.config.num_moe_experts}; re-plan for this model")
        domain_size = len(groups.domain_ranks)
        rail_pgs = copy.copy(pg_collection)
        rail_pgs.ep = groups.rail
        rail_pgs.tp_ep = groups.rail  # expert TP is 1 (checked)
        first = groups.domain_index * domain_size * local
        experts = list(range(first, first + domain_size * local))
        if plan.replicas and self.config.moe_expert_capacity_factor is not None:
            raise HybridEPConfigError(f"plan {plan.label}: hot-expert replicas change which tokens a capacity "
                                      "factor drops; use a plan without replicas or drop "
                                      "--moe-expert-capacity-factor")
        if domain_size == 1 and not plan.replicas:  # Megatron's own dispatcher, over its EP group if the rail
            same = dist.get_process_group_ranks(pg_collection.ep) == list(groups.rail_ranks)
            dispatcher = MoEAlltoAllTokenDispatcher(local, experts, config=self.config,
                                                    pg_collection=pg_collection if same else rail_pgs)
        else:
            dispatcher = HybridEPTokenDispatcher(domain_size * local, experts, config=self.config,
                                                 pg_collection=rail_pgs, order=expert_order(plan, local),
                                                 masked=bool(plan.replicas))
        gather = replicas = None
        if domain_size > 1:
            gather = DomainGather(list(self.experts.named_parameters()), groups.domain, groups.domain_position,
                                  layer=self._layer_key(), stats=self._runtime.stats, levels=groups.domain_levels,
                                  num_local=local, config=self._runtime.migration, shared=self._shared,
                                  defer=self._defer, asynchronous=self._asynchronous, fuse_wgrad=self._fuse_wgrad,
                                  micro_batches=lambda: self._runtime.micro_batches)
        if plan.replicas:
            levels = tuple(crossing_level(plan, groups.ep_rank, q) for q in range(plan.ep_size))
            replicas = ReplicaExchange(list(self.experts.named_parameters()), local, plan, groups.ep_rank,
                                       self._runtime.ep_group, layer=self._layer_key(), stats=self._runtime.stats,
                                       levels=levels, hold=self._runtime.migration.hold_copies, defer=self._defer,
                                       asynchronous=self._asynchronous, step=lambda: self._runtime.step,
                                       fuse_wgrad=self._fuse_wgrad)
        instrument(dispatcher, self._runtime.stats, self._layer_key(), groups.rail_levels)
        return PlanState(dispatcher, gather, replicas)

    def add_plan(self, groups: PlanGroups) -> None:
        """A plan adopted after construction (runtime.adopt): its groups exist already."""
        self._plan_state.append(self._build_for_plan(groups, self._pg_collection))

    def remove_plan(self, index: int) -> None:
        """An adopted plan the runtime forgets (runtime.MAX_ADOPTED); not the active one."""
        state = self._plan_state.pop(index)
        for x in (state.gather, state.replicas):
            if x is not None:
                x.drop()

    @property
    def _fuse_wgrad(self) -> bool:
        """--gradient-accumulation-fusion: Megatron's expert layers write wgrads into main_grad."""
        return bool(getattr(self.config, "gradient_accumulation_fusion", False))

    def _layer_key(self) -> int:
        """This rank's MoE layer ordinal, 1-based: the statistics' key. Not layer_number: Megatron sets
        it after __init__, so every layer's machinery was keyed 0 (one layer's routing counted twice)."""
        return self._key

    def _defer(self) -> bool:
        return self._runtime.defer_grad_return

    def _asynchronous(self) -> bool:
        return self._runtime.async_grad_return

    # ---- runtime hooks ---------------------------------------------------------------------
    def start_gather(self) -> None:
        state = self._active
        if state.gather is not None:
            state.gather.start()
        if state.replicas is not None:
            state.replicas.start()

    def on_step(self, step: int) -> None:
        for state in self._plan_state:
            if state.gather is not None:
                state.gather.on_step(step)

    def encode_ahead(self) -> None:
        gather = self._active.gather
        if gather is not None:
            gather.encode_ahead()

    def _owing(self) -> list[Any]:
        state = self._active
        return [x for x in (state.gather, state.replicas) if x is not None and x.owed.owes]

    def owes_grads(self) -> bool:
        return bool(self._owing())

    def flush_owed(self) -> None:
        for x in self._owing():
            x.flush_owed()

    def collect_grad_returns(self) -> int:
        launched = [x for x in self._owing() if x.owed.pending is not None]
        for x in launched:
            x.flush_owed()  # with a return in flight: waits for it, no new collective
        return len(launched)

    def hybridep_state_dict(self) -> dict[str, Any]:
        """The runtime state this layer owns (not parameters, so not in Megatron's state_dict): the
        shared expert and each plan's domain gather."""
        return {"shared": self._shared.state_dict() if self._shared is not None else None,
                "gathers": [s.gather.state_dict() if s.gather is not None else None for s in self._plan_state]}

    def load_hybridep_state_dict(self, state: dict[str, Any]) -> None:
        if (state["shared"] is None) != (self._shared is None) or len(state["gathers"]) != len(self._plan_state):
            raise ValueError("hybridep state of another configuration (shared expert or plans differ)")
        if self._shared is not None:
            self._shared.load_state_dict(state["shared"])
        for plan_state, saved in zip(self._plan_state, state["gathers"], strict=True):
            if (plan_state.gather is None) != (saved is None):
                raise ValueError("hybridep state of another configuration (domain sizes differ)")
            if plan_state.gather is not None:
                plan_state.gather.load_state_dict(saved)

    def drop_gather(self) -> None:
        for state in self._plan_state:
            if state.gather is not None:
                state.gather.drop()
            if state.replicas is not None:
                state.replicas.drop()

    # ---- MoELayer overrides ----------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):  # noqa: ANN201
        if self.hybridep:
            state = self._active
            if self.token_dispatcher is not state.dispatcher:  # nn.Module's __setattr__ is slow per call
                self.token_dispatcher = state.dispatcher
            if not state.plain:
                self.start_gather()  # usually already in flight (prefetched); overlaps routing if not
        return super().forward(hidden_states, *args, **kwargs)

    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):  # noqa: ANN201
        exchange = self._active.replicas if self.hybridep else None
        if exchange is not None:
            hidden_states, routing_map, self._replica_out = replica_experts(
                self.experts, exchange, hidden_states, probs, routing_map, self._runtime.stats, self._layer_key())
        return super().preprocess(hidden_states, probs, routing_map)

    def postprocess(self, output: torch.Tensor, shared_expert_output: torch.Tensor | None):  # noqa: ANN201
        output = super().postprocess(output, shared_expert_output)
        local, self._replica_out = getattr(self, "_replica_out", None), None
        return output if local is None else output + local.view_as(output)

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):  # noqa: ANN201
        if not self.hybridep or self._active.plain:
            return super().routed_experts_compute(hidden_states, probs)
        dispatched, tokens_per_expert, permuted_probs = self.token_dispatcher.dispatch_postprocess(
            hidden_states, probs)
        gather = self._active.gather
        if gather is None:
            expert_output, bias = self.experts(dispatched, tokens_per_expert, permuted_probs)
        else:
            expert_output, bias = self._domain_experts(gather, dispatched, tokens_per_expert, permuted_probs)
        self._runtime.after_experts(self._key - 1)
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
