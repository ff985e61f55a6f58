"""Analysis of a `hybridep bench` run: rows (measured, predicted, bytes), the all-to-all probe, the
target check, and the files (CSV, PNG, summary.json, report.txt) plus the printed report."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import statistics
from typing import Any

from megatron_hybridep.bench import predict as bp
from megatron_hybridep.bench import report as br
from megatron_hybridep.bench.config import SYSTEMS, BenchConfig
from megatron_hybridep.bench.predict import MEASURED
from megatron_hybridep.bench.probes import format_probe, probe_summary, steady_efficiency
from megatron_hybridep.bench.session import Session
from megatron_hybridep.plan.phases import Phase
from megatron_hybridep.testbed.selfcheck import TCP_GOODPUT_FRACTION


def pool_rounds(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point event per (phase, system, plan, point) where --rounds measured it several times: the
    rounds' iterations pooled (median of all of them), their per-phase times the median over rounds,
    link counters summed per DC over the pooled iterations, the load averaged; ``rounds`` says how
    many. Other events come first, as they were; a single round is left as it is."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for e in events:
        if e["event"] == "point":
            groups.setdefault((e["phase"], e["system"], e["plan"], e["point"]), []).append(e)
    return [e for e in events if e["event"] != "point"] + [_pooled(g) for g in groups.values()]


def _pooled(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    if len(rounds) == 1:
        return rounds[0]
    steps = [s for e in rounds for s in e["step_s"]]
    links = [{**c, **{k: sum(e["link"][i][k] for e in rounds) for k in c if k != "dc"}}
             for i, c in enumerate(rounds[0]["link"])]
    return {**rounds[0], "iters": len(steps), "step_s": steps, "median_s": statistics.median(steps),
            "warmup_s": statistics.fmean(e["warmup_s"] for e in rounds), "link": links, "rounds": len(rounds),
            "loadavg": [statistics.fmean(e["loadavg"][j] for e in rounds) for j in (0, 1)],
            "ranks": {k: statistics.median(e["ranks"][k] for e in rounds) for k in rounds[0]["ranks"]}}


def analyse(cfg: BenchConfig, session: Session, events: list[dict[str, Any]], elapsed_s: float) -> dict[str, Any]:
    events = pool_rounds(events)
    measured = [e for e in events if e["event"] == "point" and e["phase"] == "measure"]
    calib = {(e["system"], e["plan"], e["point"]): e for e in events
             if e["event"] == "point" and e["phase"] == "calibrate"}
    dense = next(e["dense_params"] for e in events if e["event"] == "model")
    shaped = session.topology(shaped=True)
    ep_median = {e["point"]: e["median_s"] for e in measured if e["system"] == "ep"}
    probes = probe_summary(cfg, events)
    steady = steady_efficiency(probes)
    rows: list[br.Row] = []
    rep_median = {e["point"]: e["median_s"] for e in measured if e["system"] == "replicated"}
    for e in sorted(measured, key=lambda e: (e["point"], SYSTEMS.index(e["system"]))):
        lay = session.layouts.get((e["point"], e["system"]))  # pp, auto: one stage's plan in the layout
        if lay is not None or e["system"].startswith("hybridep"):
            plan = session.chosen[(e["point"], e["system"])]
        else:
            plan = bp.system_plan(e["system"], shaped, cfg.model.num_experts)
        base = calib[(e["system"], e["plan"], e["point"])]
        eff = probes.get(e["point"], {}).get("efficiency", 1.0)
        pred = session.prediction(e["point"], e["system"], plan, base["median_s"], dense, eff, steady, lay,
                                  base["ranks"])
        rows.append(make_row(cfg, e, base, pred, ep_median[e["point"]], eff, rep_median.get(e["point"])))
    rows = with_auto_rows(rows, session)
    checks = br.check_targets(rows)
    write_outputs(cfg, rows, checks, session, elapsed_s, dense)
    return {"rows": rows, "checks": checks, "elapsed_s": elapsed_s}


def with_auto_rows(rows: list[br.Row], session: Session) -> list[br.Row]:
    """Where an auto layout (auto, auto-c) was a system measured at that point (not run again), that
    system's row as its own too, labelled with the layout and what it equals."""
    extra = []
    for key, same in sorted(session.info.get("same_as", {}).items(), key=lambda kv: SYSTEMS.index(kv[0].split()[1])):
        point, system = int(key.split()[0]), key.split()[1]
        row = next(r for r in rows + extra if r.point == point and r.system == same)
        lay = session.layouts[(point, system)]
        extra.append(dataclasses.replace(row, system=system, plan=f"PP{lay.pp} EP{lay.ep} (= {same})"))
    return sorted(rows + extra, key=lambda r: (r.point, SYSTEMS.index(r.system)))


