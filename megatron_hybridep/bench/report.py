"""Output of `hybridep bench`: result rows, CSV, the printed table, the target check and the plot."""

from __future__ import annotations

import csv
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

SYSTEM_ORDER = ("ep", "replicated", "hybridep", "hybridep-compressed", "pp", "auto", "auto-c")
SYSTEM_LABEL = {"ep": "alltoall EP", "replicated": "replicated", "hybridep": "HybridEP",
                "hybridep-compressed": "HybridEP-c", "pp": "PP per DC", "auto": "auto layout",
                "auto-c": "auto-c layout"}
MEGATRON = ("ep", "replicated", "pp")  # what a Megatron user runs without hybridep
HYBRID = ("hybridep", "hybridep-compressed")
AUTO = ("auto", "auto-c")  # the layout planner's choice: exact, and with HybridEP-c's compression allowed
TARGET_FASTEST_SHARE = 0.9  # issue 25: the planner's choice is the fastest measured system at >= 90% of points
TARGET_TOP_SPEEDUP = 5.0
TARGET_LOW_SLOWDOWN = 0.05
TARGET_PRED_ERROR = 0.10  # issue 25: every system within 10%


@dataclass
class Row:
    """One system at one point (measured on the shaped testbed)."""

    point: int
    tokens: int
    micro_batch: int
    seq: int
    micro_batches: int  # per iteration (--micro-batches); tokens and micro_batch are per micro-batch
    token_traffic_mb: float  # EP's token bytes one rank dispatches per iteration (all all-to-alls)
    system: str
    plan: str
    iters: int
    median_s: float
    min_s: float
    max_s: float
    q1_s: float
    q3_s: float
    speedup_vs_ep: float
    speedup_vs_replicated: float  # replicated median / this median (nan without a replicated run)
    unshaped_s: float  # same system/plan, unshaped testbed (the prediction's base)
    predicted_s: float
    pred_error_pct: float  # (predicted - measured) / measured
    planner_s: float  # the cost model's own total (its overlap assumptions, compute from T_pre only)
    a2a_efficiency: float  # the bare gloo all-to-all probe's of EP's size (bench/probes.py)
    pred_uncal_s: float  # predicted_s with the token all-to-alls at the TCP goodput (no probe calibration)
    pred_uncal_error_pct: float
    pred_token_a2a_s: float
    pred_expert_gather_s: float
    pred_grad_return_s: float
    pred_shared_sync_s: float
    pred_expert_grad_allreduce_s: float
    pred_dense_grad_allreduce_s: float
    pred_pipeline_send_s: float  # what the shaped WAN adds to the pipeline's activation / gradient sends
    meas_a2a_fwd_s: float  # dispatch + combine, forward only (instrumented); backward is not timed
    pred_a2a_fwd_s: float  # unshaped measured + half of the predicted token all-to-all time
    meas_gather_wait_s: float
    pred_gather_wait_s: float
    meas_grad_return_s: float
    pred_grad_return_full_s: float  # unshaped measured + predicted
    meas_grad_sync_s: float  # Megatron's finalize_model_grads: dense + expert-data-parallel all-reduces
    pred_grad_sync_s: float
    wan_tx_mb: float  # per DC uplink and iteration, leaving the DC (link counters, wire bytes)
    wan_rx_mb: float
    pred_wan_mb: float  # predicted wire bytes through the busiest DC uplink, one direction, per iteration
    payload_dc_mb: float  # token/expert payload to other DCs per rank and iteration (instrumented)
    loadavg: float  # the machine's 1-minute load average around the timed window (cores are shared)
    tcp_rto_per_it: float = float("nan")  # TCP retransmission timeouts per iteration, all DCs (runs before: nan)
    # the busiest DC uplink's busier direction per iteration (link counters): what pred_wan_mb predicts
    # (a middle pipeline stage sends twice an end stage's bytes, so the mean over uplinks is not)
    wan_busiest_mb: float = float("nan")


