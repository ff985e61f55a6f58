"""One rank of a soak run (issue 28): pretrain_moe's CPU loop with the scheduler forced to switch plans
every ``switch_every`` iterations (SchedulerConfig.cycle_every), sampling this process's resources.

Used by tests/runtime/test_soak.py and benchmarks/soak.py (``run_ranks(rank, world, argv, ...)``).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Sequence
from typing import Any

from megatron_hybridep.testing.loop import PRESET, REPO

TOPOLOGY_2DC = os.path.join(REPO, "configs", "topologies", "2dc_x_2.yaml")


def slow_wan_topology(path: str) -> str:
    """The 2dc_x_2 topology with a 1 Mbit/s WAN: measured loopback calls are overhead-bound, so the
    scheduler prices with this rate, and hot-replica variants pay (they join the cycle)."""
    with open(TOPOLOGY_2DC) as f:
        src = f.read()
    for old in ("bandwidth_gbps: 10\n", "uplink_gbps: 10\n"):
        assert old in src, old
        src = src.replace(old, old.split(":")[0] + ": 0.001\n")
    with open(path, "w") as f:
        f.write(src)
    return path


def resources() -> dict[str, int]:
    """This process: resident memory (kB), threads, open fds, process groups alive (c10d's map: ours
    and Megatron's) and those runtime/groups.py created."""
    from torch.distributed import distributed_c10d as c10d

    from megatron_hybridep.runtime.context import process_context

    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"rss_kb": rss, "threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")),
            "groups": len(c10d._world.pg_map), "hybridep_groups": process_context().group_cache.created}


def rank(ctx: Any, argv: Sequence[str], switch_every: int, sample_every: int) -> dict[str, Any]:
    """Run the loop; return per-iteration plan labels and step times, the switches (iteration, label,
    seconds of the scheduler's decision that switched: cost model, adopt and switch), resource samples
    every ``sample_every`` iterations, and the prebuilt plans (for a rebuild check)."""
    from megatron_hybridep.megatron.arguments import parse
    from megatron_hybridep.runtime import scheduler
    from megatron_hybridep.runtime.context import process_context
    from megatron_hybridep.train import cpu_loop

    scheduler.SchedulerConfig = functools.partial(scheduler.SchedulerConfig, cycle_every=switch_every)
    decide, decided = scheduler.PlanScheduler.decide, []

    def timed_decide(self: Any, iteration: int) -> Any:
        t = time.perf_counter()
        d = decide(self, iteration)
        decided.append((iteration, d.switched, time.perf_counter() - t))
        return d

    scheduler.PlanScheduler.decide = timed_decide
    out: dict[str, Any] = {"labels": [], "step_s": [], "samples": [], "switches": [], "prebuilt": None}

    def on_iteration(iteration: int, seconds: float, decision: Any) -> None:
        runtime = process_context().runtime
        if out["prebuilt"] is None:
            out["prebuilt"] = [p.to_json(indent=None) for p in runtime.plans]
        out["labels"].append(runtime.plan.label)
        out["step_s"].append(seconds)
        if decision is not None and decision.switched:
            out["switches"].append((iteration, runtime.plan.label, decided[-1][2]))
        if iteration % sample_every == 0 or iteration == 1:
            out["samples"].append({"iteration": iteration, "plans": len(runtime.plans), **resources()})

    t0 = time.perf_counter()
    cpu_loop.run(parse([*argv], default_config=PRESET), on_iteration=on_iteration)
    out["wall_s"] = time.perf_counter() - t0
    out["rebuild_groups"], out["groups_per_ranks"] = _rebuilt(out["prebuilt"])
    return out


def _rebuilt(prebuilt: Sequence[str]) -> tuple[int, int]:
    """(groups created by a second runtime for the same plans in this process, as the bench builds one
    per system: 0 when reused; most distinct group objects its plans hold for one rank tuple: 1 when
    plans with the same ranks share a group)."""
    import torch.distributed as dist

    from megatron_hybridep.plan.plan import Plan
    from megatron_hybridep.runtime.context import HybridEPRuntime

    before = resources()["groups"]
    runtime = HybridEPRuntime([Plan.from_json(p) for p in prebuilt], dist.group.WORLD)
    created = resources()["groups"] - before
    objects: dict[tuple[int, ...], set[int]] = {}
    for g in runtime.groups:
        objects.setdefault(g.domain_ranks, set()).add(id(g.domain))
        objects.setdefault(g.rail_ranks, set()).add(id(g.rail))
    return created, max(len(v) for v in objects.values())