def make_row(cfg: BenchConfig, e: dict[str, Any], base: dict[str, Any], pred: bp.Prediction,
             ep_median: float, a2a_efficiency: float, rep_median: float | None = None) -> br.Row:
    steps, r, b = e["step_s"], e["ranks"], base["ranks"]
    q1, q3 = br.quartiles(steps)
    link = e["link"]
    n, it = len(link), e["iters"]
    m = e.get("micro_batches", 1)
    P, ph = Phase, pred.phases
    a2a_fwd = r[f"{P.TOKEN_DISPATCH}_s"] + r[f"{P.TOKEN_COMBINE}_s"]
    payload = sum(r[f"{p}_dc_bytes"] for p in MEASURED)
    payload += r[f"{P.TOKEN_DISPATCH}_dc_bytes"] + r[f"{P.TOKEN_COMBINE}_dc_bytes"]  # backward: the transposes
    return br.Row(
        point=e["point"], tokens=e["tokens"], micro_batch=e["micro_batch"], seq=e["seq"],
        # EP's traffic at the same global batch (a layout with PP runs more micro-batches on fewer ranks)
        micro_batches=m, token_traffic_mb=bp.token_traffic_bytes(cfg.model, e["tokens"], cfg.micro_batches) / 1e6,
        system=e["system"], plan=e["plan"],
        iters=it, median_s=e["median_s"], min_s=min(steps), max_s=max(steps), q1_s=q1, q3_s=q3,
        speedup_vs_ep=ep_median / e["median_s"],
        speedup_vs_replicated=rep_median / e["median_s"] if rep_median else float("nan"),
        unshaped_s=base["median_s"], predicted_s=pred.total,
        pred_error_pct=(pred.total / e["median_s"] - 1) * 100, planner_s=pred.planner_total,
        a2a_efficiency=a2a_efficiency, pred_uncal_s=pred.uncalibrated_total,
        pred_uncal_error_pct=(pred.uncalibrated_total / e["median_s"] - 1) * 100,
        # column names are the recorded CSV's (pred_expert_gather_s: the expert all-gather)
        pred_token_a2a_s=ph[P.TOKEN_A2A], pred_expert_gather_s=ph[P.EXPERT_ALLGATHER],
        pred_grad_return_s=ph[P.GRAD_RETURN], pred_shared_sync_s=ph[P.SHARED_SYNC],
        pred_expert_grad_allreduce_s=ph[P.EXPERT_GRAD_ALLREDUCE],
        pred_dense_grad_allreduce_s=ph[P.DENSE_GRAD_ALLREDUCE], pred_pipeline_send_s=ph[P.PIPELINE_SEND],
        meas_a2a_fwd_s=a2a_fwd,
        pred_a2a_fwd_s=b[f"{P.TOKEN_DISPATCH}_s"] + b[f"{P.TOKEN_COMBINE}_s"] + ph[P.TOKEN_A2A] / 2,
        meas_gather_wait_s=r[f"{P.EXPERT_ALLGATHER}_s"],
        pred_gather_wait_s=b[f"{P.EXPERT_ALLGATHER}_s"] + ph[P.EXPERT_ALLGATHER],
        meas_grad_return_s=r[f"{P.GRAD_RETURN}_s"], pred_grad_return_full_s=b[f"{P.GRAD_RETURN}_s"] + ph[P.GRAD_RETURN],
        meas_grad_sync_s=r["grad_sync"],
        pred_grad_sync_s=b["grad_sync"] + ph[P.EXPERT_GRAD_ALLREDUCE] + ph[P.DENSE_GRAD_ALLREDUCE],
        wan_tx_mb=sum(c["tx_bytes"] for c in link) / n / it / 1e6,
        wan_rx_mb=sum(c["rx_bytes"] for c in link) / n / it / 1e6,
        pred_wan_mb=pred.dc_uplink_bytes / TCP_GOODPUT_FRACTION / 1e6,
        payload_dc_mb=payload / 1e6, loadavg=sum(e["loadavg"]) / 2,
        tcp_rto_per_it=sum(c.get("tcp_timeouts", math.nan) for c in link) / it,
        wan_busiest_mb=max(max(c["tx_bytes"], c["rx_bytes"]) for c in link) / it / 1e6)


