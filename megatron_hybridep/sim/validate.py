"""Check the simulator against measurements: the testbed benchmark's CSV, and the paper's closed form.

Two CSV layouts are read.

1. `hybridep bench` output (megatron_hybridep/bench/cli.py): ``bench.csv`` with one row per
   system and point (system, plan, tokens, micro_batch, seq, median_s, unshaped_s, ...) and
   ``summary.json`` beside it (command with --dcs/--ranks-per-dc, rate_mbit, goodput_mbit, model,
   probe.unshaped_wan_mbit / probe.intra_mbit). The bench measures every system twice: WAN shaped
   and unshaped. The CSV carries no compute times, so the unshaped step calibrates them
   (``calibrate``): the compute estimate is scaled until the simulated unshaped step equals the
   measured one, then the shaped testbed is simulated with it (method ``calibrated``, default).
   Method ``difference`` is the bench's own: measured unshaped + sim(shaped) - sim(unshaped). Like
   the bench, the dense gradients (``dense_params`` in summary.json, else estimated from the model)
   are all-reduced over all ranks; ``hybridep-compressed`` rows ship weights and return gradients at
   the command's ``--compression-ratio``. Transport calibration, as the bench's prediction does it:
   where summary.json has the all-to-all probe of a point (the share of the shaped rate a bare
   gloo all-to-all of that size got), the token all-to-alls of plans whose rails cross DCs are
   charged at that share (their simulated time / efficiency; they block and nothing shares their
   links); ``Comparison.uncalibrated`` is the simulation without it.

2. A self-contained CSV (the column contract below), one row per point, for any other harness.
   Column names are matched case-insensitively; aliases in brackets.

  required  system          ep | hybridep | hybridep-compressed | replicated
            dcs             emulated DCs                       [num_dcs]
            ranks_per_dc    ranks in each DC                   [local_world_size]
            wan_gbps        shaped rate of every DC uplink     [rate_gbps; rate_mbit / 1000]
            hidden_size, ffn_hidden_size, num_experts, num_layers (all MoE), seq_length,
            micro_batch_size                                   [micro_batch]
            step_s          measured step time, median          [median_s]
  optional  top_k [topk] (2); wan_delay_ms [delay_ms] (0): one-way delay added on DC egress;
            domain_sizes "2x1" per plan level (hybridep; else parsed from the plan label [plan]);
            intra_gbps (20) and intra_latency_us (10): ranks of one DC (loopback, unshaped);
            bytes_per_element (4, fp32 on CPU); micro_batches (1);
            t_pre_s, expert_fwd_s, expert_rows: measured per step (bench/worker's PhaseTimer, summed
            over layers, mean over ranks): the simulator then uses the measured compute instead of
            an estimate from throughput_tflops (default 0.05 TFLOP/s, a CPU core);
            dense_params: dense parameters all-reduced (fp32) over all ranks after the backward;
            compression_ratio (1): weights and returned gradients (hybridep-compressed);
            grad_value_bytes (0: the gradient's own; 2: bf16, the runtime's default since 2026-11-26);
            a2a_efficiency (1): share of the WAN rate the token all-to-all gets (see layout 1);
            unshaped_s: the same point measured without WAN shaping (then the difference method
            of layout 1 is used, with unshaped_wan_gbps (default 10) as the unshaped WAN rate).

The topology of a row: DC level with the WAN rate as the DC uplink (the testbed shapes each DC's veth
in both directions; the bridge between DCs is not a limit) and the delay as latency; inside a DC
one level of ``ranks_per_dc`` at intra_gbps. Pass: |simulated / measured - 1| <= tolerance (15%).

The closed form: :func:`stream_model_exact` is the paper's T(p) = max(T_pre, AG) + 2 A2A with the
bytes an all-gather and an all-to-all really move; the paper's own formula (plan/paper_model.py)
charges (1-p)(G-1)P for the gather (exact at S = G) and p(G-1)D/G for the all-to-all ((G-1)/G of
the true pD). tests/sim/test_closed_form.py checks the simulator against both.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.phases import Phase
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.topology import Level, Topology
from megatron_hybridep.plan.workload import Workload
from megatron_hybridep.sim.schedule import SimOptions
from megatron_hybridep.sim.simulate import simulate

TOLERANCE = 0.15
ALIASES = {"num_dcs": "dcs", "local_world_size": "ranks_per_dc", "rate_gbps": "wan_gbps", "topk": "top_k",
           "median_s": "step_s", "delay_ms": "wan_delay_ms", "micro_batch": "micro_batch_size"}
REQUIRED = ("system", "dcs", "ranks_per_dc", "wan_gbps", "hidden_size", "ffn_hidden_size", "num_experts",
            "num_layers", "seq_length", "micro_batch_size", "step_s")


# ---- the closed form ---------------------------------------------------------------------------------------
def stream_model_exact(G: int, S: int, D: float, P: float, B: float, t_pre: float) -> float:
    """Forward time of one MoE layer (no expert compute): max(T_pre, (S-1)P/B) + 2 (1 - S/G) D / B."""
    return max(t_pre, (S - 1) * P / B) + 2 * (1 - S / G) * D / B


# ---- testbed CSV ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchPoint:
    row: int
    system: str
    topology: Topology
    workload: Workload
    plan: Plan
    measured: float
    dense_grad_bytes: float
    label: str
    unshaped: float | None = None            # measured step time without WAN shaping
    unshaped_topology: Topology | None = None
    a2a_efficiency: float = 1.0              # share of the WAN rate the token all-to-all gets (measured)
    steady_efficiency: float = 1.0           # the same for all-to-alls of >= STEADY_S (pooled probes)


@dataclass(frozen=True)
class Comparison:
    point: BenchPoint
    simulated: float
    uncalibrated: float = math.nan           # without the all-to-all calibration

    @property
    def error(self) -> float:
        return self.simulated / self.point.measured - 1

    def ok(self, tolerance: float = TOLERANCE) -> bool:
        return abs(self.error) <= tolerance


def _norm(row: dict[str, str]) -> dict[str, str]:
    out = {}
    for k, v in row.items():
        if k is None:
            continue
        key = k.strip().lower()
        key = ALIASES.get(key, key)
        if key == "rate_mbit" and v not in ("", None):
            out.setdefault("wan_gbps", str(float(v) / 1000))
            continue
        out.setdefault(key, (v or "").strip())
    return out


def _num(row: dict[str, str], key: str, where: str, default: float | None = None) -> float:
    raw = row.get(key, "")
    if raw == "":
        if default is None:
            raise PlanError(f"{where}.{key}: missing; fix: add a '{key}' column (see sim/validate.py for the "
                            "column contract)")
        return default
    try:
        v = float(raw)
    except ValueError:
        raise PlanError(f"{where}.{key}: expected a number, got {raw!r}") from None
    if not math.isfinite(v) or v < 0:
        raise PlanError(f"{where}.{key}: expected a finite number >= 0, got {raw!r}")
    return v


def bench_topology(dcs: int, ranks_per_dc: int, wan_gbps: float, delay_ms: float = 0.0, intra_gbps: float = 20.0,
                   intra_latency_us: float = 10.0) -> Topology:
    # the bridge between DC namespaces is no limit: give the DC-to-DC link the uplink's rate
    dc = Level("dc", dcs, wan_gbps, delay_ms * 1e3, wan_gbps)
    gpu = Level("gpu", ranks_per_dc, intra_gbps, intra_latency_us)
    return Topology((dc, gpu), f"testbed {dcs}x{ranks_per_dc}", "emulated DCs (netns + tc)")


def plan_for(system: str, topo: Topology, num_experts: int, domain_sizes: str, label: str, where: str) -> Plan:
    lay = topo.ep_layout(topo.world_size)
    if system == "ep":
        return Plan("domains", lay.names, lay.counts, (1,) * len(lay.counts), num_experts)
    if system == "replicated":
        return Plan.replicated(lay.counts, num_experts, lay.names)
    if system not in ("hybridep", "hybridep-compressed"):
        raise PlanError(f"{where}.system: unknown {system!r}; fix: ep, hybridep, hybridep-compressed or replicated")
    sizes: list[int] | None = None
    if domain_sizes:
        sizes = [int(x) for x in domain_sizes.replace(",", "x").split("x") if x]
    elif label.startswith("domains "):
        got = {}
        for part in label.split()[1:]:
            for n in lay.names:
                if part.startswith(n) and part[len(n):].isdigit():
                    got[n] = int(part[len(n):])
        sizes = [got.get(n, 1) for n in lay.names]
    elif label.startswith("ep"):
        sizes = [1] * len(lay.counts)
    if sizes is None or len(sizes) != len(lay.counts):
        raise PlanError(f"{where}.domain_sizes: need one S per level {list(lay.names)} (e.g. '2x1') for a hybridep "
                        f"row, got {domain_sizes or label!r}; fix: add a domain_sizes column")
    return Plan("domains", lay.names, lay.counts, tuple(sizes), num_experts)


def read_bench_csv(path: str) -> list[BenchPoint]:
    """Points of a `hybridep bench` CSV (with its summary.json) or of a self-contained CSV."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = [_norm(r) for r in csv.DictReader(f)]
    except FileNotFoundError:
        raise PlanError(f"{path}: benchmark CSV not found; fix: run 'hybridep bench' (it writes bench.csv) "
                        "or pass a CSV with the columns of sim/validate.py") from None
    if not rows:
        raise PlanError(f"{path}: no rows; fix: pass the CSV that 'hybridep bench' wrote")
    summary = os.path.join(os.path.dirname(os.path.abspath(path)), "summary.json")
    if "dcs" not in rows[0] and os.path.exists(summary):
        return _bench_points(rows, path, summary)
    missing = [k for k in REQUIRED if k not in rows[0]]
    if missing:
        raise PlanError(f"{path}: missing column(s) {', '.join(missing)}; fix: see the column contract in "
                        "megatron_hybridep/sim/validate.py (or keep summary.json beside a bench.csv)")
    return [_point(r, f"{path}:{i + 2}", i) for i, r in enumerate(rows)]


