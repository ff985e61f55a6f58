"""The job-wide HybridEP runtime: the plans a job may switch between, their process groups, the
active plan, the MoE layers in forward order (for prefetching) and the measurements; and the
process's one context object (``process_context()``), which holds it with the rest of the process's
mutable runtime state.

Knows nothing of Megatron: the layers it holds only need ``start_gather(plan_index)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.topology import Topology
from megatron_hybridep.runtime.groups import GroupCache, PlanGroups, build_plan_groups, validate_for_job
from megatron_hybridep.runtime.instrument import Stats
from megatron_hybridep.runtime.migration import MigrationConfig

log = logging.getLogger(__name__)

# Hot-replica variants held at once (runtime.adopt): routing drifts over a long run, and each adopted plan
# keeps a dispatcher and exchanges in every layer; the oldest one not running is forgotten beyond this.
MAX_ADOPTED = 8


class GatheringLayer(Protocol):
    def start_gather(self) -> None: ...
    def drop_gather(self) -> None: ...
    def on_step(self, step: int) -> None: ...
    def hybridep_state_dict(self) -> dict[str, Any]: ...
    def load_hybridep_state_dict(self, state: dict[str, Any]) -> None: ...
    def encode_ahead(self) -> None: ...
    def add_plan(self, groups: PlanGroups) -> None: ...
    def remove_plan(self, index: int) -> None: ...
    def owes_grads(self) -> bool: ...
    def flush_owed(self) -> None: ...
    def collect_grad_returns(self) -> int: ...


class HybridEPRuntime:
    def __init__(self, plans: Sequence[Plan], ep_group: dist.ProcessGroup, active: int = 0,
                 prefetch: bool = True, migration: MigrationConfig | None = None) -> None:
        if not plans:
            raise ValueError("HybridEPRuntime needs at least one plan")
        ep_size = dist.get_world_size(ep_group)
        for plan in plans:  # all checks before the first collective
            validate_for_job(plan, ep_size, plan.num_experts)
        self.plans = list(plans)
        self.prebuilt = len(self.plans)  # plans past this are adopted variants (adopt), at most MAX_ADOPTED
        self.ep_group = ep_group
        self.migration = migration or MigrationConfig()
        self.step = 0
        self.groups: list[PlanGroups] = build_plan_groups(self.plans, ep_group, process_context().group_cache)
        self.active = active
        self.prefetch = prefetch
        self.stats = Stats()
        self.layers: list[GatheringLayer] = []
        self.scheduler: Any = None  # runtime.scheduler.PlanScheduler when the job re-plans (set by its builder)
        # > 0 while Megatron accumulates gradients without synchronising them (its no_sync): the
        # gradients of borrowed copies are then owed, and returned by the first backward after it
        self._no_sync_depth = 0
        # set by a loop that collects owed gradients before reducing gradients (grad_sync.install):
        # the last backward then only launches the returns, which overlap the rest of the backward
        self.async_grad_return = False
        # micro-batches of the iteration running (set by the loop): an early gradient return splits there
        self.micro_batches: int | None = None
        # set by grad_sync.install under --overlap-param-gather: finishes the all-gather of the owners'
        # expert parameters, which the distributed optimizer's step leaves to the next forward
        self.expert_param_sync: Callable[[], None] | None = None
        # Megatron's own loop (megatron/training_hooks.py) runs after_optimizer_step before the next
        # forward instead of right after the optimizer step, so that a checkpoint saved in between sees
        # nothing in flight: True while it is owed. ``boundary``: the state_dict there, kept when an
        # evaluation had to run it first and a save may follow.
        self.post_step_due = False
        self.boundary: dict[str, Any] | None = None

    @property
    def plan(self) -> Plan:
        return self.plans[self.active]

    @property
    def active_groups(self) -> PlanGroups:
        return self.groups[self.active]

    def register_layer(self, layer: GatheringLayer) -> int:
        self.layers.append(layer)
        return len(self.layers) - 1

    def after_experts(self, index: int) -> None:
        """Layer ``index`` has its experts: start the next layer's gather so it overlaps this
        layer's combine and the next layer's attention. Not from a forward recomputed inside the
        backward pass: the next layer's backward is already done by then."""
        if self.prefetch and index + 1 < len(self.layers) and torch._C._current_autograd_node() is None:
            self.layers[index + 1].start_gather()

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Wrap Megatron's no_sync with this: borrowed copies' gradients accumulate locally and
        return to their owners once, in the first backward after it (the iteration's last)."""
        self._no_sync_depth += 1  # a count: interleaved schedules leave chunks' no_sync out of order
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    @property
    def defer_grad_return(self) -> bool:
        return self._no_sync_depth > 0

    def collect_grad_returns(self) -> int:
        """Wait for the gradient returns launched in this backward (--hybridep-async-grad-return) and
        add them to the owners' main grads. Local waits on collectives every rank launched in the same
        order, so ranks may call it at different points. Returns how many were in flight."""
        return sum(layer.collect_grad_returns() for layer in self.layers)

    def flush_owed_grads(self, within: Any = None) -> int:
        """Before Megatron synchronises gradients: return what a schedule left owed (one whose last
        backward ran under no_sync, e.g. interleaved chunks) straight into the owners' main grads.
        Collective over each domain, in layer order on every rank. ``within``: only the layers inside
        this module (one model chunk). Returns how many layers owed."""
        inside = None if within is None else {id(m) for m in within.modules()}
        owing = [layer for layer in self.layers if layer.owes_grads() and (inside is None or id(layer) in inside)]
        for layer in owing:
            layer.flush_owed()
        return len(owing)

    def after_optimizer_step(self) -> None:
        """Parameters are final for the next iteration: advance the step (the shared-expert
        refresh rule runs on it), encode every layer's compressed experts now (the migration
        queue: payloads are 1/ratio of the experts, so holding all layers' is cheap) and start
        the first layer's gather; the others launch one layer ahead of the compute."""
        if self.expert_param_sync is not None:  # gathers below read the updated parameters
            self.expert_param_sync()
        self.step += 1
        for layer in self.layers:
            layer.on_step(self.step)
        if self.migration.compresses_weights:
            for layer in self.layers:
                layer.encode_ahead()
        if self.prefetch and self.layers:
            self.layers[0].start_gather()

    def state_dict(self) -> dict[str, Any]:
        """For an exact resume, taken between the optimizer step and ``after_optimizer_step`` (no
        gather in flight): the step counter (the shared-expert refresh schedule runs on it), the
        plans (adopted hot variants included) and the active one, and each layer's codec state."""
        return {"step": self.step, "plans": [p.to_json(indent=None) for p in self.plans], "active": self.active,
                "layers": [layer.hybridep_state_dict() for layer in self.layers],
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Restore a ``state_dict`` (same on every rank: plans adopted here create no group). False,
        with nothing changed, when it was saved under other plans or another model: the run goes on
        as from a checkpoint without it (fresh copies, as a plain-EP checkpoint gives)."""
        saved = [Plan.from_json(p) for p in state["plans"]]
        if saved[:len(self.plans)] != self.plans or len(state["layers"]) != len(self.layers):
            log.warning("hybridep: the checkpoint's runtime state is for other plans or layers; resuming with "
                        "fresh borrowed-expert copies and codec state")
            return False
        for plan in saved[len(self.plans):]:
            self.adopt(plan)
        for layer in self.layers:
            layer.drop_gather()
        self.active = state["active"]
        for layer, layer_state in zip(self.layers, state["layers"], strict=True):
            layer.load_hybridep_state_dict(layer_state)
        self.step = state["step"]
        for layer in self.layers:
            layer.on_step(self.step)
        if self.scheduler is not None and state.get("scheduler") is not None:  # else it measures afresh
            self.scheduler.load_state_dict(state["scheduler"])
        return True

    def adopt(self, plan: Plan) -> int:
        """Index of ``plan``, added now if it is a variant of a prebuilt plan with the same domains and
        rails (a hot-replica variant: its replica exchange runs over the EP group), so no group is
        created: identical on every rank, no collective. Call on all ranks with the same plan."""
        if plan in self.plans:
            return self.plans.index(plan)
        validate_for_job(plan, dist.get_world_size(self.ep_group), plan.num_experts)
        base = next((g for g in self.groups if g.plan.domains == plan.domains and g.plan.rails == plan.rails), None)
        if base is None:
            raise PlanError(f"hybridep: plan {plan.label} needs process groups this job did not prebuild; fix: "
                            "run with --hybridep-replan-interval so every candidate plan's groups exist")
        groups = dataclasses.replace(base, plan=plan)
        if len(self.plans) - self.prebuilt >= MAX_ADOPTED:
            self._forget(next(i for i in range(self.prebuilt, len(self.plans)) if i != self.active))
        self.plans.append(plan)
        self.groups.append(groups)
        for layer in self.layers:
            layer.add_plan(groups)
        return len(self.plans) - 1

    def _forget(self, index: int) -> None:
        """Drop an adopted plan that is not running (same on every rank: no collective)."""
        for layer in self.layers:
            layer.remove_plan(index)
        del self.plans[index], self.groups[index]
        if self.active > index:
            self.active -= 1
        if self.scheduler is not None:
            self.scheduler.plans_renumbered()

    def switch(self, plan_index: int) -> None:
        """Activate another prebuilt plan at an iteration boundary. Owners keep their parameters,
        gradients and optimizer state; borrowed copies are simply rebuilt under the new plan."""
        if plan_index == self.active:
            return
        for layer in self.layers:
            layer.drop_gather()
        log.debug("hybridep: plan %s -> %s", self.plan.label, self.plans[plan_index].label)
        self.active = plan_index


@dataclasses.dataclass
class Measuring:
    """Bytes counted per link level while a job measures (megatron/measure.py)."""

    topology: Topology
    stats: Stats


@dataclasses.dataclass
class Heartbeat:
    """This process's progress (train/launch.py ``progress()``): what its beacon answers a peer
    (train/reachability.py) and, inside a run_ranks rank, the shared slots its parent watches."""

    beats: int = 0
    iteration: int = 0
    phase: str = "start-up"
    when: float = dataclasses.field(default_factory=time.monotonic)
    slots: tuple[Any, Any, int] | None = None  # (numbers, phases, rank) inside run_ranks
    steps: list[float] = dataclasses.field(default_factory=list)  # recent step seconds, for the median


@dataclasses.dataclass
class CpuPatches:
    """What megatron/cpu_runtime.py replaced in Megatron-Core's modules, to undo it: (owner, attribute,
    original) in patch order."""

    saved: list[tuple[Any, str, Any]] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


@dataclasses.dataclass
class ProcessContext:
    """All of this process's mutable runtime state, in one object: the HybridEP runtime (None
    without hybridep), the measurement (None when not measuring), the one MoE-layer counter, the
    launcher's heartbeat, the process groups built for plans (and Megatron's, where reused) and the CPU
    runtime's patches of Megatron."""

    runtime: HybridEPRuntime | None = None
    measuring: Measuring | None = None
    moe_layers: int = 0  # MoE layers of the model being built: their statistics' keys
    heartbeat: Heartbeat = dataclasses.field(default_factory=Heartbeat)
    group_cache: GroupCache = dataclasses.field(default_factory=GroupCache)  # outlives runtimes (groups.py)
    # Megatron's own groups, kept across rebuilds of its parallel state (megatron/group_reuse.py)
    megatron_groups: GroupCache = dataclasses.field(default_factory=GroupCache)
    cpu_patches: CpuPatches = dataclasses.field(default_factory=CpuPatches)  # Megatron on CPU (cpu_runtime.py)

    def set_runtime(self, runtime: HybridEPRuntime | None) -> None:
        self.runtime = runtime
        self.restart_layers()

    def restart_layers(self) -> None:
        """A new model: count on after the layers the runtime already holds (none for a new one)."""
        self.moe_layers = len(self.runtime.layers) if self.runtime is not None else 0

    def register_moe_layer(self, layer: GatheringLayer | None = None) -> int:
        """The key of the next MoE layer built: 1-based, in build order (Megatron sets layer_number
        only after the layer's __init__). A layer that gathers also joins the runtime's layers, at
        position key - 1 (the prefetch order)."""
        self.moe_layers += 1
        if layer is not None:
            if self.runtime is None:
                raise RuntimeError("hybridep: a gathering MoE layer was built with no HybridEP runtime set up")
            if self.runtime.register_layer(layer) != self.moe_layers - 1:
                raise RuntimeError("hybridep: a measured plain MoE layer was built among the runtime's layers; "
                                   "their keys and prefetch order would disagree")
        return self.moe_layers


_CONTEXT = ProcessContext()  # the only module-level mutable state: everything else lives inside it


def process_context() -> ProcessContext:
    """The one context object of this process (each rank is its own process)."""
    return _CONTEXT


def get_runtime() -> HybridEPRuntime | None:
    """This process's HybridEP runtime (None before setup): the accessor patches/pretrain_gpt.patch uses."""
    return process_context().runtime