def params_line(events: list[dict[str, Any]]) -> str:
    """The model's dense / expert parameter split, as the ranks of alltoall EP counted it."""
    m = next((e for e in events if e["event"] == "model" and e["system"] == "ep"), None)
    if m is None:
        return "parameters: not reported"
    experts = m["expert_params_per_rank"] * m["ep_size"]
    return (f"parameters: {m['dense_params']:,} dense + {experts:,} in experts "
            f"({m['expert_params_per_rank']:,} per rank at EP {m['ep_size']}): experts hold "
            f"{experts / (experts + m['dense_params']):.1%}")


def format_finalists(cfg: BenchConfig, finals: dict[str, dict[str, Any]]) -> list[str]:
    """auto's finalists per point: their planner and unshaped-based predictions, and the one run."""
    out = []
    for key, rec in sorted(finals.items(), key=lambda kv: (int(kv[0].split()[0]), kv[0])):
        point, system = int(key.split()[0]), key.split()[1]
        cands = ", ".join(f"{f['name']} {f['planner_s'] * 1e3:,.0f} / {f['predicted_s'] * 1e3:,.0f} ms"
                          f" ({_source(f)})" for f in rec.get("finalists", []))
        dropped = f"; not tried: {', '.join(rec['dropped'])}" if rec.get("dropped") else ""
        out.append(f"  {cfg.points[point]['tokens']} {system}: {cands} -> {rec.get('chosen')}{dropped}")
    if not out:
        return []
    return ["auto's finalists (planner / predicted from the measured unshaped step: the median of its trials' "
            "steps (the mean of their medians before 2026-12-02 16:00), run back to back with the others' in the "
            "order A B .. B A (\"trial\": one, runs before 2026-12-02 07:45); = the measured system whose row "
            "stands for it, and whose calibration it used where not trialled (runs before 2026-12-02); a tie "
            "within 3% on the trials goes to the planner's clearly faster; bench/finalists.py):",
            *out]


def _source(f: dict[str, Any]) -> str:
    """Where a finalist's unshaped step came from, as format_finalists prints it."""
    trial = f"{f['trials']} trials" if f.get("trials", 1) > 1 else "trial"
    if not f["same_as"]:
        return trial
    return f"{trial}, = {f['same_as']}" if f.get("trialled") else f"= {f['same_as']}"


def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, Linux {platform.release()}, torch CPU + gloo"