def quartiles(xs: Sequence[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def write_csv(rows: Sequence[Row], path: Path) -> None:
    names = [f.name for f in fields(Row)]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=names)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in asdict(r).items()})


def _ms(s: float) -> str:
    return f"{s * 1e3:,.0f}" if s < 10 else f"{s:,.1f}s"


def _signed_ms(s: float) -> str:
    return ("-" if s < 0 else "+") + _ms(abs(s))


def format_table(rows: Sequence[Row]) -> str:
    head = (f"{'pt':>2} {'tokens':>6} {'traffic':>8}  {'system':<11} {'plan':<17} {'median ms':>9} "
            f"{'[min-max]':>13} {'vs EP':>6} {'pred ms':>8} {'err':>6} {'uncal':>6}  {'WAN MB/it tx/rx':>15} "
            f"{'load':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        spread = f"[{_ms(r.min_s)}-{_ms(r.max_s)}]"
        lines.append(
            f"{r.point:>2} {r.tokens:>6} {r.token_traffic_mb:>6.1f}MB  {SYSTEM_LABEL[r.system]:<11} {r.plan:<17} "
            f"{_ms(r.median_s):>9} {spread:>13} {r.speedup_vs_ep:>5.2f}x {_ms(r.predicted_s):>8} "
            f"{r.pred_error_pct:>+5.1f}% {r.pred_uncal_error_pct:>+5.1f}%  {r.wan_tx_mb:>7.2f}/{r.wan_rx_mb:<7.2f} "
            f"{r.loadavg:>5.1f}")
    return "\n".join(lines)


def format_phases(rows: Sequence[Row]) -> str:
    """Predicted vs measured per phase (ms per iteration)."""
    head = (f"{'pt':>2} {'system':<11} {'a2a fwd meas/pred':>18} {'gather wait m/p':>16} "
            f"{'grad return m/p':>16} {'grad all-reduce m/p':>20} {'busiest MB m/p':>14} {'TCP RTO/it':>10} "
            f"{'WAN cost m/p':>15}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.point:>2} {SYSTEM_LABEL[r.system]:<11} "
            f"{_ms(r.meas_a2a_fwd_s):>8} /{_ms(r.pred_a2a_fwd_s):>8} "
            f"{_ms(r.meas_gather_wait_s):>7} /{_ms(r.pred_gather_wait_s):>7} "
            f"{_ms(r.meas_grad_return_s):>7} /{_ms(r.pred_grad_return_full_s):>7} "
            f"{_ms(r.meas_grad_sync_s):>9} /{_ms(r.pred_grad_sync_s):>9} "
            f"{r.wan_busiest_mb:>6.2f}/{r.pred_wan_mb:<6.2f} {r.tcp_rto_per_it:>10.1f} "
            f"{_signed_ms(r.median_s - r.unshaped_s):>7}/{_signed_ms(r.predicted_s - r.unshaped_s):<7}")
    return "\n".join(lines)


@dataclass
class TargetCheck:
    name: str
    ok: bool
    detail: str


def check_targets(rows: Sequence[Row]) -> list[TargetCheck]:
    """The issue's targets, for each HybridEP variant that ran."""
    by = {(r.point, r.system): r for r in rows}
    points = sorted({r.point for r in rows})
    out: list[TargetCheck] = []
    if not points:
        return out
    lo, hi = points[0], points[-1]
    for system in HYBRID:
        name = SYSTEM_LABEL[system]
        if (hi, system) in by and (hi, "ep") in by:
            s = by[(hi, system)].speedup_vs_ep
            out.append(TargetCheck(f"top point: {name} >= {TARGET_TOP_SPEEDUP:g}x faster than EP",
                                   s >= TARGET_TOP_SPEEDUP, f"{s:.2f}x"))
        if (hi, system) in by and (hi, "replicated") in by:
            h, rep = by[(hi, system)].median_s, by[(hi, "replicated")].median_s
            out.append(TargetCheck(f"top point: {name} faster than replicated", h < rep,
                                   f"{rep / h:.3f}x ({_ms(h)} vs {_ms(rep)} ms)"))
        if (lo, system) in by and (lo, "ep") in by:
            h, ep = by[(lo, system)].median_s, by[(lo, "ep")].median_s
            out.append(TargetCheck(f"lowest point: {name} at most {TARGET_LOW_SLOWDOWN:.0%} slower than EP",
                                   h <= ep * (1 + TARGET_LOW_SLOWDOWN), f"{(h / ep - 1) * 100:+.1f}% vs EP"))
    out += layout_targets(rows)
    worst = max(rows, key=lambda r: abs(r.pred_error_pct))
    misses = [r for r in rows if abs(r.pred_error_pct) > TARGET_PRED_ERROR * 100]
    # the prediction adds the WAN's cost to the system's measured unshaped step: where the shaped step
    # measured below it, the cost hid entirely (independent pipelines on shared cores fill each other's
    # waits) or that step's noise is larger than the cost
    noisy = sum(r.median_s < r.unshaped_s for r in misses)
    within = f"{len(rows) - len(misses)}/{len(rows)} within"
    out.append(TargetCheck(f"predicted step within {TARGET_PRED_ERROR:.0%} of measured at every point",
                           not misses, f"{within}; worst {worst.pred_error_pct:+.1f}% "
                           f"({SYSTEM_LABEL[worst.system]}, point {worst.point})"
                           + (f"; {noisy} of the {len(misses)} misses measured faster shaped than unshaped "
                              "(the WAN's cost hidden, or the unshaped step's noise)" if noisy else "")))
    return out


def layout_targets(rows: Sequence[Row]) -> list[TargetCheck]:
    """Issue 25's: against the best Megatron layout measured at each point (ep, replicated, pp), where
    HybridEP wins and where it loses; and the layout planner's choice against the fastest system."""
    out: list[TargetCheck] = []
    points = sorted({r.point for r in rows})
    for system in (*HYBRID, *AUTO):
        pairs = []
        for p in points:
            mine = next((r for r in rows if r.point == p and r.system == system), None)
            base = [r for r in rows if r.point == p and r.system in MEGATRON]
            if mine and base:
                best = min(base, key=lambda r: r.median_s)
                pairs.append((p, best.median_s / mine.median_s, best.system))
        if pairs and (system not in AUTO or any(s == "pp" for _, _, s in pairs)):
            wins = sum(x >= 1 for _, x, _ in pairs)
            detail = ", ".join(f"pt {p}: {x:.2f}x vs {SYSTEM_LABEL[s]}" for p, x, s in pairs)
            out.append(TargetCheck(f"{SYSTEM_LABEL[system]} vs the best Megatron layout measured", wins == len(pairs),
                                   f"faster at {wins}/{len(pairs)} points ({detail})"))
    # auto chooses among exact systems (compression changes the training: the user opts in), so it
    # is held against the fastest exact one, and against every system beside it; auto-c (compression
    # allowed) against every system
    for system, name, pool in (("auto", "exact", lambda s: s not in (*AUTO, "hybridep-compressed")),
                               ("auto", "other", lambda s: s not in AUTO),
                               ("auto-c", "other", lambda s: s not in AUTO)):
        mine = [r for r in rows if r.system == system]
        if not mine or not any(pool(x.system) for x in rows):
            continue
        close = fastest_at = 0
        for r in mine:
            fastest = min((x.median_s for x in rows if x.point == r.point and pool(x.system)), default=r.median_s)
            close += r.median_s <= 1.05 * fastest
            fastest_at += r.median_s <= fastest
        label = SYSTEM_LABEL[system]
        out.append(TargetCheck(f"{label} within 5% of the fastest {name} system at every point",
                               close == len(mine), f"{close}/{len(mine)} points"))
        out.append(TargetCheck(f"{label} the fastest {name} system at >= {TARGET_FASTEST_SHARE:.0%} of points",
                               fastest_at >= TARGET_FASTEST_SHARE * len(mine), f"{fastest_at}/{len(mine)} points"))
    return out


def format_targets(checks: Sequence[TargetCheck]) -> str:
    return "\n".join(f"  [{'met' if c.ok else 'MISSED'}] {c.name}: {c.detail}" for c in checks)


def systems_title(rows: Sequence[Row]) -> str:
    """'HybridEP vs alltoall EP ...': the systems these rows measured, in the report's order."""
    return " vs ".join(SYSTEM_LABEL[s] for s in SYSTEM_ORDER if any(r.system == s for r in rows))


def _log_ticks(axis: object, lo: float, hi: float) -> None:
    """Plain-number labels on a log axis (1-9 under half a decade, 1-2-3-5 within one, 1-2-5 up to
    three, else decades only) and no minor labels: matplotlib's default labels minor ticks as 2x10^-1,
    3x10^-1, ..., which collide when the data span under a decade."""
    import math

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    decades = math.log10(hi / lo) if lo > 0 and hi > lo else 0.0
    subs = (tuple(float(i) for i in range(1, 10)) if decades < 0.5 else (1.0, 2.0, 3.0, 5.0) if decades <= 1
            else (1.0, 2.0, 5.0) if decades <= 3 else (1.0,))
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def plot(rows: Sequence[Row], path: Path, title: str) -> None:
    """Step time, speedup vs EP and WAN bytes against token traffic per rank (measured: markers with
    min-max bars; predicted: dashed)."""
    import matplotlib

    matplotlib.use("Agg")  # no display; set before pyplot is imported
    import matplotlib.pyplot as plt

    systems = [s for s in SYSTEM_ORDER if any(r.system == s for r in rows)]
    colors = {"ep": "tab:red", "replicated": "tab:blue", "hybridep": "tab:green", "hybridep-compressed": "tab:purple",
              "pp": "tab:orange", "auto": "tab:brown", "auto-c": "tab:pink"}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for s in systems:
        rs = sorted((r for r in rows if r.system == s), key=lambda r: r.point)
        x = [r.token_traffic_mb for r in rs]
        med = [r.median_s for r in rs]
        err = [[r.median_s - r.min_s for r in rs], [r.max_s - r.median_s for r in rs]]
        c, label = colors[s], SYSTEM_LABEL[s]
        axes[0].errorbar(x, med, yerr=err, fmt="o-", color=c, label=f"{label} measured", capsize=3)
        axes[0].plot(x, [r.predicted_s for r in rs], "--", color=c, label=f"{label} predicted")
        if s != "ep":
            axes[1].plot(x, [r.speedup_vs_ep for r in rs], "o-", color=c, label=f"{label} measured")
            ep = {r.point: r for r in rows if r.system == "ep"}
            pred = [ep[r.point].predicted_s / r.predicted_s for r in rs if r.point in ep]
            axes[1].plot([r.token_traffic_mb for r in rs if r.point in ep], pred, "--", color=c,
                         label=f"{label} predicted")
        axes[2].plot(x, [r.wan_busiest_mb for r in rs], "o-", color=c, label=f"{label} link counters")
        axes[2].plot(x, [r.pred_wan_mb for r in rs], "--", color=c, label=f"{label} predicted")
    axes[0].set(xscale="log", yscale="log", xlabel="token traffic per rank per iteration (MB, EP)",
                ylabel="step time (s)", title="step time")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].axhline(TARGET_TOP_SPEEDUP, color="grey", lw=0.8, ls=":")
    axes[1].set(xscale="log", xlabel="token traffic per rank per iteration (MB, EP)", ylabel="speedup vs EP",
                title="speedup over cross-DC alltoall EP")
    axes[2].set(xscale="log", yscale="log", xlabel="token traffic per rank per iteration (MB, EP)",
                ylabel="MB through the busiest DC uplink per iteration", title="inter-DC bytes (one direction)")
    for ax in axes:
        for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            if axis.get_scale() == "log":
                _log_ticks(axis, lo, hi)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
