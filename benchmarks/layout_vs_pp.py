"""HybridEP against the layout cross-DC Megatron users run: one pipeline stage per DC (issue 25),
measured on the testbed through pretrain_moe.py itself (one process per rank), with the planner
told the shaped rate.

    sudo python benchmarks/layout_vs_pp.py --rate 20 --repeats 2 --out docs/results/layout_vs_pp

Systems (every one with --overlap-grad-reduce, as a Megatron user runs it):
- ep: alltoall EP over all ranks (PP 1);
- hybridep: the planner's HybridEP plan, PP 1;
- pp: PP = the number of DCs (one stage per DC), alltoall EP inside each stage;
- pp-hybridep: the same layout with the hybridep dispatcher (the planner's plan inside a stage);
- auto: --hybridep-layout auto (the layout planner's choice).
Runs alternate system by system within a repeat, the order reversed every other repeat; each run's
figure is the median step after --warmup iterations; the report is the median over repeats with
the range, the inter-DC bytes per iteration the job counted, and what --hybridep-layout auto chose.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# issue 25's model: cpu_demo with 4 layers, hidden 128, 16 experts (ffn 512), seq 128, micro-batch 4
MODEL = ["--config", str(REPO / "configs" / "presets" / "cpu_demo.yaml"),
         "--num-layers", "4", "--hidden-size", "128", "--ffn-hidden-size", "512", "--moe-ffn-hidden-size", "512",
         "--num-experts", "16", "--seq-length", "128", "--max-position-embeddings", "128",
         "--micro-batch-size", "4", "--lr-warmup-iters", "1", "--overlap-grad-reduce"]
STEP = re.compile(r" iter +(\d+)/\d+ \| loss +[\d.na]+ \| step +([\d.]+) ms .*?\| inter-DC ([\d.]+) (\w?B)/iter")
UNITS = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}


def systems(dcs: int, world: int) -> dict[str, list[str]]:
    pp = ["--pipeline-model-parallel-size", str(dcs), "--expert-model-parallel-size", str(world // dcs)]
    return {"ep": ["--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", str(world)],
            "hybridep": ["--expert-model-parallel-size", str(world)],
            "pp": ["--moe-token-dispatcher-type", "alltoall", *pp],
            "pp-hybridep": pp,
            "auto": ["--hybridep-layout", "auto"]}


def write_topology(path: Path, dcs: int, per_dc: int, rate_mbit: float, intra_gbps: float) -> Path:
    spec = {"name": f"testbed_{dcs}dc_x_{per_dc}", "description": f"testbed at {rate_mbit:g} Mbit/s per DC uplink",
            "world_size": dcs * per_dc, "memory_gb_per_gpu": 8,
            "levels": [{"name": "dc", "count": dcs, "bandwidth_gbps": rate_mbit / 1e3, "latency_us": 0,
                        "uplink_gbps": rate_mbit / 1e3},
                       {"name": "gpu", "count": per_dc, "bandwidth_gbps": intra_gbps, "latency_us": 10}]}
    path.write_text(yaml.safe_dump(spec))
    return path


def parse_log(text: str, warmup: int) -> tuple[list[float], float]:
    """(step seconds after warm-up, inter-DC bytes per iteration of the last logged iteration)."""
    rows = [(int(i), float(ms) / 1e3, float(b) * UNITS[u]) for i, ms, b, u in STEP.findall(text)]
    steps = [s for i, s, _ in rows if i > warmup]
    return steps, rows[-1][2] if rows else float("nan")


def run_one(tb, flags: list[str], args: argparse.Namespace, topology: Path) -> dict:  # noqa: ANN001
    from megatron_hybridep.testbed.launcher import python_cmd
    from megatron_hybridep.train.rank_imports import PRELOAD

    cmd = python_cmd(REPO / "pretrain_moe.py", *MODEL, "--global-batch-size", str(args.global_batch),
                     "--train-iters", str(args.iters), "--log-interval", "1", "--hybridep-topology", topology, *flags)
    result = tb.launch(cmd, timeout_s=args.timeout, cwd=REPO, preload=PRELOAD)
    text = result.outputs[0]
    if not result.ok:
        raise RuntimeError(f"run failed: {' '.join(map(str, cmd))}\n{text[-3000:]}")
    steps, wan = parse_log(text, args.warmup)
    chose = re.search(r"\[layout\] running (TP\d+ PP\d+ EP\d+ DP\d+)", text)
    plan = re.search(r"\[pretrain_moe\] plan: (\S+(?: \S+)?);", text)
    return {"median_s": statistics.median(steps), "steps": len(steps), "wan_bytes": wan,
            "layout": chose.group(1) if chose else None, "plan": plan.group(1) if plan else None}


def testbed_flags(p: argparse.ArgumentParser, rate: float) -> None:
    """The emulated testbed and the global batch (this script's and time_to_loss.py's)."""
    p.add_argument("--dcs", type=int, default=2)
    p.add_argument("--ranks-per-dc", type=int, default=2)
    p.add_argument("--rate", type=float, default=rate, help="Mbit/s per DC uplink")
    p.add_argument("--intra-gbps", type=float, default=2.0, help="what the planner assumes for loopback inside a DC")
    p.add_argument("--global-batch", type=int, default=64, help="4 micro-batches of 4 at PP 1 on 2 x 2")
    p.add_argument("--queue-ms", type=float, default=0.0,
                   help="queue before each uplink's rate limit as ms at the rate, e.g. 50 (a shallow-buffer link); "
                        "default 0: the kernel's 1000 packets")
    p.add_argument("--burst-ms", type=float, default=None,
                   help="HTB bucket of each uplink as ms at the rate, e.g. 1 (a link that banks no idle time, as "
                        "`hybridep bench` shapes it); default: >= 70 KB, which lets the first 70 KB after an idle gap "
                        "pass unshaped (the runs recorded before 2026-11-28 afternoon)")
    p.add_argument("--congestion", default="reno",
                   help="TCP congestion control inside the DCs (default reno); host: the host's default (BBR here), "
                        "which the runs recorded before 2026-11-27 had")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    testbed_flags(p, rate=20.0)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--systems", default="ep,hybridep,pp,pp-hybridep,auto")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=None, help="folder for results.json and results.md")
    args = p.parse_args(argv)
    from megatron_hybridep.testbed import Testbed, TestbedConfig

    world = args.dcs * args.ranks_per_dc
    table = {k: v for k, v in systems(args.dcs, world).items() if k in args.systems.split(",")}
    out = Path(args.out) if args.out else Path(os.getcwd())
    out.mkdir(parents=True, exist_ok=True)
    topology = write_topology(out / "topology.yaml", args.dcs, args.ranks_per_dc, args.rate, args.intra_gbps)
    print("# " + " ".join([sys.executable, *sys.argv]), flush=True)
    runs: dict[str, list[dict]] = {s: [] for s in table}
    with Testbed(TestbedConfig(dcs=args.dcs, ranks_per_dc=args.ranks_per_dc, rate_mbit=args.rate,
                               queue_ms=args.queue_ms, burst_ms=args.burst_ms, congestion=args.congestion)) as tb:
        print("# " + tb.describe(), flush=True)
        for r in range(args.repeats):
            for s in (list(table) if r % 2 == 0 else list(table)[::-1]):
                runs[s].append(run_one(tb, table[s], args, topology))
                print(f"repeat {r} {s:12s} {runs[s][-1]}", flush=True)
    pp_med = statistics.median(x["median_s"] for x in runs["pp"]) if "pp" in runs else None
    lines = [f"{args.dcs} DCs x {args.ranks_per_dc} ranks at {args.rate:g} Mbit/s, global batch {args.global_batch}, "
             f"{args.iters} iterations ({args.warmup} dropped), {args.repeats} repeats",
             "", "| system | flags | median s/step [range] | vs pp | inter-DC per iteration | layout / plan |",
             "|---|---|---|---|---|---|"]
    for s, rs in runs.items():
        meds = [x["median_s"] for x in rs]
        med = statistics.median(meds)
        vs = f"{pp_med / med:.2f}x" if pp_med else "-"
        chosen = " / ".join(filter(None, [rs[0]["layout"], rs[0]["plan"]]))
        lines.append(f"| {s} | `{' '.join(table[s])}` | {med:.2f} [{min(meds):.2f}-{max(meds):.2f}] | {vs} | "
                     f"{rs[0]['wan_bytes'] / 1e6:.2f} MB | {chosen} |")
    report = "\n".join(lines)
    print("\n" + report)
    (out / "results.md").write_text(report + "\n")
    (out / "results.json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
