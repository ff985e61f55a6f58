#!/usr/bin/env python
"""The plan scheduler on the emulated multi-DC testbed (root): the WAN rate drops mid-run.

    sudo python benchmarks/replan_demo.py                    # defaults below, ~4 min on 2 quiet cores
    sudo python benchmarks/replan_demo.py --smoke            # a few iterations, adaptive + stable only

2 DCs x 2 ranks train pretrain_moe.py's GPT-MoE (its CPU loop, Megatron's pieces, the real
scheduler wiring of --hybridep-replan-interval) on the testbed. The WAN starts at --rate-high and
drops to --rate-low after iteration --change-at: rank 0 asks the controller over a control socket
(bench/control) at the end of that iteration and waits for its answer, which comes once
`Testbed.set_rate` has changed both uplinks, so the change lands exactly between two iterations (no
sleeps). Runs, each a fresh launch with the same seed and data:
  adaptive  --hybridep-plan auto (the planner's plan for the high rate) + --hybridep-replan-interval
  fixed_a   the planner's plan for the high rate, never re-planned
  fixed_b   the planner's plan for the low rate, never re-planned
  stable    like adaptive, but the rate never changes (the controller answers without a change)
Every run pauses at --change-at for the controller; that pause is not counted in its time. Each run's
time is rank 0's wall time of the training loop (sum of step times and the per-iteration log), the
pause excluded. The report: the switch iteration(s), total time per run (median over --repeats), step
time medians before and after the change, the command; CSV + PNG under --out.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RUNS = ("adaptive", "fixed_a", "fixed_b", "stable")
PRESET = REPO / "configs" / "presets" / "cpu_demo.yaml"


@dataclass
class DemoConfig:
    iters: int = 60
    change_at: int = 30
    rate_high: float = 200.0  # Mbit/s per DC uplink
    rate_low: float = 20.0
    micro_batch: int = 16
    seq: int = 128
    interval: int = 1
    # Each DC's fabric (lo, shared by its 2 ranks), scaled down like the WAN: unshaped, lo runs at
    # ~30 Gbit/s, where no plan's intra-DC token traffic costs anything measurable and the plan that
    # avoids it (A) cannot win at any WAN rate.
    fabric: float = 400.0  # Mbit/s; 0 = unshaped
    # What the planner is told intra-DC token all-to-alls get per rank; default: the fabric shared by the
    # DC's 2 ranks (lo's 64 KB packets: goodput ~= rate; unshaped: 1000, what gloo between 2 of 4 ranks on
    # 2 cores reaches).
    # The scheduler re-measures it whenever a plan has intra-DC-only token traffic.
    intra_mbit: float = 0.0
    repeats: int = 1
    runs: list[str] = field(default_factory=lambda: list(RUNS))
    plan_a: str | None = None  # plan labels; default: the planner's choice at each rate
    plan_b: str | None = None
    fixed_measure: bool = False  # fixed runs measure too (scheduler on, one plan: it cannot switch)
    pin: bool = True  # pin rank r to core r % cores (gloo's threads follow): launches agree within ~2%, not ~30%
    burst_ms: float = 1.0  # HTB bucket at the rate: small collectives must not pass unshaped on its credit
    timeout: float = 600.0
    out: str = "docs/results"
    name: str = "replan_demo"

    def command(self) -> str:
        d, parts = DemoConfig(), []
        for k, v in asdict(self).items():
            if v == getattr(d, k):
                continue
            flag = f"--{k.replace('_', '-')}"
            if isinstance(v, bool):
                parts.append(flag if v else f"--no-{flag[2:]}")
            else:
                parts.append(f"{flag} {shlex.quote(','.join(v) if isinstance(v, list) else str(v))}")
        return " ".join(["python benchmarks/replan_demo.py", *parts])


# ---- the job's flags ---------------------------------------------------------------------------------
def train_argv(cfg: DemoConfig) -> list[str]:
    """pretrain_moe.py flags of every run: the CPU demo model at this batch shape (4 ranks, EP 4)."""
    return ["--config", str(PRESET), "--train-iters", str(cfg.iters), "--micro-batch-size", str(cfg.micro_batch),
            "--global-batch-size", str(cfg.micro_batch * 4), "--seq-length", str(cfg.seq),
            "--max-position-embeddings", str(cfg.seq), "--lr-warmup-iters", str(max(1, min(20, cfg.iters // 3))),
            "--log-interval", str(max(1, cfg.iters // 4))]


def testbed_topology(cfg: DemoConfig, mbit: float) -> Any:
    """What the planner is told about the testbed at `mbit` (TCP goodput of the shaped rate)."""
    from megatron_hybridep.bench.predict import testbed_topology as topo
    from megatron_hybridep.testbed.selfcheck import TCP_GOODPUT_FRACTION

    intra = cfg.intra_mbit or (cfg.fabric / 2 if cfg.fabric else 1000.0)
    return topo(2, 2, mbit * TCP_GOODPUT_FRACTION, intra)


def planned(cfg: DemoConfig, mbit: float) -> Any:
    """The planner's HybridEP plan for the job's workload on the testbed at `mbit`."""
    from megatron_hybridep.megatron.arguments import parse
    from megatron_hybridep.plan.planner import choose_plan
    from megatron_hybridep.train.planning import workload_for

    result = choose_plan(testbed_topology(cfg, mbit), workload_for(parse(train_argv(cfg))), 4)
    return next(c.plan for c in result.candidates if c.plan.kind == "domains")


def plan_named(cfg: DemoConfig, label: str) -> Any:
    from megatron_hybridep.plan.planner import enumerate_plans

    args_plans = enumerate_plans(testbed_topology(cfg, cfg.rate_high).ep_layout(4), 8, include_replicated=False)
    for p in args_plans:
        if label in (p.label, p.label.removeprefix("domains "), p.label.split(" (")[0]):
            return p
    raise SystemExit(f"replan_demo: no plan {label!r}; fix: one of {[p.label for p in args_plans]}")


# ---- one rank (inside a DC namespace) ------------------------------------------------------------------
def worker(spec_path: str) -> int:
    import torch
    import torch.distributed as dist

    from megatron_hybridep.bench.control import CONTROL_ENV, ControlClient
    from megatron_hybridep.megatron.arguments import parse
    from megatron_hybridep.runtime.context import process_context
    from megatron_hybridep.train import cpu_loop

    spec = json.loads(Path(spec_path).read_text())
    if spec.get("pin"):  # one core per rank pair, fixed: the OS otherwise places 4 ranks on 2 cores anew per launch
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(os.environ["RANK"]) % len(cores)]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    client = ControlClient(os.environ[CONTROL_ENV]) if rank == 0 else None
    rows: list[dict[str, Any]] = []
    pause = [0.0]

    def on_iteration(iteration: int, seconds: float, decision: Any) -> None:
        now = time.perf_counter()
        rt = process_context().runtime
        row = {"iteration": iteration, "step_s": seconds, "t": now, "plan": rt.plan.label if rt else "",
               "switched": bool(decision is not None and decision.switched)}
        if decision is not None:
            r = decision.replan
            row.update(predicted_current_s=r.current_seconds, predicted_best_s=r.best_seconds, best=r.plan.label,
                       compute_s=decision.compute_s, network_factor=decision.network_factor,
                       **{f"bw_{k}_gbps": v for k, v in decision.bandwidth_gbps.items()})
        rows.append(row)
        if client is not None and iteration == spec["change_at"]:
            client.request({"op": "change", "iteration": iteration})  # returns once the rate has changed
            pause[0] = time.perf_counter() - now

    try:
        t0 = time.perf_counter()
        cpu_loop.run(parse(spec["argv"]), on_iteration=on_iteration)
        if client is not None:
            start = rows[0]["t"] - rows[0]["step_s"]
            Path(spec["result"]).write_text(json.dumps({
                "rows": rows, "pause_s": pause[0], "loop_s": rows[-1]["t"] - start - pause[0],
                "startup_s": start - t0}))
            client.bye()
    finally:
        dist.destroy_process_group()
    return 0


# ---- the controller (root) -----------------------------------------------------------------------------
def set_rate(tb: Any, mbit: float) -> None:
    for dc in range(tb.dcs):  # the testbed keeps its HTB burst (TestbedConfig.burst_ms) across changes
        tb.set_rate(dc, mbit)


def run_once(tb: Any, cfg: DemoConfig, kind: str, plans: dict[str, Any], tmp: str, log_dir: Path) -> dict[str, Any]:
    """One launch of the 4 ranks; returns rank 0's result."""
    from megatron_hybridep.bench.control import launch_controlled
    from megatron_hybridep.train.rank_imports import PRELOAD

    argv = train_argv(cfg)
    import yaml

    topo_path = os.path.join(tmp, "topology.yaml")  # every run: what the scheduler calibrates against
    Path(topo_path).write_text(yaml.safe_dump(testbed_topology(cfg, cfg.rate_high).to_dict()))
    argv += ["--hybridep-topology", topo_path]
    if kind in ("adaptive", "stable"):
        argv += ["--hybridep-plan", "auto", "--hybridep-replan-interval", str(cfg.interval)]
    else:
        plan_path = os.path.join(tmp, f"{kind}.json")
        plans["a" if kind == "fixed_a" else "b"].save(plan_path)
        argv += ["--hybridep-plan", plan_path]
        if cfg.fixed_measure:
            argv += ["--hybridep-replan-interval", str(cfg.interval)]
    result = os.path.join(tmp, f"{kind}.result.json")
    spec = os.path.join(tmp, f"{kind}.spec.json")
    Path(spec).write_text(json.dumps({"argv": argv, "change_at": cfg.change_at, "result": result, "pin": cfg.pin}))
    set_rate(tb, cfg.rate_high)
    changed: dict[str, float] = {}

    def handle(request: dict[str, Any]) -> dict[str, Any]:
        if request.get("op") != "change":
            raise RuntimeError(f"replan_demo: unexpected control request {request!r}")
        if kind != "stable":
            set_rate(tb, cfg.rate_low)
        changed["iteration"] = request["iteration"]
        return {"ok": True}

    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    launch = launch_controlled(tb, [sys.executable, str(Path(__file__).resolve()), "--worker", spec], handle,
                               os.path.join(tmp, "control.sock"), time.monotonic() + cfg.timeout, env=env,
                               timeout_s=cfg.timeout, log_dir=log_dir, cwd=REPO, preload=PRELOAD)
    launch.raise_for_status()
    out = json.loads(Path(result).read_text())
    out["changed_at"] = changed.get("iteration")
    return out


