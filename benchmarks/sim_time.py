"""Simulation time: one iteration of 1000 DCs x 8 GPUs (target < 2 s) and the paper-reproduction
sweep (target < 2 min on 2 cores).

Run:  source scripts/env.sh && python benchmarks/sim_time.py [--repeats 5] [--jobs 2] [--skip-sweep]

Scenarios (one iteration each, forward + backward, the runtime's schedule):
  deepseek planner   configs/topologies/1000dc_x_8.yaml (with its per-DC-pair overrides) and
                     deepseek-v3-like (256 experts, 58 MoE layers x 8 micro-batches): EP group of
                     64 = 8 DCs, 125 EP groups (2 classes: the one with the overrides, the rest),
                     the planner's plan, then the expert all-reduce over 125 replicas
  deepseek domains   the same, HybridEP domains dc8 gpu1 (gathers overlap the all-to-alls)
  deepseek skewed    the same with Zipf(1.2) routing: explicit flows per rank pair
  paper-l EP 8000    one EP group over all 1000 DCs x 8 GPUs (uniform links): plain EP, 7999 flow classes
  paper-l dc500      the same, domains of 500 DCs
Each is timed end to end (plan checks, flow classes, event loop), median of --repeats after a warm-up.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from plan_time import timed  # noqa: E402 - the planning-time benchmark's warm-up + repeats

from megatron_hybridep.plan.plan import Plan  # noqa: E402
from megatron_hybridep.plan.planner import choose_plan  # noqa: E402
from megatron_hybridep.plan.topology import Topology  # noqa: E402
from megatron_hybridep.plan.workload import Workload, zipf_routing  # noqa: E402
from megatron_hybridep.sim.paper import repro_spec, repro_topology, repro_workload  # noqa: E402
from megatron_hybridep.sim.simulate import simulate  # noqa: E402
from megatron_hybridep.sim.sweep import run_sweep  # noqa: E402

TARGET_ITER_S, TARGET_SWEEP_S = 2.0, 120.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=2, help="processes for the reproduction sweep (default 2)")
    ap.add_argument("--skip-sweep", action="store_true")
    args = ap.parse_args()
    print("command:", shlex.join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT), *sys.argv[1:]]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"cores available: {cores}, repeats: {args.repeats}, python {sys.version.split()[0]}")

    topo = Topology.from_yaml(os.path.join(ROOT, "configs/topologies/1000dc_x_8.yaml"))
    ds = Workload.from_yaml(os.path.join(ROOT, "configs/models/deepseek-v3-like.yaml"))
    ep = topo.default_ep_size(ds.num_experts)
    lay = topo.ep_layout(ep)
    best = choose_plan(topo, ds, check_memory=False).best  # timing only: the model needs PP to fit
    dom = Plan("domains", lay.names, lay.counts, (8, 1), ds.num_experts)
    skewed = ds.replace(routing_counts=zipf_routing(ep, ds.num_experts, ds.tokens, ds.top_k, 1.2))
    uni = repro_topology(ROOT)
    pl = repro_workload(ROOT).replace(num_experts=uni.world_size)
    ul = uni.ep_layout(uni.world_size)
    scen = [
        ("deepseek planner", lambda: simulate(topo, ds, best)),
        ("deepseek domains", lambda: simulate(topo, ds, dom)),
        ("deepseek skewed", lambda: simulate(topo, skewed, Plan("domains", lay.names, lay.counts, (1, 1), 256))),
        ("paper-l EP 8000", lambda: simulate(uni, pl, Plan("domains", ul.names, ul.counts, (1, 1), pl.num_experts))),
        ("paper-l dc500", lambda: simulate(uni, pl, Plan("domains", ul.names, ul.counts, (500, 1), pl.num_experts))),
    ]
    print(f"\n{'scenario':18s} {'plan':28s} {'iteration':>10s} {'median':>9s} {'min':>9s} {'max':>9s}  "
          f"segments/events")
    worst = 0.0
    for name, fn in scen:
        times, r = timed(fn, args.repeats)
        med = statistics.median(times)
        worst = max(worst, med)
        print(f"{name:18s} {r.plan.label:28s} {r.total:9.3g}s {med * 1e3:7.0f}ms {min(times) * 1e3:7.0f}ms "
              f"{max(times) * 1e3:7.0f}ms  {r.stats.segments}/{r.stats.events}")
    ok = worst < TARGET_ITER_S
    print(f"\none iteration, 1000 DCs x 8 GPUs: slowest median {worst:.3f} s -> "
          f"{'within' if ok else 'OVER'} the {TARGET_ITER_S:.0f} s target")
    if args.skip_sweep:
        return 0 if ok else 1
    t0 = time.perf_counter()
    n = 0
    for variant in ("full", "forward"):
        rows = run_sweep(repro_spec(ROOT, variant), jobs=args.jobs)
        n += len(rows)
    took = time.perf_counter() - t0
    ok_sweep = took < TARGET_SWEEP_S
    print(f"paper-reproduction sweep (hybridep simulate --paper-repro): {n} rows (2 variants x 10 DC counts x "
          f"7 bandwidths x 3 policies + EP) in {took:.1f} s with {args.jobs} process(es) -> "
          f"{'within' if ok_sweep else 'OVER'} the {TARGET_SWEEP_S:.0f} s target")
    return 0 if ok and ok_sweep else 1


if __name__ == "__main__":
    sys.exit(main())