def dense_params_estimate(model: dict[str, Any]) -> float:
    """Dense (data-parallel) parameters of the bench's GPT-MoE when summary.json does not give them:
    tied embedding, per layer QKV + projection, two layer norms and the router, final norm."""
    h, layers, E = int(model["hidden_size"]), int(model["num_layers"]), int(model["num_experts"])
    vocab = int(model.get("vocab_size", 256))
    return float(vocab * h + layers * (4 * h * h + 3 * h + 2 * 2 * h + h * E) + 2 * h)


def _bench_points(rows: list[dict[str, str]], path: str, summary_path: str) -> list[BenchPoint]:
    with open(summary_path, encoding="utf-8") as f:
        summary = json.load(f)
    where = summary_path
    try:
        argv = shlex.split(summary["command"])
        model = summary["model"]
        rate = float(summary.get("goodput_mbit") or summary["rate_mbit"])
        probe = summary.get("probe", {})
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(f"{where}: not a `hybridep bench` summary ({exc}); fix: keep the summary.json the bench "
                        "wrote beside its bench.csv") from None

    def flag(name: str, default: int) -> int:
        return int(argv[argv.index(name) + 1]) if name in argv else default

    dcs, rpd = flag("--dcs", 2), flag("--ranks-per-dc", 2)
    ratio = float(argv[argv.index("--compression-ratio") + 1]) if "--compression-ratio" in argv else 1.0
    probes = summary.get("all_to_all_probe", {})
    intra = float(probe.get("intra_mbit", 2e4)) / 1e3
    shaped = bench_topology(dcs, rpd, rate / 1e3, 0.0, intra, 0.0)
    unshaped = bench_topology(dcs, rpd, float(probe.get("unshaped_wan_mbit", 1e4)) / 1e3, 0.0, intra, 0.0)
    layers = int(model["num_layers"])
    dense = float(summary.get("dense_params") or dense_params_estimate(model)) * 4  # fp32 grad buffers
    copies = argv[argv.index("--borrowed-copies") + 1] if "--borrowed-copies" in argv else "auto"
    steady = [float(v["efficiency"]) for v in probes.values() if float(v.get("ideal_s", 0.0)) >= STEADY_S]
    steady = steady[0] if steady else 1.0
    out = []
    for i, r in enumerate(rows):
        w = f"{path}:{i + 2}"
        mbs, seq = int(_num(r, "micro_batch_size", w)), int(_num(r, "seq", w))
        work = Workload(hidden_size=int(model["hidden_size"]), ffn_hidden_size=int(model["ffn_hidden_size"]),
                        num_experts=int(model["num_experts"]), top_k=int(model.get("topk", 2)),
                        num_moe_layers=layers, num_layers=layers, seq_length=seq, micro_batch_size=mbs,
                        activation_bytes=4, weight_bytes=4, grad_bytes=4, throughput_tflops=0.05,
                        name=str(model.get("name", "bench")), micro_batches=int(_num(r, "micro_batches", w, 1)),
                        backend="gloo",
                        borrowed_copies=copies)
        system = r["system"].lower()
        if system == "hybridep-compressed":
            # recorded before bf16 gradient values: the gradient's fp32
            work = work.replace(compression_ratio=ratio, grad_compression_ratio=ratio, grad_value_bytes=0)
        plan = plan_for(system, shaped, work.num_experts, r.get("domain_sizes", ""), r.get("plan", ""), w)
        label = f"{system} {plan.label if system.startswith('hybridep') else ''} tokens={mbs * seq}"
        eff = float(probes.get(r.get("point", ""), {}).get("efficiency", 1.0))
        out.append(BenchPoint(i, system, shaped, work, plan, _num(r, "step_s", w), dense, " ".join(label.split()),
                              _num(r, "unshaped_s", w), unshaped, eff, steady))
    return out