def _settled(rows: list[dict[str, Any]], first: int, last: int) -> tuple[float, float]:
    """(measured, predicted) median step over the second half of iterations first..last: the
    scheduler's windows hold only that segment's samples there. NaN where nothing was predicted."""
    sel = [r for r in rows if (first + last) // 2 < r["iteration"] <= last]
    pred = [r["predicted_current_s"] for r in sel if r.get("predicted_current_s")]
    nan = float("nan")
    return (statistics.median(r["step_s"] for r in sel) if sel else nan, statistics.median(pred) if pred else nan)


def summarise(kind: str, repeat: int, res: dict[str, Any], cfg: DemoConfig) -> dict[str, Any]:
    rows = res["rows"]
    before = [r["step_s"] for r in rows if r["iteration"] <= cfg.change_at]
    after = [r["step_s"] for r in rows if r["iteration"] > cfg.change_at]
    switches = [(r["iteration"], r["plan"]) for r in rows if r["switched"]]
    # the scheduler's prediction of the running plan's step, and of the plan it switched to
    (mb, pb), (ma, pa) = _settled(rows, 1, cfg.change_at), _settled(rows, cfg.change_at + 1, cfg.iters)
    chosen = [r["predicted_best_s"] for r in rows if r["switched"] and r.get("predicted_best_s")]
    return {"run": kind, "repeat": repeat, "total_s": res["loop_s"], "startup_s": res["startup_s"],
            "median_before_s": statistics.median(before) if before else float("nan"),
            "median_after_s": statistics.median(after) if after else float("nan"),
            "first_plan": rows[0]["plan"], "last_plan": rows[-1]["plan"], "switches": switches,
            "changed_at": res["changed_at"], "settled_before_s": mb, "predicted_before_s": pb,
            "settled_after_s": ma, "predicted_after_s": pa,
            "predicted_switch_to_s": chosen[-1] if chosen else float("nan")}


def write_outputs(cfg: DemoConfig, results: list[tuple[str, int, dict[str, Any]]],
                  out: Path) -> tuple[Path, Path | None]:
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / f"{cfg.name}.csv"
    keys = ["run", "repeat", "iteration", "step_s", "plan", "switched", "best", "predicted_current_s",
            "predicted_best_s", "compute_s", "network_factor", "bw_dc_gbps", "bw_gpu_gbps"]
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for kind, repeat, res in results:
            for r in res["rows"]:
                w.writerow({"run": kind, "repeat": repeat, **{k: r.get(k, "") for k in keys[2:]}})
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return csv_path, None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for kind, repeat, res in results:
        if repeat:
            continue
        rows = res["rows"]
        ax.plot([r["iteration"] for r in rows], [r["step_s"] * 1e3 for r in rows], label=kind, lw=1.2)
        for r in rows:
            if r["switched"]:
                ax.annotate(f"switch -> {r['plan'].removeprefix('domains ')}", (r["iteration"], r["step_s"] * 1e3),
                            fontsize=7, rotation=30)
    ax.axvline(cfg.change_at + 0.5, color="grey", ls="--", lw=1)
    ax.text(cfg.change_at + 0.7, ax.get_ylim()[0] * 1.05, f"WAN {cfg.rate_high:g} -> {cfg.rate_low:g} Mbit/s",
            fontsize=8, va="bottom")
    ax.set_xlabel("iteration")
    ax.set_ylabel("step time (ms, rank 0)")
    ax.set_yscale("log")
    ax.set_title("plan scheduler on the testbed: 2 DCs x 2 ranks, WAN rate drops mid-run")
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = out / f"{cfg.name}.png"
    fig.savefig(png, dpi=120)
    return csv_path, png


def report(cfg: DemoConfig, plans: dict[str, Any], summaries: list[dict[str, Any]]) -> str:
    lines = [f"command: {cfg.command()}",
             f"WAN {cfg.rate_high:g} -> {cfg.rate_low:g} Mbit/s per DC uplink after iteration {cfg.change_at} "
             f"of {cfg.iters}; plan A (high rate) {plans['a'].label}, plan B (low rate) {plans['b'].label}",
             f"{'run':<9} {'total s (median)':>17} {'all repeats':>22} {'before ms':>10} {'after ms':>9}  switches",
             ]
    for kind in cfg.runs:
        mine = [s for s in summaries if s["run"] == kind]
        if not mine:
            continue
        totals = [s["total_s"] for s in mine]
        sw = "; ".join(",".join(f"{i}->{p.removeprefix('domains ')}" for i, p in s["switches"]) or "none"
                       for s in mine)
        lines.append(f"{kind:<9} {statistics.median(totals):17.2f} {' '.join(f'{t:.2f}' for t in totals):>22} "
                     f"{statistics.median(s['median_before_s'] for s in mine) * 1e3:10.1f} "
                     f"{statistics.median(s['median_after_s'] for s in mine) * 1e3:9.1f}  {sw}")
    lines.append("the scheduler's prediction (median over each segment's second half; switch: its prediction of "
                 "the plan it switched to, against that plan's settled step)")
    lines.append(f"{'run':<9} {'before: measured / predicted ms':>32} {'after: measured / predicted ms':>32}  "
                 "switch: predicted")
    for s in summaries:
        def cell(m: float, p: float) -> str:
            return "n/a" if p != p else f"{m * 1e3:.0f} / {p * 1e3:.0f} ({p / m - 1:+.1%})"
        sw = s.get("predicted_switch_to_s", float("nan"))
        lines.append(f"{s['run']:<9} {cell(s['settled_before_s'], s['predicted_before_s']):>32} "
                     f"{cell(s['settled_after_s'], s['predicted_after_s']):>32}  "
                     f"{cell(s['settled_after_s'], sw) if sw == sw else 'no switch'}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> tuple[DemoConfig, str | None]:
    """(config, the worker's spec path when this process is a rank, else None)."""
    d = DemoConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    for k, v in asdict(d).items():
        if k == "runs":
            p.add_argument("--runs", default=",".join(v), help=f"comma list of {','.join(RUNS)}")
        elif isinstance(v, bool):
            p.add_argument(f"--{k.replace('_', '-')}", action=argparse.BooleanOptionalAction, default=v)
        else:
            p.add_argument(f"--{k.replace('_', '-')}", type=type(v) if v is not None else str, default=v)
    p.add_argument("--smoke", action="store_true", help="10 iterations, change after 5, adaptive + stable")
    a = p.parse_args(argv)
    if a.worker:
        return d, a.worker
    kw = {k: getattr(a, k) for k in asdict(d)}
    kw["runs"] = [r for r in a.runs.split(",") if r]
    if bad := [r for r in kw["runs"] if r not in RUNS]:
        p.error(f"--runs: unknown {bad}; fix: a comma list of {','.join(RUNS)}")
    if a.smoke:
        kw.update(iters=10, change_at=5, runs=["adaptive", "stable"], name="replan_demo_smoke")
    cfg = DemoConfig(**kw)
    if not 0 < cfg.change_at < cfg.iters:
        p.error(f"--change-at {cfg.change_at}: must be inside 1..{cfg.iters - 1}")
    return cfg, None


def main(argv: list[str] | None = None) -> int:
    cfg, spec = parse_args(argv)
    if spec is not None:
        return worker(spec)
    from megatron_hybridep.testbed.network import Testbed, TestbedConfig

    plans = {"a": plan_named(cfg, cfg.plan_a) if cfg.plan_a else planned(cfg, cfg.rate_high),
             "b": plan_named(cfg, cfg.plan_b) if cfg.plan_b else planned(cfg, cfg.rate_low)}
    if plans["a"] == plans["b"] and {"fixed_a", "fixed_b"} & set(cfg.runs):
        print(f"replan_demo: the planner picks {plans['a'].label} at both rates: nothing to switch between; "
              "fix: other --rate-high/--rate-low/--micro-batch/--seq, or --plan-a/--plan-b", file=sys.stderr)
        return 2
    out = (REPO / cfg.out) if not os.path.isabs(cfg.out) else Path(cfg.out)
    print(f"command: {cfg.command()}\nplans: A {plans['a'].label}, B {plans['b'].label}", flush=True)
    results, summaries = [], []
    with tempfile.TemporaryDirectory(prefix="replan-demo-") as tmp, \
            Testbed(TestbedConfig(dcs=2, ranks_per_dc=2, rate_mbit=cfg.rate_high,
                                  burst_ms=cfg.burst_ms or None, fabric_mbit=cfg.fabric or None)) as tb:
        for repeat in range(cfg.repeats):
            for kind in cfg.runs:
                res = run_once(tb, cfg, kind, plans, tmp, Path(tmp) / "logs" / f"{kind}{repeat}")
                results.append((kind, repeat, res))
                s = summarise(kind, repeat, res, cfg)
                summaries.append(s)
                print(f"  {kind:<9} repeat {repeat}: {s['total_s']:.2f} s, median step {s['median_before_s'] * 1e3:.1f}"
                      f" / {s['median_after_s'] * 1e3:.1f} ms before/after, plan {s['first_plan']} -> "
                      f"{s['last_plan']}, switches {s['switches'] or 'none'}", flush=True)
    csv_path, png = write_outputs(cfg, results, out)
    text = report(cfg, plans, summaries)
    print(text)
    (out / f"{cfg.name}.txt").write_text(text + "\n")
    labels = {k: p.label for k, p in plans.items()}
    (out / f"{cfg.name}.json").write_text(json.dumps({"config": asdict(cfg), "plans": labels, "summaries": summaries},
                                                     indent=1))
    print(f"wrote {csv_path}" + (f", {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
