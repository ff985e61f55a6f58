"""Simulator vs the closed-form stream model where the paper's assumptions hold (balanced routing, one
level, no latency): the agreement figure and the worst relative errors.

Run:  source scripts/env.sh && python benchmarks/sim_agreement.py [--png sim-out/agreement.png]

Grid: G in {16, 128, 1000} ranks, every domain size S | G, per-rank bandwidth 1 / 10 / 100 Gbit/s,
paper-l-sized layers (hidden 1024, 8.4M-parameter experts at 50x, 4096 tokens, top-2), T_pre = 0.5 ms
and 20 ms; the simulated forward time of one MoE layer under the paper's schedule (gather with T_pre,
waited before the dispatch) against
- the stream model with exact bytes: max(T_pre, (S-1)P/B) + 2(1-S/G)D/B, and
- the paper's T(p) verbatim (plan/paper_model.stream_time), which charges S(G-1)P/G for the gather
  and (G-1)/G of the true all-to-all bytes.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_hybridep.plan.grid import divisors  # noqa: E402
from megatron_hybridep.plan.paper_model import stream_time  # noqa: E402
from megatron_hybridep.plan.plan import Plan  # noqa: E402
from megatron_hybridep.plan.topology import Level, Topology  # noqa: E402
from megatron_hybridep.plan.workload import Workload  # noqa: E402
from megatron_hybridep.sim.plot import agreement_png  # noqa: E402
from megatron_hybridep.sim.schedule import SimOptions  # noqa: E402
from megatron_hybridep.sim.simulate import simulate  # noqa: E402
from megatron_hybridep.sim.validate import stream_model_exact  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--png", default="sim-out/agreement.png")
    args = ap.parse_args()
    print("command:", shlex.join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT), *sys.argv[1:]]))
    points = []
    for G in (16, 128, 1000):
        for gbps in (1.0, 10.0, 100.0):
            topo = Topology((Level("gpu", G, gbps, 0.0, gbps),))
            for t_pre_ms in (0.5, 20.0):
                w = Workload(hidden_size=1024, ffn_hidden_size=4096, num_experts=G, top_k=2, num_moe_layers=3,
                             tokens_per_rank=4096, t_pre_ms=t_pre_ms, compression_ratio=50, throughput_tflops=1e9)
                expert = w.tokens * w.top_k * w.expert_seconds_per_token
                D, P, B = w.dispatch_bytes, w.expert_wire_bytes, gbps * 1e9 / 8
                for S in divisors(G):
                    r = simulate(topo, w, Plan.grid((G,), (S,), G), options=SimOptions(schedule="paper",
                                                                                         backward=False))
                    sim = r.layer_forward(1) - expert
                    points.append({"G": G, "S": S, "p": 1 - S / G, "sim": sim,
                                   "exact": stream_model_exact(G, S, D, P, B, w.t_pre),
                                   "paper": stream_time(1 - S / G, G, D, P, B, w.t_pre).total,
                                   "hidden": stream_time(1 - S / G, G, D, P, B, w.t_pre).ag <= w.t_pre})
    exact = max(abs(p["sim"] / p["exact"] - 1) for p in points)
    print(f"{len(points)} points; worst |sim / stream model (exact bytes) - 1| = {exact:.2e}")
    for G in (16, 128, 1000):
        sel = [p for p in points if p["G"] == G]
        worst = max(abs(p["sim"] / p["paper"] - 1) for p in sel)
        hidden = [abs(p["sim"] / p["paper"] - 1) for p in sel if p["hidden"] or p["S"] == G]
        print(f"G = {G:4d}: worst |sim / paper T(p) - 1| = {worst:.2%} over {len(sel)} points; "
              f"{max(hidden):.2%} where the paper's gather term hides behind T_pre or S = G ({len(hidden)})")
    agreement_png(points, args.png, "simulated MoE layer (forward) vs closed form: one level, balanced, no latency")
    print(f"wrote {args.png}")
    return 0 if exact < 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
