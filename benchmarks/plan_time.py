"""Planning time for 1000 DCs x 8 GPUs and a 256-expert model, on one core (target: < 1 s).

Run:  source scripts/env.sh && python benchmarks/plan_time.py [--repeats 7] [--check]

Scenarios (all on configs/topologies/1000dc_x_8.yaml, with its per-DC-pair overrides):
  default EP    DeepSeek-V3-like (256 experts): the largest EP group that fits (64 = 8 DCs x 8 GPUs),
                every domain-size combination + the replicated plan
  all EP sizes  the same for every feasible EP size (1 .. 64): what `hybridep plan --ep-size all` does
  skewed        default EP with a Zipf(1.2) routing-count matrix (explicit flows, 64 x 256)
  EP over 1000  stress: one EP group over all 1000 DCs (8000 ranks, 8000 experts), 65 candidates
Each is timed end to end (choose_plan: enumerate, cost every candidate, rank, paper model), median of
--repeats runs after one warm-up; YAML loading is timed separately.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core: keep numpy's BLAS single-threaded
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_hybridep.plan.planner import choose_plan, choose_plan_all_ep_sizes  # noqa: E402
from megatron_hybridep.plan.topology import Topology  # noqa: E402
from megatron_hybridep.plan.workload import Workload, zipf_routing  # noqa: E402

TARGET_S = 1.0


def timed(fn, repeats: int) -> tuple[list[float], object]:
    out = fn()  # warm-up (imports, caches)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--check", action="store_true", help="exit 1 if the default-EP median exceeds 1 s")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the process to one CPU core")
    args = parser.parse_args()
    if not args.no_pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    print("command:", shlex.join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT), *sys.argv[1:]]))
    print(f"cores: {cores} (pinned: {not args.no_pin}), repeats: {args.repeats}, python {sys.version.split()[0]}")

    t0 = time.perf_counter()
    topo = Topology.from_yaml(os.path.join(ROOT, "configs", "topologies", "1000dc_x_8.yaml"))
    model = Workload.from_yaml(os.path.join(ROOT, "configs", "models", "deepseek-v3-like.yaml"))
    load = time.perf_counter() - t0
    print(f"world: {topo.describe()}, model: {model.name} ({model.num_experts} experts, top-{model.top_k}); "
          f"YAML load {load * 1e3:.1f} ms")

    ep = topo.default_ep_size(model.num_experts)
    skewed = model.replace(routing_counts=zipf_routing(ep, model.num_experts, model.tokens, model.top_k, 1.2))
    wide = model.replace(num_experts=topo.world_size, top_k=8)
    scenarios = [
        ("default EP", lambda: [choose_plan(topo, model, check_memory=False)]),
        ("all EP sizes", lambda: choose_plan_all_ep_sizes(topo, model, check_memory=False)),
        ("skewed routing", lambda: [choose_plan(topo, skewed, ep, check_memory=False)]),
        ("EP over 1000 DCs", lambda: [choose_plan(topo, wide, topo.world_size, check_memory=False)]),
    ]
    print(f"\n{'scenario':18s} {'EP sizes':>9s} {'candidates':>10s} {'median':>9s} {'min':>9s} {'max':>9s}  chosen")
    default_median = None
    for name, fn in scenarios:
        times, results = timed(fn, args.repeats)
        med = statistics.median(times)
        if default_median is None:
            default_median = med
        n_cands = sum(len(r.candidates) for r in results)
        best = min(results, key=lambda r: r.chosen.cost.total)
        print(f"{name:18s} {len(results):>9d} {n_cands:>10d} {med * 1e3:>7.1f}ms {min(times) * 1e3:>7.1f}ms "
              f"{max(times) * 1e3:>7.1f}ms  ep={best.layout.ep_size} {best.best.label}")
    ok = default_median is not None and default_median < TARGET_S
    print(f"\nplanning time, 1000 DCs x 8 GPUs, 256 experts (default EP): median {default_median * 1e3:.1f} ms "
          f"on one core -> {'within' if ok else 'OVER'} the {TARGET_S:.0f} s target")
    return 1 if (args.check and not ok) else 0


if __name__ == "__main__":
    sys.exit(main())
