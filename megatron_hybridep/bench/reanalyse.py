"""`hybridep bench --reanalyse DIR`: a finished run's analysis again, from what it recorded
(summary.json and rank 0's ``BENCH`` lines in logs/point*/[run*/]rank0.log), with today's cost model and
report: the prediction can be improved and checked against real runs without the testbed. The
measured rows are the run's; bench.csv, bench.png, summary.json and report.txt are rewritten."""

from __future__ import annotations

import argparse
import io
import json
import shlex
from pathlib import Path
from typing import Any

from megatron_hybridep.bench import predict as bp
from megatron_hybridep.bench.analysis import analyse
from megatron_hybridep.bench.config import BenchError, add_arguments, resolve
from megatron_hybridep.bench.session import Session
from megatron_hybridep.plan.layout import Layout
from megatron_hybridep.plan.plan import Plan


def recorded_events(out: Path) -> list[dict[str, Any]]:
    """Rank 0's events (what the parent saw over the control channel), per-iteration lines left out."""
    events = []
    # logs/point<i>/rank0.log: a launch per point (runs before 2026-12-02 22:00); else logs/point<i>/run<k>/
    for log in sorted([*out.glob("logs/point*/rank0.log"), *out.glob("logs/point*/run*/rank0.log")]):
        for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
            if "BENCH " in line:
                e = json.loads(line.split("BENCH ", 1)[1])
                if e["event"] != "iter":
                    events.append(e)
    if not any(e["event"] == "point" for e in events):
        raise BenchError(f"--reanalyse: no BENCH point events under {out}/logs/point*/rank0.log; fix: pass the "
                         "--out directory of a finished `hybridep bench` run")
    return events


def recorded_session(out: Path) -> tuple[dict[str, Any], Session]:
    """(summary.json, a Session holding the run's config, events and probe) of a finished run in ``out``."""
    try:
        summary = json.loads((out / "summary.json").read_text())
    except FileNotFoundError:
        raise BenchError(f"--reanalyse: {out}/summary.json not found; fix: pass the --out directory of a finished "
                         "`hybridep bench` run") from None
    argv = shlex.split(summary["command"])
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv[argv.index("bench") + 1:])
    args.out, args.quiet = str(out), True
    cfg = resolve(args)
    cfg.overlap_grad_reduce = bool(summary.get("overlap_grad_reduce", False))  # runs before the flag had none
    # runs before --grad-compression-ratio returned gradients at the weights' ratio
    cfg.grad_compression_ratio = float(summary.get("grad_compression_ratio", cfg.compression_ratio))
    cfg.congestion = summary.get("congestion", "host")  # runs before 2026-11-27 had the host's TCP (BBR here)
    cfg.grad_values = summary.get("grad_values", "same")  # runs before bf16 values sent the gradient's fp32
    cfg.early_grad_return = float(summary.get("early_grad_return", 0.0))  # runs before its flag: one return
    cfg.cores = int(summary.get("cpu_cores", 2))  # runs before 2026-12-01: 2-core hosts (their machine line)
    session = Session(cfg, tb=None, log=io.StringIO())  # type: ignore[arg-type]  # nothing is shaped
    session.events = recorded_events(out)
    session.info.update(summary["probe"])
    return summary, session


def restored_session(out: Path) -> tuple[dict[str, Any], Session]:
    """recorded_session, with the plans and layouts the run chose restored as its Session held them."""
    summary, session = recorded_session(out)
    cfg = session.cfg
    session.info.update(chosen=dict(summary["hybridep_plans"]),
                        planner_best=dict(summary["planner_best_overall"]),
                        shaped_tx_bytes=summary["link_counters_check_mb"]["shaped_segments"] * cfg.dcs * 1e6)
    candidates = {p.label: p for p in bp.candidate_plans(session.topology(shaped=True), cfg.model.num_experts)}
    for key, label in summary["hybridep_plans"].items():  # the plans that ran
        point, system = key.split()
        if label not in candidates:
            raise BenchError(f"--reanalyse: plan {label!r} of {key} is not a candidate of this testbed")
        session.chosen[(int(point), system)] = candidates[label]
    for key, ran in summary.get("layouts", {}).items():  # pp's and auto's: the layouts that ran
        point, system = key.split()
        session.layouts[(int(point), system)] = Layout(**ran["layout"])
        session.chosen[(int(point), system)] = Plan.from_dict(ran["plan"])
    session.info["layouts"] = dict(summary.get("layouts", {}))
    session.info["finalists"] = dict(summary.get("finalists", {}))  # runs before 2026-11-27 had none
    session.info["same_as"] = {**{f"{p} auto": s for p, s in summary.get("auto_same_as", {}).items()},  # older runs
                               **summary.get("same_as", {})}
    return summary, session


def reanalyse(out: Path) -> dict[str, Any]:
    summary, session = restored_session(out)
    return analyse(session.cfg, session, session.events, float(summary["elapsed_s"]))