def _point(r: dict[str, str], where: str, i: int) -> BenchPoint:
    system = r["system"].lower()
    dcs, rpd = int(_num(r, "dcs", where)), int(_num(r, "ranks_per_dc", where))
    topo = bench_topology(dcs, rpd, _num(r, "wan_gbps", where), _num(r, "wan_delay_ms", where, 0.0),
                          _num(r, "intra_gbps", where, 20.0), _num(r, "intra_latency_us", where, 10.0))
    layers = int(_num(r, "num_layers", where))
    mbs, seq = int(_num(r, "micro_batch_size", where)), int(_num(r, "seq_length", where))
    nbytes = int(_num(r, "bytes_per_element", where, 4))
    kw: dict[str, Any] = dict(
        hidden_size=int(_num(r, "hidden_size", where)), ffn_hidden_size=int(_num(r, "ffn_hidden_size", where)),
        num_experts=int(_num(r, "num_experts", where)), top_k=int(_num(r, "top_k", where, 2)),
        num_moe_layers=layers, num_layers=layers, seq_length=seq, micro_batch_size=mbs,
        micro_batches=int(_num(r, "micro_batches", where, 1)), activation_bytes=nbytes, weight_bytes=nbytes,
        grad_bytes=nbytes, throughput_tflops=_num(r, "throughput_tflops", where, 0.05), backend="gloo")
    ratio = _num(r, "compression_ratio", where, 1.0)
    if ratio > 1:
        kw.update(compression_ratio=ratio, grad_compression_ratio=ratio,
                  grad_value_bytes=int(_num(r, "grad_value_bytes", where, 0)))
    work = Workload(**kw)
    t_pre = _num(r, "t_pre_s", where, -1.0)
    if t_pre > 0:
        work = work.replace(t_pre_ms=t_pre / layers * 1e3)
    fwd, rows_ = _num(r, "expert_fwd_s", where, -1.0), _num(r, "expert_rows", where, -1.0)
    if fwd > 0 and rows_ > 0:
        # seconds per token copy -> an equivalent throughput for Workload.expert_seconds_per_token
        work = work.replace(throughput_tflops=work.expert_flops_per_token / (fwd / rows_) / 1e12)
    plan = plan_for(system, topo, work.num_experts, r.get("domain_sizes", ""), r.get("plan", ""), where)
    dense = _num(r, "dense_params", where, 0.0) * 4  # grad_reduce_in_fp32
    label = f"{system} {plan.label if system.startswith('hybridep') else ''} {dcs}x{rpd} @{r['wan_gbps']}G " \
            f"tokens={mbs * seq}"
    unshaped = _num(r, "unshaped_s", where, -1.0)
    base = None
    if unshaped > 0:
        base = bench_topology(dcs, rpd, _num(r, "unshaped_wan_gbps", where, 10.0), 0.0,
                              _num(r, "intra_gbps", where, 20.0), _num(r, "intra_latency_us", where, 10.0))
    eff = _num(r, "a2a_efficiency", where, 1.0)
    if not eff > 0:
        raise PlanError(f"{where}.a2a_efficiency: must be > 0, got {eff}")
    return BenchPoint(i, system, topo, work, plan, _num(r, "step_s", where), dense, " ".join(label.split()),
                      unshaped if unshaped > 0 else None, base, eff)


