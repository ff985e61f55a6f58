"""Time to the same loss on real text (issue 26, item 4): every system trains the same GPT-MoE on the
prepared corpus through pretrain_moe.py on the testbed (one process per rank, the WAN shaped), and
the report gives wall-clock time and steps to a target loss, the loss at equal steps, and
loss-vs-wall-clock curves.

    sudo python benchmarks/time_to_loss.py --rate 50 --iters 120 --out docs/results/time_to_loss/50mbit

Systems (each with --overlap-grad-reduce, as a Megatron user runs it):
- ep: alltoall EP over every rank;              - replicated: Megatron EP inside each DC;
- hybridep: the planner's exact plan;           - hybridep-c: weights at --ratio and returned gradients
- pp: one pipeline stage per DC, EP inside it;    at --grad-ratio (shared + top-k, top-k + error feedback);
- auto: --hybridep-layout auto;                 - auto-c: the same with hybridep-c's ratios (the planner
                                                  compresses only where it pays).
The target is the loss the --reference system (default: alltoall EP) reaches at --target-at of its
run (default: its last iteration); every curve is a moving mean over
--window logged iterations (one iteration's loss on one batch is noisy). Every system starts from
the same model (--hybridep-layout-independent-init: weights drawn from the seed and their global
layer and expert index, not Megatron's per-stage and per-EP-rank RNG) and sees the same global
batches, so exact HybridEP reproduces EP and the layouts differ only by summation order and the
per-micro-batch load-balancing loss. Wall clock = the sum of the logged step times (start-up and
the first --warmup iterations' extra time excluded). Systems alternate in a repeat, the order
reversed every other repeat.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from layout_vs_pp import MODEL, testbed_flags, write_topology  # noqa: E402 - the same model and topology as issue 25's

from megatron_hybridep.plan.workload import GRAD_VALUE_BYTES, QUALITY_GRAD_RATIO, QUALITY_WEIGHT_RATIO  # noqa: E402

LINE = re.compile(r" iter +(\d+)/\d+ \| loss +([\d.]+|nan) \| step +([\d.]+) ms")


def systems(dcs: int, world: int, ratio: float = QUALITY_WEIGHT_RATIO,
            grad_ratio: float = QUALITY_GRAD_RATIO, grad_values: str = "bf16",
            early: float | None = None) -> dict[str, list[str]]:
    pp = ["--pipeline-model-parallel-size", str(dcs), "--expert-model-parallel-size", str(world // dcs)]
    comp = ["--hybridep-compression-ratio", f"{ratio:g}", "--hybridep-grad-compression-ratio", f"{grad_ratio:g}",
            "--hybridep-max-compression-ratio", "0",  # what is asked for, past the quality caps too
            "--hybridep-max-grad-compression-ratio", "0", "--hybridep-grad-compression-values", grad_values]
    if early is not None:  # None: pretrain_moe.py's default (auto)
        comp += ["--hybridep-early-grad-return", f"{early:g}"]
    return {"ep": ["--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", str(world)],
            "replicated": ["--hybridep-plan", "replicated", "--expert-model-parallel-size", str(world)],
            "hybridep": ["--expert-model-parallel-size", str(world)],
            "hybridep-c": ["--expert-model-parallel-size", str(world), *comp],
            "pp": ["--moe-token-dispatcher-type", "alltoall", *pp],
            "auto": ["--hybridep-layout", "auto"], "auto-c": ["--hybridep-layout", "auto", *comp]}


def parse_log(text: str) -> list[tuple[int, float, float]]:
    """(iteration, loss, step seconds) of every logged iteration (--log-interval 1)."""
    return [(int(i), float(loss), float(ms) / 1e3) for i, loss, ms in LINE.findall(text)]


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving mean (the first window - 1 points average what there is)."""
    return [statistics.fmean(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]


def to_target(rows: list[tuple[int, float, float]], target: float, window: int, warmup: int) -> dict:
    """Steps and wall-clock seconds until the smoothed loss first reaches ``target`` (None: never)."""
    losses = smooth([loss for _, loss, _ in rows], window)
    steps = [s for _, _, s in rows]
    typical = statistics.median(steps[warmup:]) if len(steps) > warmup else statistics.median(steps)
    clock, elapsed = [], 0.0
    for i, s in enumerate(steps):  # the warm-up's extra time (allocation, first gathers) is not training
        elapsed += min(s, typical) if i < warmup else s
        clock.append(elapsed)
    hit = next((i for i, loss in enumerate(losses) if loss <= target), None)
    return {"steps": rows[hit][0] if hit is not None else None, "seconds": clock[hit] if hit is not None else None,
            "final": losses[-1], "clock": clock, "smoothed": losses, "median_step_s": typical}


def chosen(text: str) -> str:
    """What the job ran, from its log: the layout planner's layout and the plan (or "")."""
    lay = re.search(r"\[layout\] running (TP\d+ PP\d+ EP\d+ DP\d+)", text)
    plan = re.search(r"\[pretrain_moe\] plan: ([^;]+);", text)  # labels have 1-3 words
    return " / ".join(m.group(1) for m in (lay, plan) if m)


def run_one(tb, flags: list[str], args: argparse.Namespace, topology: Path,  # noqa: ANN001
            log: Path) -> list[tuple[int, float, float]]:
    """One training run; its logging rank's output is kept in ``log`` (phases, WAN bytes, the plan)."""
    from megatron_hybridep.testbed.launcher import python_cmd
    from megatron_hybridep.train.rank_imports import PRELOAD

    cmd = python_cmd(REPO / "pretrain_moe.py", *MODEL, *shlex.split(args.model_flags),
                     "--global-batch-size", str(args.global_batch), "--train-iters", str(args.iters),
                     "--lr-warmup-iters", str(max(1, args.iters // 20)), "--log-interval", "1",
                     "--seed", str(args.seed), "--hybridep-layout-independent-init", "--data-path", args.data_path,
                     "--split", "100,0,0", "--hybridep-topology", topology, *flags)
    result = tb.launch(cmd, timeout_s=args.timeout, cwd=REPO, preload=PRELOAD)
    text = next((o for o in result.outputs if LINE.search(o)), result.outputs[0])
    log.write_text(text)
    if not result.ok:
        raise RuntimeError(f"run failed: {' '.join(map(str, cmd))}\n{result.outputs[0][-3000:]}")
    rows = parse_log(text)
    print(f"  ran: {chosen(result.outputs[0]) or 'alltoall'}", flush=True)
    if len(rows) != args.iters:
        raise RuntimeError(f"expected {args.iters} logged iterations, parsed {len(rows)}:\n{text[-2000:]}")
    return rows


def report(runs: dict[str, list[list[tuple[int, float, float]]]], args: argparse.Namespace) -> tuple[str, dict]:
    """The table (medians over repeats) and its numbers. Target: the reference system's smoothed loss
    at --target-at of its run (1: its last step); loss at equal steps: at the last step."""
    ref = args.reference
    at = max(1, round(args.target_at * args.iters)) - 1
    target = statistics.median(smooth([x[1] for x in r], args.window)[at] for r in runs[ref])
    ref_final = statistics.median(smooth([x[1] for x in r], args.window)[-1] for r in runs[ref])
    out: dict[str, dict] = {}
    for name, reps in runs.items():
        hits = [to_target(r, target, args.window, args.warmup) for r in reps]
        secs = [h["seconds"] for h in hits if h["seconds"] is not None]
        steps = [h["steps"] for h in hits if h["steps"] is not None]
        finals = [h["final"] for h in hits]
        out[name] = {"reached": f"{len(secs)}/{len(hits)}", "seconds": statistics.median(secs) if secs else None,
                     "steps": statistics.median(steps) if steps else None, "final": statistics.median(finals),
                     "final_vs_ref_pct": (statistics.median(finals) / ref_final - 1) * 100,
                     "step_s": statistics.median(h["median_step_s"] for h in hits), "runs": hits}
    ref_s = out[ref]["seconds"]
    lines = [f"{args.dcs} DCs x {args.ranks_per_dc} ranks at {args.rate:g} Mbit/s per DC uplink, {args.iters} "
             f"iterations, global batch {args.global_batch}, corpus {args.data_path}, seed {args.seed}, "
             f"{args.repeats} repeat(s); target = {ref}'s loss at iteration {at + 1} ({target:.4f}, mean of the "
             f"last {args.window})", "",
             f"| system | median step s | steps to target | wall-clock s to target | vs {ref} | loss at equal steps "
             f"({args.iters}) | vs {ref} |", "|---|---|---|---|---|---|---|"]
    for name, o in out.items():
        t = o["seconds"]
        speed = f"{ref_s / t:.2f}x" if t and ref_s else "-"
        lines.append(f"| {name} | {o['step_s']:.2f} | {o['steps'] if o['steps'] is not None else 'not reached'} "
                     f"| {f'{t:.1f}' if t is not None else '-'} | {speed} | {o['final']:.4f} | "
                     f"{o['final_vs_ref_pct']:+.2f}% |")
    return "\n".join(lines), {"target": target, "reference": ref, "systems": out}


# what a recorded run must share with this one for its curves to join the table (the corpus, model,
# batches and steps: the losses; the link: the step times)
SAME_RUN = ("dcs", "ranks_per_dc", "rate", "intra_gbps", "global_batch", "queue_ms", "burst_ms", "congestion",
            "iters", "warmup", "seed", "model_flags", "data_path")


def recorded_runs(paths: list[str], args: argparse.Namespace, running: set[str]) -> dict[str, list]:
    """Runs of earlier results.json files (systems not trained here; one trained here too joins as
    "NAME (recorded)"), refused naming the field where the runs are not comparable."""
    out: dict[str, list] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        for key in SAME_RUN:
            mine, theirs = getattr(args, key), data["args"].get(key)
            if mine != theirs:
                raise SystemExit(f"--recorded {path}: {key} was {theirs!r}, this run has {mine!r}; fix: run with "
                                 f"the recorded run's settings (its results.md ends with its command)")
        for name, reps in data["runs"].items():
            label = f"{name} (recorded)" if name in running else name
            out.setdefault(label, []).extend([[tuple(x) for x in r] for r in reps])
    return out


def plot(numbers: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, o in numbers["systems"].items():
        run = o["runs"][0]
        ax.plot(run["clock"], run["smoothed"], label=name)
    ax.axhline(numbers["target"], color="grey", ls=":", label=f"target ({numbers['reference']})")
    ax.set(xlabel="wall-clock training time (s)", ylabel="loss (moving mean)", title=title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    testbed_flags(p, rate=50.0)
    p.add_argument("--iters", type=int, default=120)
    p.add_argument("--warmup", type=int, default=2, help="iterations whose extra time is not counted")
    p.add_argument("--window", type=int, default=10, help="logged iterations in the loss's moving mean")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ratio", type=float, default=QUALITY_WEIGHT_RATIO,
                   help="hybridep-c's weight compression ratio (default: the runtime's quality cap; docs/results.md's "
                        "runs from before that cap used 50)")
    p.add_argument("--grad-ratio", type=float, default=QUALITY_GRAD_RATIO,
                   help="hybridep-c's returned-gradient compression ratio (default: the runtime's quality cap; "
                        "docs/results.md's runs from before it was 4 used 10)")
    p.add_argument("--grad-values", choices=tuple(GRAD_VALUE_BYTES), default="bf16",
                   help="hybridep-c's returned gradients' kept values: bf16 (the runtime's default) or the "
                        "gradient's fp32 (docs/results.md's runs from before 2026-11-26's change)")
    p.add_argument("--early-grad-return", type=float, default=None, metavar="R",
                   help="hybridep-c's and auto-c's --hybridep-early-grad-return R (0 = off; default: "
                        "pretrain_moe.py's auto, 16 where it applies; the runs recorded before 2026-11-29 "
                        "night had it off)")
    p.add_argument("--recorded", action="append", default=[], metavar="RESULTS_JSON",
                   help="add the runs of an earlier results.json made with the same corpus, model, batch, "
                        "iterations, seed and link (a system also trained here joins as 'NAME (recorded)')")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--reference", default="ep", help="the system whose loss is the target (e.g. pp: the best "
                                                      "Megatron layout where the WAN binds)")
    p.add_argument("--target-at", type=float, default=1.0,
                   help="the target is the reference's loss at this fraction of its run (below 1: systems that "
                        "converge more slowly per step have iterations left to reach it)")
    p.add_argument("--systems", default="ep,replicated,hybridep,hybridep-c,pp,auto")
    p.add_argument("--data-path", default=None, help="indexed-dataset prefix (default: scripts/prepare_corpus's)")
    p.add_argument("--model-flags", default="", help="pretrain_moe flags after the model's own, which they override "
                                                     "(e.g. '--hidden-size 32 --micro-batch-size 8')")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=None, help="folder for results.md, results.json, loss_vs_time.png and each "
                   "run's log (SYSTEM_repeatR.log: the plan, phases and WAN bytes per iteration)")
    args = p.parse_args(argv)
    if args.data_path is None:
        from megatron_hybridep.data import austen
        from megatron_hybridep.data.prepare import default_prefix, prepare_corpus

        prepare_corpus()  # idempotent: "up to date" when already prepared
        args.data_path = default_prefix(None, austen.default_cache())
    world = args.dcs * args.ranks_per_dc
    known = systems(args.dcs, world, args.ratio, args.grad_ratio, args.grad_values, args.early_grad_return)
    unknown = [k for k in args.systems.split(",") if k not in known]
    if unknown:
        p.error(f"--systems: unknown {', '.join(unknown)}; fix: choose from {', '.join(known)}")
    table = {k: known[k] for k in args.systems.split(",")}  # run in the order given
    recorded = recorded_runs(args.recorded, args, set(table))
    if args.reference not in table and args.reference not in recorded:
        p.error(f"--systems: the target is {args.reference}'s loss; fix: keep {args.reference} in the list or "
                "change --reference")
    if not 0 < args.target_at <= 1:
        p.error(f"--target-at: a fraction of the run in (0, 1], got {args.target_at:g}")
    out = Path(args.out) if args.out else Path.cwd()
    out.mkdir(parents=True, exist_ok=True)
    topology = write_topology(out / "topology.yaml", args.dcs, args.ranks_per_dc, args.rate, args.intra_gbps)
    print("# " + shlex.join([sys.executable, *sys.argv]), flush=True)
    from megatron_hybridep.testbed import Testbed, TestbedConfig

    runs: dict[str, list] = {s: [] for s in table}
    with Testbed(TestbedConfig(dcs=args.dcs, ranks_per_dc=args.ranks_per_dc, rate_mbit=args.rate,
                               queue_ms=args.queue_ms, burst_ms=args.burst_ms, congestion=args.congestion)) as tb:
        print("# " + tb.describe(), flush=True)
        for r in range(args.repeats):
            for s in (list(table) if r % 2 == 0 else list(table)[::-1]):
                runs[s].append(run_one(tb, table[s], args, topology, out / f"{s}_repeat{r}.log"))
                last = runs[s][-1]
                print(f"repeat {r} {s:11s} final loss {last[-1][1]:.4f}, median step "
                      f"{statistics.median(x[2] for x in last):.2f} s", flush=True)
    runs.update(recorded)
    text, numbers = report(runs, args)
    print("\n" + text)
    (out / "results.md").write_text(text + "\n\ncommand: " + shlex.join(sys.argv) + "\n")
    (out / "results.json").write_text(json.dumps({"args": vars(args), "runs": runs, "target": numbers["target"]},
                                                 indent=1))
    plot(numbers, out / "loss_vs_time.png", f"{args.dcs} DCs x {args.ranks_per_dc} at {args.rate:g} Mbit/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
