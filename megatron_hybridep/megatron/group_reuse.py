"""Megatron's process groups reused when one process builds its parallel state again and again.

A process that calls initialize_model_parallel once per configuration (the bench's rank workers
build one per system) gets a new set of groups each time, and gloo never frees a group's threads
(runtime/groups.py): 60 threads per build at 4 ranks, and the same layout ran 2.2-2.9x slower by its
third build (benchmarks/rebuild_probe.py, docs/results.md). With ``reuse_megatron_groups()`` a group
asked for again (same ranks, backend, timeout and description) is the one made before, and
destroy_model_parallel leaves those alone: a second build of a layout creates no group.

Every rank asks for the same groups in the same order (new_group is collective over the world), so
hits and misses agree. Only for processes that own their world group (the bench's workers).
"""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed as dist

from megatron_hybridep.runtime.context import process_context


def reuse_megatron_groups() -> None:
    """Install the cache into megatron.core.parallel_state (idempotent). The groups live in the
    process context (``megatron_groups``), for the life of the world group."""
    from megatron.core import parallel_state as ps

    if getattr(ps.create_group, "_hybridep_reuse", False):
        return
    create, destroy = ps.create_group, ps.destroy_model_parallel

    @functools.wraps(create)
    def create_group(ranks: Any = None, timeout: Any = None, backend: Any = None, pg_options: Any = None,
                     use_local_synchronization: bool = False, group_desc: Any = None) -> Any:
        def make() -> Any:
            return create(ranks, timeout, backend, pg_options, use_local_synchronization, group_desc)

        if pg_options is not None or use_local_synchronization:  # not keyed: made each time, as Megatron does
            return make()
        return process_context().megatron_groups.cached((tuple(ranks), backend, timeout, group_desc), make)

    @functools.wraps(destroy)
    def destroy_model_parallel() -> None:
        kept = {id(g) for g in process_context().megatron_groups.groups.values()}
        real = dist.destroy_process_group

        def destroy_process_group(group: Any = None) -> None:
            if group is None or id(group) not in kept:
                real(group)

        dist.destroy_process_group = destroy_process_group  # parallel_state calls it through the module
        try:
            destroy()
        finally:
            dist.destroy_process_group = real

    create_group._hybridep_reuse = True  # type: ignore[attr-defined]
    ps.create_group, ps.destroy_model_parallel = create_group, destroy_model_parallel


def groups_made() -> int:
    """How many distinct groups this process holds for Megatron (the tests' count)."""
    return process_context().megatron_groups.created