def write_outputs(cfg: BenchConfig, rows: list[br.Row], checks: list[br.TargetCheck], session: Session,
                  elapsed_s: float, dense_params: int) -> None:
    csv_path, png_path = cfg.out / "bench.csv", cfg.out / "bench.png"
    br.write_csv(rows, csv_path)
    title = (f"{br.systems_title(rows)}: {cfg.dcs} DCs x {cfg.ranks_per_dc} ranks, WAN {cfg.rate_text} "
             f"per DC, model {cfg.model.name}, {cfg.rounds * cfg.iters} iterations per point")
    br.plot(rows, png_path, title)
    probe = probe_summary(cfg, session.events)
    window = sum(r.wan_tx_mb * r.iters for r in rows)
    total = session.info["shaped_tx_bytes"] / cfg.dcs / 1e6
    summary = {
        "command": cfg.command(), "machine": machine(), "rate_mbit": cfg.rate_mbit,
        "goodput_mbit": cfg.rate_mbit * TCP_GOODPUT_FRACTION, "model": bp.recorded_model(cfg.model),
        "points": cfg.points, "elapsed_s": elapsed_s, "probe": {k: session.info[k] for k in
                                                                ("unshaped_wan_mbit", "intra_mbit")},
        "dense_params": dense_params,
        "hybridep_plans": session.info["chosen"], "planner_best_overall": session.info["planner_best"],
        "layouts": session.info.get("layouts", {}),  # pp's and auto's layout and stage plan per "point system"
        "same_as": session.info.get("same_as", {}),  # "point system" -> the system whose layout auto(-c) chose
        "finalists": session.info.get("finalists", {}),  # "point system" -> auto's finalists (bench/finalists.py)
        "overlap_grad_reduce": cfg.overlap_grad_reduce,
        "queue_ms": cfg.queue_ms, "congestion": cfg.congestion, "rto_min_ms": cfg.rto_min_ms,
        "grad_compression_ratio": cfg.grad_compression_ratio,
        "grad_values": cfg.grad_values,
        "early_grad_return": cfg.early_grad_return,
        "cpu_cores": cfg.cores,
        "targets": [c.__dict__ for c in checks],
        "link_counters_check_mb": {"timed_windows": window, "shaped_segments": total},
        "all_to_all_probe": probe,
    }
    (cfg.out / "summary.json").write_text(json.dumps(summary, indent=1))
    text = [
        f"machine: {summary['machine']}",
        f"testbed: {cfg.dcs} DCs x {cfg.ranks_per_dc} ranks, WAN {cfg.rate_text} per DC uplink "
        f"(TCP goodput {summary['goodput_mbit']:.1f} Mbit/s; queue "
        f"{f'{cfg.queue_ms:g} ms' if cfg.queue_ms else '1000 packets'}; TCP {cfg.congestion}"
        f"{f', minimum RTO {cfg.rto_min_ms:g} ms' if cfg.rto_min_ms else ''}), "
        f"model {cfg.model.name}, "
        f"{cfg.warmup} warm-up + {cfg.iters} timed iterations of {cfg.micro_batches} micro-batch(es) "
        + (f"in each of {cfg.rounds} rounds, the systems interleaved (rows pool the rounds) " if cfg.rounds > 1 else "")
        + f"(borrowed copies: {cfg.borrowed_copies})"
        + (f"; HybridEP-c: weights {cfg.compression_ratio:g}x, returned gradients {cfg.grad_compression_ratio:g}x "
           f"({cfg.grad_values} values)" + (f", the last micro-batch's share at {cfg.early_grad_return:g}x "
                                            "(--early-grad-return)" if cfg.early_grad_return else "")
           if "hybridep-compressed" in cfg.systems else ""),
        params_line(session.events),
        "", br.format_table(rows),
        "median of the timed iterations [min-max]; pred = cost-model prediction (WAN at the TCP goodput of the "
        "rate, token all-to-alls calibrated by a bare gloo all-to-all of the same size, below), "
        "err = (pred - measured) / measured; uncal = the error without that calibration; "
        "load = the machine's 1-minute load average around the "
        f"timed window ({os.cpu_count()} cores: above that, other jobs competed for them)", "",
        "per phase, ms per iteration (measured / predicted; a2a = forward dispatch + combine, the backward's "
        "transposes are not timed separately; WAN cost = shaped - unshaped step, which the prediction adds to "
        "the measured unshaped step: a measured one below 0 is that step's noise):",
        br.format_phases(rows), "",
        "planner's overall best per point and workload (its own cost model, replicated included): "
        + ", ".join(f"{cfg.points[int(k.split()[0])]['tokens']} {k.split()[1]}: {b}"
                    for k, b in sorted(session.info["planner_best"].items(), key=lambda kv: kv[0])),
        *format_finalists(cfg, session.info.get("finalists", {})),
        format_probe(cfg, probe),
        f"link counters: the timed windows hold {window:.1f} MB of the {total:.1f} MB per DC uplink (tx) sent while "
        "the WAN was shaped (the rest: warm-up)",
        "targets:", br.format_targets(checks), "",
        f"wrote {csv_path}, {png_path}, {cfg.out / 'summary.json'}; {elapsed_s:.0f} s",
        f"command: {cfg.command()}",
    ]
    (cfg.out / "report.txt").write_text("\n".join(text) + "\n")
    print("\n".join(text))