METHODS = ("calibrated", "difference")
STEADY_S = 0.05  # as the bench's prediction: all-to-alls this long get the pooled (steady-state) share


def calibrate(p: BenchPoint, options: SimOptions) -> Workload:
    """The point's workload with its compute scaled so that the simulated *unshaped* step equals the
    measured one: everything the unshaped run spends outside the (near-free) network is compute (and
    framework time) in the same proportions as the estimate - and, like compute, it hides gathers."""
    assert p.unshaped is not None and p.unshaped_topology is not None
    r = simulate(p.unshaped_topology, p.workload, p.plan, options=options)
    compute = r.phases[Phase.PRE_COMPUTE] + r.phases[Phase.EXPERT_COMPUTE]
    k = max(p.unshaped - (r.total - compute), 0.0) / compute if compute > 0 else 1.0
    w = p.workload
    return w.replace(t_pre_ms=w.t_pre * k * 1e3, throughput_tflops=w.throughput_tflops / k if k > 0 else 1e9)


def compare(points: Sequence[BenchPoint], options: SimOptions | None = None,
            method: str = "calibrated") -> list[Comparison]:
    """Simulate every point. With an unshaped measurement: ``calibrated`` (default) fits the compute to
    it and simulates the shaped testbed; ``difference`` adds sim(shaped) - sim(unshaped) to it (the
    bench's own method). Without one: the workload as given (measured or estimated compute)."""
    if method not in METHODS:
        raise PlanError(f"method: unknown {method!r}; fix: use one of {', '.join(METHODS)}")
    out = []
    for p in points:
        opts = options or SimOptions()
        if p.dense_grad_bytes:
            opts = dataclasses.replace(opts, dense_grad_bytes=p.dense_grad_bytes)
        if p.unshaped is None or p.unshaped_topology is None:
            shaped = simulate(p.topology, p.workload, p.plan, options=opts)
            sim = shaped.total
        elif method == "calibrated":
            shaped = simulate(p.topology, calibrate(p, opts), p.plan, options=opts)
            sim = shaped.total
        else:
            shaped = simulate(p.topology, p.workload, p.plan, options=opts)
            sim = p.unshaped + shaped.total - simulate(p.unshaped_topology, p.workload, p.plan, options=opts).total
        extra = 0.0
        if p.a2a_efficiency != 1.0 and rails_cross_dcs(p.plan):
            a2a = shaped.phases[Phase.TOKEN_A2A_FWD] + shaped.phases[Phase.TOKEN_A2A_BWD]
            extra = (1 / p.a2a_efficiency - 1) * a2a
        ret = shaped.phases.get(Phase.GRAD_RETURN, 0.0)
        if p.steady_efficiency != 1.0 and domains_cross_dcs(p.plan) and ret >= STEADY_S:
            extra += (1 / p.steady_efficiency - 1) * ret  # on gloo the return is an all-to-all too
        out.append(Comparison(p, sim + extra, sim))
    return out


