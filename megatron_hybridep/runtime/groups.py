"""Process groups for a Plan: domains (expert all-gather) and rails (token all-to-all).

Plans speak in EP-group-local ranks (0..G-1, the position in Megatron's expert-parallel group);
this module maps them onto global ranks of every EP group in the job and creates the groups once,
in the same order on every rank (torch.distributed.new_group is collective over the world).

Groups are cached by their ranks for the life of the world group: gloo never frees a group's threads
(destroy_process_group did not either, docs/results.md), so plans with the same ranks share a group
and a runtime rebuilt in the same process (the bench builds one per system) creates none. Every rank
asks for the same ranks in the same order, so hits and misses, and the new_group calls, agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from megatron_hybridep.plan.plan import Plan, PlanError


@dataclass
class GroupCache:
    """The process groups this module created, by their global ranks, for the life of one world group
    (module doc). One per process, held by its ProcessContext (runtime/context.py), so that runtimes
    rebuilt in the process reuse them."""

    groups: dict[tuple[Any, ...], dist.ProcessGroup] = field(default_factory=dict)  # by ranks (or a wider key)
    world: dist.ProcessGroup | None = None  # the world group the cached groups belong to
    created: int = 0  # groups created in this process (the soak test's count)

    def group_of(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        """The process group of these global ranks, created on the first request (collective over the
        world: call on every rank with the same ranks in the same order)."""
        return self.cached(ranks, lambda: dist.new_group(list(ranks)))

    def cached(self, key: tuple[Any, ...], make: Callable[[], dist.ProcessGroup]) -> dist.ProcessGroup:
        """The group made by ``make()`` on the first request for ``key`` in this world (a rank outside
        the group gets a placeholder, cached the same way)."""
        from torch.distributed import distributed_c10d as c10d

        world = c10d._get_default_group()
        if self.world is not world:  # a new world (destroyed and initialised again): old groups are gone
            self.groups.clear()
            self.world = world
        if key not in self.groups:
            self.groups[key] = make()
            self.created += 1
        return self.groups[key]


@dataclass(frozen=True)
class PlanGroups:
    """This rank's view of one plan: its groups and where it sits in them."""

    plan: Plan
    ep_rank: int
    domain: dist.ProcessGroup
    rail: dist.ProcessGroup
    domain_ranks: tuple[int, ...]  # global ranks, in domain position order
    rail_ranks: tuple[int, ...]

    @property
    def rail_levels(self) -> tuple[str, ...]:
        """Per rail position, the link level traffic from this rank to it crosses."""
        return tuple(crossing_level(self.plan, self.ep_rank, r) for r in self.plan.rail_of(self.ep_rank))

    @property
    def domain_levels(self) -> tuple[str, ...]:
        return tuple(crossing_level(self.plan, self.ep_rank, r) for r in self.plan.domain_of(self.ep_rank))

    @property
    def domain_position(self) -> int:
        return self.plan.domain_of(self.ep_rank).index(self.ep_rank)

    @property
    def domain_index(self) -> int:
        """Index of this rank's domain = its position in every rail (see check_grid_order)."""
        return self.plan.rail_of(self.ep_rank).index(self.ep_rank)


def crossing_level(plan: Plan, a: int, b: int) -> str:
    """Name of the coarsest level at which EP ranks a and b differ ('local' if a == b): the link
    class their traffic uses (e.g. 'dc' = an inter-DC link)."""
    for name, ca, cb in zip(plan.level_names, plan.coords(a), plan.coords(b), strict=True):
        if ca != cb:
            return name
    return "local"


def check_grid_order(plan: Plan) -> None:
    """The dispatcher relies on one fact of the grid: sorted by rank, every rail lists the domains
    in the same order. Then 'rail position j' and 'domain j' are the same thing on every rail."""
    domain_order = sorted(plan.domains, key=min)
    index = {r: j for j, d in enumerate(domain_order) for r in d}
    for rail in plan.rails:
        got = [index[r] for r in sorted(rail)]
        if got != list(range(len(domain_order))):
            raise PlanError(f"plan {plan.label}: rail {rail} visits domains in order {got}; a HybridEP plan "
                            "needs every rail to meet the domains in rank order (use Plan.grid)")


def validate_for_job(plan: Plan, ep_size: int, num_experts: int) -> None:
    """Everything that can be checked before any collective starts."""
    plan.validate(ep_size, num_experts)
    if plan.kind != "domains":
        raise PlanError(f"plan kind {plan.kind!r} is not run by the hybridep dispatcher; the replicated plan "
                        "is Megatron's own EP inside each DC (--moe-token-dispatcher-type alltoall with "
                        f"--expert-model-parallel-size {plan.megatron_ep_size})")
    check_grid_order(plan)


def build_plan_groups(plans: list[Plan], ep_group: dist.ProcessGroup, cache: GroupCache) -> list[PlanGroups]:
    """Domain and rail groups for each plan, created unless in ``cache`` (collective over the world, call
    on all ranks with the same plans in the same order). Returns this rank's PlanGroups per plan."""
    ep_ranks = dist.get_process_group_ranks(ep_group)
    ep_size, me = len(ep_ranks), dist.get_rank()
    for plan in plans:
        plan.validate(ep_size, plan.num_experts)
    # Every EP group of the job, from each rank's own EP group (one small collective).
    everyone: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ep_ranks)
    all_ep_groups = sorted({tuple(g) for g in everyone if g is not None})
    out = []
    for plan in plans:
        mine: dict[str, tuple[dist.ProcessGroup, tuple[int, ...]]] = {}
        for kind, local_groups in (("domain", plan.domains), ("rail", plan.rails)):
            for ep in all_ep_groups:
                for local in local_groups:
                    ranks = tuple(ep[i] for i in sorted(local))
                    # new_group is collective even for groups this rank is not in. Size-1 groups
                    # too: Megatron's dispatcher wants a real group for its EP argument.
                    group = cache.group_of(ranks)
                    if me in ranks:
                        mine[kind] = (group, ranks)
        ep_rank = ep_ranks.index(me)
        out.append(PlanGroups(plan=plan, ep_rank=ep_rank, domain=mine["domain"][0], rail=mine["rail"][0],
                              domain_ranks=mine["domain"][1], rail_ranks=mine["rail"][1]))
    return out


def set_collective_timeout(seconds: float) -> int:
    """Give every process group made so far this collective timeout; returns how many.

    init_process_group's timeout covers the world group only: Megatron's groups get
    distributed_timeout_minutes and ours (new_group) torch's 30-minute default."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    groups = list(c10d._world.pg_map)
    for group in groups:
        c10d._set_pg_timeout(timedelta(seconds=seconds), group)
    return len(groups)

