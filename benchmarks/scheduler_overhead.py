#!/usr/bin/env python
"""What the plan scheduler costs per iteration in the default run (`./scripts/train`'s config:
configs/presets/cpu_demo.yaml, 4 local CPU ranks), as a fraction of the step time.

    python benchmarks/scheduler_overhead.py                          # intervals 1 and 10, 100 iterations
    python benchmarks/scheduler_overhead.py --intervals 10 --iters 300 --repeats 3

Each rank runs pretrain_moe's CPU loop with --hybridep-replan-interval N and times every call of
PlanScheduler.step, the real one: it starts this interval's statistics all-reduce in the background
and decides on the previous interval's (update_estimates + the cost model over the candidate plans; a
switch if any). Overhead per iteration, amortised over the interval = time in step / iterations. For
reference, the same all-reduce done blocking right after a barrier (ranks in step) is timed too: what
the scheduler would add per decision without the overlap. The instrumentation the
scheduler reads (bytes and time per collective, routing counts: runtime/instrument.Stats, fed by the
dispatcher and the expert gather) runs in every hybridep run for the training log too; its cost is
counted as calls per iteration x the time of one call (timed here in a tight loop, the routing count
on the run's own routing-map shape), and added to the scheduler's. Figures: median over ranks and
repeats; step time = median step of the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_hybridep.plan.phases import Phase  # noqa: E402
from megatron_hybridep.train.launch import run_ranks  # noqa: E402

PRESET = os.path.join(REPO, "configs", "presets", "cpu_demo.yaml")


def rank(ctx: Any, argv: list[str]) -> dict[str, Any]:
    import torch.distributed as dist

    from megatron_hybridep.megatron.arguments import parse
    from megatron_hybridep.runtime import scheduler
    from megatron_hybridep.runtime.instrument import Stats
    from megatron_hybridep.train import cpu_loop

    t = {"measure_sync": 0.0, "decision": 0.0, "idle": 0.0, "decisions": 0}
    calls = {"add": 0, "add_routing": 0}
    step, add, add_routing = scheduler.PlanScheduler.step, Stats.add, Stats.add_routing

    def timed_step(self: Any, iteration: int) -> Any:
        t0 = time.perf_counter()
        decision = step(self, iteration)  # the real step: launch this interval's all-reduce, decide on the last
        dt = time.perf_counter() - t0
        if iteration <= self.config.warmup or iteration % self.config.interval:
            t["idle"] += dt  # returns at once; timed anyway
            return decision
        t["decision"] += dt
        t["decisions"] += 1
        # reference: the statistics all-reduce done blocking, ranks in step (what overlap hides)
        dist.barrier(group=self.runtime.ep_group)
        t3 = time.perf_counter()
        self.measure()
        t["measure_sync"] += time.perf_counter() - t3
        return decision

    def counted_add(self: Any, *a: Any, **k: Any) -> None:
        calls["add"] += 1
        add(self, *a, **k)

    def counted_routing(self: Any, *a: Any, **k: Any) -> None:
        calls["add_routing"] += 1
        add_routing(self, *a, **k)

    scheduler.PlanScheduler.step, Stats.add, Stats.add_routing = timed_step, counted_add, counted_routing
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # Megatron's argument dump
            summary = cpu_loop.run(parse(argv))
    finally:
        scheduler.PlanScheduler.step, Stats.add, Stats.add_routing = step, add, add_routing
    n = summary.iterations
    return {"iterations": n, "median_step_s": statistics.median(summary.step_times), **t,
            "scheduler_s": t["decision"] + t["idle"], "add_per_iter": calls["add"] / n,
            "routing_per_iter": calls["add_routing"] / n}


def instrumentation_call_s(tokens: int, experts: int) -> tuple[float, float]:
    """Seconds of one Stats.add (with the perf_counter pair around a collective) and of one routing
    count (the dispatcher's routing_map.sum + Stats.add_routing) at this routing-map shape."""
    import torch

    from megatron_hybridep.runtime.instrument import Stats

    stats, n = Stats(), 20000
    t0 = time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        stats.add(i % 4, Phase.TOKEN_DISPATCH, "rail", 4096, time.perf_counter() - t, level="dc")
    add_s = (time.perf_counter() - t0) / n
    routing_map = torch.rand(tokens, experts) < 0.25
    t0 = time.perf_counter()
    for i in range(n // 10):
        stats.add_routing(i % 2, routing_map.sum(dim=0).cpu().numpy())
    return add_s, (time.perf_counter() - t0) / (n // 10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--intervals", default="1,10", help="comma list of --hybridep-replan-interval values")
    p.add_argument("--iters", type=int, default=100, help="training iterations per run (the default run: 300)")
    p.add_argument("--repeats", type=int, default=1)
    a = p.parse_args()
    print(f"command: python benchmarks/scheduler_overhead.py --intervals {a.intervals} --iters {a.iters} "
          f"--repeats {a.repeats}")
    torch_threads = os.environ.setdefault("OMP_NUM_THREADS", "1")
    add_s, routing_s = instrumentation_call_s(tokens=4 * 64, experts=8)  # micro-batch 4 x seq 64 (preset)
    print(f"config: {os.path.relpath(PRESET, REPO)} (the default run), {a.iters} iterations, 4 CPU ranks "
          f"(OMP_NUM_THREADS={torch_threads}); one Stats.add {add_s * 1e6:.2f} us, one routing count "
          f"{routing_s * 1e6:.1f} us")
    print(f"{'interval':>8} {'step ms':>8} {'decision ms':>11} {'(blocking all-reduce ms)':>24} "
          f"{'scheduler ms/iter':>17} {'instrument ms/iter':>18} {'overhead':>9} {'decisions':>9}")
    worst = 0.0
    for interval in [int(x) for x in a.intervals.split(",")]:
        argv = ["--config", PRESET, "--train-iters", str(a.iters), "--log-interval", str(a.iters),
                "--hybridep-replan-interval", str(interval)]
        rows = [r for _ in range(a.repeats) for r in run_ranks(rank, 4, argv, timeout=1800)]
        step = statistics.median(r["median_step_s"] for r in rows)
        sched = statistics.median(r["scheduler_s"] / r["iterations"] for r in rows)
        instr = statistics.median(r["add_per_iter"] * add_s + r["routing_per_iter"] * routing_s for r in rows)
        frac = (sched + instr) / step
        worst = max(worst, frac)
        def per(key: str, rows: list[dict[str, Any]] = rows) -> float:
            return statistics.median(r[key] / max(1, r["decisions"]) for r in rows) * 1e3

        print(f"{interval:8d} {step * 1e3:8.1f} {per('decision'):11.3f} {per('measure_sync'):24.3f} "
              f"{sched * 1e3:17.3f} {instr * 1e3:18.3f} {frac:9.2%} {rows[0]['decisions']:9d}",
              flush=True)
    print(f"worst overhead {worst:.2%} of the step time (target < 1%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