def domains_cross_dcs(plan: Plan) -> bool:
    """Whether the plan's domains (expert gathers, gradient returns) span DCs (level 0)."""
    return plan.kind == "domains" and plan.domain_sizes[0] > 1


def rails_cross_dcs(plan: Plan) -> bool:
    """Whether the plan's token all-to-alls cross the DC level (level 0)."""
    if plan.kind != "domains":
        return False  # replicated: EP inside each DC
    return plan.domain_sizes[0] < plan.level_counts[0]


def format_comparison(comps: Sequence[Comparison], tolerance: float = TOLERANCE) -> str:
    heads = ["row", "point", "measured", "simulated", "error", "", "a2a eff", "uncalibrated"]
    rows = [heads] + [[str(c.point.row + 2), c.point.label, f"{c.point.measured:.4g} s", f"{c.simulated:.4g} s",
                       f"{c.error:+.1%}", "ok" if c.ok(tolerance) else "OFF",
                       f"{c.point.a2a_efficiency:.2f}" if c.simulated != c.uncalibrated else "-",
                       f"{c.uncalibrated / c.point.measured - 1:+.1%}"] for c in comps]
    widths = [max(len(r[i]) for r in rows) for i in range(len(heads))]
    lines = ["  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    bad = sum(not c.ok(tolerance) for c in comps)
    lines.append(f"{len(comps) - bad}/{len(comps)} points within {tolerance:.0%} of measured")
    return "\n".join(lines)
